"""Strategy: an ordered list of ``(name, config, tunable)`` items, with pickle and JSON files.

A strategy is plain data so it can be saved, shared and reused as ``load_strategy``. Pickles are
the seed's format; they are read back with a restricted unpickler so that opening a strategy file
never runs code (only Strategy itself, torch dtypes and nn.Module classes may appear in one), and
never imports anything: a class named in a file is looked up, without calling any code, in the
modules the process has already imported, or the load is refused.

Saving serialises first (a value a strategy file cannot hold is a ``StrategyFileError`` naming the
item, and the file is not touched), then writes a temporary file beside the target and
``os.replace``s it, so a failed save leaves the previous file as it was. The atomic write and the
unpickler's machinery are shared with checkpoints (``atorch/checkpoint/files.py``, ``safe_load.py``).

Configs are kept as given; the strategy ``auto_accelerate`` returns holds each method's normalized
config (a ``MethodConfig`` dataclass). Pickles and JSON store a dataclass as plain data, the dict
of its non-default fields, so loading gives that dict back and the method's ``normalize`` turns it
into an equal dataclass. Two strategies are equal when they would run alike: the same methods in
the same order, with the same tunable flags and configs that normalise alike; a strategy also
equals the list of names / ``(name, config)`` pairs it was loaded from (ATorch's tests assert
``best_strategy == strategy``).
"""
from __future__ import annotations

import inspect
import io
import json
import os
import pickle
import sys
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch

from atorch.checkpoint.files import write_atomic
from atorch.checkpoint.safe_load import CallFreeUnpickler
from atorch.errors import AtorchError, StrategyError, StrategyFileError, UnsafeStrategyError
from atorch.utils.config import MethodConfig

_FORMAT = "atorch-strategy"
_VERSION = 1
# The torch dtypes a file may name, fixed at import: looking a name up here runs no code (torch's
# module ``__getattr__`` would import its lazy submodules or call deprecated factories).
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_MISSING = object()
# the scalar types a config may hold (exact types: a subclass would be pickled by reference)
_SCALARS = (type(None), bool, int, float, str, bytes)


# A method's config as loading normalises it, set by the method registry (atorch.auto.opt_lib),
# which this layer cannot import. Without it (the registry not imported) configs compare as given.
_config_normalizer: Optional[Callable[[str, Any], Any]] = None


def set_config_normalizer(normalize: Optional[Callable[[str, Any], Any]]) -> None:
    """``normalize(name, config)``: the config ``resolve_strategy`` would run, for equality."""
    global _config_normalizer
    _config_normalizer = normalize


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
        """Equal to a Strategy, or to a list of names / ``(name, config[, tunable])`` entries, that
        runs alike: ``("half", "bf16")`` equals the returned ``HalfConfig`` (see the module docstring)."""
        if isinstance(other, (list, tuple)):
            try:
                other = Strategy(other)
            except StrategyError:
                return False
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._normalized_items() == other._normalized_items()

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

    def _normalized_items(self) -> list[tuple]:
        """(name, config as loading normalises it, in plain form, tunable)."""
        return [(item.name, _plain(_normalized(item.name, item.config)), item.tunable) for item in self._items]

    def _plain_items(self) -> list[tuple]:
        """(name, config, tunable) with dataclass configs as the dict of their non-default fields."""
        return [(item.name, _plain(item.config), item.tunable) for item in self._items]

    def _check_savable(self) -> None:
        """StrategyFileError naming the first item whose config a strategy file cannot hold."""
        for index, (name, config, _) in enumerate(self._plain_items()):
            try:
                _check_savable(config, f"item {index} ({name!r}): config")
            except RecursionError as error:
                raise StrategyFileError(
                    f"cannot save strategy: item {index} ({name!r}): config is nested too deeply or contains itself"
                ) from error

    # --- pickle (seed format) ----------------------------------------------------------------
    def __getstate__(self) -> dict:
        # plain tuples only, so the restricted unpickler needs no other class
        return {"version": _VERSION, "items": self._plain_items()}

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("items"), list):
            raise UnsafeStrategyError(f"not a Strategy state: {type(state).__name__}")
        self._items = [_to_item(entry) for entry in state["items"]]

    def to_bytes(self) -> bytes:
        """The pickle (seed format); a config value that could not be loaded back is a
        StrategyFileError naming the item."""
        self._check_savable()
        return pickle.dumps(self, protocol=4)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Strategy":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StrategyFileError(f"strategy data must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if not data:
            raise StrategyFileError("empty file: the strategy data is 0 bytes, expected a pickled Strategy")
        stream = io.BytesIO(data)
        try:
            loaded = _SafeUnpickler(stream).load()
        except StrategyFileError:  # UnsafeStrategyError included
            raise
        except StrategyError as error:  # a malformed entry inside the pickled state
            raise StrategyFileError(f"strategy pickle holds a malformed method entry: {error}") from error
        except Exception as error:  # truncated or foreign data
            reason = str(error) or type(error).__name__
            if stream.tell() >= len(data):  # the data ran out before the pickle's STOP
                raise StrategyFileError(
                    f"truncated pickle data: the {len(data)} bytes end before the pickle is complete ({reason})"
                ) from error
            if isinstance(error, KeyError) and isinstance(error.args[0], int):  # no such opcode
                reason = f"invalid opcode byte {error.args[0]:#04x} at offset {stream.tell() - 1}"
            raise StrategyFileError(f"not a strategy pickle: {type(error).__name__}: {reason}") from error
        if isinstance(loaded, list):  # a bare list of methods pickled directly
            try:
                loaded = Strategy(loaded)
            except StrategyError as error:
                raise StrategyFileError(f"strategy pickle holds a malformed method entry: {error}") from error
        if not isinstance(loaded, Strategy):
            raise StrategyFileError(f"pickle holds a {type(loaded).__name__}, not a Strategy")
        return loaded

    # --- JSON --------------------------------------------------------------------------------
    def to_json(self) -> str:
        self._check_savable()
        methods = [
            {"name": name, "config": _encode(config, name), "tunable": tunable}
            for name, config, tunable in self._plain_items()
        ]
        return json.dumps({"format": _FORMAT, "version": _VERSION, "methods": methods}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        if not isinstance(text, (str, bytes, bytearray)):
            raise StrategyFileError(f"strategy JSON must be text, not {type(text).__name__}")
        if not text.strip():
            raise StrategyFileError("empty file: the strategy JSON is empty, expected an atorch strategy")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise StrategyFileError(f"strategy JSON is not valid JSON: {error}") from error
        except RecursionError as error:
            raise StrategyFileError("strategy JSON is nested too deeply") from error
        try:
            if isinstance(data, list):
                return Strategy(_decode(entry) for entry in data)
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise StrategyFileError(f"JSON is not an atorch strategy (expected format {_FORMAT!r})")
            methods = data.get("methods", [])
            if not isinstance(methods, list):
                raise StrategyFileError(f"strategy JSON 'methods' must be a list, got {type(methods).__name__}")
            items = []
            for entry in methods:
                if not isinstance(entry, dict) or "name" not in entry:
                    raise StrategyFileError(f"strategy JSON method entry must have a 'name': {entry!r}")
                items.append((entry["name"], _decode(entry.get("config")), bool(entry.get("tunable", False))))
            return Strategy(items)
        except StrategyFileError:
            raise
        except StrategyError as error:
            raise StrategyFileError(f"strategy JSON holds a malformed method entry: {error}") from error
        except RecursionError as error:
            raise StrategyFileError("strategy JSON is nested too deeply") from error

    # --- files -------------------------------------------------------------------------------
    def serialize(self, path: str | os.PathLike) -> bytes:
        """The file content ``save(path)`` writes (JSON for ``.json``, else a pickle), checked to
        load back; a StrategyFileError naming the item when a config cannot be saved."""
        as_json = _file_path(path).endswith(".json")
        data = (self.to_json() + "\n").encode("utf-8") if as_json else self.to_bytes()
        try:  # belt and braces: what is written must read back in this process
            Strategy.from_json(data.decode("utf-8")) if as_json else Strategy.from_bytes(data)
        except StrategyFileError as error:
            raise StrategyFileError(f"cannot save strategy: it would not load back: {error}") from error
        return data

    def save(self, path: str | os.PathLike) -> None:
        """Readable JSON for ``.json``; a pickle (the seed's format) for any other suffix.

        Atomic: the strategy is serialised first (the file is untouched when that fails), then
        written to a temporary file in the same directory, fsynced and ``os.replace``d onto
        ``path``. A failure is a StrategyFileError and leaves any previous file byte-identical.
        """
        path = _file_path(path)
        _write_atomic(path, self.serialize(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Strategy":
        path = _file_path(path)
        if not os.path.isfile(path):
            raise StrategyFileError(f"strategy file not found: {path!r}")
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise StrategyFileError(f"cannot read strategy file {path!r}: {error}") from error
        try:
            if not data.strip():
                raise StrategyFileError(f"empty file: the strategy file is {len(data)} bytes")
            if path.endswith(".json") or data.lstrip()[:1] in (b"{", b"["):
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise StrategyFileError(f"strategy JSON is not UTF-8 text: {error}") from error
                return cls.from_json(text)
            return cls.from_bytes(data)
        except StrategyFileError as error:  # the same type (UnsafeStrategyError stays one), with the path
            raise type(error)(f"strategy file {path!r}: {error}") from error

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


def _normalized(name: str, config: Any) -> Any:
    """``config`` as loading normalises it; as given when there is no normalizer, or when loading
    would refuse it (equality never raises)."""
    if _config_normalizer is None:
        return config
    try:
        return _config_normalizer(name, config)
    except (AtorchError, TypeError, ValueError):
        return config


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


# --- saving ----------------------------------------------------------------------------------
def _file_path(path: Any) -> str:
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError as error:
        raise StrategyFileError(
            f"a strategy file path must be a str or os.PathLike, not {type(path).__name__}") from error


def _check_savable(value: Any, where: str) -> None:
    """Raise StrategyFileError unless ``value`` is what the loaders rebuild: plain data (exact
    builtin types), torch dtypes and module-level nn.Module classes."""
    kind = type(value)
    if kind in _SCALARS or kind is torch.dtype:
        return
    if kind in (list, tuple):
        for index, inner in enumerate(value):
            _check_savable(inner, f"{where}[{index}]")
        return
    if kind in (set, frozenset):
        for inner in value:
            _check_savable(inner, f"{where} element {inner!r}")
        return
    if kind is dict:
        for key, inner in value.items():
            _check_savable(key, f"{where} key {key!r}")
            _check_savable(inner, f"{where}[{key!r}]")
        return
    if isinstance(value, type):
        _check_savable_class(value, where)
        return
    raise StrategyFileError(
        f"cannot save strategy: {where} is {_describe(value)}, which a strategy file cannot hold; "
        "configs in a file may hold only plain data (None, bool, int, float, str, list, tuple, dict, "
        "set), torch dtypes and nn.Module classes defined at module level"
    )


def _check_savable_class(cls: type, where: str) -> None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not issubclass(cls, torch.nn.Module):
        reason = "not an nn.Module class; the only classes a strategy file may name are nn.Module classes"
    elif "<locals>" in cls.__qualname__:
        reason = ("defined inside a function, so it cannot be found again by its module and name when the "
                  "file is loaded; define it at module level")
    elif _lookup(cls.__module__, cls.__qualname__) is not cls:
        reason = (f"not reachable as {cls.__module__}:{cls.__qualname__} (created dynamically or replaced "
                  "since), so the file could not name it")
    else:
        return
    raise StrategyFileError(f"cannot save strategy: {where} is the class {name}, {reason}")


def _describe(value: Any) -> str:
    kind = type(value)
    qualname = getattr(value, "__qualname__", None) if callable(value) else None
    if isinstance(qualname, str):
        what = "a lambda" if qualname.endswith("<lambda>") else "a function"
        return f"{what} ({getattr(value, '__module__', '?')}.{qualname})"
    described = f"an object of type {kind.__module__}.{kind.__qualname__}"
    for plain in (dict, list, tuple, set, frozenset, int, float, str, bytes):
        if isinstance(value, plain):
            return f"{described} (a subclass of {plain.__name__}: use a plain {plain.__name__})"
    return described


def _write_atomic(path: str, data: bytes) -> None:
    """``write_atomic`` (a temporary file, fsynced, ``os.replace``d onto ``path``); StrategyFileError."""
    try:
        write_atomic(path, data)
    except OSError as error:
        raise StrategyFileError(f"cannot write strategy file {path!r}: {error}") from error


# --- JSON value encoding ---------------------------------------------------------------------
def _encode(value: Any, method: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, method) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, method) for v in value]}
    if isinstance(value, (set, frozenset)):
        tag = "__frozenset__" if isinstance(value, frozenset) else "__set__"
        return {tag: [_encode(v, method) for v in sorted(value, key=repr)]}
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
        if key in ("__tuple__", "__set__", "__frozenset__", "__dict__") and not isinstance(inner, list):
            raise StrategyFileError(f"strategy JSON {key} must hold a list, got {inner!r}")
        if key in ("__dtype__", "__class__") and not isinstance(inner, str):
            raise StrategyFileError(f"strategy JSON {key} must hold a string, got {inner!r}")
        if key == "__tuple__":
            return tuple(_decode(v) for v in inner)
        if key == "__set__":
            return _hashable(key, set, [_decode(v) for v in inner])
        if key == "__frozenset__":
            return _hashable(key, frozenset, [_decode(v) for v in inner])
        if key == "__dtype__":
            return _dtype(inner)
        if key == "__class__":
            module, _, qualname = inner.partition(":")
            return _module_class(module, qualname)
        if key == "__dict__":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in inner):
                raise StrategyFileError(f"strategy JSON __dict__ must hold [key, value] pairs, got {inner!r}")
            return _hashable(key, dict, [(_decode(k), _decode(v)) for k, v in inner])
    return {k: _decode(v) for k, v in value.items()}


def _hashable(key: str, build: type, values: list) -> Any:
    try:
        return build(values)
    except TypeError as error:  # an unhashable member (a list as a set element or dict key)
        raise StrategyFileError(f"strategy JSON {key} holds an unhashable value: {error}") from error


def _dtype(name: str) -> torch.dtype:
    """A torch dtype by name, from the fixed table (never an attribute lookup on torch)."""
    if name not in _DTYPES:
        raise UnsafeStrategyError(f"torch.{name} is not a torch dtype; refusing to load it")
    return _DTYPES[name]


def _lookup(module: str, qualname: str) -> Any:
    """``module.qualname`` found without running code: only in modules already in ``sys.modules``,
    through their ``__dict__`` (no module ``__getattr__``, no descriptors, no import)."""
    target = sys.modules.get(module)
    if target is None or not qualname:
        return _MISSING
    for part in qualname.split("."):
        target = inspect.getattr_static(target, part, _MISSING)
        if target is _MISSING:
            return _MISSING
    return target


def _module_class(module: str, qualname: str) -> type:
    """An nn.Module class named by a file, resolved against the modules already imported; never
    imports. Anything else is an UnsafeStrategyError naming the global."""
    if sys.modules.get(module) is None:
        raise UnsafeStrategyError(
            f"strategy names the global {module}.{qualname} (module {module!r}, name {qualname!r}), but "
            f"module {module!r} is not imported; atorch never imports a module named by a strategy file: "
            "import the module that defines your model before loading its strategy"
        )
    target = _lookup(module, qualname)
    if not (issubclass(type(target), type) and issubclass(target, torch.nn.Module)):
        raise UnsafeStrategyError(
            f"strategy names the global {module}.{qualname} (module {module!r}, name {qualname!r}), which is "
            "not an nn.Module class; refusing to load it"
        )
    return target


class _SafeUnpickler(CallFreeUnpickler):
    """Unpickler that only rebuilds Strategy objects holding plain data.

    Any opcode that would call a function (REDUCE, INST, OBJ, NEWOBJ_EX, extensions, persistent
    ids) is refused; NEWOBJ/BUILD are allowed for Strategy alone; globals are limited to Strategy,
    torch dtypes, builtins set/frozenset and nn.Module classes of modules already imported (which are
    only referenced, never called). Globals are resolved without importing or calling anything.
    """

    buildable = (Strategy,)

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "Strategy":
            return Strategy
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if module in ("builtins", "__builtin__") and name in ("set", "frozenset"):
            return {"set": set, "frozenset": frozenset}[name]
        return _module_class(module, name)

    def refuse(self) -> None:
        raise UnsafeStrategyError(
            "strategy pickle tries to call code while loading; refused (only plain strategy data is allowed)"
        )
