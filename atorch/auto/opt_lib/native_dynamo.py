"""native_dynamo: ``torch.compile`` of the model, applied after the parallel wrappers.

Config: ``{"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None}`` (any subset).
Compiling after DDP / FSDP lets dynamo see the wrapper (DDP's graph breaks at bucket boundaries so
communication still overlaps). The compiled module's parameters and state dict are the original
model's (keys gain the ``_orig_mod.`` prefix of ``torch.compile``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch

from atorch.auto.opt_lib.base import Optimization
from atorch.errors import MethodConfigError
from atorch.utils.config import MethodConfig, option

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True)
class NativeDynamoConfig(MethodConfig):
    backend: Union[str, Callable] = option("inductor", doc="torch.compile backend: a registered name or a callable")
    mode: Optional[Mode] = option(None, doc="torch.compile mode")
    fullgraph: bool = option(False, doc="fail on a graph break instead of splitting the graph")
    dynamic: Optional[bool] = option(None, doc="dynamic shapes: None lets dynamo decide")


class NativeDynamoOptimization(Optimization):
    name = "native_dynamo"
    config_class = NativeDynamoConfig
    stages = ("compile",)
    reads = ("model",)
    writes = ("model",)

    def normalize(self, config: Any) -> NativeDynamoConfig:
        config = super().normalize(config)
        backend = config.backend
        if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise MethodConfigError(self.name,
                                    f"backend {backend!r} is unknown; available: {torch._dynamo.list_backends()}")
        return config

    def transform(self, ctx, config: NativeDynamoConfig) -> None:
        def wrap(ctx) -> None:
            ctx.model = torch.compile(ctx.model, **config.to_dict(omit_defaults=False))

        ctx.add_wrapper("compile", self.name, wrap)
