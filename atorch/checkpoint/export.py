"""``export_model``: the trained weights unsharded, under the user's names, for one process to load.

Unlike a checkpoint (sharded, for resuming under any strategy), an export is the plain weights of
the unwrapped model in Hugging Face's ``save_pretrained`` layout: ``config.json`` (and
``generation_config.json``) when the model has a config, the weights as ``model.safetensors`` or,
past ``max_shard_size``, as ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``. ``from_pretrained`` loads an HF model's export;
``load_exported`` reads any export back.

The export streams: no process ever holds the whole model, since the models worth sharding are the
ones no process can hold. Every process agrees on one list of tensors (name, owner, shape, dtype);
for each in turn, the owner (or its DTensor mesh) makes the full tensor and process 0 receives it,
appends it to the shard it is filling and writes that shard before starting the next one. Process 0
holds at most one shard (or one tensor larger than a shard); the others one tensor at a time.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import safetensors
import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from atorch.checkpoint.agreement import agree, agreed_tmp_dir, gather, on_every_rank
from atorch.checkpoint.files import check_path, fsync_dir, replace_dir
from atorch.checkpoint.safe_load import load_weights_only
from atorch.checkpoint.tensors import canonical_name, model_roots, model_tensors, saved_orders
from atorch.distributed.agreement import comm_device, is_main_rank
from atorch.errors import AtorchError, CheckpointError

if TYPE_CHECKING:  # the result type lives in the entry point's layer
    from atorch.auto.accelerate import AutoAccelerateResult

logger = logging.getLogger("atorch")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
ALIASES_KEY = "atorch_aliases"  # {name: name it shares its tensor with}, in the index or the single file
DEFAULT_MAX_SHARD_SIZE = "5GB"  # Hugging Face's default
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# what an export directory may hold: replacing one with a new export removes nothing else
_EXPORT_FILES = re.compile(r"(config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|"
                           r"model-\d{5}-of-\d{5}\.safetensors|model\.pt)")


@dataclass
class ExportRecord:
    """What the last ``export_model`` did on this process: the files written (process 0) and the
    most bytes of tensors it held at once beyond the model's own (gathered tensors, copies, the
    shard being filled), so tests and users can check the memory bound."""
    peak_bytes: int = 0
    held_bytes: int = 0
    total_bytes: int = 0
    largest_tensor_bytes: int = 0
    max_shard_bytes: int = 0
    files: list[str] = field(default_factory=list)

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes


_last_record = ExportRecord()


def last_export_record() -> ExportRecord:
    """This process's record of its last ``export_model`` call."""
    return _last_record


@dataclass(frozen=True)
class Entry:
    """One tensor of the export, as every process agrees on it: ``ranks`` take part in making it
    whole (the owner's DTensor mesh, or the owner alone) and ``owner`` then holds it whole."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    owner: int
    ranks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=_dtype(self.dtype)).element_size()


def export_model(result: "AutoAccelerateResult", path: Union[str, os.PathLike], *,
                 max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Write the trained weights unsharded under the user's ``state_dict()`` names, in Hugging Face's
    ``save_pretrained`` layout, into the directory ``path`` (collective: every process calls it;
    process 0 writes). Returns ``path`` (absolute).

    Weights go to safetensors files of at most ``max_shard_size`` (bytes, or a string such as
    ``"5GB"``, ``"500MB"``, ``"20KB"``; a larger tensor gets a file of its own) with an index, or one
    ``model.safetensors`` when they fit. A model with a ``config`` (Hugging Face) gets its
    ``config.json`` too and loads with ``from_pretrained(path)``; ``load_exported`` reads any export.
    Each tensor keeps its dtype; a tied weight is stored once (under the name Hugging Face keeps).
    No process holds more than its own part of the model plus one shard (or one larger tensor): see
    ``last_export_record``. The directory appears complete or not at all; a failure raises the same
    CheckpointError on every process."""
    return export_module(result.model, path, max_shard_size=max_shard_size)


def export_module(model: nn.Module, path: Union[str, os.PathLike], *,
                  max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, caller: str = "export_model") -> str:
    """``export_model`` of a model as auto_accelerate returned it (``result.model``); ``caller`` names the
    user's call in errors (``save_pretrained`` routes here)."""
    global _last_record
    target = check_path(path, caller)
    limit = on_every_rank(lambda: parse_size(max_shard_size))
    on_every_rank(lambda: _check_target(target) if is_main_rank() else None)
    tensors = model_tensors(model)
    entries, aliases = _agreed_entries(model, tensors)
    _last_record = record = ExportRecord(max_shard_bytes=limit, total_bytes=sum(e.nbytes for e in entries),
                                         largest_tensor_bytes=max((e.nbytes for e in entries), default=0))
    tmp = agreed_tmp_dir(target)
    writer = _ShardWriter(tmp, _plan_shards(entries, limit), aliases, record) if is_main_rank() else None
    orders = saved_orders(model)
    for entry in entries:
        if writer is not None:
            writer.start(entry)  # the shard it closes is written before the tensor arrives
        full = _gather_to_main(entry, tensors, orders, record)
        if writer is not None:
            writer.add(entry, full)
    error = writer.finish(model_roots(model)[0], target) if writer is not None else None
    agree(error, f"{caller}: writing", target, only_main=True)
    return target


def gather_trainable(model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """The trainable parameters of a model as auto_accelerate returned it, each whole, by the user's names,
    on process 0 (None elsewhere); collective. What an adapter library's ``save_pretrained`` (PEFT's) keeps
    of a state_dict: its adapters, without gathering the frozen model around them."""
    tensors = model_tensors(model)
    local = on_every_rank(lambda: sorted(name for name, tensor in tensors.items() if tensor.requires_grad))
    trainable = set().union(*gather(local))
    entries, _ = _agreed_entries(model, tensors)
    record = ExportRecord()
    orders = saved_orders(model)
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        if entry.name in trainable:
            full = _gather_to_main(entry, tensors, orders, record)
            if full is not None:
                out[entry.name] = full
    return out if is_main_rank() else None


# --- sizes -----------------------------------------------------------------------------------------
def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"5GiB"`` (2**30), ``"20KB"``,
    as Hugging Face reads ``max_shard_size``."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise CheckpointError(f"export_model: max_shard_size must be positive, got {size}", key="max_shard_size")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper()) if isinstance(size, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise CheckpointError(f"export_model: max_shard_size must be a positive number of bytes or a string such as "
                              f"'5GB', '500MB', '20KB', got {size!r}", key="max_shard_size")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# --- the agreed list -------------------------------------------------------------------------------
def _agreed_entries(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], dict[str, str]]:
    """Every process's tensors merged into one list in one order (each rank's own order, ranks in
    turn: for pipeline stages, the model's), and the names left out as aliases of a kept one."""
    local = on_every_rank(lambda: _local_metadata(model, tensors))
    everyone = gather(local)
    return on_every_rank(lambda: _merge(everyone))


def _local_metadata(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's tensors as ``(name, shape, dtype, mesh ranks or None)`` and its aliases."""
    items = []
    for name, tensor in tensors.items():
        mesh = tensor.device_mesh.mesh.flatten().tolist() if isinstance(tensor, DTensor) else None
        items.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), mesh))
    return {"items": items, "aliases": _aliases(model, tensors)}


def _aliases(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{left-out name: kept name}``: the other names of a tensor held under several (tied weights
    share one object), and Hugging Face's tied targets (``lm_head.weight`` of a tied Llama), which
    a pipeline may hold as a copy on another stage. ``save_pretrained`` keeps the source name."""
    out = {}
    for root in model_roots(model):
        names: dict[int, list[str]] = {}
        persistent = {canonical_name(n) for n in root.state_dict(keep_vars=True)}
        named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            if canonical_name(name) in persistent:
                names.setdefault(id(tensor), []).append(canonical_name(name))
        out.update(_tied_targets(root))
        for group in names.values():
            kept = next((n for n in group if n in tensors), None)
            out.update({n: kept for n in group if kept is not None and n != kept})
    return out


def _tied_targets(root: nn.Module) -> dict[str, str]:
    """Hugging Face's ``{target: source}`` of the weights it ties (empty when untied or not HF)."""
    tied = getattr(root, "all_tied_weights_keys", None)
    if not isinstance(tied, dict) or not getattr(getattr(root, "config", None), "tie_word_embeddings", True):
        return {}
    return {canonical_name(k): canonical_name(v) for k, v in tied.items() if isinstance(v, str)}


def _merge(everyone: list[dict[str, Any]]) -> tuple[list[Entry], dict[str, str]]:
    """One entry per name: its owner is the lowest rank holding it; a DTensor is made whole by its
    owner's mesh. An alias is dropped from the entries (a pipeline stage's copy of a tied weight)
    when the name it shares with is exported; the aliases returned point at exported names."""
    aliases: dict[str, str] = {}
    for part in everyone:
        aliases.update(part["aliases"])
    seen: dict[str, Entry] = {}
    for rank, part in enumerate(everyone):
        for name, shape, dtype, mesh in part["items"]:
            if name in seen:
                _check_same(seen[name], rank, tuple(shape), dtype)
            else:
                seen[name] = Entry(name, tuple(shape), dtype, rank, tuple(mesh) if mesh else (rank,))
    valid = {}
    for name, source in sorted(aliases.items()):
        if name == source or source not in seen or (name in seen and seen[name].shape != seen[source].shape):
            continue
        seen.pop(name, None)
        valid[name] = source
    resolved = {name: _root_of(name, valid, seen) for name in valid}
    return list(seen.values()), {name: root for name, root in resolved.items() if root is not None}


def _root_of(name: str, aliases: dict[str, str], exported: dict[str, Entry]) -> Optional[str]:
    """The exported name ``name`` is an alias of, following chains (``None`` for a cycle)."""
    visited = set()
    while name not in exported:
        if name in visited or name not in aliases:
            return None
        visited.add(name)
        name = aliases[name]
    return name


def _check_same(entry: Entry, rank: int, shape: tuple[int, ...], dtype: str) -> None:
    if entry.shape != shape or entry.dtype != dtype:
        raise CheckpointError(f"export_model: {entry.name!r} is {list(shape)} {dtype} on rank {rank} but "
                              f"{list(entry.shape)} {entry.dtype} on rank {entry.owner}", key=entry.name)


def _plan_shards(entries: list[Entry], limit: int) -> list[list[str]]:
    """Names per shard file, in order: a shard is closed when the next tensor would take it past
    ``limit``; a tensor larger than ``limit`` gets a shard of its own (as Hugging Face does)."""
    shards: list[list[str]] = []
    size = limit + 1  # no open shard yet
    for entry in entries:
        if not shards or size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry.name)
        size += entry.nbytes
    return shards


# --- moving one tensor to process 0 -----------------------------------------------------------------
def _gather_to_main(entry: Entry, tensors: dict[str, torch.Tensor], orders: dict,
                    record: ExportRecord) -> Optional[torch.Tensor]:
    """The full tensor on process 0, in the user's element order, as a CPU tensor of its own (no
    storage shared with the model, as safetensors requires); ``None`` elsewhere. Collective over
    ``entry.ranks`` and, when the owner is not process 0, a send from it to process 0 (process 0
    holds the tensor whenever it is among ``entry.ranks``: the owner is the lowest rank holding it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank not in entry.ranks:
        return _received(entry, record) if rank == 0 else None
    full, fresh = _made_whole(entry, tensors[entry.name], orders, record)
    if rank == 0:
        return _own_cpu_copy(full, fresh, entry, record)
    if rank == entry.owner:
        _send_bytes(full, entry, record)
    if fresh:  # a mesh peer's copy, or the one just sent
        record.release(entry.nbytes)
    return None


def _made_whole(entry: Entry, tensor: torch.Tensor, orders: dict,
                record: ExportRecord) -> tuple[torch.Tensor, bool]:
    """The full tensor where it lives (a DTensor gathered over its mesh: collective there), in the
    user's order if this parameter is kept in another, and whether it is a copy (counted in
    ``record``) rather than the live tensor itself."""
    fresh = isinstance(tensor, DTensor)
    full = tensor.full_tensor().detach() if fresh else tensor.detach()
    if fresh:
        record.hold(entry.nbytes)
    if entry.name in orders:
        saved = orders[entry.name].to_saved(full)
        if saved.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            full = saved  # a view of the same tensor: no copy made
        else:
            full, fresh = _replaced(full, saved, entry, record, fresh), True
    return full, fresh


def _own_cpu_copy(full: torch.Tensor, fresh: bool, entry: Entry, record: ExportRecord) -> torch.Tensor:
    """``full`` as a contiguous CPU tensor sharing no storage with the model."""
    if fresh and full.device.type == "cpu" and full.is_contiguous():
        return full
    return _replaced(full, full.to("cpu", copy=True, memory_format=torch.contiguous_format), entry, record, fresh)


def _replaced(old: torch.Tensor, new: torch.Tensor, entry: Entry, record: ExportRecord,
              old_is_copy: bool) -> torch.Tensor:
    """``new`` in place of ``old`` in the count (both are held until ``old`` is dropped)."""
    record.hold(entry.nbytes)
    if old_is_copy:
        record.release(entry.nbytes)
    del old
    return new


def _send_bytes(tensor: torch.Tensor, entry: Entry, record: ExportRecord) -> None:
    """``tensor``'s bytes to process 0 on the default group (raw bytes: any dtype, any backend;
    copied only where the backend needs another device or the tensor is not contiguous)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).to(comm_device())
    copied = data.data_ptr() != tensor.data_ptr()
    if copied:
        record.hold(entry.nbytes)
    dist.send(data, dst=0)
    if copied:
        record.release(entry.nbytes)


def _received(entry: Entry, record: ExportRecord) -> torch.Tensor:
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8, device=comm_device())
    record.hold(entry.nbytes)
    dist.recv(buffer, src=entry.owner)
    if buffer.device.type != "cpu":
        host = buffer.to("cpu")
        record.hold(entry.nbytes)
        del buffer
        record.release(entry.nbytes)
        buffer = host
    return buffer.view(_dtype(entry.dtype)).reshape(entry.shape)


# --- writing on process 0 ---------------------------------------------------------------------------
class _ShardWriter:
    """Process 0's shard being filled: appends each full tensor and writes the shard when the next
    tensor starts another. After a failure it keeps taking tensors (so every process stays in step)
    and writes nothing more; ``finish`` reports the error for every process to raise."""

    def __init__(self, tmp: str, plan: list[list[str]], aliases: dict[str, str], record: ExportRecord):
        self.tmp, self.plan, self.aliases, self.record = tmp, plan, aliases, record
        self.shard_of = {name: i for i, names in enumerate(plan) for name in names}
        self.total_parameters = 0
        self.current: dict[str, torch.Tensor] = {}
        self.index = 0
        self.weight_map: dict[str, str] = {}
        self.error = self._attempt(lambda: os.makedirs(tmp))

    def file_name(self, index: int) -> str:
        return SINGLE_FILE if len(self.plan) == 1 else SHARD_FILE.format(index=index + 1, count=len(self.plan))

    def start(self, entry: Entry) -> None:
        """Write the shard being filled if ``entry`` belongs to the next one."""
        if self.shard_of[entry.name] != self.index:
            self._flush()
            self.index = self.shard_of[entry.name]

    def add(self, entry: Entry, tensor: torch.Tensor) -> None:
        self.current[entry.name] = tensor
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        if self.error is None and self.current:
            self.error = self._attempt(lambda: self._write_shard(self.file_name(self.index)))
        self.record.release(sum(t.nbytes for t in self.current.values()))
        self.current = {}

    def _write_shard(self, name: str) -> None:
        metadata = {"format": "pt"}
        if len(self.plan) == 1 and self.aliases:
            metadata[ALIASES_KEY] = json.dumps(self.aliases, sort_keys=True)
        safetensors_torch.save_file(self.current, os.path.join(self.tmp, name), metadata=metadata)
        self.weight_map.update({tensor_name: name for tensor_name in self.current})
        self.record.files.append(name)

    def finish(self, user_model: nn.Module, target: str) -> Optional[str]:
        """Write the last shard, the index and the config, and put the directory in place; the
        error text (``None``: done) for every process to agree on."""
        self._flush()
        if self.error is None:
            self.error = self._attempt(lambda: self._finish(user_model, target))
        if self.error is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.error

    def _finish(self, user_model: nn.Module, target: str) -> None:
        if len(self.plan) > 1:
            metadata: dict[str, Any] = {"total_parameters": self.total_parameters,
                                        "total_size": self.record.total_bytes}
            if self.aliases:
                metadata[ALIASES_KEY] = self.aliases
            with open(os.path.join(self.tmp, INDEX_FILE), "w") as handle:
                json.dump({"metadata": metadata, "weight_map": dict(sorted(self.weight_map.items()))}, handle,
                          indent=2)
        _write_config(user_model, self.tmp)
        fsync_dir(self.tmp)
        _check_target(target)
        replace_dir(self.tmp, target, checked=True)

    @staticmethod
    def _attempt(action: Any) -> Optional[str]:
        try:
            action()
        except (OSError, TypeError, ValueError, RuntimeError, AtorchError) as failure:
            return f"{type(failure).__name__}: {failure}"
        return None


def _write_config(user_model: nn.Module, directory: str) -> None:
    """A Hugging Face model's ``config.json`` and, for a generating model, its generation config
    (what ``save_pretrained`` writes beside the weights)."""
    config = getattr(user_model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.save_pretrained(directory)
    generation = getattr(user_model, "generation_config", None)
    can_generate = getattr(user_model, "can_generate", lambda: generation is not None)
    if generation is not None and hasattr(generation, "save_pretrained") and can_generate():
        generation.save_pretrained(directory)


def _check_target(target: str) -> None:
    """Refuse to replace anything but an earlier export: the rename would delete what is there."""
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target) or os.path.islink(target):
        raise CheckpointError(f"export_model: {target!r} exists and is not a directory", key="path")
    others = [n for n in os.listdir(target) if not _EXPORT_FILES.fullmatch(n)]
    if others:
        raise CheckpointError(f"export_model: {target!r} holds files an export does not write ({sorted(others)[:5]}); "
                              "refusing to replace it", key="path")


# --- reading -----------------------------------------------------------------------------------------
def load_exported(path: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """The state dict ``export_model`` wrote (one safetensors file, the sharded layout with its
    index, or an older export's ``model.pt``), with every tied name back as ``state_dict()`` has
    it (the same tensor under each), for ``load_state_dict(strict=True)``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            return _load_sharded(path)
        path = next((os.path.join(path, n) for n in (SINGLE_FILE, "model.pt") if os.path.exists(os.path.join(path, n))),
                    os.path.join(path, SINGLE_FILE))
    if not path.endswith(".safetensors"):
        return load_weights_only(path)
    with safetensors.safe_open(path, framework="pt") as handle:
        aliases = json.loads((handle.metadata() or {}).get(ALIASES_KEY, "{}"))
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    return _with_aliases(state, aliases)


def _load_sharded(directory: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(directory, INDEX_FILE)) as handle:
        index = json.load(handle)
    state: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(index["weight_map"].values()):
        state.update(safetensors_torch.load_file(os.path.join(directory, file)))
    missing = set(index["weight_map"]) - set(state)
    if missing:
        raise CheckpointError(f"load_exported: {directory!r} lacks {sorted(missing)[:5]} its index names", key="path")
    return _with_aliases(state, index.get("metadata", {}).get(ALIASES_KEY, {}))


def _with_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    out = dict(state)
    out.update({name: state[kept] for name, kept in aliases.items() if kept in state})
    return out


__all__ = ["export_model", "export_module", "load_exported", "last_export_record", "ExportRecord", "parse_size"]
