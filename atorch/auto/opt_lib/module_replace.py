"""module_replace: swap known modules for optimized implementations, keeping weights and keys.

Built-in pairs:

- ``hf_attention``: the attention modules of any HF transformers model whose attention goes through
  transformers' attention interface, found from the model rather than from class names: a module
  holding the config that picks ``_attn_implementation`` whose class looks up
  ``ALL_ATTENTION_FUNCTIONS``, in a modeling file whose PreTrainedModel declares
  ``_supports_attention_backend`` (GPT-2, Llama, Qwen2, Mistral, BERT, ViT, CLIP, ...). The module
  keeps its projections (same parameters and keys) and is given atorch's attention function
  (``atorch.kernels.hf_attention_forward``: flash-attn when installed and supported, else SDPA)
  through transformers' own ``AttentionInterface``. Attention modules that compute attention
  themselves, or whose model does not declare that support (T5: it hands its attention function a
  relative position bias), are left as is and named, with the reason, in the log.
- ``repo_attention``: the repo GPT's ``CausalSelfAttention`` → the same dispatch.
- ``fused_layernorm``: ``nn.LayerNorm`` → ``atorch.kernels.FusedLayerNorm`` where a faster kernel
  exists (flash-attn's Triton LayerNorm on CUDA); elsewhere PyTorch's LayerNorm is already one
  kernel and the pair is skipped with a logged line.

Users add pairs with ``register_replace_pair(name, supported_dtypes, pair_cls)`` as the seed shows;
``pair_cls = (original, optimized)`` where ``original`` is a module class or class name and the
optimized module is made by, in order: ``optimized.from_original(module)`` if defined; a class swap
when ``optimized`` subclasses the original (same parameters, same keys); else ``optimized(module)``.
A pair applies only when the training dtype (fp32, or the amp / half dtype) is in its
``supported_dtypes``; a pair may also say why it leaves a module as is (``declines``), which is logged
with the classes each pair replaced. Config: None (every registered pair), a list of pair names or ``{"pairs": [...]}``.
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from atorch.auto.opt_lib.base import Optimization
from atorch.errors import MethodConfigError
from atorch.kernels.attention import attention, hf_attention_forward
from atorch.kernels.norm import FusedLayerNorm, fused_layer_norm_available
from atorch.models.gpt import CausalSelfAttention
from atorch.utils.config import MethodConfig, option

logger = logging.getLogger(__name__)

ALL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
ATTENTION_REGISTRY = "ALL_ATTENTION_FUNCTIONS"  # what transformers attention modules dispatch through
ATORCH_ATTENTION = "atorch"


@dataclass
class ReplacePair:
    """One replacement: which modules it matches, how it builds the optimized one, which dtypes it
    supports and, optionally, why it cannot run on a device (None when it can) and why it leaves a
    module it could have been meant for as is (``declines``: a reason, or None), so nothing the user
    may expect replaced is skipped silently."""

    name: str
    supported_dtypes: frozenset
    matches: Callable[[nn.Module], bool]
    build: Callable[[nn.Module], nn.Module]
    unavailable: Callable[[torch.device], Optional[str]] = field(default=lambda device: None)
    declines: Callable[[nn.Module], Optional[str]] = field(default=lambda module: None)


_PAIRS: dict[str, ReplacePair] = {}


def register_replace_pair(
    name: str,
    supported_dtypes: Any = ALL_DTYPES,
    pair_cls: Optional[tuple] = None,
    *,
    matches: Optional[Callable[[nn.Module], bool]] = None,
    build: Optional[Callable[[nn.Module], nn.Module]] = None,
    unavailable: Optional[Callable[[torch.device], Optional[str]]] = None,
    declines: Optional[Callable[[nn.Module], Optional[str]]] = None,
    replace: bool = False,
) -> ReplacePair:
    """Register a replacement (the seed's form: ``pair_cls=(original, optimized)``)."""
    if name in _PAIRS and not replace:
        raise ValueError(f"replace pair {name!r} is already registered (pass replace=True)")
    dtypes = frozenset(supported_dtypes)
    if not dtypes or not dtypes <= ALL_DTYPES:
        raise ValueError(f"supported_dtypes must be a non-empty subset of {sorted(map(str, ALL_DTYPES))}, "
                         f"got {supported_dtypes!r}")
    if pair_cls is not None:
        original, optimized = pair_cls
        matches = matches or _class_matcher(original)
        build = build or functools.partial(_build_from_class, optimized)
    if matches is None or build is None:
        raise ValueError("register_replace_pair needs pair_cls=(original, optimized) or both matches= and build=")
    pair = ReplacePair(name, dtypes, matches, build, unavailable or (lambda device: None),
                       declines or (lambda module: None))
    _PAIRS[name] = pair
    return pair


def registered_pairs() -> list[str]:
    return list(_PAIRS)


def _class_matcher(original: Union[type, str]) -> Callable[[nn.Module], bool]:
    if isinstance(original, str):
        return lambda module: type(module).__name__ == original
    return lambda module: type(module) is original


def _build_from_class(optimized: type, module: nn.Module) -> nn.Module:
    if hasattr(optimized, "from_original"):
        return optimized.from_original(module)
    if issubclass(optimized, type(module)):
        module.__class__ = optimized  # same object, same parameters and state-dict keys
        return module
    return optimized(module)


# --- built-in pairs ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _register_hf_attention_function() -> bool:
    """Register atorch's attention with transformers; returns whether its masks can be registered too
    (SDPA-style: None for plain causal or full attention, so flash kernels can run; boolean otherwise)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATORCH_ATTENTION, hf_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers: models keep building masks for their own setting
        return False
    AttentionMaskInterface.register(ATORCH_ATTENTION, sdpa_mask)
    return True


@functools.lru_cache(maxsize=None)
def _atorch_subclass(cls: type) -> type:
    return type(f"Atorch{cls.__name__}", (cls,), {"__module__": cls.__module__, "atorch_replaced": True})


def _picks_attention_implementation(module: nn.Module) -> bool:
    """Holds the transformers config whose ``_attn_implementation`` chooses the attention function
    (a model itself holds one too but only routes calls, so PreTrainedModels are not counted)."""
    if not hasattr(getattr(module, "config", None), "_attn_implementation"):
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return not isinstance(module, PreTrainedModel)


def _code_names(obj: Any) -> tuple[str, ...]:
    code = getattr(inspect.unwrap(obj), "__code__", None) if callable(obj) else None
    return code.co_names if code is not None else ()


@functools.lru_cache(maxsize=None)
def _dispatches_via_attention_interface(cls: type) -> bool:
    """Whether the class's own methods look up ``ALL_ATTENTION_FUNCTIONS``, the registry transformers'
    attention modules call the configured attention function from. Read from the compiled code (the
    global names it loads), so no source file and no class names are needed, and subclasses of a
    transformers attention class are found too."""
    own_classes = (c for c in cls.__mro__ if not c.__module__.startswith("torch."))
    return any(ATTENTION_REGISTRY in _code_names(f) for c in own_classes for f in vars(c).values())


@functools.lru_cache(maxsize=None)
def _model_classes_beside(cls: type) -> tuple[type, ...]:
    """The PreTrainedModel classes of the modeling file that defines ``cls`` (or its nearest base class
    that has some): their flags say what that file's attention modules pass to the attention function."""
    from transformers import PreTrainedModel

    for base in cls.__mro__:
        namespace = vars(sys.modules[base.__module__]) if base.__module__ in sys.modules else {}
        found = tuple(v for v in namespace.values() if isinstance(v, type) and issubclass(v, PreTrainedModel)
                      and v.__module__ == base.__module__)
        if found:
            return found
    return ()


def _hf_attention_refusal(module: nn.Module) -> Optional[str]:
    """Why an attention module of a transformers model cannot be given atorch's attention (None: it can).

    It can when it dispatches through the attention interface and its model declares
    ``_supports_attention_backend`` (transformers' promise that any registered attention function gets
    the standard arguments: q, k, v, mask, dropout, scale). T5 dispatches too, but hands the function
    its relative position bias, which a generic kernel cannot take, so it does not declare it."""
    name = type(module).__name__
    if not _dispatches_via_attention_interface(type(module)):
        return f"{name} computes attention itself (no call through transformers' attention interface)"
    models = _model_classes_beside(type(module))
    unsupported = [m for m in models if not getattr(m, "_supports_attention_backend", False)]
    if not models or unsupported:
        roots = sorted(m.__name__ for m in unsupported if not any(b in unsupported for b in m.__mro__[1:]))
        owner = f"{', '.join(roots)} does not" if roots else "no PreTrainedModel beside it does"
        return (f"{name} computes attention itself ({owner} declare _supports_attention_backend: its attention "
                "takes terms of its own model, such as T5's relative position bias)")
    return None


def _is_hf_attention_module(module: nn.Module) -> bool:
    """An attention module of a transformers model: it dispatches on the config's attention
    implementation, or (reported when left as is) it is named for attention and holds none that does."""
    if not _picks_attention_implementation(module):
        return False
    if getattr(module, "atorch_replaced", False) or _dispatches_via_attention_interface(type(module)):
        return True
    return "Attention" in type(module).__name__ and not any(
        _dispatches_via_attention_interface(type(m)) for m in module.modules() if m is not module)


def _is_hf_attention(module: nn.Module) -> bool:
    return (_is_hf_attention_module(module) and not getattr(module, "atorch_replaced", False)
            and _hf_attention_refusal(module) is None)


def _hf_attention_left(module: nn.Module) -> Optional[str]:
    if not _is_hf_attention_module(module) or getattr(module, "atorch_replaced", False):
        return None
    return _hf_attention_refusal(module)


def _replace_hf_attention(module: nn.Module) -> nn.Module:
    _register_hf_attention_function()
    config = copy.copy(module.config)  # per-module copy: the model's setting changes only if all are replaced
    config._attn_implementation = ATORCH_ATTENTION
    module.config = config
    module.__class__ = _atorch_subclass(type(module))
    return module


def _use_atorch_masks(model: nn.Module) -> None:
    """Let HF models whose attention modules are all replaced build masks for atorch's attention.

    A model set to "eager" builds a 4D float causal mask even with no padding, and a kernel given an
    explicit mask cannot use flash attention. When every attention module under a HF model is
    replaced, its config switches to atorch's mask builder (SDPA's: no mask for plain causal or full
    attention, a boolean one with padding), so the flash path opens. A model with some attention
    left unreplaced keeps its own setting.
    """
    if not _register_hf_attention_function():
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        if not hasattr(module, "set_attn_implementation") or not hasattr(config, "_attn_implementation"):
            continue
        attention_modules = [m for m in module.modules() if _is_hf_attention_module(m)]
        if attention_modules and all(getattr(m, "atorch_replaced", False) for m in attention_modules):
            config._attn_implementation = ATORCH_ATTENTION


class AtorchCausalSelfAttention(CausalSelfAttention):
    """The repo GPT's attention with atorch's dispatch (flash-attn when supported, else SDPA)."""

    atorch_replaced = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        return attention(q, k, v, dropout_p=dropout, is_causal=True)


def _is_repo_attention(module: nn.Module) -> bool:
    return type(module) is CausalSelfAttention


def _replace_repo_attention(module: nn.Module) -> nn.Module:
    module.__class__ = AtorchCausalSelfAttention
    return module


def _layernorm_unavailable(device: torch.device) -> Optional[str]:
    if fused_layer_norm_available(device):
        return None
    return f"no faster LayerNorm kernel than PyTorch's on {device.type} (needs CUDA and flash-attn's Triton LayerNorm)"


def _register_builtins() -> None:
    register_replace_pair("hf_attention", ALL_DTYPES, matches=_is_hf_attention, build=_replace_hf_attention,
                          declines=_hf_attention_left)
    register_replace_pair("repo_attention", ALL_DTYPES, matches=_is_repo_attention, build=_replace_repo_attention)
    register_replace_pair(
        "fused_layernorm", ALL_DTYPES, (nn.LayerNorm, FusedLayerNorm), unavailable=_layernorm_unavailable
    )


_register_builtins()


# --- the method ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleReplaceConfig(MethodConfig):
    pairs: Optional[tuple[str, ...]] = option(None,
                                              doc="names of registered replace pairs; None: every registered pair")


class ModuleReplaceOptimization(Optimization):
    name = "module_replace"
    config_class = ModuleReplaceConfig
    stages = ("module_replace",)
    reads = ("model", "device", "amp_dtype", "half_dtype")
    writes = ("model", "args")

    def normalize(self, config: Any) -> ModuleReplaceConfig:
        """Also accepts the pair names alone: ``["hf_attention"]`` or ``"fused_layernorm"``."""
        if config is not None and not isinstance(config, (Mapping, ModuleReplaceConfig)):
            config = {"pairs": config}
        config = super().normalize(config)
        unknown = [n for n in config.pairs or () if n not in _PAIRS]
        if unknown:
            raise MethodConfigError(self.name, f"unknown replace pair(s) {unknown}; registered: {registered_pairs()}")
        return config

    def transform(self, ctx, config: ModuleReplaceConfig) -> None:
        def wrap(ctx) -> None:
            replaced: dict = {}
            ctx.model = replace_modules(ctx.model, config.pairs, training_dtype(ctx), ctx.device, replaced)
            # what was replaced, for the user and for the search (a method that changed nothing is not kept)
            ctx.args.extras["module_replace"] = {"replaced": replaced}

        ctx.add_wrapper("module_replace", self.name, wrap)


def training_dtype(ctx) -> torch.dtype:
    return ctx.amp_dtype or getattr(ctx, "half_dtype", None) or torch.float32


def replace_modules(model: nn.Module, names: Optional[tuple], dtype: torch.dtype, device: torch.device,
                    report: Optional[dict] = None) -> nn.Module:
    """Apply the chosen pairs to every matching submodule; returns the (possibly new) root.

    Logs, per pair, the classes replaced (and how many of each) and the classes left as is with why;
    ``report``, when given, receives ``{pair: {class name: count}}`` for the pairs that replaced any."""
    replaced: dict[str, Counter] = {}
    for pair in (_PAIRS[n] for n in (names or registered_pairs())):
        if dtype not in pair.supported_dtypes:
            logger.info("module_replace: %s skipped, %s is not among its dtypes", pair.name, dtype)
            continue
        reason = pair.unavailable(torch.device(device))
        if reason:
            logger.info("module_replace: %s skipped: %s", pair.name, reason)
            continue
        model, replaced[pair.name], declined = _apply_pair(model, pair)
        for reason in declined.values():
            logger.info("module_replace: %s: %s; left as is", pair.name, reason)
    if replaced.get("hf_attention"):
        _use_atorch_masks(model)
    done = {k: dict(v) for k, v in replaced.items() if v}
    logger.info("module_replace: replaced %s", done or "nothing")
    if report is not None:
        report.update(done)
    return model


def _apply_pair(model: nn.Module, pair: ReplacePair) -> tuple[nn.Module, Counter, dict[str, str]]:
    """Returns the root, the count of replaced modules per class and the declined classes' reasons."""
    replaced: Counter = Counter()
    declined: dict[str, str] = {}
    for qualname, module in list(model.named_modules()):
        if not pair.matches(module):
            reason = pair.declines(module)
            if reason:
                declined.setdefault(type(module).__name__, reason)
            continue
        replaced[type(module).__name__] += 1
        new = pair.build(module)
        if new is module:
            continue
        if not qualname:
            model = new
            continue
        parent_name, _, child = qualname.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model, replaced, declined
