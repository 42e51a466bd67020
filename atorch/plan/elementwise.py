"""The bytes a transformer block's non-matmul kernels move, counted from the block's own ops.

The analytic model prices norms, rotary embeddings, activations, residual adds and casts as bytes over
HBM bandwidth. How many bytes depends on how the block is written: a fused RMSNorm reads its input and
writes its output once, an eager one (``x.float()``, ``pow``, ``mean``, ``rsqrt``, ``mul``,
``type_as``, ``mul``) writes fp32 intermediates at every step and autograd reads them again in the
backward. ``ELEMENTWISE_HIDDEN_WIDTHS`` in ``analytic.py`` is the fused count; an eager implementation
moves several times more. Rather than guess, ``elementwise_bytes`` runs the block forward and backward
once at a small size under a dispatch mode that sees every aten op, adds up the bytes each kernel that
is not a matmul or attention reads and writes, and splits the total per token into the parts that grow
with the hidden size, the MLP's width and the key / value width (three traces). Views and allocations
move nothing and are not counted; each other op is taken to read its inputs and write its outputs once
from memory (an eager kernel does: its tensors are far larger than the cache at training sizes).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# ops that run on the tensor cores or inside the fused attention kernel: priced by FLOPs, not bytes
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm"})
ATTENTION_PREFIX = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "scaled_dot_product")
# ops that make a view, an alias or an uninitialised tensor: no kernel reads or writes memory
NO_TRAFFIC_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "detach", "alias",
    "slice", "select", "split", "split_with_sizes", "as_strided", "_reshape_alias", "reshape", "flatten", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view_as", "unbind", "lift_fresh",
    "is_same_size", "view_as_complex", "view_as_real", "_conj", "conj", "resolve_conj", "resolve_neg", "unfold",
    "ones_like",  # the backward's seed gradient: an artefact of the trace, not of a training step
})


def _bytes_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes_of(item) for item in value)
    return 0


class _TrafficCounter(TorchDispatchMode):
    """Adds up the bytes every memory-bound kernel reads (its tensor arguments) and writes (its outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS or name in NO_TRAFFIC_OPS or name.startswith(ATTENTION_PREFIX):
            return out
        self.bytes += _bytes_of(list(args)) + _bytes_of(list((kwargs or {}).values())) + _bytes_of(out)
        return out


def block_traffic(block: nn.Module, hidden: int, tokens: int = 512, seq_len: int = 128,
                  dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per token the memory-bound kernels of ``block`` move in one forward and backward, with its
    parameters and input in ``dtype`` (a 16-bit compute dtype, as FSDP's mixed precision runs it)."""
    for parameter in block.parameters():  # the weights in the compute dtype; buffers (rotary tables) as built
        parameter.data = parameter.data.to(dtype)
    x = torch.randn(tokens // seq_len, seq_len, hidden, dtype=dtype, requires_grad=True)
    counter = _TrafficCounter()
    with counter:
        y = block(x)
        y.backward(torch.ones_like(y))
    return counter.bytes / tokens


def elementwise_bytes(make_block: Callable[[int, int, int, int], nn.Module], hidden: int = 256, heads: int = 4,
                      ffn: int = 688) -> tuple[float, float, float]:
    """Bytes per token and block, forward and backward, per element of the hidden size, of the MLP's
    width and of the key / value width: ``make_block(hidden, heads, kv_heads, ffn)`` traced at three
    shapes (twice the MLP; a quarter of the key / value heads) and the three parts solved for."""
    base = block_traffic(make_block(hidden, heads, heads, ffn), hidden)
    wide = block_traffic(make_block(hidden, heads, heads, 2 * ffn), hidden)
    grouped = block_traffic(make_block(hidden, heads, heads // 4, ffn), hidden)
    per_ffn = (wide - base) / ffn
    kv_dim = hidden  # with as many key / value heads as heads; a quarter of them leave a quarter of it
    per_kv = (base - grouped) / (kv_dim * 3 / 4)
    per_hidden = (base - per_ffn * ffn - per_kv * kv_dim) / hidden
    return per_hidden, per_ffn, per_kv
