"""``atorch.plan``: rank the search's candidate strategies for a cluster you do not have.

The automatic search (``atorch/auto/search``) measures the machine it runs on, so it cannot tell
you, before you rent 64 H100s, which strategy to train a 70B model with or whether it fits. The
planner answers from the model's shape and the cluster's datasheet alone: it enumerates the same
candidates as the search (``candidates.enumerate_candidates``, with every pruning rule), predicts
each one's per-GPU memory and throughput analytically (``analytic.py``, which reuses the sharding
formulas of ``atorch/cost_model.py``, the cost model the search uses), and ranks those that fit by
tokens/s per GPU. The top plan is a ``Strategy`` that ``auto_accelerate(load_strategy=...)``
accepts. Nothing is allocated and no GPU is needed.

    python -m atorch.plan --model llama3-8b --cluster 8xH100-96GB --global-batch 16 --seq-len 8192

For the machine you have, ``plan_measured`` takes the search's measurements
(``result.args.extras["search"].measured``) instead of a datasheet and predicts each candidate through
the search's own function (``cost_model.predict_measured``), so it reproduces the search's predictions.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.candidates import SHARDINGS, Candidate, SearchSpace, enumerate_candidates
from atorch.auto.search.topology import Topology, keep_tensor_in_node
from atorch.auto.strategy import Strategy
from atorch.cost_model import MeasuredProfile, fits_with_margin, predict_measured
from atorch.errors import InputError
from atorch.plan import elementwise  # noqa: F401  (atorch.plan.elementwise.elementwise_bytes, as the docs write it)
from atorch.plan.analytic import (
    AC_MODES,
    ATTENTIONS,
    EXPERT_DISPATCHES,
    FSDP_UNITS,
    GRAD_REDUCE_DTYPES,
    GRAD_SYNCS,
    OPTIMIZER_STATES,
    RANK_ORDERS,
    TIGHT_MEMORY_SHARE,
    Prediction,
    Workload,
    chunk_blocks,
    counted_per_stage,
    expert_tensor_size,
    predict,
    recomputed_block_share,
    spec_layout_facts,
    step_breakdown,
    tight_memory_note,
)
from atorch.plan.hardware_specs import ClusterSpec, DeviceSpec, cluster_spec
from atorch.plan.model_specs import TransformerSpec, model_spec
from atorch.utils.plotting import headless_pyplot

logger = logging.getLogger("atorch")

GIB = 2**30


@dataclass
class Plan:
    """Every candidate's prediction, best first (those that fit, by tokens/s per GPU), and why the
    others were not candidates."""

    model: TransformerSpec
    cluster: ClusterSpec
    workload: Workload
    predictions: list[Prediction]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> Optional[Prediction]:
        return next((p for p in self.predictions if p.fits), None)

    @property
    def applicable(self) -> Optional[Prediction]:
        """The best fitting plan atorch's methods can apply: selective checkpointing is ranked for
        comparison, but atorch's ``checkpoint`` method recomputes whole modules, not an op policy."""
        return next((p for p in self.predictions if p.fits and p.checkpointing != "selective"), None)

    @property
    def strategy(self) -> Optional[Strategy]:
        """The best applicable plan as a strategy for ``auto_accelerate(load_strategy=...)``; None if
        none fits."""
        best = self.applicable
        return best.candidate.strategy(self.cluster.world_size) if best else None

    def table(self, limit: Optional[int] = None) -> str:
        return format_plan(self, limit)

    def breakdown(self, prediction: Optional[Prediction] = None) -> dict[str, float]:
        """Where ``prediction``'s step goes (the best plan's if None; ``analytic.step_breakdown``): the
        workload it was ranked under, selective checkpointing's for a selective row."""
        prediction = prediction or self.best
        if prediction is None:
            raise InputError("no plan fits, so there is no best plan to break down; pass one of plan.predictions")
        work = self.workload
        if prediction.checkpointing == "selective":
            work = dataclasses.replace(work, activation_checkpointing="selective")
        facts = spec_layout_facts(self.model, self.cluster.world_size)
        return step_breakdown(prediction.candidate, self.model, self.cluster, work, facts)


def plan(model: Union[str, Mapping[str, Any], nn.Module, TransformerSpec],
         cluster: Union[str, Mapping[str, Any], ClusterSpec], global_batch: int, seq_len: int,
         excluded: Iterable[str] = (), device: Optional[Union[str, Mapping[str, Any], DeviceSpec]] = None, *,
         attention_span: Optional[int] = None,
         elementwise_bytes: Optional[tuple[float, float, float]] = None,
         optimizer_bytes_per_param: Optional[float] = None) -> Plan:
    """Rank the candidate strategies for ``model`` on ``cluster`` (see the module doc).

    ``model``: a built-in name (``llama3-8b``, ...), a transformers config.json path or dict, or an
    ``nn.Module`` built on the meta device. ``cluster``: ``"8xH100-96GB"``, ``"4x8xA100-80GB"`` or a
    dict (its device may be a dict of your own numbers). ``excluded``: method names to leave out.
    ``attention_span`` (packed documents attending within themselves), ``elementwise_bytes`` (the
    block's memory-bound traffic as your code writes it) and ``optimizer_bytes_per_param`` (your
    optimizer step's) as ``estimate`` takes them.
    """
    spec, cluster = model_spec(model), cluster_spec(cluster)
    if device is not None:
        cluster = cluster_spec({"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "device": device})
    _check_positive("global_batch", global_batch)
    _check_positive("seq_len", seq_len)
    _check_attention_span(attention_span, seq_len, "flash")
    _check_optimizer_bytes(optimizer_bytes_per_param)
    # the candidates are atorch's own strategies: its tensor_parallel gathers the logits whole on every
    # rank (the user's loss function reads them as one tensor), and a candidate's strategy names no
    # sequence_parallel, so the norms and the residual stream run whole on every tensor rank
    work = Workload(global_batch, seq_len, attention_span=attention_span,
                    elementwise_bytes=_elementwise_bytes(elementwise_bytes),
                    optimizer_bytes_per_param=optimizer_bytes_per_param, vocab_parallel_loss=False,
                    sequence_parallel=False)
    world = cluster.world_size
    facts = keep_tensor_in_node(spec_layout_facts(spec, world), Topology(cluster.nodes, cluster.gpus_per_node))
    profile = _profile(spec, facts)
    space = SearchSpace(world, torch.device("meta"), profile, frozenset(excluded), Strategy(),
                        max(global_batch // world, 1), cluster.gpus_per_node if cluster.nodes > 1 else 0)
    candidates, skipped = enumerate_candidates(space)
    kept = []
    for candidate in candidates:
        data = candidate.data_size(world)
        if global_batch % data:
            skipped[candidate.label] = f"the global batch {global_batch} does not split over {data} data ranks"
        else:
            kept.append(candidate)
    predictions = [predict(c, spec, cluster, work, facts) for c in kept]
    predictions += selective_predictions(kept, spec, cluster, work, facts)
    # fitting plans by throughput (equal throughput: less memory first), then the rest by memory
    predictions.sort(key=lambda p: (not p.fits, -round(p.tokens_per_s_per_gpu) if p.fits else 0, p.memory_bytes))
    return Plan(spec, cluster, work, predictions, skipped)


def plan_measured(measured: MeasuredProfile, candidates: Optional[Iterable[Candidate]] = None,
                  excluded: Iterable[str] = ()) -> list[Prediction]:
    """Rank candidates on the machine a search measured (``SearchResult.measured``), best first as
    ``plan`` ranks them: each predicted by ``cost_model.predict_measured``, the function the search's
    own estimates go through, so a candidate gets exactly the search's predicted memory and step time.

    ``candidates``: None enumerates the search's candidates again (its search space, less
    ``excluded``), leaving out those whose precision / checkpoint setting was not measured or failed
    alone; given ones using an ``excluded`` method are left out, and one with no usable measurement is
    an InputError. ``memory_bytes`` is the predicted per-rank peak, ``fits`` compares it, with the memory
    model's error to spare (``cost_model.MEMORY_MODEL_ERROR``, as the search does), with the
    search's memory limit; ``mfu`` is 0 (the machine's peak FLOPs are not measured)."""
    excluded = frozenset(excluded)
    if candidates is None:
        enumerated, _ = enumerate_candidates(measured.search_space(excluded))
        candidates = [c for c in enumerated if measured.predictable(c)]
    else:
        candidates = [c for c in candidates if not c.methods() & excluded]
    predictions = [measured_prediction(c, measured) for c in candidates]
    predictions.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else 0.0, p.memory_bytes))
    return predictions


def measured_prediction(candidate: Candidate, measured: MeasuredProfile) -> Prediction:
    """One candidate on the measured machine, as a ``Prediction`` (tokens/s per GPU from the per-rank
    batch of pure data parallelism: every layout trains the same global batch)."""
    guess = predict_measured(candidate, measured)
    tokens = measured.per_rank_batch * measured.profile.tokens_per_sample / guess.step_time_s
    return Prediction(candidate, guess.memory_bytes, guess.step_time_s, tokens, 0.0,
                      fits_with_margin(guess.memory_bytes, measured.hardware.memory_limit), notes=[guess.detail],
                      allocated_bytes=guess.memory_bytes, checkpointing="full" if candidate.checkpoint else "none")


def selective_predictions(candidates: list[Candidate], spec: TransformerSpec, cluster: ClusterSpec,
                          work: Workload, facts) -> list[Prediction]:
    """Every checkpointed candidate once more under selective checkpointing (the op policy torchtitan
    runs: matmul outputs kept, the rest recomputed), which often beats full recompute when it fits.
    No atorch method applies it, so ``Plan.strategy`` skips these; they show what it would buy."""
    selective = dataclasses.replace(work, activation_checkpointing="selective")
    return [predict(c, spec, cluster, selective, facts) for c in candidates if c.checkpoint]


# how a label names the checkpointing estimate() was given where it is not full (plan() ranks selective too)
CHECKPOINT_LABELS = {"selective": "sel-ckpt", "core_attention": "attn-ckpt"}


def plan_label(prediction: Prediction) -> str:
    """The candidate's label, with ``ckpt`` named ``sel-ckpt`` under selective checkpointing (``attn-ckpt``
    where only the attention core is recomputed)."""
    label = prediction.candidate.label
    named = CHECKPOINT_LABELS.get(prediction.checkpointing)
    return label.replace("ckpt", named) if named else label


# estimate()'s precision names -> the candidates' (amp: fp32 master weights, bf16 compute)
PRECISIONS = {"bf16": "amp_bf16", "fp16": "amp_fp16", "fp32": "fp32", "pure_bf16": "half_bf16", "fp8": "fp8"}
ESTIMATE_SHARDINGS = SHARDINGS + ("hsdp",)


def estimate(model: Union[str, Mapping[str, Any], nn.Module, TransformerSpec],
             cluster: Union[str, Mapping[str, Any], ClusterSpec], *, global_batch: int, seq_len: int,
             tensor: int = 1, pipeline: int = 1, sharding: str = "fsdp", precision: str = "bf16",
             activation_checkpointing: str = "none", micro_batch_size: Optional[int] = None,
             optimizer_states: str = "fp32", pipeline_ends_as_layers: bool = False, virtual_stages: int = 1,
             distributed_optimizer: bool = False, grad_sync: str = "last_micro_step",
             tp_comm_overlap: bool = False, grad_reduce_overlap: Optional[bool] = None,
             param_gather_overlap: Optional[bool] = None, pipeline_p2p_overlap: Optional[bool] = None,
             fused_swiglu: bool = False, grad_reduce_dtype: str = "fp32", attention: str = "flash",
             sequence_parallel: bool = True, half_grads_kept: bool = False, reduce_cast_copy: bool = False,
             stage_outputs_kept: bool = False, attention_span: Optional[int] = None,
             elementwise_bytes: Optional[tuple[float, float, float]] = None,
             optimizer_bytes_per_param: Optional[float] = None, grad_accumulation_bytes_per_param: float = 0.0,
             rank_order: str = "tensor-pipeline-data", vocab_parallel_loss: bool = True,
             saves_gathered_inputs: bool = False, context: int = 1, context_comm_overlap: bool = False,
             recompute_layers: Optional[int] = None, expert: int = 1, expert_tensor: Optional[int] = None,
             expert_comm_overlap: bool = False, expert_permute_fused: bool = False,
             expert_dispatch: str = "alltoall",
             pipeline_layout: Optional[str] = None, fsdp_units: str = "blocks_and_root") -> Prediction:
    """How fast and how big is the one configuration you name ("what I run today")?

    The same analytic model ``plan()`` ranks its candidates with, so a configuration that ``plan()``
    lists gets the same figures here. ``sharding``: ddp / zero1 (a distributed optimizer) / zero2 /
    fsdp / hsdp (fsdp inside a node, replicated across); ``precision``: bf16 / fp16 (autocast over fp32
    weights), pure_bf16, fp32 or fp8 (fp8 matmuls); ``activation_checkpointing``: none / selective
    (an op policy keeping the matmul outputs, torchtitan's) / full / core_attention (only the attention
    core recomputed: Megatron's ``--recompute-granularity selective``); ``micro_batch_size``: sequences
    per forward on one data rank (None: the whole per-rank batch, or the pipeline's default split);
    ``optimizer_states``: fp32 (fp32 master weights, gradients and Adam moments), bf16_moments (bf16
    Adam moments beside fp32 master weights) or bf16 (no fp32 copy: bf16 weights, gradients and
    moments, as Apex's DistributedFusedAdam with dtype=bf16);
    ``pipeline_ends_as_layers``: the pipeline split counts the embedding and the output layer as a block
    each, one block fewer on the first and the last stage (Megatron-Core's
    account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split);
    ``virtual_stages``: model chunks per pipeline stage (Megatron's interleaved schedule; 1: plain 1F1B);
    ``pipeline_layout``: an explicit split as Megatron-Core's ``pipeline_model_parallel_layout`` writes it
    ("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL": each chunk's layers, E the embedding, t a block, L the output layer
    and loss; it sets the chunks per stage, ``parse_pipeline_layout``);
    ``distributed_optimizer``: with ``sharding="zero1"``, Megatron's distributed optimizer (bf16 weights
    and the gradient buffer whole, fp32 master weights and moments sharded; reduce-scatter, then gather)
    also without tensor / pipeline parallelism, where zero1 is it anyway.

    Gradient accumulation, ``grad_sync``: "last_micro_step" (default: unsharded gradients kept until
    the last micro-step, reduced once, FSDP / zero2 keeping them in the reduce dtype; DDP's / FSDP's
    no_sync, atorch's micro_batch, Megatron) or
    "each_micro_step" (reduced, under sharding reduce-scattered, at every micro-step, so only one
    micro-batch's activations and sharded gradients stay between them: FSDP without no_sync, Composer).

    Communication overlapped with compute (each hides behind the compute it runs beside; only what
    exceeds it adds to the step): ``tp_comm_overlap`` the tensor-parallel collectives beside the block's
    matmuls (Megatron-Core's --tp-comm-overlap, torchtitan's async TP; default False, as in both);
    ``grad_reduce_overlap`` / ``param_gather_overlap`` the data dimension's gradient reduction beside
    the backward, its parameter gathers beside the forward (default None, the framework's: on for ddp,
    fsdp, hsdp and zero2, DDP's bucketed all-reduce and FSDP's backward_prefetch=BACKWARD_PRE /
    FSDP2's prefetch; off for the distributed optimizer, Megatron's --overlap-grad-reduce and
    --overlap-param-gather default); ``pipeline_p2p_overlap`` the stages' sends and receives (default
    None: on under the interleaved schedule, off under plain 1F1B, Megatron-Core's overlap_p2p_comm).

    ``fused_swiglu``: a gated MLP's activation runs as one fused kernel that saves only its input
    (Megatron-Core's bias_swiglu_fusion): 3 intermediate widths saved per token instead of eager
    SwiGLU's 4. ``grad_reduce_dtype``: the dtype gradients are reduced in, "fp32" (default; Megatron's
    grad_reduce_in_fp32, torchtitan's FSDP reduce_dtype) or "bf16": the distributed optimizer's buffer
    in bf16 (half the buffer and half the reduce-scatter: sharding="zero1" under tensor / pipeline
    parallelism or with ``distributed_optimizer``), or FSDP / hsdp / zero2 reduce-scattering in bf16
    (MixedPrecision's reduce_dtype, which FSDP sets to the param dtype when not given: half the bytes
    reduced); refused for ddp, plain zero1 and fp32 training. ``attention``: "flash" (default: a fused
    kernel that never writes the scores; FlashAttention, SDPA, cuDNN) or "materialised" (the s x s
    scores written per head, as batched matmuls over the whole square with Megatron's fused softmax and
    attention dropout between them: more FLOPs, memory-bound traffic on the scores, and 5 bytes per head
    and key saved for backward).
    ``attention_span``: packed sequences whose documents attend only within themselves (variable-length
    flash attention, cu_seqlens / THD: NeMo's and torchtune's packed fine-tuning): the length of the
    document a token sits in, averaged over the tokens (sum of squared lengths over the sum of lengths);
    causal attention's FLOPs, and the MFU's attention term, go with it instead of ``seq_len`` (default
    None: each sequence is one document); at most ``seq_len``, and only with ``attention="flash"``.
    ``elementwise_bytes``: the block's memory-bound traffic as your code writes it, bytes per token (forward
    and backward, 16-bit compute) per element of the hidden size, the MLP's width and the key / value
    width: ``atorch.plan.elementwise.elementwise_bytes(YourBlock)`` counts it from the block's own ops (an
    eager fp32 RMSNorm and rotary move several times what fused kernels do); default None: fused kernels,
    or, for a model given as an ``nn.Module``, its own block's traffic counted on the meta device.
    ``optimizer_bytes_per_param``: the optimizer step's traffic as your optimizer makes it, bytes per
    parameter updated (``atorch.plan.elementwise.optimizer_step_bytes(lambda ps: torch.optim.AdamW(ps))``;
    torch's foreach AdamW 56); default None: a fused Adam's (30 with fp32 states).
    ``sequence_parallel``: under tensor parallelism the norms, residual adds and dropout split over the
    sequence (default True, Megatron's --sequence-parallel, torchtitan); False runs and keeps them whole on
    every tensor rank (Megatron before sequence parallelism; ``plan()``'s candidates, whose strategies name
    tensor_parallel without sequence_parallel).

    What a framework keeps that Megatron-Core frees (all default False): ``half_grads_kept``, the
    model's own bf16 gradients stay allocated beside the distributed optimizer's fp32 buffer through the
    next forward (DeepSpeed's BF16 optimizer under its pipeline engine: 2 more bytes per parameter; only
    with that optimizer, ``sharding="zero1"`` under tensor / pipeline parallelism or with
    ``distributed_optimizer``, and a 16-bit ``precision``); ``stage_outputs_kept``, each pipeline stage
    keeps every in-flight micro-batch's output until its backward (DeepSpeed's pipeline engine;
    Megatron-Core frees the data once sent; only with ``pipeline`` > 1); ``reduce_cast_copy``, the data
    dimension all-reduces the distributed optimizer's fp32 gradient buffer through a 16-bit copy of it
    (DeepSpeed's engine: ``communication_data_type`` is bf16 under bf16), 2 bytes per parameter on top
    of the peak, since the activations' blocks stay cached (the same optimizer and precision as
    ``half_grads_kept``, with ``grad_reduce_dtype="fp32"``).
    ``grad_accumulation_bytes_per_param``: bytes per parameter every micro-batch's backward moves to add its
    gradients into the optimizer's buffer outside the weight-gradient matmuls, charged at HBM bandwidth once
    per micro-step over the parameters a GPU holds (default 0: the matmul writes the gradient in place, a
    fresh .grad or Megatron's gradient_accumulation_fusion; DeepSpeed's BF16 optimizer casts each bf16
    gradient to a new fp32 tensor and adds it into its fp32 buffer after every backward: 18).
    ``rank_order``: how ranks are laid out over the dimensions, fastest-varying first (consecutive ranks
    share a node): "tensor-pipeline-data" (default: atorch's own parallel_mode; Llama 3's [TP, CP, PP, DP])
    or "tensor-data-pipeline" (Megatron-LM / Megatron-Core, DeepSpeed's pipeline topology, torchtitan:
    the pipeline outermost). It decides which data groups and stage boundaries stay inside a node and
    how many ranks share a node's network.
    ``vocab_parallel_loss``: under tensor parallelism the loss runs on the vocabulary-split logits, each
    tensor rank holding 1/tp of them (default True: Megatron's vocab-parallel cross-entropy, torchtitan's
    loss_parallel); False gathers them whole on every rank first, as atorch's tensor_parallel does (your
    loss function reads one tensor), and as ``plan()`` counts its candidates.
    ``saves_gathered_inputs``: under sequence parallelism the column-parallel matmuls (the block's two
    after its norms, and the output layer) save the all-gathered input they ran on for their weight
    gradients (DTensor's ColwiseParallel: torchtitan, atorch's tensor_parallel with sequence_parallel);
    default False: Megatron saves the sequence shard and gathers it again in backward.
    ``context``: context parallelism, each sequence split over this many ranks (torch's context_parallel
    as torchtitan runs it, Megatron-Core's --context-parallel-size, Llama 3's CP), load-balanced for the
    causal mask; the data ranks are world / (tensor x pipeline x context), and FSDP, the distributed
    optimizer and the gradient reduction span data x context ranks, as in those frameworks. A rank's
    activations, logits and matmuls are its seq_len / context tokens'; its attention runs them against
    the whole sequence's keys, gathered from the context group in forward and backward (their gradients
    sent back): ``context_comm_overlap`` says whether that exchange hides behind the attention
    (Megatron-Core's ring, Transformer Engine's "p2p") or not (default False: torch's "allgather",
    torchtitan's default, and Llama 3's all-gather).
    ``recompute_layers``: with ``activation_checkpointing="full"``, only the first N blocks of each
    pipeline model chunk (of the model without a pipeline) are recomputed, the others keep all their
    activations (Megatron-Core's --recompute-method block --recompute-num-layers N); None: every block.
    ``expert``: expert parallelism for a Mixture-of-Experts model (Megatron-Core's
    --expert-model-parallel-size): each block's routed experts dealt out over this many ranks of the data
    (x context) dimension, each split over ``expert_tensor`` ranks (None: the tensor size, Megatron-Core's
    default), the tokens sent to their experts and back by all-to-all (exposed unless
    ``expert_comm_overlap``: Megatron-Core's overlap of one micro-batch's forward with another's backward,
    a forward's all-to-alls behind the backward's compute and the backward's behind the forward's). The
    expert group's ranks sit ``expert_tensor`` apart (Megatron-Core's expert grid), so a group folded over
    the tensor ranks spans whole nodes. A rank holds 1 / expert of the routed
    experts' weights and gradient buffers; their sharded states are the same bytes. Modelled for
    Megatron-Core's layouts (the distributed optimizer, or tensor / pipeline > 1).
    ``expert_permute_fused``: a Mixture-of-Experts block's routed tokens are grouped by expert inside the
    communication kernels, with no gather / scatter passes of their own (Megatron-Core's flex dispatcher on
    Hybrid-EP with moe_permute_fusion_into_hybridep; without it Hybrid-EP permutes in kernels of its own);
    default False: each token's copies are permuted into expert order and back by their own
    memory-bound kernels, forward and backward (Megatron-Core's alltoall dispatcher, torchtitan's and Hugging
    Face's index gathers; ``analytic.expert_permute_bytes``).
    ``expert_dispatch``: how the routed tokens reach their experts' ranks (``analytic.EXPERT_DISPATCHES``):
    "alltoall" (default: every routed copy to its expert's rank, Megatron-Core's alltoall dispatcher,
    torchtitan's all-to-all) or "hierarchical" (a token crosses to each remote node holding one of its
    experts once and is forwarded there over NVLink, the combine adding a node's outputs up before
    sending them back: DeepEP's normal kernels, Hybrid-EP; ``analytic.expert_copies``). Needs expert > 1
    with whole experts on each rank (expert_tensor 1).
    ``fsdp_units``: how FSDP groups the parameters into the units it gathers (``analytic.FSDP_UNITS``):
    "blocks_and_root" (default: each block a unit and the rest, embedding, final norm and output layer,
    the root's one unit, as atorch's fsdp and torchtitan before 2025-07 wrap them) or
    "embedding_and_head_apart" (the embedding, and the final norm with the output layer, units of their own:
    torchtitan since 2025-07-28), where the largest gathered unit is the larger of the two. Modelled for
    sharding fsdp / hsdp without tensor or pipeline parallelism (whose ranks count two gathered blocks).
    Returns a ``Prediction`` (``tokens_per_s_per_gpu``, ``mfu``, ``memory_bytes``, ``fits`` and the
    time breakdown)."""
    spec, cluster, candidate, work = configuration(
        model, cluster, global_batch=global_batch, seq_len=seq_len, tensor=tensor, pipeline=pipeline, sharding=sharding,
        precision=precision, activation_checkpointing=activation_checkpointing, micro_batch_size=micro_batch_size,
        optimizer_states=optimizer_states, pipeline_ends_as_layers=pipeline_ends_as_layers,
        virtual_stages=virtual_stages, distributed_optimizer=distributed_optimizer, grad_sync=grad_sync,
        tp_comm_overlap=tp_comm_overlap, grad_reduce_overlap=grad_reduce_overlap,
        param_gather_overlap=param_gather_overlap, pipeline_p2p_overlap=pipeline_p2p_overlap,
        fused_swiglu=fused_swiglu, grad_reduce_dtype=grad_reduce_dtype, attention=attention,
        sequence_parallel=sequence_parallel, half_grads_kept=half_grads_kept, stage_outputs_kept=stage_outputs_kept,
        reduce_cast_copy=reduce_cast_copy, attention_span=attention_span, elementwise_bytes=elementwise_bytes,
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        grad_accumulation_bytes_per_param=grad_accumulation_bytes_per_param, rank_order=rank_order,
        vocab_parallel_loss=vocab_parallel_loss, saves_gathered_inputs=saves_gathered_inputs, context=context,
        context_comm_overlap=context_comm_overlap, recompute_layers=recompute_layers, expert=expert,
        expert_tensor=expert_tensor, expert_comm_overlap=expert_comm_overlap,
        expert_permute_fused=expert_permute_fused, expert_dispatch=expert_dispatch, pipeline_layout=pipeline_layout,
        fsdp_units=fsdp_units)
    return predict(candidate, spec, cluster, work, spec_layout_facts(spec, cluster.world_size))


# Megatron-Core's pipeline_model_parallel_layout letters this planner counts (its "m", a multi-token
# prediction layer, is not modelled)
PIPELINE_LAYOUT_LETTERS = {"E": "the embedding", "t": "a block", "L": "the output layer and the loss"}


def parse_pipeline_layout(layout: str, pipeline: int, layers: int) -> tuple[int, ...]:
    """Megatron-Core's ``pipeline_model_parallel_layout`` string as the blocks of each model chunk, in model
    order (chunk i runs on stage i mod ``pipeline``, its ``i // pipeline``-th chunk there). The string
    lists the chunks separated by ``|``, each as its layers' letters (``PIPELINE_LAYOUT_LETTERS``);
    ``x*n`` repeats a letter, ``(...)*n`` a group, commas are cosmetic: "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"
    (Megatron-Bridge's Llama 3 70B on 8 stages x 5 chunks). The embedding must open the first chunk and
    the loss close the last, each once; the blocks must be the model's; the chunks a multiple of the
    stages."""
    if not isinstance(layout, str) or not layout.strip():
        raise InputError(f"pipeline_layout={layout!r} is not a layout string: give Megatron-Core's "
                         "pipeline_model_parallel_layout, e.g. 'Et*2|(t*2|)*38,t*2L'")
    text = layout.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"([^()|*\d])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    bad = sorted({c for c in text if c != "|" and c not in PIPELINE_LAYOUT_LETTERS})
    if bad:
        valid = ", ".join(f"{k} ({v})" for k, v in PIPELINE_LAYOUT_LETTERS.items())
        raise InputError(f"pipeline_layout={layout!r}: {bad} not understood; the letters are {valid}, with "
                         "'|' between chunks, x*n and (...)*n repeats (a multi-token prediction layer, m, is not "
                         "modelled)")
    chunks = text.split("|")
    if len(chunks) % pipeline:
        raise InputError(f"pipeline_layout={layout!r} has {len(chunks)} chunks, not a multiple of pipeline={pipeline}")
    if not text.startswith("E") or text.count("E") != 1 or not text.endswith("L") or text.count("L") != 1:
        raise InputError(f"pipeline_layout={layout!r}: the embedding (E) must open the first chunk and the loss "
                         "(L) close the last, each once")
    if text.count("t") != layers:
        raise InputError(f"pipeline_layout={layout!r} places {text.count('t')} blocks (t); the model has {layers}")
    return tuple(chunk.count("t") for chunk in chunks)


def _layout_virtual_stages(layout: str, chunks: tuple[int, ...], pipeline: int, virtual_stages: int,
                           ends_as_layers: bool) -> int:
    """The layout's chunks per stage, which ``virtual_stages`` may repeat but not contradict; it places the
    embedding and the loss itself, so ``pipeline_ends_as_layers`` has nothing to add."""
    per_stage = len(chunks) // pipeline
    if virtual_stages not in (1, per_stage):
        raise InputError(f"virtual_stages={virtual_stages} contradicts pipeline_layout={layout!r}: "
                         f"{len(chunks)} chunks over pipeline={pipeline} are {per_stage} a stage")
    if ends_as_layers:
        raise InputError("pipeline_ends_as_layers=True is not valid with pipeline_layout: the layout places the "
                         "embedding and the loss itself")
    return per_stage


def _check_grad_reduce_dtype(dtype: str, sharding: str, precision: str, tensor: int, pipeline: int,
                             distributed_optimizer: bool) -> None:
    """A bf16 gradient reduction exists where gradients are reduced into a buffer or a shard of their own
    dtype: the distributed optimizer's buffer, FSDP's / zero2's reduce-scatter (MixedPrecision's
    reduce_dtype); DDP and ZeRO-1 without it reduce the fp32 gradients themselves."""
    if dtype == "fp32":
        return
    reduced_in_its_own_dtype = sharding in ("fsdp", "hsdp", "zero2") or (
        sharding == "zero1" and (tensor * pipeline > 1 or distributed_optimizer))
    if not reduced_in_its_own_dtype:
        raise InputError(f"grad_reduce_dtype={dtype!r} is not valid with sharding={sharding!r}, tensor={tensor}, "
                         f"pipeline={pipeline}: it is the dtype of the distributed optimizer's gradient buffer or of "
                         "FSDP's / zero2's reduce-scatter; keep grad_reduce_dtype='fp32' there, or give sharding "
                         "'fsdp', 'hsdp' or 'zero2', or 'zero1' with tensor / pipeline > 1 or distributed_optimizer")
    if precision == "fp32":
        raise InputError(f"grad_reduce_dtype={dtype!r} is not valid with precision='fp32': fp32 training is "
                         "modelled reducing its fp32 gradients; give grad_reduce_dtype='fp32' or a 16-bit precision")


def configuration(model: Any, cluster: Any, *, global_batch: int, seq_len: int, tensor: int = 1, pipeline: int = 1,
                  sharding: str = "fsdp", precision: str = "bf16", activation_checkpointing: str = "none",
                  micro_batch_size: Optional[int] = None, optimizer_states: str = "fp32",
                  pipeline_ends_as_layers: bool = False, virtual_stages: int = 1, distributed_optimizer: bool = False,
                  grad_sync: str = "last_micro_step", tp_comm_overlap: bool = False,
                  grad_reduce_overlap: Optional[bool] = None, param_gather_overlap: Optional[bool] = None,
                  pipeline_p2p_overlap: Optional[bool] = None, fused_swiglu: bool = False,
                  grad_reduce_dtype: str = "fp32", attention: str = "flash", sequence_parallel: bool = True,
                  half_grads_kept: bool = False, stage_outputs_kept: bool = False, reduce_cast_copy: bool = False,
                  attention_span: Optional[int] = None, elementwise_bytes: Optional[tuple[float, float, float]] = None,
                  optimizer_bytes_per_param: Optional[float] = None, grad_accumulation_bytes_per_param: float = 0.0,
                  rank_order: str = "tensor-pipeline-data", vocab_parallel_loss: bool = True,
                  saves_gathered_inputs: bool = False, context: int = 1, context_comm_overlap: bool = False,
                  recompute_layers: Optional[int] = None, expert: int = 1, expert_tensor: Optional[int] = None,
                  expert_comm_overlap: bool = False, expert_permute_fused: bool = False,
                  expert_dispatch: str = "alltoall", pipeline_layout: Optional[str] = None,
                  fsdp_units: str = "blocks_and_root") -> tuple[TransformerSpec, ClusterSpec, Candidate, Workload]:
    """``estimate``'s arguments checked and turned into the planner's candidate and workload (for
    callers that adjust the workload further, such as the published-runs benchmark)."""
    spec, cluster = model_spec(model), cluster_spec(cluster)
    _check_positive("global_batch", global_batch)
    _check_positive("seq_len", seq_len)
    _check_choice("sharding", sharding, ESTIMATE_SHARDINGS, SHARDING_NAMES_ELSEWHERE)
    _check_choice("precision", precision, tuple(PRECISIONS))
    if precision == "fp8" and not cluster.device.fp8_flops:
        raise InputError(f"precision='fp8' is not valid on {cluster.device.name}: it has no fp8 tensor cores "
                         "(fp8_flops 0); choose one of ['bf16', 'fp16', 'pure_bf16', 'fp32'] there")
    _check_choice("activation_checkpointing", activation_checkpointing, AC_MODES)
    _check_choice("optimizer_states", optimizer_states, OPTIMIZER_STATES)
    _check_choice("grad_sync", grad_sync, GRAD_SYNCS)
    _check_choice("grad_reduce_dtype", grad_reduce_dtype, GRAD_REDUCE_DTYPES)
    _check_choice("attention", attention, ATTENTIONS)
    _check_choice("rank_order", rank_order, RANK_ORDERS)
    _check_attention_span(attention_span, seq_len, attention)
    _check_context(context, seq_len, attention, context_comm_overlap)
    elementwise_bytes = _elementwise_bytes(elementwise_bytes)
    _check_optimizer_bytes(optimizer_bytes_per_param)
    _check_accumulation_bytes(grad_accumulation_bytes_per_param)
    for name, value in (("tp_comm_overlap", tp_comm_overlap), ("distributed_optimizer", distributed_optimizer),
                        ("pipeline_ends_as_layers", pipeline_ends_as_layers), ("fused_swiglu", fused_swiglu),
                        ("sequence_parallel", sequence_parallel), ("half_grads_kept", half_grads_kept),
                        ("reduce_cast_copy", reduce_cast_copy), ("vocab_parallel_loss", vocab_parallel_loss),
                        ("saves_gathered_inputs", saves_gathered_inputs),
                        ("stage_outputs_kept", stage_outputs_kept), ("context_comm_overlap", context_comm_overlap)):
        _check_flag(name, value, (True, False))
    for name, value in (("grad_reduce_overlap", grad_reduce_overlap), ("param_gather_overlap", param_gather_overlap),
                        ("pipeline_p2p_overlap", pipeline_p2p_overlap)):
        _check_flag(name, value, (None, True, False))
    if distributed_optimizer and sharding != "zero1":
        raise InputError(f"distributed_optimizer=True is not valid with sharding={sharding!r}: the distributed "
                         "optimizer is zero1's sharding; give sharding='zero1'")
    world = cluster.world_size
    data = _check_layout(spec, cluster, tensor, pipeline, context)
    _check_grad_reduce_dtype(grad_reduce_dtype, sharding, precision, tensor, pipeline, distributed_optimizer)
    _check_kept(sharding, precision, tensor, pipeline, distributed_optimizer, half_grads_kept, stage_outputs_kept,
                reduce_cast_copy, grad_reduce_dtype)
    _check_positive("virtual_stages", virtual_stages)
    chunks = None
    if pipeline_layout is not None:
        chunks = parse_pipeline_layout(pipeline_layout, pipeline, spec.layers)
        virtual_stages = _layout_virtual_stages(pipeline_layout, chunks, pipeline, virtual_stages,
                                                pipeline_ends_as_layers)
    if virtual_stages > 1 and pipeline == 1:
        raise InputError(f"virtual_stages={virtual_stages} is not valid with pipeline=1: the interleaved schedule "
                         "splits each pipeline stage into model chunks; give pipeline > 1 or virtual_stages=1")
    ends = 2 if pipeline_ends_as_layers and pipeline > 1 else 0
    if pipeline * virtual_stages > spec.layers + ends and chunks is None:
        raise InputError(f"virtual_stages={virtual_stages} is not valid: {spec.layers} blocks cannot fill "
                         f"{pipeline} stages x {virtual_stages} chunks")
    if global_batch % data:
        split = f" / context {context}" if context > 1 else ""
        raise InputError(f"global_batch={global_batch} does not split over {data} data ranks "
                         f"(world {world} / tensor {tensor} / pipeline {pipeline}{split})")
    per_rank = global_batch // data
    micro = 1
    if micro_batch_size is not None:
        _check_positive("micro_batch_size", micro_batch_size)
        if per_rank % micro_batch_size:
            raise InputError(f"micro_batch_size={micro_batch_size} does not divide the per-data-rank batch {per_rank}")
        micro = per_rank // micro_batch_size if pipeline == 1 else 1  # a pipeline splits its batch itself
    shard = 0
    if sharding == "hsdp":
        sharding, shard = "fsdp", (cluster.gpus_per_node if cluster.nodes > 1 else 0)
    # the candidate names the sync where atorch's micro_batch would run it (a split under fsdp / zero2)
    sync = grad_sync if micro > 1 and sharding in ("fsdp", "zero2") else "last_micro_step"
    candidate = Candidate(sharding, PRECISIONS[precision], activation_checkpointing != "none", block=spec.block,
                          tensor=tensor, pipeline=pipeline, micro=micro, shard=shard, grad_sync=sync)
    # under context parallelism a rank runs shards of the sequences: global_batch x context shards of
    # seq_len / context tokens over data x context ranks (Workload.context)
    work = Workload(global_batch * context, seq_len // context, activation_checkpointing,
                    micro_batch_size=micro_batch_size,
                    optimizer_states=optimizer_states, pipeline_ends_as_layers=bool(pipeline_ends_as_layers),
                    virtual_stages=virtual_stages, distributed_optimizer=distributed_optimizer,
                    sync_each_micro_step=grad_sync == "each_micro_step", tp_comm_overlap=tp_comm_overlap,
                    grad_reduce_overlap=grad_reduce_overlap, param_gather_overlap=param_gather_overlap,
                    pipeline_p2p_overlap=pipeline_p2p_overlap, fused_swiglu=fused_swiglu,
                    grad_reduce_dtype=grad_reduce_dtype, attention=attention, sequence_parallel=sequence_parallel,
                    half_grads_kept=half_grads_kept, stage_outputs_kept=stage_outputs_kept,
                    reduce_cast_copy=reduce_cast_copy, attention_span=attention_span,
                    elementwise_bytes=elementwise_bytes, optimizer_bytes_per_param=optimizer_bytes_per_param,
                    grad_accumulation_bytes_per_param=float(grad_accumulation_bytes_per_param),
                    rank_order=rank_order, vocab_parallel_loss=vocab_parallel_loss,
                    saves_gathered_inputs=saves_gathered_inputs, context=context,
                    context_comm_overlap=context_comm_overlap, pipeline_layout=chunks)
    if recompute_layers is not None:
        work = dataclasses.replace(work, recomputed_blocks=_recomputed_blocks(
            spec, work, pipeline, recompute_layers, activation_checkpointing))
    if expert != 1 or expert_tensor is not None or expert_comm_overlap is not False:
        _check_experts(spec, cluster.world_size, candidate, work, expert, expert_tensor, expert_comm_overlap)
        work = dataclasses.replace(work, expert=expert, expert_tensor=expert_tensor,
                                   expert_comm_overlap=expert_comm_overlap)
    if expert_permute_fused is not False:
        _check_flag("expert_permute_fused", expert_permute_fused, (True, False))
        if not spec.experts:
            raise InputError(f"expert_permute_fused=True is not valid: {spec.name} has no Mixture-of-Experts blocks "
                             "whose tokens are grouped by expert")
        work = dataclasses.replace(work, expert_permute_fused=True)
    if expert_dispatch != "alltoall":
        _check_expert_dispatch(candidate, work, expert_dispatch)
        work = dataclasses.replace(work, expert_dispatch=expert_dispatch)
    if fsdp_units != "blocks_and_root":
        _check_fsdp_units(fsdp_units, sharding, tensor, pipeline)
        work = dataclasses.replace(work, fsdp_units=fsdp_units)
    return spec, cluster, candidate, work


def _check_fsdp_units(units: Any, sharding: str, tensor: int, pipeline: int) -> None:
    """``fsdp_units`` is a choice, and says something only where FSDP gathers units on a data rank of the
    whole model."""
    _check_choice("fsdp_units", units, FSDP_UNITS)
    if sharding not in ("fsdp", "hsdp") or tensor * pipeline > 1:
        raise InputError(f"fsdp_units={units!r} is not valid with sharding={sharding!r}, tensor={tensor}, "
                         f"pipeline={pipeline}: it is modelled for FSDP's units over the whole model (sharding "
                         "'fsdp' or 'hsdp', tensor=1, pipeline=1); give fsdp_units='blocks_and_root' there")


def _check_expert_dispatch(candidate: Candidate, work: Workload, dispatch: Any) -> None:
    """A dispatch other than the all-to-all needs expert parallelism to carry, and is modelled with whole
    experts on each rank (Megatron-Core's flex dispatcher folds the expert tensor ranks into its group,
    which ``analytic.expert_copies`` does not count)."""
    _check_choice("expert_dispatch", dispatch, EXPERT_DISPATCHES)
    if work.expert == 1:
        raise InputError(f"expert_dispatch={dispatch!r} is not valid with expert=1: it says how expert parallelism "
                         "sends the tokens; give expert > 1, or expert_dispatch='alltoall'")
    split = expert_tensor_size(candidate, work)
    if split > 1:
        raise InputError(f"expert_dispatch={dispatch!r} is not valid with expert_tensor={split}: it is modelled "
                         "with whole experts on each rank; give expert_tensor=1, or expert_dispatch='alltoall'")


def _check_experts(spec: TransformerSpec, world: int, candidate: Candidate, work: Workload, expert: Any,
                   expert_tensor: Any, overlap: Any) -> None:
    """Expert parallelism needs experts to deal out, a size that divides them and the ranks of a pipeline
    stage with the expert tensor size, and one of the layouts it is modelled for; its two companion
    options need it."""
    _check_positive("expert", expert)
    _check_flag("expert_comm_overlap", overlap, (True, False))
    if expert == 1:
        named = "expert_tensor" if expert_tensor is not None else "expert_comm_overlap"
        raise InputError(f"{named} is not valid with expert=1: it belongs to expert parallelism; give expert > 1")
    if not spec.experts:
        raise InputError(f"expert={expert} is not valid: {spec.name} has no Mixture-of-Experts blocks to deal out")
    if spec.experts % expert:
        raise InputError(f"expert={expert} is not valid: it must divide the {spec.experts} experts of a block")
    if expert_tensor is not None:
        _check_positive("expert_tensor", expert_tensor)
    split = expert_tensor or candidate.tensor
    if (world // candidate.pipeline) % (expert * split):
        raise InputError(f"expert={expert} x expert_tensor={split} does not divide the {world // candidate.pipeline} "
                         f"ranks of a pipeline stage")
    if not counted_per_stage(candidate, work):
        raise InputError(f"expert={expert} is not valid with sharding={candidate.sharding!r} and tensor = pipeline "
                         "= 1: expert parallelism is modelled for Megatron-Core's layouts; give tensor or "
                         "pipeline > 1, or sharding='zero1' with distributed_optimizer=True")


def _recomputed_blocks(spec: TransformerSpec, work: Workload, pipeline: int, layers: Any, checkpointing: str) -> float:
    """The share of blocks ``recompute_layers`` recomputes, after checking it names a real block count of
    a full-checkpointing run (a count beyond a chunk's blocks would silently mean every block)."""
    _check_positive("recompute_layers", layers)
    if checkpointing != "full":
        raise InputError(f"recompute_layers={layers} is not valid with activation_checkpointing={checkpointing!r}: "
                         "it is the number of blocks of each pipeline chunk that full checkpointing recomputes; "
                         "give activation_checkpointing='full', or recompute_layers=None")
    largest = max(blocks for stage in chunk_blocks(spec, work, pipeline) for blocks in stage)
    if layers > math.ceil(largest):
        raise InputError(f"recompute_layers={layers} is not valid: the largest pipeline chunk holds "
                         f"{math.ceil(largest)} blocks; give at most that, or None to recompute every block")
    return recomputed_block_share(spec, work, pipeline, layers)


def _is_finite_number(value: Any) -> bool:
    """A real int or float (not a bool, which Python counts as an int) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_optimizer_bytes(value: Any) -> None:
    if value is None:
        return
    if not (_is_finite_number(value) and value > 0):
        raise InputError(f"optimizer_bytes_per_param={value!r} is not valid: give a positive number, the bytes one "
                         "optimizer step moves per parameter (atorch.plan.elementwise.optimizer_step_bytes counts "
                         "it), or None for a fused Adam")


def _check_accumulation_bytes(value: Any) -> None:
    if not (_is_finite_number(value) and value >= 0):
        raise InputError(f"grad_accumulation_bytes_per_param={value!r} is not valid: give a number >= 0, the bytes "
                         "per parameter each micro-batch's gradient accumulation moves outside the matmuls (0: "
                         "accumulated in place; DeepSpeed's BF16 optimizer: 18)")


def _elementwise_bytes(value: Any) -> Optional[tuple[float, float, float]]:
    """Three finite, non-negative byte counts (per hidden, MLP and key / value element) as a tuple, or None."""
    if value is None:
        return None
    valid = (isinstance(value, (tuple, list)) and len(value) == 3
             and all(_is_finite_number(v) and v >= 0 for v in value))
    if not valid:
        raise InputError(f"elementwise_bytes={value!r} is not valid: give three non-negative numbers, bytes per token "
                         "per element of the hidden size, the MLP's width and the key / value width (as "
                         "atorch.plan.elementwise.elementwise_bytes returns them), or None for fused kernels")
    return tuple(value)


def _check_attention_span(span: Optional[int], seq_len: int, attention: str) -> None:
    """Packed documents attend within themselves only through a variable-length fused kernel; a
    materialised score matrix is written whole whatever the mask, so a span there would hide the cost."""
    if span is None:
        return
    _check_positive("attention_span", span)
    if span > seq_len:
        raise InputError(f"attention_span={span} is not valid with seq_len={seq_len}: a document is at most the "
                         "packed sequence; give attention_span <= seq_len, or None for one document a sequence")
    if attention != "flash":
        raise InputError(f"attention_span={span} is not valid with attention={attention!r}: materialised attention "
                         "writes the whole s x s scores whatever the documents; give attention='flash' or "
                         "attention_span=None")


def _check_kept(sharding: str, precision: str, tensor: int, pipeline: int, distributed_optimizer: bool,
                half_grads_kept: bool, stage_outputs_kept: bool, reduce_cast_copy: bool,
                grad_reduce_dtype: str) -> None:
    """``half_grads_kept`` needs the distributed optimizer over 16-bit compute, ``reduce_cast_copy`` that
    and an fp32 buffer to cast, ``stage_outputs_kept`` a pipeline: elsewhere the buffer does not exist,
    and a flag that changed nothing would hide the mistake."""
    optimizer = sharding == "zero1" and (tensor * pipeline > 1 or distributed_optimizer)
    if reduce_cast_copy and not (optimizer and precision in ("bf16", "fp16", "fp8") and grad_reduce_dtype == "fp32"):
        raise InputError(f"reduce_cast_copy=True is not valid with sharding={sharding!r}, precision={precision!r}, "
                         f"tensor={tensor}, pipeline={pipeline}, grad_reduce_dtype={grad_reduce_dtype!r}: it is the "
                         "16-bit copy of the distributed optimizer's fp32 gradient buffer that the reduction "
                         "sends; give sharding='zero1' with tensor / pipeline > 1 or distributed_optimizer, "
                         "precision 'bf16', 'fp16' or 'fp8', and grad_reduce_dtype='fp32'")
    if half_grads_kept and not (optimizer and precision in ("bf16", "fp16", "fp8")):
        raise InputError(f"half_grads_kept=True is not valid with sharding={sharding!r}, precision={precision!r}, "
                         f"tensor={tensor}, pipeline={pipeline}: it is the 16-bit gradients kept beside the "
                         "distributed optimizer's fp32 buffer; give sharding='zero1' with tensor / pipeline > 1 or "
                         "distributed_optimizer, and precision 'bf16', 'fp16' or 'fp8'")
    if stage_outputs_kept and pipeline == 1:
        raise InputError("stage_outputs_kept=True is not valid with pipeline=1: it is the outputs a pipeline stage "
                         "keeps until their backward; give pipeline > 1")


def _check_context(context: Any, seq_len: int, attention: str, overlap: Any) -> None:
    """A context split needs a sequence that divides over it and a fused attention kernel (the
    exchange of key / value shards is a flash attention's); its overlap flag needs a split to act on."""
    _check_positive("context", context)
    if seq_len % context:
        raise InputError(f"context={context} is not valid with seq_len={seq_len}: each sequence is split over the "
                         "context ranks; give a context size that divides seq_len")
    if context > 1 and attention != "flash":
        raise InputError(f"context={context} is not valid with attention={attention!r}: context parallelism "
                         "exchanges key / value shards between flash attention kernels; give attention='flash' "
                         "or context=1")
    if overlap is True and context == 1:
        raise InputError("context_comm_overlap=True is not valid with context=1: it is the overlap of the context "
                         "group's key / value exchange; give context > 1")


def _check_layout(spec: TransformerSpec, cluster: ClusterSpec, tensor: int, pipeline: int, context: int = 1) -> int:
    """The data size of a tensor x pipeline (x context) layout, after the checks the planner's candidates
    pass."""
    _check_positive("tensor", tensor)
    _check_positive("pipeline", pipeline)
    world = cluster.world_size
    if world % (tensor * pipeline * context):
        layout = f"tensor={tensor} x pipeline={pipeline}" + (f" x context={context}" if context > 1 else "")
        raise InputError(f"{layout} does not divide the {world} GPUs of {cluster.label}")
    if spec.heads % tensor or spec.kv_heads % tensor:
        raise InputError(f"tensor={tensor} is not valid: it must divide {spec.heads} attention heads and "
                         f"{spec.kv_heads} key-value heads")
    if pipeline > spec.layers:
        raise InputError(f"pipeline={pipeline} is not valid: {spec.layers} blocks cannot fill {pipeline} stages")
    return world // (tensor * pipeline * context)


def _check_choice(name: str, value: Any, choices: tuple, elsewhere: Optional[Mapping[str, str]] = None) -> None:
    """``value`` among ``choices``, or an ``InputError`` naming them (and, for a name another framework
    gives one of them, ``elsewhere``, which)."""
    if value not in choices:
        hint = elsewhere.get(value) if elsewhere and isinstance(value, str) else None
        known = f" ({value!r} is {hint!r} here)" if hint else ""
        raise InputError(f"{name}={value!r} is not valid; choose one of {list(choices)}{known}")


# shardings other frameworks name otherwise: DeepSpeed's ZeRO-3, FSDP's ShardingStrategy names
SHARDING_NAMES_ELSEWHERE = {"zero3": "fsdp", "full_shard": "fsdp", "shard_grad_op": "zero2",
                            "hybrid_shard": "hsdp", "no_shard": "ddp"}


def _check_flag(name: str, value: Any, choices: tuple) -> None:
    """A switch: exactly True / False (or None, the framework's default, where ``choices`` has it); 1 or
    "yes" is refused rather than read as a truth value."""
    if not any(value is choice for choice in choices):
        raise InputError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def format_plan(result: Plan, limit: Optional[int] = None) -> str:
    spec, cluster, work = result.model, result.cluster, result.workload
    head = (f"model {spec.name}: {spec.param_count / 1e9:.2f} B parameters; cluster {cluster.label} "
            f"({cluster.device.memory_bytes / GIB:.1f} GiB per GPU); global batch {work.global_batch} x "
            f"{work.seq_len} tokens")
    header = (f"{'#':>3}  {'candidate':<34}{'tp':>4}{'pp':>4}{'dp':>5}{'GiB/GPU':>9}{'step s':>9}{'tok/s/GPU':>11}"
              f"{'MFU':>7}  fits")
    lines = [head, header, "-" * len(header)]
    rows = result.predictions[:limit] if limit else result.predictions
    for i, p in enumerate(rows, 1):
        c = p.candidate
        lines.append(f"{i:>3}  {plan_label(p):<34}{c.tensor:>4}{c.pipeline:>4}{c.data_size(cluster.world_size):>5}"
                     f"{p.memory_bytes / GIB:>9.1f}{p.step_time_s:>9.3f}{p.tokens_per_s_per_gpu:>11.0f}"
                     f"{p.mfu * 100:>6.1f}%  {_fits_label(p, cluster)}")
    if limit and len(result.predictions) > limit:
        lines.append(f"... {len(result.predictions) - limit} more")
    if any(_fits_label(p, cluster) == "tight" for p in rows):
        lines.append(f"tight: fits within {1 - TIGHT_MEMORY_SHARE:.0%} of the device's memory, where "
                     "published runs' peaks sat at about 1.1 x the planner's prediction (docs/plan.md)")
    if any(p.checkpointing == "selective" for p in rows):
        lines.append("sel-ckpt: selective checkpointing (an op policy: matmul outputs kept), ranked for comparison; "
                     "no atorch method applies it, so the top plan is the best fitting row without it")
    # the notes of the model or the device rather than of one row (an MoE model's, a thinly calibrated
    # device's), said once
    shared = dict.fromkeys(note for p in rows for note in p.notes if not note.startswith("tight:"))
    lines.extend(f"note: {note}" for note in shared)
    best = result.strategy
    lines.append(f"top plan (load_strategy): {_compact(best) if best is not None else 'none fits in memory'}")
    return "\n".join(lines)


def _fits_label(prediction: Prediction, cluster: ClusterSpec) -> str:
    """yes / no, or tight where a fitting plan is within ``TIGHT_MEMORY_SHARE`` of the device."""
    if not prediction.fits:
        return "no"
    return "tight" if tight_memory_note(prediction.memory_bytes, cluster.device.memory_bytes) else "yes"


def plot_plan(result: Plan, path: Union[str, Path]) -> Optional[Path]:
    """Tokens/s per GPU against memory per GPU, when matplotlib is installed (``.[plot]``)."""
    plt = headless_pyplot("plan plot")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in result.predictions:
        ax.scatter(p.memory_bytes / GIB, p.tokens_per_s_per_gpu, marker="o" if p.fits else "x")
        ax.annotate(plan_label(p), (p.memory_bytes / GIB, p.tokens_per_s_per_gpu), fontsize=6)
    ax.axvline(result.cluster.device.memory_bytes / GIB, linestyle="--", color="grey")
    ax.set_xlabel("predicted memory per GPU (GiB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(f"atorch plan: {result.model.name} on {result.cluster.label}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _compact(strategy: Strategy) -> str:
    return "[" + ", ".join(item.name if item.config is None else f"({item.name!r}, {item.config!r})"
                           for item in strategy) + "]"


def _profile(spec: TransformerSpec, facts) -> ModelProfile:
    n = spec.param_count
    return ModelProfile(n, 4 * n, n, 4 * n, 0, {spec.block: spec.layers}, {spec.block: int(4 * spec.block_params)}, {},
                        layouts=facts)


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}={value!r} is not valid: give a positive int")


__all__ = ["Plan", "plan", "plan_measured", "MeasuredProfile", "estimate", "format_plan", "plot_plan", "Candidate",
           "Prediction", "elementwise"]


class _CallablePackage(types.ModuleType):
    """``atorch.plan`` is this package and its main function at once: ``atorch.plan(model, cluster, ...)``
    calls ``plan``, while ``atorch.plan.estimate``, ``atorch.plan.plan_measured``, ``atorch.plan.elementwise``
    and ``import atorch.plan.elementwise`` reach the package, as the docs write them (with the function
    alone in its place, ``import atorch`` made each of those raise)."""

    def __call__(self, *args: Any, **kwargs: Any) -> "Plan":
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
