"""The registry of optimization methods: name -> instance, in registration order.

Everything derived from the methods' declared facts (the stage contract, the mesh dimensions, the
compatibility check) reads the methods from here, so a registered method counts as a built-in one.
"""
from __future__ import annotations

import dataclasses
from typing import Type

from atorch.auto.opt_lib.base import Optimization
from atorch.errors import UnknownMethodError
from atorch.utils.config import MethodConfig

_REGISTRY: dict[str, Optimization] = {}


def register_optimization(method: Optimization | Type[Optimization], *, replace: bool = False) -> Optimization:
    """Register a method instance (or class, instantiated with no arguments). Returns the instance."""
    instance = method() if isinstance(method, type) else method
    if not isinstance(instance, Optimization) or not instance.name:
        raise TypeError("register_optimization needs an Optimization subclass with a non-empty name")
    config_class = instance.config_class
    if config_class is not None and not (isinstance(config_class, type) and issubclass(config_class, MethodConfig)
                                         and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"{instance.name}: config_class must be a @dataclass(frozen=True) subclass of "
                        f"atorch.utils.config.MethodConfig (or None), got {config_class!r}")
    if instance.name in _REGISTRY and not replace:
        raise ValueError(f"optimization {instance.name!r} is already registered (pass replace=True)")
    _REGISTRY[instance.name] = instance
    return instance


def unregister_optimization(name: str) -> None:
    _REGISTRY.pop(name, None)


def get_optimization(name: str) -> Optimization:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(name, _REGISTRY) from None


def registered_names() -> list[str]:
    return list(_REGISTRY)


def registered_methods() -> list[Optimization]:
    """The registered method instances, in registration order."""
    return list(_REGISTRY.values())
