"""Cost of atorch.save_checkpoint / load_checkpoint against a plain torch.save of the full state.

On ``--world`` gloo ranks, a GPT trained one step with AdamW under ``--strategy`` is saved and
loaded ``--rounds`` times (median). The baseline is what a hand-written loop does on one process:
``torch.save({"model": full weights, "optim": full optimizer state}, file)`` and ``torch.load``.
Printed: save and load seconds and the ratios to the baseline, and the bytes each rank wrote
(its shard file) as a fraction of the baseline file: with fsdp every rank writes about 1/world.

    .venv/bin/python benchmarks/checkpoint.py [--world 2] [--strategy fsdp] [--rounds 3]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import atorch
from atorch.auto.checkpointing import OptimizerView, _param_names, model_tensors, optimizer_state_tensors
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.utils.modules import full_state_dict

CONFIG = GPTConfig(vocab_size=1024, block_size=64, n_layer=6, n_head=8, n_embd=256)
STRATEGIES = {"ddp": [], "zero1": ["zero1"], "fsdp": ["fsdp"],
              "tp": [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]}


def _trained(strategy: list):
    torch.manual_seed(0)
    dataset = SyntheticTokenDataset(num_samples=16, seq_len=CONFIG.block_size, vocab_size=CONFIG.vocab_size)
    status, result, _ = atorch.auto_accelerate(
        GPT(CONFIG), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3}, model_input_format="unpack_dict",
        dataloader_args={"batch_size": 8}, load_strategy=strategy)
    batch = result.prepare_input(next(iter(result.dataloader)))
    loss = result.loss_func(batch, result.model(**batch))
    result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
    result.optim.step()
    return result


def _full_optimizer_state(result) -> dict:
    """The full optimizer state by name, gathered (what a one-file save must hold)."""
    local = optimizer_state_tensors(OptimizerView(result.optim), _param_names(model_tensors(result.model)))
    mine = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in local.items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _timed(action) -> float:
    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def bench(strategy_name: str, rounds: int, root: str) -> dict:
    result = _trained(STRATEGIES[strategy_name])
    rank = dist.get_rank()
    path, baseline = os.path.join(root, "ckpt"), os.path.join(root, "full.pt")
    full = {"model": full_state_dict(result.model), "optim": _full_optimizer_state(result)}
    saves, loads, base_saves, base_loads = [], [], [], []
    for _ in range(rounds):
        saves.append(_timed(lambda: atorch.save_checkpoint(path, result, step=1)))
        loads.append(_timed(lambda: atorch.load_checkpoint(path, result)))
        base_saves.append(_timed(lambda: torch.save(full, baseline) if rank == 0 else None))
        base_loads.append(_timed(lambda: torch.load(baseline, weights_only=True) if rank == 0 else None))
    mine = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{rank}_*.distcp")))
    return {"save": statistics.median(saves), "load": statistics.median(loads),
            "base_save": statistics.median(base_saves), "base_load": statistics.median(base_loads),
            "rank_bytes": mine, "base_bytes": os.path.getsize(baseline)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="fsdp")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="atorch-bench-ckpt-")
    try:
        per_rank = run_distributed(bench, args.world, args.strategy, args.rounds, root, timeout_s=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = per_rank[0]
    print(f"{args.strategy} on {args.world} rank(s), GPT {sum(p.numel() for p in GPT(CONFIG).parameters()) / 1e6:.1f}M "
          f"parameters, AdamW; baseline: torch.save of the full state on one rank ({first['base_bytes'] / 2**20:.1f} MiB)")
    print(f"save  {first['save']:.3f} s  vs {first['base_save']:.3f} s  ratio {first['save'] / first['base_save']:.2f}")
    print(f"load  {first['load']:.3f} s  vs {first['base_load']:.3f} s  ratio {first['load'] / first['base_load']:.2f}")
    for rank, row in enumerate(per_rank):
        print(f"rank {rank} wrote {row['rank_bytes'] / 2**20:.2f} MiB  ratio {row['rank_bytes'] / row['base_bytes']:.2f}")


if __name__ == "__main__":
    main()
