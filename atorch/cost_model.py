"""The cost model: every formula that turns measurements into a candidate's predicted per-rank peak
memory and step time, shared by the search (``atorch/auto/search``) and ``atorch.plan``. Nothing here
runs a model or a collective (that is ``search/measure.py``), so each prediction can be read, and
checked, from the numbers it was given.

One module for both, so ``atorch.plan`` cannot drift from the search: its analytical model
feeds its data-parallel memory through ``estimate`` (with an analytical alone profile), and given the
search's own measurements (``MeasuredProfile``, kept as ``SearchResult.measured``) its
``plan_measured`` predicts every candidate through ``predict_measured``, the one function the search's
estimates go through, so the two agree exactly on the machine that was measured.

The search does not guess activation memory or compute time from first principles: ``search/measure.py``
measures one rank training alone (no communication) for each precision / checkpoint setting, at
the per-rank batch, and each candidate is modelled from that:

    memory(candidate) = peak_alone(precision, checkpoint, batch)
                        - what the sharding removes from the rank   (params / grads / optimizer state)
                        + what the sharding adds while it works     (gathered units, comm buffers)
    time(candidate)   = step_time_alone - the optimizer update the rank does not own
                        + communication bytes / measured bandwidth

The alone step's optimizer update is measured apart (``optimizer_step_time_s``): zero1, zero2 and fsdp
step 1/N of it on each rank, and a layout's rank steps its share of the parameters once a step, never
scaled by the batch or the pipeline's bubble. (Measured on CPU, where torch's AdamW loops over the
parameters, on the 9.7M-parameter Llama of ``benchmarks/search_quality.py --scale``: the update is 18 %
of a one-thread step and 20 % of a ddp step on 4 ranks sharing 2 cores, 137 of 697 ms, which zero1 cut
to 77 ms; an exhaustive pass measured zero1 17 % faster than ddp, which the model priced 5 % slower
before the update was apart.)

With ``micro_batch`` (k micro-steps per per-rank batch) the activations are a micro-batch's (1/k of
the measured ones) and each extra micro-step adds its pass's fixed part where the search measured it
(``micro_step_overhead_s``), else ``MICRO_STEP_OVERHEAD`` of the step (``_split``).

Parameters, gradients and optimizer state are measured too (``state_bytes`` after a step), so the
optimizer's state coefficient (AutoDist's ``opt_resident_coef``) is observed, not assumed.

Tensor / pipeline layouts start from the same measurement, with the layout facts that the methods'
own plan finders give (``search/layouts.py``: which sizes the model supports, each rank's share of the bytes):

- parameters, gradients and optimizer state scale by the rank's exact share of the parameter bytes
  (its pipeline stage's modules, with the tensor-split projections divided by the tensor size);
- activations: the part made inside split projections divides by the tensor size, the residual
  stream and the loss do not; a pipeline stage keeps its own blocks' activations for the
  micro-batches in flight (1F1B: at most the number of stages on the first stage, plus one being
  received or recomputed). The two constants below were calibrated by measurement;
- time: compute (the alone step less its optimizer update) scales like the parameters it touches,
  the update by the rank's share of them; a pipeline stage pays its share of one micro-batch's pass
  (``pass_seconds``: its fixed part from the alone step measured also at a micro-batch) for each
  of the schedule's ``M + p - 1`` slots, the bubble included, tensor parallelism pays four activation
  all-reduces per block per step, and the data dimension all-reduces the rank's gradients as DDP does.

With several nodes each collective runs on the link it crosses (``topology_estimate``: the bandwidth
inside a node or between nodes; hybrid sharding pays both).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from atorch.auto.opt_lib.micro_batch import EACH_MICRO_STEP
from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.candidates import Candidate, SearchSpace
from atorch.auto.search.layouts import LayoutFacts, micro_batches
from atorch.auto.search.measure import HardwareProfile, Setting, VariantProfile
from atorch.auto.search.topology import Links, Topology
from atorch.auto.strategy import Strategy
from atorch.errors import InputError

# The share of the activations tensor parallelism does not split: the residual stream, norms, logits and
# the loss. Calibrated on the repo GPT (4 blocks x 128, vocab 512, 2 gloo ranks, tp2 with and without
# checkpointing; tests/search/test_search.py); held out: the HF Llama of tests/search/test_search_at_scale.py,
# whose tp2 x pp2 peaks it predicts within 7 % (0.3 to 0.5 all stay within 8 % on both).
REPLICATED_ACTIVATION_SHARE = 0.4
# A pipeline stage holds the micro-batches in flight beyond the stage count (1F1B: the first stage keeps
# ``pipeline`` micro-batches' activations, the others fewer). Measured: 0 on both models above.
EXTRA_MICRO_BATCHES_IN_FLIGHT = 0
# micro_batch: each extra micro-step costs this share of the unsplit step (another forward / backward
# launch over a smaller batch, the loss, the accumulation). Calibrated on the repo GPT 4x128 on 2 CPU
# ranks (measured +0.14 to +0.23; benchmarks/search_quality.py prints the measured value beside it).
MICRO_STEP_OVERHEAD = 0.2
# The memory model predicts a dry run's peak within this fraction (tests/search/test_search.py holds it
# to that): a candidate predicted closer to the limit is not dry-run, since its run could exceed the limit
# (on a device, an out-of-memory error; under a memory cgroup, the process killed).
MEMORY_MODEL_ERROR = 0.15


def fits_with_margin(memory_bytes: float, limit: float) -> bool:
    """Whether a predicted peak fits ``limit`` with the memory model's error to spare: the search dry-runs
    only such candidates, and ``atorch.plan.plan_measured`` calls only those fitting."""
    return memory_bytes * (1 + MEMORY_MODEL_ERROR) <= limit


@dataclass
class Estimate:
    """One candidate's prediction: per-rank peak bytes, seconds per step, and the numbers it came from."""

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
             unit's unsharded gradients), or, where larger, P/N + O/N + 3 U_c + the activations at
             backward's start (``forward_peak_activations``: the gradients are not there yet)

    ``_c`` is in the compute dtype (half of fp32 under amp: FSDP's mixed-precision policy gathers in
    it), U the largest sharding unit, and act' = act less autocast's weight copies, which FSDP's
    policy makes unnecessary (they exist only without checkpointing).
    """
    if candidate.tensor * candidate.pipeline > 1:
        return _estimate_layout(candidate, variant, world, profile, hardware)
    n = max(world, 1)
    P, G, O = variant.params, variant.grads, variant.optim_state  # noqa: E741  (O as in the formulas above)
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
                early = forward_peak_activations(variant)
                if early is not None:  # backward's start: every activation alive, no gradient yet
                    early_act = sum(early) - (0.5 * P if amp and not candidate.checkpoint else 0.0)
                    memory = max(memory, (P + O) / n + 3 * compute * unit + early_act)
                comm, collectives = shed * (G + 2 * P), 3 * units
    unsplit_comm_s = _comm_seconds(comm, collectives, hardware)
    if candidate.micro > 1:
        memory, comm, collectives = _split(candidate, memory, comm, collectives, act, P, G, n, units)
    # a sharded optimizer state is stepped by its owner only: the rank skips the rest of the alone step's update
    alone_s = variant.step_time_s - (1 - 1 / _optimizer_shards(candidate, n)) * _optimizer_seconds(variant)
    comm_s = _comm_seconds(comm, collectives, hardware)
    comm_s = _measured_sharding_seconds(candidate, variant, n, unsplit_comm_s, comm_s, alone_s)
    time_s = alone_s + micro_step_overhead_s(variant) * (candidate.micro - 1) + comm_s
    detail = f"alone {variant.peak_bytes / 2**20:.1f} MiB, P/G/O {P / 2**20:.1f}/{G / 2**20:.1f}/{O / 2**20:.1f} MiB"
    return Estimate(int(memory), time_s, detail)


def _comm_seconds(comm_bytes: float, collectives: int, hardware: HardwareProfile) -> float:
    return comm_bytes / max(hardware.bandwidth_bytes_per_s, 1.0) + collectives * hardware.latency_s


def _optimizer_seconds(variant: VariantProfile) -> float:
    """The alone step's optimizer update (0 where it was not measured: profiles from before it was)."""
    return min(max(variant.optimizer_step_time_s, 0.0), variant.step_time_s)


def pass_seconds(variant: VariantProfile, samples: float) -> float:
    """One forward and backward of ``samples`` samples through the whole model alone (the alone step less
    its optimizer update): its fixed part (``VariantProfile.pass_fixed_share``, which a pipeline pays once
    per micro-batch) plus the rest in proportion to the batch; all of it in proportion where the fixed
    part was not measured."""
    full = max(variant.step_time_s - _optimizer_seconds(variant), 0.0)
    fixed = min(max(variant.pass_fixed_share or 0.0, 0.0), 1.0) * full
    return fixed + (full - fixed) * samples / variant.batch


def micro_step_overhead_s(variant: VariantProfile) -> float:
    """What each micro-step beyond the first adds to an unsplit step: its pass's fixed part where the search
    measured it (k micro-batches of 1/k run the batch-bound part once in all, the fixed part k times),
    else ``MICRO_STEP_OVERHEAD`` of the step."""
    if variant.pass_fixed_share is None:
        return variant.step_time_s * MICRO_STEP_OVERHEAD
    return pass_seconds(variant, 0.0)


def fixed_pass_share(variant: VariantProfile, small_step_time_s: float, small_batch: int) -> float:
    """The share of ``variant``'s pass that does not shrink with the batch, from the straight line through
    its step and the same step measured at ``small_batch`` samples (both less the optimizer update). The
    line's slope is bounded between flat and proportional, so noise that made the small batch slower than
    the large one cannot price a pass above the full batch's, nor one that made it faster below its share."""
    optimizer_s = _optimizer_seconds(variant)
    full = max(variant.step_time_s - optimizer_s, 0.0)
    if not (full > 0 and 0 < small_batch < variant.batch):
        return 0.0
    small = max(small_step_time_s - optimizer_s, 0.0)
    slope = min(max((full - small) / (variant.batch - small_batch), 0.0), full / variant.batch)
    return (full - slope * variant.batch) / full


def _optimizer_shards(candidate: Candidate, data: int) -> int:
    """Over how many ranks the optimizer state is split on the data dimension: zero1 / zero2 / fsdp over
    the data ranks (hybrid sharding: over its shard group), ddp not at all."""
    if candidate.sharding == "ddp" or data <= 1:
        return 1
    return candidate.shard or data


def _measured_sharding_seconds(candidate: Candidate, variant: VariantProfile, world: int, unsplit_comm_s: float,
                               comm_s: float, alone_s: float) -> float:
    """What the sharding adds to the rank's own step (``alone_s``: the alone step less the optimizer update
    the rank does not own): the formula's ``comm_s``, or, where the search measured the sharding over every
    rank (``variant.sharded_step_times``: the whole model's unsplit step, less ``alone_s``), that measured
    excess scaled as the formula scales with micro-steps (``comm_s`` over ``unsplit_comm_s``). The measurement
    counts what the formula cannot: each collective's real cost on these process groups (gloo's all-gather
    and reduce-scatter are not its all-reduce) and the sharding's own per-unit work (FSDP's copy-in /
    copy-out and hooks). Hybrid sharding (``candidate.shard``) and
    other world sizes keep the formula: the measurement was over all ranks as one group."""
    if candidate.shard or world != variant.sharded_world or unsplit_comm_s <= 0:
        return comm_s
    measured = variant.sharded_step_times.get(candidate.sharding)
    added = max(measured - alone_s, 0.0) if measured is not None else variant.sharded_overhead_s.get(candidate.sharding)
    return comm_s if added is None else added * comm_s / unsplit_comm_s


def sharding_overhead_s(sharding: str, variant: VariantProfile) -> Optional[float]:
    """What ``sharding``, measured over every rank (``variant.sharded_step_times``), adds to the step of an
    unsplit candidate under it: the measured step less the alone step the rank still runs (its shard of
    the optimizer update). None where it was not measured."""
    measured = variant.sharded_step_times.get(sharding)
    if measured is None:
        return None
    alone_s = variant.step_time_s - (1 - 1 / max(variant.sharded_world, 1)) * _optimizer_seconds(variant)
    return max(measured - alone_s, 0.0)


def _split(candidate: Candidate, memory: float, comm: float, collectives: int, act: float, P: float, G: float,
           n: int, units: int) -> tuple[float, float, int]:
    """micro_batch with k micro-steps: the batch's activations shrink to 1/k (autocast's weight
    copies do not scale with the batch); inside the window FSDP keeps its gradients unsharded and
    gathers every unit again for each micro-step's forward and backward (zero2's parameters stay
    gathered through the window; DDP and zero1 communicate once, at its end). The gradients it keeps
    are in its policy's reduce dtype, fp32 (FSDP2 upcasts each kept unsharded gradient to it,
    ``FSDPParam.to_accumulated_grad_if_needed``), so zero2's whole gradients grow from the compute
    dtype to fp32 too.
    ``grad_sync="each_micro_step"`` (fsdp / zero2): every micro-step reduce-scatters, k times G's share
    instead of once, and FSDP's gradients stay sharded between micro-steps (no unsharded copy kept;
    zero2's model already holds its whole gradients through one backward)."""
    k, amp = candidate.micro, candidate.precision.startswith("amp")
    batch_act = max(act - (0.5 * P if amp and not candidate.checkpoint else 0.0), 0.0)
    memory -= (1 - 1 / k) * batch_act
    each = candidate.grad_sync == EACH_MICRO_STEP and candidate.sharding in ("fsdp", "zero2")
    if candidate.sharding == "zero2" and n > 1 and amp and not each:
        memory += 0.5 * G  # the compute-dtype gradients counted unsplit, now accumulated in fp32
    if candidate.sharding == "fsdp" and n > 1:
        shed = 1.0 - 1.0 / n
        memory += 0.0 if each else G * shed
        comm += (k - 1) * shed * 2 * P
        collectives += (k - 1) * 2 * units
    if each and n > 1:
        comm += (k - 1) * (1.0 - 1.0 / n) * G
        collectives += (k - 1) * units
    return memory, comm, collectives


def _estimate_layout(candidate: Candidate, variant: VariantProfile, world: int, profile: ModelProfile,
                     hardware: HardwareProfile) -> Estimate:
    """Tensor / pipeline layouts: the rank's share of the model (see the layout formulas below)."""
    facts, t, p = profile.layouts, candidate.tensor, candidate.pipeline
    memory = estimate_layout_memory(candidate, variant, world, facts)
    time_s = estimate_layout_time(candidate, variant, world, profile, hardware)
    detail = f"rank holds {facts.state_share[(t, p)]:.0%} of the model; data size {candidate.data_size(world)}"
    return Estimate(int(memory), time_s, detail)


def forward_peak_activations(variant: VariantProfile) -> Optional[tuple[float, float]]:
    """The activations at backward's start, from the alone run, as (saved, working): what its forward
    left alive for backward, and backward's working memory (its forward-and-backward peak beyond the
    parameters, the optimizer state and the larger of those saved activations and the gradients). A
    pipeline stage keeps the first for every micro-batch in flight, the second for one. None when the
    alone run did not measure them (a profile cached before they were)."""
    if not variant.forward_saved_bytes or not variant.forward_backward_peak_bytes:
        return None
    P, G, O = variant.params, variant.grads, variant.optim_state  # noqa: E741
    saved = float(variant.forward_saved_bytes)
    working = max(variant.forward_backward_peak_bytes - P - O - max(saved, G), 0.0)
    return saved, working


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


# --- tensor / pipeline layouts -------------------------------------------------------------------
def estimate_layout_memory(candidate: Candidate, variant: VariantProfile, world: int, facts: LayoutFacts) -> float:
    """Per-rank peak of a tensor / pipeline layout from one rank's alone measurement (see the module doc).

    The activations are what the alone run held beyond its state (parameters + gradients + optimizer
    state) at the per-rank batch of pure data parallelism; a data rank of the layout sees
    ``tensor * pipeline`` times that batch, so they scale by it. (Measuring the alone run at a
    second batch size to separate a batch-independent part changed no prediction by more than 2%
    here, and cost a quarter of the search's time.)

    The peak is the larger of two moments: after backward (the whole state, plus what the alone run held
    beyond it) and at backward's start, when the forward's saved activations are all alive
    (``forward_peak_activations``). The alone run's overall peak alone hides the second where the
    optimizer step's temporaries top the activations (a model whose state outweighs its activations).
    """
    tensor, pipeline, data = candidate.tensor, candidate.pipeline, candidate.data_size(world)
    P, G, O = variant.params, variant.grads, variant.optim_state  # noqa: E741
    state = P + G + O
    share = facts.state_share[(tensor, pipeline)]
    micro = micro_batches(pipeline, variant.batch * tensor * pipeline) if pipeline > 1 else 1
    # one micro-batch's activations on this rank, relative to the alone run's batch: a data rank sees
    # tensor * pipeline times that batch, split in ``micro``; tensor parallelism splits part of them
    per_micro = tensor * pipeline * (REPLICATED_ACTIVATION_SHARE + (1 - REPLICATED_ACTIVATION_SHARE) / tensor) / micro
    in_flight = 1.0
    if pipeline > 1:  # the stage's share of the blocks, for each micro-batch in flight
        in_flight = facts.stage_block_share[pipeline] * min(min(pipeline, micro) + EXTRA_MICRO_BATCHES_IN_FLIGHT, micro)
    # the step's peak after backward (the whole state and what the alone run held beyond it) ...
    memory = state * share + (variant.peak_bytes - state) * per_micro * in_flight
    early = forward_peak_activations(variant)
    if early is not None:
        saved, working = early
        # ... or at backward's start: every micro-batch in flight saved its activations; a pipeline stage
        # already holds its gradients from the first micro-batch's backward, a single step none yet
        held = P + O + (G if pipeline > 1 else 0)
        memory = max(memory, held * share + saved * per_micro * in_flight + working * per_micro)
    if data > 1:
        memory += variant.grads * share  # the data group's gradient all-reduce buffers
        if candidate.sharding == "zero1":
            memory -= (1 - 1 / data) * variant.optim_state * share
    return memory


def estimate_layout_time(candidate: Candidate, variant: VariantProfile, world: int, profile: ModelProfile,
                         hardware: HardwareProfile) -> float:
    """Step time of a tensor / pipeline layout (see the module doc): the rank's compute, the pipeline's
    bubble and sends and the data dimension's all-reduce, plus what the tensor split costs."""
    shards = _optimizer_shards(candidate, candidate.data_size(world))
    return (_time_without_tensor_split(candidate.tensor, candidate.pipeline, variant, world, profile, hardware, shards)
            + _tensor_split_time(candidate, variant, world, profile, hardware))


def _time_without_tensor_split(tensor: int, pipeline: int, variant: VariantProfile, world: int,
                               profile: ModelProfile, hardware: HardwareProfile, optimizer_shards: int = 1) -> float:
    """The alone step time was measured at the pure-data-parallel per-rank batch; the layout's data rank
    sees ``tensor * pipeline`` times more, of which the rank computes its share. The optimizer update is
    apart: it steps the rank's share of the parameters once a step, whatever the batch and the bubble
    (divided again over ``optimizer_shards`` data ranks under zero1)."""
    facts = profile.layouts
    data, batch = world // (tensor * pipeline), variant.batch * tensor * pipeline  # per data rank
    dtype_bytes = 2 if variant.precision != "fp32" else 4
    share = facts.state_share[(tensor, pipeline)]
    optimizer_s = _optimizer_seconds(variant)
    compute = (variant.step_time_s - optimizer_s) * tensor * pipeline * share
    comm, collectives = 0.0, 0
    if pipeline > 1:
        micro = micro_batches(pipeline, batch)
        # each stage runs its share of every micro-batch's pass, through the bubble
        compute = pass_seconds(variant, batch / micro) * share * (micro + pipeline - 1)
        comm += 2 * batch * profile.tokens_per_sample * facts.hidden_size * dtype_bytes  # activations, gradients
        collectives += 2 * micro
    compute += optimizer_s * share / optimizer_shards
    if data > 1:
        comm += 2 * (1 - 1 / data) * variant.grads * share
        collectives += 1
    return compute + _comm_seconds(comm, collectives, hardware)


def _tensor_split_time(candidate: Candidate, variant: VariantProfile, world: int, profile: ModelProfile,
                       hardware: HardwareProfile) -> float:
    """What the tensor split adds. Measured where the search measured it (``variant.tensor_step_times``:
    the whole model under ddp + the split, less the other terms of the same layout without a pipeline),
    which counts the split's collectives on the real groups and the split layers' own overheads (on CPU
    gloo the latter dominate); a pipeline stage pays it for its share of the blocks at its per-data-rank
    batch, through the bubble. Otherwise four activation all-reduces per block at the measured bandwidth."""
    facts, tensor, pipeline = profile.layouts, candidate.tensor, candidate.pipeline
    if tensor == 1:
        return 0.0
    along = 1.0  # the (tensor, 1) layout's cost -> this one's
    if pipeline > 1:
        micro = micro_batches(pipeline, variant.batch * tensor * pipeline)
        along = pipeline * facts.stage_block_share[pipeline] * (micro + pipeline - 1) / micro
    added = tensor_split_overhead_s(tensor, variant, world, profile, hardware)
    if added is None:
        added = variant.tensor_overhead_s.get(tensor)
    if added is not None:
        return added * along
    dtype_bytes = 2 if candidate.precision != "fp32" else 4
    activation_bytes = variant.batch * tensor * pipeline * profile.tokens_per_sample * facts.hidden_size * dtype_bytes
    blocks_here = max(facts.blocks, 1) * (facts.stage_block_share.get(pipeline, 1.0) if pipeline > 1 else 1.0)
    comm = 4 * blocks_here * 2 * (1 - 1 / tensor) * activation_bytes
    return _comm_seconds(comm, int(4 * blocks_here), hardware)


def tensor_split_overhead_s(tensor: int, variant: VariantProfile, world: int, profile: ModelProfile,
                            hardware: HardwareProfile) -> Optional[float]:
    """What a ``tensor``-way split, measured (``variant.tensor_step_times``: the whole model under ddp +
    the split), adds to the same layout without it; None where it was not measured."""
    measured = variant.tensor_step_times.get(tensor)
    if not measured:
        return None
    return max(measured - _time_without_tensor_split(tensor, 1, variant, world, profile, hardware), 0.0)


# --- the links a collective crosses ----------------------------------------------------------------
def topology_estimate(candidate: Candidate, variant: VariantProfile, *, world: int, profile: ModelProfile,
                      hardware: HardwareProfile, topology: Topology, links: Links = Links()) -> Estimate:
    """``estimate`` with each collective on the links it crosses. One node: unchanged (the
    measured bandwidth is the node's). Several: a data group spanning nodes runs at the inter-node
    bandwidth; hybrid sharding gathers and reduce-scatters inside the node and all-reduces its shard of
    the gradients across nodes (2 (1 - 1/r) G / shard bytes over r replicas)."""
    intra = links.intra_node or hardware.bandwidth_bytes_per_s
    inter = links.inter_node or hardware.bandwidth_bytes_per_s
    if topology.nodes == 1:
        return estimate(candidate, variant, world, profile, dataclasses.replace(hardware, bandwidth_bytes_per_s=intra))
    if not candidate.shard:
        stride = candidate.tensor * candidate.pipeline
        crosses = topology.crosses_nodes(candidate.data_size(world), stride) or stride > topology.ranks_per_node
        bandwidth = inter if crosses else intra
        return estimate(candidate, variant, world, profile,
                        dataclasses.replace(hardware, bandwidth_bytes_per_s=bandwidth))
    inner = estimate(candidate, variant, candidate.shard, profile,
                     dataclasses.replace(hardware, bandwidth_bytes_per_s=intra))
    replicas = candidate.data_size(world) // candidate.shard
    across = 2 * (1 - 1 / replicas) * variant.grads / candidate.shard / max(inter, 1.0) + hardware.latency_s
    return Estimate(inner.memory_bytes + int(variant.grads / candidate.shard), inner.step_time_s + across,
                    inner.detail + f"; hybrid: {candidate.shard} per shard group x {replicas} replicas")


# --- the machine the search measured ---------------------------------------------------------------
@dataclass
class MeasuredProfile:
    """Everything the search measured on its machine that a prediction reads, and the search space its
    candidates came from: handed to ``atorch.plan.plan_measured``, which then predicts (and ranks) any
    candidate exactly as the search did, in another process or later (it pickles: plain numbers only).

    ``variants``: one rank training alone per (precision, checkpoint) setting the candidates used (a
    failed one keeps its ``error``); ``links``: the bandwidth inside a node and between nodes the
    estimates used (None: ``hardware``'s all-ranks one). The last four fields rebuild the search's
    ``SearchSpace`` so the same candidates can be enumerated again."""

    profile: ModelProfile
    hardware: HardwareProfile
    variants: dict[Setting, VariantProfile]
    world: int
    topology: Topology
    links: Links = Links()
    per_rank_batch: int = 1          # under pure data parallelism
    device: str = "cpu"              # the search's device type (which precisions it supports)
    excluded: frozenset = frozenset()
    included: Strategy = field(default_factory=Strategy)

    def variant(self, candidate: Candidate) -> VariantProfile:
        """The alone measurement ``candidate`` is predicted from; InputError when its setting was not
        measured or failed alone (nothing to predict from)."""
        setting = (candidate.precision, candidate.checkpoint)
        variant = self.variants.get(setting)
        if variant is None:
            raise InputError(f"{candidate.label}: the search measured no rank alone under {setting}; "
                             f"measured: {sorted(self.variants)}")
        if variant.error:
            raise InputError(f"{candidate.label}: {setting} failed alone: {variant.error}")
        return variant

    def predictable(self, candidate: Candidate) -> bool:
        """Whether ``candidate``'s setting was measured and trained alone."""
        variant = self.variants.get((candidate.precision, candidate.checkpoint))
        return variant is not None and not variant.error

    def search_space(self, excluded: frozenset = frozenset()) -> SearchSpace:
        """The search's space (less the methods in ``excluded`` too), to enumerate its candidates again."""
        ranks_per_node = self.topology.ranks_per_node if self.topology.nodes > 1 else 0
        return SearchSpace(self.world, torch.device(self.device), self.profile, frozenset(self.excluded | excluded),
                           self.included, self.per_rank_batch, ranks_per_node)


def predict_measured(candidate: Candidate, measured: MeasuredProfile) -> Estimate:
    """Per-rank peak memory and step time of ``candidate`` on the measured machine: the search's
    estimate and ``atorch.plan.plan_measured``'s, through this one function so they cannot differ."""
    return topology_estimate(candidate, measured.variant(candidate), world=measured.world, profile=measured.profile,
                             hardware=measured.hardware, topology=measured.topology, links=measured.links)
