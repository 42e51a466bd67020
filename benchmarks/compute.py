"""Step time with / without each compute method, measured side by side in one process.

Each row trains the same model under the baseline strategy and under baseline + the method,
alternating rounds so machine noise hits both alike, and prints the median step-time ratio
(below 1 = the method is faster). On CPU the attention dispatch is SDPA and fp8 is unavailable;
run it on a GPU machine for flash-attn / fp8 figures.

    .venv/bin/python benchmarks/compute.py [--rounds 4] [--steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.opt_lib.fp8 import fp8_unavailable_reason
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing.training import build_gpt

CONFIG = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=256)
BATCH = 8


def _hf_gpt2(eager: bool):
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager" if eager else "sdpa")


def _hf_loss(batch, output):
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())


def _stepper(model_fn, strategy, loss):
    dataset = SyntheticTokenDataset(BATCH * 4, CONFIG.block_size, CONFIG.vocab_size)
    _, result, _ = auto_accelerate(model_fn(), torch.optim.AdamW, dataset, loss, optim_args={"lr": 1e-4},
                                   dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict",
                                   load_strategy=strategy)
    hf = loss is _hf_loss  # HF models would compute their own loss from labels: feed input_ids only
    batches = [result.prepare_input({"input_ids": b["input_ids"]} if hf else b) for b in result.dataloader]

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        out = result.model(**batch)
        result.optim.backward(result.loss_func(batch, out))
        result.optim.step()
        result.optim.zero_grad()

    return step


def _time(step, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    return (time.perf_counter() - start) / steps


def compare(label, model_fn, baseline, method, loss, rounds, steps):
    base, with_method = _stepper(model_fn, baseline, loss), _stepper(model_fn, baseline + [method], loss)
    _time(base, 2), _time(with_method, 3)  # warm-up (and compilation)
    times = {"base": [], "method": []}
    for r in range(rounds):
        order = [("base", base), ("method", with_method)]
        for key, step in order if r % 2 == 0 else order[::-1]:
            times[key].append(_time(step, steps))
    b, m = statistics.median(times["base"]), statistics.median(times["method"])
    print(f"{label:<44}{b * 1000:>11.1f}{m * 1000:>13.1f}{m / b:>8.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; GPT {CONFIG.n_layer}x{CONFIG.n_embd}, seq {CONFIG.block_size}, batch {BATCH}, AdamW")
    print(f"{'method (on top of baseline)':<44}{'base ms':>11}{'method ms':>13}{'ratio':>8}")
    low = torch.bfloat16
    rows = [
        ("module_replace, repo GPT, fp32", lambda: build_gpt(0, CONFIG), [], "module_replace", gpt_loss),
        ("module_replace, HF GPT-2 eager, fp32", lambda: _hf_gpt2(True), [], "module_replace", _hf_loss),
        ("native_dynamo, repo GPT, fp32", lambda: build_gpt(0, CONFIG), [], "native_dynamo", gpt_loss),
    ]
    if torch.cuda.is_available():  # bf16 matmuls are emulated (slow) on most CPUs: GPU only
        rows.append(("module_replace, HF GPT-2 eager, bf16 amp", lambda: _hf_gpt2(True),
                     [("amp_native", {"dtype": low})], "module_replace", _hf_loss))
    for label, model_fn, baseline, method, loss in rows:
        compare(label, model_fn, baseline, method, loss, args.rounds, args.steps)
    reason = fp8_unavailable_reason()
    if reason:
        print(f"{'fp8':<44}{'n/a':>11}  ({reason})")
    else:
        compare("fp8, repo GPT, bf16 amp", lambda: build_gpt(0, CONFIG), [("amp_native", {"dtype": low})], "fp8",
                gpt_loss, args.rounds, args.steps)


if __name__ == "__main__":
    main()
