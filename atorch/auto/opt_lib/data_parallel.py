"""The default data-parallel wrapper: DDP over the data-parallel group of the mesh.

Not a method users name: ``apply_strategy`` installs it when no method (fsdp, zero2, ...) has
claimed the context's data-parallel slot. Model-parallel (DTensor) parameters cannot go through DDP,
so for them each local shard's gradient is averaged over the data group by a hook instead; under a
pipeline schedule (which runs every micro-batch's backward inside the model's forward) the gradients
are averaged once, bucketed, when that forward returns, not once per micro-batch and parameter.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from atorch.distributed import mesh

NAME = "ddp"
# its facts, as a method declares them (``base.Optimization``): the stage contract lists it
STAGES = ("data_parallel",)
READS = ("model", "device", "model_parallel", "find_unused_parameters", "backward_in_forward")
# the largest flat buffer one all-reduce of the deferred average carries (as DDP's default bucket)
BUCKET_BYTES = 25 * 2**20
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
    ddp = DataParallelModel(
        ctx.model, device_ids=device_ids, process_group=group, find_unused_parameters=ctx.find_unused_parameters,
    )
    ctx.model = ddp
    # what DDP.no_sync() does, as a switch the optimizer can flip between micro-steps
    ctx.add_sync_toggle(lambda on: setattr(ddp, "require_backward_grad_sync", on))


class DataParallelModel(torch.nn.parallel.DistributedDataParallel):
    """DDP through which the user's model's values read as before: ``result.model.config``,
    ``.generation_config``, a submodule. Not its methods: a method calling the model's own forward
    would skip DDP's, and DDP's gradient synchronisation with it (each process would train apart,
    silently), so reading one raises an AttributeError that says to call it on ``result.model.module``
    (for inference) instead."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as missing:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("__") or not hasattr(inner, name):
                raise missing from None
        value = getattr(inner, name)
        if inspect.ismethod(value) or inspect.isfunction(value):
            raise AttributeError(
                f"{name!r} is a method of your {type(inner).__name__} inside DistributedDataParallel: call it as "
                f"result.model.module.{name}(...). Its own forward does not synchronise gradients over the "
                "processes, so use it for inference, not to train")
        return value


def average_gradients_over(ctx, group) -> None:
    """Data parallelism for model-parallel parameters: each local shard's gradient is averaged
    over the data group as soon as it is ready (hooks fire in the same order on every rank), or,
    where backward runs inside forward (a pipeline schedule: ``backward_in_forward``), once when that
    forward returns (``average_after_schedule``)."""
    size = dist.get_world_size(group)
    state = {"sync": True}
    ctx.add_sync_toggle(lambda on: state.__setitem__("sync", on))
    source = dist.get_global_rank(group, 0)
    for param in ctx.model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            dist.broadcast(local, src=source, group=group)
    if ctx.backward_in_forward:
        average_after_schedule(ctx.model, group, state)
        return
    for param in ctx.model.parameters():
        if not param.requires_grad:
            continue

        def average(p: torch.Tensor) -> None:
            if state["sync"] and p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=group)
                grad.div_(size)

        param.register_post_accumulate_grad_hook(average)


def average_after_schedule(model: torch.nn.Module, group, state: dict) -> None:
    """A pipeline schedule accumulates every micro-batch's gradients inside one call of the model: a
    per-parameter hook would all-reduce each gradient once per micro-batch (that many times the
    traffic, one collective per parameter). Instead the finished gradients are averaged once, in
    buckets, when the pipeline says a training call's gradients are final (its
    ``register_gradients_ready_hook``: after the user's backward scaled them), skipped where sync was off
    when the call began (an accumulation micro-step)."""
    def average(sync: bool) -> None:
        if sync:
            grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
            average_in_buckets([g.to_local() if isinstance(g, DTensor) else g for g in grads], group)

    model.register_gradients_ready_hook(average, capture=lambda: state["sync"])


@torch.no_grad()
def average_in_buckets(grads: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average ``grads`` in place over ``group``: one all-reduce per flat bucket of one dtype and device
    (every rank holds the same gradients in the same order, so the buckets match)."""
    size = dist.get_world_size(group)
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each at most ``bucket_bytes`` (a larger
    tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        current = buckets[-1] if buckets else None
        if (current is None or size + nbytes > bucket_bytes or current[0].dtype != tensor.dtype
                or current[0].device != tensor.device):
            buckets.append([tensor])
            size = nbytes
        else:
            current.append(tensor)
            size += nbytes
    return buckets
