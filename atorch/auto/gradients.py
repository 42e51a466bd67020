"""Gradient norms and clipping that stay correct when gradients are sharded.

Under DDP and zero1 every rank holds full, identical gradients; under FSDP2 (fsdp, zero2) they are
DTensor shards; under the non-FSDP zero2 path each rank keeps only the gradients of the parameters
it owns. The global norm must count every element exactly once, so each case reduces differently.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

COUNTED_ELSEWHERE = "_atorch_grad_counted_elsewhere"


def mark_counted_elsewhere(param: torch.Tensor) -> None:
    """Leave ``param``'s gradient out of global norms: it is a copy of one another rank or stage
    counts (a weight tied across pipeline stages, its copies' gradients summed to be equal)."""
    setattr(param, COUNTED_ELSEWHERE, True)


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, partition_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The p-norm of all gradients taken together, as a plain tensor equal on every rank.

    DTensor gradients are reduced over their own mesh (one collective per layout). Plain gradients
    are replicated on every rank. ``partition_group`` says each rank of it holds a disjoint part of
    the gradients (the non-FSDP zero2 path, pipeline stages): the parts are summed over it. Copies
    marked with ``mark_counted_elsewhere`` (tied weights on several stages) are counted once.
    """
    grads = [p.grad for p in parameters if p.grad is not None and not getattr(p, COUNTED_ELSEWHERE, False)]
    norm_type = float(norm_type)
    by_layout: dict[tuple, list[DTensor]] = {}
    plain: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            by_layout.setdefault((id(grad.device_mesh), grad.placements), []).append(grad)
        else:
            plain.append(grad)
    parts: list[torch.Tensor] = []
    for group_grads in by_layout.values():
        norm = torch.nn.utils.get_total_norm(group_grads, norm_type, foreach=False)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain, norm_type, foreach=False))
    device = parts[0].device if parts else torch.device("cpu")
    stacked = torch.stack([p.to(device, torch.float32) for p in parts]) if parts else torch.zeros(1, device=device)
    local = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if partition_group is not None and dist.get_world_size(partition_group) > 1:
        local = _combine_across(local, norm_type, partition_group)
    return local


def _combine_across(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    value = norm.detach().to(torch.float32).clone()
    if math.isinf(norm_type):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value
    value = value.pow(norm_type)
    dist.all_reduce(value, group=group)
    return value.pow(1.0 / norm_type)


@torch.no_grad()
def scale_grads_to_norm(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply every gradient by min(1, max_norm / total_norm), as torch.nn.utils.clip_grad_norm_."""
    factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(factor.to(local.device, local.dtype))


def clip_grad_norm_(target, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
    """Clip gradients by their global norm under any atorch method; returns the norm before clipping.

    ``target`` is what auto_accelerate returned: the optimizer (preferred: under fp16 amp it unscales
    first, and under DeepSpeed the clip is applied inside ``step``) or the model.
    """
    if hasattr(target, "clip_grad_norm_") and not isinstance(target, torch.nn.Module):
        return target.clip_grad_norm_(max_norm, norm_type)
    if isinstance(target, torch.nn.Module):
        if hasattr(target, "atorch_clip_grad_norm_"):
            return target.atorch_clip_grad_norm_(max_norm, norm_type)
        params = [p for p in target.parameters() if p.grad is not None]
    elif isinstance(target, torch.optim.Optimizer):
        params = [p for group in target.param_groups for p in group["params"] if p.grad is not None]
    else:
        params = [p for p in target if p.grad is not None]
    norm = total_grad_norm(params, norm_type)
    scale_grads_to_norm(params, max_norm, norm)
    return norm


# --- the user's own torch.nn.utils.clip_grad_norm_ --------------------------------------------------
# A loop written for one process clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``.
# Over an accelerated model torch's function takes the norm of what this rank holds: a pipeline stage's
# own gradients (every stage then clips by a different factor: silently wrong weights), under
# tensor_parallel a mix of DTensor and plain gradients (torch raises inside the loop), under fp16 amp the
# scaled gradients (the loop has no scaler to unscale them first: the update shrinks by the loss scale),
# under DeepSpeed none (it keeps them in its buffers). So once atorch has built an optimizer, the function
# is routed: the gradients of the accelerated model's trainable parameters are clipped exactly as
# ``optim.clip_grad_norm_`` does (settled first, by their global norm, unscaled under fp16 amp,
# DeepSpeed's threshold under DeepSpeed); any other call is torch's own. A ``from torch.nn.utils import
# clip_grad_norm_`` bound before auto_accelerate ran keeps torch's function: docs/semi-automatic.md says so.
# id(parameter) -> (a weak reference to it, a weak reference to its optimizer); by identity, since a
# tensor's == compares values
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_TORCH_CLIP: dict[str, Callable] = {}


def route_torch_clipping(optimizer: Any, model: torch.nn.Module) -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` over ``model``'s trainable parameters to ``optimizer``'s
    global-norm clip. Only the model's: a library's own call on its internal copies (DeepSpeed's fp16
    optimizer clips its fp32 masters with torch's function) stays torch's."""
    owner = weakref.ref(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer.routed_clip_params = {id(p) for p in trainable}
    for param in trainable:
        _OWNERS[id(param)] = (weakref.ref(param, functools.partial(_forget, id(param))), owner)
    if not _TORCH_CLIP:
        _TORCH_CLIP["function"] = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _routed_clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = _routed_clip_grad_norm_


def _forget(key: int, dead: weakref.ref) -> None:
    if _OWNERS.get(key, (None,))[0] is dead:
        del _OWNERS[key]


def _routed_clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                            foreach: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, by the global norm where an atorch optimizer steps the parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = _owner_of(params)
    if owner is None:
        return _TORCH_CLIP["function"](params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                                       foreach=foreach)
    if owner.routed_clip_params <= {id(p) for p in params}:  # all the model trains, frozen ones beside
        norm = owner.clip_grad_norm_(max_norm, norm_type)
        if norm is None:  # DeepSpeed: this step's norm is taken inside step(), which clips; none to check here
            return torch.tensor(float("nan"))
    else:  # a part of them: its norm over the processes
        refusal = owner.part_clip_refusal()
        if refusal is not None:
            raise refusal
        owner._settle()
        held = [p for p in params if id(p) in owner.routed_clip_params]
        norm = total_grad_norm(held, norm_type, owner.grad_partition_group)
        scale_grads_to_norm(held, max_norm, norm)
    if error_if_nonfinite and not torch.isfinite(norm).all():
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm


def _owner_of(params: list[torch.Tensor]) -> Any:
    """The one live atorch optimizer stepping every parameter of ``params`` that has a gradient (frozen
    ones aside), or None: then torch's own function serves the call."""
    owners = set()
    for param in params:
        entry = _OWNERS.get(id(param))
        if entry is None or entry[0]() is not param:
            if param.grad is not None:
                return None
            continue
        owners.add(entry[1])
    if len(owners) != 1:
        return None
    return next(iter(owners))()
