"""Step time with / without each compute method, measured side by side in one process.

Each row trains the same model under the baseline strategy and under baseline + the method,
alternating rounds so machine noise hits both alike, and prints the median step-time ratio
(below 1 = the method is faster). On CPU the attention dispatch is SDPA and fp8 is unavailable;
run it on a GPU machine for flash-attn / fp8 figures.

    .venv/bin/python benchmarks/compute.py [--rounds 4] [--steps 5] [--tiny]

``--tiny`` runs a one-block model for one round of one step, without native_dynamo (compiling alone
takes about 20 s on CPU): it checks the script, not the speed.
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
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
BATCH = 8


def _hf_gpt2(eager: bool, shape: GPTConfig):
    import transformers

    config = transformers.GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                     vocab_size=shape.vocab_size, n_positions=shape.block_size,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager" if eager else "sdpa")


def _hf_loss(batch, output):
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())


def _stepper(model_fn, strategy, loss, config: GPTConfig):
    dataset = SyntheticTokenDataset(BATCH * 4, config.block_size, config.vocab_size)
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


def compare(label, model_fn, baseline, method, loss, rounds, steps, config: GPTConfig):
    base, with_method = (_stepper(model_fn, baseline, loss, config),
                         _stepper(model_fn, baseline + [method], loss, config))
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
    parser.add_argument("--tiny", action="store_true", help="a one-block model, one round of one step, no "
                        "native_dynamo: checks the script")
    args = parser.parse_args()
    config = TINY if args.tiny else CONFIG
    if args.tiny:
        args.rounds, args.steps = 1, 1
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; GPT {config.n_layer}x{config.n_embd}, seq {config.block_size}, batch {BATCH}, AdamW")
    print(f"{'method (on top of baseline)':<44}{'base ms':>11}{'method ms':>13}{'ratio':>8}")
    low = torch.bfloat16
    rows = [
        ("module_replace, repo GPT, fp32", lambda: build_gpt(0, config), [], "module_replace", gpt_loss),
        ("module_replace, HF GPT-2 eager, fp32", lambda: _hf_gpt2(True, config), [], "module_replace", _hf_loss),
    ]
    if not args.tiny:
        rows.append(("native_dynamo, repo GPT, fp32", lambda: build_gpt(0, config), [], "native_dynamo", gpt_loss))
    if torch.cuda.is_available():  # bf16 matmuls are emulated (slow) on most CPUs: GPU only
        rows.append(("module_replace, HF GPT-2 eager, bf16 amp", lambda: _hf_gpt2(True, config),
                     [("amp_native", {"dtype": low})], "module_replace", _hf_loss))
    for label, model_fn, baseline, method, loss in rows:
        compare(label, model_fn, baseline, method, loss, args.rounds, args.steps, config)
    reason = fp8_unavailable_reason()
    if reason:
        print(f"{'fp8':<44}{'n/a':>11}  ({reason})")
    else:
        compare("fp8, repo GPT, bf16 amp", lambda: build_gpt(0, config), [("amp_native", {"dtype": low})], "fp8",
                gpt_loss, args.rounds, args.steps, config)


if __name__ == "__main__":
    main()
