"""Transformers written the way non-HF codebases write them, for the conformance zoo.

Users do not only bring ``transformers`` models: they bring PyTorch's own ``nn.TransformerEncoder``,
torchtitan / Meta-reference Llamas, timm ViTs, nanoGPT, lucidrains-style modules, GPT-J / Falcon-like
parallel blocks, Mixture-of-Experts layers and plain MLPs with their own layer names. Each model here
is written from the architecture in that codebase's *style* (module layout, attribute names, the way
the forward reads shapes and calls attention), not copied from it, so that atorch's methods are
checked against the structures those codebases produce: blocks in an ``nn.ModuleDict`` or an
``nn.Sequential``, fused projections split in the forward, widths read from the input, grouped-query
attention, tied embeddings, routers, unusual projection names.

All are tiny (width 32, 4 heads, 4 blocks; token models: vocabulary 64, sequence 16; images 16x16)
with random weights and no downloads. Token models are called as ``model(tokens)`` and return
logits; the data and losses are in ``atorch.testing.hf_models`` (which registers them in ``ZOO``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import safetensors.torch
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB, SEQ, DIM, HEADS, DEPTH = 64, 16, 32, 4, 4


# --- 1. PyTorch's own nn.TransformerEncoder --------------------------------------------------------
class TorchEncoderLM(nn.Module):
    """A causal LM on ``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` (pre-norm, batch
    first): the blocks are PyTorch's fused-attention ``nn.MultiheadAttention`` layers inside
    ``encoder.layers``, called with keyword masks, and the stack's final norm lives inside the
    encoder. In the zoo because it is what "a transformer without transformers" usually is."""

    def __init__(self, vocab_size: int = VOCAB, max_len: int = SEQ, d_model: int = DIM, nhead: int = HEADS,
                 num_layers: int = DEPTH, dim_feedforward: int = 2 * DIM):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_embedding = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=input_ids.device)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        return self.lm_head(self.encoder(x, mask=mask, is_causal=True))



class TorchEncoderMaskArgLM(TorchEncoderLM):
    """The same model called as PyTorch's nn.Transformer language-modeling tutorial calls its own:
    ``model(src, src_mask)``, the causal mask made once by the script and given to every call. That mask
    is a tensor every row of the batch shares (its first dimension is the sequence, not the batch): a
    micro-batch must take it whole (``shared_mask_batches`` makes such batches)."""

    def forward(self, input_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        return self.lm_head(self.encoder(x, mask=src_mask))


def shared_mask_batches(rows: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` batches of ``rows`` token rows for ``TorchEncoderMaskArgLM``, each with the one causal
    mask its rows share (``src_mask``, SEQ x SEQ), put first as a script's collate may put it; rows != SEQ
    keeps the mask's first dimension apart from the batch's."""
    generator = torch.Generator().manual_seed(seed)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    return [{"src_mask": mask, "input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=generator)}
            for _ in range(count)]


class SequenceFirstLM(TorchEncoderLM):
    """The same model laid out as PyTorch's "Language Modeling with nn.Transformer" tutorial lays out its
    own: ``nn.TransformerEncoderLayer``'s default ``batch_first=False``, token batches ``(seq, batch)``
    (``sequence_first_collate``), called as ``model(src, tgt)`` with the targets beside the source."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, activation="gelu", norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, DEPTH, norm=nn.LayerNorm(DIM), enable_nested_tensor=False)

    def forward(self, src: torch.Tensor, tgt: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions = torch.arange(src.shape[0], device=src.device)[:, None]
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[0], device=src.device)
        return self.lm_head(self.encoder(self.embedding(src) + self.pos_embedding(positions), mask=mask))


def sequence_first_collate(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``(source, target)`` token sequences stacked on dimension 1: ``(seq, batch)`` each."""
    return torch.stack([row[0] for row in rows], 1), torch.stack([row[1] for row in rows], 1)


# --- 2. torchtitan / Meta reference Llama ----------------------------------------------------------
@dataclass
class TitanModelArgs:
    dim: int = DIM
    n_layers: int = DEPTH
    n_heads: int = HEADS
    n_kv_heads: int = 2
    vocab_size: int = VOCAB
    ffn_dim: int = 2 * DIM
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = SEQ


def precompute_rope(head_dim: int, end: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, (end, head_dim // 2): the real form of Meta's freqs_cis."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive (even, odd) pairs of x (bs, seq, heads, head_dim) by the position's angles."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs.unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, seq, n_kv_heads, head_dim) -> (bs, seq, n_kv_heads * n_rep, head_dim)."""
    if n_rep == 1:
        return x
    bs, seq, n_kv_heads, head_dim = x.shape
    expanded = x[:, :, :, None, :].expand(bs, seq, n_kv_heads, n_rep, head_dim)
    return expanded.reshape(bs, seq, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args: TitanModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, rope_cos, rope_sin), apply_rope(xk, rope_cos, rope_sin)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """torchtitan's block: its feed-forward a SwiGLU ``feed_forward``, or with ``moe_enabled`` a routed
    ``moe`` (``TitanMoE`` below), as torchtitan's MoE models switch it per block."""

    def __init__(self, layer_id: int, args: TitanModelArgs, moe_enabled: bool = False):
        super().__init__()
        self.layer_id, self.moe_enabled = layer_id, moe_enabled
        self.attention = Attention(args)
        if moe_enabled:
            self.moe = TitanMoE(args.dim, args.ffn_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self) -> None:
        init_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5  # torchtitan's depth-scaled init
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(init_std)
        (self.moe.shared_expert if self.moe_enabled else self.feed_forward).init_weights(init_std)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan / Meta reference Llama: ``tok_embeddings``, ``layers`` an ``nn.ModuleDict`` keyed
    "0".."n" (torchtitan keeps the names stable when pipeline stages delete layers), grouped-query
    attention with ``wq/wk/wv/wo``, RoPE from precomputed tables passed to every block, SwiGLU
    ``w1/w2/w3``, ``nn.RMSNorm``. In the zoo for the ModuleDict of blocks and the extra block inputs."""

    def __init__(self, args: TitanModelArgs = TitanModelArgs(), moe_enabled: bool = False):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, moe_enabled) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = precompute_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """torchtitan's convention: the whole model's initialisation in one call, made for a model
        built on the meta device and given storage with ``to_empty`` (it recomputes the RoPE tables,
        which no checkpoint holds). The zoo's normal build keeps torch's layer defaults instead."""
        buffer_device = buffer_device or self.rope_cos.device
        args = self.args
        with torch.device(buffer_device):
            cos, sin = precompute_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.rope_cos, self.rope_sin = cos, sin
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# --- 3. timm ViT -----------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    def __init__(self, img_size: int = 16, patch_size: int = 8, in_chans: int = 3, embed_dim: int = DIM):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # B, C, H, W -> B, N, C


class VitAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = HEADS, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape  # the width is read from the input, as timm does
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VitAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm-style VisionTransformer: ``patch_embed`` (a Conv2d), a ``cls_token`` and ``pos_embed``
    Parameters on the model itself, ``blocks`` an ``nn.Sequential`` (with ``grad_checkpointing``, iterated
    block by block under activation checkpointing as timm's ``checkpoint_seq`` does, the Sequential itself
    never called), attention with one fused ``qkv`` whose forward reads the width from the input
    (``B, N, C = x.shape``; a tensor-parallel split of ``qkv`` must keep that reading right), final
    ``norm`` and ``head`` on the class token."""

    def __init__(self, img_size: int = 16, patch_size: int = 8, in_chans: int = 3, num_classes: int = 4,
                 embed_dim: int = DIM, depth: int = DEPTH, num_heads: int = HEADS, mlp_ratio: float = 2.0,
                 grad_checkpointing: bool = False):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.blocks = nn.Sequential(*(Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        if self.grad_checkpointing and self.training:  # timm's checkpoint_seq: the Sequential is iterated, not called
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)[:, 0])


# --- 4. nanoGPT ------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = DEPTH
    n_head: int = HEADS
    n_embd: int = DIM
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's own, as nn.LayerNorm had no bias=False)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT: ``transformer`` an ``nn.ModuleDict`` (wte, wpe, drop, h, ln_f), blocks in
    ``transformer.h``, one fused ``c_attn`` split by width in the forward, widths read with
    ``B, T, C = x.size()``, and ``lm_head`` tied to ``wte`` (the tie made on the embedding's side).
    Weight init as nanoGPT's (normal 0.02, residual projections scaled by depth)."""

    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --- 5. lucidrains-style block ---------------------------------------------------------------------
class PerceiverAttention(nn.Module):
    def __init__(self, dim: int, heads: int = HEADS, dim_head: int = DIM // HEADS, dropout: float = 0.0,
                 causal: bool = True):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads, self.scale, self.causal = heads, dim_head ** -0.5, causal
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, context: torch.Tensor = None) -> torch.Tensor:
        h = self.heads
        x = self.norm(x)
        context = x if context is None else context
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        # 'b n (h d) -> b h n d' without einops
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        if self.causal:
            i, j = sim.shape[-2:]
            mask = torch.ones(i, j, dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = attn @ v
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class PerceiverBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, mult: int = 2):
        super().__init__()
        self.attn = PerceiverAttention(dim, heads)
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x) + x
        return self.ff(x) + x


class PerceiverLM(nn.Module):
    """lucidrains-style (perceiver-pytorch, x-transformers): attention with ``to_q`` and one fused
    ``to_kv`` chunked in the forward, ``to_out`` an ``nn.Sequential(Linear, Dropout)``, a manual
    ``softmax(q k^T * scale) v`` with a masked_fill causal mask, the norm inside the attention and the
    feed-forward an anonymous ``nn.Sequential``. In the zoo for layers found only inside Sequentials
    and attention computed by hand."""

    def __init__(self, num_tokens: int = VOCAB, max_seq_len: int = SEQ, dim: int = DIM, depth: int = DEPTH,
                 heads: int = HEADS):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList([PerceiverBlock(dim, heads) for _ in range(depth)])
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        x = self.token_emb(x) + self.pos_emb(torch.arange(n, device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(x)


# --- 6. GPT-J / Falcon parallel block --------------------------------------------------------------
class ParallelAttention(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.query_proj = nn.Linear(dim, dim, bias=False)
        self.key_proj = nn.Linear(dim, dim, bias=False)
        self.value_proj = nn.Linear(dim, dim, bias=False)
        self.dense_out = nn.Linear(dim, dim, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        head_dim = width // self.heads
        q, k, v = (proj(hidden).view(batch, length, self.heads, head_dim).permute(0, 2, 1, 3)
                   for proj in (self.query_proj, self.key_proj, self.value_proj))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense_out(context.permute(0, 2, 1, 3).reshape(batch, length, width))


class ParallelMLP(nn.Module):
    def __init__(self, dim: int = DIM, mult: int = 4):
        super().__init__()
        self.expand = nn.Linear(dim, dim * mult)
        self.contract = nn.Linear(dim * mult, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.contract(F.gelu(self.expand(hidden), approximate="tanh"))


class ParallelBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.attention = ParallelAttention(dim, heads)
        self.mlp = ParallelMLP(dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return hidden + self.attention(normed) + self.mlp(normed)


class ParallelLM(nn.Module):
    """GPT-J / Falcon / PaLM parallel block: one LayerNorm feeds attention and MLP side by side,
    ``x + attn(ln(x)) + mlp(ln(x))``, with projection names no recipe lists (``query_proj``,
    ``key_proj``, ``value_proj``, ``dense_out``, ``expand``, ``contract``). In the zoo for a block
    whose two branches share one input and for name-based heuristics that should not be needed."""

    def __init__(self, vocab: int = VOCAB, max_len: int = SEQ, dim: int = DIM, depth: int = DEPTH, heads: int = HEADS):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(ParallelBlock(dim, heads) for _ in range(depth))
        self.final_layernorm = nn.LayerNorm(dim)
        self.unembed = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.word_embeddings(tokens) + self.position_embeddings(positions)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.unembed(self.final_layernorm(hidden))


# --- 7. Mixture of Experts -------------------------------------------------------------------------
class Expert(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM):
        super().__init__()
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.silu(self.w_gate(x)) * self.w_in(x))


class MoEFeedForward(nn.Module):
    """Top-k routing per token (Mixtral-style: softmax over the k chosen router logits); each expert
    runs on the tokens routed to it and the outputs are summed with the routing weights. No auxiliary
    load-balancing loss: every token's output depends on that token only, so any split of the batch
    (data parallel, micro-batches) computes the same thing."""

    def __init__(self, dim: int = DIM, n_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        top_logits, top_experts = logits.topk(self.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(top_experts == index)
            routed = weights[rows, slot, None] * expert(tokens[rows])
            out = out.index_add(0, rows, routed.to(out.dtype))  # under autocast the experts run in low precision
        return out.reshape(shape)


class MoEAttention(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MoEBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, n_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = MoEAttention(dim, heads)
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = MoEFeedForward(dim, n_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoELM(nn.Module):
    """A small decoder whose feed-forward is a Mixture of Experts (router ``nn.Linear`` to 4 experts,
    top-2, experts an ``nn.ModuleList`` of SwiGLU MLPs). In the zoo for data-dependent control flow
    (which tokens each expert sees) and parameters a batch may leave unused."""

    def __init__(self, vocab: int = VOCAB, max_len: int = SEQ, dim: int = DIM, depth: int = DEPTH, heads: int = HEADS,
                 n_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, heads, n_experts, top_k) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --- 7b. torchtitan-style Mixture of Experts ------------------------------------------------------
class GroupedExperts(nn.Module):
    """torchtitan's expert bank: every expert's SwiGLU weights stacked in 3-D parameters (``w1`` / ``w3``
    (experts, hidden, dim), ``w2`` (experts, dim, hidden)), called on the routed tokens already grouped
    by expert with how many each expert gets: ``experts(x, num_tokens_per_expert)``. Rows past the
    counted ones (padding) come back as zeros."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for weight in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.tolist()
        used = sum(counts)
        outputs = []
        for expert, rows in enumerate(torch.split(x[:used], counts, dim=0)):
            hidden = F.silu(rows @ self.w1[expert].transpose(0, 1)) * (rows @ self.w3[expert].transpose(0, 1))
            outputs.append(hidden @ self.w2[expert].transpose(0, 1))
        out = torch.cat(outputs, dim=0)
        return torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[1])], dim=0)


class TokenChoiceRouter(nn.Module):
    """Each token picks its top-k experts from a sigmoid gate (torchtitan's DeepSeek-V3 / Llama 4 style),
    the chosen scores normalised to sum to one; also returns how many tokens each expert got."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        top_scores, chosen = torch.topk(scores, k=self.top_k, dim=1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        counts = torch.bincount(chosen.view(-1), minlength=self.num_experts)
        return top_scores, chosen, counts


class TitanMoE(nn.Module):
    """Route, group the (token, choice) pairs by expert, run the grouped bank on them, weight each
    output by its score and add it back to its token, beside an always-on shared expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router = TokenChoiceRouter(dim, num_experts, top_k)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_expert = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, chosen, counts = self.router(x)
        order = torch.argsort(chosen.view(-1), stable=True)
        token_of = order // self.router.top_k
        routed = self.experts(x[token_of], counts)
        shared = self.shared_expert(x)  # under autocast in low precision, as the experts' outputs
        routed = (routed.float() * top_scores.view(-1)[order].reshape(-1, 1)).to(shared.dtype)
        out = shared.scatter_add(0, token_of.reshape(-1, 1).expand(-1, dim), routed)
        return out.view(bs, slen, dim)


class TitanMoELM(TitanLlama):
    """A torchtitan-style MoE decoder (its DeepSeek-V3 / Llama 4 layout at toy size): the Llama above
    with every block's feed-forward a routed ``GroupedExperts`` bank of 4 SwiGLU experts (top-2,
    tokens grouped by expert and passed with their counts) beside a shared expert. In the zoo for an
    expert bank with torchtitan's interface (not transformers'), sort / scatter routing and
    ``.tolist()`` counts: data-dependent shapes inside every block."""

    def __init__(self, args: TitanModelArgs = TitanModelArgs()):
        super().__init__(args, moe_enabled=True)


# --- 8. a residual MLP with up / down projections --------------------------------------------------
class UpDownBlock(nn.Module):
    def __init__(self, dim: int = 64, mult: int = 2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, mult * dim)
        self.down = nn.Linear(mult * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class UpDownMLP(nn.Module):
    """A plain residual MLP called as ``model(x)`` whose layers are named ``up`` / ``down`` (as in many
    hand-written MLPs and adapters) rather than fc1 / fc2. In the zoo so that nothing depends on the
    names the other MLP uses."""

    def __init__(self, in_dim: int = 32, dim: int = 64, depth: int = DEPTH, out_dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(UpDownBlock(dim) for _ in range(depth))
        self.proj_out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


# --- 9. adapters as PEFT adds them (LoRA) ------------------------------------------------------------
class LoraLinear(nn.Module):
    """PEFT's ``lora.Linear`` layout: the frozen layer as ``base_layer``, beside it the trainable rank-r
    ``lora_A`` / ``lora_B`` pair whose product is added, scaled by alpha / r."""

    def __init__(self, base_layer: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base_layer.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.02)  # PEFT starts B at zero; nonzero: A trains at once
        self.scaling = {"default": alpha / rank}

    @property
    def weight(self) -> torch.Tensor:  # PEFT's BaseTunerLayer answers for the layer it wraps
        return self.base_layer.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        lora_A = self.lora_A["default"]
        x = x.to(lora_A.weight.dtype)  # PEFT casts the input to the adapter's dtype, read outside its call
        return result + self.lora_B["default"](lora_A(x)) * self.scaling["default"]


class LoraWrapped(nn.Module):
    """PEFT's ``LoraModel``: the model as ``model``, its named linears replaced by ``LoraLinear`` and every
    other weight frozen; the forward only passes ``*args, **kwargs`` on."""

    def __init__(self, model: nn.Module, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")):
        super().__init__()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoraLinear(child))
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class PeftStyleModel(nn.Module):
    """PEFT's ``PeftModel`` (``get_peft_model`` without a task type): ``base_model`` holds the
    ``LoraWrapped`` model and the forward, again ``*args, **kwargs``, calls it: nothing in either
    signature says which arguments the model inside takes."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.base_model = LoraWrapped(model)

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def save_pretrained(self, save_directory: str, state_dict: Optional[dict] = None, is_main_process: bool = True,
                        **kwargs) -> None:
        """PEFT's way: the adapters only (``adapter_model.safetensors`` beside ``adapter_config.json``), taken
        from ``state_dict`` when given, their names picked by walking the model's LoRA layers, so every
        layer must be there."""
        if not is_main_process:
            return
        state = self.state_dict() if state_dict is None else state_dict
        layers = [f"{name}.lora_" for name, module in self.named_modules() if isinstance(module, LoraLinear)]
        adapters = {key: value.detach().contiguous() for key, value in state.items()
                    if any(key.startswith(layer) for layer in layers)}
        os.makedirs(save_directory, exist_ok=True)
        safetensors.torch.save_file(adapters, os.path.join(save_directory, "adapter_model.safetensors"))
        with open(os.path.join(save_directory, "adapter_config.json"), "w") as file:
            json.dump({"peft_type": "LORA", "layers": len(layers)}, file)
