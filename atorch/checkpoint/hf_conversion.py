"""What transformers changes between the names and layouts ``save_pretrained`` writes and the model's.

transformers 5 keeps a conversion mapping per model type (``transformers.conversion_mapping``): keys
renamed on load (a ViT's ``attention.attention.query`` is its ``attention.q_proj``), and tensors built
from several saved ones. The second matters for every Mixture-of-Experts model: Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek and others hold each layer's experts stacked in one 3-D parameter
(``mlp.experts.gate_up_proj``: experts x 2 ffn x hidden), while their checkpoints, on the Hub and as
``save_pretrained`` writes them, hold one 2-D tensor per expert and projection
(``block_sparse_moe.experts.3.w1.weight``). ``load_pretrained`` reads such a parameter as a
``ComposedSource``: the saved tensors stacked along the experts' dimension (``MergeModulelist``), the
projections concatenated (``Concatenate``), in transformers' order, and only the part a process holds:
under fsdp a rank whose shard holds experts 0 and 1 opens only their tensors.

Other conversions (splitting one saved tensor into several parameters, transposing, interleaving,
RoPE permutations) are not guessed: their parameters are reported missing and their saved keys
unexpected, as for any key ``load_pretrained`` cannot place.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from atorch.checkpoint.tensors import model_roots
from atorch.errors import CheckpointError

CALLER = "load_pretrained"


@dataclass
class ComposedSource:
    """A model tensor built from saved tensors: ``parts`` (one per source pattern, in the converter's
    order), each a list of saved keys stacked along ``stack_dim`` (a ``MergeModulelist``; ``None``: a
    part is one key), the parts concatenated along ``cat_dim`` (``None``: one part)."""

    target: str
    parts: list[list[str]]
    stack_dim: Optional[int]
    cat_dim: Optional[int]
    shapes: dict[str, list[int]] = field(default_factory=dict)  # saved key -> its shape (from the headers)
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [key for part in self.parts for key in part]

    def part_shape(self, part: list[str]) -> list[int]:
        shapes = [self.shapes[key] for key in part]
        for key, shape in zip(part, shapes):
            if shape != shapes[0]:
                raise CheckpointError(f"{CALLER}: {self.target} is built from {part[0]!r} {shapes[0]} and {key!r} "
                                      f"{shape}, which do not stack", key=self.target)
        if self.stack_dim is None:
            return list(shapes[0])
        return shapes[0][:self.stack_dim] + [len(part)] + shapes[0][self.stack_dim:]

    def shape(self) -> list[int]:
        shapes = [self.part_shape(part) for part in self.parts]
        if self.cat_dim is None:
            return shapes[0]
        out = list(shapes[0])
        for part, shape in zip(self.parts[1:], shapes[1:]):
            rest = [n for d, n in enumerate(shape) if d != self.cat_dim]
            if rest != [n for d, n in enumerate(out) if d != self.cat_dim]:
                raise CheckpointError(f"{CALLER}: {self.target} concatenates {part[0]!r} {shape} to {out}, which "
                                      "do not fit", key=self.target)
            out[self.cat_dim] += shape[self.cat_dim]
        return out

    def dtype(self) -> str:
        kinds = {self.dtypes[key] for key in self.keys}
        if len(kinds) > 1:
            raise CheckpointError(f"{CALLER}: {self.target} is built from tensors of several dtypes {sorted(kinds)}",
                                  key=self.target)
        return kinds.pop()

    def read(self, files: "SavedFiles", index: tuple[slice, ...]) -> torch.Tensor:
        """The elements ``index`` (one slice per dimension) of the built tensor, reading only the saved
        tensors (and, of each, only the rows) that fall inside it."""
        if self.cat_dim is None:
            return self._read_part(files, self.parts[0], index)
        pieces, start = [], 0
        for part in self.parts:
            length = self.part_shape(part)[self.cat_dim]
            wanted = index[self.cat_dim]
            low, high = max(wanted.start, start), min(wanted.stop, start + length)
            if low < high:
                inner = list(index)
                inner[self.cat_dim] = slice(low - start, high - start)
                pieces.append(self._read_part(files, part, tuple(inner)))
            start += length
        return torch.cat(pieces, dim=self.cat_dim)

    def _read_part(self, files: "SavedFiles", part: list[str], index: tuple[slice, ...]) -> torch.Tensor:
        if self.stack_dim is None:
            return files.read(part[0], index)
        chosen = index[self.stack_dim]
        rest = index[:self.stack_dim] + index[self.stack_dim + 1:]
        return torch.stack([files.read(part[i], rest) for i in range(chosen.start, chosen.stop)], dim=self.stack_dim)


class SavedFiles:
    """The safetensors files a composed tensor reads, each opened once while in use (``opener`` is
    ``load_pretrained``'s, which names a broken file)."""

    def __init__(self, weight_map: dict[str, str], opener: Callable[[str], Any]):
        self.weight_map, self.opener = weight_map, opener
        self.handles: dict[str, Any] = {}

    def handle(self, key: str) -> Any:
        file = self.weight_map[key]
        if file not in self.handles:
            self.handles[file] = self.opener(file).__enter__()
        return self.handles[file]

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        stored = self.handle(key).get_slice(key)
        if all(s.start == 0 and s.stop == n for s, n in zip(index, stored.get_shape())):
            return self.handle(key).get_tensor(key)
        return stored[index]

    def describe(self, key: str) -> tuple[list[int], str]:
        stored = self.handle(key).get_slice(key)
        return list(stored.get_shape()), stored.get_dtype()

    def __enter__(self) -> "SavedFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()


class ComposedHandle:
    """A stand-in for a safetensors handle over composed tensors (``get_slice``, ``get_tensor``), so
    ``load_pretrained`` checks and copies them as it does saved ones."""

    def __init__(self, sources: dict[str, ComposedSource], files: SavedFiles):
        self.sources, self.files = sources, files
        for source in sources.values():
            for key in source.keys:
                source.shapes[key], source.dtypes[key] = files.describe(key)

    def keys(self) -> list[str]:
        return list(self.sources)

    def get_slice(self, name: str) -> "ComposedSlice":
        return ComposedSlice(self.sources[name], self.files)

    def get_tensor(self, name: str) -> torch.Tensor:
        source = self.sources[name]
        return source.read(self.files, tuple(slice(0, n) for n in source.shape()))


@dataclass
class ComposedSlice:
    source: ComposedSource
    files: SavedFiles

    def get_shape(self) -> list[int]:
        return self.source.shape()

    def get_dtype(self) -> str:
        return self.source.dtype()

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        shape = self.source.shape()
        full = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape)) + tuple(
            slice(0, n) for n in shape[len(index):])
        return self.source.read(self.files, full)


# --- from transformers' conversion mapping ---------------------------------------------------------------
def _transforms(model: nn.Module) -> Optional[tuple[list, list]]:
    """transformers' renamings and converters for ``model`` (an HF model under transformers 5), else None."""
    root = model_roots(model)[0]
    if not (hasattr(root, "config") and hasattr(root, "post_init")):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers < 5 renames nothing on load
        return None
    transforms = get_model_conversion_mapping(root)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _rename(file_key: str, renamings: list, converters: list) -> tuple[str, Optional[str]]:
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(file_key, renamings, converters)


def hf_checkpoint_names(model: nn.Module, file_keys: Iterable[str]) -> dict[str, str]:
    """``{model key: file key}`` for the keys transformers renames when it loads this model (a ViT's
    ``attention.attention.query`` is its ``attention.q_proj``). Renamings only: keys a converter builds
    are ``composed_sources``'."""
    found = _transforms(model)
    if found is None:
        return {}
    renamings, converters = found
    out = {}
    for file_key in file_keys:
        renamed, pattern = _rename(file_key, renamings, converters)
        if pattern is None and renamed != file_key:
            out[renamed] = file_key
    return out


def composed_sources(model: nn.Module, file_keys: Iterable[str]) -> dict[str, ComposedSource]:
    """``{model key: how to build it}`` for the tensors transformers builds from several saved ones with
    the operations read here (``MergeModulelist`` then ``Concatenate``, or either alone); a converter
    with any other operation builds nothing here."""
    found = _transforms(model)
    if found is None:
        return {}
    renamings, converters = found
    grouped: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for file_key in sorted(file_keys, key=_natural):
        target, pattern = _rename(file_key, renamings, converters)
        if pattern is None:
            continue
        converter = next((c for c in converters if pattern in c.source_patterns), None)
        if converter is None or _layout(converter) is None:
            continue
        grouped.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(file_key)
    out = {}
    for target, (converter, by_pattern) in grouped.items():
        stack_dim, cat_dim = _layout(converter)
        parts = [by_pattern[p] for p in converter.source_patterns if p in by_pattern]
        if len(parts) != len(converter.source_patterns) or (stack_dim is None and any(len(p) != 1 for p in parts)):
            continue  # a pattern without keys, or several keys where one is read: not built here
        out[target] = ComposedSource(target, parts, stack_dim, cat_dim if len(parts) > 1 else None)
    return out


def _layout(converter: Any) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(stack dim, concatenation dim) of a converter whose operations are read here, else None."""
    names = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    if names == ["MergeModulelist"]:
        return dims[0], None
    if names == ["MergeModulelist", "Concatenate"]:
        return dims[0], dims[1]
    if names == ["Concatenate"]:
        return None, dims[0]
    return None


def _natural(key: str) -> list:
    """transformers' order of saved keys: numbers compared as numbers (expert 10 after expert 9)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", key)]


__all__ = ["ComposedHandle", "ComposedSource", "SavedFiles", "composed_sources", "hf_checkpoint_names"]
