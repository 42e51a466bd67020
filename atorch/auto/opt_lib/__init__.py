"""The optimization methods: the built-in ones are registered below, users add their own with
``register_optimization`` (``registry.py``); the tables derived from the methods' declared facts
(``facts.py``) include both alike.
"""
from __future__ import annotations

from atorch.auto.opt_lib.activation_checkpoint import CheckpointOptimization
from atorch.auto.opt_lib.amp import AmpNativeOptimization
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.ds_3d_parallel import DS3DParallelOptimization
from atorch.auto.opt_lib.facts import exclusive_groups, record_time_facts, required_dims, stage_contract
from atorch.auto.opt_lib.fp8 import FP8Optimization
from atorch.auto.opt_lib.fsdp import FSDPOptimization
from atorch.auto.opt_lib.half import HalfOptimization
from atorch.auto.opt_lib.micro_batch import MicroBatchOptimization
from atorch.auto.opt_lib.mixed_parallel import MixedParallelOptimization
from atorch.auto.opt_lib.module_replace import ModuleReplaceOptimization
from atorch.auto.opt_lib.native_dynamo import NativeDynamoOptimization
from atorch.auto.opt_lib.parallel_mode import ParallelModeOptimization
from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelOptimization
from atorch.auto.opt_lib.registry import (
    get_optimization,
    register_optimization,
    registered_methods,
    registered_names,
    unregister_optimization,
)
from atorch.auto.opt_lib.sequence_parallel import SequenceParallelOptimization
from atorch.auto.opt_lib.tensor_parallel import TensorParallelOptimization
from atorch.auto.opt_lib.zero import Zero1Optimization, Zero2Optimization
from atorch.auto.strategy import set_config_normalizer

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

__all__ = ["Optimization", "register_optimization", "unregister_optimization", "get_optimization", "registered_names",
           "registered_methods", "stage_contract", "record_time_facts", "required_dims", "exclusive_groups"]
