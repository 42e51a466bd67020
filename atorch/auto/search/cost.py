"""Measured single-rank profiles and the cost model built on them.

The search does not guess activation memory or compute time from first principles: it measures
one rank training alone (no communication) for each precision / checkpoint setting it needs, at the
per-rank batch, and models each candidate from that:

    memory(candidate) = peak_alone(precision, checkpoint, batch)
                        - what the sharding removes from the rank   (params / grads / optimizer state)
                        + what the sharding adds while it works     (gathered units, comm buffers)
    time(candidate)   = step_time_alone + communication bytes / measured bandwidth

Parameters, gradients and optimizer state are measured too (``state_bytes`` after a step), so the
optimizer's state coefficient (AutoDist's ``opt_resident_coef``) is observed, not assumed.
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

from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.candidates import Candidate
from atorch.auto.search.layouts import estimate_layout_memory, estimate_layout_time

logger = logging.getLogger(__name__)


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


@dataclass
class Estimate:
    memory_bytes: int
    step_time_s: float
    detail: str = ""


def estimate(candidate: Candidate, variant: VariantProfile, world: int, profile: ModelProfile,
             hardware: HardwareProfile) -> Estimate:
    """Per-rank peak memory and step time of ``candidate`` from the single-rank measurements.

    With P, G, O the parameter, gradient and optimizer-state bytes measured alone and
    ``act = peak_alone - (P + G + O)`` (activations, temporaries, autocast's weight copies):

    - ddp:   peak_alone + G                 (DDP's gradient buckets)
    - zero1: peak_alone + G - (1 - 1/N) O   (DDP buckets; optimizer state sharded)
    - zero2: P/N + P_c + G_c + G/N + O/N + act'   (parameters stay gathered in the compute dtype
             through forward and backward; unsharded gradients until they are reduce-scattered)
    - fsdp:  P/N + 3 U_c + G/N + O/N + act'       (a gathered unit, the prefetched next one and the
             unit's unsharded gradients)

    ``_c`` is in the compute dtype (half of fp32 under amp: FSDP's mixed-precision policy gathers in
    it), U the largest sharding unit, and act' = act less autocast's weight copies, which FSDP's
    policy makes unnecessary (they exist only without checkpointing).
    """
    if candidate.tensor * candidate.pipeline > 1:
        return _estimate_layout(candidate, variant, world, profile, hardware)
    n = max(world, 1)
    P, G, O = variant.params, variant.grads, variant.optim_state
    amp = candidate.precision.startswith("amp")
    compute = 0.5 if amp else 1.0
    act = variant.peak_bytes - (P + G + O)
    unit = _largest_unit_bytes(profile, P)
    memory, comm, collectives = float(variant.peak_bytes), 0.0, 0
    units = sum(list(profile.repeated_blocks.values())[:1]) + 1
    if n > 1:
        shed = 1.0 - 1.0 / n
        if candidate.sharding == "ddp":
            memory, comm, collectives = variant.peak_bytes + G, 2 * shed * G, 1
        elif candidate.sharding == "zero1":
            memory, comm, collectives = variant.peak_bytes + G - shed * O, 2 * shed * G + shed * P, 2
        else:
            act_sharded = act - (0.5 * P if amp and not candidate.checkpoint else 0.0)
            if candidate.sharding == "zero2":
                memory = P / n + compute * (P + G) + (G + O) / n + act_sharded
                comm, collectives = shed * (G + P), 2 * units
            else:  # fsdp
                memory = P / n + 3 * compute * unit + (G + O) / n + act_sharded
                comm, collectives = shed * (G + 2 * P), 3 * units
    time_s = (variant.step_time_s + comm / max(hardware.bandwidth_bytes_per_s, 1.0)
              + collectives * hardware.latency_s)
    detail = f"alone {variant.peak_bytes / 2**20:.1f} MiB, P/G/O {P / 2**20:.1f}/{G / 2**20:.1f}/{O / 2**20:.1f} MiB"
    return Estimate(int(memory), time_s, detail)


def _estimate_layout(candidate: Candidate, variant: VariantProfile, world: int, profile: ModelProfile,
                     hardware: HardwareProfile) -> Estimate:
    """Tensor / pipeline layouts: the rank's share of the model, modelled in ``layouts.py``."""
    facts, t, p = profile.layouts, candidate.tensor, candidate.pipeline
    data = candidate.data_size(world)
    state = variant.params + variant.grads + variant.optim_state
    batch = variant.batch * t * p  # per data rank
    memory = estimate_layout_memory(state, variant.peak_bytes - state, variant.grads, variant.optim_state, facts,
                                    t, p, data, candidate.sharding, batch)
    dtype_bytes = 2 if candidate.precision != "fp32" else 4
    time_s = estimate_layout_time(variant.step_time_s, variant.grads, facts, t, p, data, batch,
                                  profile.tokens_per_sample, dtype_bytes, hardware.bandwidth_bytes_per_s,
                                  hardware.latency_s)
    detail = f"rank holds {facts.state_share[(t, p)]:.0%} of the model; data size {data}"
    return Estimate(int(memory), time_s, detail)


def _largest_unit_bytes(profile: ModelProfile, params_bytes: int) -> float:
    """Bytes of the largest FSDP unit (a repeated block, or the root's remainder), in the measured
    parameter dtype."""
    if not profile.block_param_bytes:
        return float(params_bytes)
    scale = params_bytes / max(profile.param_bytes, 1)
    name, count = next(iter(profile.repeated_blocks.items()))
    block = profile.block_param_bytes[name]
    root = profile.param_bytes - block * count  # embeddings, head, final norm
    return max(block, root) * scale


# --- measuring -----------------------------------------------------------------------------------
def measure_variant(run: Callable[[int], tuple], precision: str, checkpoint: bool, batch: int) -> VariantProfile:
    """``run(batch) -> (DryRunResult, state_bytes)`` trains alone at the per-rank batch."""
    variant = VariantProfile(precision, checkpoint, batch)
    result, state = run(batch)
    if not result.ok:
        variant.error = result.error
        return variant
    variant.peak_bytes, variant.step_time_s = result.peak_memory_bytes, result.step_time_s
    variant.params, variant.grads, variant.optim_state = state["params"], state["grads"], state["optim_state"]
    return variant


def measure_hardware(device: torch.device, memory_limit: Optional[int], group=None) -> HardwareProfile:
    limit = memory_limit if memory_limit is not None else default_memory_limit(device)
    bandwidth, latency = float("inf"), 0.0
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        latency = _timed_all_reduce(torch.zeros(1, device=device), group, repeats=10)
        buffer = torch.zeros(2**21, device=device)  # 8 MiB
        dist.all_reduce(buffer, group=group)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        bandwidth = 3 * buffer.numel() * buffer.element_size() / (time.perf_counter() - start)
        agreed = torch.tensor([bandwidth, -latency], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        bandwidth, latency = float(agreed[0].item()), -float(agreed[1].item())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return HardwareProfile(name, int(limit), bandwidth, latency)


def _timed_all_reduce(buffer: torch.Tensor, group, repeats: int) -> float:
    dist.all_reduce(buffer, group=group)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer, group=group)
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)
    return (time.perf_counter() - start) / repeats


def default_memory_limit(device: torch.device) -> int:
    """A rank's share of the device: the GPU's memory, or the available RAM over the local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 * 2**30
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return int(available // max(local_ranks, 1))


# --- the on-disk cache ---------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("ATORCH_CACHE_DIR", Path.home() / ".cache" / "atorch")) / "profiles"


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
