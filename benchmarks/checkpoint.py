"""Cost of atorch.save_checkpoint / load_checkpoint against a bare torch.distributed.checkpoint (DCP) save /
load of the same state, and the training stall of an asynchronous save against a synchronous one.

On ``--world`` gloo ranks, a GPT trained one step with AdamW under ``--strategy`` is saved and loaded
``--rounds`` times, side by side in alternating order with:

- bare DCP: ``dcp.save`` / ``dcp.load`` of the very tensors atorch saves (``model/<name>``,
  ``optim/<name>/<key>``, as atorch builds them), one file per rank, on the same ranks; no metadata,
  RNG, temporary directory or rename (goal: atorch / bare <= 1.2);
- ``torch.save`` / ``torch.load`` of the full state on one rank (what a hand-written loop does);
- ``save_checkpoint(..., async_save=True)``: the time the training loop is blocked (the tensors are
  copied to host memory, then a thread writes them) against a synchronous save's, and the time until
  the asynchronous save is renamed into place.

Also printed: the bytes each rank wrote as a fraction of the one-file baseline (about 1/world with fsdp).

    .venv/bin/python benchmarks/checkpoint.py [--world 2] [--strategy fsdp] [--rounds 9] [--tiny]

``--tiny`` runs a 2-block, 32-wide GPT for one round: it checks the script, not the speed.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import atorch
from atorch.checkpoint.optimizer_state import OptimizerView, optimizer_state_tensors
from atorch.checkpoint.tensors import model_tensors, param_names
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.utils.modules import full_state_dict

CONFIG = GPTConfig(vocab_size=1024, block_size=64, n_layer=6, n_head=8, n_embd=256)
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STRATEGIES = {"ddp": [], "zero1": ["zero1"], "fsdp": ["fsdp"],
              "tp": [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]}


def _trained(strategy: list, config: GPTConfig):
    torch.manual_seed(0)
    dataset = SyntheticTokenDataset(num_samples=16, seq_len=config.block_size, vocab_size=config.vocab_size)
    status, result, _ = atorch.auto_accelerate(
        GPT(config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3}, model_input_format="unpack_dict",
        dataloader_args={"batch_size": 8}, load_strategy=strategy)
    batch = result.prepare_input(next(iter(result.dataloader)))
    loss = result.loss_func(batch, result.model(**batch))
    result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
    result.optim.step()
    return result


def _atorch_tensors(result) -> dict:
    """The tensors save_checkpoint hands to DCP: this rank's model and optimizer state by canonical name."""
    model = model_tensors(result.model)
    tensors = {f"model/{k}": v for k, v in model.items()}
    tensors.update(optimizer_state_tensors(OptimizerView(result.optim), param_names(model)))
    return tensors


def _full_optimizer_state(result) -> dict:
    """The full optimizer state by name, gathered (what a one-file save must hold)."""
    local = optimizer_state_tensors(OptimizerView(result.optim), param_names(model_tensors(result.model)))
    mine = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in local.items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _no_grad(action) -> None:
    with torch.no_grad():  # the parameters are loaded in place, as atorch does
        action()


def _timed(action) -> tuple[float, float]:
    """Wall seconds (barrier to barrier) and this process's CPU seconds (every thread), which other
    jobs on a shared machine do not inflate."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    action()
    spent = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, spent


def _actions(result, root: str) -> dict:
    """Every timed action by name, each a function of no arguments."""
    path, bare, baseline = (os.path.join(root, name) for name in ("ckpt", "bare", "full.pt"))
    tensors = _atorch_tensors(result)
    full = {"model": full_state_dict(result.model), "optim": _full_optimizer_state(result)}
    main = dist.get_rank() == 0
    pending = {}

    def async_save() -> None:
        pending["save"] = atorch.save_checkpoint(path, result, step=1, async_save=True)

    return {
        "save": lambda: atorch.save_checkpoint(path, result, step=1),
        "load": lambda: atorch.load_checkpoint(path, result),
        "bare_save": lambda: dcp.save(tensors, storage_writer=FileSystemWriter(bare, single_file_per_rank=True,
                                                                                 overwrite=True)),
        "bare_load": lambda: _no_grad(lambda: dcp.load(tensors, storage_reader=FileSystemReader(bare))),
        "base_save": lambda: torch.save(full, baseline) if main else None,
        "base_load": lambda: torch.load(baseline, weights_only=True) if main else None,
        "async_stall": async_save,
        "async_rest": lambda: pending.pop("save").wait(),
    }


GROUPS = [("save", "bare_save"), ("load", "bare_load"), ("base_save", "base_load"), ("async_stall", "async_rest")]
REVERSIBLE = 2  # the first groups compare their two actions: each round runs them in the other order
RATIOS = {"save": ("save", "bare_save"), "load": ("load", "bare_load"), "stall": ("async_stall", "save")}


def bench(strategy_name: str, rounds: int, root: str, tiny: bool) -> dict:
    """Medians of every action's wall time, and of the per-round ratios of wall and CPU times (each
    round's pair measured side by side, so a busy moment hits both)."""
    result = _trained(STRATEGIES[strategy_name], TINY if tiny else CONFIG)
    actions = _actions(result, root)
    for name in actions:  # warm-up: the first DCP call of a process plans and imports; every file exists
        actions[name]()
    times: dict = {name: [] for name in actions}
    for r in range(rounds):
        groups = GROUPS if r % 2 == 0 else GROUPS[::-1]
        for group in groups:
            flip = r % 2 == 1 and GROUPS.index(group) < REVERSIBLE
            for name in (group[::-1] if flip else group):
                times[name].append(_timed(actions[name]))
    rank = dist.get_rank()
    path, baseline = os.path.join(root, "ckpt"), os.path.join(root, "full.pt")
    mine = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{rank}_*.distcp")))
    out = {name: statistics.median(wall for wall, _ in values) for name, values in times.items()}
    for key, (top, bottom) in RATIOS.items():
        out[f"ratio_{key}"] = statistics.median(a[0] / b[0] for a, b in zip(times[top], times[bottom]))
        out[f"cpu_ratio_{key}"] = statistics.median(a[1] / b[1] for a, b in zip(times[top], times[bottom]))
    out.update(rank_bytes=mine, base_bytes=os.path.getsize(baseline))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="fsdp")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tiny", action="store_true", help="a 2-block, 32-wide GPT, one round: checks the script")
    args = parser.parse_args()
    if args.tiny:
        args.rounds = 1
    root = tempfile.mkdtemp(prefix="atorch-bench-ckpt-")
    try:
        per_rank = run_distributed(bench, args.world, args.strategy, args.rounds, root, args.tiny, timeout_s=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r = per_rank[0]
    params = sum(p.numel() for p in GPT(TINY if args.tiny else CONFIG).parameters())
    print(f"{args.strategy} on {args.world} rank(s), GPT {params / 1e6:.1f}M parameters, AdamW; medians of "
          f"{args.rounds} alternating rounds; full state {r['base_bytes'] / 2**20:.1f} MiB")
    print(f"{'':<6}{'atorch s':>10}{'bare DCP s':>12}{'atorch / DCP':>14}{'(CPU time)':>12}{'torch.save/load s':>19}"
          f"{'atorch / torch':>16}")
    for op in ("save", "load"):
        print(f"{op:<6}{r[op]:>10.3f}{r['bare_' + op]:>12.3f}{r['ratio_' + op]:>14.2f}{r['cpu_ratio_' + op]:>12.2f}"
              f"{r['base_' + op]:>19.3f}{r[op] / r['base_' + op]:>16.2f}")
    print("atorch / DCP: median of the per-round ratios of wall time, and of rank 0's CPU time (goal <= 1.2); "
          "times: medians")
    print(f"asynchronous save: training blocked {r['async_stall']:.3f} s vs {r['save']:.3f} s for a synchronous save "
          f"(stall ratio {r['ratio_stall']:.2f}); written and renamed into place {r['async_rest']:.3f} s later")
    for rank, row in enumerate(per_rank):
        print(f"rank {rank} wrote {row['rank_bytes'] / 2**20:.2f} MiB  "
              f"ratio {row['rank_bytes'] / row['base_bytes']:.2f}")


if __name__ == "__main__":
    main()
