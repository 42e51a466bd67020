"""half: train with parameters, activations and floating inputs in fp16 or bf16."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atorch.auto.opt_lib.base import Optimization
from atorch.utils.config import LOW_PRECISION_DTYPES, MethodConfig, option


@dataclass(frozen=True)
class HalfConfig(MethodConfig):
    dtype: torch.dtype = option(torch.float16, doc="torch.float16 ('fp16') or torch.bfloat16 ('bf16')",
                                choices=LOW_PRECISION_DTYPES)


class HalfOptimization(Optimization):
    name = "half"
    config_class = HalfConfig
    stages = ("half",)
    reads = ("model",)
    writes = ("model", "input_dtype")
    record_writes = ("half_dtype",)  # module_replace checks its pairs' dtypes against it

    def normalize(self, config: Any) -> HalfConfig:
        """Also accepts the dtype alone: ``"bf16"`` or ``torch.bfloat16``."""
        if isinstance(config, (str, torch.dtype)):
            config = {"dtype": config}
        return super().normalize(config)

    def precision(self, config: HalfConfig) -> torch.dtype:
        return config.dtype

    def stores_weights_in(self, config: HalfConfig) -> torch.dtype:
        return config.dtype

    def transform(self, ctx, config: HalfConfig) -> None:
        dtype = config.dtype
        ctx.half_dtype = dtype  # module_replace checks its pairs' dtypes against it

        def cast(ctx) -> None:
            ctx.model.to(dtype)
            ctx.input_dtype = dtype

        ctx.add_wrapper("half", self.name, cast)
