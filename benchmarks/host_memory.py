"""Host memory of loading a pretrained Hugging Face Llama under fsdp: each process's peak RSS growth.

The parent saves a Llama once with ``save_pretrained`` (random weights, safetensors shards of
500 MB) and frees it. Then each path runs in a fresh launch of ``--world`` CPU processes (peak RSS
only grows, so each path needs its own processes), trains 2 AdamW steps on one synthetic batch,
and reports per process the growth of its peak RSS over its RSS right after imports and
process-group init:

- ``atorch (meta)``: the model built on the meta device, ``auto_accelerate`` with fsdp (each
  LlamaDecoderLayer wrapped), then ``atorch.load_pretrained``;
- ``full copy``: ``from_pretrained`` on every process, then ``auto_accelerate`` with the same fsdp;
- ``pytorch recipe``: built on meta, ``fully_shard`` on every decoder layer and the root,
  ``to_empty``, the RoPE buffer recomputed, ``torch.distributed.checkpoint.load`` with
  ``HuggingFaceStorageReader``: PyTorch's own way, without atorch.

Ratios: atorch / pytorch recipe (goal <= 1.1) and atorch / full copy (goal <= 0.5), on the largest
process of each. The first loss (mean over processes) of each path is printed: the weights are the
same pretrained weights, so they must agree (fp32, ~1e-5). Peak RSS is read from ``VmHWM``, not
``ru_maxrss`` (which a spawned process inherits from its parent: see ``atorch.testing.rss``); file
pages a process maps in (safetensors reads) count, as they do in RSS. A second table gives the peak
growth reached by each stage of each path, rank 0's.

    .venv/bin/python benchmarks/host_memory.py [--world 4] [--layers 16] [--hidden 1024] [--tiny]

``--tiny``: a 2-layer, 64-wide Llama with a 256-token vocabulary on 2 processes (seconds).
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import atorch
from atorch.models import SyntheticTokenDataset
from atorch.testing import run_distributed
from atorch.testing.hf_models import hf_loss
from atorch.testing.rss import RssGrowth
from atorch.testing.training import call_model

STEPS, LR = 2, 1e-5
FSDP = ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("LlamaDecoderLayer",)})]
PATHS = ("atorch (meta)", "full copy", "pytorch recipe")
STAGES = ("model ready", "weights loaded", "step 1", "step 2")
GIB = 2**30


def llama_config(layers: int, hidden: int, intermediate: int, heads: int, vocab: int, seq: int):
    return transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                                    num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                    max_position_embeddings=seq, tie_word_embeddings=False, bos_token_id=0,
                                    eos_token_id=0, pad_token_id=0)


def save_model(config, directory: str) -> int:
    """A randomly initialised Llama, saved and freed; returns its parameter count."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size="500MB")
    del model
    gc.collect()
    return count


def measure(path: str, directory: str, config, batch: int, seq: int) -> dict:
    """One rank of one path: peak RSS growth per stage, first loss (mean over ranks), seconds."""
    rss = RssGrowth()  # after imports and process-group init, before any model exists
    start = time.perf_counter()
    dataset = SyntheticTokenDataset(batch, seq, config.vocab_size)  # one global batch: the first one is all of it
    if path == "pytorch recipe":
        losses = _pytorch_recipe(directory, config, dataset, batch, rss)
    else:
        losses = _atorch(path, directory, config, dataset, batch, rss)
    return {"growth": rss.growth(), "marks": dict(rss.marks), "reset": rss.reset, "baseline": rss.baseline,
            "first_loss": losses[0], "losses": losses, "seconds": time.perf_counter() - start}


def _atorch(path: str, directory: str, config, dataset, batch: int, rss: RssGrowth) -> list[float]:
    if path == "atorch (meta)":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(directory)
    status, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, dataset, hf_loss, optim_args={"lr": LR}, dataloader_args={"batch_size": batch},
        model_input_format="unpack_dict", load_strategy=list(FSDP))
    assert status
    del model
    rss.mark("model ready")
    if path == "atorch (meta)":
        atorch.load_pretrained(directory, result)
    rss.mark("weights loaded")
    losses, data = [], result.prepare_input(next(iter(result.dataloader)))
    for step in range(STEPS):
        loss = result.loss_func(data, call_model(result.model, data, "unpack_dict"))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(_mean_over_ranks(loss))
        rss.mark(f"step {step + 1}")
    return losses


def _pytorch_recipe(directory: str, config, dataset, batch: int, rss: RssGrowth) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model._init_weights(model.model.rotary_emb)  # the non-persistent RoPE buffers are in no checkpoint
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    rss.mark("model ready")
    torch.distributed.checkpoint.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(directory))
    rss.mark("weights loaded")
    rows = slice(rank * batch // world, (rank + 1) * batch // world)  # the same rows atorch's first batch covers
    data = {"input_ids": dataset.inputs[rows], "labels": dataset.labels[rows]}
    losses = []
    for step in range(STEPS):
        loss = model(**data).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_mean_over_ranks(loss))
        rss.mark(f"step {step + 1}")
    return losses


def _mean_over_ranks(loss: torch.Tensor) -> float:
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return float(value.item()) / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: one row per process)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide Llama on 2 processes")
    args = parser.parse_args()
    if args.tiny:
        args.world, args.layers, args.hidden, args.intermediate, args.vocab, args.seq = 2, 2, 64, 128, 256, 16
    batch = args.batch or args.world
    config = llama_config(args.layers, args.hidden, args.intermediate, max(args.hidden // 64, 2), args.vocab, args.seq)
    directory = tempfile.mkdtemp(prefix="atorch-host-memory-")
    try:
        params = save_model(config, directory)
        rows = {path: run_distributed(measure, args.world, path, directory, config, batch, args.seq, timeout_s=3000)
                for path in PATHS}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _print(args, params, batch, rows)


def _print(args, params: int, batch: int, rows: dict) -> None:
    whole = params * 4
    print(f"Llama {args.layers} layers x {args.hidden} wide, intermediate {args.intermediate}, vocab {args.vocab} "
          f"({params / 1e6:.1f} M parameters, {whole / GIB:.2f} GiB fp32), fsdp on {args.world} CPU processes, "
          f"AdamW, {STEPS} steps of a global batch of {batch} x {args.seq} tokens")
    header = (f"{'path':<16}{'peak RSS growth GiB/process (min / max)':>42}{'x whole model':>15}{'first loss':>14}"
              f"{'s':>7}")
    print(header)
    print("-" * len(header))
    for path, ranks in rows.items():
        growth = [r["growth"] for r in ranks]
        seconds = statistics.median(r["seconds"] for r in ranks)
        print(f"{path:<16}{f'{min(growth) / GIB:.3f} / {max(growth) / GIB:.3f}':>42}{max(growth) / whole:>15.2f}"
              f"{ranks[0]['first_loss']:>14.7f}{seconds:>7.0f}")
    peak = {path: max(r["growth"] for r in ranks) for path, ranks in rows.items()}
    print(f"atorch / pytorch recipe: {peak['atorch (meta)'] / peak['pytorch recipe']:.2f} (goal <= 1.1); "
          f"atorch / full copy: {peak['atorch (meta)'] / peak['full copy']:.2f} (goal <= 0.5)")
    loading = {path: max(r["marks"]["weights loaded"] for r in ranks) for path, ranks in rows.items()}
    print(f"up to the first step (building, sharding, loading; max over processes): atorch / pytorch recipe "
          f"{loading['atorch (meta)'] / loading['pytorch recipe']:.2f}, atorch / full copy "
          f"{loading['atorch (meta)'] / loading['full copy']:.2f}")
    losses = {path: ranks[0]["first_loss"] for path, ranks in rows.items()}
    reference = losses["full copy"]
    print("first loss, relative difference to the full copy's: " + ", ".join(
        f"{path} {abs(loss - reference) / abs(reference):.1e}" for path, loss in losses.items() if path != "full copy"))
    print(f"peak RSS growth reached by each stage, GiB, rank 0 (a whole fp32 copy is {whole / GIB:.2f} GiB)")
    print(f"{'path':<16}" + "".join(f"{stage:>16}" for stage in STAGES))
    for path, ranks in rows.items():
        print(f"{path:<16}" + "".join(f"{ranks[0]['marks'][stage] / GIB:>16.3f}" for stage in STAGES))
    if not all(r["reset"] for ranks in rows.values() for r in ranks):
        print("note: /proc/self/clear_refs was not writable: peaks count from each process's start")
    print(f"baseline RSS after imports and process-group init: {rows['atorch (meta)'][0]['baseline'] / GIB:.2f} GiB "
          "(rank 0)")


if __name__ == "__main__":
    main()
