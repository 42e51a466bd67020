"""Strategy: an ordered list of ``(name, config, tunable)`` items, with pickle and JSON files.

A strategy is plain data so it can be saved, shared and reused as ``load_strategy``. Pickles are
the seed's format; they are read back with a restricted unpickler so that opening a strategy file
never runs code (only Strategy itself, torch dtypes and nn.Module classes may appear in one).

Configs are kept as given; the strategy ``auto_accelerate`` returns holds each method's normalized
config (a ``MethodConfig`` dataclass). Pickles and JSON store a dataclass as plain data, the dict
of its non-default fields, so loading gives that dict back and the method's ``normalize`` turns it
into an equal dataclass. Two strategies are equal when they would be saved alike.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import sys
from typing import Any, Iterable, Iterator, NamedTuple

import torch

from atorch.errors import StrategyError, StrategyFileError, UnsafeStrategyError
from atorch.utils.config import MethodConfig

_FORMAT = "atorch-strategy"
_VERSION = 1
# Modules a JSON strategy may name classes from even when the user has not imported them yet.
_IMPORTABLE_PREFIXES = ("torch", "atorch", "transformers")


class StrategyItem(NamedTuple):
    name: str
    config: Any
    tunable: bool


class Strategy:
    """An ordered list of optimization methods with their configs.

    ``tunable`` marks items whose config may be changed by ``finetune_strategy`` (by default, items
    given without a config).
    """

    def __init__(self, items: Iterable[Any] | None = None):
        self._items: list[StrategyItem] = [_to_item(entry) for entry in (items or [])]

    # --- sequence protocol -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> StrategyItem:
        return self._items[index]

    def __iter__(self) -> Iterator[StrategyItem]:
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._plain_items() == other._plain_items()

    def __contains__(self, name: object) -> bool:
        return any(item.name == name for item in self._items)

    def __repr__(self) -> str:
        return f"Strategy({[tuple(i) for i in self._items]!r})"

    def __str__(self) -> str:
        if not self._items:
            return "Strategy: (empty)"
        lines = ["Strategy:"]
        for index, item in enumerate(self._items):
            config = "default" if item.config is None or _plain(item.config) == {} else _short_repr(item.config)
            flag = " (tunable)" if item.tunable else ""
            lines.append(f"  {index}. {item.name}: {config}{flag}")
        return "\n".join(lines)

    # --- editing -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [item.name for item in self._items]

    def get(self, name: str, default: Any = None) -> Any:
        """Config of the first item called ``name`` (``default`` when absent)."""
        for item in self._items:
            if item.name == name:
                return item.config
        return default

    def replace(self, name: str, config: Any, tunable: bool | None = None) -> "Strategy":
        """A copy with ``name``'s config replaced (appended when absent)."""
        items, found = [], False
        for item in self._items:
            if item.name == name and not found:
                found = True
                item = StrategyItem(name, config, item.tunable if tunable is None else tunable)
            items.append(item)
        if not found:
            items.append(StrategyItem(name, config, bool(tunable)))
        return Strategy(items)

    def without(self, names: Iterable[str]) -> "Strategy":
        drop = set(names)
        return Strategy([item for item in self._items if item.name not in drop])

    def with_first(self, name: str, config: Any, tunable: bool = True) -> "Strategy":
        return Strategy([StrategyItem(name, config, tunable)] + self._items)

    def _plain_items(self) -> list[tuple]:
        """(name, config, tunable) with dataclass configs as the dict of their non-default fields."""
        return [(item.name, _plain(item.config), item.tunable) for item in self._items]

    # --- pickle (seed format) ----------------------------------------------------------------
    def __getstate__(self) -> dict:
        # plain tuples only, so the restricted unpickler needs no other class
        return {"version": _VERSION, "items": self._plain_items()}

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("items"), list):
            raise UnsafeStrategyError(f"not a Strategy state: {type(state).__name__}")
        self._items = [_to_item(entry) for entry in state["items"]]

    def to_bytes(self) -> bytes:
        return pickle.dumps(self, protocol=4)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Strategy":
        try:
            loaded = _SafeUnpickler(io.BytesIO(data)).load()
        except UnsafeStrategyError:
            raise
        except Exception as error:  # truncated or foreign data
            raise StrategyFileError(f"cannot read strategy bytes: {error}") from error
        if isinstance(loaded, list):  # a bare list of methods pickled directly
            loaded = Strategy(loaded)
        if not isinstance(loaded, Strategy):
            raise StrategyFileError(f"pickle holds a {type(loaded).__name__}, not a Strategy")
        return loaded

    # --- JSON --------------------------------------------------------------------------------
    def to_json(self) -> str:
        methods = [
            {"name": name, "config": _encode(config, name), "tunable": tunable}
            for name, config, tunable in self._plain_items()
        ]
        return json.dumps({"format": _FORMAT, "version": _VERSION, "methods": methods}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise StrategyFileError(f"strategy JSON is not valid JSON: {error}") from error
        if isinstance(data, list):
            return Strategy(_decode(entry) for entry in data)
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise StrategyFileError(f"JSON is not an atorch strategy (expected format {_FORMAT!r})")
        items = []
        for entry in data.get("methods", []):
            if not isinstance(entry, dict) or "name" not in entry:
                raise StrategyFileError(f"strategy JSON method entry must have a 'name': {entry!r}")
            items.append((entry["name"], _decode(entry.get("config")), bool(entry.get("tunable", False))))
        return Strategy(items)

    # --- files -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Readable JSON for ``.json``; a pickle (the seed's format) for any other suffix."""
        path = os.fspath(path)
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        if path.endswith(".json"):
            with open(path, "w") as handle:
                handle.write(self.to_json() + "\n")
        else:
            with open(path, "wb") as handle:
                handle.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Strategy":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise StrategyFileError(f"strategy file not found: {path!r}")
        with open(path, "rb") as handle:
            data = handle.read()
        if path.endswith(".json") or data.lstrip()[:1] in (b"{", b"["):
            return cls.from_json(data.decode("utf-8"))
        return cls.from_bytes(data)

    @classmethod
    def from_any(cls, value: Any) -> "Strategy":
        """Accept every ``load_strategy`` form: Strategy, bytes, a path, or a list of methods."""
        if isinstance(value, Strategy):
            return Strategy(list(value))
        if isinstance(value, (bytes, bytearray)):
            return cls.from_bytes(bytes(value))
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value)
        if isinstance(value, (list, tuple)):
            return Strategy(value)
        raise StrategyError(
            f"load_strategy must be a Strategy, bytes, a file path or a list of methods, not {type(value).__name__}"
        )


def _to_item(entry: Any) -> StrategyItem:
    """Normalise one list entry: 'name', (name, config) or (name, config, tunable)."""
    if isinstance(entry, str):
        return StrategyItem(entry, None, True)
    if isinstance(entry, (tuple, list)) and 1 <= len(entry) <= 3 and isinstance(entry[0], str):
        name = entry[0]
        config = entry[1] if len(entry) > 1 else None
        tunable = bool(entry[2]) if len(entry) > 2 else config is None
        return StrategyItem(name, config, tunable)
    raise StrategyError(
        f"strategy entry {entry!r} must be a method name or a (name, config[, tunable]) tuple"
    )


def _plain(config: Any) -> Any:
    return config.to_dict() if isinstance(config, MethodConfig) else config


def _short_repr(value: Any) -> str:
    if isinstance(value, MethodConfig):  # its non-default fields
        return ", ".join(f"{k}={_short_repr(v)}" for k, v in value.to_dict().items())
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, tuple):
        inner = ", ".join(_short_repr(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, list):
        return "[" + ", ".join(_short_repr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_short_repr(v)}" for k, v in value.items()) + "}"
    return repr(value)


# --- JSON value encoding ---------------------------------------------------------------------
def _encode(value: Any, method: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, method) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, method) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v, method) for v in sorted(value, key=repr)]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if isinstance(value, type):
        return {"__class__": f"{value.__module__}:{value.__qualname__}"}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, method) for k, v in value.items()}
        return {"__dict__": [[_encode(k, method), _encode(v, method)] for k, v in value.items()]}
    raise StrategyFileError(
        f"{method}: config value of type {type(value).__name__} cannot be written as JSON; save as .pkl instead"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == "__tuple__":
            return tuple(_decode(v) for v in inner)
        if key == "__set__":
            return set(_decode(v) for v in inner)
        if key == "__dtype__":
            return _dtype(inner)
        if key == "__class__":
            module, _, qualname = inner.partition(":")
            return _module_class(module, qualname)
        if key == "__dict__":
            return {_decode(k): _decode(v) for k, v in inner}
    return {k: _decode(v) for k, v in value.items()}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsafeStrategyError(f"torch.{name} is not a torch dtype")
    return dtype


def _module_class(module: str, qualname: str) -> type:
    """Resolve an nn.Module class without importing arbitrary modules."""
    if module not in sys.modules:
        if not module.split(".")[0] in _IMPORTABLE_PREFIXES:
            raise UnsafeStrategyError(
                f"strategy names {module}.{qualname}, but module {module!r} is not imported; "
                "import the module that defines your model before loading its strategy"
            )
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise UnsafeStrategyError(f"cannot import {module!r} for {qualname}: {error}") from error
    target: Any = sys.modules[module]
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not (isinstance(target, type) and issubclass(target, torch.nn.Module)):
        raise UnsafeStrategyError(
            f"strategy names {module}.{qualname}, which is not an nn.Module class; refusing to load it"
        )
    return target


class _SafeUnpickler(pickle._Unpickler):  # the pure-Python unpickler lets us veto opcodes
    """Unpickler that only rebuilds Strategy objects holding plain data.

    Any opcode that would call a function (REDUCE, INST, OBJ, NEWOBJ_EX, extensions, persistent
    ids) is refused; NEWOBJ/BUILD are allowed for Strategy alone; globals are limited to Strategy,
    torch dtypes, builtins set/frozenset and nn.Module classes (which are only referenced, never called).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "Strategy":
            return Strategy
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in ("set", "frozenset"):
            return {"set": set, "frozenset": frozenset}[name]
        return _module_class(module, name)

    def _refuse(self) -> None:
        raise UnsafeStrategyError(
            "strategy pickle tries to call code while loading; refused (only plain strategy data is allowed)"
        )

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls is not Strategy or args:
            self._refuse()
        self.append(Strategy.__new__(Strategy))

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if not isinstance(target, Strategy):
            self._refuse()
        target.__setstate__(state)

    for _op in (pickle.REDUCE, pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2,
                pickle.EXT4, pickle.PERSID, pickle.BINPERSID):
        dispatch[_op[0]] = _refuse
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.BUILD[0]] = _load_build
    del _op
