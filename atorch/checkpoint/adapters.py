"""How a method tells checkpoints about the optimizer it builds: an adapter per optimizer class.

``result.optim`` is a chain of ``AtorchOptimizer`` wrappers around a torch optimizer. The
checkpoint code knows no method: it walks the chain and asks each object for the adapter its class
registered (``register_optimizer_adapter``, called by the method's own file in
``atorch/auto/opt_lib/``, looked up along the class's MRO). An adapter is a few optional functions
of the optimizer object:

- ``scaler``: a grad scaler whose state is saved and restored (``None``: none here);
- ``partitions``: a ``PartitionedState`` when the state is kept outside torch's ``optimizer.state``
  (DeepSpeed's flat partitions); the checkpoint then reads and writes it through that object;
- ``local_state``: the torch optimizer holding this process's share of the state (a
  ZeroRedundancyOptimizer's local optimizer), or ``None`` when this process holds none; without
  it the innermost optimizer holds its own state;
- ``unsupported``: the CheckpointError to raise when checkpoints cannot hold this optimizer (None:
  they can);
- ``sharded_reason``: why torch's own ``state_dict()`` of this optimizer would be partial (the
  state is split over processes), for ``result.optim.state_dict()`` to refuse with it;
- ``whole_state_dict``: given the optimizer and the call (``"state_dict()"`` or
  ``"load_state_dict()"``), whether torch's own call is whole despite that (a ZeroRedundancyOptimizer
  after ``consolidate_state_dict``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from atorch.errors import CheckpointError


class PartitionedState(Protocol):
    """Optimizer state kept in partitions of the process's own (DeepSpeed ZeRO-1/2's flat buffers)."""

    group_params: list[list[torch.Tensor]]  # the model's parameters of each param group

    def held_params(self) -> list[torch.Tensor]:
        """The parameters with state on this process (whose state it loads)."""

    def owned_state(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(parameter, state key, full tensor) for the parameters this process writes (collective)."""

    def load_state(self, loaded: dict[int, dict[str, torch.Tensor]]) -> None:
        """Each parameter's full state (``{id(param): {key: tensor}}``) into the partitions."""

    def sync_master_weights(self) -> None:
        """After the model's parameters were loaded in place, update the partitions' copy of them."""


@dataclass(frozen=True)
class OptimizerAdapter:
    """What one optimizer class tells the checkpoint code; every part optional (see the module doc)."""

    scaler: Optional[Callable[[Any], Any]] = None
    partitions: Optional[Callable[[Any], PartitionedState]] = None
    local_state: Optional[Callable[[Any], Optional[torch.optim.Optimizer]]] = None
    unsupported: Optional[Callable[[Any], Optional[CheckpointError]]] = None
    sharded_reason: Optional[Callable[[Any], Optional[str]]] = None
    whole_state_dict: Optional[Callable[[Any, str], bool]] = None


NO_ADAPTER = OptimizerAdapter()
_ADAPTERS: dict[type, OptimizerAdapter] = {}


def register_optimizer_adapter(cls: type, **parts: Callable[[Any], Any]) -> OptimizerAdapter:
    """Declare how checkpoints read optimizers of class ``cls`` (and its subclasses): the parts of
    ``OptimizerAdapter`` as keyword arguments. Returns the adapter."""
    adapter = OptimizerAdapter(**parts)
    _ADAPTERS[cls] = adapter
    return adapter


def adapter_for(optimizer: Any) -> OptimizerAdapter:
    """The adapter registered for ``optimizer``'s class or its nearest base, else ``NO_ADAPTER``."""
    for cls in type(optimizer).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
    return NO_ADAPTER
