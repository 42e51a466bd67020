"""What torch.compile does to the activations a block keeps for its backward. The planner counts a
block's saved activations from its shapes, with a selective-checkpointing share fitted on one eager
run (torchtitan's Llama 3.1 8B, op-level selective checkpointing); torchtitan's compiled runs of the
same configuration hold less. Here torchtitan's block (``_block_implementations.TorchtitanLlamaBlock``,
bf16, at Llama 3 8B's proportions: ffn 3.5 x hidden, a quarter as many key / value heads as query
heads) runs forward and backward eager and under ``torch.compile``, with no checkpointing, with
torchtitan's op-level selective policy (``parallelize_llama.py`` @ 9dec370: save every second mm's
output, the attention's output, max / abs) and with full checkpointing, and the bytes it keeps are
counted per token and hidden element: eager by the tensors alive after forward, compiled by what its
compiled function saves (both without the weights and the block's input). No GPU: AOTAutograd's
partitioner decides what a compiled block saves, the same on every device.

The selective row's compiled / eager ratio is the planner's ``COMPILED_SELECTIVE_SAVED``
(``benchmarks/plan_vs_published.py``), applied to its compiled rows' selective share; no published
row is used here.

    .venv/bin/python benchmarks/compiled_activations.py [--tiny]

``--tiny`` runs a narrow block, selective only, to check the script.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _block_implementations as blocks  # noqa: E402

SHAPE = dict(hidden=512, heads=8, kv_heads=2, ffn=1792, batch=2, seq=256)  # Llama 3 8B's ratios
TINY = dict(hidden=64, heads=4, kv_heads=1, ffn=224, batch=1, seq=32)
ATEN = torch.ops.aten
# torchtitan's _save_list (parallelize_llama.py @ 9dec370), with CPU's flash attention op beside CUDA's
SAVED_OPS = {ATEN.mm.default, ATEN._scaled_dot_product_efficient_attention.default,
             ATEN._scaled_dot_product_flash_attention.default, ATEN._scaled_dot_product_flash_attention_for_cpu.default,
             ATEN.abs.default, ATEN.max.default}


def torchtitan_policy():
    """torchtitan's op-level selective policy: every op of its save list, but every second mm recomputed."""
    counts: dict[str, int] = {}

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == ATEN.mm.default:
            counts[key] = counts.get(key, 0) + 1
        save = func in SAVED_OPS and not (func == ATEN.mm.default and counts.get(key, 0) % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(torch.nn.Module):
    """The block under one checkpointing mode: none, selective (torchtitan's policy) or full."""

    def __init__(self, block: torch.nn.Module, mode: str) -> None:
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return self.block(x)
        context = {"context_fn": torchtitan_policy} if self.mode == "selective" else {}
        return checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=False, **context)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive (``skip``: storages not counted)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.alive, self.seen = 0, set(skip)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self.seen or not size:
            return
        self.seen.add(key)
        self.alive += size

        def freed(key: int = key, size: int = size) -> None:
            self.alive -= size
            self.seen.discard(key)

        weakref.finalize(storage, freed)


def _owned(block: torch.nn.Module, x: torch.Tensor) -> set[int]:
    tensors = [*block.parameters(), *block.buffers(), x]
    return {t.untyped_storage().data_ptr() for t in tensors}


def eager_kept(model: Checkpointed, x: torch.Tensor) -> int:
    """Bytes alive after the eager forward, besides its output: what autograd and the checkpoint keep."""
    live = _LiveBytes(_owned(model.block, x))
    with live:
        out = model(x)
        kept = live.alive - out.untyped_storage().nbytes()
    out.float().sum().backward()
    return kept


def compiled_kept(model: Checkpointed, x: torch.Tensor) -> int:
    """Bytes the compiled forward saves for its backward (the partitioner's choice)."""
    owned, saved = _owned(model.block, x), {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    compiled = torch.compile(model, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = compiled(x)
    out.float().sum().backward()
    return sum(saved.values())


def build(shape: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block = blocks.TorchtitanLlamaBlock(shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"])
    block = block.to(torch.bfloat16)
    angles = blocks._frequencies(block.head_dim)  # the rotary factors stay complex, as torchtitan keeps them
    block.frequencies = torch.polar(torch.ones_like(angles), angles)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], dtype=torch.bfloat16, requires_grad=True)
    return block, x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a narrow block, selective only")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch._logging.set_logs(all=logging.ERROR)  # dynamo's note that a context_fn is traced
    shape = TINY if args.tiny else SHAPE
    block, x = build(shape)
    per = x.numel()  # bytes per token and hidden element
    input_bytes = x.untyped_storage().nbytes() / per  # both keep the block's input under checkpointing
    print(f"torchtitan's Llama block, hidden {shape['hidden']}, heads {shape['heads']} / {shape['kv_heads']}, "
          f"ffn {shape['ffn']}, {shape['batch']} x {shape['seq']} tokens, bf16; bytes kept per token and hidden "
          "element (the block's input included under checkpointing)")
    print(f"{'checkpointing':<14}{'eager':>8}{'compiled':>10}{'compiled / eager':>18}")
    for mode in ("selective",) if args.tiny else ("none", "selective", "full"):
        extra = 0.0 if mode == "none" else input_bytes
        eager = eager_kept(Checkpointed(block, mode), x) / per + extra
        compiled = compiled_kept(Checkpointed(block, mode), x) / per + extra
        print(f"{mode:<14}{eager:>8.2f}{compiled:>10.2f}{compiled / eager:>18.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
