"""Which methods cannot be combined: rules in one place, not ifs scattered over methods."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from atorch.errors import IncompatibleMethodsError

# At most one method of each set may appear in a strategy.
EXCLUSIVE_SETS: tuple[tuple[frozenset, str], ...] = (
    (frozenset({"zero1", "zero2", "fsdp", "ds_3d_parallel"}), "choose one sharding level"),
    (frozenset({"tensor_parallel", "mixed_parallel", "ds_3d_parallel"}),
     "mixed_parallel already includes tensor parallel"),
    (frozenset({"pipeline_parallel", "mixed_parallel", "ds_3d_parallel"}),
     "mixed_parallel already includes pipeline parallel"),
    (frozenset({"micro_batch", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel"}),
     "a pipeline splits the batch into micro-batches itself: set its num_micro_batch"),
)


# A method that only works together with another one.
REQUIRES: dict[str, tuple[str, ...]] = {
    "sequence_parallel": ("tensor_parallel", "mixed_parallel"),
}


def precision_of(name: str, config: Any) -> torch.dtype | None:
    """The low-precision dtype a method asks for, if any (configs are normalized: AmpNativeConfig,
    HalfConfig)."""
    return config.dtype if name in ("amp_native", "half") else None


def check_compatible(items: Sequence[tuple[str, Any]]) -> None:
    """Raise a typed error naming the clashing methods; ``items`` are (name, normalized config)."""
    names = [name for name, _ in items]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise IncompatibleMethodsError(
            f"method(s) {duplicates} appear more than once in the strategy; keep one of each")
    for members, why in EXCLUSIVE_SETS:
        clash = [n for n in names if n in members]
        if len(clash) > 1:
            raise IncompatibleMethodsError(f"{' and '.join(clash)} cannot be combined: {why}")
    for name, needs in REQUIRES.items():
        if name in names and not any(n in names for n in needs):
            raise IncompatibleMethodsError(f"{name} needs one of {list(needs)} in the strategy")
    dtypes = {name: precision_of(name, config) for name, config in items}
    chosen = {name: dtype for name, dtype in dtypes.items() if dtype is not None}
    if len(set(chosen.values())) > 1:
        detail = ", ".join(f"{n} asks for {str(d).replace('torch.', '')}" for n, d in chosen.items())
        raise IncompatibleMethodsError(f"fp16 and bf16 are both requested ({detail}); use one precision")
