"""``nn.MultiheadAttention`` with separate q / k / v projections, so tensor_parallel can split it.

PyTorch's attention keeps q, k and v in one packed ``in_proj_weight`` and computes its head size
from the query's width, so a column split of the packed weight cannot be expressed. ``split_mha``
swaps each such module for ``SeparateProjectionAttention``: the same maths (scaled dot-product
attention over ``num_heads`` heads, the same masks, dropout and ``batch_first``) with ``q_proj``,
``k_proj`` and ``v_proj`` Linears initialised from the packed weight. Its ``state_dict`` keeps the
original keys (``in_proj_weight``, ``in_proj_bias``, ``out_proj.*``), so checkpoints and weights
compare with the user's model unchanged (``PACKED_STATE_ATTR`` tells ``load_pretrained`` which
parameters each packed key fills). Modules using ``bias_k`` / ``bias_v``, ``add_zero_attn``
or different key / value widths are left as they are (and stay whole).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atorch.utils.modules import PACKED_STATE_ATTR

logger = logging.getLogger(__name__)


class SeparateProjectionAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` (see the module docstring)."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.embed_dim, self.num_heads = mha.embed_dim, mha.num_heads
        self.head_dim = mha.embed_dim // mha.num_heads
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        # keep nn.TransformerEncoder(Layer) off its fused inference path, which reads the packed weight
        self._qkv_same_embed_dim = False
        self.in_proj_weight = self.in_proj_bias = None
        bias = mha.in_proj_bias is not None
        device, dtype = mha.in_proj_weight.device, mha.in_proj_weight.dtype
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(self.embed_dim, self.embed_dim, bias=bias, device=device,
                                                           dtype=dtype) for _ in range(3))
        with torch.no_grad():
            for index, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
                proj.weight.copy_(mha.in_proj_weight[index * self.embed_dim:(index + 1) * self.embed_dim])
                if bias:
                    proj.bias.copy_(mha.in_proj_bias[index * self.embed_dim:(index + 1) * self.embed_dim])
        self.out_proj = mha.out_proj
        setattr(self, PACKED_STATE_ATTR, {f"in_proj_{suffix}": tuple(f"{p}_proj.{suffix}" for p in "qkv")
                                          for suffix in (("weight", "bias") if bias else ("weight",))})
        self._register_state_dict_hook(_packed_state)
        self._register_load_state_dict_pre_hook(_unpack_state)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        q, k, v = (self._heads(proj(t)) for proj, t in ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)))
        mask = _combined_mask(attn_mask, key_padding_mask, q.dtype)
        causal = is_causal and mask is None
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = _attention_with_weights(q, k, v, mask, causal, dropout)
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            out, weights = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                          is_causal=causal), None
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)


def _combined_mask(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                   dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One additive mask from MultiheadAttention's two (True or -inf: masked out)."""
    mask = None
    for part in (attn_mask, None if key_padding_mask is None else key_padding_mask[:, None, None, :]):
        if part is None:
            continue
        additive = torch.zeros_like(part, dtype=dtype).masked_fill(part, float("-inf")) if part.dtype == torch.bool \
            else part.to(dtype)
        mask = additive if mask is None else mask + additive
    return mask


def _attention_with_weights(q, k, v, mask, causal: bool, dropout: float):
    scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = F.dropout(scores.softmax(-1), dropout)
    return weights @ v, weights


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _packed_state(module: SeparateProjectionAttention, state: dict, prefix: str, local_metadata) -> dict:
    for suffix in ("weight", "bias"):
        keys = [f"{prefix}{p}_proj.{suffix}" for p in "qkv"]
        if all(k in state for k in keys):
            state[f"{prefix}in_proj_{suffix}"] = torch.cat([_full(state.pop(k)) for k in keys])
    return state


def _unpack_state(state: dict, prefix: str, *args) -> None:
    for suffix in ("weight", "bias"):
        packed = state.pop(f"{prefix}in_proj_{suffix}", None)
        if packed is not None:
            for p, part in zip("qkv", packed.chunk(3)):
                state[f"{prefix}{p}_proj.{suffix}"] = part


def splittable(mha: nn.MultiheadAttention) -> Optional[str]:
    """Why this MultiheadAttention cannot be swapped, or None."""
    if not mha._qkv_same_embed_dim:
        return "its keys / values have their own widths (kdim / vdim)"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "it uses bias_k / bias_v or add_zero_attn"
    return None


def split_mha(model: nn.Module) -> list[str]:
    """Swap every swappable ``nn.MultiheadAttention`` in ``model``; returns their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.MultiheadAttention:
                continue
            full = f"{name}.{child_name}" if name else child_name
            reason = splittable(child)
            if reason:
                logger.info("tensor_parallel: %s stays whole: %s", full, reason)
                continue
            setattr(module, child_name, SeparateProjectionAttention(child))
            swapped.append(full)
    return swapped
