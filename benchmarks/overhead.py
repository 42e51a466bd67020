"""Overhead of auto_accelerate's wrappers: DDP + bf16 amp on 2 CPU ranks, the auto_accelerate-wrapped
seed loop vs a hand-written PyTorch loop doing the same work. Both run in the same processes,
alternating in rounds, so machine noise hits both alike. Goal: ratio <= 1.03.

    .venv/bin/python benchmarks/overhead.py [--world 2] [--rounds 6] [--steps 10] [--tiny]

``--tiny`` runs a one-block model for one round of one step: it checks the script, not the speed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from atorch.auto.accelerate import auto_accelerate
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
GLOBAL_BATCH = 16


def _atorch_loop(dataset, config: GPTConfig):
    torch.manual_seed(0)
    status, result, _ = auto_accelerate(
        GPT(config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": GLOBAL_BATCH}, model_input_format="unpack_dict",
        load_strategy=["parallel_mode", ("amp_native", {"dtype": torch.bfloat16})],
    )
    batches = [result.prepare_input(b) for b in result.dataloader]

    def step(i):
        batch = batches[i % len(batches)]
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()

    return step, batches


def _hand_loop(batches, config: GPTConfig):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(config))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        batch = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(batch, model(**batch))
        loss.backward()
        optim.step()
        optim.zero_grad()

    return step


def _timed(step, steps: int, offset: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(offset + i)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def measure(config: GPTConfig, rounds: int, steps: int) -> dict:
    dataset = SyntheticTokenDataset(GLOBAL_BATCH * 8, config.block_size, config.vocab_size)
    atorch_step, batches = _atorch_loop(dataset, config)
    hand_step = _hand_loop(batches, config)
    for step in (atorch_step, hand_step):  # warm up both
        _timed(step, 2, 0)
    atorch_times, hand_times = [], []
    for r in range(rounds):
        order = [(atorch_step, atorch_times), (hand_step, hand_times)]
        for step, sink in (order if r % 2 == 0 else order[::-1]):
            sink.append(_timed(step, steps, r * steps))
    return {"atorch": atorch_times, "hand": hand_times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true",
                        help="a one-block model, one round of one step: checks the script")
    args = parser.parse_args()
    config = TINY if args.tiny else CONFIG
    if args.tiny:
        args.rounds, args.steps = 1, 1
    times = run_distributed(measure, args.world, config, args.rounds, args.steps, timeout_s=900)[0]
    atorch_ms = statistics.median(times["atorch"]) * 1000
    hand_ms = statistics.median(times["hand"]) * 1000
    ratios = [a / h for a, h in zip(times["atorch"], times["hand"])]
    print(f"DDP + bf16 amp, {args.world} CPU ranks, GPT {config.n_layer}x{config.n_embd}, global batch {GLOBAL_BATCH}")
    print(f"{'loop':<18}{'median ms/step':>16}")
    print(f"{'hand-written':<18}{hand_ms:>16.1f}")
    print(f"{'auto_accelerate':<18}{atorch_ms:>16.1f}")
    print(f"step-time ratio auto_accelerate / hand-written: {atorch_ms / hand_ms:.3f} "
          f"(per-round ratios {', '.join(f'{r:.3f}' for r in ratios)}; goal <= 1.03)")


if __name__ == "__main__":
    main()
