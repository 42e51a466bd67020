"""The optimizer's part of a checkpoint: its state tensors by parameter name, its hyperparameters.

``OptimizerView`` finds, in ``result.optim`` under any strategy, the full ``param_groups``, the
optimizer that holds this process's state and the grad scaler, through the adapters the methods
registered (``adapters.py``). Save: ``optimizer_state_tensors`` (``optim/<name>/<key>``) and
``group_records`` (hyperparameters and parameter names, for the metadata). Load:
``optimizer_destinations`` (where DCP reads each state tensor) and ``load_optimizer``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from atorch.auto.optimizer import AtorchOptimizer
from atorch.checkpoint.adapters import PartitionedState, adapter_for
from atorch.checkpoint.files import from_json_value, json_value
from atorch.errors import CheckpointError


class OptimizerView:
    """What a checkpoint needs of ``result.optim`` under any strategy: the full ``param_groups``
    (every parameter of this rank's model, for hyperparameters), the optimizer that holds this rank's
    state (``local``; ``None`` when it holds none, or when ``partitions`` hold it), and the grad
    scaler."""

    def __init__(self, optim: Any):
        outer = optim
        self.scaler = None
        self.partitions: Optional[PartitionedState] = None  # the state is in partitions of the method's own
        while isinstance(outer, AtorchOptimizer):
            self._read_layer(outer)
            outer = outer.optimizer
        self.torch_optimizer = outer
        self.full_groups: list[dict] = outer.param_groups
        self.group_params: list[list[torch.Tensor]] = [g["params"] for g in outer.param_groups]
        self.local: Optional[torch.optim.Optimizer] = None
        if self.partitions is not None:  # their groups hold flat buffers: the model's params instead
            self.group_params = self.partitions.group_params
        else:
            local_state = adapter_for(outer).local_state
            self.local = local_state(outer) if local_state is not None else outer

    def _read_layer(self, layer: Any) -> None:
        adapter = adapter_for(layer)
        error = adapter.unsupported(layer) if adapter.unsupported is not None else None
        if error is not None:
            raise error
        scaler = adapter.scaler(layer) if adapter.scaler is not None else None
        if scaler is not None:
            self.scaler = scaler
        if adapter.partitions is not None:
            self.partitions = adapter.partitions(layer)


def partitions_of(optim: Any) -> Optional[PartitionedState]:
    """The partitions holding ``optim``'s state outside torch's (DeepSpeed ZeRO's flat buffers), or None.
    Unlike ``OptimizerView`` it does not refuse an optimizer checkpoints cannot hold: loading pretrained
    weights into the model needs only to update such a copy of them (ds_3d_parallel's engine keeps none)."""
    layer = optim
    while isinstance(layer, AtorchOptimizer):
        adapter = adapter_for(layer)
        if adapter.partitions is not None:
            return adapter.partitions(layer)
        layer = layer.optimizer
    return None


def name_of(param: torch.Tensor, names: dict[int, str]) -> str:
    name = names.get(id(param))
    if name is None:
        raise CheckpointError(f"an optimizer parameter of shape {tuple(param.shape)} is not a parameter of the model "
                              "(optim_param_func gave parameters outside result.model?)")
    return name


# --- save --------------------------------------------------------------------------------------------
def optimizer_state_tensors(view: OptimizerView, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """``optim/<name>/<key>`` for every tensor of the state this rank's optimizer holds (with
    partitions: the full state of the parameters this rank owns, gathered from them; collective)."""
    if view.partitions is not None:
        return {f"optim/{name_of(p, names)}/{key}": value for p, key, value in view.partitions.owned_state()}
    out: dict[str, torch.Tensor] = {}
    if view.local is None:
        return out
    for param, state in view.local.state.items():
        name = name_of(param, names)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name!r}/{key!r} is a {type(value).__name__}, not a tensor: "
                                      "only tensor state can be checkpointed", key=f"{name}/{key}")
            out[f"optim/{name}/{key}"] = value
    return out


def group_records(view: OptimizerView, names: dict[int, str]) -> list[dict]:
    """Each full param group's hyperparameters (JSON) and parameter names."""
    return [_group_record(g, p, names) for g, p in zip(view.full_groups, view.group_params)]


def _group_record(group: dict, params: list[torch.Tensor], names: dict[int, str]) -> dict:
    record = {"params": [name_of(p, names) for p in params]}
    for key, value in group.items():
        if key != "params":
            record[key] = json_value(value, f"param_groups[{key!r}]")
    return record


# --- load --------------------------------------------------------------------------------------------
def optimizer_destinations(view: OptimizerView, names: dict[int, str], meta: dict) -> dict:
    """``optim/<name>/<key>`` → (a tensor DCP fills, the parameter, the state key) for the state of
    every parameter this rank's optimizer holds (under zero1: the owned partition; with partitions:
    the parameters with a fragment in this rank's partition, read whole)."""
    if view.partitions is not None:
        params = view.partitions.held_params()
    elif view.local is not None:
        params = [p for group in view.local.param_groups for p in group["params"]]
    else:
        return {}
    saved_keys: dict[str, list[str]] = {}  # parameter name -> its state keys, read once (not per parameter)
    for key in meta["optim"]:
        name, _, state_key = key[len("optim/"):].rpartition("/")
        saved_keys.setdefault(name, []).append(state_key)
    live = view.local.state if view.partitions is None and view.local is not None else {}
    out = {}
    for param in params:
        name = name_of(param, names)
        for state_key in saved_keys.get(name, ()):
            key = f"optim/{name}/{state_key}"
            shape, dtype = meta["optim"][key]
            current = live.get(param, {}).get(state_key)
            out[key] = (_destination(param, shape, getattr(torch, dtype), current), param, state_key)
    return out


def _destination(param: torch.Tensor, shape: list, dtype: torch.dtype,
                 current: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Where DCP reads one state tensor: the optimizer's own state tensor when it has one of that shape,
    dtype and layout (read in place: no new memory to allocate and fault in; a trained run's load costs
    what a bare DCP load does); else shaped like the parameter → laid out like it (a DTensor for a
    DTensor parameter); anything else (Adam's step) → a plain CPU tensor, as torch keeps it. Left
    uninitialised: DCP writes every element of a key it loads, and fails on a key it lacks."""
    if _fits(current, param, shape, dtype):
        return current
    if list(param.shape) == shape and shape:
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _fits(current: Optional[torch.Tensor], param: torch.Tensor, shape: list, dtype: torch.dtype) -> bool:
    """Whether the state tensor ``current`` can receive the saved one in place."""
    if not isinstance(current, torch.Tensor) or list(current.shape) != shape or current.dtype != dtype:
        return False
    if not (isinstance(param, DTensor) and list(param.shape) == shape and shape):  # Adam's step: a plain tensor
        return not isinstance(current, DTensor)
    return (isinstance(current, DTensor) and current.placements == param.placements
            and current.device_mesh == param.device_mesh)


def _by_param(targets: dict) -> dict[int, dict]:
    """``{id(param): {state key: loaded tensor}}`` of ``optimizer_destinations``' values."""
    out: dict[int, dict] = {}
    for tensor, param, key in targets.values():
        out.setdefault(id(param), {})[key] = tensor
    return out


def load_optimizer(view: OptimizerView, names: dict[int, str], meta: dict, targets: dict) -> None:
    """Hyperparameters into the full groups; the state into the optimizer that holds it, through
    its own load_state_dict (which casts and places each value as that optimizer does)."""
    saved_groups = meta.get("param_groups") or []
    group_of = {n: g for g in saved_groups for n in g["params"]}
    for group, params in zip(view.full_groups, view.group_params):
        _set_hyperparameters(group, params, names, group_of)
    if view.partitions is not None:
        view.partitions.load_state(_by_param(targets))
    elif view.local is not None:
        _load_local(view.local, names, group_of, _by_param(targets))


def _load_local(local: torch.optim.Optimizer, names: dict[int, str], group_of: dict, by_param: dict) -> None:
    state: dict[int, dict] = {}
    groups, index = [], 0
    for group in local.param_groups:
        _set_hyperparameters(group, group["params"], names, group_of)
        indices = []
        for param in group["params"]:
            if id(param) in by_param:
                state[index] = by_param[id(param)]
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    local.load_state_dict({"state": state, "param_groups": groups})


def _set_hyperparameters(group: dict, params: list[torch.Tensor], names: dict[int, str], group_of: dict) -> None:
    """The saved hyperparameters of the group that held ``params[0]`` into ``group``."""
    if not params:
        return
    saved = group_of.get(name_of(params[0], names))
    if saved is None:
        return
    for key, value in saved.items():
        if key != "params":
            group[key] = from_json_value(value, group.get(key))
