"""Training speed on one GPU: a ~1B-parameter Llama-style decoder, plain PyTorch against a hand-tuned
expert configuration and against auto_accelerate's fully automatic search, in one run.

Model: transformers ``LlamaConfig`` (16 layers, hidden 2048, 16 heads, MLP 5632, vocab 32000,
sequence 2048; random weights), AdamW, a fixed global batch of 8 sequences (16384 tokens) per
optimizer step. Rows:

- ``eager fp32`` / ``eager bf16 autocast``: the user's starting point (AdamW as torch defaults it);
- ``expert``: bf16 autocast, ``torch.compile`` of each decoder layer, SDPA restricted to flash
  attention, fused AdamW; the largest micro-batch that fits (gradient accumulation makes up the
  global batch), activation checkpointing only when no micro-batch fits without it;
- ``auto_accelerate``: the fully automatic search (its wall time reported apart), then the chosen
  strategy's steady-state step;
- ``atorch compile model`` / ``atorch compile blocks`` (``--compile-scopes``): bf16 autocast and
  native_dynamo named by hand, compiling the whole model, then each decoder layer.

Each row gives tokens/s and MFU: model FLOPs (6 N per token, N the parameters but the input
embedding's, plus attention 12 L H S per token) over the GPU's bf16 dense peak from ``PEAK_BF16``
and over a peak measured in the same run with a large bf16 matmul. The search report follows (dry
runs tried, how many ran out of memory, predicted against measured peak memory of every dry run),
then the ratios auto / expert and auto / eager; the table is written to ``benchmarks/results/``
as JSON and Markdown with the device, torch version and date.

Without CUDA it prints why it skips and exits 0. ``--tiny`` runs the same rows on CPU with a tiny
config (2 layers, hidden 64, sequence 32, fp32 where bf16 is not sensible, no torch.compile), so CI
can check the script does not rot; its figures mean nothing.

    .venv/bin/python benchmarks/gpu.py [--tiny] [--steps 10] [--time-limit 900] [--compile-scopes]
        [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing atorch

from atorch.auto.accelerate import auto_accelerate  # noqa: E402

# bf16 dense peak (TFLOP/s, no sparsity) by device name; the first key found in the name wins
PEAK_BF16 = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}
OOM_WORDS = ("out of memory", "OutOfMemoryError")


@dataclass(frozen=True)
class Setup:
    """The model and batch of one run (the full ~1B model, or the tiny CPU one)."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    seq: int
    global_batch: int            # sequences per optimizer step
    micro_batches: tuple         # the expert's micro-batches, largest first
    device: str
    low_dtype: Optional[torch.dtype]  # the autocast dtype of the bf16 rows (None: fp32)
    compile: bool
    steps: int
    warmup: int
    time_limit: float
    search_options: tuple = ()   # extra auto_accelerate keyword arguments, as (key, value) pairs

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq


class MicroBatchTooLarge(RuntimeError):
    """No micro-batch of the list fits in memory, even with activation checkpointing."""


@dataclass
class Row:
    name: str
    step_s: float
    tokens_per_s: float
    mfu_table: Optional[float]
    mfu_measured: Optional[float]
    detail: str = ""


@dataclass
class SearchSummary:
    seconds: float
    strategy: list
    dry_runs: int
    out_of_memory: int
    runs: list = field(default_factory=list)  # label, status, predicted / measured MiB, error


def full_setup(args: argparse.Namespace) -> Setup:
    return Setup(16, 2048, 16, 5632, 32000, 2048, 8, (8, 4, 2, 1), "cuda", torch.bfloat16, True,
                 args.steps, 3, args.time_limit)


def tiny_setup(args: argparse.Namespace) -> Setup:
    """CPU: bf16 autocast works there (so that row stays), but the expert runs in fp32 without
    compile (each compile costs ~20 s on CPU), the search leaves native_dynamo out and dry-runs two
    candidates of one step, and torch uses one thread (on a shared machine two threads per op wait
    for each other: steps of this tiny model then vary from 20 ms to 2 s)."""
    torch.set_num_threads(1)
    return Setup(2, 64, 4, 128, 256, 32, 4, (4, 2), "cpu", torch.bfloat16, False, min(args.steps, 3), 1,
                 min(args.time_limit, 20), (("dryrun_steps", 1), ("search_topk", 2)))


def build_model(setup: Setup, attn: str = "sdpa") -> torch.nn.Module:
    """A Llama decoder from its config, random weights (seeded: every row trains the same model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.heads, intermediate_size=setup.intermediate,
                         vocab_size=setup.vocab, max_position_embeddings=setup.seq, attn_implementation=attn,
                         use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def make_dataset(setup: Setup, batches: int) -> list:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, setup.vocab, (setup.global_batch * batches, setup.seq), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def causal_lm_loss(batch: dict, output: Any) -> torch.Tensor:
    return output.loss


def model_flops_per_token(model: torch.nn.Module, setup: Setup) -> float:
    """6 N (N without the input embedding: a lookup, no matmul) plus causal attention's 12 L H S."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return 6.0 * (params - embedding) + 12.0 * setup.layers * setup.hidden * setup.seq


def table_peak_flops(device: str) -> Optional[float]:
    """The bf16 dense peak of this GPU from ``PEAK_BF16`` (FLOP/s), None when its name is not there."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_BF16.items() if key in name), None)


def measured_peak_flops(setup: Setup) -> float:
    """A large matmul in the rows' precision, timed: the peak this GPU reaches here and now."""
    n = 8192 if setup.device == "cuda" else 512
    dtype = setup.low_dtype if setup.device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=setup.device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(setup)
    repeats = 20 if setup.device == "cuda" else 5
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(setup)
    return 2.0 * n**3 * repeats / (time.perf_counter() - start)


def synchronize(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def release(setup: Setup) -> None:
    """Free the previous row's model and optimizer (and compiled graphs) before the next is built."""
    if setup.compile:
        torch._dynamo.reset()
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or any(w in str(error) for w in OOM_WORDS)


# --- the hand-written loops -------------------------------------------------------------------------
def hand_step(setup: Setup, model: torch.nn.Module, optim: torch.optim.Optimizer, batches: list,
              micro: int, dtype: Optional[torch.dtype], flash: bool) -> Callable[[int], None]:
    """One optimizer step over the global batch, in micro-batches of ``micro`` sequences."""
    accumulation = setup.global_batch // micro

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        for k in range(accumulation):
            ids = batch[k * micro:(k + 1) * micro]
            with _autocast(setup, dtype), _flash_only(setup, flash):
                loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step


def _autocast(setup: Setup, dtype: Optional[torch.dtype]) -> Any:
    return torch.autocast(setup.device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _flash_only(setup: Setup, flash: bool) -> Any:
    """SDPA restricted to the flash kernel (CUDA): an error, not a silent fallback, if it cannot run."""
    if not (flash and setup.device == "cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place, as torchtitan does, not the whole model: compiled
    whole, transformers materialises the causal mask (it cannot skip it while tracing) and SDPA's
    flash kernel refuses a mask; built eagerly, the mask is None and the layers call SDPA causal."""
    for layer in model.model.layers:
        layer.compile()


def device_batches(setup: Setup, count: int = 4) -> list:
    data = make_dataset(setup, count)
    ids = torch.stack([d["input_ids"] for d in data]).to(setup.device)
    return list(ids.split(setup.global_batch))


def time_steps(setup: Setup, step: Callable[[int], None], steps: int, warmup: int) -> float:
    """Median seconds per step over ``steps`` steps, each synchronised, after ``warmup`` steps."""
    for i in range(warmup):
        step(i)
    synchronize(setup)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(warmup + i)
        synchronize(setup)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_hand(setup: Setup, name: str, dtype: Optional[torch.dtype], expert: bool) -> tuple[float, str]:
    """Time a hand-written configuration at the largest micro-batch that fits. The eager rows take
    the first fitting micro-batch too (a user halves the batch after an out-of-memory error)."""
    batches = device_batches(setup)
    options = [(m, False) for m in setup.micro_batches] + ([(m, True) for m in setup.micro_batches] if expert else [])
    for micro, checkpoint in options:
        release(setup)
        model = build_model(setup).to(setup.device)
        if checkpoint:
            model.gradient_checkpointing_enable()
        if expert and setup.compile:
            compile_blocks(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=expert)
        step = hand_step(setup, model, optim, batches, micro, dtype, flash=expert)
        del model, optim  # the step holds them; dropping it (and collecting: compiled layers make cycles)
        try:               # frees the row's memory before the next row is measured
            seconds = time_steps(setup, step, setup.steps, setup.warmup)
        except Exception as error:  # compile can wrap an out-of-memory error in its own type
            if not is_oom(error):
                raise
            print(f"  {name}: micro-batch {micro}{' + checkpoint' if checkpoint else ''} is out of memory")
            continue
        finally:
            del step
            release(setup)
        detail = f"micro-batch {micro} x {setup.global_batch // micro}" + (", checkpoint" if checkpoint else "")
        if expert:
            detail += ", fused AdamW" + (", compile per layer, flash SDPA" if setup.compile else "")
        print(f"  {name}: {seconds * 1000:.1f} ms/step ({detail})", flush=True)
        return seconds, detail
    raise MicroBatchTooLarge(f"{name}: no micro-batch of {setup.micro_batches} fits")


# --- auto_accelerate ----------------------------------------------------------------------------------
def training_step(result: Any, batches: list) -> Callable[[int], None]:
    """One step of auto_accelerate's result on batch ``i`` (cycling); dropping the returned function
    releases what it holds."""
    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()

    return step


def run_auto(setup: Setup) -> tuple[float, str, SearchSummary]:
    """The fully automatic search (timed apart), then the chosen strategy's steady-state step."""
    model = build_model(setup)
    dataset = make_dataset(setup, 8)
    kwargs: dict[str, Any] = {"time_limit": setup.time_limit, "use_profile_cache": False, **dict(setup.search_options)}
    if not setup.compile:
        kwargs["excluded"] = ["native_dynamo"]
    start = time.perf_counter()
    status, result, strategy = auto_accelerate(
        model, torch.optim.AdamW, dataset, causal_lm_loss, optim_args={"lr": 1e-4},
        dataloader_args={"batch_size": setup.global_batch}, model_input_format="unpack_dict", **kwargs)
    search_s = time.perf_counter() - start
    if not status:
        raise RuntimeError("auto_accelerate found no strategy that trains within the limits")
    summary = summarize_search(result.args.extras.get("search"), search_s, strategy)
    kernel = "fused" if all(g.get("fused") for g in result.optim.torch_optimizer.param_groups) else "torch's default"
    batches = [result.prepare_input(b) for b in result.dataloader]
    step = training_step(result, batches)
    seconds = time_steps(setup, step, setup.steps, setup.warmup)
    del result, step, batches
    release(setup)
    return seconds, "chosen: " + "+".join(summary.strategy) + f", {kernel} AdamW", summary


def run_compile_scope(setup: Setup, scope: str) -> tuple[float, str]:
    """Semi-automatic bf16 autocast + native_dynamo at one ``scope`` (whole model or each decoder
    layer), the whole global batch per step: the two ways atorch can compile, side by side."""
    model = build_model(setup)
    strategy = [("amp_native", {"dtype": setup.low_dtype}), ("native_dynamo", {"scope": scope})]
    _, result, _ = auto_accelerate(model, torch.optim.AdamW, make_dataset(setup, 4), causal_lm_loss,
                                   optim_args={"lr": 1e-4}, dataloader_args={"batch_size": setup.global_batch},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    del model
    batches = [result.prepare_input(b) for b in result.dataloader]
    step = training_step(result, batches)
    del result
    try:
        seconds = time_steps(setup, step, setup.steps, setup.warmup)
    finally:
        del step, batches
        release(setup)
    print(f"  atorch compile {scope}: {seconds * 1000:.1f} ms/step", flush=True)
    return seconds, f"load_strategy amp_native + native_dynamo scope {scope!r}, micro-batch {setup.global_batch}"


def summarize_search(search: Any, seconds: float, strategy: Any) -> SearchSummary:
    """What the search's result exposes: every row it dry-ran, with predicted and measured memory."""
    names = (strategy.names() or ["(empty: fp32, nothing applied)"]) if strategy is not None else []
    if search is None:
        return SearchSummary(seconds, names, 0, 0)
    tried = [r for r in search.rows if r.measured_memory or r.status in ("ok", "failed", "over memory limit")]
    oom = [r for r in tried if r.status == "over memory limit" or any(w in r.reason for w in OOM_WORDS)]
    runs = [{"label": r.label, "status": r.status, "reason": r.reason,
             "predicted_mib": round(r.predicted_memory / 2**20, 1),
             "measured_mib": round(r.measured_memory / 2**20, 1) if r.measured_memory else None,
             "error": round(r.memory_error, 3) if r.memory_error is not None else None,
             "measured_ms": round(r.measured_time_s * 1000, 2) if r.measured_time_s else None} for r in tried]
    return SearchSummary(seconds, names, len(tried), len(oom), runs)


# --- the report ----------------------------------------------------------------------------------------
def make_row(name: str, seconds: float, detail: str, flops_per_token: float, setup: Setup,
             peak_table: Optional[float], peak_measured: float) -> Row:
    tokens_per_s = setup.tokens / seconds
    achieved = flops_per_token * tokens_per_s
    return Row(name, seconds, tokens_per_s, achieved / peak_table if peak_table else None,
               achieved / peak_measured, detail)


def print_table(rows: list[Row]) -> None:
    header = f"{'configuration':<22}{'ms/step':>10}{'tokens/s':>12}{'MFU (table)':>13}{'MFU (measured)':>16}  detail"
    print(header)
    print("-" * (len(header) + 30))
    for row in rows:
        table = f"{row.mfu_table:>13.1%}" if row.mfu_table is not None else f"{'n/a':>13}"
        print(f"{row.name:<22}{row.step_s * 1000:>10.1f}{row.tokens_per_s:>12.0f}{table}"
              f"{row.mfu_measured:>16.1%}  {row.detail}")


def print_search(summary: SearchSummary) -> None:
    print(f"search: {summary.seconds:.1f} s, {summary.dry_runs} dry run(s), {summary.out_of_memory} out of memory; "
          f"chosen {'+'.join(summary.strategy)}")
    print(f"  {'dry run':<40}{'pred MiB':>10}{'meas MiB':>10}{'err':>8}  status")
    for run in summary.runs:
        measured = f"{run['measured_mib']:>10.1f}" if run["measured_mib"] is not None else f"{'':>10}"
        error = f"{run['error']:>8.1%}" if run["error"] is not None else f"{'':>8}"
        print(f"  {run['label']:<40}{run['predicted_mib']:>10.1f}{measured}{error}  {run['status']}")


def ratios(rows: dict) -> dict:
    auto = rows["auto_accelerate"].tokens_per_s
    return {f"auto / {name}": auto / rows[name].tokens_per_s
            for name in ("expert", "eager fp32", "eager bf16 autocast")}


def write_results(out: Path, setup: Setup, rows: list[Row], summary: SearchSummary, ratio: dict,
                  peaks: dict, device_name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    tag = "tiny-cpu" if setup.device == "cpu" else "gpu"
    record = {"device": device_name, "torch": torch.__version__, "date": stamp, "setup": _setup_dict(setup),
              "peak_flops": peaks, "rows": [asdict(r) for r in rows], "search": asdict(summary), "ratios": ratio}
    json_path = out / f"gpu-{tag}-{stamp}.json"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md_path = out / f"gpu-{tag}-{stamp}.md"
    md_path.write_text(_markdown(record))
    return [json_path, md_path]


def _setup_dict(setup: Setup) -> dict:
    return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(setup).items()}


def _markdown(record: dict) -> str:
    lines = [f"# benchmarks/gpu.py on {record['device']}", "",
             f"torch {record['torch']}, {record['date']}; setup {record['setup']}", "",
             "| configuration | ms/step | tokens/s | MFU (table) | MFU (measured) | detail |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in record["rows"]:
        table = f"{r['mfu_table']:.1%}" if r["mfu_table"] is not None else "n/a"
        lines.append(f"| {r['name']} | {r['step_s'] * 1000:.1f} | {r['tokens_per_s']:.0f} | {table} | "
                     f"{r['mfu_measured']:.1%} | {r['detail']} |")
    lines += ["", " ".join(f"{k}: **{v:.2f}**;" for k, v in record["ratios"].items()), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script, not the speed")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (after warm-up)")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds for auto_accelerate's search")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--compile-scopes", action="store_true",
                        help="add two rows: bf16 + native_dynamo compiling the whole model, then each layer")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks/gpu.py: skipped, no CUDA device here (torch.cuda.is_available() is False). "
              "Run it on a GPU machine, or with --tiny to check the script on CPU.")
        return 0
    setup = tiny_setup(args) if args.tiny else full_setup(args)
    device_name = torch.cuda.get_device_name() if setup.device == "cuda" else "CPU (--tiny)"
    peaks = {"table": table_peak_flops(setup.device), "measured": measured_peak_flops(setup)}
    flops = model_flops_per_token(build_model(setup), setup)
    table_text = "n/a" if peaks["table"] is None else f"{peaks['table'] / 1e12:.0f}"
    print(f"{device_name}, torch {torch.__version__}: Llama {setup.layers} layers x {setup.hidden}, "
          f"sequence {setup.seq}, {setup.tokens} tokens per step; {flops / 1e9:.3f} GFLOP per token; peak "
          f"{table_text} TFLOP/s (table), {peaks['measured'] / 1e12:.4g} TFLOP/s (measured matmul)")
    timed: dict[str, tuple[float, str]] = {}
    timed["eager fp32"] = run_hand(setup, "eager fp32", None, expert=False)
    timed["eager bf16 autocast"] = run_hand(setup, "eager bf16 autocast", setup.low_dtype, expert=False)
    expert_dtype = setup.low_dtype if setup.device == "cuda" else None
    timed["expert"] = run_hand(setup, "expert", expert_dtype, expert=True)
    auto_s, auto_detail, summary = run_auto(setup)
    timed["auto_accelerate"] = (auto_s, auto_detail)
    if args.compile_scopes and setup.compile:
        for scope in ("model", "blocks"):
            timed[f"atorch compile {scope}"] = run_compile_scope(setup, scope)
    rows = {name: make_row(name, s, d, flops, setup, peaks["table"], peaks["measured"])
            for name, (s, d) in timed.items()}
    print_table(list(rows.values()))
    print_search(summary)
    ratio = ratios(rows)
    print("ratios (tokens/s): " + ", ".join(f"{k} = {v:.2f}" for k, v in ratio.items()))
    files = write_results(args.out, setup, list(rows.values()), summary, ratio, peaks, device_name)
    print("written: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
