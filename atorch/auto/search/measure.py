"""What the search measures: the machine, one rank training alone, and the on-disk profile cache.

The search does not guess activation memory or compute time from first principles: it measures one
rank training alone (no communication) for each precision / checkpoint setting it needs, at the
per-rank batch, and the formulas in ``cost.py`` scale those numbers to each candidate. Measuring
lives here, apart from the formulas, so the model of a candidate can be read (and tested) without
running anything, and so every number the model consumes has one producer.

Every measurement is agreed across ranks (``atorch.distributed.agreement``) before it is used: the
ranks must predict the same numbers, or they would rank candidates differently and then disagree on
which one to dry-run next.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from atorch.auto.apply import apply_strategy
from atorch.auto.dryrun import DryRunResult, dry_run
from atorch.auto.model_context import ModelContext
from atorch.auto.search.analyser import ModelProfile
from atorch.auto.strategy import Strategy
from atorch.distributed.agreement import (
    is_multi_rank, max_over_ranks, min_over_ranks, world_size,
)
from atorch.utils.memory import state_bytes

logger = logging.getLogger(__name__)

Setting = tuple  # (precision, checkpoint): what changes a rank's own memory and compute


@dataclass
class VariantProfile:
    """One rank training alone under one precision / checkpoint setting."""

    precision: str
    checkpoint: bool
    batch: int
    peak_bytes: int = 0          # at ``batch``
    step_time_s: float = 0.0
    params: int = 0
    grads: int = 0
    optim_state: int = 0
    error: Optional[str] = None


@dataclass
class HardwareProfile:
    device: str
    memory_limit: int
    bandwidth_bytes_per_s: float  # all-reduce algorithm bandwidth over the data-parallel ranks
    latency_s: float = 0.0        # one small all-reduce


# --- one rank alone ----------------------------------------------------------------------------------
def measure_variant(run: Callable[[int], tuple], setting: Setting, batch: int) -> VariantProfile:
    """``run(batch) -> (DryRunResult, state bytes)`` trains alone at the per-rank batch (see
    ``train_alone``); a failure is kept in the profile so every candidate using it is reported failed."""
    variant = VariantProfile(setting[0], setting[1], batch)
    result, state = run(batch)
    if not result.ok:
        variant.error = result.error
        return variant
    variant.peak_bytes, variant.step_time_s = result.peak_memory_bytes, result.step_time_s
    variant.params, variant.grads, variant.optim_state = state["params"], state["grads"], state["optim_state"]
    return variant


def train_alone(ctx: ModelContext, strategy: Strategy, steps: int) -> tuple[DryRunResult, Optional[dict]]:
    """Apply ``strategy`` to a local context (no process group) and train ``steps`` steps, the first
    a warm-up; returns the agreed dry run and the agreed state bytes (parameters, gradients,
    optimizer state) that the cost formulas subtract and scale."""
    result = dry_run(ctx, warmup_steps=1, timed_steps=max(steps - 1, 1), setup=lambda: apply_strategy(ctx, strategy))
    state = None
    if result.ok:  # the steps cleared the gradients: count them as the trainable bytes they fill
        state = state_bytes(ctx.model, ctx.raw_optim)
        state["grads"] = sum(p.numel() * p.element_size() for p in ctx.model.parameters() if p.requires_grad)
    return result, _agree_state(state)


def _agree_state(state: Optional[dict]) -> Optional[dict]:
    """The largest rank's bytes (the dry run was agreed, so ``state`` is None on all ranks or none)."""
    if state is None:
        return None
    keys = ["params", "grads", "optim_state"]
    return {k: int(v) for k, v in zip(keys, max_over_ranks([state[k] for k in keys]))}


# --- the machine -------------------------------------------------------------------------------------
def measure_hardware(device: torch.device, memory_limit: Optional[int]) -> HardwareProfile:
    """The per-rank memory limit and the all-reduce bandwidth and latency over all ranks (the slowest
    rank's: a collective runs at its pace)."""
    limit = memory_limit if memory_limit is not None else default_memory_limit(device)
    bandwidth, latency = float("inf"), 0.0
    if is_multi_rank():
        latency = _seconds_per_all_reduce(torch.zeros(1, device=device), calls=10)
        buffer = torch.zeros(2**21, device=device)  # 8 MiB
        bandwidth = buffer.numel() * buffer.element_size() / _seconds_per_all_reduce(buffer, calls=3)
        bandwidth, neg_latency = min_over_ranks([bandwidth, -latency])
        latency = -neg_latency
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return HardwareProfile(name, int(limit), bandwidth, latency)


def _seconds_per_all_reduce(buffer: torch.Tensor, calls: int) -> float:
    """Mean seconds of ``calls`` all-reduces of ``buffer`` after one warm-up call (the first sets up
    the communicator). These all-reduces are the measurement itself, not an agreement between ranks
    (that is ``min_over_ranks`` above)."""
    dist.all_reduce(buffer)
    _sync(buffer.device)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(buffer)
    _sync(buffer.device)
    return (time.perf_counter() - start) / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_memory_limit(device: torch.device) -> int:
    """A rank's share of the device: the GPU's memory, or the available RAM over the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 * 2**30
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    return int(available // max(local_ranks, 1))


# --- the on-disk cache -------------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("ATORCH_CACHE_DIR", Path.home() / ".cache" / "atorch")) / "profiles"


def cache_key(profile: ModelProfile, hardware: HardwareProfile, batch: int, setting: Setting) -> str:
    """Everything a single-rank profile depends on: the model's structure, the device, the world size
    (the per-rank batch follows from it), the batch, the setting and the torch version."""
    precision, checkpoint = setting
    key = (f"{profile.signature}-{hardware.device}-{world_size()}-{batch}-{precision}-{int(checkpoint)}-"
           f"{torch.__version__}")
    return key.replace(" ", "_").replace("/", "_")


def load_cached(key: str) -> Optional[VariantProfile]:
    path = cache_dir() / f"{key}.json"
    if not path.exists():
        return None
    try:
        return VariantProfile(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None


def store_cached(key: str, variant: VariantProfile) -> None:
    if variant.error:
        return
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        (cache_dir() / f"{key}.json").write_text(json.dumps(asdict(variant)))
    except OSError as error:  # a read-only home is not a reason to fail the search
        logger.info("profile cache not written: %s", error)
