"""The optimizer auto_accelerate returns: the user's optimizer plus what the strategy needs.

One small wrapper gives every strategy the same surface for the seed's training loop:
``backward(loss)``, ``step()``, ``zero_grad()``, ``set_gradient_accumulation_boundary(flag)`` and
``clip_grad_norm_(max_norm)``. Methods that change how these work (amp's grad scaler, DeepSpeed's
engine) subclass or wrap it; everything else is delegated to the wrapped optimizer, so
``param_groups`` and ``state`` behave as the user's own. ``state_dict`` / ``load_state_dict`` are
torch's where one process holds the whole state, and raise ShardedStateError where the strategy
splits it (see docs/checkpoints.md): atorch.save_checkpoint covers those.

It is a ``torch.optim.Optimizer`` (without that class's state: everything is the wrapped one's), so a
loop's own learning-rate scheduler (``LambdaLR(result.optim, ...)``, transformers'
``get_cosine_schedule_with_warmup``) and step hooks take it as they take the user's optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from atorch.auto.gradients import scale_grads_to_norm, total_grad_norm
from atorch.checkpoint.adapters import adapter_for
from atorch.errors import ShardedStateError

SyncToggle = Callable[[bool], None]


class AtorchOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer (or another AtorchOptimizer).

    A ``torch.optim.Optimizer`` by type only: ``torch.optim.Optimizer.__init__`` is never called, and
    what that class keeps (``defaults``, the hooks' dicts) is read from the wrapped optimizer through
    ``__getattr__``; a step hook registered here therefore runs at the innermost optimizer's step.

    ``sync_toggles`` are callables the data-parallel wrapper registered: called with False they stop
    gradient communication (micro-steps inside an accumulation window), with True they restore it.
    ``grad_partition_group``, when set, says each rank of that group holds a disjoint share of the
    gradients (the non-FSDP zero2 path), which the global gradient norm must sum over.
    """

    def __init__(
        self,
        optimizer: Any,
        sync_toggles: Optional[list[SyncToggle]] = None,
        grad_partition_group: Any = None,
        backward_in_forward: bool = False,
        settlers: Optional[list[Callable[[], None]]] = None,
    ):
        self.optimizer = optimizer
        self.backward_in_forward = backward_in_forward  # pipeline schedules already ran backward
        # what makes gradients final before they are read (a pipeline's call whose backward the loop skipped)
        self.settlers = list(settlers or [])
        self.sync_toggles = list(sync_toggles or [])
        self.grad_partition_group = grad_partition_group
        self.is_gradient_accumulation_boundary = True

    # --- the seed's loop -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        inner = self.optimizer
        if self.backward_in_forward:  # the schedule ran it; this scales its gradients as ``loss`` was scaled
            if loss.requires_grad:
                loss.backward(**kwargs)
            return
        if isinstance(inner, AtorchOptimizer):
            inner.backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def step(self, closure: Optional[Callable] = None) -> Any:
        self._settle()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._settle()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _settle(self) -> None:
        for settle in self.settlers:
            settle()
        if isinstance(self.optimizer, AtorchOptimizer):
            self.optimizer._settle()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Call with False before every micro-step but the last of an accumulation window and with True
        before the last, before the model call (a pipeline schedule runs backward inside it): gradients
        are then communicated once per window."""
        self.is_gradient_accumulation_boundary = bool(is_boundary)
        if isinstance(self.optimizer, AtorchOptimizer):
            self.optimizer.set_gradient_accumulation_boundary(is_boundary)
        for toggle in self.sync_toggles:
            toggle(bool(is_boundary))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every shard and rank; returns the norm before clipping."""
        self._settle()
        if isinstance(self.optimizer, AtorchOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm, norm_type)
        params = [p for group in self.param_groups for p in group["params"]]
        norm = total_grad_norm(params, norm_type, self.grad_partition_group)
        scale_grads_to_norm(params, max_norm, norm)
        return norm

    def part_clip_refusal(self) -> Optional[Exception]:
        """The error saying why the gradients of a part of the parameters cannot be clipped apart from the
        rest (None: they can). The innermost wrapper knows: DeepSpeed keeps them in its own buffers."""
        if isinstance(self.optimizer, AtorchOptimizer):
            return self.optimizer.part_clip_refusal()
        return None

    # --- delegation ----------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def torch_optimizer(self) -> Any:
        """The innermost optimizer (what an lr scheduler or a GradScaler acts on)."""
        inner = self.optimizer
        while isinstance(inner, AtorchOptimizer):
            inner = inner.optimizer
        return inner

    def state_dict(self) -> dict:
        """torch's ``state_dict`` where it holds the whole state; ShardedStateError where the strategy
        splits the state over processes, so that a partial or shard-keyed dict is never mistaken for
        the optimizer's state (one its method declares whole passes through: a consolidated
        ZeroRedundancyOptimizer)."""
        if not self._whole_state_dict("state_dict()"):
            self._refuse_sharded("state_dict()")
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """torch's ``load_state_dict``; ShardedStateError where the state is split over processes (a
        ZeroRedundancyOptimizer takes torch's consolidated dict and passes through)."""
        if not self._whole_state_dict("load_state_dict()"):
            self._refuse_sharded("load_state_dict()")
        self.optimizer.load_state_dict(state)

    def _whole_state_dict(self, call: str) -> bool:
        """Whether the innermost optimizer's method declares torch's own ``call`` whole (its adapter)."""
        whole = adapter_for(self.torch_optimizer).whole_state_dict
        return whole is not None and whole(self.torch_optimizer, call)

    def sharded_state_reason(self) -> Optional[str]:
        """Why this optimizer's state is split over processes, or None when one process holds it all."""
        inner = self.torch_optimizer
        sharded = adapter_for(inner).sharded_reason
        if sharded is not None:
            return sharded(inner)
        wrapper: Any = self
        while isinstance(wrapper, AtorchOptimizer):
            if wrapper.backward_in_forward:
                return "under pipeline parallelism this process's optimizer holds only its stage's parameters"
            wrapper = wrapper.optimizer
        if any(isinstance(p, DTensor) for group in inner.param_groups for p in group["params"]):
            return "the parameters are DTensor shards (fsdp, zero2 or tensor_parallel): the state would be shards"
        return None

    def _refuse_sharded(self, call: str) -> None:
        reason = self.sharded_state_reason()
        if reason is not None:
            raise ShardedStateError(
                f"result.optim.{call} is refused: {reason}. Use atorch.save_checkpoint(path, result) and "
                "atorch.load_checkpoint(path, result) (every process calls them; any strategy can load the result), "
                "or atorch.export_model(result, path) for the weights", key=call)

    def add_param_group(self, group: dict) -> None:
        self.optimizer.add_param_group(group)

    def __getattr__(self, name: str) -> Any:
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:  # not built yet (unpickling): no attribute, rather than a KeyError
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __getstate__(self) -> dict:  # a plain object's, not torch.optim.Optimizer's (which has no wrapper)
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
