"""half: train with parameters, activations and floating inputs in fp16 or bf16."""
from __future__ import annotations

from typing import Any

import torch

from atorch.auto.opt_lib.amp import parse_dtype
from atorch.auto.opt_lib.base import Optimization


class HalfOptimization(Optimization):
    name = "half"
    is_tunable = True
    default_config = "fp16"

    def normalize(self, config: Any) -> str:
        dtype = parse_dtype(self.name, self.default_config if config is None else config)
        return "fp16" if dtype == torch.float16 else "bf16"

    def candidates(self, ctx) -> list[Any]:
        return ["bf16", "fp16"]

    def transform(self, ctx, config: str) -> None:
        dtype = parse_dtype(self.name, config)
        ctx.half_dtype = dtype  # module_replace checks its pairs' dtypes against it

        def cast(ctx) -> None:
            ctx.model.to(dtype)
            ctx.input_dtype = dtype

        ctx.add_wrapper("half", self.name, cast)
