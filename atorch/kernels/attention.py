"""Attention dispatch: flash-attn when it is installed and supports the call, else PyTorch SDPA.

Every path takes and returns (batch, heads, seq, head_dim) tensors, like
``torch.nn.functional.scaled_dot_product_attention``. ``reference_attention`` is the plain
matmul-softmax-matmul the dispatch is tested against.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from atorch.errors import UnsupportedAttentionError

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# keyword arguments some transformers models pass to their attention function to change the scores:
# a kernel that ignored them would silently compute different attention
SCORE_TERMS = ("position_bias", "softcap", "s_aux", "sinks")


@functools.lru_cache(maxsize=None)
def _flash_attn_func() -> Any:
    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed, or built for another torch / CUDA
        return None
    return flash_attn_func


def flash_attention_supported(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> bool:
    """flash-attn runs when: installed, CUDA sm >= 8.0, fp16/bf16, head_dim <= 256 and a multiple of
    8, and no explicit mask (it knows only causal and full attention)."""
    if attn_mask is not None or not q.is_cuda or q.dtype not in FLASH_DTYPES or _flash_attn_func() is None:
        return False
    head_dim = q.shape[-1]
    if head_dim > 256 or head_dim % 8 or k.shape[-1] != head_dim:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query support (fewer key/value heads than query heads).

    ``attn_mask`` is boolean (True = attend) or additive float, broadcastable to (B, H, Sq, Sk).
    """
    if flash_attention_supported(q, k, attn_mask):
        out = _flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
        return out.transpose(1, 2)
    k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


def repeat_kv_heads(t: torch.Tensor, query_heads: int) -> torch.Tensor:
    heads = t.shape[1]
    if heads == query_heads:
        return t
    if query_heads % heads:
        raise ValueError(f"{query_heads} query heads do not group evenly over {heads} key/value heads")
    return t.repeat_interleave(query_heads // heads, dim=1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, in fp32, spelled out (no dropout)."""
    dtype = q.dtype
    q, k, v = q.float(), repeat_kv_heads(k, q.shape[1]).float(), repeat_kv_heads(v, q.shape[1]).float()
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    return (scores.softmax(dim=-1) @ v).to(dtype)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function with HF transformers' AttentionInterface signature.

    HF builds masks for the model's own implementation: a 4D additive float mask (eager), a 4D
    boolean mask or None (sdpa: causality then comes from ``module.is_causal``). All are honoured.
    Returns (batch, seq, heads, head_dim) as HF expects, and no attention weights.
    """
    _check_hf_call(module, kwargs)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    out = attention(query, key, value, attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _check_hf_call(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse what this function would otherwise drop silently: attention weights, and terms the
    model adds to the scores (T5's position bias, Gemma's soft cap, sink logits)."""
    if kwargs.get("output_attentions"):
        raise UnsupportedAttentionError(
            "module_replace attention does not return attention weights; drop output_attentions")
    terms = [name for name in SCORE_TERMS if kwargs.get(name) is not None]
    if terms:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} passes {terms} to its attention function, which atorch's attention does not "
            "compute; leave this model out of module_replace's hf_attention pair"
        )
