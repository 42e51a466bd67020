"""The default data-parallel wrapper: DDP over the data-parallel group of the mesh.

Not a method users name: ``apply_strategy`` installs it when no method (fsdp, zero2, ...) has
claimed the context's data-parallel slot. Model-parallel (DTensor) parameters cannot go through DDP,
so for them each local shard's gradient is averaged over the data group by a hook instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from atorch.distributed import mesh

NAME = "ddp"
# its facts, as a method declares them (``base.Optimization``): the stage contract lists it
STAGES = ("data_parallel",)
READS = ("model", "device", "model_parallel", "find_unused_parameters")
WRITES = ("model", "sync_toggles", "args")


def wrap_data_parallel(ctx) -> None:
    """DDP (or gradient-averaging hooks for model-parallel parameters) over the data group."""
    group = mesh.parallel_group("data_parallel")
    if group is None or dist.get_world_size(group) == 1:
        return
    if not any(p.requires_grad for p in ctx.model.parameters()):
        return
    if ctx.model_parallel or any(isinstance(p, DTensor) for p in ctx.model.parameters()):
        average_gradients_over(ctx, group)
        return
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(
        ctx.model, device_ids=device_ids, process_group=group, find_unused_parameters=ctx.find_unused_parameters,
    )
    ctx.model = ddp
    # what DDP.no_sync() does, as a switch the optimizer can flip between micro-steps
    ctx.add_sync_toggle(lambda on: setattr(ddp, "require_backward_grad_sync", on))


def average_gradients_over(ctx, group) -> None:
    """Data parallelism for model-parallel parameters: each local shard's gradient is averaged
    over the data group as soon as it is ready (hooks fire in the same order on every rank)."""
    size = dist.get_world_size(group)
    state = {"sync": True}
    ctx.add_sync_toggle(lambda on: state.__setitem__("sync", on))
    source = dist.get_global_rank(group, 0)
    for param in ctx.model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            dist.broadcast(local, src=source, group=group)
        if not param.requires_grad:
            continue

        def average(p: torch.Tensor) -> None:
            if state["sync"] and p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=group)
                grad.div_(size)

        param.register_post_accumulate_grad_hook(average)
