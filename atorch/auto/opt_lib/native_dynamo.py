"""native_dynamo: ``torch.compile``, applied after the parallel wrappers.

Config: ``{"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None, "scope": "auto"}``
(any subset).

``scope`` says what is compiled:

- ``"blocks"``: the ``forward`` of each repeated block (the transformer layers: the largest module
  class that occurs several times with parameters, found from the module tree, not from names), as
  torchtitan and PyTorch's regional compilation do. The blocks share one compiled graph, so compile
  time is one block's, and whatever sits around them (the user's embedding, the causal mask an HF
  model builds, the loss) stays eager: compiling the whole of an HF model makes it build an explicit
  mask, which rules out flash attention (a 1B Llama on an H200, bf16: 207.5 ms per step with the
  layers compiled, 226.3 ms with the whole model, benchmarks/README.md). Hooks the parallel wrappers
  put on a block (FSDP2's gather and reshard) and the checkpoint method's recomputation stay outside
  the compiled code (the checkpoint recomputes the compiled forward). Parameter names do not change;
  each compiled forward is a method bound to its block, so ``copy.deepcopy`` of the model binds the
  copy's own blocks.
- ``"model"``: the whole model (``torch.compile(model)``); its state dict keys gain the
  ``_orig_mod.`` prefix of ``torch.compile``. Compiling after DDP / FSDP lets dynamo see the wrapper
  (DDP's graph breaks at bucket boundaries so communication still overlaps).
- ``"auto"`` (the default): ``"blocks"`` where the model has repeated blocks, ``"model"`` otherwise.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import nn

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.tp_check import Probe, probe_from_context
from atorch.errors import MethodConfigError
from atorch.utils.batch import loss_value
from atorch.utils.config import MethodConfig, option
from atorch.utils.forward_patch import replace_innermost_forward
from atorch.utils.kv_cache import train_without_kv_cache
from atorch.utils.modules import repeated_blocks, unwrap_model

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Scope = Literal["auto", "blocks", "model"]
# set on each block whose forward native_dynamo compiled (tests and the report read it)
COMPILED_BLOCK_ATTR = "atorch_compiled_forward"
# why training forwards of compiled blocks run without a KV cache (atorch.utils.kv_cache)
KV_CACHE_RECOMPILES = ("its compiled blocks recompile for each layer's cache entry (at most 8 compiled, later "
                       "layers run eagerly)")


@dataclass(frozen=True)
class NativeDynamoConfig(MethodConfig):
    backend: Union[str, Callable] = option("inductor", doc="torch.compile backend: a registered name or a callable")
    mode: Optional[Mode] = option(None, doc="torch.compile mode")
    fullgraph: bool = option(False, doc="fail on a graph break instead of splitting the graph")
    dynamic: Optional[bool] = option(None, doc="dynamic shapes: None lets dynamo decide")
    scope: Scope = option("auto", doc="what is compiled: each repeated block's forward, the whole model, "
                                      "or blocks where the model has them")

    def compile_options(self) -> dict[str, Any]:
        options = self.to_dict(omit_defaults=False)
        options.pop("scope")
        return options


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules native_dynamo's ``"blocks"`` scope compiles: every instance of the first repeated block
    (the largest module class that repeats with parameters, a stack of layers ranked after its layers:
    ``repeated_blocks``), the innermost of classes of its size, so a checkpoint or FSDP2 wrapper's own
    class is not taken for the block. Empty where nothing repeats."""
    counts, sizes = repeated_blocks(model)
    names = list(counts)  # outermost first among equal sizes: a wrapper comes before the block it wraps
    if not names:
        return []
    largest = sizes[names[0]]
    chosen = [name for name in names if sizes[name] == largest][-1]
    return [m for m in model.modules() if type(m).__name__ == chosen and m is not model]


class NativeDynamoOptimization(Optimization):
    name = "native_dynamo"
    config_class = NativeDynamoConfig
    stages = ("compile",)
    # args: whether tensor_parallel split the model; the rest: the sample row its compiled step is checked on
    reads = ("model", "args", "dataset", "dataloader_args", "user_prepare_input", "input_dtype", "model_input_format",
             "loss_func", "device")
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
            ctx.model = compile_model(ctx.model, config)
            if "tensor_parallel" in ctx.args.extras:  # FSDP2's DTensors compile as they are: no check
                check_compiled_split_model(ctx.model, probe_from_context(ctx))

        ctx.add_wrapper("compile", self.name, wrap)


def check_compiled_split_model(model: nn.Module, probe: Optional[Probe]) -> None:
    """A model split by tensor parallelism (DTensor parameters) and compiled: one forward and backward
    on a sample row, here, so that a compiled graph that cannot run the split model (an operator DTensor
    does not support under AOT autograd: "as_strided not supported with DTensor") is refused with its
    reason when auto_accelerate applies the strategy, not met inside the training loop. The compiled graph is
    kept for training; the sample's gradients and the random numbers it drew are dropped, the buffers
    it moved restored."""
    if probe is None or probe.loss is None:
        return
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            loss_value(probe.loss(probe.batch, probe.run(model))).backward()
    except Exception as error:
        raise MethodConfigError(
            "native_dynamo", f"the compiled model split by tensor_parallel fails one forward and backward on a "
            f"sample batch: {type(error).__name__}: {str(error)[:300]}; leave native_dynamo out, or "
            "tensor_parallel") from error
    finally:
        for param in model.parameters():
            param.grad = None
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def compile_model(model: nn.Module, config: NativeDynamoConfig) -> nn.Module:
    """Compile ``model`` as ``config.scope`` says; returns the model to train (the same object
    under ``"blocks"``)."""
    blocks = compiled_blocks(unwrap_model(model)) if config.scope != "model" else []
    if config.scope == "blocks" and not blocks:
        raise MethodConfigError("native_dynamo", "scope 'blocks': the model has no module class that repeats with "
                                                 "parameters; use scope 'model' or 'auto'")
    if not blocks:
        return torch.compile(model, **config.compile_options())
    compiled: dict[Callable, Callable] = {}  # one compiled function per forward: the blocks share it
    train_without_kv_cache(unwrap_model(model), "native_dynamo", KV_CACHE_RECOMPILES, override_explicit=False)
    for block in blocks:
        replace_innermost_forward(block, functools.partial(_compiled_method, block, compiled, config))
        setattr(block, COMPILED_BLOCK_ATTR, True)
    return model


def _compiled_method(block: nn.Module, compiled: dict, config: NativeDynamoConfig, forward: Callable) -> Callable:
    """``forward`` (the block's own method, under any patches) compiled, bound to the block: a bound method, not
    a closure over it, so ``copy.deepcopy`` binds the copy's block, and dynamo sees the block as an input."""
    function = getattr(forward, "__func__", None)
    if function is None or forward.__self__ is not block:
        raise MethodConfigError("native_dynamo", f"{type(block).__name__}.forward is not a method of the block "
                                                 "(something replaced it); use scope 'model'")
    if function not in compiled:
        compiled[function] = torch.compile(function, **config.compile_options())
    return types.MethodType(compiled[function], block)

