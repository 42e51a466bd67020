"""ds_3d_parallel: DeepSpeed's pipeline engine (pipeline × data) — optional.

DeepSpeed pipelines a list of layers, so this method takes models given as ``nn.Sequential`` (the
layers in order; the first receives the whole input) and ``model_input_format`` None. The stages are
partitioned by DeepSpeed (``partition_method``: "parameters" by default, "uniform", or
"type:<regex>"); ``num_micro_batch`` micro-batches run per step. Tensor parallelism inside DeepSpeed
needs a Megatron model, so a ``tensor`` dimension above 1 is refused; use ``mixed_parallel`` for
tensor × pipeline on any model. As with pipeline_parallel, ``model(batch)`` runs the whole step and
returns a ``PipelineOutput``, ``loss_func`` returns its loss, ``optim.backward`` is a no-op and
``optim.step`` does nothing further (DeepSpeed stepped inside ``train_batch``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.auto.opt_lib.pipeline_parallel import PipelineOutput, pipeline_loss
from atorch.auto.optimizer import AtorchOptimizer
from atorch.checkpoint.adapters import register_optimizer_adapter
from atorch.distributed import mesh
from atorch.errors import CheckpointError, MethodConfigError, RequirementError
from atorch.utils.batch import batch_size_of, loss_value, select_rows
from atorch.utils.config import MethodConfig, option

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DS3DParallelConfig(MethodConfig):
    num_micro_batch: int = option(2, doc="micro-batches per step (DeepSpeed's gradient accumulation steps)", minimum=1)
    partition_method: str = option("parameters", doc="how DeepSpeed balances stages: 'parameters', 'uniform' or "
                                   "'type:<regex>'")


class DS3DParallelOptimization(Optimization):
    name = "ds_3d_parallel"
    distributed_only = True
    config_class = DS3DParallelConfig
    stages = ("data_parallel", "optimizer")  # the engine (built by the optimizer factory) is the data-parallel wrapper
    reads = {"optimizer": ("model", "loss_func", "model_input_format", "per_rank_batch_size", "optim_func",
                           "optim_args")}
    writes = {"optimizer": ("model", "loss_func")}
    record_writes = ("data_parallel_wrapper", "optimizer_factory", "backward_in_forward", "args")
    excludes = {"sharding": "choose one sharding level",
                "tensor parallel": "mixed_parallel already includes tensor parallel",
                "pipeline parallel": "mixed_parallel already includes pipeline parallel",
                "micro-batches": "a pipeline splits the batch into micro-batches itself: set its num_micro_batch"}

    def requirements(self, config: Any = None) -> Optional[str]:
        return deepspeed_unavailable_reason()

    def transform(self, ctx, config: DS3DParallelConfig) -> None:
        reason = deepspeed_unavailable_reason()
        if reason:
            raise RequirementError(f"ds_3d_parallel: {reason}")
        if not isinstance(ctx.model, nn.Sequential):
            raise MethodConfigError(self.name, f"DeepSpeed pipelines a list of layers: give the model as "
                                               f"torch.nn.Sequential (got {type(ctx.model).__name__}), "
                                               f"or use pipeline_parallel / mixed_parallel")
        if ctx.model_input_format is not None:
            raise MethodConfigError(self.name,
                                    "needs model_input_format None: the first layer receives the whole batch")
        if ctx.optim_func is None:
            raise MethodConfigError(self.name, "needs optim_func: DeepSpeed builds the optimizer into its engine")
        ctx.set_data_parallel_wrapper(self.name, lambda ctx: None)  # the engine does data parallelism
        ctx.optimizer_factory = lambda ctx, params: _build_engine(ctx, config)
        ctx.backward_in_forward = True
        ctx.args.use_optim_backward = True


def _build_engine(ctx, config: DS3DParallelConfig) -> "EngineStepOptimizer":
    import deepspeed
    from deepspeed.pipe import PipelineModule as DSPipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    if mesh.parallel_group_size("tensor") > 1:
        raise MethodConfigError("ds_3d_parallel",
                                "a tensor dimension above 1 needs a Megatron model; use mixed_parallel")
    pp, dp = mesh.parallel_group_size("pipeline"), mesh.data_parallel_size()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)  # wraps our process group
    holder: dict = {}
    layers = list(ctx.model)
    module = DSPipelineModule(layers=layers, num_stages=pp, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                              loss_fn=lambda output, index: holder["wrapper"].micro_loss(output, index),
                              partition_method=config.partition_method)
    per_rank = ctx.per_rank_batch_size
    micro = config.num_micro_batch
    if per_rank % micro:
        raise MethodConfigError("ds_3d_parallel",
                                f"the per-rank batch {per_rank} does not split into {micro} micro-batches")
    ds_config = {"train_micro_batch_size_per_gpu": per_rank // micro, "gradient_accumulation_steps": micro,
                 "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    optimizer = ctx.optim_func([p for p in module.parameters() if p.requires_grad], **ctx.optim_args)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    wrapper = DeepSpeedPipeline(engine, ctx.loss_func, micro)
    holder["wrapper"] = wrapper
    ctx.model = wrapper
    ctx.loss_func = pipeline_loss
    logger.info("ds_3d_parallel: DeepSpeed pipeline of %d stages x %d data ranks, %d micro-batches", pp, dp, micro)
    return EngineStepOptimizer(optimizer)


class DeepSpeedPipeline(nn.Module):
    def __init__(self, engine: Any, loss_func: Any, micro: int):
        super().__init__()
        self.engine = engine
        self.user_loss = loss_func
        self.micro = micro
        self._batch: Any = None

    def forward(self, batch: Any) -> PipelineOutput:
        self._batch = batch
        size = batch_size_of(batch)
        index = torch.arange(size, device=next(self.engine.parameters()).device)
        chunks = [(select_rows(batch, part), part) for part in index.chunk(self.micro)]
        loss = self.engine.train_batch(data_iter=iter(chunks))
        return PipelineOutput(loss.detach().float() if torch.is_tensor(loss) else torch.tensor(float(loss)))

    def micro_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        return loss_value(self.user_loss(select_rows(self._batch, index), output))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's layers, keyed as in the user's nn.Sequential, gathered over the pipeline."""
        mine = {}
        for key, value in self.engine.module.state_dict().items():
            parts = key.split(".")  # DeepSpeed names layers by their global index
            mine[".".join(parts)] = value.detach().float().cpu().clone()
        group = mesh.parallel_group("pipeline")
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        out = {}
        for part in gathered:
            out.update(part)
        return out


class EngineStepOptimizer(AtorchOptimizer):
    """DeepSpeed's pipeline engine steps inside ``train_batch``; the seed loop's calls are no-ops."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, backward_in_forward=True)

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _no_checkpoints(optim: EngineStepOptimizer) -> CheckpointError:
    return CheckpointError("save_checkpoint/load_checkpoint: ds_3d_parallel is not supported: DeepSpeed's pipeline "
                           "engine names layers by stage index and keeps its own optimizer state; use "
                           "pipeline_parallel / mixed_parallel, or DeepSpeed's own engine.save_checkpoint",
                           key="ds_3d_parallel")


register_optimizer_adapter(EngineStepOptimizer, unsupported=_no_checkpoints)
