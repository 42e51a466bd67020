"""Bytes per logit that the cross-entropy loss holds at its peak, eager and under ``torch.compile``.

The planner counts the loss's logits at ``LOGIT_BYTES`` (10: the bf16 logits, their fp32 copy and its
fp32 gradient), which an H200 measured for eager PyTorch (docs/plan.md). torchtitan compiles its loss
function whenever it compiles the model (``torchtitan/components/loss.py`` @ e7c0cae / 820504e:
``loss_fn = torch.compile(loss_fn)``; not yet @ 9dec370), and Inductor fuses the upcast, the
log-softmax and its backward, so the fp32 copies are never written. Here the loss torchtitan runs,
``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))`` over bf16 logits that require grad,
runs forward and backward eager and compiled, each in a fresh process, and the process's peak resident
memory above what it held before (Linux: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it)
is divided by the logits. The eager figure checks the method against the GPU's 10. No GPU, no
published row: the compiled figure is the planner's ``COMPILED_LOSS_LOGIT_BYTES``
(``benchmarks/plan_vs_published.py``).

    .venv/bin/python benchmarks/compiled_loss.py [--tiny]
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

TOKENS, VOCAB = 4096, 32768  # 134 M logits: 268 MB in bf16, far above the allocator's noise
TINY = (256, 2048)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(compiled: bool, tokens: int, vocab: int) -> float:
    """One variant's peak bytes per logit above the logits' own bf16 bytes' allocation point."""
    import torch
    import torch.nn.functional as F

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    fn = torch.compile(loss_fn) if compiled else loss_fn
    labels = torch.randint(0, vocab, (1, tokens))
    warm = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    fn(warm, labels).backward()  # compile (and first-touch the kernels) outside the measurement
    del warm
    gc.collect()
    pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from the current RSS
    fn(pred, labels).backward()
    peak = _status("VmHWM")
    # the logits themselves were allocated before: count them, so the figure is the loss's peak per logit
    return (peak - before) / pred.numel() + pred.element_size()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small logits, to check the script")
    parser.add_argument("--variant", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens, vocab = TINY if args.tiny else (TOKENS, VOCAB)
    if args.variant:
        print(json.dumps(measure(args.variant == "compiled", tokens, vocab)))
        return
    results = {}
    for variant in ("eager", "compiled"):
        command = [sys.executable, __file__, "--variant", variant] + (["--tiny"] if args.tiny else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    print(f"cross-entropy over {tokens} x {vocab} bf16 logits (forward + backward), peak bytes per logit:")
    for variant, value in results.items():
        print(f"  {variant:<9} {value:6.2f}")
    print(f"  compiled / eager {results['compiled'] / results['eager']:.3f}")


if __name__ == "__main__":
    main()
