"""The conformance matrix: every method and model-parallel layout on every model of the zoo.

Each cell trains a zoo model (``atorch.testing.hf_models.ZOO``) for a few steps under one strategy
on real gloo ranks and compares the losses and final weights with single-process PyTorch on the
same data and global batch. A cell is:

- ``pass``: relative difference within the column's tolerance (fp32 data parallel and single-process
  methods 1e-5, fp32 model parallel 1e-4, bf16 / fp16 anywhere 2e-2);
- ``refused``: atorch raised one of its typed errors (``atorch.errors.AtorchError``: a method that
  does not apply to this model, a backend this machine lacks), with the reason;
- ``ignored``: the run trained but the strategy that ran lacks a method the column names (the
  contract's "ignored with a warning", e.g. fp8 without a GPU that has it), so nothing was shown;
- ``fail``: anything else: an exception from inside torch or transformers, a parity miss, a hang.

Rows ``<family>@meta`` (``META_FAMILIES``) run the same cell on the model built on the meta device,
its weights (the reference's initial ones, written once by the parent) streamed in with
``atorch.load_pretrained``: the large-model path, judged against the same reference.

The columns of each world size (one, two and four processes) share one launch (process start-up is
most of a small cell's cost); inside a launch each cell runs
under ``run_isolated`` so that a cell failing on one rank fails on all of them and the next cell starts
on a healthy process group. ``python -m atorch.testing.conformance`` runs the
matrix and prints it; ``--write docs/models.md`` regenerates the page (``make conformance``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from atorch import errors
from atorch.auto.opt_lib.tp_mha import split_mha
from atorch.auto.opt_lib.tp_plan import find_tp_plan, split_share
from atorch.distributed.fault import Outcome, describe, run_isolated
from atorch.testing.hf_models import FAMILY_MODELS, MORE_FAMILIES, ZOO, ZooModel, zoo_model
from atorch.testing.launcher import DistributedRunError, run_distributed
from atorch.testing.training import relative_difference, train_gpt, weight_difference
from atorch.utils.batch import call_with_batch
from atorch.utils.dataflow import record_dataflow
from atorch.utils.modules import repeated_blocks

STEPS, GLOBAL_BATCH, LR = 3, 8, 0.05
DP_TOL, MP_TOL, LOW_TOL = 1e-5, 1e-4, 2e-2
COLLECTIVE_TIMEOUT_S = 60.0
BF16 = ("amp_native", {"dtype": torch.bfloat16})
# families also run built on the meta device: tied weights and a fused q|k|v (gpt2), RoPE buffers
# (llama), a torchtitan init_weights (titan_llama), nn.MultiheadAttention (torch_encoder), routing
# that depends on values (moe)
META_FAMILIES = ("gpt2", "llama", "titan_llama", "torch_encoder", "moe", "mixtral")
META = "@meta"


def family(name: str) -> str:
    """The zoo family of a row (``llama@meta`` -> ``llama``)."""
    return name.removesuffix(META)


def all_rows() -> list[str]:
    return list(ZOO) + [f"{name}{META}" for name in META_FAMILIES]


def _mode(*dims: tuple[str, int]) -> tuple:
    return ("parallel_mode", (list(dims), None))


@dataclass(frozen=True)
class Column:
    """One strategy of the matrix. ``strategy(model)`` builds the load_strategy list for a zoo model;
    ``data_parallel`` is the number of batch shards (the CNN's BatchNorm reference runs them apart)."""

    key: str
    label: str
    world: int
    strategy: Callable[[ZooModel], list]
    tolerance: float
    data_parallel: int = 1


def _fixed(*items: Any) -> Callable[[ZooModel], list]:
    return lambda model: list(items)


COLUMNS: list[Column] = [
    # one process
    Column("amp_bf16", "amp_native bf16", 1, _fixed(BF16), LOW_TOL),
    Column("half_bf16", "half bf16", 1, _fixed(("half", "bf16")), LOW_TOL),
    # checkpoint, zero2 and fsdp named without modules: each finds the model's layers from its structure
    Column("checkpoint", "checkpoint", 1, _fixed("checkpoint"), DP_TOL),
    Column("module_replace", "module_replace", 1, _fixed("module_replace"), DP_TOL),
    Column("native_dynamo", "native_dynamo", 1, _fixed("native_dynamo"), DP_TOL),
    Column("fp8", "fp8", 1, _fixed("fp8"), LOW_TOL),
    # 2 processes: data parallel and sharding
    Column("ddp", "DDP (data 2)", 2, _fixed(_mode(("data", 2))), DP_TOL, 2),
    Column("zero1", "zero1", 2, _fixed("zero1"), DP_TOL, 2),
    Column("zero2", "zero2", 2, _fixed("zero2"), DP_TOL, 2),
    Column("fsdp", "fsdp", 2, _fixed("fsdp"), DP_TOL, 2),
    # sharding composed with mixed precision: fully_shard casts what it shards (BatchNorm's running
    # statistics stay fp32, a scalar parameter stays a plain tensor beside the DTensor shards)
    Column("fsdp_amp_bf16", "fsdp + amp_native bf16", 2,
           lambda m: [("fsdp", {"atorch_wrap_cls": (m.block,)}), BF16], LOW_TOL, 2),
    Column("ds_zero1", "DeepSpeed zero1", 2, _fixed(("zero1", {"use_ds_zero": True})), DP_TOL, 2),
    Column("ds_zero2", "DeepSpeed zero2", 2, _fixed(("zero2", {"use_ds_zero": True})), DP_TOL, 2),
    # 2 processes: model parallel
    Column("tp2", "tensor 2", 2, _fixed(_mode(("tensor", 2)), "tensor_parallel"), MP_TOL),
    Column("tp2_sp", "tensor 2 + sequence", 2, _fixed(_mode(("tensor", 2)), "tensor_parallel", "sequence_parallel"),
           MP_TOL),
    Column("pp2_1f1b", "pipeline 2 1F1B", 2,
           _fixed(_mode(("pipeline", 2)), ("pipeline_parallel", {"num_micro_batch": 4})), MP_TOL),
    Column("pp2_gpipe", "pipeline 2 GPipe", 2,
           _fixed(_mode(("pipeline", 2)), ("pipeline_parallel", {"schedule": "GPipe", "num_micro_batch": 4})), MP_TOL),
    Column("pp2_interleaved", "pipeline 2 Interleaved1F1B", 2,
           _fixed(_mode(("pipeline", 2)), ("pipeline_parallel", {"schedule": "Interleaved1F1B", "num_micro_batch": 4})),
           MP_TOL),
    Column("ds_3d_pp2", "ds_3d_parallel pipeline 2", 2,
           _fixed(_mode(("pipeline", 2)), ("ds_3d_parallel", {"num_micro_batch": 4})), MP_TOL),
    # 4 processes: composed
    Column("mixed_tp2_pp2", "mixed tensor 2 x pipeline 2", 4,
           _fixed(_mode(("tensor", 2), ("pipeline", 2)), ("mixed_parallel", {"pipeline": {"num_micro_batch": 4}})),
           MP_TOL),
    Column("tp2_dp2_zero1", "tensor 2 x data 2 + zero1", 4,
           _fixed(_mode(("tensor", 2), ("data", 2)), "tensor_parallel", "zero1"), MP_TOL, 2),
    Column("pp2_dp2", "pipeline 2 x data 2", 4,
           _fixed(_mode(("pipeline", 2), ("data", 2)), ("pipeline_parallel", {"schedule": "GPipe"})), MP_TOL, 2),
]
COLUMN_BY_KEY = {c.key: c for c in COLUMNS}
# world sizes whose columns share one launch. The four-process ones share it since a refusal's rebuilt
# process group drops DTensor's caches of meshes (``mesh.forget_cached_meshes``): before, a tensor x data
# cell after a refusal was served a mesh of the old groups ("Could not resolve the process group
# registered under the name 8"), a bug every later cell of the launch now checks again
SHARED_LAUNCH_WORLDS = (1, 2, 4)


@dataclass
class Cell:
    status: str                    # pass / refused / ignored / fail
    detail: str = ""               # the refusal's reason, the failure
    loss_diff: Optional[float] = None
    weight_diff: Optional[float] = None
    seconds: float = 0.0

    @property
    def max_diff(self) -> Optional[float]:
        diffs = [d for d in (self.loss_diff, self.weight_diff) if d is not None]
        return max(diffs) if diffs else None


# --- on the ranks ----------------------------------------------------------------------------------
def _typed_error_names() -> set[str]:
    def subclasses(cls: type) -> set[str]:
        return {cls.__name__}.union(*(subclasses(c) for c in cls.__subclasses__()))

    return subclasses(errors.AtorchError)


def run_columns(column_keys: list[str], models: list[str], progress: Optional[str] = None,
                pretrained: Optional[dict[str, str]] = None) -> dict:
    """On every rank of one launch: ``run_column`` for each column of one world size, by column key."""
    return {key: run_column(key, models, progress, pretrained) for key in column_keys}


def run_column(column_key: str, models: list[str], progress: Optional[str] = None,
               pretrained: Optional[dict[str, str]] = None) -> dict:
    """On every rank of one launch: train each model under the column's strategy. Rank 0 returns the
    losses and full weights; a cell that raised on any rank reports the first error on all of them."""
    column = COLUMN_BY_KEY[column_key]
    out = {}
    for name in models:
        start = time.monotonic()
        _progress(progress, f"{column_key} {name} start")

        def cell() -> dict:
            # each cell compiles afresh, as a user's process with one model does: dynamo's recompile
            # limit counts per code object, and HF's decoder layers share one forward, so later
            # families would otherwise run eager under native_dynamo
            torch._dynamo.reset()
            try:
                run = train_gpt(column.strategy(zoo_model(family(name))), hf_model=family(name), steps=STEPS,
                                global_batch=GLOBAL_BATCH, lr=LR,
                                pretrained=(pretrained or {}).get(name) if name.endswith(META) else None)
            except Exception:
                print(f"[conformance] {column_key} x {name} raised:\n{traceback.format_exc()}", file=sys.stderr)
                raise
            return {"losses": run["losses"], "weights": run["weights"], "applied": run["strategy"].names()}

        outcome = run_isolated(cell, collective_timeout_s=COLLECTIVE_TIMEOUT_S) if column.world > 1 else _run_here(cell)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if outcome.ok:
            out[name] = {"ok": True, **(outcome.value if rank0 else {"losses": outcome.value["losses"]})}
        else:
            out[name] = {"ok": False, "error": outcome.error}
        out[name]["seconds"] = time.monotonic() - start
        _progress(progress, f"{column_key} {name} {'ok' if outcome.ok else 'error'} {out[name]['seconds']:.1f}s")
    return out


def _run_here(fn: Callable[[], Any]):
    try:
        return Outcome(True, fn())
    except Exception as error:
        return Outcome(False, error=describe(error))


def _progress(path: Optional[str], line: str) -> None:
    if path:
        with open(path, "a") as handle:
            handle.write(line + "\n")


# --- in the parent ---------------------------------------------------------------------------------
_REFERENCES: dict = {}


def reference(name: str, chunks: int) -> dict:
    """Single-process PyTorch on the same data and global batch (the CNN: per-shard forwards)."""
    chunks = chunks if zoo_model(name).norm_chunks else 1
    if (name, chunks) not in _REFERENCES:
        run = train_gpt([], hf_model=name, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, interleaved_chunks=chunks)
        _REFERENCES[(name, chunks)] = {"losses": run["losses"], "weights": run["weights"]}
    return _REFERENCES[(name, chunks)]


def judge(column: Column, row: str, ran: dict, typed: set[str]) -> Cell:
    name = family(row)  # a meta row is judged against its family's reference
    if not ran["ok"]:
        error = ran["error"] or "unknown error"
        kind = error.split(":", 1)[0]
        status = "refused" if kind in typed else "fail"
        return Cell(status, error, seconds=ran["seconds"])
    named = [item if isinstance(item, str) else item[0] for item in column.strategy(zoo_model(name))]
    dropped = [method for method in named if method != "parallel_mode" and method not in ran.get("applied", named)]
    if dropped:
        return Cell("ignored", f"{', '.join(dropped)} not applied on this machine (ignored with a warning, as the "
                    "method contract says); the run trained without it", seconds=ran["seconds"])
    ref = reference(name, column.data_parallel)
    weights, ref_weights = _comparable(ran["weights"], name), _comparable(ref["weights"], name)
    loss_diff = relative_difference(ran["losses"], ref["losses"])
    try:
        weight_diff = weight_difference(weights, ref_weights)
    except AssertionError as error:
        return Cell("fail", str(error), loss_diff, None, ran["seconds"])
    cell = Cell("pass", "", loss_diff, weight_diff, ran["seconds"])
    if not all(math.isfinite(d) and d < column.tolerance for d in (loss_diff, weight_diff)):
        cell.status, cell.detail = "fail", (f"parity: losses {loss_diff:.1e}, weights {weight_diff:.1e} "
                                            f"(tolerance {column.tolerance:g})")
    return cell


def _comparable(weights: dict, name: str) -> dict:
    """BatchNorm running statistics follow each rank's own batches (DDP keeps rank 0's); the trained
    parameters are what parity is about."""
    if not zoo_model(name).norm_chunks:
        return weights
    return {k: v for k, v in weights.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def run_matrix(columns: Optional[list[str]] = None, models: Optional[list[str]] = None,
               timeout_s: float = 900.0, verbose: bool = True) -> dict[tuple[str, str], Cell]:
    """Every cell of the matrix, judged against the references: the columns of each world size in one
    launch (``SHARED_LAUNCH_WORLDS``; single-process columns in two launches side by side, each with half
    the rows), one world size after another (starting processes and importing torch and transformers
    costs more than most cells; a launch that dies ends only its remaining cells, which are reported as
    not run)."""
    models = models or all_rows()
    typed = _typed_error_names()
    cells: dict[tuple[str, str], Cell] = {}
    chosen = [COLUMN_BY_KEY[k] for k in (columns or [c.key for c in COLUMNS])]
    groups: dict = {}
    for column in chosen:
        groups.setdefault(column.world if column.world in SHARED_LAUNCH_WORLDS else column.key, []).append(column)
    with tempfile.TemporaryDirectory(prefix="atorch-conformance-") as root:
        pretrained = {name: write_pretrained(family(name), f"{root}/{name}") for name in models if name.endswith(META)}
        for group in groups.values():
            _run_matrix_columns(group, models, pretrained, typed, cells, timeout_s * len(group), verbose)
    return cells


def write_pretrained(name: str, directory: str) -> str:
    """The reference's initial weights (``train_gpt`` seeds 0 before building) where
    ``load_pretrained`` reads them: ``save_pretrained``'s layout for an HF model, else one
    ``model.safetensors`` (a tied weight once)."""
    torch.manual_seed(0)
    model = ZOO[name].build()
    if ZOO[name].hf:
        model.save_pretrained(directory)
        return directory
    os.makedirs(directory, exist_ok=True)
    seen: set[int] = set()
    weights = {}
    for key, tensor in model.state_dict().items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            weights[key] = tensor.detach().clone().contiguous()
    save_file(weights, f"{directory}/model.safetensors")
    return directory


def _run_matrix_columns(columns: list[Column], models: list[str], pretrained: dict, typed: set[str], cells: dict,
                        timeout_s: float, verbose: bool) -> None:
    """The cells of ``columns`` (all of one world size), judged into ``cells``: one launch, or for
    single-process columns two launches side by side, each with half the rows (a single-process cell
    keeps one core busy, mostly compiling under native_dynamo; the machine the suite runs on has two)."""
    started = time.monotonic()
    keys = [c.key for c in columns]
    halves = [models[0::2], models[1::2]] if columns[0].world == 1 and len(models) > 1 else [models]
    with ThreadPoolExecutor(max_workers=len(halves)) as pool:
        parts = list(pool.map(lambda rows: _launch_columns(columns, keys, rows, pretrained, timeout_s), halves))
    ran = {key: {name: part[key][name] for part in parts for name in part[key]} for key in keys}
    for column in columns:
        for name in models:
            cells[(column.key, name)] = judge(column, name, ran[column.key][name], typed)
    if verbose:
        for column in columns:
            summary = ", ".join(f"{n} {_symbol(cells[(column.key, n)])}" for n in models)
            print(f"[conformance] {column.label}: {summary}", file=sys.stderr, flush=True)
        print(f"[conformance] {len(columns)} column(s) on {columns[0].world} process(es) x {len(halves)} "
              f"launch(es): {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def _launch_columns(columns: list[Column], keys: list[str], models: list[str], pretrained: dict,
                    timeout_s: float) -> dict:
    """One launch running ``models`` under each of ``columns``: what rank 0 reported, by column and row
    (a launch that died: its cells as ``_partial_after_crash`` says)."""
    with tempfile.NamedTemporaryFile("r", suffix=".progress") as progress:
        try:
            return run_distributed(run_columns, columns[0].world, keys, models, progress.name, pretrained,
                                   timeout_s=timeout_s)[0]
        except DistributedRunError as error:
            return _partial_after_crash(progress.name, keys, models, error)


def _partial_after_crash(progress: str, keys: list[str], models: list[str], error: Exception) -> dict:
    """A launch that died or hung: the cell it was in fails with the launcher's reason; later cells
    did not run."""
    with open(progress) as handle:
        started = [line.split() for line in handle.read().splitlines() if line.endswith(" start")]
    order = [(key, name) for key in keys for name in models]
    current = (started[-1][0], started[-1][1]) if started else order[0]
    out: dict = {key: {} for key in keys}
    for key, name in order:
        if (key, name) == current:
            out[key][name] = {"ok": False, "error": f"launch died or hung: {str(error)[-300:]}", "seconds": 0.0}
        elif order.index((key, name)) > order.index(current):
            out[key][name] = {"ok": False, "error": f"not run: the launch ended in {current[0]} x {current[1]}",
                              "seconds": 0.0}
        else:
            out[key][name] = {"ok": False, "error": "result lost with the launch", "seconds": 0.0}
    return out


# --- the table -------------------------------------------------------------------------------------
def _symbol(cell: Cell) -> str:
    return {"pass": "✔", "refused": "refused", "ignored": "ignored", "fail": "✗"}[cell.status]


def render(cells: dict[tuple[str, str], Cell], numbers: bool = True) -> str:
    """Markdown: one row per model, one column per strategy; refusals and failures are numbered notes."""
    columns = [c for c in COLUMNS if any(k == c.key for k, _ in cells)]
    models = [m for m in all_rows() if any(n == m for _, n in cells)]
    notes: dict[str, int] = {}
    lines = ["| model | " + " | ".join(c.label for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in models:
        row = [name]
        for column in columns:
            cell = cells[(column.key, name)]
            if cell.status == "pass":
                row.append(f"✔ {cell.max_diff:.0e}" if numbers else "✔")
            else:
                number = notes.setdefault(_note_text(cell), len(notes) + 1)
                row.append(f"{_symbol(cell)} [{number}](#note-{number})")
        lines.append("| " + " | ".join(row) + " |")
    totals = _totals(cells)
    lines += ["", f"Totals: {totals['pass']} ✔, {totals['refused']} refused, {totals['ignored']} ignored, "
              f"{totals['fail']} ✗ ({len(cells)} cells).", ""]
    for text, number in notes.items():
        lines.append(f"<a id=\"note-{number}\"></a>{number}. {text}")
    return "\n".join(lines) + "\n"


def _note_text(cell: Cell) -> str:
    detail = " ".join(cell.detail.split())
    prefix = {"refused": "refused: ", "ignored": "ignored: ", "fail": "✗ "}[cell.status]
    return prefix + detail[:400] + ("…" if len(detail) > 400 else "")


def _totals(cells: dict) -> dict[str, int]:
    totals = {"pass": 0, "refused": 0, "ignored": 0, "fail": 0}
    for cell in cells.values():
        totals[cell.status] += 1
    return totals


PAGE_HEAD = """# Models: the conformance matrix

Generated by `make conformance` (`python -m atorch.testing.conformance --write docs/models.md`);
never edit by hand. Each cell trains a tiny random-weight model of that family for {steps} steps
(global batch {batch}, SGD with momentum) on gloo CPU processes and compares the losses and the
final weights with single-process PyTorch on the same data: ✔ with the largest relative
difference, *refused* when atorch declines the combination with a typed error (the reason is in
the notes), *ignored* when the method does not apply on the machine that generated the page (CPU:
fp8 needs a recent GPU) and the run trained without it, ✗ when it fails. Tolerances: data parallel and
single-process fp32 methods 1e-5, model parallel fp32 1e-4, bf16 2e-2. The models are built in
`atorch/testing/hf_models.py` (HF families, plain
models) and `atorch/testing/community_models.py` (transformers written as PyTorch's, torchtitan's,
timm's, nanoGPT's and lucidrains' codebases write them, an MoE, an MLP of `up` / `down`); the columns
in `atorch/testing/conformance.py`. The checkpoint, zero2 and fsdp columns name no module: each method
finds the family's layers from its module tree (`"auto"`, [methods.md](methods.md#checkpoint)); the fsdp +
amp column names the family's layer class. The CNN's BatchNorm normalises each forward's batch, so its
reference runs the per-process shards apart; its running statistics are not compared. Rows
`<family>@meta` run the family built on the meta device, its initial weights streamed in with
`atorch.load_pretrained` ([large-models.md](large-models.md)), against the same reference.

"""


# --- how much of each model tensor_parallel splits ------------------------------------------------
def megatron_share(model: torch.nn.Module) -> float:
    """The share of the parameters a Megatron-style scheme splits: every Linear inside the repeated
    blocks (attention projections, MLPs, experts; GPT-2's Conv1D and a MultiheadAttention's packed
    projection too), experts whose weights are stacked in 3-D parameters (transformers' MoE banks) and
    the largest embedding with the head projecting to its vocabulary. Counted from module types and
    shapes, not from atorch's plan, so the two can be compared."""
    classes = set(repeated_blocks(model)[0])
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    inner = {id(p) for b in blocks for m in b.modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.MultiheadAttention)) or type(m).__name__ == "Conv1D"
             or _stacked_experts(m)
             for p in m.parameters()}
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if embeddings:
        vocab = max(embeddings, key=lambda m: m.num_embeddings)
        inner |= {id(vocab.weight)}
        inner |= {id(m.weight) for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m.out_features == vocab.num_embeddings
                  and id(m.weight) not in inner}
    return _numel_share(model, inner)


def _stacked_experts(module: torch.nn.Module) -> bool:
    """Own parameters 3-D weights (and 2-D biases, gpt-oss's) with one leading size above 1: a bank of
    experts' weights."""
    params = [p for _, p in module.named_parameters(recurse=False)]
    return (bool(params) and all(p.dim() in (2, 3) for p in params) and any(p.dim() == 3 for p in params)
            and len({p.shape[0] for p in params}) == 1 and params[0].shape[0] > 1)


def _numel_share(model: torch.nn.Module, ids: set[int]) -> float:
    sizes = {id(p): p.numel() for p in model.parameters()}
    return sum(n for i, n in sizes.items() if i in ids) / max(1, sum(sizes.values()))


def tensor_plan_share(name: str, tp: int = 2) -> tuple[float, float, str]:
    """(atorch's split share, the Megatron-style share, how the plan was found) for one zoo model,
    from the plan tensor_parallel finds on one sample row (no process group needed)."""
    zoo = zoo_model(name)
    torch.manual_seed(0)
    model = zoo.build()
    batch = torch.utils.data.default_collate([zoo.make_dataset(2, 0)[0]])
    megatron = megatron_share(model)
    split_mha(model)
    flow = record_dataflow(model, lambda m: call_with_batch(m, batch, zoo.input_format))
    plan = find_tp_plan(model, tp, flow)
    return split_share(model, plan), megatron, plan.found_by


def share_table(models: Optional[list[str]] = None) -> str:
    rows = ["| model | atorch splits | Megatron-style splits | ratio |", "|---|---|---|---|"]
    for name in models or [m for m, z in ZOO.items() if z.transformer]:
        ours, megatron, _ = tensor_plan_share(name)
        rows.append(f"| {name} | {ours:.1%} | {megatron:.1%} | {ours / megatron:.2f} |")
    return "\n".join(rows) + "\n"


SHARE_HEAD = """
## How much tensor_parallel splits

The share of each transformer's parameters that tensor_parallel's plan splits (found from the traced
forward of one sample row: column / row / vocabulary / per-head / by expert), beside what a
Megatron-style scheme splits (every Linear inside the repeated blocks, experts stacked in 3-D
parameters, the token embedding and the LM head; `conformance.megatron_share`). A ratio of 1 or
more: the plan splits all of it.

"""


def page(cells: dict) -> str:
    return PAGE_HEAD.format(steps=STEPS, batch=GLOBAL_BATCH) + render(cells) + SHARE_HEAD + share_table()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--columns", nargs="*", choices=[c.key for c in COLUMNS], metavar="COLUMN",
                        help=f"subset of {[c.key for c in COLUMNS]}")
    parser.add_argument("--models", nargs="*", choices=all_rows() + list(MORE_FAMILIES) + list(FAMILY_MODELS),
                        metavar="MODEL", help=f"subset of {all_rows()}, or of transformers' further families "
                        f"{list(MORE_FAMILIES)}, or 'family:<model_type>' of atorch.testing.family_configs (tensor "
                        "parallel columns: tp2, tp2_sp)")
    parser.add_argument("--write", help="write the page (e.g. docs/models.md); only with the whole matrix")
    parser.add_argument("--json", help="also write the cells as JSON")
    args = parser.parse_args(argv)
    cells = run_matrix(args.columns, args.models)
    print(render(cells))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({f"{c}|{m}": vars(cell) for (c, m), cell in cells.items()}, handle, indent=1)
    if args.write:
        if args.columns or args.models:
            parser.error("--write needs the whole matrix (no --columns / --models)")
        with open(args.write, "w") as handle:
            handle.write(page(cells))
    return 1 if _totals(cells)["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
