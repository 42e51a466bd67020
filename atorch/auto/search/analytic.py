"""Analytical predictions for a cluster that is not here: the planner's cost model.

``cost.py`` turns one rank's *measurements* into a candidate's memory and time. Nothing can be
measured for an H100 cluster from a CPU machine, so here the same candidates are predicted from
the model's shape (``model_specs.py``) and the device's datasheet (``hardware_specs.py``):

- memory: the sharding's effect on parameters, gradients and optimizer state is ``cost.estimate``'s
  own formula (fed with an analytical single-rank profile instead of a measured one); activations are
  counted per token and block (flash / SDPA attention), plus the logits the loss upcasts;
- time: compute is FLOPs / (peak x the device's efficiency); the data dimension's collectives run at
  NVLink speed inside a node and network speed across nodes, overlapped with compute (FSDP and DDP
  both overlap them with forward / backward); tensor-parallel all-reduces and the pipeline bubble
  are not hidden.

Every constant below says where it comes from; ``benchmarks/plan_vs_published.py`` compares the
predictions with published runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.candidates import Candidate
from atorch.auto.search.cost import EXTRA_MICRO_BATCHES_IN_FLIGHT, estimate
from atorch.auto.search.hardware_specs import ClusterSpec
from atorch.auto.search.layouts import LayoutFacts, divisors_above_one, micro_batches
from atorch.auto.search.measure import HardwareProfile, VariantProfile
from atorch.auto.search.model_specs import TransformerSpec

# The loss reads bf16 logits, upcasts them to fp32 and keeps their fp32 gradient: 2 + 4 + 4 bytes per
# logit (first principles; transformers and torchtitan both upcast before cross-entropy).
LOGIT_BYTES = 10
# Selective activation checkpointing (torchtitan's "op" policy: matmul outputs kept, the rest
# recomputed) keeps this share of a block's activations. Calibrated on torchtitan's Llama 3.1 8B FSDP
# row on 8 H100 (82.4 GiB); the 128-GPU row tests it.
SELECTIVE_ACTIVATION_SHARE = 0.48
# What the caching allocator reserves beyond the live peak (fragmentation, freed blocks kept). 1.0:
# the selective share above was fitted with it, so no second constant is taken from the same row.
ALLOCATOR_OVERHEAD = 1.0
AC_MODES = ("none", "selective", "full")
# micro_batch on a GPU: each extra micro-step runs smaller matmuls at lower efficiency. Not calibrated
# (no published row splits the batch); small, so a split is chosen only when the whole batch does not
# fit, as the search does with its CPU-calibrated cost.MICRO_STEP_OVERHEAD.
MICRO_STEP_SLOWDOWN = 0.02


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens over the whole cluster."""

    global_batch: int
    seq_len: int
    activation_checkpointing: Optional[str] = None  # None: the candidate's (off / full); or one of AC_MODES
    logit_bytes: int = LOGIT_BYTES                  # per logit, through the loss
    fp32_residual: Optional[bool] = None            # None: autocast over fp32 weights unless FSDP casts them
    micro_batch_size: Optional[int] = None          # sequences per forward on a data rank; None: the default split

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class Prediction:
    candidate: Candidate
    memory_bytes: int
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool
    compute_s: float = 0.0
    comm_s: float = 0.0
    notes: list = field(default_factory=list)


def predict(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
            facts: Optional[LayoutFacts] = None) -> Prediction:
    """Per-GPU peak memory, step time, tokens/s per GPU and MFU of ``candidate`` (see the module doc)."""
    world = cluster.world_size
    memory = predict_memory(candidate, spec, cluster, work, facts)
    compute = compute_seconds(candidate, spec, cluster, work)
    data_comm = data_comm_seconds(candidate, spec, cluster, facts)
    exposed = tensor_comm_seconds(candidate, spec, cluster, work) + pipeline_comm_seconds(candidate, spec, cluster, work)
    step = max(compute, data_comm) + exposed
    tokens = work.tokens / world / step
    mfu = tokens * spec.model_flops_per_token(work.seq_len) / cluster.device.bf16_flops
    return Prediction(candidate, int(memory), step, tokens, mfu, memory <= cluster.device.memory_bytes,
                      compute, data_comm + exposed)


# --- memory ------------------------------------------------------------------------------------------
def state_bytes(candidate: Candidate, spec: TransformerSpec) -> tuple[float, float, float]:
    """Parameter, gradient and optimizer-state (Adam) bytes of the whole model, unsharded. Under amp the
    master weights, gradients and moments stay fp32; pure half keeps everything in bf16."""
    n = spec.param_count
    if candidate.precision == "half_bf16":
        return 2.0 * n, 2.0 * n, 4.0 * n
    return 4.0 * n, 4.0 * n, 8.0 * n


def checkpointing(candidate: Candidate, work: Workload) -> str:
    return work.activation_checkpointing or ("full" if candidate.checkpoint else "none")


def activation_bytes(candidate: Candidate, spec: TransformerSpec, work: Workload, tokens: float,
                     tensor: int = 1, layers: Optional[float] = None, in_flight: float = 1.0) -> float:
    """Activations of ``tokens`` tokens (one data rank's share of the step) over ``layers`` blocks, with
    ``in_flight`` micro-batches of them alive at once (pipelines)."""
    layers = spec.layers if layers is None else layers
    width = 4 if candidate.precision == "fp32" else 2
    residual = 4 if residual_is_fp32(candidate, work) else width
    split = spec.split_activation_elements()
    unsplit = spec.block_activation_elements() - split  # norms and the residual stream
    per_token = split / tensor * width + unsplit * residual
    mode = checkpointing(candidate, work)
    kept = {"none": per_token, "selective": SELECTIVE_ACTIVATION_SHARE * per_token,
            "full": spec.hidden * residual}[mode]
    blocks = layers * kept * tokens * in_flight
    working = per_token * tokens * (2 if mode == "full" else 1)  # one block's backward (and its recompute)
    logits = spec.vocab * tokens * work.logit_bytes
    return blocks + working + logits


def residual_is_fp32(candidate: Candidate, work: Workload) -> bool:
    """Under autocast the weights stay fp32, so the embedding output and the residual stream (and the
    norms on it) are fp32; FSDP's mixed-precision policy casts the weights to bf16 first."""
    if work.fp32_residual is not None:
        return work.fp32_residual
    return candidate.precision == "fp32" or (candidate.precision.startswith("amp") and candidate.sharding != "fsdp")


def predict_memory(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                   facts: Optional[LayoutFacts] = None) -> float:
    """Per-GPU peak bytes. Data-parallel layouts go through ``cost.estimate`` with an analytical alone
    profile; tensor / pipeline layouts scale state by the largest rank's share (``LayoutFacts``)."""
    world, t, p = cluster.world_size, candidate.tensor, candidate.pipeline
    data = candidate.data_size(world)
    P, G, O = state_bytes(candidate, spec)
    tokens = work.tokens / data
    if t * p == 1:
        autocast_copies = 0.5 * P if candidate.precision.startswith("amp") and checkpointing(candidate, work) == "none" else 0.0
        act = activation_bytes(candidate, spec, work, tokens) + autocast_copies
        variant = VariantProfile(candidate.precision, candidate.checkpoint, work.global_batch // data,
                                 int(P + G + O + act), 0.0, int(P), int(G), int(O))
        shard_group = shard_size(candidate, world)
        memory = estimate(candidate, variant, shard_group, _profile(spec, P), _hardware(cluster)).memory_bytes
        return memory * ALLOCATOR_OVERHEAD
    share = facts.state_share[(t, p)] if facts and (t, p) in facts.state_share else 1.0 / (t * p)
    if p > 1:
        micro = pipeline_micro_batches(candidate, work, data)
        in_flight = min(min(p, micro) + EXTRA_MICRO_BATCHES_IN_FLIGHT, micro)
        act = activation_bytes(candidate, spec, work, tokens / micro, t, math.ceil(spec.layers / p), in_flight)
    else:
        act = activation_bytes(candidate, spec, work, tokens, t)
    memory = (P + G + O) * share + act
    if data > 1:
        memory += G * share  # the data group's gradient all-reduce buffers
        if candidate.sharding == "zero1":
            memory -= (1 - 1 / data) * O * share
    return memory * ALLOCATOR_OVERHEAD


def pipeline_micro_batches(candidate: Candidate, work: Workload, data: int) -> int:
    """Micro-batches a pipeline splits a data rank's batch into: the user's micro-batch size, or the
    pipeline method's default."""
    per_rank = max(work.global_batch // data, 1)
    if work.micro_batch_size:
        return max(per_rank // work.micro_batch_size, 1)
    return micro_batches(candidate.pipeline, per_rank)


def shard_size(candidate: Candidate, world: int) -> int:
    """Ranks the state is sharded over: the whole data dimension, or a node's under hybrid sharding."""
    shard = getattr(candidate, "shard", 0)
    return shard if shard else candidate.data_size(world)


def _profile(spec: TransformerSpec, param_bytes: float) -> ModelProfile:
    """A profile with the facts ``cost.estimate`` reads (the blocks: FSDP's units)."""
    scale = param_bytes / max(spec.param_count, 1)
    return ModelProfile(spec.param_count, int(param_bytes), spec.param_count, int(param_bytes), 0,
                        {spec.block: spec.layers}, {spec.block: int(spec.block_params * scale)}, {})


def _hardware(cluster: ClusterSpec) -> HardwareProfile:
    return HardwareProfile(cluster.device.name, cluster.device.memory_bytes, cluster.device.nvlink_bytes_per_s)


# --- time --------------------------------------------------------------------------------------------
def compute_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """FLOPs of the step on one GPU over its peak x efficiency, with the pipeline bubble."""
    flops = spec.model_flops_per_token(work.seq_len)
    if checkpointing(candidate, work) == "full":
        flops += spec.recompute_flops_per_token(work.seq_len)
    device = cluster.device
    peak = device.fp32_flops if candidate.precision == "fp32" else device.bf16_flops
    seconds = work.tokens * flops / cluster.world_size / (peak * device.efficiency)
    if candidate.pipeline > 1:
        micro = pipeline_micro_batches(candidate, work, candidate.data_size(cluster.world_size))
        seconds *= (micro + candidate.pipeline - 1) / micro
    if candidate.micro > 1:  # smaller matmuls and one more launch round per micro-step
        seconds *= 1 + MICRO_STEP_SLOWDOWN * (candidate.micro - 1)
    return seconds


def data_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                      facts: Optional[LayoutFacts] = None) -> float:
    """Gradient reduction (and parameter gathers when sharded) over the data dimension, per GPU."""
    world, t, p = cluster.world_size, candidate.tensor, candidate.pipeline
    data = candidate.data_size(world)
    if data == 1:
        return 0.0
    P, G, _ = state_bytes(candidate, spec)
    share = facts.state_share.get((t, p), 1 / (t * p)) if facts and t * p > 1 else 1.0 / (t * p)
    P, G = P * share, G * share
    compute_params = P / 2 if candidate.precision.startswith("amp") else P  # gathered in the compute dtype
    shard = shard_size(candidate, world)
    shed = 1 - 1 / shard
    bytes_moved = {"ddp": 2 * shed * G, "zero1": 2 * shed * G + shed * P, "zero2": shed * (G + compute_params),
                   "fsdp": shed * (G + 2 * compute_params)}[candidate.sharding]
    seconds = bytes_moved / cluster.link_bytes_per_s(shard, t * p)
    if shard < data:  # hybrid: the shards' gradients are all-reduced across the replicas
        replicas = data // shard
        seconds += 2 * (1 - 1 / replicas) * G / shard / cluster.link_bytes_per_s(replicas, t * p * shard)
    return seconds


def tensor_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Four activation all-reduces per block and step (two forward, two backward; two more when the
    forward is recomputed), on the layers this rank holds."""
    t = candidate.tensor
    if t == 1:
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    activation = work.tokens / data * spec.hidden * width
    per_block = 6 if checkpointing(candidate, work) == "full" else 4
    layers = math.ceil(spec.layers / candidate.pipeline)
    return per_block * layers * 2 * (1 - 1 / t) * activation / cluster.link_bytes_per_s(t)


def pipeline_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Activations forward and gradients back across each stage boundary."""
    t, p = candidate.tensor, candidate.pipeline
    if p == 1:
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    activation = work.tokens / data * spec.hidden * width
    return 2 * activation / cluster.link_bytes_per_s(p, t)


# --- layouts -----------------------------------------------------------------------------------------
def spec_layout_facts(spec: TransformerSpec, world: int) -> LayoutFacts:
    """The layout facts ``layouts.layout_facts`` finds on a built model, from the shape alone: tensor
    sizes must divide the heads and the key/value heads (``find_tp_plan``'s check); a pipeline stage
    needs a block; the first stage holds the embedding, the last the head and final norm."""
    n = spec.param_count
    facts = LayoutFacts(param_bytes=4 * n, hidden_size=spec.hidden, blocks=spec.layers)
    split_block = spec.block_params - 2 * spec.hidden
    facts.split_share = (spec.layers * split_block + spec.embedding_params + spec.head_params) / n
    sizes = [1] + divisors_above_one(world)
    for size in sizes[1:]:
        if spec.heads % size or spec.kv_heads % size:
            facts.unsupported[f"tp{size}"] = (f"{spec.heads} attention heads / {spec.kv_heads} key-value heads do "
                                              f"not divide by {size}")
        if spec.layers < size:
            facts.unsupported[f"pp{size}"] = f"{spec.layers} blocks cannot fill {size} stages"
    for t in sizes:
        for p in sizes:
            if world % (t * p) or facts.reason(t, p):
                continue
            facts.state_share[(t, p)] = _largest_stage(spec, t, p) / n
            facts.stage_block_share[p] = math.ceil(spec.layers / p) / spec.layers
    return facts


def _largest_stage(spec: TransformerSpec, t: int, p: int) -> float:
    per_stage = math.ceil(spec.layers / p)
    split_block = spec.block_params - 2 * spec.hidden
    block = (spec.block_params - split_block) + split_block / t
    first = per_stage * block + spec.embedding_params / t + (0 if p > 1 else spec.head_params / t + spec.hidden)
    last = per_stage * block + spec.head_params / t + spec.hidden + (spec.embedding_params / t if spec.tied else 0)
    return max(first, last)
