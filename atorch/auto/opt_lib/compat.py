"""Which methods cannot be combined, checked from what each method declares: the exclusive groups
it belongs to (``excludes``), the methods it needs beside it (``requires_one_of``) and the precision
it trains in (``precision``). No method is named here."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from atorch.auto.opt_lib.facts import exclusive_groups
from atorch.auto.opt_lib.registry import registered_methods
from atorch.errors import IncompatibleMethodsError


def precision_of(name: str, config: Any) -> Optional[torch.dtype]:
    """The low-precision dtype a method asks for with this normalized config, if any."""
    method = next((m for m in registered_methods() if m.name == name), None)
    return method.precision(config) if method is not None else None


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
