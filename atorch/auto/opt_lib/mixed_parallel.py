"""mixed_parallel: tensor × pipeline × data on the one mesh of parallel_mode.

``([("tensor", 2), ("pipeline", 2)], None)`` on 4 ranks: the model is cut into pipeline stages
(``pipeline_parallel``), each stage's layers are split over the tensor group (``tensor_parallel``),
and the data dimension (and zero1 / fsdp on it, as separate methods) replicates the whole. Config:
``{"pipeline": <pipeline_parallel config>, "tensor": <tensor_parallel config>}``, both optional.
"""
from __future__ import annotations

from typing import Any

from atorch.errors import MethodConfigError
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.pipeline_parallel import apply_pipeline, normalize_pipeline_config
from atorch.auto.opt_lib.tensor_parallel import TensorParallelOptimization, apply_tensor_parallel


class MixedParallelOptimization(Optimization):
    name = "mixed_parallel"
    distributed_only = True
    is_tunable = True
    default_config = None

    def normalize(self, config: Any) -> dict:
        config = {} if config is None else config
        if not isinstance(config, dict) or set(config) - {"pipeline", "tensor"}:
            raise MethodConfigError(self.name, f"config must be a dict with keys 'pipeline' and/or 'tensor', got {config!r}")
        return {"pipeline": normalize_pipeline_config(self.name, config.get("pipeline")),
                "tensor": TensorParallelOptimization().normalize(config.get("tensor"))}

    def transform(self, ctx, config: dict) -> None:
        ctx.add_wrapper("pipeline", self.name, lambda ctx: apply_pipeline(ctx, config["pipeline"]))
        ctx.add_wrapper("model_parallel", self.name, lambda ctx: apply_tensor_parallel(ctx, config["tensor"]))
