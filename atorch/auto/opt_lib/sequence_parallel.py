"""sequence_parallel: with tensor_parallel, shard the norm / dropout regions on the sequence dimension.

The residual stream between the split attention and MLP projections is kept as a sequence shard, so
activations there (norm inputs and outputs, residual sums) take 1/tensor of the memory; the
all-reduce of plain tensor parallelism becomes a reduce-scatter plus an all-gather of the same
volume. Applied by tensor_parallel's wrapper (``atorch.auto.opt_lib.tensor_parallel``), on models
whose repeated blocks hold norms and the split attention / MLP as direct children (the repo GPT,
Megatron-style blocks). Needs ``tensor_parallel`` in the strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atorch.auto.opt_lib.base import Optimization
from atorch.utils.config import MethodConfig


@dataclass(frozen=True)
class SequenceParallelConfig(MethodConfig):
    """No options: sequence sharding follows the tensor dimension of parallel_mode."""


class SequenceParallelOptimization(Optimization):
    name = "sequence_parallel"
    distributed_only = True
    config_class = SequenceParallelConfig

    def normalize(self, config: Any) -> SequenceParallelConfig:
        """Also accepts True (on)."""
        return super().normalize(None if config is True else config)

    def transform(self, ctx, config: SequenceParallelConfig) -> None:
        ctx.sequence_parallel = True
