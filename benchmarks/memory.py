"""Per-rank memory of the sharding methods on a GPT-style model, side by side in one launch.

For each method: the measured peak memory of a training step per rank (the dry run's tracker: live
tensor bytes on CPU, the allocator's peak on CUDA), its ratio to DDP, the parameter + gradient +
optimizer-state bytes a rank holds after a step, and the step time. AdamW, fp32.

Step times are measured after every method is built, in alternating rounds (each round starts one
method later), so machine noise hits all alike: the median wall time per step, and the median CPU
time per step of the rank (every thread of the process; robust on a shared machine, where waiting
for a core inflates wall time). Each ZeRO stage is printed over DeepSpeed's same stage (goal <= 1.0).

    .venv/bin/python benchmarks/memory.py [--world 2] [--layers 4] [--width 256] [--rounds 5] [--steps 3] [--tiny]

``--tiny`` runs every method on a one-block model for one round of one step: it checks the script.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import build_gpt
from atorch.utils.memory import training_state_bytes

GLOBAL_BATCH = 8
METHODS = {
    "ddp": [],
    "zero1": ["zero1"],
    "zero2 (fsdp2)": ["zero2"],
    "zero2 (not_use_fsdp)": [("zero2", {"not_use_fsdp": True})],
    "fsdp": [("fsdp", {"atorch_wrap_cls": ("GPTBlock",)})],
    "fsdp + checkpoint": [("fsdp", {"atorch_wrap_cls": ("GPTBlock",)}), ("checkpoint", ("GPTBlock",))],
    # named without units: each layer found from the module tree (the root alone before, as FSDP1 without a
    # wrap policy: the whole model gathered at once); beside it, that root-alone sharding asked for with ()
    "fsdp (no units named)": ["fsdp"],
    "fsdp (root alone)": [("fsdp", {"atorch_wrap_cls": ()})],
    "fsdp + ckpt ratio 0.5": ["fsdp", ("checkpoint", {"ratio": 0.5})],
    "zero1 (deepspeed)": [("zero1", {"use_ds_zero": True})],
    "zero2 (deepspeed)": [("zero2", {"use_ds_zero": True})],
}
# each ZeRO stage against DeepSpeed's same stage
VERSUS_DEEPSPEED = {"zero1": "zero1 (deepspeed)", "zero2 (fsdp2)": "zero2 (deepspeed)",
                    "zero2 (not_use_fsdp)": "zero2 (deepspeed)"}


def measure(config: GPTConfig, methods: dict, rounds: int, steps: int) -> dict:
    """Build every method (peak memory from its dry run, state bytes after one step), then time all."""
    out, step_fns = {}, {}
    for label, methods_list in methods.items():
        dataset = SyntheticTokenDataset(GLOBAL_BATCH * 4, config.block_size, config.vocab_size)
        status, result, _ = auto_accelerate(
            build_gpt(0, config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-4},
            dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
            load_strategy=["parallel_mode"] + methods_list, ignore_dryrun_on_load_strategy=False, dryrun_steps=2,
        )
        report = result.args.dryrun
        step = _step_function(result)
        step(0, zero_grad=False)
        state = training_state_bytes(result) if "deepspeed" not in label else None
        result.optim.zero_grad()
        out[label] = {"peak": report.peak_memory_bytes, "state": state}
        step_fns[label] = step
        del result
    for label, (wall, cpu) in _time_in_rounds(step_fns, rounds, steps).items():
        out[label].update(step_s=statistics.median(wall), cpu_s=statistics.median(cpu))
    return out


def _step_function(result) -> Callable[..., None]:
    """One training step of the user's loop on the result's own batches."""
    batches = [result.prepare_input(b) for b in result.dataloader]

    def step(i: int, zero_grad: bool = True) -> None:
        batch = batches[i % len(batches)]
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        if zero_grad:
            result.optim.zero_grad()

    return step


def _time_in_rounds(step_fns: dict, rounds: int, steps: int) -> dict:
    """Per method, the wall and CPU seconds per step of each round; round r starts with method r, so
    no method is always first (or always right after the same one)."""
    labels = list(step_fns)
    for step in step_fns.values():  # warm up
        step(0)
    times: dict = {label: ([], []) for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(steps):
                step_fns[label](r * steps + i)
            dist.barrier()
            times[label][0].append((time.perf_counter() - wall) / steps)
            times[label][1].append((time.process_time() - cpu) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true",
                        help="a one-block model, one round of one step: checks the script")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=2048, block_size=128, n_layer=args.layers, n_head=4, n_embd=args.width)
    if args.tiny:
        args.layers, args.width, args.rounds, args.steps = 1, 32, 1, 1
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    methods = dict(METHODS)
    if deepspeed_unavailable_reason():
        print(f"skipping DeepSpeed rows: {deepspeed_unavailable_reason()}")
        methods = {k: v for k, v in methods.items() if "deepspeed" not in k}
    rows = run_distributed(measure, args.world, config, methods, args.rounds, args.steps, timeout_s=1800)[0]
    ddp = rows["ddp"]
    params = sum(p.numel() for p in build_gpt(0, config).parameters())
    print(f"GPT {args.layers} layers x {args.width} wide ({params / 1e6:.2f} M parameters), AdamW fp32, "
          f"{args.world} CPU ranks, global batch {GLOBAL_BATCH}; rank 0's figures")
    header = (f"{'method':<24}{'peak MiB/rank':>14}{'vs DDP':>8}{'state MiB/rank':>16}{'vs DDP':>8}{'ms/step':>9}"
              f"{'cpu ms/step':>12}")
    print(header)
    print("-" * len(header))
    for label, row in rows.items():
        state = row["state"]["total"] if row["state"] else None
        state_text = f"{state / 2**20:>16.2f}{state / ddp['state']['total']:>8.2f}" if state else f"{'n/a':>16}{'':>8}"
        print(f"{label:<24}{row['peak'] / 2**20:>14.2f}{row['peak'] / ddp['peak']:>8.2f}{state_text}"
              f"{row['step_s'] * 1000:>9.1f}{row['cpu_s'] * 1000:>12.1f}")
    print("peak: the dry run's measured per-rank peak over a step (CPU: live tensor bytes). state: parameters + "
          "gradients + optimizer state held after a step (DeepSpeed keeps its own flat buffers: n/a). "
          f"ms/step: medians over {args.rounds} alternating rounds of {args.steps} steps (wall; CPU time of the rank)")
    _print_versus_deepspeed(rows)


def _print_versus_deepspeed(rows: dict) -> None:
    """Each ZeRO stage's step time over DeepSpeed's same stage, measured in the same run."""
    for label, deepspeed in VERSUS_DEEPSPEED.items():
        if label in rows and deepspeed in rows:
            mine, theirs = rows[label], rows[deepspeed]
            print(f"{label} / {deepspeed}: step time {mine['step_s'] / theirs['step_s']:.2f}, "
                  f"CPU time {mine['cpu_s'] / theirs['cpu_s']:.2f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
