"""Reading files that must not run code: restricted unpicklers and weights-only tensor files.

Two pickles are read back by atorch, each with the least the format needs:

- ``CallFreeUnpickler``: the pure-Python unpickler with every opcode that calls a function refused;
  only the classes a subclass lists in ``buildable`` are created (``__new__`` without arguments,
  then ``__setstate__``). Strategy files use it.
- ``AllowListUnpickler``: the C unpickler with globals limited to an allow-list. DCP's ``.metadata``
  is such a pickle; ``SafeFileSystemReader`` is DCP's reader using it.

Tensor files are read with ``torch.load(weights_only=True)`` (``load_weights_only``); metadata is
JSON.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from atorch.errors import CheckpointError


class CallFreeUnpickler(pickle._Unpickler):  # the pure-Python unpickler lets us veto opcodes
    """An unpickler that never calls code while loading.

    REDUCE, INST, OBJ, NEWOBJ_EX, extensions and persistent ids are refused (``refuse``); NEWOBJ and
    BUILD are allowed for the classes in ``buildable`` alone. Subclasses resolve globals in
    ``find_class`` (without importing) and raise their own error type from ``refuse``.
    """

    buildable: tuple[type, ...] = ()
    dispatch = dict(pickle._Unpickler.dispatch)

    def refuse(self) -> None:
        raise pickle.UnpicklingError("the pickle tries to call code while loading; refused")

    def _refuse(self) -> None:
        self.refuse()

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in self.buildable or args:
            self.refuse()
        self.append(cls.__new__(cls))

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if not isinstance(target, self.buildable):
            self.refuse()
        target.__setstate__(state)

    for _op in (pickle.REDUCE, pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2,
                pickle.EXT4, pickle.PERSID, pickle.BINPERSID):
        dispatch[_op[0]] = _refuse
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.BUILD[0]] = _load_build
    del _op


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler whose globals are limited to ``allowed(module, name)``; anything else raises
    ``refused(module, name)``."""

    def allowed(self, module: str, name: str) -> bool:
        return False

    def refused(self, module: str, name: str) -> Exception:
        return pickle.UnpicklingError(f"{module}.{name} is not allowed in this pickle")

    def find_class(self, module: str, name: str) -> Any:
        if self.allowed(module, name):
            return super().find_class(module, name)
        raise self.refused(module, name)


class DcpMetadataUnpickler(AllowListUnpickler):
    """DCP's ``.metadata`` is a pickle: build only DCP's own metadata classes, torch sizes, dtypes
    and paths from it; anything else (a crafted file importing code) is refused."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                       "torch.distributed.checkpoint.planner")
    ALLOWED_GLOBALS = (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                       ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"))

    def allowed(self, module: str, name: str) -> bool:
        if module in self.ALLOWED_MODULES and not name.startswith("__"):
            return True
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return True
        return (module, name) in self.ALLOWED_GLOBALS

    def refused(self, module: str, name: str) -> Exception:
        return CheckpointError(f"the checkpoint's DCP .metadata refers to {module}.{name}, which a checkpoint never "
                               "holds: refusing to load it", key=f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by ``DcpMetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = os.path.join(os.fspath(self.path), ".metadata")
        with open(path, "rb") as handle:
            metadata = DcpMetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if metadata.planner_data is None:
            metadata.planner_data = {}
        return metadata


def load_weights_only(path: str) -> Any:
    """A ``torch.save`` file of tensors, read with ``weights_only=True`` (no code runs)."""
    with open(path, "rb") as handle:
        return torch.load(io.BytesIO(handle.read()), weights_only=True)
