"""``load_pretrained``: what Hugging Face ``save_pretrained`` writes, into ``result.model`` under any strategy.

The file holds full tensors under the user's names; the live model may hold only a part of each
(a DTensor shard under fsdp / zero2 / tensor_parallel, some stages under pipeline parallelism). So
each process reads only its own part of each tensor it holds (``get_slice`` at its shard's
offsets) from only the files that hold them, and copies it in place: no process reads the whole
model, no collective moves weights. Everything is checked from the safetensors headers first
(keys, shapes, dtypes), so a file that does not fit raises ``CheckpointError`` on every process
before any parameter changes. Only safetensors and JSON are read: nothing in the user's files can
run code.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from atorch.checkpoint.agreement import gather, on_every_rank
from atorch.checkpoint.files import check_path
from atorch.checkpoint.hf_conversion import (
    ComposedHandle,
    ComposedSource,
    SavedFiles,
    composed_sources,
    hf_checkpoint_names,
)
from atorch.checkpoint.optimizer_state import partitions_of
from atorch.checkpoint.tensors import (
    SavedOrder,
    canonical_name,
    model_roots,
    model_tensors,
    saved_orders,
    to_live_order,
)
from atorch.errors import CheckpointError
from atorch.utils.modules import PACKED_STATE_ATTR

try:  # optional, as for export_model; load_pretrained says how to install it
    from safetensors import safe_open
except ImportError:  # pragma: no cover - safetensors comes with transformers
    safe_open = None

if TYPE_CHECKING:  # the result type lives in the entry point's layer
    from atorch.auto.accelerate import AutoAccelerateResult

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
CALLER = "load_pretrained"
# safetensors' dtype names of the non-floating dtypes a parameter or buffer may have
EXACT_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                "I64": torch.int64}


class LoadResult(NamedTuple):
    """The model's keys the file did not have (left as they were) and the file's keys no process's
    model has (not read); both empty after a strict load."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_pretrained(path: str | os.PathLike, result: "AutoAccelerateResult", *, strict: bool = True) -> LoadResult:
    """Load the weights Hugging Face ``save_pretrained`` wrote to ``path`` into ``result.model``, in
    place, under whatever strategy ``auto_accelerate`` applied (collective: every process calls it).

    ``path`` is a directory with ``model.safetensors.index.json`` and its shard files, or with a
    single ``model.safetensors`` (or that file itself). Keys are the user's model's names, as its
    ``state_dict()`` has them; a weight tied under several names is found under any of them. A
    floating tensor of another width is cast, as ``from_pretrained`` does. Each process reads only
    the elements it holds.

    ``strict=True`` raises CheckpointError (naming the key, on every process, before any weight
    changes) when a key of the model is missing from the file, the file has a key the model does
    not, or a tensor's shape or dtype does not fit; ``strict=False`` loads the keys that exist on
    both sides and returns the others in the ``LoadResult`` (shape and dtype still must fit).
    """
    target = check_path(path, CALLER)
    weight_map = on_every_rank(lambda: weight_files(target))
    model = on_every_rank(lambda: model_tensors(result.model))
    packed = packed_parts(result.model)
    on_every_rank(lambda: refuse_computed(result.model, model, packed))
    names = on_every_rank(lambda: with_hf_renames(accepted_names(result.model, model),
                                                  hf_checkpoint_names(result.model, weight_map)))
    composed = on_every_rank(lambda: composed_sources(result.model, weight_map))
    sources = {key: _source(candidates, weight_map, composed) for key, candidates in names.items()}
    loaded = _agreed_key_lists(names, sources, weight_map, composed)
    if strict:
        _refuse_key_mismatch(loaded, target)
    sources = {key: source for key, source in sources.items() if source is not None}
    on_every_rank(lambda: check_fit(model, sources, weight_map, composed))
    partitions = on_every_rank(lambda: partitions_of(result.optim) if result.optim is not None else None)
    orders = saved_orders(result.model)
    on_every_rank(lambda: copy_in(model, sources, weight_map, orders, packed, composed))
    if partitions is not None:
        partitions.sync_master_weights()  # DeepSpeed ZeRO steps from its own fp32 copy
    return loaded


def packed_parts(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """``{key: the live parameters it packs}`` for saved tensors a module builds from several
    parameters (``PACKED_STATE_ATTR``: tensor_parallel's split nn.MultiheadAttention saves its q, k
    and v projections as ``in_proj_weight``), concatenated along dimension 0."""
    out = {}
    for root in model_roots(model):
        for prefix, module in root.named_modules():
            for suffix, paths in getattr(module, PACKED_STATE_ATTR, {}).items():
                key = canonical_name(f"{prefix}.{suffix}" if prefix else suffix)
                out[key] = [module.get_parameter(path) for path in paths]
    return out


def refuse_computed(root: nn.Module, model: dict[str, torch.Tensor], packed: dict[str, list]) -> None:
    """A state_dict value that no parameter or buffer holds and no module declares as packed (a
    state_dict hook of the user's builds it) cannot be loaded in place: refused, naming the key,
    rather than written into a temporary and lost."""
    live = {id(t) for t in root.parameters()} | {id(t) for t in root.buffers()}
    computed = sorted(key for key, tensor in model.items() if id(tensor) not in live and key not in packed)
    if computed:
        raise CheckpointError(
            f"{CALLER}: {computed[0]!r} is built by a state_dict hook of the model and is no tensor atorch can "
            "load into in place; load the weights into the model before auto_accelerate (build it normally) or "
            "declare the parameters it packs (PACKED_STATE_ATTR, atorch/utils/modules.py)",
            key=computed[0])


# --- which files hold which keys -----------------------------------------------------------------------
def weight_files(target: str) -> dict[str, str]:
    """``{key: the safetensors file holding it}`` for the file or directory ``target``."""
    if not os.path.exists(target):
        raise CheckpointError(f"{CALLER}: no such file or directory {target!r}", key=target)
    if os.path.isfile(target):
        return dict.fromkeys(_header_keys(target), target)
    index = os.path.join(target, INDEX_FILE)
    if os.path.isfile(index):
        return _indexed_files(index, target)
    single = os.path.join(target, SINGLE_FILE)
    if os.path.isfile(single):
        return dict.fromkeys(_header_keys(single), single)
    pickled = [name for name in PICKLED_FILES if os.path.exists(os.path.join(target, name))]
    hint = (f"; it holds {pickled[0]}, a pickle, which atorch does not load (it can run code): save with "
            "safe_serialization=True") if pickled else ""
    raise CheckpointError(f"{CALLER}: {target!r} holds neither {INDEX_FILE} nor {SINGLE_FILE}{hint}", key=target)


def _indexed_files(index: str, directory: str) -> dict[str, str]:
    """The index's ``weight_map`` with each file's path, every file checked to exist."""
    try:
        with open(index, "rb") as handle:
            weight_map = json.loads(handle.read())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a JSON object of file names")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{CALLER}: cannot read the index {index!r}: {type(error).__name__}: {error}",
                              key=index) from error
    files = {name: os.path.join(directory, name) for name in set(weight_map.values())}
    for name, file in sorted(files.items()):
        if not os.path.isfile(file):
            raise CheckpointError(f"{CALLER}: the index {index!r} names {name!r}, but {file!r} does not exist",
                                  key=file)
    return {key: files[name] for key, name in weight_map.items()}


def _open(file: str) -> Any:
    """``safe_open`` of ``file``; CheckpointError naming the file when it is no safetensors file
    (truncated: the header claims more bytes than there are; corrupt header)."""
    if safe_open is None:
        raise CheckpointError(f"{CALLER} needs the safetensors package: pip install safetensors", key=file)
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # SafetensorError, OSError: the file, not the caller, is at fault
        raise CheckpointError(f"{CALLER}: {file!r} is not a readable safetensors file (truncated or corrupt?): "
                              f"{error}", key=file) from error


def _header_keys(file: str) -> list[str]:
    with _open(file) as handle:
        return list(handle.keys())


# --- names -----------------------------------------------------------------------------------------------
def accepted_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """``{key: the names it may have in the file}``, its own first. ``save_pretrained`` writes a tied
    weight once, under one of its names; a pipeline stage holds its own copy of a weight tied to
    another stage under its name there (its ``names``: path -> the user's first name)."""
    groups: dict[str, set[str]] = {}
    for root in model_roots(model):
        by_tensor: dict[int, list[str]] = {}
        for name, value in root.state_dict(keep_vars=True).items():
            by_tensor.setdefault(id(value), []).append(canonical_name(name))
        for aliases in by_tensor.values():
            _join(groups, aliases)
    for stage in getattr(model, "stage_modules", ()):
        for path, user_name in getattr(stage, "names", {}).items():
            _join(groups, [canonical_name(path), user_name])
    return {key: [key] + sorted(groups.get(key, set()) - {key}) for key in tensors}


def with_hf_renames(names: dict[str, list[str]], renames: dict[str, str]) -> dict[str, list[str]]:
    """Each key's accepted names, plus the file's name for it where transformers renames it."""
    return {key: candidates + [renames[key]] if key in renames else candidates for key, candidates in names.items()}


def _join(groups: dict[str, set[str]], names: Iterable[str]) -> None:
    """Put ``names`` in one group with every name already grouped with any of them."""
    merged = set(names)
    for name in list(merged):
        merged |= groups.get(name, set())
    for name in merged:
        groups[name] = merged


def _source(candidates: list[str], weight_map: dict[str, str], composed: dict[str, ComposedSource]) -> Optional[str]:
    """The first of a key's names the file has, else the first transformers builds from the file's
    tensors (``composed``), or ``None``."""
    return next((name for name in candidates if name in weight_map),
                next((name for name in candidates if name in composed), None))


def _agreed_key_lists(names: dict[str, list[str]], sources: dict[str, Optional[str]],
                      weight_map: dict[str, str], composed: dict[str, ComposedSource]) -> LoadResult:
    """Missing and unexpected keys over every process (collective): a pipeline stage lacks the other
    stages' keys, which are not unexpected; the saved tensors a composed key is built from are known."""
    missing = [key for key, source in sources.items() if source is None]
    known = {name for candidates in names.values() for name in candidates}
    known |= {key for source in sources.values() if source in composed for key in composed[source].keys}
    parts = gather((missing, known))
    all_missing = sorted({key for mine, _ in parts for key in mine})
    all_known = set().union(*(mine for _, mine in parts))
    return LoadResult(all_missing, sorted(set(weight_map) - all_known))


def _refuse_key_mismatch(loaded: LoadResult, target: str) -> None:
    """The same CheckpointError on every process (every process holds the same lists)."""
    for keys, what in ((loaded.missing_keys, "keys of the model are missing from"),
                       (loaded.unexpected_keys, "keys are not in the model but in")):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            raise CheckpointError(f"{CALLER}: {what} {target!r}: {shown} (strict=False loads the rest and "
                                  "returns them)", key=keys[0])


# --- checks from the headers -------------------------------------------------------------------------------
def _by_file(sources: dict[str, str], weight_map: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{file: {model key: file key}}``: the files this process needs, nothing else (composed keys
    are read by ``_composed``)."""
    out: dict[str, dict[str, str]] = {}
    for key, source in sources.items():
        if source in weight_map:
            out.setdefault(weight_map[source], {})[key] = source
    return out


def _composed(sources: dict[str, str], weight_map: dict[str, str], composed: dict[str, ComposedSource],
              ) -> tuple[dict[str, str], ComposedHandle, SavedFiles]:
    """This process's composed keys (``{model key: composed name}``) and a handle that reads them."""
    mine = {key: source for key, source in sources.items() if source not in weight_map}
    files = SavedFiles(weight_map, _open)
    return mine, ComposedHandle({source: composed[source] for source in mine.values()}, files), files


def check_fit(model: dict[str, torch.Tensor], sources: dict[str, str], weight_map: dict[str, str],
              composed: Optional[dict[str, ComposedSource]] = None) -> None:
    """Every tensor this process loads is in its file with the model's (global) shape and a dtype
    that casts to the model's; CheckpointError naming the first that is not."""
    mine, handle, files = _composed(sources, weight_map, composed or {})
    with files:
        for key, source in sorted(mine.items()):
            _check_tensor(key, source, handle.get_slice(source), model[key], "the tensors it is built from")
    for file, keys in sorted(_by_file(sources, weight_map).items()):
        with _open(file) as handle:
            present = set(handle.keys())
            for key, source in sorted(keys.items()):
                if source not in present:
                    raise CheckpointError(f"{CALLER}: the index names {file!r} for {source!r}, which that file does "
                                          "not hold", key=source)
                _check_tensor(key, source, handle.get_slice(source), model[key], file)


def _check_tensor(key: str, source: str, stored: Any, live: torch.Tensor, file: str) -> None:
    shape, dtype = list(stored.get_shape()), stored.get_dtype()
    named = key if key == source else f"{key} (saved as {source})"
    if shape != list(live.shape):
        raise CheckpointError(f"{CALLER}: {named} has shape {shape} in {file!r} but {list(live.shape)} in the model",
                              key=key)
    if not _dtype_fits(dtype, live.dtype):
        raise CheckpointError(f"{CALLER}: {named} is {dtype} in {file!r} but {live.dtype} in the model: only "
                              "floating tensors are cast", key=key)


def _dtype_fits(stored: str, live: torch.dtype) -> bool:
    """A floating tensor loads into any floating tensor (cast); any other only into its own dtype."""
    if stored.startswith(("F", "BF")):
        return live.is_floating_point
    return EXACT_DTYPES.get(stored) == live


# --- copying each process's part ---------------------------------------------------------------------------
def copy_in(model: dict[str, torch.Tensor], sources: dict[str, str], weight_map: dict[str, str],
            orders: dict[str, SavedOrder], packed: dict[str, list[torch.Tensor]],
            composed: Optional[dict[str, ComposedSource]] = None) -> None:
    """Read this process's part of every tensor it loads, one file open at a time (a composed key's
    files together), into the live tensors (in place)."""
    mine, handle, files = _composed(sources, weight_map, composed or {})
    with files, torch.no_grad():
        for key, source in sorted(mine.items()):
            _copy_one(handle, key, source, model[key], orders.get(key))
    for file, keys in sorted(_by_file(sources, weight_map).items()):
        with _open(file) as handle, torch.no_grad():
            for key, source in sorted(keys.items()):
                if key in packed:
                    _copy_packed(handle, source, packed[key])
                    continue
                _copy_one(handle, key, source, model[key], orders.get(key))


def _copy_one(handle: Any, key: str, source: str, live: torch.Tensor, order: Optional[SavedOrder]) -> None:
    local = live.to_local() if isinstance(live, DTensor) else live
    if local.numel():
        local.copy_(_local_part(handle, source, live, order))


def _copy_packed(handle: Any, source: str, parts: list[torch.Tensor]) -> None:
    """A packed saved tensor into the parameters it is made of: each part's rows, read one part at
    a time, then this process's share of them."""
    start = 0
    for live in parts:
        rows = handle.get_slice(source)[start: start + live.shape[0]].to(dtype=live.dtype)
        start += live.shape[0]
        if isinstance(live, DTensor):
            rows = distribute_tensor(rows.to(live.device), live.device_mesh, live.placements,
                                     src_data_rank=None).to_local()
            live.to_local().copy_(rows)
        else:
            live.copy_(rows)


def _local_part(handle: Any, source: str, live: torch.Tensor, order: Optional[SavedOrder]) -> torch.Tensor:
    """The elements of ``source`` that ``live`` holds here: a slice of the file's tensor at this
    shard's offsets; the whole tensor (then this process's part of it) only where no slice is this
    shard: a parameter kept in a permuted order, or a placement other than plain Shard / Replicate."""
    if order is not None:
        part = to_live_order(handle.get_tensor(source), live, order)
        return part.to_local() if isinstance(part, DTensor) else part
    if not isinstance(live, DTensor):
        return handle.get_tensor(source)
    mesh, placements = live.device_mesh, live.placements
    if not all(type(p) is Shard or isinstance(p, Replicate) for p in placements):  # _StridedShard is a Shard
        full = handle.get_tensor(source).to(device=live.device, dtype=live.dtype)
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    shape, offset = compute_local_shape_and_global_offset(live.shape, mesh, placements)
    if list(shape) == list(live.shape):
        return handle.get_tensor(source)
    return handle.get_slice(source)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


__all__ = ["LoadResult", "load_pretrained"]
