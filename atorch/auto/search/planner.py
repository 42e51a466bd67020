"""The fully automatic search: analyse → candidates → measure alone → estimate → prune → dry-run
the most promising within the time limit → pick the fastest measured strategy that fits.

Every rank runs the same loop on the same numbers (measurements are agreed with all-reduces and
time-limit decisions are broadcast from rank 0), so every rank ends with the same strategy. A
candidate that fails on any rank — while being applied or while training — is marked failed on
every rank and the loop goes on.
"""
from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from atorch.auto import opt_lib
from atorch.auto.apply import apply_strategy, resolve_strategy
from atorch.auto.dryrun import DryRunResult, dry_run
from atorch.auto.search.analyser import ModelProfile, analyse_model
from atorch.auto.search.candidates import Candidate, SearchSpace, enumerate_candidates, refinements
from atorch.auto.search.cost import estimate
from atorch.auto.search.measure import (
    HardwareProfile, VariantProfile, cache_key, load_cached, measure_hardware, measure_variant, store_cached,
    train_alone,
)
from atorch.auto.search.options import SearchOptions
from atorch.auto.search.report import Row, format_table, write_report
from atorch.auto.search.layouts import layout_facts
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.distributed.agreement import all_ranks_true, broadcast_flag, is_main_rank, world_size
from atorch.utils.batch import first_tensor, loss_value

logger = logging.getLogger("atorch")

ContextFactory = Callable[..., Any]  # (model, local=False, batch_size=None) -> ModelContext


@dataclass
class SearchResult:
    strategy: Optional[Strategy]
    candidate: Optional[Candidate]
    rows: list[Row]
    profile: ModelProfile
    hardware: HardwareProfile
    dryrun: Optional[DryRunResult] = None
    report_files: list = field(default_factory=list)
    table: str = ""
    phase_seconds: dict = field(default_factory=dict)  # where the search's time went


class _Phases:
    """Wall time per search phase, so a user (and the benchmark) can see where the time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def search(model: torch.nn.Module, make_context: ContextFactory, options: SearchOptions) -> SearchResult:
    started = time.perf_counter()
    phases = _Phases()
    world = world_size()
    probe = make_context(model, local=True)
    per_rank_batch = probe.dataloader_args.get("batch_size", 1) // world
    device = probe.device
    profile = _analyse(model, probe, per_rank_batch, world)
    space = SearchSpace(world, device, profile, options.excluded, options.included, per_rank_batch)
    candidates, skipped = enumerate_candidates(space)
    _say(options, f"search: {len(candidates)} candidate strategies for {world} rank(s); "
                  f"model {profile.param_count / 1e6:.2f} M parameters, repeated block {profile.main_block}")
    hardware = measure_hardware(device, options.memory_limit)
    phases.mark("analyse")
    variants = _measure_variants(model, make_context, candidates, per_rank_batch, profile, hardware, options)
    phases.mark("measure alone")
    rows, order = _estimate_all(candidates, variants, world, profile, hardware)
    chosen, dryrun = _dry_run_best(model, make_context, candidates, rows, order, hardware, options, started, world)
    phases.mark("dry-run")
    if chosen is not None and options.refine:
        chosen, dryrun = _refine(model, make_context, space, candidates, rows, chosen, dryrun, variants, hardware,
                                 options, started, world)
    phases.mark("refine")
    table = format_table(rows, hardware.memory_limit)
    table += "\nsearch time: " + ", ".join(f"{name} {s:.1f} s" for name, s in phases.seconds.items())
    _say(options, "search report:\n" + table)
    files = []
    if options.report_dir and is_main_rank():
        files = write_report(rows, hardware.memory_limit, options.report_dir)
    strategy = candidates[chosen].strategy(world) if chosen is not None else None
    return SearchResult(strategy, candidates[chosen] if chosen is not None else None, rows, profile, hardware,
                        dryrun, files, table, phases.seconds)


def _analyse(model, probe, per_rank_batch: int, world: int) -> ModelProfile:

    sample = None
    if probe.dataset is not None:
        loader = torch.utils.data.DataLoader(probe.dataset, batch_size=max(per_rank_batch, 1))
        sample = next(iter(loader), None)

    def run_model(call, batch):
        return loss_value(probe.loss_func(batch, probe.call_model(call, batch)))

    profile = analyse_model(model, sample, run_model if probe.loss_func is not None else None)
    first = first_tensor(sample)
    if first is not None and first.dim() > 1:
        profile.tokens_per_sample = first[0].numel()
    if world > 1:
        profile.layouts = layout_facts(model, world)
    return profile


# --- measuring alone -------------------------------------------------------------------------------
def _measure_variants(model, make_context, candidates, batch, profile, hardware, options) -> dict:
    variants: dict[tuple, VariantProfile] = {}
    for precision, checkpoint in sorted({(c.precision, c.checkpoint) for c in candidates}):
        key = cache_key(profile, hardware, batch, (precision, checkpoint))
        cached = load_cached(key) if options.use_cache else None
        if all_ranks_true(cached is not None):
            variants[(precision, checkpoint)] = cached
            continue
        candidate = next(c for c in candidates if (c.precision, c.checkpoint) == (precision, checkpoint))
        items = [i for i in candidate.strategy(1) if i.name in ("amp_native", "half", "checkpoint")]
        _say(options, f"search: measuring one rank alone with {'+'.join(i.name for i in items) or 'fp32'} at batch {batch}")

        def run(b: int, items=items):
            return _run_alone(model, make_context, items, b, options.dryrun_steps)

        variant = measure_variant(run, (precision, checkpoint), batch)
        variants[(precision, checkpoint)] = variant
        if is_main_rank():
            store_cached(key, variant)
    return variants


def _run_alone(model, make_context, items, batch: int, steps: int):

    ctx = make_context(copy.deepcopy(model), local=True, batch_size=batch)
    try:
        return train_alone(ctx, _normalized(items), steps)
    finally:
        del ctx
        gc.collect()


def _normalized(items: list) -> Strategy:
    return Strategy([StrategyItem(i.name, opt_lib.get_optimization(i.name).normalize(i.config), i.tunable) for i in items])


# --- estimating and dry-running ----------------------------------------------------------------------
def _estimate_all(candidates, variants, world, profile, hardware) -> tuple[list[Row], list[int]]:
    rows = []
    for candidate in candidates:
        variant = variants[(candidate.precision, candidate.checkpoint)]
        if variant.error:
            rows.append(Row(candidate.label, 0, float("inf"), "failed", reason=f"alone: {variant.error}"))
            continue
        guess = estimate(candidate, variant, world, profile, hardware)
        row = Row(candidate.label, guess.memory_bytes, guess.step_time_s)
        if guess.memory_bytes > hardware.memory_limit:
            row.status = "predicted over limit"
        rows.append(row)
    fitting = [i for i, r in enumerate(rows) if r.status == "not tried"]
    # fastest first; among equals, the strategy with fewer methods
    order = sorted(fitting, key=lambda i: (round(rows[i].predicted_time_s, 4), len(rows[i].label.split("+"))))
    return rows, order


def _dry_run_best(model, make_context, candidates, rows, order, hardware, options, started, world):
    tried, best, best_result = 0, None, None
    for position, index in enumerate(order):
        row = rows[index]
        out_of_time = options.time_limit is not None and time.perf_counter() - started > options.time_limit
        if broadcast_flag(out_of_time):
            row.status = "skipped: time limit"
            continue
        successes = sum(r.status == "ok" for r in rows)
        if tried >= options.topk and successes and not options.exhaustive:
            row.status = "not tried"
            row.reason = "below the top-k by prediction"
            continue
        tried += 1
        result = _dry_run_candidate(model, make_context, candidates[index], world, options.dryrun_steps)
        _record(row, result, hardware)
        _say(options, f"search [{position + 1}/{len(order)}] {row.label}: {row.status}"
                      + (f", {row.measured_time_s * 1000:.1f} ms/step, {row.measured_memory / 2**20:.1f} MiB "
                         f"(predicted {row.predicted_memory / 2**20:.1f} MiB)" if row.status == "ok" else f" ({row.reason})"))
        if row.status == "ok" and (best is None or row.measured_time_s < rows[best].measured_time_s):
            best, best_result = index, result
    best = _confirm_finalists(model, make_context, candidates, rows, options, started, world) if best is not None else None
    if best is not None:
        rows[best].chosen = True
    return best, best_result


CLOSE_CALL = 0.15  # finalists measured within this fraction of each other are measured again
CONFIRM_ROUNDS = 2  # alternating re-measurements of close finalists (3 samples each: a real median)


def _confirm_finalists(model, make_context, candidates, rows, options, started, world, indices=None) -> int:
    """Single dry runs on a busy machine differ by 10-20% from noise alone: when the two fastest are
    that close, measure both again ``CONFIRM_ROUNDS`` times in alternating order and compare medians."""
    ok = sorted((i for i in (indices if indices is not None else range(len(rows))) if rows[i].status == "ok"),
                key=lambda i: rows[i].measured_time_s)
    if len(ok) < 2:
        return ok[0] if ok else None
    first, second = ok[0], ok[1]
    if rows[second].measured_time_s > rows[first].measured_time_s * (1 + CLOSE_CALL):
        return first
    rounds = [(second, first) if r % 2 == 0 else (first, second) for r in range(CONFIRM_ROUNDS)]
    for index in (i for pair in rounds for i in pair):
        if broadcast_flag(options.time_limit is not None and time.perf_counter() - started > options.time_limit):
            break
        result = _dry_run_candidate(model, make_context, candidates[index], world, options.dryrun_steps)
        if result.ok:
            rows[index].samples.append(result.step_time_s)
            rows[index].measured_time_s = statistics.median(rows[index].samples)
    return min((first, second), key=lambda i: rows[i].measured_time_s)


def _refine(model, make_context, space, candidates, rows, chosen, dryrun, variants, hardware, options, started, world):
    """Try the winner with each compute method; keep one only when it measures faster."""
    for candidate in refinements(space, candidates[chosen]):
        if broadcast_flag(options.time_limit is not None and time.perf_counter() - started > options.time_limit):
            break
        variant = variants[(candidate.precision, candidate.checkpoint)]
        guess = estimate(candidate, variant, world, space.profile, hardware)
        row = Row(candidate.label, guess.memory_bytes, guess.step_time_s)
        rows.append(row)
        candidates.append(candidate)
        result = _dry_run_candidate(model, make_context, candidate, world, options.dryrun_steps)
        _record(row, result, hardware)
        _say(options, f"search refine {row.label}: {row.status}"
                      + (f", {row.measured_time_s * 1000:.1f} ms/step" if row.status == "ok" else f" ({row.reason})"))
        if row.status != "ok":
            continue
        winner = _confirm_finalists(model, make_context, candidates, rows, options, started, world,
                                    indices=[chosen, len(candidates) - 1])
        if winner != chosen:
            rows[chosen].chosen = False
            row.chosen = True
            chosen, dryrun = winner, result
    return chosen, dryrun


def _record(row: Row, result: DryRunResult, hardware: HardwareProfile) -> None:
    if not result.ok:
        row.status, row.reason = "failed", result.error or ""
        return
    row.measured_memory, row.measured_time_s = result.peak_memory_bytes, result.step_time_s
    row.samples.append(result.step_time_s)
    if result.peak_memory_bytes > hardware.memory_limit:
        row.status = "over memory limit"
    else:
        row.status = "ok"


def _dry_run_candidate(model, make_context, candidate: Candidate, world: int, steps: int) -> DryRunResult:
    ctx, error = None, None
    try:
        ctx = make_context(copy.deepcopy(model))
        apply_strategy(ctx, resolve_strategy(candidate.strategy(world)))
    except Exception as exc:  # agreed below: no rank goes on to train alone
        error = f"{type(exc).__name__}: {exc}"
        logger.info("search: %s failed to apply on this rank: %s", candidate.label, error)
    try:
        if not all_ranks_true(error is None):
            return DryRunResult(False, error=error or "failed on another rank")
        return dry_run(ctx, warmup_steps=1, timed_steps=steps)
    finally:
        del ctx
        gc.collect()


# --- progress ------------------------------------------------------------------------------------------
def _say(options: SearchOptions, message: str) -> None:
    if is_main_rank():
        logger.info(message)
