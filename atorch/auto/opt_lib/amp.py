"""amp_native: torch.amp autocast for the forward and loss, with a grad scaler for fp16.

fp16 always scales the loss and skips steps whose gradients are not finite (GradScaler). bf16 needs
no scaling; with ``skip_if_nonfinite`` it still checks the gradients (agreed over all ranks) and
skips the step when any is inf/nan.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from torch.amp.grad_scaler import OptState

from atorch.errors import MethodConfigError
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.optimizer import AtorchOptimizer

_UNSCALED = OptState.UNSCALED  # the grad scaler's per-optimizer stage marker

DTYPE_NAMES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def parse_dtype(method: str, value: Any) -> torch.dtype:
    """'fp16' / 'bf16' / torch.float16 / torch.bfloat16 → a torch dtype (clear error otherwise)."""
    if value in (torch.float16, torch.bfloat16):
        return value
    if isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    raise MethodConfigError(method, f"dtype {value!r} is not valid; choose torch.float16 / 'fp16' or torch.bfloat16 / 'bf16'")


class AmpNativeOptimization(Optimization):
    name = "amp_native"
    is_tunable = True
    default_config = {"dtype": torch.float16}

    def normalize(self, config: Any) -> dict:
        if config is None:
            return dict(self.default_config)
        if isinstance(config, (str, torch.dtype)):
            config = {"dtype": config}
        if not isinstance(config, dict):
            raise MethodConfigError(self.name, f"config must be a dict such as {{'dtype': torch.bfloat16}}, got {config!r}")
        valid = ("dtype", "skip_if_nonfinite") + SCALER_KEYS
        for key in config:
            if key not in valid:
                raise MethodConfigError(self.name, f"unknown key {key!r}; valid keys: {list(valid)}")
        out = dict(config)
        out["dtype"] = parse_dtype(self.name, config.get("dtype", torch.float16))
        if "skip_if_nonfinite" in out and not isinstance(out["skip_if_nonfinite"], bool):
            raise MethodConfigError(self.name, f"skip_if_nonfinite must be a bool, got {out['skip_if_nonfinite']!r}")
        if out["dtype"] == torch.bfloat16 and any(k in out for k in SCALER_KEYS):
            raise MethodConfigError(self.name, f"grad-scaler keys {SCALER_KEYS} apply to fp16 only")
        return out

    def candidates(self, ctx) -> list[Any]:
        return [{"dtype": torch.bfloat16}, {"dtype": torch.float16}]

    def transform(self, ctx, config: dict) -> None:
        dtype = config["dtype"]
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
                kwargs = {k: config[k] for k in SCALER_KEYS if k in config}
                scaler = torch.amp.GradScaler(device_type, **kwargs)
            ctx.optim = AmpOptimizer(ctx.optim, scaler, check_nonfinite=bool(config.get("skip_if_nonfinite")))
            ctx.args.use_optim_backward = True

        ctx.add_wrapper("amp", self.name, wrap)


def patch_forward_autocast(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model.forward`` under autocast by patching the instance (state_dict keys unchanged)."""
    model.forward = autocast_callable(model.forward, device_type, dtype)


def autocast_callable(fn, device_type: str, dtype: torch.dtype):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


class AmpOptimizer(AtorchOptimizer):
    """Mixed precision on top of the strategy's optimizer: ``backward`` scales the loss, ``step``
    unscales, skips non-finite steps (agreed over all ranks, so sharded gradients cannot make ranks
    disagree) and updates the scale. ``clip_grad_norm_`` unscales before clipping."""

    def __init__(self, optimizer: AtorchOptimizer, scaler: Optional[torch.amp.GradScaler], check_nonfinite: bool):
        super().__init__(optimizer)
        self.scaler = scaler
        self.check_nonfinite = check_nonfinite
        self.skipped_steps = 0
        self.last_step_skipped = False

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        super().backward(self.scaler.scale(loss) if self.scaler is not None else loss, **kwargs)

    def step(self, closure=None):
        if self.scaler is not None:
            self.unscale_()
            scale_before = self.scaler.get_scale()
            target = self.torch_optimizer
            result = self.scaler.step(target, closure) if closure else self.scaler.step(target)
            self.scaler.update()
            self._record(self.scaler.get_scale() < scale_before)
            return result
        if self.check_nonfinite and not grads_are_finite(self.torch_optimizer):
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
            self.scaler.unscale_(target)
            if dist.is_initialized() and dist.get_world_size() > 1:
                for found_inf in state["found_inf_per_device"].values():
                    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

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


def grads_are_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every gradient on every rank is finite (one scalar all-reduce when distributed)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        bad = torch.maximum(bad, (~torch.isfinite(local)).any().float())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0)
