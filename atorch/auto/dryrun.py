"""A few real training steps of an applied strategy: step time and peak memory, agreed by all ranks."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from atorch.errors import InputError
from atorch.auto.model_context import ModelContext
from atorch.distributed.agreement import max_over_ranks
from atorch.utils.batch import loss_value
from atorch.utils.memory import PeakMemoryTracker

logger = logging.getLogger(__name__)

# Timed steps of a dry run, after one warm-up step, in both modes (semi-automatic ``dryrun_steps``
# and each candidate of the search): one step alone is dominated by allocator and autograd warm-up
# noise; three keep a candidate's dry run cheap while averaging out most of it.
DEFAULT_DRYRUN_STEPS = 3


@dataclass
class DryRunResult:
    ok: bool
    step_time_s: Optional[float] = None   # mean of the timed steps, max over ranks
    peak_memory_bytes: Optional[int] = None  # max over ranks
    error: Optional[str] = None

    def __str__(self) -> str:
        if not self.ok:
            return f"dry run failed: {self.error}"
        return f"dry run: {self.step_time_s * 1000:.1f} ms/step, peak memory {self.peak_memory_bytes / 2**20:.1f} MiB/rank"


def train_step(ctx: ModelContext, batch) -> torch.Tensor:
    """One step exactly as the seed's user loop drives the returned objects."""
    data = ctx.prepare_input(batch)
    output = ctx.call_model(ctx.model, data)
    loss = loss_value(ctx.loss_func(data, output))
    if ctx.args.use_optim_backward:
        ctx.optim.backward(loss)
    else:
        loss.backward()
    ctx.optim.step()
    ctx.optim.zero_grad()
    return loss.detach()


def dry_run(ctx: ModelContext, warmup_steps: int = 1, timed_steps: int = DEFAULT_DRYRUN_STEPS) -> DryRunResult:
    """Run warmup + timed steps on an applied context; failures on any rank fail every rank."""
    if ctx.dataloader is None or ctx.optim is None:
        raise InputError("a dry run needs dataset, loss_func and optim_func")
    error: Optional[str] = None
    elapsed, peak = 0.0, 0
    try:
        batches = iter(ctx.dataloader)
        with PeakMemoryTracker(ctx.device, roots=[ctx.model, ctx.raw_optim]) as tracker:
            for step in range(warmup_steps + timed_steps):
                batch = next(batches)
                _sync(ctx.device)
                start = time.perf_counter()
                train_step(ctx, batch)
                _sync(ctx.device)
                if step >= warmup_steps:
                    elapsed += time.perf_counter() - start
        peak = tracker.stats.peak_bytes
    except StopIteration:
        error = f"the dataset has fewer than {warmup_steps + timed_steps} batches for the dry run"
    except Exception as exc:  # reported, and agreed across ranks below
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("dry run failed on this rank")
    return _agree(ctx, error, elapsed / max(timed_steps, 1), peak)


def _agree(ctx: ModelContext, error: Optional[str], step_time: float, peak: int) -> DryRunResult:
    failed, step_time, peak = max_over_ranks([float(error is not None), step_time, float(peak)])
    failed, peak = bool(failed), int(peak)
    if failed and error is None:
        error = "failed on another rank"
    if failed:
        return DryRunResult(False, error=error)
    return DryRunResult(True, step_time, peak)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
