"""Files that are either complete or absent: atomic writes, durable renames, the checkpoint directory.

A single file (a strategy file) is written with ``write_atomic``: a temporary file beside it,
fsynced, then ``os.replace``d onto it. A checkpoint directory is written under ``<path>.tmp-<id>``
and put in place by ``replace_dir``; ``resolve_checkpoint`` finds the previous one when a crash fell
between that function's two renames. ``atorch_checkpoint.json`` (``META_FILE``), written last, marks
a directory complete.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import stat
import threading
from typing import Any

import torch

from atorch.errors import CheckpointError

logger = logging.getLogger("atorch")

FORMAT, VERSION = "atorch-checkpoint", 1
META_FILE = "atorch_checkpoint.json"
RNG_DIR = "rng"


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform can open a directory)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_json(path: str, value: Any) -> None:
    """``value`` as JSON (no NaN), flushed to disk before returning."""
    data = json.dumps(value, indent=1, allow_nan=False).encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def read_json(path: str) -> Any:
    """A JSON file (never a pickle: reading it runs no code)."""
    with open(path, "rb") as handle:
        return json.loads(handle.read())


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, and ``os.replace`` it onto
    ``path`` (the target of a symlink, which stays a link); the temporary file never outlives a
    failure, and the previous file is untouched unless the replace succeeds. Raises OSError."""
    target = os.path.realpath(path) if os.path.islink(path) else path
    directory = os.path.dirname(os.path.abspath(target))
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        if os.path.isdir(target):
            raise IsADirectoryError(f"{target!r} is a directory")
        temporary = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        _write_new_file(temporary, data)
        _keep_mode(target, temporary)
        os.replace(temporary, target)
        temporary = None
        fsync_dir(directory)
    finally:
        if temporary is not None:
            _remove_quietly(temporary)


def _write_new_file(path: str, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    with open(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _keep_mode(previous: str, new: str) -> None:
    """Give ``new`` the permissions of the file it replaces, if any."""
    try:
        os.chmod(new, stat.S_IMODE(os.stat(previous).st_mode))
    except FileNotFoundError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- JSON values ---------------------------------------------------------------------------------------
def json_value(value: Any, where: str) -> Any:
    """A JSON-able copy (tuples → lists, scalar tensors → numbers); CheckpointError naming ``where``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    raise CheckpointError(f"{where} holds a {type(value).__name__} ({value!r}), which a checkpoint cannot store as "
                          "JSON", key=where)


def from_json_value(saved: Any, current: Any) -> Any:
    """A saved value in the type the live object holds now (tuple, tensor, float)."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(saved, str) and saved in ("inf", "-inf", "nan"):
        return float(saved)
    return saved


# --- checkpoint directories --------------------------------------------------------------------------
def replace_dir(tmp: str, target: str, checked: bool = False) -> None:
    """Put the complete ``tmp`` at ``target``; an old checkpoint there is moved aside first and
    removed last, by a thread (``resolve_checkpoint`` falls back to it if a crash falls between the
    two renames). ``checked``: the caller has made sure ``target`` may be replaced (an export's
    directory has no checkpoint metadata file)."""
    old = None
    if os.path.lexists(target):
        if not checked:
            _check_replaceable(target)
        old = f"{target}.old-{os.path.basename(tmp).rsplit('-', 1)[-1]}"
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(os.path.dirname(target))
    if old is not None:
        threading.Thread(target=remove_replaced, args=(old,), name="atorch-checkpoint-cleanup").start()


def _check_replaceable(target: str) -> None:
    if not os.path.isdir(target) or os.path.islink(target):
        raise CheckpointError(f"save_checkpoint: {target!r} exists and is not a checkpoint directory", key="path")
    if os.listdir(target) and not os.path.exists(os.path.join(target, META_FILE)):
        raise CheckpointError(f"save_checkpoint: {target!r} is a non-empty directory that is not an atorch "
                              "checkpoint; refusing to replace it", key="path")


def remove_replaced(old: str) -> None:
    """Delete a replaced checkpoint (off the save's path: unlinking its shards takes as long as a
    tenth of the save): its metadata file first, so a removal cut short never passes for a complete
    checkpoint. Not a daemon thread: the process's exit waits for it."""
    try:
        os.remove(os.path.join(old, META_FILE))
    except OSError:
        pass
    shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(target: str) -> str:
    """``target``, or the previous checkpoint moved aside by a save that crashed between its renames."""
    if os.path.isdir(target):
        return target
    parent, base = os.path.split(target)
    aside = sorted((os.path.join(parent, n) for n in os.listdir(parent or ".") if n.startswith(base + ".old-")
                    and os.path.exists(os.path.join(parent, n, META_FILE))), key=os.path.getmtime)
    if aside:
        logger.warning("load_checkpoint: %s is missing; loading %s (a save was interrupted while renaming)", target,
                       aside[-1])
        return aside[-1]
    raise CheckpointError(f"load_checkpoint: no checkpoint at {target!r}", key="path")


def check_path(path: Any, caller: str) -> str:
    """The absolute directory path a checkpoint call was given; CheckpointError for anything else."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"{caller}: path must be a directory path (str or os.PathLike), got {path!r}", key="path")
    return os.path.abspath(os.fspath(path))
