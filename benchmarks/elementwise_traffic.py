"""Does a block's counted memory-bound traffic predict its time? The planner prices norms, rotary
embeddings and the other non-matmul kernels as the bytes they move over the memory bandwidth, and
counts those bytes from the block's own ops (``atorch.plan.elementwise``). Here, on one GPU, the
published runs' eager blocks (``_block_implementations.py``: fms-fsdp's and torchtitan's Llama) are
timed forward and backward beside a bare block (the same matmuls, attention, SwiGLU and residual adds,
no norm, no rotary) at Llama 2 7B's width, and the extra time is set beside the extra bytes counted,
over the copy bandwidth measured in the same run. Prints measured / predicted per block (1.0: the
count explains the time; above 1: small kernels that do not reach the copy bandwidth).

Then whole training steps: eager transformers Llamas (sdpa attention, bf16 autocast over fp32 weights,
torch's AdamW) at a few shapes, timed (median of 6 steps) beside ``atorch.estimate`` on the device the
planner's table names (``--device``, default H200) from the config (fused count), from the model
built on meta (its block's traffic counted) and from the model with torch's AdamW counted too
(``optimizer_step_bytes``: its foreach step, CUDA's default, where the planner assumes a fused Adam):
no constant is fitted on these.

    .venv/bin/python benchmarks/elementwise_traffic.py [--tiny]

Without CUDA it skips (exit 0); ``--tiny`` runs a narrow block on CPU to check the script.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _block_implementations as blocks  # noqa: E402

import atorch  # noqa: E402
from atorch.plan.elementwise import block_traffic, optimizer_step_bytes  # noqa: E402

SHAPE = dict(hidden=4096, heads=32, kv_heads=32, ffn=11008, batch=2, seq=4096)  # Llama 2 7B, 8192 tokens
TINY = dict(hidden=64, heads=2, kv_heads=2, ffn=172, batch=1, seq=64)
COUNT_SHRINK = 8  # bytes are counted on a block this many times narrower (per token they scale with width)


class BareBlock(blocks.FmsLlamaBlock):
    """The same matmuls, attention, SwiGLU and residual adds; no norm, no rotary."""

    def make_norm(self, hidden: int) -> nn.Module:
        return nn.Identity()

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_seconds(block: nn.Module, shape: dict, device: torch.device, repeats: int) -> float:
    """The median forward + backward time of ``block`` in bf16 at ``shape``."""
    block = block.to(device, torch.bfloat16)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    times = []
    for i in range(repeats + 3):
        _sync(device)
        start = time.perf_counter()
        block(x).backward(torch.ones_like(x))
        _sync(device)
        if i >= 3:  # warm-up first
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes per second a device-to-device copy reads and writes."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    _sync(device)
    start = time.perf_counter()
    for _ in range(20):
        target.copy_(source)
    _sync(device)
    return 2 * size * 20 / (time.perf_counter() - start)


def counted_bytes(cls: type, shape: dict) -> float:
    """Bytes per token of ``cls`` at ``shape``'s width, counted on a narrower copy and scaled."""
    k = COUNT_SHRINK if shape["hidden"] >= 64 * COUNT_SHRINK else 1
    narrow = cls(shape["hidden"] // k, max(shape["heads"] // k, 1), max(shape["kv_heads"] // k, 1), shape["ffn"] // k)
    return block_traffic(narrow, shape["hidden"] // k) * k


# (layers, hidden, heads, kv heads, MLP, batch, sequence)
LLAMA_STEPS = [(16, 2048, 16, 16, 5632, 8, 2048), (16, 2048, 16, 16, 5632, 4, 4096), (24, 3072, 24, 8, 8192, 4, 2048),
               (32, 4096, 32, 32, 11008, 2, 2048)]
TINY_STEPS = [(2, 64, 2, 2, 172, 2, 32)]


def llama_config(shape: tuple) -> dict:
    layers, hidden, heads, kv, mlp, _, seq = shape
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=mlp, vocab_size=32000, max_position_embeddings=seq)


def llama_step_ms(transformers, shape: tuple, device: torch.device, steps: int) -> float:
    """The median step of an eager transformers Llama trained as benchmarks/gpu.py's eager bf16 row is."""
    batch, seq = shape[5], shape[6]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(shape), attn_implementation="sdpa"))
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32000, (batch, seq), device=device)
    times = []
    for i in range(steps + 2):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def whole_steps(shapes: list, device: torch.device, planner_device: str, steps: int) -> None:
    try:
        import transformers
    except ImportError:
        print("whole steps: transformers is not installed; skipped")
        return
    print(f"\nwhole steps (eager transformers Llama, bf16 autocast, AdamW) against atorch.estimate on "
          f"1x{planner_device}: predicted / measured")
    print(f"{'layers x hidden, kv, MLP':28s} {'batch x seq':>12s} {'measured ms':>12s} {'config ms':>10s} "
          f"{'module ms':>10s} {'+AdamW ms':>10s}")
    adamw = optimizer_step_bytes(lambda parameters: torch.optim.AdamW(parameters, lr=1e-5, foreach=True))
    errors: dict = {"config": [], "module": [], "+AdamW": []}
    for shape in shapes:
        measured = llama_step_ms(transformers, shape, device, steps)
        with torch.device("meta"):
            meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(shape),
                                                                          attn_implementation="sdpa"))
        args = dict(global_batch=shape[5], seq_len=shape[6], sharding="ddp", precision="bf16")
        cluster = f"1x{planner_device}"
        predicted = {
            "config": atorch.estimate({**llama_config(shape), "model_type": "llama"}, cluster, **args).step_time_s,
            "module": atorch.estimate(meta, cluster, **args).step_time_s,
            "+AdamW": atorch.estimate(meta, cluster, optimizer_bytes_per_param=adamw, **args).step_time_s}
        predicted = {key: value * 1e3 for key, value in predicted.items()}
        for key, value in predicted.items():
            errors[key].append(abs(value / measured - 1))
        ratios = ", ".join(f"{value / measured:.2f}" for value in predicted.values())
        print(f"{shape[0]} x {shape[1]}, {shape[3]}, {shape[4]}".ljust(28) + f" {shape[5]:>5} x {shape[6]:<5}"
              f" {measured:12.1f} {predicted['config']:10.1f} {predicted['module']:10.1f} {predicted['+AdamW']:10.1f}"
              f"   ({ratios})")
    print("mean absolute error: " + ", ".join(f"{key} {statistics.mean(v):.1%}" for key, v in errors.items())
          + f" (torch's foreach AdamW counted at {adamw:.0f} bytes per parameter)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a narrow block on CPU: checks the script")
    parser.add_argument("--device", default="H200", help="the planner's device for the whole steps (its table)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if not args.tiny and not torch.cuda.is_available():
        print("elementwise_traffic: no CUDA device; skipped (use --tiny to check the script on CPU)")
        return 0
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else SHAPE
    name = "CPU" if args.tiny else torch.cuda.get_device_name()
    bandwidth = copy_bandwidth(device, 2**24 if args.tiny else 2**30)
    tokens = shape["batch"] * shape["seq"]
    repeats = 2 if args.tiny else 10
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); block hidden {shape['hidden']}, "
          f"ffn {shape['ffn']}, {tokens} tokens, bf16, forward + backward")
    bare_s = step_seconds(BareBlock(shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"]), shape, device,
                          repeats)
    bare_bytes = counted_bytes(BareBlock, shape)
    print(f"{'block':30s} {'ms':>8s} {'+ms over bare':>14s} {'+GB counted':>12s} {'predicted +ms':>14s}  "
          "measured / predicted")
    print(f"{'bare (no norm, no rotary)':30s} {bare_s * 1e3:8.2f}")
    for cls in (blocks.FmsLlamaBlock, blocks.TorchtitanLlamaBlock):
        seconds = step_seconds(cls(shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"]), shape, device,
                               repeats)
        extra = (counted_bytes(cls, shape) - bare_bytes) * tokens
        predicted = extra / bandwidth
        print(f"{cls.__name__:30s} {seconds * 1e3:8.2f} {(seconds - bare_s) * 1e3:14.2f} {extra / 1e9:12.2f} "
              f"{predicted * 1e3:14.2f}  measured / predicted {(seconds - bare_s) / predicted:.2f}")
    whole_steps(TINY_STEPS if args.tiny else LLAMA_STEPS, device, args.device, 1 if args.tiny else 6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
