"""What the search measures: the machine, one rank training alone, and the on-disk profile cache.

The search does not guess activation memory or compute time from first principles: it measures one
rank training alone (no communication) for each precision / checkpoint setting it needs, at the
per-rank batch (the model cut to one block or two and extrapolated, ``pieces.py``), and the formulas in
``atorch/cost_model.py`` scale those numbers to each candidate. Measuring
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
from dataclasses import asdict, dataclass, field, fields, replace
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
    is_multi_rank,
    max_over_ranks,
    min_over_ranks,
    world_size,
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
    # the peak up to the end of backward (0: not measured, as in profiles cached before it was): what the
    # activations reach, which ``peak_bytes`` hides when the optimizer step's temporaries top it
    forward_backward_peak_bytes: int = 0
    forward_saved_bytes: int = 0  # what the forward left alive for backward: the activations (0: not measured)
    # the repeated blocks' part of ``step_time_s``: their count times one block's time as the pieces measured it
    # (0: the model was measured whole)
    blocks_step_time_s: float = 0.0
    # the optimizer step's part of ``step_time_s`` (0: not measured): it scales with the parameters a rank
    # steps (a sharded optimizer state, a pipeline stage's or tensor shard's share), not with the batch
    optimizer_step_time_s: float = 0.0
    # tensor size -> the whole model's step time under ddp + that tensor split (pipeline 1, the rest data
    # parallel) on every rank, measured by pieces: what the split really costs on these process groups
    tensor_step_times: dict = field(default_factory=dict)
    # sharding ("fsdp") -> the whole model's unsplit step time under it over all ``sharded_world`` ranks (one
    # shard group), measured by pieces on the real process group: what its gathers, reduce-scatters and
    # per-unit work really cost, which the bandwidth formula prices from an all-reduce
    sharded_step_times: dict = field(default_factory=dict)
    sharded_world: int = 0
    # what a tensor split (size -> seconds) or a sharding (name -> seconds, over ``sharded_world`` ranks) adds
    # to a step, carried from another setting's measurement where this one's was not measured: the split's
    # collectives and its layers' own work, which the precision changes little (``carry_split_overheads``)
    tensor_overhead_s: dict = field(default_factory=dict)
    sharded_overhead_s: dict = field(default_factory=dict)
    # the share of a forward + backward pass's time that does not shrink with the batch (each op's own
    # overhead, autocast's weight casts once a forward): measured alone again at a pipeline's micro-batch
    # (``cost_model.fixed_pass_share``) or carried from the same precision without checkpointing (None: not
    # measured: a pass is priced in proportion to its batch, a micro-step at ``MICRO_STEP_OVERHEAD``). A
    # pipeline stage pays it once per micro-batch, micro_batch once per extra micro-step.
    pass_fixed_share: Optional[float] = None


@dataclass
class HardwareProfile:
    device: str
    memory_limit: int
    bandwidth_bytes_per_s: float  # all-reduce bus bandwidth over all ranks (see ``_bandwidth``)
    latency_s: float = 0.0        # one small all-reduce
    intra_node_bandwidth: Optional[float] = None  # all-reduce bytes/s per rank inside a node
    inter_node_bandwidth: Optional[float] = None  # the same between nodes; None: one node (no such link)
    link_sources: dict = field(default_factory=dict)  # "intra_node" / "inter_node" -> "measured" or "given"

    def describe_links(self) -> str:
        """One line for the log and the report: each link's bandwidth and whether it was measured or given
        (a given number is the user's claim, not the machine's, and the reader should know which is which)."""
        parts = [f"{name.replace('_', '-')} {bandwidth / 1e9:.3g} GB/s ({self.link_sources.get(name, 'measured')})"
                 for name, bandwidth in (("intra_node", self.intra_node_bandwidth),
                                         ("inter_node", self.inter_node_bandwidth)) if bandwidth is not None]
        return "links: " + ", ".join(parts) if parts else ""


@dataclass(frozen=True)
class NodeGrid:
    """Nodes x ranks per node as the launcher numbers them (rank = node * ranks_per_node + local rank), and the
    bandwidths the user gave (None: measure it). Plain numbers, so measuring needs nothing from ``topology.py``."""

    nodes: int = 1
    ranks_per_node: int = 1
    given_intra_node: Optional[float] = None
    given_inter_node: Optional[float] = None

    def node_groups(self) -> list[list[int]]:
        """The ranks of each node: the groups whose all-reduce runs on the links inside a node."""
        per = self.ranks_per_node
        return [[node * per + local for local in range(per)] for node in range(self.nodes)]

    def cross_groups(self) -> list[list[int]]:
        """The ranks with the same local rank on every node: their all-reduce runs on the links between nodes."""
        per = self.ranks_per_node
        return [[node * per + local for node in range(self.nodes)] for local in range(per)]


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
    variant.forward_backward_peak_bytes = result.forward_backward_peak_bytes or 0
    variant.forward_saved_bytes = result.forward_saved_bytes or 0
    variant.optimizer_step_time_s = min(result.optimizer_step_time_s or 0.0, result.step_time_s)
    variant.params, variant.grads, variant.optim_state = state["params"], state["grads"], state["optim_state"]
    return variant


def train_alone(ctx: ModelContext, strategy: Strategy, steps: int,
                agree: bool = True) -> tuple[DryRunResult, Optional[dict]]:
    """Apply ``strategy`` to a local context (no process group) and train ``steps`` steps, the first
    a warm-up; returns the dry run and the state bytes (parameters, gradients, optimizer state) that the
    cost formulas subtract and scale: agreed over every rank, each training the same, or, with ``agree``
    False, this rank's alone (its peers are measuring other things: ``spread_over_ranks``)."""
    result = dry_run(ctx, warmup_steps=1, timed_steps=max(steps - 1, 1), setup=lambda: apply_strategy(ctx, strategy),
                     alone=not agree)
    state = None
    if result.ok:  # the steps cleared the gradients: count them as the trainable bytes they fill
        state = state_bytes(ctx.model, ctx.raw_optim)
        state["grads"] = sum(p.numel() * p.element_size() for p in ctx.model.parameters() if p.requires_grad)
    return result, _agree_state(state) if agree else state


def _agree_state(state: Optional[dict]) -> Optional[dict]:
    """The largest rank's bytes (the dry run was agreed, so ``state`` is None on all ranks or none)."""
    if state is None:
        return None
    keys = ["params", "grads", "optim_state"]
    return {k: int(v) for k, v in zip(keys, max_over_ranks([state[k] for k in keys]))}


# --- the machine -------------------------------------------------------------------------------------
def measure_hardware(device: torch.device, memory_limit: Optional[int],
                     layout: NodeGrid = NodeGrid()) -> HardwareProfile:
    """The per-rank memory limit and the all-reduce bandwidth and latency over all ranks (the slowest
    rank's: a collective runs at its pace), and each link's bandwidth (``measure_links``)."""
    limit = memory_limit if memory_limit is not None else default_memory_limit(device)
    bandwidth, latency = float("inf"), 0.0
    if is_multi_rank():
        # the smallest rank's: ranks that judged "over the limit" against their own free memory would
        # keep different candidates and then wait for each other in different dry runs
        limit = int(min_over_ranks([float(limit)])[0])
        latency = _seconds_per_all_reduce(torch.zeros(1, device=device), calls=10)
        bandwidth, neg_latency = min_over_ranks([_bandwidth(device), -latency])
        latency = -neg_latency
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    hardware = HardwareProfile(name, int(limit), bandwidth, latency)
    measure_links(hardware, device, layout)
    return hardware


def measure_links(hardware: HardwareProfile, device: torch.device, layout: NodeGrid) -> None:
    """Fill in the intra- and inter-node bandwidths. A collective's cost depends on the link it crosses (NVLink
    inside a node is an order of magnitude faster than the network), so with several nodes each link is
    measured on its own: all nodes all-reduce inside themselves at once, then the ranks with the same local rank
    all-reduce across nodes at once, as training does. A bandwidth the user gave is used as given and not
    measured. With one node the all-ranks measurement is the intra-node one and there is no inter-node link."""
    several = layout.nodes > 1 and is_multi_rank()
    measured_intra = hardware.bandwidth_bytes_per_s
    if several and layout.given_intra_node is None:
        measured_intra = _bandwidth_in_groups(device, layout.node_groups())
    hardware.intra_node_bandwidth, hardware.link_sources["intra_node"] = _given_or(layout.given_intra_node,
                                                                                   measured_intra)
    if several:
        measured_inter = None
        if layout.given_inter_node is None:
            measured_inter = _bandwidth_in_groups(device, layout.cross_groups())
        hardware.inter_node_bandwidth, hardware.link_sources["inter_node"] = _given_or(layout.given_inter_node,
                                                                                       measured_inter)


def _given_or(given: Optional[float], measured: Optional[float]) -> tuple[Optional[float], str]:
    return (given, "given") if given is not None else (measured, "measured")


def _bandwidth_in_groups(device: torch.device, rank_lists: list[list[int]]) -> float:
    """The slowest group's all-reduce bandwidth, every group all-reducing at once (a collective: every rank
    calls it with the same ``rank_lists``). The subgroups are destroyed afterwards: they serve only this."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    try:
        measured = _bandwidth(device, group)
    finally:
        dist.destroy_process_group(group)
    return min_over_ranks([measured])[0]


def _bandwidth(device: torch.device, group: Optional[dist.ProcessGroup] = None) -> float:
    """The bus bandwidth of an 8 MiB all-reduce over ``group`` (default: all ranks) on this rank: its
    bytes per second times 2 (n - 1) / n, the share of the buffer a ring all-reduce moves through each
    rank's link. The cost formulas divide such ring volumes by it (``2 (1 - 1/n) G`` for DDP's
    all-reduce, ``(1 - 1/n) P`` for a gather), as ``atorch.plan`` does a datasheet's link bandwidth;
    the buffer's bytes per second alone would price every collective over more than 2 ranks too high
    (by 1.5 times over 4)."""
    buffer = torch.zeros(2**21, device=device)
    ranks = dist.get_world_size(group)
    seconds = _seconds_per_all_reduce(buffer, calls=3, group=group)
    return buffer.numel() * buffer.element_size() / seconds * 2 * (ranks - 1) / ranks


def _seconds_per_all_reduce(buffer: torch.Tensor, calls: int, group: Optional[dist.ProcessGroup] = None) -> float:
    """Mean seconds of ``calls`` all-reduces of ``buffer`` after one warm-up call (the first sets up
    the communicator). These all-reduces are the measurement itself, not an agreement between ranks
    (that is ``min_over_ranks`` above)."""
    dist.all_reduce(buffer, group=group)
    _sync(buffer.device)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(buffer, group=group)
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
        stored = json.loads(path.read_text())
        if set(stored) != {f.name for f in fields(VariantProfile)}:  # written before a field was measured
            return None
        return variant_from_dict(stored)
    except (ValueError, TypeError):
        return None


def variant_from_dict(stored: dict) -> VariantProfile:
    """A profile from its ``asdict`` form, as JSON gives it back (the tensor sizes as strings)."""
    return VariantProfile(**{**stored, **{name: {int(size): t for size, t in stored[name].items()}
                                          for name in ("tensor_step_times", "tensor_overhead_s")}})


MEASURED_FIELDS = ("peak_bytes", "step_time_s", "params", "grads", "optim_state", "forward_backward_peak_bytes",
                   "forward_saved_bytes", "blocks_step_time_s", "optimizer_step_time_s")


def slowest_of(variants: list[VariantProfile]) -> VariantProfile:
    """One profile from the same setting measured on several ranks at once: each measured quantity's largest
    (training runs at its slowest rank's pace and must fit on its fullest), as agreeing the ranks' own
    measurements over all ranks does; the first error where any rank's measurement failed."""
    failed = [v for v in variants if v.error]
    if failed:
        return failed[0]
    return replace(variants[0], **{name: max(getattr(v, name) for v in variants) for name in MEASURED_FIELDS})


def store_cached(key: str, variant: VariantProfile) -> None:
    if variant.error:
        return
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        (cache_dir() / f"{key}.json").write_text(json.dumps(asdict(variant)))
    except OSError as error:  # a read-only home is not a reason to fail the search
        logger.info("profile cache not written: %s", error)
