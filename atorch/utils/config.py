"""Typed method configs: each method declares a frozen dataclass, and ONE validator builds it from a
user's dict, with errors that name the key, the bad value and what is valid.

A config class is a ``@dataclass(frozen=True)`` subclass of ``MethodConfig`` whose fields are made
with ``option(default, doc=...)``. The annotations say what a value may be; ``validate_config``
reads them (``typing.get_type_hints``) and accepts:

- ``bool`` (True / False only), ``int`` (not a bool), ``float`` (an int is taken), ``str``;
- ``torch.dtype``: a dtype or a name in ``DTYPE_NAMES`` ('bf16', 'fp16', 'half', 'fp32', ...);
- ``Optional[X]`` and ``Union[...]``, ``Literal[...]`` (the choices), ``type[nn.Module]`` (a class);
- ``tuple[X, ...]``: a list, tuple or set, or one bare value, stored as a tuple (a dict, where X is
  a pair, is taken as its items); ``tuple[A, B]``: a pair;
- a nested ``MethodConfig`` (a dict, or an instance);
- field metadata ``minimum`` / ``maximum`` (inclusive) and ``choices`` (narrower than the type).

``to_dict()`` gives the non-default fields (what strategy files store), ``field_docs()`` a row per
field for the generated documentation.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Mapping, NamedTuple, Optional, TypeVar, Union

import torch

from atorch.errors import MethodConfigError, nearest_name

DTYPE_NAMES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32,
}
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
# modules named by class or by class name / qualified-name glob (checkpoint, fsdp)
ModuleTargets = tuple[Union[str, type[torch.nn.Module]], ...]

_NONE = type(None)
_ARTICLED = {bool: "a bool (True or False)", int: "an int", float: "a number", str: "a string"}
C = TypeVar("C", bound="MethodConfig")


def option(default: Any = dataclasses.MISSING, *, doc: str, default_factory: Any = dataclasses.MISSING,
           minimum: Any = None, maximum: Any = None, choices: Optional[tuple] = None) -> Any:
    """A config field: its default (none: the key is required), a one-line ``doc`` for the generated
    docs, and checks beyond the type: ``minimum`` / ``maximum`` (inclusive), ``choices``."""
    metadata = {"doc": doc, "minimum": minimum, "maximum": maximum, "choices": choices}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


class FieldDoc(NamedTuple):
    name: str
    type: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Base of the methods' configs (frozen dataclasses); build one with ``validate_config``."""

    def to_dict(self, omit_defaults: bool = True) -> dict:
        """The fields as a dict (nested configs as dicts too); by default only those that differ
        from their default, which is what strategy files store."""
        return {name: value.to_dict(omit_defaults) if isinstance(value, MethodConfig) else value
                for name, value in self._fields(omit_defaults)}

    def __str__(self) -> str:
        """The short form: only the fields that differ from their default."""
        shown = ", ".join(f"{name}={value}" if isinstance(value, MethodConfig) else f"{name}={value!r}"
                          for name, value in self._fields(omit_defaults=True))
        return f"{type(self).__name__}({shown})"

    def _fields(self, omit_defaults: bool) -> list[tuple[str, Any]]:
        values = [(f.name, getattr(self, f.name), _default(f)) for f in dataclasses.fields(self)]
        return [(name, value) for name, value, default in values if not (omit_defaults and value == default)]

    @classmethod
    def field_docs(cls) -> list[FieldDoc]:
        """One row per field (name, type, default, doc), for the generated method docs."""
        hints = _hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            default = _default(f)
            shown = "required" if default is dataclasses.MISSING else _show(default)
            rows.append(FieldDoc(f.name, type_name(hints[f.name]), shown, f.metadata.get("doc", "")))
        return rows


def validate_config(method: str, cls: type[C], values: Any, prefix: str = "") -> C:
    """The one validator: a dict (or an instance, checked again) → a ``cls`` instance, or a
    MethodConfigError naming ``method`` and the bad key / value. ``prefix`` names a nested config."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if isinstance(values, cls):
        values = values.to_dict(omit_defaults=False)
    if not isinstance(values, Mapping):
        where = prefix.rstrip(".") or "config"
        raise MethodConfigError(method, f"{where} must be a dict with keys among {list(fields)}, got {values!r}")
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise MethodConfigError(method, _unknown_keys(unknown, list(fields), prefix))
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        if name in values:
            kwargs[name] = _check_field(method, key, values[name], hints[name], f.metadata)
        elif _default(f) is dataclasses.MISSING:
            raise MethodConfigError(method, f"missing key {key!r} ({type_name(hints[name])})")
    return cls(**kwargs)


def type_name(tp: Any) -> str:
    """A short readable name of an annotation, for errors and docs."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not _NONE) + (" or None" if _NONE in args else "")
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            inner = type_name(args[0])
            return f"tuple of ({inner})" if " or " in inner or " | " in inner else f"tuple of {inner}"
        return "(" + ", ".join(type_name(a) for a in args) + ")"
    if origin is type:
        return "nn.Module class" if args[0] is torch.nn.Module else f"{args[0].__name__} class"
    if origin is collections.abc.Callable:
        return "callable"
    if tp is Any:
        return "any"
    if tp is torch.dtype:
        return "dtype"
    return getattr(tp, "__name__", str(tp))


# --- internals ---------------------------------------------------------------------------------
class _Invalid(Exception):
    """The innermost bad value and what was expected there (turned into a MethodConfigError)."""

    def __init__(self, path: str, value: Any, expected: str):
        super().__init__(path)
        self.path, self.value, self.expected = path, value, expected


def _check_field(method: str, key: str, value: Any, tp: Any, meta: Mapping) -> Any:
    choices = meta.get("choices")
    try:
        value = _convert(method, key, value, tp)
        if choices is not None and value not in choices:
            raise _Invalid(key, value, "")
    except _Invalid as bad:
        expected = f"one of {_show_choices(choices)}" if choices is not None else bad.expected
        raise MethodConfigError(method, f"{bad.path}={bad.value!r} is not valid: expected {expected}") from None
    low, high = meta.get("minimum"), meta.get("maximum")
    if value is not None and (low is not None and value < low or high is not None and value > high):
        bounds = " and ".join(f"{op} {b!r}" for op, b in ((">=", low), ("<=", high)) if b is not None)
        raise MethodConfigError(method, f"{key}={value!r} is out of range: expected {bounds}")
    return value


def _convert(method: str, path: str, value: Any, tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        options = [a for a in args if a is not _NONE]
        if len(options) == 1:
            try:
                return _convert(method, path, value, options[0])
            except _Invalid as bad:
                if bad.path == path and _NONE in args:
                    bad.expected += " or None"
                raise
        for option_type in options:
            try:
                return _convert(method, path, value, option_type)
            except _Invalid:
                continue
        raise _Invalid(path, value, type_name(tp))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Invalid(path, value, f"one of {list(args)!r}")
    if origin is tuple:
        return _convert_tuple(method, path, value, args)
    if origin is type:
        if isinstance(value, type) and issubclass(value, args[0]):
            return value
        raise _Invalid(path, value, type_name(tp))
    if origin is collections.abc.Callable:
        if callable(value):
            return value
        raise _Invalid(path, value, "callable")
    if isinstance(tp, type) and issubclass(tp, MethodConfig):
        return validate_config(method, tp, value, prefix=path + ".")
    return _convert_scalar(path, value, tp)


def _convert_tuple(method: str, path: str, value: Any, args: tuple) -> tuple:
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any number of X
        if isinstance(value, Mapping) and typing.get_origin(args[0]) is tuple:
            items = list(value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        else:
            items = [value]  # one bare value
        return tuple(_convert(method, f"{path}[{i}]", item, args[0]) for i, item in enumerate(items))
    if not isinstance(value, (list, tuple)) or len(value) != len(args):
        raise _Invalid(path, value, type_name(tuple[args]))
    return tuple(_convert(method, f"{path}[{i}]", item, tp) for i, (item, tp) in enumerate(zip(value, args)))


def _convert_scalar(path: str, value: Any, tp: Any) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.lower() in DTYPE_NAMES:
            return DTYPE_NAMES[value.lower()]
        raise _Invalid(path, value, f"a torch dtype or one of {list(DTYPE_NAMES)}")
    if tp in _ARTICLED:
        raise _Invalid(path, value, _ARTICLED[tp])
    raise TypeError(f"config annotation {tp!r} is not supported by validate_config")


def _unknown_keys(unknown: list, valid: list[str], prefix: str) -> str:
    parts = []
    for key in unknown:
        close = nearest_name(key, valid)
        parts.append(repr(prefix + key) if isinstance(key, str) else repr(key))
        if close:
            parts[-1] += f" (did you mean {prefix + close!r}?)"
    noun = "key" if len(unknown) == 1 else "keys"
    listed = ", ".join(prefix + v for v in valid) or "none (this method takes no config)"
    return f"unknown {noun} {', '.join(parts)}; valid keys: {listed}"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if isinstance(value, type):
        return value.__name__
    return str(value) if isinstance(value, MethodConfig) else repr(value)


def _show_choices(choices: tuple) -> str:
    names = {dtype: name for name, dtype in reversed(DTYPE_NAMES.items())}  # the shortest name of each
    return "[" + ", ".join(f"{c!r} ({names[c]!r})" if c in names else repr(c) for c in choices) + "]"


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


__all__ = ["MethodConfig", "option", "validate_config", "type_name", "FieldDoc", "DTYPE_NAMES",
           "LOW_PRECISION_DTYPES", "ModuleTargets"]
