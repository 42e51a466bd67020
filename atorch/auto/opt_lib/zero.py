"""zero1 and zero2: ZeRO stages 1 and 2 over the data-parallel group.

zero1 shards the optimizer state. Default: PyTorch's ``ZeroRedundancyOptimizer`` under DDP (the
seed names fairscale's OSS; fairscale is unmaintained and this is its PyTorch successor).
``{"use_ds_zero": True}`` uses DeepSpeed ZeRO-1.

zero2 also shards the gradients. Default: FSDP2 ``fully_shard`` with ``reshard_after_forward=False``
(parameters stay gathered between forward and backward, as FSDP1's SHARD_GRAD_OP), so every fsdp key
applies. ``{"not_use_fsdp": True}``: fairscale-ShardedDDP-style, no DDP; each gradient is reduced to
the rank that owns its parameter in the ZeroRedundancyOptimizer partition and freed elsewhere.
``{"use_ds_zero": True}``: DeepSpeed ZeRO-2.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from atorch.auto.gradients import scale_grads_to_norm, total_grad_norm
from atorch.auto.opt_lib.base import SHARDED_STAGES, SHARDED_STAGES_WHY, Optimization
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason, use_deepspeed_zero
from atorch.auto.opt_lib.fsdp import (
    FSDPConfig,
    normalize_fsdp_config,
    shard_model,
    use_foreach_optimizer,
    with_units_resolved,
)
from atorch.auto.optimizer_kernels import param_tensors, without_names
from atorch.checkpoint.adapters import register_optimizer_adapter
from atorch.distributed import mesh
from atorch.errors import MethodConfigError
from atorch.utils.config import MethodConfig, option

logger = logging.getLogger(__name__)

USE_DS_ZERO = "use DeepSpeed ZeRO (needs the deepspeed extra)"
# ZeroRedundancyOptimizer keeps each rank's parameters as views of one flat buffer, so the updated
# shares are sent in one broadcast per rank instead of one per parameter (same values)
BUCKET_VIEW = True


@dataclass(frozen=True)
class Zero1Config(MethodConfig):
    use_ds_zero: bool = option(False, doc=USE_DS_ZERO + " instead of PyTorch's ZeroRedundancyOptimizer")


class Zero1Optimization(Optimization):
    name = "zero1"
    distributed_only = True
    config_class = Zero1Config
    stages = ("data_parallel", "optimizer")  # DeepSpeed's engine claims data parallelism; the optimizer factory
    reads = {"optimizer": ("model", "amp_dtype", "per_rank_batch_size", "optim_func", "optim_args")}
    writes = {"optimizer": ("model",)}  # DeepSpeed's engine
    record_writes = ("optimizer_factory", "data_parallel_wrapper", "args")  # data_parallel_wrapper, args: DeepSpeed
    excludes = {"sharding": "choose one sharding level"}

    def requirements(self, config: Any = None) -> Optional[str]:
        return deepspeed_unavailable_reason() if config is not None and config.use_ds_zero else None

    def transform(self, ctx, config: Zero1Config) -> None:
        if config.use_ds_zero:
            use_deepspeed_zero(ctx, self.name, stage=1)
            return
        ctx.optimizer_factory = _zero_redundancy_optimizer


def _zero_redundancy_optimizer(ctx, params: Any):
    group = mesh.parallel_group("data_parallel")
    params = without_names(params)
    # tensor-parallel parameters: ZeRO cannot broadcast DTensors
    if any(isinstance(p, DTensor) for p in param_tensors(params)):
        return ShardedStateOptimizer(params, ctx.optim_func, group, **ctx.optim_args_for(params))
    return ZeroRedundancyOptimizer(params, optimizer_class=ctx.optim_func, process_group=group,
                                   parameters_as_bucket_view=BUCKET_VIEW, **ctx.optim_args_for(params))


class ShardedStateOptimizer(torch.optim.Optimizer):
    """ZeRO-1 for model-parallel (DTensor) parameters: each parameter's optimizer state lives on one
    rank of the data group (greedy balance by local size); that rank steps it and broadcasts this
    rank's local shard to the others. ``param_groups`` are the full groups, so schedulers and
    clipping see every parameter; hyper-parameters are copied to the owned groups before each step."""

    def __init__(self, params: list, optimizer_class: Any, group: Any, **defaults: Any):
        groups = [dict(g) if isinstance(g, dict) else {"params": [g]} for g in params] if params else []
        if groups and not isinstance(params[0], dict):
            groups = [{"params": [g["params"][0] for g in groups]}]
        super().__init__(groups, defaults)
        self.group = group
        size, me = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
        loads = [0] * size
        self.owner: dict[int, int] = {}
        for param in sorted((p for g in self.param_groups for p in g["params"]), key=lambda p: -_local(p).numel()):
            rank = loads.index(min(loads))
            self.owner[id(param)] = rank
            loads[rank] += _local(param).numel()
        self.owned = [[p for p in g["params"] if self.owner[id(p)] == me] for g in self.param_groups]
        inner_groups = [dict(g, params=owned) for g, owned in zip(self.param_groups, self.owned) if owned]
        self.inner = optimizer_class(inner_groups, **defaults) if inner_groups else None
        self._inner_index = [i for i, owned in enumerate(self.owned) if owned]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        if self.inner is not None:
            for inner_group, index in zip(self.inner.param_groups, self._inner_index):
                inner_group.update({k: v for k, v in self.param_groups[index].items() if k != "params"})
            self.inner.step()
        for group in self.param_groups:
            for param in group["params"]:
                source = dist.get_global_rank(self.group, self.owner[id(param)]) if self.group is not None else 0
                if self.group is not None and dist.get_world_size(self.group) > 1:
                    dist.broadcast(_local(param), src=source, group=self.group)
        return loss

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict() if self.inner is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])


# checkpoints read this rank's partition of the state from the optimizer that steps it; torch's own
# state_dict() of it is partial (result.optim.state_dict() refuses it with the reason)
register_optimizer_adapter(
    ZeroRedundancyOptimizer, local_state=lambda optim: optim.optim,
    sharded_reason=lambda optim: (
        "zero1 partitions the optimizer state over the data-parallel processes (ZeroRedundancyOptimizer: "
        "consolidate_state_dict(to=0) on every process first, then state_dict() on process 0)"),
    whole_state_dict=lambda optim, call: call == "load_state_dict()" or bool(getattr(optim, "_all_state_dicts", None)))
register_optimizer_adapter(
    ShardedStateOptimizer, local_state=lambda optim: optim.inner,
    sharded_reason=lambda optim: "zero1 over tensor-parallel parameters keeps each parameter's state on one process")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class Zero2Config(FSDPConfig):
    """Every fsdp key (for the default FSDP implementation) plus the choice of implementation."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP"] = option(
        "SHARD_GRAD_OP", doc="always SHARD_GRAD_OP: parameters stay gathered after forward (use fsdp for ZeRO-3)")
    use_ds_zero: bool = option(False, doc=USE_DS_ZERO + " instead of FSDP")
    not_use_fsdp: bool = option(False, doc="gradients reduced to the rank owning their optimizer state, without FSDP")


class Zero2Optimization(Optimization):
    name = "zero2"
    distributed_only = True
    config_class = Zero2Config
    stages = ("data_parallel", "optimizer")  # its data-parallel wrapper; the optimizer factory
    # the sample row (dataset ... model_input_format): FSDP2's units_called, when a chosen unit is a Sequential
    reads = {"data_parallel": ("model", "amp_dtype", "dataset", "dataloader_args", "user_prepare_input", "input_dtype",
                               "model_input_format", "loss_func"),
             "optimizer": ("model", "amp_dtype", "per_rank_batch_size", "optim_func", "optim_args")}
    writes = {"data_parallel": ("model", "grad_partition_group", "sync_toggles", "args"), "optimizer": ("model",)}
    record_writes = ("data_parallel_wrapper", "optimizer_factory", "args")  # args: DeepSpeed
    excludes = {"sharding": "choose one sharding level", SHARDED_STAGES: SHARDED_STAGES_WHY}

    def normalize(self, config: Any) -> Zero2Config:
        config = normalize_fsdp_config(self.name, self.config_class, config)
        if config.use_ds_zero and config.not_use_fsdp:
            raise MethodConfigError(self.name, "use_ds_zero and not_use_fsdp each pick an implementation; set one")
        fsdp_keys = sorted(set(config.to_dict()) - {"use_ds_zero", "not_use_fsdp"})
        if fsdp_keys and (config.use_ds_zero or config.not_use_fsdp):
            raise MethodConfigError(self.name, f"fsdp keys {fsdp_keys} apply only to the default FSDP implementation")
        if config.reshard_after_forward or config.sharding_strategy == "FULL_SHARD":
            raise MethodConfigError(self.name,
                                    "zero2 keeps parameters gathered after forward; use the fsdp method for ZeRO-3")
        return config

    def requirements(self, config: Any = None) -> Optional[str]:
        return deepspeed_unavailable_reason() if config is not None and config.use_ds_zero else None

    def transform(self, ctx, config: Zero2Config) -> None:
        if config.use_ds_zero:
            use_deepspeed_zero(ctx, self.name, stage=2)
        elif config.not_use_fsdp:
            _use_sharded_gradients(ctx, self.name)
        else:
            config = with_units_resolved(ctx.model, config, self.name)
            ctx.set_data_parallel_wrapper(self.name, lambda ctx: shard_model(ctx, config, reshard_after_forward=False),
                                          shards_meta=True)
            use_foreach_optimizer(ctx)


def _use_sharded_gradients(ctx, method: str) -> None:
    state: dict[str, Any] = {}

    def wrap(ctx) -> None:
        group = mesh.parallel_group("data_parallel")
        if group is None or dist.get_world_size(group) == 1:
            return
        state["wrapper"] = ShardedGradientDataParallel(ctx.model, group)
        ctx.model = state["wrapper"]
        ctx.grad_partition_group = group
        ctx.add_sync_toggle(state["wrapper"].set_gradient_sync)

    def build_optimizer(ctx, params: Any) -> ZeroRedundancyOptimizer:
        optimizer = _zero_redundancy_optimizer(ctx, params)
        if "wrapper" in state:
            state["wrapper"].set_owners(optimizer._param_to_rank)
        return optimizer

    ctx.set_data_parallel_wrapper(method, wrap)
    ctx.optimizer_factory = build_optimizer


class ShardedGradientDataParallel(torch.nn.Module):
    """ZeRO-2 without FSDP: as each gradient is ready, it is averaged onto the rank that owns the
    parameter's optimizer state and freed on the others, so a rank keeps only its own share of the
    gradients. The optimizer (ZeroRedundancyOptimizer) steps the owned share and broadcasts it."""

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.module = module
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.sync = True
        self._owner: Optional[dict[torch.Tensor, int]] = None
        self._broadcast_states()
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._reduce_to_owner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_owners(self, param_to_rank: dict[torch.Tensor, int]) -> None:
        self._owner = dict(param_to_rank)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.sync = enabled

    @torch.no_grad()
    def _broadcast_states(self) -> None:
        source = dist.get_global_rank(self.group, 0)
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(tensor.data, src=source, group=self.group)

    @torch.no_grad()
    def _reduce_to_owner(self, param: torch.nn.Parameter) -> None:
        if not self.sync or param.grad is None:
            return
        if self._owner is None:
            raise RuntimeError(
                "ShardedGradientDataParallel needs the optimizer's partition (set_owners) before backward")
        owner = self._owner[param]
        param.grad.div_(self.group_size)
        dist.reduce(param.grad, dst=dist.get_global_rank(self.group, owner), group=self.group)
        if owner != self.group_rank:
            param.grad = None

    def atorch_clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = list(self.module.parameters())
        norm = total_grad_norm(params, norm_type, partition_group=self.group)
        scale_grads_to_norm(params, max_norm, norm)
        return norm


