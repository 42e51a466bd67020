"""``model.no_sync()`` on what auto_accelerate returns, whatever the strategy.

A loop written for DDP accumulates gradients as ``with model.no_sync(): loss.backward()`` on every
micro-step but the last (HF accelerate's ``accelerator.no_sync`` does the same). DDP has the method;
an FSDP2 module, a tensor-parallel model, a pipeline stage and DeepSpeed's ZeRO engine do not (or
refuse it), so the same loop raised AttributeError under fsdp. Where the returned model has no such
method it gets one that does what ``optim.set_gradient_accumulation_boundary(False)`` does for the code
inside (each strategy's own switch: FSDP's ``set_requires_gradient_sync``, DeepSpeed's boundary, a
pipeline's reduction of its stage gradients) and puts the previous boundary back on exit, so the next
backward outside it communicates the whole window's gradients.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from torch import nn


def route_no_sync(model: nn.Module, optimizer: Any) -> None:
    """Give ``model`` a ``no_sync()`` driven by ``optimizer`` (an AtorchOptimizer, held weakly) unless it
    has its own (DDP's). DeepSpeed's engine has one that refuses ZeRO-2 (an AssertionError) and that its
    step cannot follow without the boundary the loop marks here: that one is replaced."""
    own = getattr(model, "no_sync", None)
    if optimizer is None or (callable(own) and not type(model).__module__.startswith("deepspeed")):
        return
    model.__dict__["no_sync"] = _NoSync(weakref.ref(optimizer))


class _NoSync:
    """The returned model's ``no_sync``: gradients of the backward passes inside stay on this process.
    A pickled copy of the model (``torch.save`` of the whole module) gets ``_CopyNoSync``: alone, a copy
    has no gradient traffic to skip."""

    def __init__(self, optimizer_ref: weakref.ref):
        self.optimizer_ref = optimizer_ref

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        optimizer = self.optimizer_ref()
        if optimizer is None:  # the run's optimizer is gone: nothing communicates
            yield
            return
        was_boundary = optimizer.is_gradient_accumulation_boundary
        optimizer.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            optimizer.set_gradient_accumulation_boundary(was_boundary)

    def __reduce__(self) -> tuple:
        return _CopyNoSync, ()


class _CopyNoSync:
    """``no_sync`` of an unpickled copy of an accelerated model: nothing to skip."""

    def __call__(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()
