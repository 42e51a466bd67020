"""Walking a user's batch (a tensor, or dicts / lists / tuples / namedtuples of them).

One home for every walk over a nested batch, all on ``torch.utils._pytree`` so that containers
PyTorch knows (namedtuples, OrderedDict, HF ``ModelOutput``) keep their type.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from atorch.errors import InputError


def call_with_batch(model: Any, batch: Any, input_format: Optional[str]) -> Any:
    """``model`` called on ``batch`` as ``model_input_format`` says: ``model(*batch)`` for
    "unpack_sequence", ``model(**batch)`` for "unpack_dict", else ``model(batch)``."""
    if input_format == "unpack_sequence":
        return model(*batch)
    if input_format == "unpack_dict":
        return model(**batch)
    return model(batch)


def dict_of_forward_arguments(model: Any, batch: Any) -> bool:
    """Whether ``model(batch)`` could only be a mistake for ``model(**batch)``: ``batch`` is a mapping
    holding the name of the forward's first positional parameter (``model(batch)`` would bind the whole
    mapping to it: HF's ``input_ids``), and every key is a parameter of the forward (or it takes
    ``**kwargs``). A forward taking the mapping itself (``forward(self, batch)``, keys ``x`` / ``y``)
    does not match, since its first parameter is not one of the keys."""
    if not isinstance(batch, Mapping) or not batch or not all(isinstance(k, str) for k in batch):
        return False
    try:
        parameters = inspect.signature(_signature_holder(model).forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    positional = [p for p in parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not positional or positional[0].name not in batch:
        return False
    open_keywords = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return open_keywords or set(batch) <= set(parameters)


def _signature_holder(model: Any, depth: int = 8) -> Any:
    """The module whose forward says what a call binds: ``model``, or where its forward only passes
    ``*args, **kwargs`` on (PEFT's ``PeftModel`` and ``LoraModel``, other wrappers), the child that holds
    every one of its parameters, as deep as such wrappers go."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for _ in range(depth):
        try:
            parameters = inspect.signature(model.forward).parameters.values()
        except (TypeError, ValueError, AttributeError):
            return model
        if not parameters or not all(p.kind in variadic for p in parameters) or not hasattr(model, "children"):
            return model
        total = sum(1 for _ in model.parameters())
        inner = [child for child in model.children() if total and sum(1 for _ in child.parameters()) == total]
        if len(inner) != 1:
            return model
        model = inner[0]
    return model


def equal_chunks(rows: int, preferred: int, largest: Optional[int] = None) -> int:
    """How many equal micro-batches a batch of ``rows`` rows runs as: ``preferred`` when it divides them
    into chunks of at most ``largest`` rows (the configured micro-batch's size); else the fewest equal
    chunks of at most that many rows (an epoch's last batch, without drop_last: 6 rows for 4 micro-batches
    of 2 run as 3 of 2; 7 rows as 7 of 1); without ``largest``, the most equal chunks up to ``preferred``.
    Equal chunks keep the mean of the micro-steps' mean losses the batch's mean, and no chunk is larger
    than the ones memory was planned for."""
    if not largest:
        return next(c for c in range(min(preferred, rows), 0, -1) if rows % c == 0)
    if rows % preferred == 0 and rows // preferred <= largest:
        return preferred
    return next(c for c in range(1, rows + 1) if rows % c == 0 and rows // c <= largest)


def batch_of_call(args: tuple, kwargs: dict, input_format: Optional[str]) -> Any:
    """The batch a wrapper's ``forward(*args, **kwargs)`` was called with (the inverse of
    ``call_with_batch``): the keywords, the positional tuple, or the one argument."""
    if input_format == "unpack_dict":
        return kwargs
    if input_format == "unpack_sequence":
        return args
    return args[0]


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


def batch_size_of(data: Any, expected: Optional[int] = None, shared: frozenset[str] = frozenset()) -> int:
    """Rows in a batch: ``expected`` (the rows a method planned for) where a tensor's first dimension is
    that, else the first dimension most of its tensors share, the first tensor's where none is shared
    more (1 for scalars or no tensor). Not simply the first tensor's: a script's collate may put an input
    the rows share (a sequence x sequence mask) before the rows themselves. ``shared``: the paths
    (``pytree.keystr``) of inputs the data pipeline does not stack rows into, never counted."""
    leaves = pytree.tree_flatten_with_path(data)[0]
    sizes = [t.shape[0] for path, t in leaves
             if isinstance(t, torch.Tensor) and t.dim() > 0 and not _at(path, shared)]
    if not sizes:
        return 1
    if expected in sizes:
        return expected
    return max(sizes, key=sizes.count)  # the first of the most common: ties go to the earliest tensor


def move_to_device(data: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=True), data)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors cast to ``dtype``; integer tensors (token ids, masks) are left alone."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)


def to_meta(data: Any) -> Any:
    """The same structure on the meta device (shapes only, no memory)."""
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), data)


def holds_rows(tensor: torch.Tensor, rows: int) -> bool:
    """Whether ``tensor`` holds the batch's rows (its first dimension is the batch's ``rows``). A tensor of
    another first dimension, or none (an attention mask shared by every row, as nn.Transformer's
    ``generate_square_subsequent_mask`` makes; a position table; a scalar), is the same for every row:
    a micro-batch takes it whole, not a slice of it."""
    return tensor.dim() > 0 and tensor.shape[0] == rows


def select_rows(data: Any, index: torch.Tensor, rows: int, shared: frozenset[str] = frozenset()) -> Any:
    """The rows ``index`` of every tensor in the batch that holds its ``rows`` rows (micro-batch slicing);
    the others whole (``holds_rows``), and those at the ``shared`` paths whatever their shape."""
    return on_rows(lambda t: t.index_select(0, index.to(t.device)), data, rows, shared)


def narrow_rows(data: Any, start: int, length: int, rows: int, shared: frozenset[str] = frozenset()) -> Any:
    """Rows ``start`` to ``start + length`` of every tensor in the batch that holds its ``rows`` rows, the
    others whole (``holds_rows``), and those at the ``shared`` paths whatever their shape."""
    return on_rows(lambda t: t.narrow(0, start, length), data, rows, shared)


def on_rows(fn: Callable[[torch.Tensor], Any], data: Any, rows: int, shared: frozenset[str] = frozenset()) -> Any:
    """``data`` with ``fn`` applied to every tensor that holds the batch's rows (``holds_rows``) and is not
    at one of the ``shared`` paths (inputs the data pipeline does not stack rows into: their first
    dimension may equal the rows by coincidence, as a sequence x sequence mask does when the batch has as
    many rows as the sequence has tokens)."""
    def apply(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and holds_rows(leaf, rows) and not _at(path, shared):
            return fn(leaf)
        return leaf

    return pytree.tree_map_with_path(apply, data)


def _at(path: Any, paths: frozenset[str]) -> bool:
    """Whether a pytree ``path`` is one of ``paths`` (``pytree.keystr`` form; formatted only when asked)."""
    return bool(paths) and pytree.keystr(path) in paths


def loss_value(output: Any) -> torch.Tensor:
    """``loss_func`` may return the loss or a list/tuple whose first item is the loss."""
    if isinstance(output, (list, tuple)) and not output:
        raise InputError(f"loss_func must return a scalar tensor (or a list/tuple starting with one), got an empty "
                         f"{type(output).__name__}")
    loss = output[0] if isinstance(output, (list, tuple)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputError(
            f"loss_func must return a scalar tensor (or a list/tuple starting with one), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss


class SampleRowsDataset(torch.utils.data.Dataset):
    """A map-style dataset of ``length`` rows made by repeating the rows of one sample batch: row
    ``i`` is row ``i % rows`` of every tensor in ``sample`` (non-tensor leaves are kept as they
    are). auto_accelerate's ``sample_batch``: what dry runs and the search train on when no dataset
    is given; DataLoader's default collate turns the rows back into batches of the sample's structure."""

    def __init__(self, sample: Any, length: int):
        found = tensors(sample)
        if not found:
            raise InputError("sample_batch must hold at least one tensor (a tensor, or a dict / list / tuple of them)")
        firsts = {tuple(t.shape[:1]) for t in found}
        if any(t.dim() == 0 for t in found) or len(firsts) != 1:
            raise InputError(f"sample_batch's tensors must share their first (batch) dimension; their shapes are "
                             f"{[tuple(t.shape) for t in found]}")
        self.sample = map_tensors(lambda t: t.detach(), sample)
        self.rows = found[0].shape[0]
        if self.rows < 1:
            raise InputError("sample_batch has 0 rows: give a batch with at least one row")
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.length:
            raise IndexError(index)
        row = index % self.rows
        return map_tensors(lambda t: t[row], self.sample)


def stacking_dims(one: Any, two: Any) -> Optional[list[tuple[str, tuple[int, ...], Optional[int]]]]:
    """Where a data pipeline stacks a batch's rows, read from the same row collated once (``one``) and
    twice (``two``): for each tensor of the batch, its path, its shape in ``two`` and the first dimension
    that doubled between the two (None where none did: an input the rows share, such as one causal mask).
    None where the two batches differ in structure (a collate that does not stack rows)."""
    leaves_one, spec_one = pytree.tree_flatten_with_path(one)
    leaves_two, spec_two = pytree.tree_flatten_with_path(two)
    if spec_one != spec_two:
        return None
    out = []
    for (path, single), (_, double) in zip(leaves_one, leaves_two):
        if not isinstance(single, torch.Tensor) or not isinstance(double, torch.Tensor):
            continue
        if single.dim() != double.dim():
            return None
        doubled = [d for d in range(single.dim()) if double.shape[d] == 2 * single.shape[d] and single.shape[d]]
        out.append((pytree.keystr(path), tuple(double.shape), doubled[0] if doubled else None))
    return out
