"""native_dynamo: ``torch.compile`` of the model, applied after the parallel wrappers.

Config: ``{"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None}`` (any subset).
Compiling after DDP / FSDP lets dynamo see the wrapper (DDP's graph breaks at bucket boundaries so
communication still overlaps). The compiled module's parameters and state dict are the original
model's (keys gain the ``_orig_mod.`` prefix of ``torch.compile``).
"""
from __future__ import annotations

from typing import Any

import torch

from atorch.errors import MethodConfigError
from atorch.auto.opt_lib.base import Optimization

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULTS = {"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None}


class NativeDynamoOptimization(Optimization):
    name = "native_dynamo"
    is_tunable = True
    default_config = DEFAULTS

    def normalize(self, config: Any) -> dict:
        config = {} if config is None else config
        if not isinstance(config, dict):
            raise MethodConfigError(self.name, f"config must be a dict of torch.compile options, got {config!r}")
        unknown = sorted(set(config) - set(DEFAULTS))
        if unknown:
            raise MethodConfigError(self.name, f"unknown key(s) {unknown}; valid keys: {list(DEFAULTS)}")
        out = {**DEFAULTS, **config}
        if out["mode"] not in MODES:
            raise MethodConfigError(self.name, f"mode={out['mode']!r} is not valid; choose one of {list(MODES)}")
        backend = out["backend"]
        if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise MethodConfigError(self.name, f"backend {backend!r} is unknown; available: {torch._dynamo.list_backends()}")
        if not isinstance(out["fullgraph"], bool) or out["dynamic"] not in (None, True, False):
            raise MethodConfigError(self.name, "fullgraph must be a bool and dynamic None or a bool")
        return out

    def candidates(self, ctx) -> list[Any]:
        return [dict(DEFAULTS)]

    def transform(self, ctx, config: dict) -> None:
        def wrap(ctx) -> None:
            ctx.model = torch.compile(ctx.model, **config)

        ctx.add_wrapper("compile", self.name, wrap)
