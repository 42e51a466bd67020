"""Which kernel the user's optimizer steps with: torch's fused one where it is known to be the same update.

PyTorch's Adam, AdamW and SGD step with ``foreach`` by default on a GPU: a dozen multi-tensor kernels a
step, each reading and writing the parameters, gradients or moments again (56 bytes a parameter for
AdamW with fp32 states). Their ``fused=True`` kernel does the same update in one pass (about 30 bytes a
parameter): on the ~1B-parameter Llama of ``benchmarks/gpu.py`` on an H200 it took the fully automatic
mode's step from 205.8 to 196.3 ms, what was left between it and a hand-tuned configuration (195.5).
torchtitan and HF Trainer make the fused kernel their default for the same reason.

atorch passes ``fused=True`` only where nothing about the result can change but rounding:

- the optimizer is one of torch's own classes listed in ``FUSED_OPTIMIZERS`` (not a subclass, a
  ``functools.partial`` or a user function: their step may do more than the class's);
- the user set none of ``fused``, ``foreach`` or ``differentiable`` (an explicit choice is kept);
- every parameter is a floating-point tensor on a device in ``FUSED_DEVICES``: CUDA, where the kernel
  is the faster one. On CPU torch's per-parameter loop stays (the fsdp method makes CPU DTensor
  shards step with foreach, see ``opt_lib/fsdp.py``);
- where parameters are DTensors (fsdp, zero2, tensor parallelism), only for the optimizers whose fused
  op DTensor shards pointwise (``FUSED_OVER_DTENSOR``: Adam and AdamW; DTensor has no sharding rule
  for ``_fused_sgd_``, which raises NotImplementedError at the first step), and only where every
  parameter is one (tensor parallelism leaves norms plain, fully_shard 0-dim scalars: the fused op
  takes the device's tensors as one list and refuses plain and DTensor mixed).

The choice is logged once per process and recorded on the returned optimizer's parameter groups
(``fused: True``) like any optimizer argument, so a saved optimizer state says how it stepped.

fp16 parameters (``half``) are the one case where the kernel changes more than rounding. Adam's and
AdamW's default eps (1e-8) is 0 in float16, and so is the second moment of any gradient below about
8e-3: torch's foreach and per-parameter updates then divide by zero in fp16, and every such parameter
is inf or NaN after the first step. The fused kernel computes the update in fp32 (its opmath type) and
stores fp16, the update mixed-precision training makes. So over fp16 parameters Adam and AdamW take
the fused kernel on CPU too (where the user made no kernel choice); any other optimizer whose eps is 0
in fp16 over them is refused when the optimizer is built (``check_low_precision_update``), naming
the fixes, rather than training on NaN.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from atorch.errors import InputError

logger = logging.getLogger(__name__)

FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
FUSED_OVER_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)
FUSED_DEVICES = frozenset({"cuda"})
USER_KERNEL_CHOICES = ("fused", "foreach", "differentiable")
_logged: set = set()


def optimizer_args(optim_func: Any, optim_args: dict, params: Iterable[Any]) -> dict:
    """``optim_args`` with ``fused=True`` added where the fused kernel applies (see the module's
    docstring), else ``optim_args`` unchanged. ``params`` is what the optimizer is built over:
    tensors or parameter groups (dicts with ``"params"``)."""
    reason = fused_kernel_refusal(optim_func, optim_args, params)
    if reason is not None and fp16_update_needs_fused(optim_func, optim_args, params):
        logger.info("atorch: %s over float16 parameters steps with fused=True: its eps %g is 0 in float16, where "
                    "the foreach update divides by zero; the fused kernel computes the update in float32",
                    optim_func.__name__, _eps(optim_func, optim_args))
        return {**optim_args, "fused": True}
    if reason is not None:
        return optim_args
    name = f"{optim_func.__module__}.{optim_func.__qualname__}"
    if name not in _logged:
        _logged.add(name)
        logger.info("atorch: %s steps with fused=True (one kernel a step, the same update as torch's default "
                    "foreach up to rounding); pass fused=False or foreach=True in optim_args to keep torch's own "
                    "choice", name)
    return {**optim_args, "fused": True}


def fused_kernel_refusal(optim_func: Any, optim_args: dict, params: Iterable[Any]) -> str | None:
    """Why the fused kernel is not used for this optimizer (None when it is)."""
    if not (isinstance(optim_func, type) and optim_func in FUSED_OPTIMIZERS):
        return f"{getattr(optim_func, '__name__', optim_func)!s} is not one of torch's {_names()}"
    chosen = [key for key in USER_KERNEL_CHOICES if key in optim_args]
    if chosen:
        return f"optim_args set {', '.join(chosen)}: the user's choice is kept"
    tensors = param_tensors(params)
    if not tensors:
        return "no parameters"
    devices = {t.device.type for t in tensors}
    if not devices <= FUSED_DEVICES:
        return f"parameters on {sorted(devices)}: the fused kernel is used on {sorted(FUSED_DEVICES)} only"
    if not all(torch.is_floating_point(t) for t in tensors):
        return "a parameter is not floating point"
    shards = sum(isinstance(t, DTensor) for t in tensors)
    if shards and optim_func not in FUSED_OVER_DTENSOR:
        return f"{optim_func.__name__}'s fused op has no DTensor sharding rule (parameters are DTensors)"
    if 0 < shards < len(tensors):
        return (f"{shards} of {len(tensors)} parameters are DTensors: the fused op takes a device's tensors as one "
                "list and refuses plain and DTensor mixed")
    return None


FP16_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)  # fused on CPU and CUDA, over plain or DTensors
FP16_FUSED_DEVICES = frozenset({"cpu", "cuda"})


def fp16_update_needs_fused(optim_func: Any, optim_args: dict, params: Iterable[Any]) -> bool:
    """Whether torch's Adam / AdamW over these parameters must take the fused kernel to update fp16
    parameters without dividing by zero (see the module's docstring)."""
    if not (isinstance(optim_func, type) and optim_func in FP16_FUSED_OPTIMIZERS):
        return False
    if any(key in optim_args for key in USER_KERNEL_CHOICES):
        return False
    tensors = param_tensors(params)
    shards = sum(isinstance(t, DTensor) for t in tensors)
    return (bool(tensors) and any(t.dtype == torch.float16 for t in tensors) and 0 in (shards, len(tensors) - shards)
            and {t.device.type for t in tensors} <= FP16_FUSED_DEVICES
            and _is_zero_in_fp16(_eps(optim_func, optim_args)))


def check_low_precision_update(optimizer: torch.optim.Optimizer) -> None:
    """InputError where the optimizer would update fp16 parameters with an eps that is 0 in float16
    outside a fused kernel: the first step would leave them inf or NaN (see the module's docstring)."""
    for group in optimizer.param_groups:
        eps = group.get("eps")
        halves = any(p.dtype == torch.float16 for p in group["params"])
        if halves and isinstance(eps, (int, float)) and _is_zero_in_fp16(eps) and not group.get("fused"):
            raise InputError(
                f"{type(optimizer).__name__} would update float16 parameters with eps={eps:g}, which is 0 in "
                "float16: its update divides by zero wherever the gradient statistics underflow in float16 (small or "
                "zero gradients), leaving those parameters inf or NaN. Train in bf16 (half 'bf16'), keep fp32 "
                "weights (amp_native alone), or pass an eps float16 holds (optim_args={'eps': 1e-4})"
                + _fused_alternative(optimizer))


def _fused_alternative(optimizer: torch.optim.Optimizer) -> str:
    if type(optimizer) in FP16_FUSED_OPTIMIZERS:
        return ("; torch's fused kernel, which computes the update in float32, cannot step these parameters "
                "(they mix DTensors and plain tensors, or optim_args chose a kernel)")
    return "; or use torch's Adam / AdamW: atorch steps them with the fused kernel, which computes in float32"


def _eps(optim_func: Any, optim_args: dict) -> float:
    if "eps" in optim_args:
        return optim_args["eps"]
    try:
        default = inspect.signature(optim_func).parameters.get("eps")
    except (TypeError, ValueError):
        return 0.0
    return default.default if default is not None and isinstance(default.default, (int, float)) else 0.0


def _is_zero_in_fp16(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0 and float(torch.tensor(value, dtype=torch.float16)) == 0


def param_tensors(params: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of what an optimizer is built over, in every form torch takes: tensors, (name, tensor)
    pairs, or param-group dicts whose "params" is a tensor or a list of either."""
    out: list[torch.Tensor] = []
    for item in without_names(params):
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return out


def without_names(params: Iterable[Any]) -> list[Any]:
    """``params`` as optimizers that take tensors only accept them (``ZeroRedundancyOptimizer``, zero1's
    sharded state over DTensors): (name, tensor) pairs, which torch's own optimizers also take (what
    ``optim_param_func`` may return), become their tensors, in the same groups with the same options."""
    out: list[Any] = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            out.append(dict(item, params=without_names([group] if isinstance(group, torch.Tensor) else group)))
        elif isinstance(item, (tuple, list)):  # (name, tensor)
            out.append(item[1])
        else:
            out.append(item)
    return out


def _names() -> str:
    return ", ".join(cls.__name__ for cls in FUSED_OPTIMIZERS)
