"""Which methods cannot be combined, checked from what each method declares: the exclusive groups
it belongs to (``excludes``), the methods it needs beside it (``requires_one_of``), the precision
it trains in (``precision``) and whether it stores the parameters in it (``stores_weights_in``) or needs
them in fp32 (``needs_fp32_weights``). No method is named here."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.facts import exclusive_groups
from atorch.auto.opt_lib.registry import registered_methods
from atorch.errors import IncompatibleMethodsError


def precision_of(name: str, config: Any) -> Optional[torch.dtype]:
    """The low-precision dtype a method asks for with this normalized config, if any."""
    method = _method(name)
    return method.precision(config) if method is not None else None


def _method(name: str) -> Optional[Optimization]:
    return next((m for m in registered_methods() if m.name == name), None)


def _check_weight_dtypes(items: Sequence[tuple[str, Any]]) -> None:
    """A method that needs fp32 parameters cannot go beside one that stores them in low precision."""
    methods = [(name, _method(name), config) for name, config in items]
    casting = [(name, m.stores_weights_in(config)) for name, m, config in methods if m is not None]
    casting = [(name, dtype) for name, dtype in casting if dtype is not None and dtype != torch.float32]
    for name, method, config in methods:
        why = method.needs_fp32_weights(config) if method is not None else None
        if why and casting:
            other, dtype = casting[0]
            raise IncompatibleMethodsError(
                f"{name} and {other} cannot be combined here: {name} needs fp32 parameters ({why}), and {other} "
                f"stores them in {str(dtype).replace('torch.', '')}. Use {name} alone (fp32 parameters, "
                f"low-precision compute), or bf16 for both (no loss scaler)")


def check_compatible(items: Sequence[tuple[str, Any]]) -> None:
    """Raise a typed error naming the clashing methods; ``items`` are (name, normalized config)."""
    names = [name for name, _ in items]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise IncompatibleMethodsError(
            f"method(s) {duplicates} appear more than once in the strategy; keep one of each")
    for _, members, why in exclusive_groups():
        clash = [n for n in names if n in members]
        if len(clash) > 1:
            raise IncompatibleMethodsError(f"{' and '.join(clash)} cannot be combined: {why}")
    for method in registered_methods():
        needs = method.requires_one_of
        if needs and method.name in names and not any(n in names for n in needs):
            raise IncompatibleMethodsError(f"{method.name} needs one of {list(needs)} in the strategy")
    dtypes = {name: precision_of(name, config) for name, config in items}
    chosen = {name: dtype for name, dtype in dtypes.items() if dtype is not None}
    if len(set(chosen.values())) > 1:
        detail = ", ".join(f"{n} asks for {str(d).replace('torch.', '')}" for n, d in chosen.items())
        raise IncompatibleMethodsError(f"fp16 and bf16 are both requested ({detail}); use one precision")
    _check_weight_dtypes(items)
