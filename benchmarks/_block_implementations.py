"""Transformer blocks written op for op as published runs' code writes them, for counting their
memory-bound traffic (``atorch.plan.elementwise.elementwise_bytes``).

The matmuls and the attention kernel are priced by FLOPs elsewhere; what differs between codebases is
the rest: how the norm, the rotary embedding, the key / value repeat and the gated activation are
written. Each class below follows its source's forward at the commit named (written here, not copied);
autograd then gives the backward that source's training ran. Sizes are free (``hidden``, ``heads``,
``kv_heads``, ``ffn``): the counter traces small ones and scales per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROTARY_BASE = 10000.0
MAX_POSITIONS = 4096


def _frequencies(head_dim: int) -> torch.Tensor:
    inverse = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    return torch.outer(torch.arange(MAX_POSITIONS).float(), inverse)


class _Block(nn.Module):
    """The block's weights and order (pre-norm attention, then pre-norm gated MLP, residual adds);
    subclasses say how the norm and the rotary embedding run."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.attention_norm = self.make_norm(hidden)
        self.mlp_norm = self.make_norm(hidden)

    def make_norm(self, hidden: int) -> nn.Module:
        raise NotImplementedError

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def repeat(self, t: torch.Tensor) -> torch.Tensor:
        """Key / value heads repeated to the query heads (B, L, H, D layout)."""
        if self.heads == self.kv_heads:
            return t
        b, s, kv, d = t.shape
        return t.unsqueeze(3).expand(b, s, kv, self.heads // kv, d).reshape(b, s, self.heads, d)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = self.rotate(q, k)
        k, v = self.repeat(k), self.repeat(v)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(out.transpose(1, 2).contiguous().view(b, s, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attend(self.attention_norm(x))
        y = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))


class Fp32RMSNorm(nn.Module):
    """RMSNorm in fp32 by eager ops: upcast, square, mean, rsqrt, scale, cast back, weight."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class _FusedNormTraffic(torch.autograd.Function):
    """A fused RMSNorm kernel's traffic: the forward reads x and writes y; the backward reads x and dy
    and writes dx (the per-row statistics and the weight's partial sums are small beside them). The
    values are not RMSNorm's: only the bytes matter here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return torch.addcmul(dy, x, weight), weight


class FusedRMSNorm(Fp32RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedNormTraffic.apply(x, self.weight)


class FmsLlamaBlock(_Block):
    """foundation-model-stack's LLaMABlock as fms-fsdp trained it (foundation-model-stack/foundation-model-stack
    @ 006bd7ed2d984b6eccccec9ed5d38d416d441077: fms/modules/layernorm.py LayerNormParameterized with
    use_high_precision_pow, fms/modules/positions.py RotaryEmbedding.adjusted_qk, fms/modules/attention.py
    MultiHeadAttention, fms/modules/feedforward.py GatedLinearUnit). The rotary embedding runs in fp32 as a
    real 2 x 2 rotation: q and k are upcast, multiplied by the per-position rotation matrices, summed over
    the last axis and cast back; keys and values are expanded to the query heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__(hidden, heads, kv_heads, ffn)
        angles = _frequencies(self.head_dim)
        rotation = torch.stack([torch.cos(angles), -torch.sin(angles), torch.sin(angles), torch.cos(angles)], dim=2)
        self.register_buffer("rotation", rotation.view(*angles.shape, 2, 2), persistent=False)

    def make_norm(self, hidden: int) -> nn.Module:
        return Fp32RMSNorm(hidden)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(q.size(1)).repeat(q.size(0), 1)
        rotation = self.rotation[positions].float()[:, :, None]  # B L 1 D/2 2 2

        def turn(t: torch.Tensor) -> torch.Tensor:
            pairs = t.float().view(*t.shape[:-1], -1, 2).unsqueeze(-2)
            return rotation.mul(pairs).sum(5).flatten(3).type_as(t)

        return turn(q), turn(k)


class TorchtitanLlamaBlock(_Block):
    """torchtitan's Llama TransformerBlock (pytorch/torchtitan torchtitan/models/llama/model.py): the
    rotary embedding as an fp32 complex multiply (view_as_complex, multiply, view_as_real, cast back),
    keys and values repeated by expand + reshape (repeat_kv), SwiGLU eager; the norm as the run's
    norm_type: the eager fp32 RMSNorm ('rmsnorm', torchtitan/models/norms.py RMSNorm)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__(hidden, heads, kv_heads, ffn)
        angles = _frequencies(self.head_dim)
        self.register_buffer("frequencies", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def make_norm(self, hidden: int) -> nn.Module:
        return Fp32RMSNorm(hidden)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frequencies = self.frequencies[: q.size(1)].view(1, q.size(1), 1, -1)

        def turn(t: torch.Tensor) -> torch.Tensor:
            pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * frequencies).flatten(3).type_as(t)

        return turn(q), turn(k)


class TorchtitanFusedNormLlamaBlock(TorchtitanLlamaBlock):
    """The same with norm_type 'fused_rmsnorm' (torchtitan's Triton RMSNorm: one kernel forward, one
    backward), the setting of torchtitan's Llama configs at the A100 table's commit."""

    def make_norm(self, hidden: int) -> nn.Module:
        return FusedRMSNorm(hidden)
