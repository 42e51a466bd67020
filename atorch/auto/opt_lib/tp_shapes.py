"""Shapes that model code reads at run time, made local under tensor parallelism.

Attention code often sizes its views from its input or from attributes: timm's
``qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)`` and ``x.reshape(B, N, C)``,
nanoGPT's ``c_attn(x).split(self.n_embd, dim=2)``, GPT-2's ``split(self.split_size)``. Under a
column split each rank holds 1/tp of the heads, so those sizes are tp times too large. Two remedies,
tried in this order by ``tensor_parallel`` (the first that reproduces the unsplit model on the sample
wins):

1. ``ShapeLocalizer``: while a split region (the module holding one attention's or MLP's
   projections) runs, a view / reshape whose shape does not fit the local tensor, or a split whose
   size no longer tiles it, has one size that equals a full width or head count of that region
   replaced by its per-rank share. Shapes that fit are left alone, but for one: a view of the features
   into a full head count and ``-1`` (DeBERTa's ``view(B, N, num_heads, -1)``) fits a rank's share as
   that many heads of 1/tp the head size, a wrong grouping that at initialisation (attention nearly
   uniform) moves the output too little for the plan check to see; where the attention's head size is
   known and only the per-rank head count gives it, the count is made local. A slice of a fused projection's
   output (Phi-3's ``qkv[..., q_width : q_width + kv_width]``) whose bounds are one of its parts in the
   full layout is cut from the rank's own layout instead (each rank holds its share of every part, in
   order: ``tensor_parallel._interleave_fused``); such slices fit the local tensor but would read the
   wrong part, so they are rewritten whether or not they fit. A tensor built for every head and
   broadcast against the rank's heads (MPT's ALiBi bias ``[heads, 1, keys]`` added to the scores) is cut
   to the rank's contiguous heads (``local_side_input``); parameters are never cut.
2. ``localize_attributes``: with 1, the integer attributes equal to a full head count (``n_heads``,
   ...) of the region module and of its parameter-free submodules become the per-rank values, for
   code that builds tensors from them (T5's zero position bias) or views by them (DeBERTa's);
   failing that, those equal to a full width too (``inner_dim``).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from atorch.auto.opt_lib.tp_experts import gradient_summed
from atorch.utils.dataflow import ADD_MATMUL, BROADCASTS, add_matmul_arguments

VIEWS = frozenset({"view", "reshape"})
SPLITS = frozenset({"split"})


class ShapeLocalizer(TorchFunctionMode):
    """Rewrites the shapes of views and splits that do not fit a rank's share (see module doc)."""

    def __init__(self, full_sizes: set[int], tp: int, fused_parts: Sequence[Sequence[int]] = (),
                 head_dims: frozenset = frozenset(), rank: int = 0):
        super().__init__()
        self.full_sizes, self.tp, self.head_dims, self.rank = full_sizes, tp, frozenset(head_dims), rank
        self.part_bounds = part_bounds(fused_parts, tp)
        self.rewrites = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in VIEWS and args and isinstance(args[0], torch.Tensor) and not kwargs:
            shape = _shape_args(args[1:])
            if shape is not None:
                local = local_view_shape(args[0], shape, self.full_sizes, self.tp, self.head_dims)
                if local is not None:
                    self.rewrites += 1
                    args = (args[0], tuple(local))
        elif name in SPLITS and args and isinstance(args[0], torch.Tensor):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            size = local_split_size(args[0], args[1] if len(args) > 1 else kwargs.get("split_size_or_sections"),
                                    dim, self.full_sizes, self.tp)
            if size is not None:
                self.rewrites += 1
                args = (args[0], size, *args[2:])
                kwargs = {k: v for k, v in kwargs.items() if k != "split_size_or_sections"}
        elif name == "__getitem__" and self.part_bounds and len(args) == 2 and isinstance(args[0], torch.Tensor):
            index = local_part_index(args[0], args[1], self.part_bounds, self.tp)
            if index is not None:
                self.rewrites += 1
                args = (args[0], index)
        elif name in ADD_MATMUL:
            args, kwargs = self._localize_added_input(args, kwargs)
        elif name in BROADCASTING and len(args) >= 2:
            local = local_side_input(args[0], args[1], self.full_sizes, self.tp, self.rank)
            if local is not None:
                self.rewrites += 1
                args = (*local, *args[2:])
        return func(*args, **kwargs)


    def _localize_added_input(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``baddbmm``'s added input (BLOOM's ALiBi bias, built for every head) cut to this rank's heads."""
        given = add_matmul_arguments(args, kwargs)
        local = local_merged_heads_input(given.get("input"), given.get("batch1"), self.full_sizes, self.head_dims,
                                         self.tp, self.rank)
        if local is None:
            return args, kwargs
        self.rewrites += 1
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "input": local}


# binary ops that broadcast their operands: a side input built for every head (ALiBi's per-head slopes,
# MPT's position bias [heads, 1, keys]) meets the scores of this rank's heads there
BROADCASTING = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "mul",
                          "__mul__", "__rmul__"})


def local_side_input(first: Any, second: Any, full_sizes: set[int], tp: int,
                     rank: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(first, second) with the one that is a full size where the other holds its per-rank share (the
    dimensions aligned from the right, as broadcasting aligns them; exactly one such dimension, every
    other equal or 1) cut to this rank's contiguous share there; None when nothing needs cutting. A
    parameter is never cut: a whole one used by a split computation gets a gradient per rank, which the
    plan's check refuses (its forward mismatch names it first)."""
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return None
    if isinstance(first, nn.Parameter) or isinstance(second, nn.Parameter):
        return None
    pairs = list(zip(reversed(first.shape), reversed(second.shape)))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b and a != 1 and b != 1]
    if len(differ) != 1:
        return None
    a, b = pairs[differ[0]]
    full, share = max(a, b), min(a, b)
    if full not in full_sizes or full != share * tp:
        return None
    cut = lambda t: t.narrow(t.dim() - 1 - differ[0], rank * share, share)  # noqa: E731
    return (cut(first), second) if a == full else (first, cut(second))


def local_merged_heads_input(added: Any, batch1: Any, full_sizes: set[int], head_dims: frozenset, tp: int,
                             rank: int) -> Optional[torch.Tensor]:
    """The tensor a batched matmul adds its product to, built for every head with the batch and the heads
    merged batch-major in its first dimension (BLOOM's ALiBi bias ``[batch * heads, 1, keys]``), cut to this
    rank's contiguous heads of each batch row where the product holds 1/tp of those rows; None when it
    needs no cut. The head count is the one full size that, times a head size of the region, is one of its
    full widths (a width alone would group the rows wrongly); with several such sizes nothing is cut."""
    if not (isinstance(added, torch.Tensor) and isinstance(batch1, torch.Tensor)) or isinstance(added, nn.Parameter):
        return None
    if added.dim() != batch1.dim() or added.shape[0] != batch1.shape[0] * tp:
        return None
    rows = added.shape[0]
    heads = {h for h in full_sizes if h % tp == 0 and rows % h == 0 and any(h * d in full_sizes for d in head_dims)}
    if len(heads) != 1:
        return None
    (count,) = heads
    share = count // tp
    grouped = added.reshape(rows // count, count, *added.shape[1:])
    return grouped.narrow(1, rank * share, share).reshape(rows // tp, *added.shape[1:])


def part_bounds(fused_parts: Sequence[Sequence[int]], tp: int) -> dict[int, set[tuple[int, int]]]:
    """Per full width of a fused projection whose every part divides by ``tp``: its parts' (start,
    stop) in the full layout."""
    bounds: dict[int, set[tuple[int, int]]] = {}
    for parts in fused_parts:
        if len(parts) < 2 or any(p % tp for p in parts):
            continue
        ends = [sum(parts[:i + 1]) for i in range(len(parts))]
        bounds.setdefault(sum(parts), set()).update(zip([0, *ends[:-1]], ends))
    return bounds


def local_part_index(tensor: torch.Tensor, index: Any, bounds: dict[int, set[tuple[int, int]]], tp: int) -> Any:
    """``index`` (slices and an Ellipsis only) with each slice that cuts one part of a fused output in
    the full layout along a dimension holding 1/tp of that output made the rank's own part; None when
    nothing is rewritten."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or items.count(Ellipsis) > 1:
        return None
    cut = items.index(Ellipsis) if Ellipsis in items else len(items)
    rewritten, changed = list(items), False
    for position, item in enumerate(items):
        if item is Ellipsis or item == slice(None):
            continue
        dim = position if position < cut else tensor.dim() - (len(items) - position)
        local = _local_part(item, tensor.shape[dim] * tp if 0 <= dim < tensor.dim() else 0, bounds, tp)
        if local is not None:
            rewritten[position], changed = local, True
    if not changed:
        return None
    return tuple(rewritten) if isinstance(index, tuple) else rewritten[0]


def _local_part(item: slice, full: int, bounds: dict[int, set[tuple[int, int]]], tp: int) -> Optional[slice]:
    start, stop = item.start or 0, full if item.stop is None else item.stop
    if item.step not in (None, 1) or not isinstance(start, int) or not isinstance(stop, int):
        return None
    if (start, stop) not in bounds.get(full, ()):
        return None
    return slice(start // tp, None if item.stop is None else stop // tp, item.step)


def _shape_args(rest: tuple) -> Optional[list[int]]:
    shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
    if not all(isinstance(s, int) for s in shape):
        return None
    return list(shape)


def _fits(shape: Sequence[int], numel: int) -> bool:
    known = math.prod([s for s in shape if s != -1])  # a list: dynamo traces math.prod of a list, not of a generator
    if -1 in shape:
        return known > 0 and numel % known == 0
    return known == numel


def local_view_shape(tensor: torch.Tensor, shape: list[int], full_sizes: set[int], tp: int,
                     head_dims: frozenset = frozenset()) -> Optional[list[int]]:
    """``shape`` with one full size made local when the shape does not fit ``tensor`` (or splits it into
    heads of the wrong size: ``_wrong_head_size``); the leading sizes equal to the tensor's own (batch,
    sequence) are never candidates. None: leave it."""
    numel = tensor.numel()
    heads = _wrong_head_size(shape, numel, full_sizes, tp, head_dims)
    if heads is not None:
        return heads
    start = 0
    while start < min(len(shape), tensor.dim()) and shape[start] == tensor.shape[start]:
        start += 1
    wanted = _inferred_dim_wanted(tensor, shape, start)
    if _fits(shape, numel) and (wanted is None or _inferred(shape, numel) == wanted):
        return None
    for position in range(start, len(shape)):
        size = shape[position]
        if size in full_sizes and size % tp == 0:
            candidate = shape[:position] + [size // tp] + shape[position + 1:]
            if _fits(candidate, numel) and (wanted is None or _inferred(candidate, numel) == wanted):
                return candidate
    return None


def _wrong_head_size(shape: list[int], numel: int, full_sizes: set[int], tp: int,
                     head_dims: frozenset) -> Optional[list[int]]:
    """``[.., heads, -1]`` with a full head count that leaves -1 a size other than the attention's head size,
    where the per-rank count leaves the head size: that shape, made local."""
    if len(shape) < 2 or shape[-1] != -1 or shape.count(-1) != 1 or not head_dims:
        return None
    heads = shape[-2]
    if heads not in full_sizes or heads % tp or heads == tp or not _fits(shape, numel):
        return None
    local = shape[:-2] + [heads // tp, -1]
    if _inferred(shape, numel) not in head_dims and _fits(local, numel) and _inferred(local, numel) in head_dims:
        return local
    return None


def _inferred_dim_wanted(tensor: torch.Tensor, shape: list[int], start: int) -> Optional[int]:
    """With ``view(B, -1, C)`` right after the leading sizes that match, the -1 stands for the
    tensor's own size there (the sequence): a full C would silently halve it instead."""
    if -1 not in shape or len(shape) >= tensor.dim():  # only merges (heads into the width) are read this way
        return None
    position = shape.index(-1)
    return tensor.shape[position] if position == start and position < tensor.dim() else None


def _inferred(shape: list[int], numel: int) -> int:
    return numel // max(1, math.prod([s for s in shape if s != -1]))


def local_split_size(tensor: torch.Tensor, size: Any, dim: int, full_sizes: set[int], tp: int) -> Any:
    """A split size (or list of sizes) made local when it no longer tiles the split dimension."""
    length = tensor.shape[dim]
    if isinstance(size, int):
        if size in full_sizes and size % tp == 0 and length % size and (length * tp) % size == 0:
            return size // tp
        return None
    if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size) and sum(size) == length * tp:
        if all(s % tp == 0 for s in size):
            return [s // tp for s in size]
    return None


def install_localizer(region: nn.Module, full_sizes: set[int], tp: int, fused_parts: Sequence[Sequence[int]] = (),
                      head_dims: frozenset = frozenset(), rank: int = 0) -> ShapeLocalizer:
    """Run ``region``'s forward under a ShapeLocalizer (its ``rewrites`` count tells whether it was needed);
    ``rank``: this process's place in the tensor group (which share of a full side input it keeps)."""
    return _run_under(region, ShapeLocalizer(full_sizes, tp, fused_parts, head_dims, rank))


def _run_under(region: nn.Module, mode: TorchFunctionMode) -> TorchFunctionMode:
    """Enter ``mode`` for each forward of ``region`` (``mode.handles`` removes the hooks)."""
    def enter(module, args, kwargs):
        mode.__enter__()

    def leave(module, args, output):
        mode.__exit__(None, None, None)

    mode.handles = [region.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
                    region.register_forward_hook(leave, always_call=True)]
    return mode


class SharedHeadGradients(TorchFunctionMode):
    """In a split attention, a tensor of one head broadcast to the rank's heads (multi-head latent
    attention's rotary key, ``k_rot.expand(.., heads, ..)``) gets from them only their part of its
    gradient: it is broadcast through ``gradient_summed``, so its gradient is summed over the tensor
    group, as one process's broadcast to every head sums it. ``shared``: (ndim, heads dim, last size)
    of the tensors the recorded forward broadcast so."""

    def __init__(self, shared: list, tp_mesh: Any):
        super().__init__()
        self.shared, self.tp_mesh = {tuple(s) for s in shared}, tp_mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in BROADCASTS and args and isinstance(args[0], torch.Tensor):
            tensor = args[0]
            dims = [d for d in range(tensor.dim()) if (tensor.dim(), d, tensor.shape[-1]) in self.shared
                    and tensor.shape[d] == 1]
            if dims:
                out = func(gradient_summed(tensor, self.tp_mesh), *args[1:], **kwargs)
                if any(out.shape[d] > 1 for d in dims):
                    return out
        return func(*args, **kwargs)


def install_shared_head_gradients(region: nn.Module, shared: list, tp_mesh: Any) -> SharedHeadGradients:
    """Run ``region``'s forward under ``SharedHeadGradients``."""
    return _run_under(region, SharedHeadGradients(shared, tp_mesh))


def remove_localizer(mode: ShapeLocalizer) -> None:
    for handle in getattr(mode, "handles", ()):
        handle.remove()


def localize_attributes(region: nn.Module, full_sizes: set[int], tp: int) -> dict[tuple[str, str], int]:
    """Divide the integer attributes equal to one of ``full_sizes`` (head counts, or head counts and
    widths) of the region and of the modules inside it that hold no parameters of their own (DeBERTa's
    region, the attention block, holds the self-attention module whose ``num_attention_heads`` its code
    reads; a Linear's or an embedding's own sizes are left as they are); returns the old values, by
    (module path inside the region, attribute), so the change can be undone."""
    changed = {}
    for path, module in region.named_modules():
        if path and next(module.parameters(recurse=False), None) is not None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, int) and not isinstance(value, bool) and value in full_sizes and value % tp == 0:
                changed[(path, attr)] = value
                setattr(module, attr, value // tp)
    return changed


def restore_attributes(region: nn.Module, changed: dict[tuple[str, str], int]) -> None:
    for (path, attr), value in changed.items():
        setattr(region.get_submodule(path), attr, value)
