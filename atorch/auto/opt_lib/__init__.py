"""Registry: the one place that lists the optimization methods.

Built-in methods are registered below; users add their own with ``register_optimization``.
"""
from __future__ import annotations

import dataclasses
from typing import Type

from atorch.auto.opt_lib.activation_checkpoint import CheckpointOptimization
from atorch.auto.opt_lib.amp import AmpNativeOptimization
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.ds_3d_parallel import DS3DParallelOptimization
from atorch.auto.opt_lib.fp8 import FP8Optimization
from atorch.auto.opt_lib.fsdp import FSDPOptimization
from atorch.auto.opt_lib.half import HalfOptimization
from atorch.auto.opt_lib.micro_batch import MicroBatchOptimization
from atorch.auto.opt_lib.mixed_parallel import MixedParallelOptimization
from atorch.auto.opt_lib.module_replace import ModuleReplaceOptimization
from atorch.auto.opt_lib.native_dynamo import NativeDynamoOptimization
from atorch.auto.opt_lib.parallel_mode import ParallelModeOptimization
from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelOptimization
from atorch.auto.opt_lib.sequence_parallel import SequenceParallelOptimization
from atorch.auto.opt_lib.tensor_parallel import TensorParallelOptimization
from atorch.auto.opt_lib.zero import Zero1Optimization, Zero2Optimization
from atorch.auto.strategy import set_config_normalizer
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


BUILTIN_METHODS = (
    ParallelModeOptimization, AmpNativeOptimization, HalfOptimization, CheckpointOptimization,
    Zero1Optimization, Zero2Optimization, FSDPOptimization, ModuleReplaceOptimization, FP8Optimization,
    NativeDynamoOptimization, TensorParallelOptimization, SequenceParallelOptimization,
    PipelineParallelOptimization, MixedParallelOptimization, DS3DParallelOptimization, MicroBatchOptimization,
)
for _method in BUILTIN_METHODS:
    register_optimization(_method)
del _method
set_config_normalizer(lambda name, config: get_optimization(name).normalize(config))  # Strategy equality

__all__ = ["Optimization", "register_optimization", "unregister_optimization", "get_optimization", "registered_names"]
