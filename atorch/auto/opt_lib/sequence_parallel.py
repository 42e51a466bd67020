"""sequence_parallel: with tensor_parallel, shard the norm / dropout regions on the sequence dimension.

The residual stream between the split attention and MLP projections is kept as a sequence shard, so
activations there (norm inputs and outputs, residual sums) take 1/tensor of the memory; the
all-reduce of plain tensor parallelism becomes a reduce-scatter plus an all-gather of the same
volume. Applied by tensor_parallel's wrapper (``atorch.auto.opt_lib.tensor_parallel``), on models
whose repeated blocks hold norms and the split attention / MLP as direct children (the repo GPT,
Megatron-style blocks). Needs ``tensor_parallel`` in the strategy.
"""
from __future__ import annotations

from typing import Any

from atorch.errors import MethodConfigError
from atorch.auto.opt_lib.base import Optimization


class SequenceParallelOptimization(Optimization):
    name = "sequence_parallel"
    distributed_only = True
    is_tunable = False
    default_config = None

    def normalize(self, config: Any) -> None:
        if config not in (None, {}, True):
            raise MethodConfigError(self.name, f"takes no config, got {config!r}")
        return None

    def transform(self, ctx, config: Any) -> None:
        ctx.sequence_parallel = True
