"""Walking a user's batch (a tensor, or dicts / lists / tuples / namedtuples of them).

One home for every walk over a nested batch, all on ``torch.utils._pytree`` so that containers
PyTorch knows (namedtuples, OrderedDict, HF ``ModelOutput``) keep their type.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from atorch.errors import InputError


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``data`` with every tensor replaced by ``fn(tensor)``; other leaves stay as they are."""
    return pytree.tree_map_only(torch.Tensor, fn, data)


def tensors(data: Any) -> list[torch.Tensor]:
    """Every tensor in ``data``, in pytree order."""
    return [leaf for leaf in pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]


def first_tensor(data: Any) -> Optional[torch.Tensor]:
    """The first tensor in a (nested) batch, or None."""
    found = tensors(data)
    return found[0] if found else None


def batch_size_of(data: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor (1 for a scalar or no tensor)."""
    tensor = first_tensor(data)
    if tensor is None or tensor.dim() == 0:
        return 1
    return tensor.shape[0]


def move_to_device(data: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=True), data)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors cast to ``dtype``; integer tensors (token ids, masks) are left alone."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)


def to_meta(data: Any) -> Any:
    """The same structure on the meta device (shapes only, no memory)."""
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), data)


def select_rows(data: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` of every tensor in the batch (micro-batch slicing)."""
    return map_tensors(lambda t: t.index_select(0, index.to(t.device)), data)


def loss_value(output: Any) -> torch.Tensor:
    """``loss_func`` may return the loss or a list/tuple whose first item is the loss."""
    loss = output[0] if isinstance(output, (list, tuple)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputError(
            f"loss_func must return a scalar tensor (or a list/tuple starting with one), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss
