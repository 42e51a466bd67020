"""Per-rank memory of the sharding methods on a GPT-style model, side by side in one launch.

For each method: the measured peak memory of a training step per rank (the dry run's tracker: live
tensor bytes on CPU, the allocator's peak on CUDA), its ratio to DDP, the parameter + gradient +
optimizer-state bytes a rank holds after a step, and the step time. AdamW, fp32.

    .venv/bin/python benchmarks/memory.py [--world 2] [--layers 4] [--width 256]
"""
from __future__ import annotations

import argparse

import torch

from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import build_gpt
from atorch.utils.memory import training_state_bytes
from atorch.auto.accelerate import auto_accelerate

GLOBAL_BATCH = 8
METHODS = {
    "ddp": [],
    "zero1": ["zero1"],
    "zero2 (fsdp2)": ["zero2"],
    "zero2 (not_use_fsdp)": [("zero2", {"not_use_fsdp": True})],
    "fsdp": [("fsdp", {"atorch_wrap_cls": ("GPTBlock",)})],
    "fsdp + checkpoint": [("fsdp", {"atorch_wrap_cls": ("GPTBlock",)}), ("checkpoint", ("GPTBlock",))],
    "zero1 (deepspeed)": [("zero1", {"use_ds_zero": True})],
    "zero2 (deepspeed)": [("zero2", {"use_ds_zero": True})],
}


def measure(config: GPTConfig, methods: dict) -> dict:
    out = {}
    for label, methods_list in methods.items():
        dataset = SyntheticTokenDataset(GLOBAL_BATCH * 4, config.block_size, config.vocab_size)
        status, result, _ = auto_accelerate(
            build_gpt(0, config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-4},
            dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
            load_strategy=["parallel_mode"] + methods_list, ignore_dryrun_on_load_strategy=False, dryrun_steps=2,
        )
        report = result.args.dryrun
        batch = result.prepare_input(next(iter(result.dataloader)))
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss)
        result.optim.step()
        state = training_state_bytes(result) if "deepspeed" not in label else None
        out[label] = {"peak": report.peak_memory_bytes, "step_s": report.step_time_s, "state": state}
        del result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    config = GPTConfig(vocab_size=2048, block_size=128, n_layer=args.layers, n_head=4, n_embd=args.width)
    methods = dict(METHODS)
    if deepspeed_unavailable_reason():
        print(f"skipping DeepSpeed rows: {deepspeed_unavailable_reason()}")
        methods = {k: v for k, v in methods.items() if "deepspeed" not in k}
    rows = run_distributed(measure, args.world, config, methods, timeout_s=900)[0]
    ddp = rows["ddp"]
    params = sum(p.numel() for p in build_gpt(0, config).parameters())
    print(f"GPT {args.layers} layers x {args.width} wide ({params / 1e6:.2f} M parameters), AdamW fp32, "
          f"{args.world} CPU ranks, global batch {GLOBAL_BATCH}; rank 0's figures")
    header = f"{'method':<24}{'peak MiB/rank':>14}{'vs DDP':>8}{'state MiB/rank':>16}{'vs DDP':>8}{'ms/step':>9}"
    print(header)
    print("-" * len(header))
    for label, row in rows.items():
        state = row["state"]["total"] if row["state"] else None
        state_text = f"{state / 2**20:>16.2f}{state / ddp['state']['total']:>8.2f}" if state else f"{'n/a':>16}{'':>8}"
        print(f"{label:<24}{row['peak'] / 2**20:>14.2f}{row['peak'] / ddp['peak']:>8.2f}{state_text}{row['step_s'] * 1000:>9.1f}")
    print("peak: the dry run's measured per-rank peak over a step (CPU: live tensor bytes). state: parameters + "
          "gradients + optimizer state held after a step (DeepSpeed keeps its own flat buffers: n/a).")


if __name__ == "__main__":
    main()
