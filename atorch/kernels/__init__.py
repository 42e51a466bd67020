"""Kernels used by the compute methods, each with a pure-PyTorch reference it is tested against."""
from atorch.kernels.attention import attention, flash_attention_supported, hf_attention_forward, reference_attention
from atorch.kernels.norm import FusedLayerNorm, fused_layer_norm_available, layer_norm, reference_layer_norm

__all__ = [
    "attention", "flash_attention_supported", "hf_attention_forward", "reference_attention",
    "FusedLayerNorm", "fused_layer_norm_available", "layer_norm", "reference_layer_norm",
]
