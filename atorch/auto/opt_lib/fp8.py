"""fp8: ``nn.Linear`` → TransformerEngine ``te.Linear`` run under ``te.fp8_autocast``.

Which Linear layers are converted is decided by ``select_fp8_linears`` (include / exclude name
substrings, weight dims multiples of 16), testable without a GPU. The method needs a GPU of compute
capability >= 8.9 and TransformerEngine >= 1.0; without them it is ignored with a warning, as the
seed says (``ignored_when_unavailable``). Users must keep the inputs of those layers 16-aligned too.
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn

from atorch.auto.opt_lib.base import Optimization
from atorch.utils.config import MethodConfig, option
from atorch.utils.forward_patch import patch_forward

logger = logging.getLogger(__name__)

RECIPE_KEYS = ("margin", "interval", "amax_history_len", "amax_compute_algo", "reduce_amax")  # besides fp8_format


@dataclass(frozen=True)
class FP8Config(MethodConfig):
    include: Optional[tuple[str, ...]] = option(None, doc="convert only Linear layers whose name holds one of these")
    exclude: Optional[tuple[str, ...]] = option(None, doc="leave Linear layers whose name holds one of these")
    verbose: bool = option(False, doc="log which layers are converted and why the others are not")
    margin: int = option(0, doc="DelayedScaling: margin of the scaling factor (a power of 2)", minimum=0)
    interval: int = option(1, doc="DelayedScaling: steps between scaling-factor updates", minimum=1)
    fp8_format: Literal["HYBRID", "E4M3"] = option("HYBRID", doc="HYBRID: E4M3 forward, E5M2 backward")
    amax_history_len: int = option(1024, doc="DelayedScaling: amax history length", minimum=1)
    amax_compute_algo: Literal["max", "most_recent"] = option("max", doc="DelayedScaling: amax from the history")
    reduce_amax: bool = option(True, doc="DelayedScaling: reduce amax over the data-parallel group")


def select_fp8_linears(model: nn.Module, include=None, exclude=None) -> tuple[list[str], dict[str, str]]:
    """(names to convert, {name: why not} for the nn.Linear layers left alone)."""
    chosen, skipped = [], {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if include and not any(part in name for part in include):
            skipped[name] = f"no include substring {list(include)} in the name"
        elif exclude and any(part in name for part in exclude):
            skipped[name] = f"an exclude substring {list(exclude)} is in the name"
        elif module.weight.shape[0] % 16 or module.weight.shape[1] % 16:
            skipped[name] = f"weight shape {tuple(module.weight.shape)} is not a multiple of 16 in both dims"
        else:
            chosen.append(name)
    return chosen, skipped


@functools.lru_cache(maxsize=None)
def fp8_unavailable_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper); none is present"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"fp8 needs compute capability >= 8.9; this GPU is sm {major}.{minor}"
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:
        return f"TransformerEngine >= 1.0 is not importable ({type(error).__name__}: {error})"
    return None


class FP8Optimization(Optimization):
    name = "fp8"
    config_class = FP8Config
    ignored_when_unavailable = True  # the seed: ignored (with a warning) without the hardware
    stages = ("fp8",)
    reads = ("model",)
    writes = ("model",)

    def requirements(self, config: Any = None) -> Optional[str]:
        return fp8_unavailable_reason()

    def transform(self, ctx, config: FP8Config) -> None:
        def wrap(ctx) -> None:
            names, skipped = select_fp8_linears(ctx.model, config.include, config.exclude)
            if config.verbose:
                logger.warning("fp8: converting %s; left alone: %s", names, skipped)
            convert_to_te_linear(ctx.model, names)
            patch_fp8_autocast(ctx.model, make_recipe(config))

        ctx.add_wrapper("fp8", self.name, wrap)


def convert_to_te_linear(model: nn.Module, names: list[str]) -> None:
    import transformer_engine.pytorch as te

    for name in names:
        linear = model.get_submodule(name)
        replacement = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                params_dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            replacement.weight.copy_(linear.weight)
            if linear.bias is not None:
                replacement.bias.copy_(linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)


def make_recipe(config: FP8Config) -> Any:
    from transformer_engine.common.recipe import DelayedScaling, Format

    accepted = inspect.signature(DelayedScaling).parameters
    kwargs = {k: getattr(config, k) for k in RECIPE_KEYS if k in accepted}
    return DelayedScaling(fp8_format=getattr(Format, config.fp8_format), **kwargs)


def patch_fp8_autocast(model: nn.Module, recipe: Any) -> None:
    patch_forward(model, _fp8_call, recipe=recipe)


def _fp8_call(forward, options: dict, *args, **kwargs):
    import transformer_engine.pytorch as te

    with te.fp8_autocast(enabled=True, fp8_recipe=options["recipe"]):
        return forward(*args, **kwargs)
