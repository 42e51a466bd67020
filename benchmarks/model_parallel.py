"""Step time and per-rank peak memory of DP, TP, PP and TP×PP on 4 CPU ranks, as ratios to DP.

Each layout trains the same GPT-style model with the same global batch; figures are the dry run's
(a warm-up and timed steps; peak = tracked live tensor bytes on CPU, the allocator's peak on CUDA),
maxima over ranks. Note that at one global batch a DP rank trains on a quarter of it while every
rank of a tensor group trains on the whole of its group's share, so TP trades parameter memory for
activation memory; PP ranks hold a quarter of the blocks. On CPU, 4 processes share the machine's
cores and collectives are gloo over loopback, so step times are what this machine gives.

    .venv/bin/python benchmarks/model_parallel.py [--layers 8] [--width 256] [--steps 3] [--tiny]

``--tiny`` runs every layout on a 4-block, 32-wide model for one step: it checks the script.
"""
from __future__ import annotations

import argparse

import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import build_gpt

GLOBAL_BATCH = 16
LAYOUTS = {
    "DP (data 4)": [("parallel_mode", ([("data", 4)], None))],
    "TP (tensor 4)": [("parallel_mode", ([("tensor", 4)], None)), "tensor_parallel"],
    "TP+SP (tensor 4)": [("parallel_mode", ([("tensor", 4)], None)), "tensor_parallel", "sequence_parallel"],
    "PP (pipeline 4, 1F1B)": [("parallel_mode", ([("pipeline", 4)], None)),
                              ("pipeline_parallel", {"num_micro_batch": 8})],
    "TP2 x PP2": [("parallel_mode", ([("tensor", 2), ("pipeline", 2)], None)),
                  ("mixed_parallel", {"pipeline": {"num_micro_batch": 8}})],
}


def measure(config: GPTConfig, steps: int) -> dict:
    out = {}
    for label, strategy in LAYOUTS.items():
        dataset = SyntheticTokenDataset(GLOBAL_BATCH * (steps + 2), config.block_size, config.vocab_size)
        _, result, _ = auto_accelerate(
            build_gpt(0, config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-4},
            dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
            load_strategy=strategy, ignore_dryrun_on_load_strategy=False, dryrun_steps=steps,
        )
        report = result.args.dryrun
        out[label] = {"time": report.step_time_s, "peak": report.peak_memory_bytes}
        del result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a 4-block, 32-wide model, one step: checks the script")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=2048, block_size=128, n_layer=args.layers, n_head=4, n_embd=args.width)
    if args.tiny:  # 4 blocks: one per pipeline stage
        args.layers, args.width, args.steps = 4, 32, 1
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
    rows = run_distributed(measure, 4, config, args.steps, timeout_s=1800)[0]
    base = rows["DP (data 4)"]
    params = sum(p.numel() for p in build_gpt(0, config).parameters())
    print(f"GPT {args.layers} layers x {args.width} ({params / 1e6:.2f} M params), AdamW fp32, 4 CPU ranks, "
          f"global batch {GLOBAL_BATCH}, seq {config.block_size}")
    print(f"{'layout':<24}{'ms/step':>10}{'vs DP':>8}{'peak MiB/rank':>15}{'vs DP':>8}")
    for label, row in rows.items():
        print(f"{label:<24}{row['time'] * 1000:>10.1f}{row['time'] / base['time']:>8.2f}"
              f"{row['peak'] / 2**20:>15.1f}{row['peak'] / base['peak']:>8.2f}")


if __name__ == "__main__":
    main()
