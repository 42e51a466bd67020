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
Attention runs as one fused kernel priced by its FLOPs elsewhere, so ``scaled_dot_product_attention``
is stood in for by a kernel that moves nothing here. ``model_block_traffic`` does the same for a whole
token model built on the meta device, from copies of it cut to 0 and 1 blocks: the planner counts the
block of a module it is given (``model_specs.from_module``).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from atorch.auto.search.pieces import cut_copy, find_block_stack

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


class _FusedAttention(torch.autograd.Function):
    """Stands in for a fused attention kernel, which the cost model prices by its FLOPs: its output and
    gradients are allocated, never written here, so no bytes are counted for it (on the meta device, or
    with a mask on CPU, SDPA would otherwise decompose into materialised scores and softmax)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


class _AttentionAsOneKernel(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
            return _FusedAttention.apply(q, k, v)
        return func(*args, **kwargs)


def _count(run: Callable[[], torch.Tensor]) -> int:
    """Bytes the memory-bound kernels of ``run()`` and of the backward of its output move."""
    counter = _TrafficCounter()
    with _AttentionAsOneKernel(), counter:
        out = run()
        out.backward(torch.ones_like(out))
    return counter.bytes


def _in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    for parameter in module.parameters():  # the weights in the compute dtype; buffers (rotary tables) as built
        parameter.data = parameter.data.to(dtype)
    return module


def block_traffic(block: nn.Module, hidden: int, tokens: int = 512, seq_len: int = 128,
                  dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per token the memory-bound kernels of ``block`` move in one forward and backward, with its
    parameters (cast in place: pass a block built for counting) and input in ``dtype`` (a 16-bit compute
    dtype, as FSDP's mixed precision runs it). On the meta device (only shapes and dtypes count: the same
    bytes, 30 times faster than bf16 on a CPU); on the CPU for a block that needs values (a data-dependent op)."""
    shape = (tokens // seq_len, seq_len, hidden)
    try:
        meta = _in_dtype(copy.deepcopy(block).to("meta"), dtype)
        x = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
        return _count(lambda: meta(x)) / tokens
    except Exception:  # noqa: BLE001 - any op the meta device cannot run: count with values instead
        block = _in_dtype(block, dtype)
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        return _count(lambda: block(x)) / tokens


def model_block_traffic(model: nn.Module, batch: int = 2, seq_len: int = 256,
                        dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Bytes per token one repeated block of a token model moves, forward and backward, from copies of the
    model cut to 0 and 1 of its blocks (1 and 2 where it cannot run without one; ``pieces.cut_copy``),
    run on the meta device: only shapes and dtypes are needed, so a model of any size costs
    milliseconds and no memory. The difference of the two counts is the block's. None when the model
    has no stack of repeated blocks or does not run on token ids there (data-dependent ops, other inputs):
    the caller keeps the fused count."""
    stack = find_block_stack(model)
    if stack is None:
        return None
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    for low in (0, 1):
        if low + 1 > stack.blocks:
            break
        try:
            counts = [_count(lambda piece=_meta_piece(model, stack, kept, dtype): _first_tensor(piece(tokens)))
                      for kept in (low, low + 1)]
        except Exception:  # noqa: BLE001 - any failure of a foreign model's forward on meta: not countable
            continue
        return max(counts[1] - counts[0], 0) / (batch * seq_len)
    return None


def _meta_piece(model: nn.Module, stack: Any, kept: int, dtype: torch.dtype) -> nn.Module:
    piece = cut_copy(model, stack, kept)  # a copy of its own: moving it to meta leaves the model as it was
    if any(not p.is_meta for p in piece.parameters()):
        piece = piece.to("meta")
    return _in_dtype(piece, dtype)


def _first_tensor(output: Any) -> torch.Tensor:
    """The model output's first floating tensor (logits), as a float so its backward seeds every token."""
    if isinstance(output, torch.Tensor):
        return output.float()
    values = output.values() if isinstance(output, dict) else output
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float()
    raise TypeError(f"no floating tensor in the model's output {type(output).__name__}")


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


def optimizer_step_bytes(make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                         numel: int = 1 << 18) -> float:
    """Bytes per parameter one step of ``make_optimizer(params)`` moves, counted as the blocks are: fp32
    parameters with gradients, a first step to create the state, then the second step traced (torch's
    AdamW: 56 bytes with ``foreach=True``, its CUDA default, 84 with the per-tensor loop; a fused kernel
    reads and writes each tensor once). An optimizer's kernels do not depend on the model's shape."""
    parameters = [nn.Parameter(torch.randn(numel)) for _ in range(3)]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = make_optimizer(parameters)
    optimizer.step()
    counter = _TrafficCounter()
    with counter:
        optimizer.step()
    return counter.bytes / (3 * numel)
