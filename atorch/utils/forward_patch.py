"""Replacing a module's ``forward`` on the instance, in a way ``copy.deepcopy`` carries over correctly.

Methods that wrap a module's forward (amp_native's autocast, checkpoint's recomputation, fp8's
autocast, native_dynamo's compiled blocks) patch the instance, so state-dict keys do not change. A
closure over the old bound forward would survive ``copy.deepcopy`` unchanged (functions are copied
by reference): the copy (an EMA model, a teacher, a reference) would then run the *original*
module's weights, silently. A ``PatchedForward`` is an object instead: deep-copying the module
deep-copies it, which rebinds ``inner`` (a method bound to the module, or another
``PatchedForward``) to the copy. ``wrapper`` is a module-level function, ``options`` plain values.
Pickling one is refused with a clear error (save the state dict instead): a bound method pickles as
a lookup of ``forward`` on the module, which would find the patch itself again.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

from torch import nn

Wrapper = Callable[..., Any]  # wrapper(inner, options, *args, **kwargs)


class PatchedForward:
    """``wrapper(inner, options, *args, **kwargs)`` as a module's forward; see the module doc."""

    def __init__(self, wrapper: Wrapper, inner: Callable, options: Optional[dict] = None):
        self.wrapper, self.inner, self.options = wrapper, inner, dict(options or {})
        functools.update_wrapper(self, inner, updated=())  # name, doc and __wrapped__: signatures still read

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(self.inner, self.options, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "PatchedForward":
        return PatchedForward(self.wrapper, copy.deepcopy(self.inner, memo), copy.deepcopy(self.options, memo))

    def __reduce__(self):
        raise TypeError("a module whose forward atorch wrapped (amp_native, checkpoint, fp8, native_dynamo) cannot "
                        "be pickled whole; save its state_dict (atorch.save_checkpoint) and rebuild it")


def patch_forward(module: nn.Module, wrapper: Wrapper, **options: Any) -> None:
    """Make ``module.forward`` run ``wrapper(previous_forward, options, *args, **kwargs)``."""
    module.forward = PatchedForward(wrapper, module.forward, options)


def replace_innermost_forward(module: nn.Module, make: Callable[[Callable], Callable]) -> None:
    """Replace the method at the bottom of ``module``'s patches (its class's forward, bound to it) with
    ``make(that method)``, keeping every patch above it (a checkpoint then recomputes the new one)."""
    holder: Optional[PatchedForward] = None
    forward = module.forward
    while isinstance(forward, PatchedForward):
        holder, forward = forward, forward.inner
    if holder is None:
        module.forward = make(forward)
    else:
        holder.inner = make(forward)
