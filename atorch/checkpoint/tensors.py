"""The model's tensors under canonical names, whatever wraps the model.

Keys are ``model/<name>`` under the user's own parameter and buffer names (no ``module.`` /
``_orig_mod.`` / ``_checkpoint_wrapped_module.`` parts; pipeline stages contribute their own names;
tied weights once) and ``optim/<name>/<key>`` for optimizer state. DTensors stay DTensors, so DCP
reshards them on load.

A method that keeps a parameter in another order than the user's (tensor_parallel's fused q|k|v)
declares it on the module: ``SAVED_ORDERS_ATTR`` maps the parameter's attribute name to an order
object with ``to_saved(full_live) -> full_saved`` and ``to_live(full_saved) -> full_live``. Such a
parameter is saved in the user's order, gathered whole, so any strategy can load it.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from atorch.errors import CheckpointError
from atorch.utils.modules import SAVED_ORDERS_ATTR, unwrap_model

INNER_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")  # anywhere: torch.compile, checkpoint_wrapper


class SavedOrder(Protocol):
    """How a parameter kept in a live order of its own converts to and from the user's order."""

    def to_saved(self, live: torch.Tensor) -> torch.Tensor: ...

    def to_live(self, saved: torch.Tensor) -> torch.Tensor: ...


def model_roots(model: nn.Module) -> list[nn.Module]:
    """The user's module(s) inside the wrappers: one per pipeline stage this rank holds, else one."""
    stages = getattr(model, "stage_modules", None)
    if stages is not None:
        return [stage.model for stage in stages]
    engine_module = getattr(model, "module", None)
    return [unwrap_model(engine_module if isinstance(engine_module, nn.Module) else model)]


def canonical_name(name: str) -> str:
    """A state_dict key without the wrappers' parts: ``_orig_mod.`` / ``_checkpoint_wrapped_module.``
    anywhere (blocks can be wrapped), ``module.`` (DDP, DeepSpeed) only in front, since a user's
    own submodule may be called ``module``."""
    for part in INNER_WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's live parameters and persistent buffers by canonical name (DTensors as they are;
    a weight tied under several names once, under its first). A parameter kept in another order
    (``SAVED_ORDERS_ATTR``) is returned live too; save and load convert it. CheckpointError for any
    other parameter whose ``state_dict`` value is not the live tensor (an unknown state_dict hook
    rewrites it): loading it in place would be wrong."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for root in model_roots(model):
        _add_root_tensors(root, out, seen)
    return out


def _add_root_tensors(root: nn.Module, out: dict[str, torch.Tensor], seen: set[int]) -> None:
    live = dict(root.named_parameters(remove_duplicate=False))
    live.update(root.named_buffers(remove_duplicate=False))
    permuted = _orders_of(root)
    for name, value in root.state_dict(keep_vars=True).items():
        key = canonical_name(name)
        if key in out or id(value) in seen:
            continue  # a tied weight, or a replicated buffer of a second pipeline stage
        if name in live and value is not live[name]:
            if name not in permuted:
                raise CheckpointError(
                    f"save_checkpoint/load_checkpoint: {key!r} is stored in another order than the live "
                    "parameter (a state_dict hook rewrites it) and atorch does not know that order; export the "
                    "weights with atorch.export_model", key=key)
            value = live[name]
        seen.add(id(value))
        out[key] = value


def param_names(tensors: dict[str, torch.Tensor]) -> dict[int, str]:
    """``{id(parameter): canonical name}`` of the parameters among ``tensors``."""
    return {id(t): name for name, t in tensors.items() if isinstance(t, nn.Parameter)}


def _orders_of(root: nn.Module) -> dict[str, SavedOrder]:
    """``{state_dict name: order}`` of the parameters a module keeps in an order of its own."""
    out = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr, order in getattr(module, SAVED_ORDERS_ATTR, {}).items():
            out[f"{prefix}.{attr}" if prefix else attr] = order
    return out


def saved_orders(model: nn.Module) -> dict[str, SavedOrder]:
    """``{canonical name: order}`` of the parameters stored in the user's order, not the live one."""
    return {canonical_name(n): order for root in model_roots(model) for n, order in _orders_of(root).items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def param_of_key(key: str) -> str:
    """The parameter name of ``model/<name>`` or ``optim/<name>/<state key>``."""
    if key.startswith("model/"):
        return key[len("model/"):]
    return key[len("optim/"):].rsplit("/", 1)[0]


def _has_order(key: str, tensor: torch.Tensor, model: dict, orders: dict) -> bool:
    """Whether ``key`` is a parameter with an order of its own, or its parameter-shaped state."""
    name = param_of_key(key)
    return name in orders and tensor.shape == model[name].shape and bool(tensor.dim())


def in_saved_order(tensors: dict[str, torch.Tensor], model: dict[str, torch.Tensor],
                   orders: dict[str, SavedOrder]) -> dict[str, torch.Tensor]:
    """``tensors`` (``model/<name>`` and ``optim/<name>/<key>``) with each permuted parameter and
    its parameter-shaped state in the user's order, so any strategy can load them. Such a tensor is
    gathered whole (collective: call it on every rank in the same order) and saved replicated: the
    permutation mixes every rank's columns, so no rank's shard is a block of the saved tensor."""
    if not orders:
        return tensors
    out = dict(tensors)
    for key in sorted(tensors):
        if _has_order(key, tensors[key], model, orders):
            out[key] = orders[param_of_key(key)].to_saved(_full(tensors[key]).detach())
    return out


def to_live_order(saved: torch.Tensor, like: torch.Tensor, order: SavedOrder) -> torch.Tensor:
    """A full tensor in the user's order, permuted and cut as ``like`` (this rank's DTensor shard)."""
    live = order.to_live(saved)
    if not isinstance(like, DTensor):
        return live
    shape, offset = compute_local_shape_and_global_offset(live.shape, like.device_mesh, like.placements)
    local = live[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(like.device)
    return DTensor.from_local(local.contiguous(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def saved_order_destinations(destinations: dict, model: dict, orders: dict) -> dict:
    """Plain full tensors for DCP to read the permuted parameters (and their parameter-shaped
    state) into, in the user's order; ``into_live_order`` converts them afterwards."""
    return {key: torch.zeros(tensor.shape, dtype=tensor.dtype) for key, tensor in destinations.items()
            if _has_order(key, tensor, model, orders)}


def into_live_order(loaded: dict, model: dict, orders: dict, optim_targets: dict) -> dict:
    """Copy the permuted parameters read in the user's order into the live ones (in place) and
    return ``optim_targets`` with their state in the live order, laid out like the parameter."""
    targets = dict(optim_targets)
    for key in loaded:
        name = param_of_key(key)
        live = to_live_order(loaded[key], model[name], orders[name])
        if key.startswith("model/"):
            _copy_into(model[name], live)
        else:
            _, param, state_key = targets[key]
            targets[key] = (live, param, state_key)
    return targets


def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(value.to_local() if isinstance(value, DTensor) else value)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory; a DTensor stays a DTensor (a copy of this rank's shard) so DCP saves
    its shard as it would the live one."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                                  stride=tensor.stride())
    return tensor.detach().to("cpu", copy=True)


def describe(tensor: torch.Tensor) -> list:
    """``[shape, dtype name]`` as the metadata records a tensor."""
    return [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]


__all__ = ["SAVED_ORDERS_ATTR", "SavedOrder", "model_roots", "canonical_name", "model_tensors", "param_names",
           "saved_orders", "param_of_key", "in_saved_order", "to_live_order", "saved_order_destinations",
           "into_live_order", "host_copy", "describe"]
