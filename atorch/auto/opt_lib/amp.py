"""amp_native: torch.amp autocast for the forward and loss, with a grad scaler for fp16.

fp16 always scales the loss and skips steps whose gradients are not finite (GradScaler). bf16 needs
no scaling; with ``skip_if_nonfinite`` it still checks the gradients (agreed over all ranks) and
skips the step when any is inf/nan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState
from torch.distributed.tensor import DTensor

from atorch.auto.opt_lib.base import Optimization
from atorch.auto.optimizer import AtorchOptimizer
from atorch.checkpoint.adapters import register_optimizer_adapter
from atorch.errors import LoopError, MethodConfigError
from atorch.utils.config import LOW_PRECISION_DTYPES, MethodConfig, option
from atorch.utils.forward_patch import patch_forward

_UNSCALED = OptState.UNSCALED  # the grad scaler's per-optimizer stage marker

SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True)
class AmpNativeConfig(MethodConfig):
    dtype: torch.dtype = option(torch.float16, doc="autocast dtype: torch.float16 ('fp16') or torch.bfloat16 ('bf16')",
                                choices=LOW_PRECISION_DTYPES)
    skip_if_nonfinite: bool = option(False, doc="bf16: skip a step whose gradients hold inf/nan on any rank "
                                     "(fp16 always does, through the grad scaler)")
    init_scale: float = option(2.0**16, doc="fp16 only: the grad scaler's first loss scale", minimum=0.0)
    growth_factor: float = option(2.0, doc="fp16 only: scale multiplier after growth_interval finite steps",
                                  minimum=1.0)
    backoff_factor: float = option(0.5, doc="fp16 only: scale multiplier after a non-finite step",
                                   minimum=0.0, maximum=1.0)
    growth_interval: int = option(2000, doc="fp16 only: finite steps before the scale grows", minimum=1)


class AmpNativeOptimization(Optimization):
    name = "amp_native"
    config_class = AmpNativeConfig
    stages = ("amp",)
    reads = ("model", "loss_func", "optim", "device", "local")  # local: a rank alone agrees with no peer
    writes = ("model", "loss_func", "optim", "args")
    record_writes = ("amp_dtype",)  # sharding wrappers pick their mixed-precision policy from it

    def normalize(self, config: Any) -> AmpNativeConfig:
        """Also accepts the dtype alone: ``torch.bfloat16`` or ``"bf16"``."""
        if isinstance(config, (str, torch.dtype)):
            config = {"dtype": config}
        config = super().normalize(config)
        scaler_keys = sorted(set(config.to_dict()) & set(SCALER_KEYS))
        if config.dtype == torch.bfloat16 and scaler_keys:
            raise MethodConfigError(self.name, f"grad-scaler keys {scaler_keys} apply to fp16 only")
        return config

    def precision(self, config: AmpNativeConfig) -> torch.dtype:
        return config.dtype

    def needs_fp32_weights(self, config: AmpNativeConfig) -> Optional[str]:
        if config.dtype != torch.float16:
            return None
        return "its fp16 loss scaler, torch.amp.GradScaler, unscales fp32 gradients only"

    def transform(self, ctx, config: AmpNativeConfig) -> None:
        dtype = config.dtype
        ctx.amp_dtype = dtype  # sharding wrappers read it to pick a mixed-precision policy

        def wrap(ctx) -> None:
            device_type = ctx.device.type
            patch_forward_autocast(ctx.model, device_type, dtype)
            if ctx.loss_func is not None:
                ctx.loss_func = autocast_callable(ctx.loss_func, device_type, dtype)
            if ctx.optim is None:
                return
            scaler = None
            if dtype == torch.float16:
                scaler = torch.amp.GradScaler(device_type, **{k: getattr(config, k) for k in SCALER_KEYS})
            ctx.optim = AmpOptimizer(ctx.optim, scaler, check_nonfinite=config.skip_if_nonfinite,
                                     agree=not ctx.local)
            ctx.args.use_optim_backward = True

        ctx.add_wrapper("amp", self.name, wrap)


def patch_forward_autocast(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model.forward`` under autocast by patching the instance (state_dict keys unchanged)."""
    patch_forward(model, _autocast_call, device_type=device_type, dtype=dtype)


def _autocast_call(forward, options: dict, *args, **kwargs):
    with torch.autocast(device_type=options["device_type"], dtype=options["dtype"]):
        return forward(*args, **kwargs)


def autocast_callable(fn, device_type: str, dtype: torch.dtype):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


@dataclass
class _ParamGroups:
    """An optimizer as GradScaler's unscaling reads it: its parameter groups only."""

    param_groups: list


def _mixes_dtensor_and_plain_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's gradients are partly DTensors (fsdp / zero2 shards) and partly plain
    tensors (the 0-dim parameters fully_shard leaves replicated, such as CLIP's logit_scale)."""
    kinds = {isinstance(p.grad, DTensor) for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None}
    return len(kinds) == 2


def _unscale_dtensor_and_plain_apart(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                                     state: dict) -> None:
    """``scaler.unscale_(optimizer)`` with the DTensor gradients and the plain ones unscaled as two lists:
    GradScaler groups gradients by device and dtype only, and DTensor's handler of the fused
    check-and-unscale reads every gradient of a mixed list as a DTensor (AttributeError 'placements').
    The two lists' non-finite flags are merged per device, as one list would have given them."""
    inv_scale = scaler._scale.double().reciprocal().float()
    found: dict = {}
    for wanted in (True, False):
        groups = [{**group, "params": [p for p in group["params"] if isinstance(p.grad, DTensor) == wanted]}
                  for group in optimizer.param_groups]
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scaler._scale.device)
        for device, flag in scaler._unscale_grads_(_ParamGroups(groups), inv_scale, found_inf, False).items():
            found[device] = torch.maximum(found[device], flag) if device in found else flag
    state["found_inf_per_device"] = found
    state["stage"] = _UNSCALED


class AmpOptimizer(AtorchOptimizer):
    """Mixed precision on top of the strategy's optimizer: ``backward`` scales the loss, ``step``
    unscales, skips non-finite steps (agreed over all ranks, so sharded gradients cannot make ranks
    disagree; ``agree`` False: a process training alone, whose peers are doing other work) and updates the
    scale. ``clip_grad_norm_`` unscales before clipping."""

    def __init__(self, optimizer: AtorchOptimizer, scaler: Optional[torch.amp.GradScaler], check_nonfinite: bool,
                 agree: bool = True):
        super().__init__(optimizer)
        self.scaler = scaler
        self.check_nonfinite = check_nonfinite
        self.agree = agree
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.scaled_backwards = 0  # since the last step: none means the loop called loss.backward() itself

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.scaler is not None:
            self.scaled_backwards += 1
            loss = self.scaler.scale(loss)
        super().backward(loss, **kwargs)

    def step(self, closure=None):
        if self.scaler is not None:
            self.unscale_()
            scale_before = self.scaler.get_scale()
            target = self.torch_optimizer
            result = self.scaler.step(target, closure) if closure else self.scaler.step(target)
            self.scaler.update()
            self.scaled_backwards = 0
            self._record(self.scaler.get_scale() < scale_before)
            return result
        if self.check_nonfinite and not grads_are_finite(self.torch_optimizer, self.agree):
            self._record(True)
            return None
        self._record(False)
        return super().step(closure)

    def _record(self, skipped: bool) -> None:
        self.last_step_skipped = skipped
        self.skipped_steps += int(skipped)

    def unscale_(self) -> None:
        """Unscale gradients in place (once per step; a no-op without a scaler) and make every rank
        agree on whether any gradient is non-finite."""
        if self.scaler is None:
            return
        target = self.torch_optimizer
        state = self.scaler._per_optimizer_states[id(target)]
        if state["stage"] is not _UNSCALED:
            self._refuse_unscaled_loss()
            if _mixes_dtensor_and_plain_grads(target):
                _unscale_dtensor_and_plain_apart(self.scaler, target, state)
            else:
                self.scaler.unscale_(target)
            if self.agree and dist.is_initialized() and dist.get_world_size() > 1:
                for found_inf in state["found_inf_per_device"].values():
                    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

    def _refuse_unscaled_loss(self) -> None:
        """A step whose gradients no ``backward`` here scaled: unscaling them would divide them by the loss
        scale (a silently tiny update once the scale exists, GradScaler's AssertionError before)."""
        if self.scaled_backwards == 0:
            raise LoopError(
                "amp_native fp16: optim.step() (or clip_grad_norm_) came after gradients that optim.backward(loss) "
                "did not compute: the fp16 loss scaler scales the loss there. Call result.optim.backward(loss) "
                "instead of loss.backward() (result.args.use_optim_backward is True), or use bf16 "
                "(amp_native {'dtype': torch.bfloat16}), which needs no scaler")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.unscale_()
        return super().clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


# checkpoints save and restore the grad scaler
register_optimizer_adapter(AmpOptimizer, scaler=lambda optim: optim.scaler)


def grads_are_finite(optimizer: torch.optim.Optimizer, agree: bool = True) -> bool:
    """True when every gradient on every rank is finite (one scalar all-reduce when distributed; with
    ``agree`` False, on this rank)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        bad = torch.maximum(bad, (~torch.isfinite(local)).any().float())
    if agree and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0)
