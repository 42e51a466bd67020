"""checkpoint (activation checkpointing): recompute the activations of chosen submodules in backward
instead of storing them.

Config: a tuple of module types and/or names (a class name such as "GPTBlock" or with its import path,
"torch.nn.TransformerEncoderLayer", or a qualified submodule name / glob such as "blocks.*.mlp"), or
``{"wrap_class": (...), "no_reentrant": bool}``. ``"auto"`` (also the default: the method named without a
config) is the model's layers, found from its module tree (``atorch.utils.modules.auto_layers``: the
largest class with parameters that repeats, or a run of alike unnamed containers), as EPL's
``gradient_checkpoint.type: "auto"`` finds its checkpoints by analysing the model: a user need not know
what the layers are called.
The forward of each matching module is patched on the instance, so state_dict keys do not change.
"""
from __future__ import annotations

import fnmatch
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.utils.checkpoint import checkpoint

from atorch.auto.opt_lib.base import Optimization
from atorch.errors import MethodConfigError
from atorch.utils.config import MethodConfig, ModuleTargets, option
from atorch.utils.forward_patch import patch_forward
from atorch.utils.kv_cache import train_without_kv_cache
from atorch.utils.modules import AUTO_TARGETS, parts_with_forward, resolve_auto_targets, stacked_layers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointConfig(MethodConfig):
    wrap_class: ModuleTargets = option((AUTO_TARGETS,), doc="modules to recompute: nn.Module classes, class names "
                                       "(bare or by import path, 'torch.nn.TransformerEncoderLayer'), qualified-name "
                                       "globs such as 'blocks.*.mlp' or their ends ('attn': every '*.attn'), or "
                                       "'auto': the model's layers, found from its structure")
    no_reentrant: bool = option(True, doc="use PyTorch's non-reentrant checkpoint (keyword arguments, any outputs)")
    ratio: float = option(1.0, doc="share of the matched modules recomputed, spread evenly over them in model order "
                          "(0.5: every second one; ColossalAI's gradient_checkpointing_ratio); the rest keep their "
                          "activations", minimum=0.0, maximum=1.0)


class CheckpointOptimization(Optimization):
    name = "checkpoint"
    config_class = CheckpointConfig
    stages = ("checkpoint",)
    reads = ("model",)
    writes = ("model",)

    def normalize(self, config: Any) -> CheckpointConfig:
        """Also accepts the modules alone: ``(GPTBlock,)``, ``"GPTBlock"``, ``["blocks.*"]``; none: ``"auto"``."""
        if config is None:
            config = {}
        if not isinstance(config, (Mapping, CheckpointConfig)):
            config = {"wrap_class": config}
        config = super().normalize(config)
        if not config.wrap_class:
            raise MethodConfigError(self.name, "wrap_class is empty: name at least one module type or name, or 'auto'")
        if config.ratio == 0:
            raise MethodConfigError(self.name, "ratio=0 recomputes nothing: give a share above 0 (at most 1), or leave "
                                               "checkpoint out of the strategy")
        return config

    def transform(self, ctx, config: CheckpointConfig) -> None:
        # "auto" is read from the whole model, before a pipeline cuts it into stages (a stage may hold one layer)
        targets = resolve_auto_targets(ctx.model, config.wrap_class, self.name)

        def wrap(ctx) -> None:
            modules = matching_modules(ctx.model, targets)
            if not modules:
                present = sorted({type(m).__name__ for m in ctx.model.modules()})
                raise MethodConfigError(
                    self.name, f"no submodule matches {config.wrap_class!r}; module types in the model: {present}"
                )
            modules = evenly_chosen(called_modules(modules), config.ratio)
            _disable_kv_cache(ctx.model)
            for module in modules:
                enable_checkpoint(module, use_reentrant=not config.no_reentrant)

        ctx.add_wrapper("checkpoint", self.name, wrap)


# why training forwards under checkpoint run without a KV cache (atorch.utils.kv_cache)
KV_CACHE_APPENDS_TWICE = "recomputing a block in backward would append to its key/value cache a second time"


def _disable_kv_cache(model: torch.nn.Module) -> None:
    """HF models append to a key/value cache in forward; recomputation would append twice, so (as HF's
    own gradient checkpointing does) training forwards under checkpoint run with ``use_cache=False``, an
    explicit ``use_cache=True`` included (with a warning). Evaluation and ``generate`` keep the model's
    setting. A model whose modules read ``config.use_cache`` but whose forwards take no ``use_cache``
    cannot be told per call: its config is set to False."""
    if train_without_kv_cache(model, "checkpoint", KV_CACHE_APPENDS_TWICE, override_explicit=True):
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
            logger.info("checkpoint: set %s.config.use_cache=False (a cache is incompatible with recomputation and "
                        "no forward of the model takes use_cache)", type(module).__name__)


def matching_modules(model: torch.nn.Module, targets: tuple) -> list[torch.nn.Module]:
    """Submodules whose type, class name (``"GPT2Block"``, or with its import path as users write it:
    ``"torch.nn.TransformerEncoderLayer"``), qualified name (glob) or the end of it (``"attn"``: every
    ``*.attn``, as nnScaler's ``recompute_modules`` takes a suffix) is in ``targets``; outermost wins."""
    types = tuple(t for t in targets if isinstance(t, type))
    names = [t for t in targets if isinstance(t, str)]
    chosen: list[tuple[str, torch.nn.Module]] = []
    for qualname, module in model.named_modules():
        if module is model:
            continue
        if any(qualname == p or qualname.startswith(p + ".") for p, _ in chosen):
            continue  # already inside a checkpointed module
        if isinstance(module, types) or any(
            names_class(name, type(module)) or fnmatch.fnmatchcase(qualname, name) or qualname.endswith("." + name)
            for name in names
        ):
            chosen.append((qualname, module))
    return [module for _, module in chosen]


def called_modules(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules to patch: each matched one that has a forward of its own, else its parts that do; a
    stack of layers, its layers. A ModuleList of layers (nnScaler's ``recompute_modules='transformer.layer'``,
    a user naming ``"blocks"``) is never called, so patching it recomputed nothing, silently; a Sequential
    of layers is recomputed whole in backward, every layer's activations alive at once (no memory saved),
    or, where the model iterates it (timm's ``checkpoint_seq``), never: its layers are patched."""
    chosen: list[torch.nn.Module] = []
    for module in modules:
        parts = stacked_layers(module) or parts_with_forward(module)
        if parts != [module]:
            logger.info("checkpoint: %s is a list or stack of layers: recomputing its %d part(s) one by one",
                        type(module).__name__, len(parts))
        chosen.extend(parts)
    return chosen


def evenly_chosen(modules: list[torch.nn.Module], ratio: float) -> list[torch.nn.Module]:
    """``ratio`` of ``modules``, rounded up (never none: a share of one layer is that layer), spread evenly
    in their order: the last of each of ``count`` equal runs (0.5 of 4: the second and the fourth). Under a
    pipeline each stage chooses from its own layers, so every stage recomputes at least its share; rounded
    down, a stage of 3 layers at 0.25 recomputed none, and held every activation the share was chosen
    to save."""
    if ratio >= 1 or not modules:
        return modules
    count = math.ceil(ratio * len(modules) - 1e-9)
    chosen = [modules[round((j + 1) * len(modules) / count) - 1] for j in range(count)]
    logger.info("checkpoint: ratio %s recomputes %d of the %d matched modules", ratio, len(chosen), len(modules))
    return chosen


def names_class(name: str, cls: type) -> bool:
    """Whether ``name`` names ``cls``: its class name, or a dotted path to it by its defining module or a
    package above it (``torch.nn.TransformerEncoderLayer`` is defined in ``torch.nn.modules.transformer``).
    Read from the name alone: nothing is imported (strategy files carry such names)."""
    package, _, class_name = name.rpartition(".")
    if class_name != cls.__name__:
        return False
    module = getattr(cls, "__module__", "") or ""
    return not package or module == package or module.startswith(package + ".")


def enable_checkpoint(module: torch.nn.Module, use_reentrant: bool = False) -> None:
    patch_forward(module, _checkpointed_call, use_reentrant=use_reentrant)


def _checkpointed_call(forward, options: dict, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if options["use_reentrant"]:  # the reentrant variant takes positional tensors only
        if kwargs:
            return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True)
        return checkpoint(forward, *args, use_reentrant=True)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
