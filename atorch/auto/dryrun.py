"""A few real training steps of an applied strategy: step time and peak memory, agreed by all ranks.

The steps (and the strategy's application, when given as ``setup``) run under
``atorch.distributed.fault.run_isolated``: a step that raises on any one rank, at any point, fails
the dry run on every rank within seconds and leaves a usable process group behind.
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
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.distributed.agreement import is_multi_rank, max_over_ranks
from atorch.distributed.fault import run_here, run_isolated
from atorch.distributed.timeouts import DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S
from atorch.errors import InputError
from atorch.utils.batch import loss_value
from atorch.utils.memory import PeakMemoryTracker
from atorch.utils.meta_init import meta_copy

logger = logging.getLogger(__name__)

# Timed steps of a dry run, after one warm-up step, in both modes (semi-automatic ``dryrun_steps``
# and each candidate of the search): one step alone is dominated by allocator and autograd warm-up
# noise; three keep a candidate's dry run cheap while averaging out most of it.
DEFAULT_DRYRUN_STEPS = 3


@dataclass
class DryRunResult:
    ok: bool
    step_time_s: Optional[float] = None   # median of the timed steps (robust to one slow step), max over ranks
    peak_memory_bytes: Optional[int] = None  # max over ranks
    error: Optional[str] = None
    step_time_spread_s: Optional[float] = None  # standard deviation of the timed steps, max over ranks (noise)
    # the timed steps' peak up to the end of backward, before the optimizer step (max over ranks): the
    # activations' peak, which the overall peak hides when the optimizer step's temporaries top it
    forward_backward_peak_bytes: Optional[int] = None
    forward_saved_bytes: Optional[int] = None  # what the forward left alive for backward (max over ranks)
    # the optimizer step's part of ``step_time_s`` (median of the timed steps, max over ranks): what sharding
    # the optimizer state takes off a rank, which the cost model does not scale with the batch or the bubble
    optimizer_step_time_s: Optional[float] = None
    extras: dict = field(default_factory=dict)  # the applied context's ``args.extras`` (what methods reported)

    def __str__(self) -> str:
        if not self.ok:
            return f"dry run failed: {self.error}"
        return (f"dry run: {self.step_time_s * 1000:.1f} ms/step, "
                f"peak memory {self.peak_memory_bytes / 2**20:.1f} MiB/rank")


def train_step(ctx: ModelContext, batch) -> torch.Tensor:
    """One step exactly as the user's loop drives the returned objects."""
    loss = forward_backward(ctx, batch)
    optimizer_step(ctx)
    return loss


def forward_backward(ctx: ModelContext, batch, after_forward: Optional[Callable[[], None]] = None) -> torch.Tensor:
    data = ctx.prepare_input(batch)
    output = ctx.call_model(ctx.model, data)
    loss = loss_value(ctx.loss_func(data, output))
    if after_forward is not None:
        after_forward()
    if ctx.args.use_optim_backward:
        ctx.optim.backward(loss)
    else:
        loss.backward()
    return loss.detach()


def optimizer_step(ctx: ModelContext) -> None:
    ctx.optim.step()
    ctx.optim.zero_grad()


def dry_run(ctx: ModelContext, warmup_steps: int = 1, timed_steps: int = DEFAULT_DRYRUN_STEPS,
            setup: Optional[Callable[[], None]] = None,
            collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S, alone: bool = False) -> DryRunResult:
    """``setup()`` (e.g. applying the strategy), then warm-up + timed steps; a failure on any rank
    fails every rank with the first failure's reason. Each collective inside gives up after
    ``collective_timeout_s`` (how long a rank waits for a peer that failed). ``alone``: a context with no
    process group (``local``) run by this rank only, while its peers do other work: no collective at
    all, and the result is this rank's."""
    if ctx.dataset is None or ctx.optim_func is None or ctx.loss_func is None:
        raise InputError("a dry run needs dataset, loss_func and optim_func")

    def work() -> list[float]:
        if setup is not None:
            setup()
        return _timed_steps(ctx, warmup_steps, timed_steps)

    outcome = run_here(work) if alone else run_isolated(work, collective_timeout_s, ctx.release_training_objects)
    if not outcome.ok:
        where = f" (rank {outcome.failed_rank})" if is_multi_rank() and not alone else ""
        return DryRunResult(False, error=f"{outcome.error}{where}")
    values = outcome.value if alone else max_over_ranks(outcome.value)
    step_time, peak, spread, forward_backward_peak, saved, optimizer_time = values
    return DryRunResult(True, step_time, int(peak), step_time_spread_s=spread, extras=dict(ctx.args.extras),
                        forward_backward_peak_bytes=int(forward_backward_peak), forward_saved_bytes=int(saved),
                        optimizer_step_time_s=optimizer_time)


def _timed_steps(ctx: ModelContext, warmup_steps: int, timed_steps: int) -> list[float]:
    """[median seconds per timed step, peak bytes, standard deviation of the timed steps, the steady step's
    peak before its optimizer step, what its forward saved for backward, median seconds of the timed steps'
    optimizer steps] on this rank; raises on any failure.
    The spread is the noise a comparison of two step times must exceed.

    Memory is tracked over the warm-up steps and one steady step after them (the optimizer state then
    exists: every later step peaks as that one does); the timed steps run after it, untracked. On CPU the
    tracker is a ``TorchDispatchMode`` that runs Python for every operator: timed under it, a 4-block GPT's
    step took 165 ms instead of 37, and each layout was charged by its operator count (FSDP's gathers and
    copies, an unfused attention), not by its time. The timed steps run with Python's garbage collector
    held off (collected just before, as ``timeit`` does): a collection landing in one candidate's steps
    and not another's would be charged to that candidate."""
    take = _batch_source(ctx, warmup_steps + 1 + timed_steps)
    after: list[int] = []  # the bytes each tracked step's forward left alive for backward
    with PeakMemoryTracker(ctx.device, roots=[ctx.model, ctx.raw_optim]) as tracker:
        for _ in range(warmup_steps + 1):
            tracker.phase_peak()
            before = tracker.live_bytes()
            forward_backward(ctx, take(), lambda: after.append(tracker.live_bytes() - before))
            steady_forward_backward_peak = tracker.phase_peak()
            optimizer_step(ctx)
    times: list[float] = []
    optimizer_times: list[float] = []
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(timed_steps):
            batch = take()
            _sync(ctx.device)
            start = time.perf_counter()
            forward_backward(ctx, batch)
            _sync(ctx.device)
            optimizer_start = time.perf_counter()
            optimizer_step(ctx)
            _sync(ctx.device)
            end = time.perf_counter()
            times.append(end - start)
            optimizer_times.append(end - optimizer_start)
    finally:
        if collecting:
            gc.enable()
    spread = statistics.stdev(times) if len(times) > 1 else 0.0
    return [statistics.median(times), float(tracker.stats.peak_bytes), spread, float(steady_forward_backward_peak),
            float(after[-1]), statistics.median(optimizer_times)]


def _batch_source(ctx: ModelContext, needed: int) -> Callable[[], Any]:
    """The next batch of the dataloader at each call, starting the dataloader over when an epoch ends: a
    dry run measures time and memory, not learning, so a dataset of fewer batches than its steps (a small
    fine-tuning set) is read again rather than refused. InputError when an epoch gives no batch at all."""
    batches, given_this_epoch = iter(ctx.dataloader), 0

    def take() -> Any:
        nonlocal batches, given_this_epoch
        try:
            batch = next(batches)
        except StopIteration:
            if given_this_epoch == 0:
                raise InputError(f"the dataset gives no batch of {ctx.per_rank_batch_size} per rank; the dry "
                                 f"run needs {needed} (an epoch is read again when it ends)") from None
            batches, given_this_epoch = iter(ctx.dataloader), 0
            batch = next(batches)
        given_this_epoch += 1
        return batch

    return take


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dry_run_copy(model: nn.Module) -> nn.Module:
    """The model a dry run applies its candidate to: a meta copy (``meta_copy``), which the candidate
    materialises shard by shard, so the dry run costs the candidate's memory only; a deep copy where some
    module has no initialiser or its initialiser leaves a tensor unset (HF CLIP's ``logit_scale``; the
    same on every rank: the model is)."""
    copied = meta_copy(model)
    return copied if copied is not None else copy.deepcopy(model)
