"""mixed_parallel: tensor × pipeline × data on the one mesh of parallel_mode.

``([("tensor", 2), ("pipeline", 2)], None)`` on 4 ranks: the model is cut into pipeline stages
(``pipeline_parallel``), each stage's layers are split over the tensor group (``tensor_parallel``),
and the data dimension (and zero1 / fsdp on it, as separate methods) replicates the whole. Config:
``{"pipeline": <pipeline_parallel config>, "tensor": <tensor_parallel config>}``, both optional.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atorch.auto.opt_lib.base import SHARDED_STAGES, SHARDED_STAGES_WHY, Optimization
from atorch.auto.opt_lib.pipeline_parallel import (
    PipelineParallelConfig,
    PipelineParallelOptimization,
    apply_pipeline,
    stages_per_rank,
)
from atorch.auto.opt_lib.tensor_parallel import (
    TensorParallelConfig,
    TensorParallelOptimization,
    apply_tensor_parallel,
    find_plan_before_pipeline,
)
from atorch.utils.config import MethodConfig, option


@dataclass(frozen=True)
class MixedParallelConfig(MethodConfig):
    pipeline: PipelineParallelConfig = option(default_factory=PipelineParallelConfig,
                                              doc="the pipeline_parallel config of the pipeline dimension")
    tensor: TensorParallelConfig = option(default_factory=TensorParallelConfig,
                                          doc="the tensor_parallel config of each stage")


class MixedParallelOptimization(Optimization):
    name = "mixed_parallel"
    distributed_only = True
    config_class = MixedParallelConfig
    stages = ("pipeline", "model_parallel")
    reads = {"pipeline": PipelineParallelOptimization.reads + ("sequence_parallel",),  # the plan is found first
             "model_parallel": TensorParallelOptimization.reads}
    writes = {"pipeline": PipelineParallelOptimization.writes, "model_parallel": TensorParallelOptimization.writes}
    mesh_dims = ("tensor", "pipeline")
    excludes = {"tensor parallel": "mixed_parallel already includes tensor parallel",
                "pipeline parallel": "mixed_parallel already includes pipeline parallel",
                "micro-batches": "a pipeline splits the batch into micro-batches itself: set its num_micro_batch",
                SHARDED_STAGES: SHARDED_STAGES_WHY}

    def normalize(self, config: Any) -> MixedParallelConfig:
        config = super().normalize(config)
        stages_per_rank(config.pipeline, self.name)
        return config

    def transform(self, ctx, config: MixedParallelConfig) -> None:
        found: dict = {}  # the tensor plan, found and checked on the whole model before the pipeline cut

        def pipeline(ctx) -> None:
            found["plan"] = find_plan_before_pipeline(ctx, config.tensor)
            apply_pipeline(ctx, config.pipeline)

        ctx.add_wrapper("pipeline", self.name, pipeline)
        ctx.add_wrapper("model_parallel", self.name,
                        lambda ctx: apply_tensor_parallel(ctx, config.tensor, found.get("plan")))
