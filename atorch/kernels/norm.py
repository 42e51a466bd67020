"""Fused LayerNorm: flash-attn's Triton kernel when installed on CUDA, else PyTorch's own kernel.

``FusedLayerNorm`` subclasses ``nn.LayerNorm`` so parameters and state-dict keys are unchanged;
``reference_layer_norm`` spells the computation out for the tests.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _triton_layer_norm() -> Any:
    try:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn
    except Exception:
        return None
    return layer_norm_fn


def fused_layer_norm_available(device: Optional[torch.device] = None) -> bool:
    """Whether a faster-than-PyTorch LayerNorm kernel exists for this device."""
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return on_cuda and _triton_layer_norm() is not None


def layer_norm(x: torch.Tensor, normalized_shape: tuple, weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if x.is_cuda and weight is not None and len(normalized_shape) == 1 and _triton_layer_norm() is not None:
        return _triton_layer_norm()(x, weight, bias, eps=eps)
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def reference_layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                         eps: float, dims: int = 1) -> torch.Tensor:
    reduce = tuple(range(-dims, 0))
    xf = x.float()
    mean = xf.mean(dim=reduce, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=reduce, keepdim=True)
    y = (xf - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class FusedLayerNorm(torch.nn.LayerNorm):
    """Drop-in LayerNorm (same parameters and keys) that uses the fused kernel when it can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
