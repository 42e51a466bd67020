"""Analytical predictions for a cluster that is not here: the planner's cost model.

``atorch/cost_model.py`` (the search's cost model, shared with this one) turns one rank's
*measurements* into a candidate's memory and time. Nothing can be measured for an H100 cluster from a
CPU machine, so here the same candidates are predicted from the model's shape (``model_specs.py``)
and the device's datasheet (``hardware_specs.py``):

- memory: the sharding's effect on parameters, gradients and optimizer state is ``cost_model.estimate``'s
  own formula (fed with an analytical single-rank profile instead of a measured one); activations are
  counted per token and block (flash / SDPA attention), plus the logits the loss upcasts;
- time: compute is FLOPs / (peak x the device's efficiency); the data dimension's collectives run at
  NVLink speed inside a node and network speed across nodes. A collective that overlaps compute
  (``Workload``'s overlap options, each defaulting to its framework's default) hides behind the
  compute it is issued beside (a gradient reduction behind the backward it follows, a parameter gather
  behind the forward it precedes), and only what exceeds that window is exposed; one that does not
  overlap is added whole. Tensor-parallel collectives and pipeline sends are exposed unless their
  overlap option is on; the pipeline bubble is never hidden.

Every constant below says where it comes from; ``benchmarks/plan_vs_published.py`` compares the
predictions with published runs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.candidates import Candidate
from atorch.auto.search.layouts import LayoutFacts, divisors_above_one, micro_batches
from atorch.auto.search.measure import HardwareProfile, VariantProfile
from atorch.cost_model import estimate
from atorch.plan import calibration
from atorch.plan.hardware_specs import ClusterSpec
from atorch.plan.model_specs import TransformerSpec, groups_limit_routing

# The loss reads bf16 logits, upcasts them to fp32 and keeps their fp32 gradient: 2 + 4 + 4 bytes per
# logit (first principles; transformers and torchtitan both upcast before cross-entropy).
LOGIT_BYTES = 10
# torch's loss_parallel (torch/distributed/tensor/parallel/loss.py, read at torch 2.13): its log-softmax
# keeps the fp32 input, ``x - max`` and its ``exp`` at once beside the bf16 logits (2 + 4 + 4 + 4 = 14
# bytes per logit), its backward the saved log-probabilities, a zeroed gradient, their ``exp`` and the
# sum of both (4 x 4 = 16; the bf16 logits freed before backward, as torchtitan does): 16 at the peak
LOSS_PARALLEL_LOGIT_BYTES = 16
# Activation checkpointing: "none"; "selective", an op policy that keeps the matmul outputs and recomputes
# the rest (torchtitan's, fitted: ``selective activation share``); "full", each block's forward again in
# backward; "core_attention", only the attention core again (the scores, softmax, dropout and the value
# matmul), the rest kept: Megatron's ``--recompute-granularity selective`` (Korthikanti et al. 2022,
# section 5), which under materialised attention drops the saved scores, under flash attention only reruns
# the kernel (flash saves no scores)
AC_MODES = ("none", "selective", "full", "core_attention")
# What the optimizer keeps beside the weights: "fp32" master weights, gradients and Adam moments (the
# default of torch amp, FSDP and Megatron); "bf16_moments": fp32 master weights and gradients, bf16 Adam
# moments (Megatron-Core's --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16);
# "bf16": no fp32 copy at all, the optimizer updates the bf16 weights from bf16 gradients with bf16
# moments (Apex DistributedFusedAdam with dtype=bf16 and grad_sync_dtype=bf16, NeMo's ``optim.dtype:
# bf16``; the state ``pure_bf16`` training keeps).
OPTIMIZER_STATES = ("fp32", "bf16_moments", "bf16")
# How gradient accumulation synchronises: reduce (reduce-scatter under sharding) at every micro-step,
# keeping only sharded gradients between them (FSDP / DDP without no_sync, Composer), or keep unsharded
# gradients until the last micro-step and reduce once (DDP's and FSDP's no_sync, atorch's micro_batch,
# Megatron's gradient buffer)
GRAD_SYNCS = ("last_micro_step", "each_micro_step")
# The dtype of Megatron's gradient buffer, in which the distributed optimizer accumulates and
# reduce-scatters the gradients: fp32 (Megatron-Core's --accumulate-allreduce-grads-in-fp32 /
# DistributedDataParallelConfig.grad_reduce_in_fp32) or bf16, the parameters' own dtype (Megatron-Core's
# default; Megatron-Bridge's performance recipes set grad_reduce_in_fp32=False)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
# How attention runs: "flash", a fused kernel that never writes the s x s scores (FlashAttention, SDPA,
# cuDNN); "materialised", the scores written per head as batched matmuls with a (fused) softmax between
# them, as Megatron ran before flash attention (its fused scale-mask-softmax, then attention dropout)
ATTENTIONS = ("flash", "materialised")
# How ranks are laid out over the parallel dimensions, fastest-varying first (consecutive ranks share a
# node). "tensor-pipeline-data": atorch's own parallel_mode as its search builds it, and Llama 3's
# [TP, CP, PP, DP]; "tensor-data-pipeline": Megatron-LM / Megatron-Core ("tp-cp-ep-dp-pp"), DeepSpeed's
# PipeModelDataParallelTopology (axes pipe, data, model) and torchtitan's mesh (pp outermost, tp innermost)
RANK_ORDERS = ("tensor-pipeline-data", "tensor-data-pipeline")
# How an MoE block's tokens reach their experts' ranks. "alltoall": every routed copy is sent to its
# expert's rank (Megatron-Core's alltoall dispatcher, torchtitan's and Hugging Face's all-to-all), so a
# token goes k times, most of them through the network once the group spans nodes. "hierarchical": a token
# crosses to each remote node it has experts on once, to the rank of its own local index there, which
# forwards it over NVLink to each rank of that node holding one of its experts, and the combine adds a
# node's outputs up before sending them back (DeepEP's normal kernels, NVIDIA's Hybrid-EP: Megatron-Core's
# flex dispatcher; DeepEP's Hybrid-EP design notes: its RDMA buffer holds a rank's tokens once per remote
# node, and its combine pre-reduces within the node)
EXPERT_DISPATCHES = ("alltoall", "hierarchical")
# How FSDP groups the parameters into the units it gathers one at a time. "blocks_and_root": each block
# a unit, everything else (the embedding, the final norm and the output layer) the root's one unit
# (atorch's fsdp, torchtitan before 2025-07); "embedding_and_head_apart": the embedding and the final
# norm with the output layer are units of their own (torchtitan since its #1094, 83e6941, 2025-07-28:
# ``fully_shard(model.tok_embeddings)``, ``fully_shard([model.norm, model.output])``), so the largest
# unit gathered is the larger of the two, not both together
FSDP_UNITS = ("blocks_and_root", "embedding_and_head_apart")
# the shardings FSDP runs, with its mixed-precision policy and its gathers (zero2: FSDP without resharding
# after forward)
FSDP_KINDS = ("fsdp", "hsdp", "zero2")


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens over the whole cluster."""

    global_batch: int
    seq_len: int
    activation_checkpointing: Optional[str] = None  # None: the candidate's (off / full); or one of AC_MODES
    logit_bytes: int = LOGIT_BYTES                  # per logit, through the loss
    # under tensor parallelism the loss runs on the vocabulary-split logits (Megatron's vocab-parallel
    # cross-entropy, torchtitan's loss_parallel): each rank holds 1/tp of them; False: they are gathered
    # whole on every rank first (atorch's tensor_parallel, whose head outputs whole logits because the
    # user's loss function reads them as one tensor)
    vocab_parallel_loss: bool = True
    # per logit through a loss on vocabulary-split logits, where it differs: torch's loss_parallel
    # (DTensor) decomposes log-softmax and its backward into whole-size fp32 temporaries
    # (LOSS_PARALLEL_LOGIT_BYTES); None: ``logit_bytes``
    loss_parallel_logit_bytes: Optional[int] = None
    fp32_residual: Optional[bool] = None            # None: autocast over fp32 weights unless FSDP casts them
    micro_batch_size: Optional[int] = None          # sequences per forward on a data rank; None: the default split
    virtual_stages: int = 1                         # interleaved pipeline: model chunks per stage
    logits_kept: bool = False                       # the caller keeps the logits through backward (HF outputs)
    # gradient accumulation reduce-scatters every micro-step (Composer, FSDP2 by default) instead of
    # keeping unsharded gradients until the last one (atorch's micro_batch, DDP's no_sync)
    sync_each_micro_step: bool = False
    # zero1 is Megatron's distributed optimizer (bf16 weights and the gradient buffer whole, fp32 master
    # weights and Adam moments sharded) also without tensor / pipeline parallelism (Megatron-LM, NeMo)
    distributed_optimizer: bool = False
    # attention runs a Hopper-native kernel (cuDNN fused attention, which Transformer Engine prefers on
    # Hopper; FlashAttention-3) rather than FlashAttention-2
    hopper_attention: bool = False
    optimizer_states: str = "fp32"                  # one of OPTIMIZER_STATES
    # the pipeline split counts the embedding and the output layer with its loss as one block each, so the
    # first and the last stage hold one block fewer (Megatron-Core's account_for_embedding_in_pipeline_split
    # and account_for_loss_in_pipeline_split; Llama 3 405B's 126 blocks on 16 stages)
    pipeline_ends_as_layers: bool = False
    # an explicit split (Megatron-Core's pipeline_model_parallel_layout, ``parse_pipeline_layout``): the
    # blocks of each model chunk in model order, chunk i on stage i mod pipeline; the embedding on the
    # first stage, the output layer and the loss on the last. None: the even split (or the ends as blocks)
    pipeline_layout: Optional[tuple[int, ...]] = None
    # Communication overlapped with compute. ``tp_comm_overlap``: the tensor-parallel all-gathers and
    # reduce-scatters run beside the matmuls they feed (Megatron-Core's --tp-comm-overlap, torchtitan's
    # async TP; both off by default). ``grad_reduce_overlap`` / ``param_gather_overlap``: the data
    # dimension's gradient reduction runs beside the backward, its parameter gather beside the forward;
    # None is the framework's default: on for DDP (bucketed all-reduce in backward hooks) and FSDP / zero2
    # (reduce-scatter in backward, gathers prefetched: FSDP's backward_prefetch=BACKWARD_PRE and FSDP2's
    # implicit prefetch), off for Megatron's distributed optimizer (--overlap-grad-reduce and
    # --overlap-param-gather are off by default). ``pipeline_p2p_overlap``: the stages' sends and receives
    # run beside the next chunk's compute; None is Megatron-Core's default, on under the interleaved schedule
    # (overlap_p2p_comm) and off under plain 1F1B (blocking batched send / receive).
    tp_comm_overlap: bool = False
    grad_reduce_overlap: Optional[bool] = None
    param_gather_overlap: Optional[bool] = None
    pipeline_p2p_overlap: Optional[bool] = None
    # a gated MLP's activation runs as one fused kernel (Megatron-Core's bias_swiglu_fusion, on unless
    # --no-bias-swiglu-fusion) that saves only its input for backward: 3 intermediate widths kept per
    # token (gate and up, the product fed to the down projection) where eager SwiGLU keeps 4 (its
    # silu output too)
    fused_swiglu: bool = False
    # the distributed optimizer's gradient buffer, or the dtype FSDP / zero2 reduce-scatter gradients in
    # (FSDP's MixedPrecision reduce_dtype): one of GRAD_REDUCE_DTYPES
    grad_reduce_dtype: str = "fp32"
    attention: str = "flash"  # one of ATTENTIONS
    # under tensor parallelism the norms, residual adds and dropout run split over the sequence
    # (Megatron's --sequence-parallel, torchtitan); without it every tensor rank runs them whole and
    # keeps their activations whole
    sequence_parallel: bool = True
    # under sequence parallelism the column-parallel matmuls (the block's two after its norms, and the
    # output layer) save the all-gathered input they ran on for their weight gradients (DTensor's
    # ColwiseParallel: autograd keeps the replicated local tensor; torchtitan, atorch's tensor_parallel),
    # where Megatron saves the sequence shard and gathers it again in backward
    saves_gathered_inputs: bool = False
    # the blocks' saved activations under selective checkpointing relative to those of the eager block
    # the selective share was fitted on (torchtitan's, op-level); a compiled block's partitioner drops
    # the saved outputs its backward never reads (benchmarks/compiled_activations.py measures it)
    selective_saved_scale: float = 1.0
    # how FSDP's units group the parameters (FSDP_UNITS; ``apart_units_saving``)
    fsdp_units: str = "blocks_and_root"
    # DeepSpeed's BF16 optimizer (Megatron-DeepSpeed's ZeRO-1 equivalent): each micro-batch's bf16
    # gradients are added into the fp32 buffer and stay allocated on the parameters until the next
    # backward clears them (its pipeline engine calls update_hp_grads(clear_lp_grads=False) after every
    # backward), so the next forward's activation peak meets them: 2 more bytes per parameter held
    half_grads_kept: bool = False
    # a pipeline stage keeps each in-flight micro-batch's output tensor until that micro-batch's backward
    # (DeepSpeed's pipeline engine frees pipe_buffers['outputs'] only after it); Megatron-Core frees the
    # output's data once it is sent (deallocate_pipeline_outputs), keeping only its autograd node
    stage_outputs_kept: bool = False
    # DeepSpeed's engine all-reduces the BF16 optimizer's fp32 gradient buffer (one flat tensor, one
    # bucket) through a bf16 copy of it (allreduce_bucket: tensor.to(communication_data_type), which is
    # bf16 when bf16 is enabled): 2 bytes per parameter at the end of the step, when the activations are
    # freed but their blocks stay cached, so the allocator reserves a new segment that size beside them
    reduce_cast_copy: bool = False
    # packed sequences whose documents attend only within themselves (variable-length flash attention:
    # cu_seqlens / THD, NeMo's packed SFT): the document length a token sits in, averaged over the tokens
    # (sum L^2 / sum L), which causal attention's FLOPs go with instead of seq_len; None: one document
    attention_span: Optional[int] = None
    # the block's memory-bound traffic as its implementation writes it: bytes per token, forward and
    # backward, per element of the hidden size, the MLP's width and the key / value width, counted from
    # its ops (``atorch.plan.elementwise.elementwise_bytes``); None: the fused count (norms, rotary,
    # activation and residual adds each one kernel: ELEMENTWISE_HIDDEN_WIDTHS, ELEMENTWISE_FFN_WIDTHS)
    elementwise_bytes: Optional[tuple[float, float, float]] = None
    # the optimizer step's traffic as the run's optimizer makes it, bytes per parameter updated
    # (``atorch.plan.elementwise.optimizer_step_bytes``: torch's foreach AdamW 56, its for-loop one 84);
    # None: a fused Adam's (OPTIMIZER_BYTES_PER_PARAM by the state dtypes)
    optimizer_bytes_per_param: Optional[float] = None
    # bytes per parameter every micro-batch's backward moves to add its gradients into the optimizer's
    # buffer outside the weight-gradient matmuls: 0 where the matmul writes the gradient in place (a fresh
    # .grad, Megatron's gradient_accumulation_fusion into main_grad); DeepSpeed's BF16 optimizer calls
    # update_hp_grads after every backward: each bf16 gradient cast to a new fp32 tensor (read 2, write 4)
    # and added into the fp32 buffer (read 4 + 4, write 4), 18
    grad_accumulation_bytes_per_param: float = 0.0
    # one of RANK_ORDERS: which groups a node holds, so which collectives and sends stay on NVLink and how
    # many of a group's ranks share a node's network
    rank_order: str = "tensor-pipeline-data"
    # context parallelism: each sequence split over ``context`` ranks (torch's context_parallel,
    # Megatron-Core's --context-parallel-size, Llama 3's CP), load-balanced for the causal mask. The
    # planner counts such a run as it runs on a rank: ``global_batch`` and ``seq_len`` are then the
    # sequence shards (global batch x context shards of seq_len / context tokens, the data dimension's
    # ranks times context holding them, which FSDP and the distributed optimizer shard over and
    # gradients are reduced over, as the three frameworks do), each attending over the whole sequence,
    # ``seq_len`` x ``context`` keys; ``atorch.plan.configuration`` builds it from the full sequence
    context: int = 1
    # the context group's key / value exchange overlaps the attention it feeds (Megatron-Core's default
    # ring, Transformer Engine's cp_comm_type "p2p"); False: exposed (torch's "allgather" rotate method,
    # torchtitan's default; Llama 3's all-gather)
    context_comm_overlap: bool = False
    # under full checkpointing, the share of the blocks recomputed: Megatron-Core's block method
    # (--recompute-method block --recompute-num-layers N) recomputes the first N blocks of each pipeline
    # chunk and keeps all activations of the others; 1.0: every block (``recompute_layers`` in
    # ``atorch.plan.configuration`` sets it, ``recomputed_block_share``)
    recomputed_blocks: float = 1.0
    # expert parallelism (Megatron-Core's --expert-model-parallel-size): a Mixture-of-Experts block's
    # routed experts dealt out over ``expert`` ranks of the data (x context) dimension, each expert split
    # over ``expert_tensor`` ranks (--expert-tensor-parallel-size; None: the tensor size, Megatron-Core's
    # default), the tokens sent to their experts and back by all-to-all; ``expert_comm_overlap``: those
    # all-to-alls run beside another micro-batch's compute, a forward's beside a backward's and the other
    # way round (Megatron-Core's overlap_moe_expert_parallel_comm: ``paired_expert_exposure``)
    expert: int = 1
    expert_tensor: Optional[int] = None
    expert_comm_overlap: bool = False
    # the routed tokens are grouped by expert inside the communication kernels (Megatron-Core's flex
    # dispatcher on Hybrid-EP with moe_permute_fusion_into_hybridep): no permutation passes of their own
    # (``expert_permute_bytes``); False: gathered and scattered by kernels of their own (Megatron-Core's
    # alltoall dispatcher, its flex one otherwise, torchtitan's and Hugging Face's index gathers)
    expert_permute_fused: bool = False
    # how the routed tokens travel (EXPERT_DISPATCHES; ``expert_copies``)
    expert_dispatch: str = "alltoall"

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def sequence(self) -> int:
        """The length of a whole sequence: ``seq_len`` times the ranks of its context group."""
        return self.seq_len * self.context

    @property
    def attended(self) -> int:
        """The tokens' attention length: ``attention_span`` within packed documents, else the whole
        sequence (under context parallelism longer than a rank's shard of it)."""
        return min(self.attention_span or self.sequence, self.sequence)

    def overlaps(self, what: str, candidate: Candidate) -> bool:
        """Whether ``what`` (grad_reduce / param_gather / pipeline_p2p) overlaps compute: the option
        when set, else the framework's default (see the fields' comment)."""
        chosen = getattr(self, f"{what}_overlap")
        if chosen is not None:
            return bool(chosen)
        if what == "pipeline_p2p":
            return self.virtual_stages > 1
        return not megatron_optimizer(candidate, self)

    def syncs_each_micro_step(self, candidate: Candidate) -> bool:
        """Gradients reduced at every micro-step: the option, or the candidate's micro_batch grad_sync."""
        return self.sync_each_micro_step or candidate.grad_sync == "each_micro_step"


def data_stride(candidate: Candidate, work: Optional[Workload]) -> int:
    """Ranks between neighbours of a data group: the tensor group's size, times the pipeline's unless the
    pipeline is the outermost dimension (``Workload.rank_order``)."""
    if work is not None and work.rank_order == "tensor-data-pipeline":
        return candidate.tensor
    return candidate.tensor * candidate.pipeline


def pipeline_stride(candidate: Candidate, work: Workload, data: int) -> int:
    """Ranks between neighbouring pipeline stages: the tensor group's size, times the data dimension's
    when the pipeline is the outermost dimension (then every rank of a node sits in the same stage, and
    at each stage boundary they all send through the node's network at once)."""
    if work.rank_order == "tensor-data-pipeline":
        return candidate.tensor * data
    return candidate.tensor


def megatron_optimizer(candidate: Candidate, work: Workload) -> bool:
    """zero1 is Megatron's distributed optimizer under tensor / pipeline parallelism, and wherever the
    workload says so (``distributed_optimizer``)."""
    return candidate.sharding == "zero1" and (candidate.tensor * candidate.pipeline > 1 or work.distributed_optimizer)


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
    allocated_bytes: int = 0  # the live tensors at the peak; memory_bytes is what the allocator reserves
    checkpointing: str = "none"  # the activation checkpointing predicted: one of AC_MODES


def predict(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
            facts: Optional[LayoutFacts] = None) -> Prediction:
    """Per-GPU peak memory, step time, tokens/s per GPU and MFU of ``candidate`` (see the module doc)."""
    world = cluster.world_size
    allocated = predict_memory(candidate, spec, cluster, work, facts)
    memory = reserved_bytes(predict_memory(candidate, spec, cluster, work, facts, reserved=True))
    compute = compute_seconds(candidate, spec, cluster, work)
    comm = comm_seconds(candidate, spec, cluster, facts, work)
    step = compute + exposed_comm_seconds(candidate, spec, cluster, facts, work, compute)
    tokens = work.tokens / world / step
    fp8 = candidate.precision == "fp8" and cluster.device.fp8_flops
    peak = cluster.device.fp8_flops if fp8 else cluster.device.bf16_flops
    mfu = tokens * spec.model_flops_per_token(work.attended) / peak
    notes = [note for note in (tight_memory_note(memory, cluster.device.memory_bytes), moe_throughput_note(spec),
                               thin_calibration_note(cluster)) if note]
    return Prediction(candidate, int(memory), step, tokens, mfu, memory <= cluster.device.memory_bytes,
                      compute, comm, notes=notes, allocated_bytes=int(allocated),
                      checkpointing=checkpointing(candidate, work))


def memory_breakdown(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                     facts: Optional[LayoutFacts] = None) -> dict[str, float]:
    """Where one GPU's predicted peak goes, in bytes, ending with the peak ``predict`` reports. Under tensor /
    pipeline / expert parallelism or the distributed optimizer (``layout_memory``) the state part by part
    (``layout_state_parts``: the rank holding the largest stage) and the activations of the stage that
    holds the most; under pure data parallelism the search's cost model's one figure; then what the
    allocator holds beyond the live tensors (``cached_block_bytes``)."""
    allocated = predict_memory(candidate, spec, cluster, work, facts)
    peak = reserved_bytes(predict_memory(candidate, spec, cluster, work, facts, reserved=True))
    if counted_per_stage(candidate, work) or work.expert > 1:
        stated = fp8_state_candidate(candidate)
        data = candidate.data_size(cluster.world_size)
        parts = {name: b for name, b in layout_state_parts(stated, spec, work, facts, data).items() if b}
        at_step = parts.pop(STEP_MAIN_GRADS, 0.0)
        rest = allocated - sum(parts.values())  # the activations, or the main gradients where the step is the peak
        if at_step and at_step >= rest:
            parts[STEP_MAIN_GRADS] = rest
        else:
            parts["activations (the stage that holds the most)"] = rest
    else:
        parts = {"weights, gradients, optimizer states and activations": allocated}
    parts["the allocator's cached blocks beyond the live tensors"] = peak - allocated
    parts["peak"] = peak
    return parts


def step_breakdown(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                   facts: Optional[LayoutFacts] = None) -> dict[str, float]:
    """Where one GPU's step goes, seconds, in the order ``predict`` adds it up: the compute parts (the
    output layer's matmul is part of the weight matmuls), the host's launch floor, the pipeline's slowest
    stage and its bubble; then each collective before overlap, the share no compute hides, and the step.
    For people reading a prediction (``python -m atorch.plan --estimate``, the published-runs benchmark's
    ``--explain``), not for ranking."""
    data = candidate.data_size(cluster.world_size)
    parts = {"weight matmuls": matmul_seconds(candidate, spec, cluster, work),
             "  of which the output layer": head_matmul_seconds(candidate, spec, cluster, work),
             "attention": attention_seconds(candidate, spec, cluster, work),
             "memory-bound": memory_bound_seconds(candidate, spec, cluster, work, work.tokens / data),
             "optimizer": optimizer_seconds(candidate, spec, cluster, work),
             "gradient accumulation": accumulation_seconds(candidate, spec, cluster, work),
             "slowest stage's excess": head_stage_excess_seconds(candidate, spec, cluster, work)}
    compute = compute_seconds(candidate, spec, cluster, work)
    busy = compute / (1 + pipeline_bubble(candidate, work, data))
    summed = sum(v for k, v in parts.items() if not k.startswith(" "))
    parts["host launch floor (above the GPU's work)"] = max(0.0, busy - summed)
    parts["pipeline bubble"] = compute - busy
    parts["compute"] = compute
    parts.update({"data collectives": data_comm_seconds(candidate, spec, cluster, facts, work),
                  "tensor collectives": tensor_comm_seconds(candidate, spec, cluster, work),
                  "pipeline sends": pipeline_comm_seconds(candidate, spec, cluster, work),
                  "context exchange": context_comm_seconds(candidate, spec, cluster, work),
                  "expert all-to-all": expert_comm_seconds(candidate, spec, cluster, work)})
    exposed = exposed_comm_seconds(candidate, spec, cluster, facts, work, compute)
    parts["communication not hidden"] = exposed
    parts["step"] = compute + exposed
    return parts


def comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                 facts: Optional[LayoutFacts], work: Workload) -> float:
    """All communication of the step, hidden or not."""
    return (data_comm_seconds(candidate, spec, cluster, facts, work)
            + tensor_comm_seconds(candidate, spec, cluster, work)
            + pipeline_comm_seconds(candidate, spec, cluster, work)
            + context_comm_seconds(candidate, spec, cluster, work)
            + expert_comm_seconds(candidate, spec, cluster, work))


def exposed_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                         facts: Optional[LayoutFacts], work: Workload, compute: float) -> float:
    """The communication the compute does not hide. Each overlapped collective hides behind the compute
    of the phase it is issued in and adds only what exceeds it; a collective that does not overlap adds
    whole. Phases (one data rank, its ``m`` micro-steps, compute without the bubble split 1 : 2 + r
    between forward and backward, r the recomputed share):

    - FSDP / zero2 gather parameters in every micro-step's forward (and FSDP again in its backward);
      their gradients are reduced in every backward (``sync_each_micro_step``) or in the last one;
    - DDP reduces in the last backward; Megatron's distributed optimizer reduce-scatters there and
      gathers the parameters in the next step's first forward. Under the interleaved schedule a
      stage's model chunks finish their backward (start their forward) one round of micro-batches
      apart, so the window spans up to ``pipeline`` micro-batches rather than one;
    - tensor-parallel collectives hide behind the block's matmuls, pipeline sends behind the next chunk."""
    data = candidate.data_size(cluster.world_size)
    bubble = 1.0 + pipeline_bubble(candidate, work, data)
    busy = compute / bubble  # the GPU's own work, without the bubble
    steps = micro_steps(candidate, work, data)
    forward = busy / (3.0 + recomputed_share(candidate, work))
    backward = busy - forward
    gather, reduce = data_comm_parts(candidate, spec, cluster, facts, work)
    exposed = 0.0
    gather_overlaps = work.overlaps("param_gather", candidate)
    reduce_overlaps = work.overlaps("grad_reduce", candidate)
    if candidate.sharding in FSDP_KINDS and candidate.tensor * candidate.pipeline == 1:
        # per micro-step: gathers in forward (and, FSDP, backward), reductions in each or the last backward
        passes = 2 if candidate.sharding != "zero2" else 1
        fwd_gather = gather / steps / passes
        bwd_gather = gather / steps - fwd_gather
        each = work.syncs_each_micro_step(candidate)
        per_reduce = reduce / steps if each else 0.0
        last_reduce = reduce if not each else per_reduce
        if gather_overlaps:
            exposed += steps * max(0.0, fwd_gather - forward / steps)
        else:
            exposed += gather
        bwd = backward / steps
        if reduce_overlaps:
            hidden_gather = bwd_gather if gather_overlaps else 0.0
            exposed += (steps - 1) * max(0.0, hidden_gather + per_reduce - bwd)
            exposed += max(0.0, hidden_gather + last_reduce - bwd)
        else:
            exposed += reduce + (steps * max(0.0, bwd_gather - bwd) if gather_overlaps else 0.0)
    else:
        window = overlap_window(candidate, work, steps)
        exposed += max(0.0, gather - window * forward / steps) if gather_overlaps else gather
        exposed += max(0.0, reduce - window * backward / steps) if reduce_overlaps else reduce
    tensor = tensor_comm_seconds(candidate, spec, cluster, work)
    if work.tp_comm_overlap:
        tensor = max(0.0, tensor - matmul_seconds(candidate, spec, cluster, work))
    pipe = pipeline_comm_seconds(candidate, spec, cluster, work)
    if work.overlaps("pipeline_p2p", candidate):
        pipe = max(0.0, pipe - busy)
    context = context_comm_seconds(candidate, spec, cluster, work)
    if work.context_comm_overlap:
        context = max(0.0, context - attention_seconds(candidate, spec, cluster, work))
    experts = expert_comm_seconds(candidate, spec, cluster, work)
    if work.expert_comm_overlap:
        experts = paired_expert_exposure(experts, forward, backward, recomputed_share(candidate, work))
    return exposed + tensor + pipe + context + experts


def paired_expert_exposure(all_to_all: float, forward: float, backward: float, recomputed: float) -> float:
    """What of the expert all-to-alls Megatron-Core's overlap_moe_expert_parallel_comm leaves exposed: it
    runs one micro-batch's forward merged with another's backward, so a forward's dispatch and combine
    (2 of the 4 + 2 r passes, r the recomputed share) hide behind the backward's compute and the
    backward's (its own two and the recomputed forward's) behind the forward's; each side adds what
    exceeds its partner."""
    passes = 4.0 + 2.0 * recomputed
    forward_comm = all_to_all * 2.0 / passes
    return max(0.0, forward_comm - backward) + max(0.0, all_to_all - forward_comm - forward)


def overlap_window(candidate: Candidate, work: Workload, steps: int) -> float:
    """Micro-batches of compute a once-per-step reduction (gather) can hide behind: the last (first)
    one, or under the interleaved schedule (v chunks per stage) up to a round of ``pipeline``
    micro-batches, the chunks finishing (starting) a round apart: (v - 1) / v of a round plus 1 / v."""
    v = max(work.virtual_stages, 1)
    if candidate.pipeline == 1 or v == 1:
        return 1.0
    return min(candidate.pipeline, steps) * (v - 1) / v + 1 / v


def reserved_bytes(allocated: float) -> float:
    """What PyTorch's caching allocator holds at the live peak (what runs out of memory): freed blocks
    stay cached and split blocks fragment, so it may exceed the tensors alive. ``ALLOCATOR_RESERVE``
    says by how much; see its comment for why it is 1 here."""
    return allocated * ALLOCATOR_RESERVE


# A prediction that fits within this share of the device's memory is flagged tight: the published runs'
# peaks sit above the planner's (held out, at 0.91 of them on average in three unrelated stacks:
# docs/plan.md), so such a plan may not fit when it runs. A warning only; the prediction is unchanged.
TIGHT_MEMORY_SHARE = 0.9


# Published Mixture-of-Experts runs over the planner's throughput: the held-out H100 MoE rows of
# Megatron-Bridge (seven) and of Megatron-LM's own recipes (two; benchmarks/plan_vs_published.py) ran at
# these shares of the predicted tokens/s. Megatron-Bridge's tuned BF16 Qwen3 30B runs of 2026-07/08 (its
# overlap A/B and canonical recipe) and the plainest recipe row came near it (0.96-1.06); its performance
# archive's earlier recipes (FP8, pipelines, experts across nodes) ran further below it, by more than the
# planner counts (docs/plan.md). A warning only; the prediction is unchanged.
# tests/search/test_plan_calibration.py keeps it true.
MOE_PUBLISHED_SHARE = (0.70, 1.06)


# Devices whose efficiency is fitted on a single published run: the held-out runs on the same device ran
# at these shares of the predicted tokens/s (benchmarks/plan_vs_published.py: Blackwell's one held-out
# Megatron-Bridge run, TP 4 x PP 8 x CP 2 on 128 B200, and torchao's Float8 run on the 750 W part). A
# warning only; tests/search/test_plan_calibration.py keeps it true.
THIN_FAMILY_PUBLISHED_SHARE = {"blackwell": (0.78, 0.78), "blackwell 750W": (0.91, 0.91)}


def thin_calibration_note(cluster: ClusterSpec) -> Optional[str]:
    """The warning a prediction for a device fitted on one run carries (``THIN_FAMILY_PUBLISHED_SHARE``)."""
    device = cluster.device
    if device.efficiency is not None or device.family not in THIN_FAMILY_PUBLISHED_SHARE:
        return None
    low, high = THIN_FAMILY_PUBLISHED_SHARE[device.family]
    ran = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
    return (f"{device.name}: its efficiency is fitted on one published run, and the held-out run on it ran at "
            f"{ran} of the planner's tokens/s (docs/plan.md)")


def moe_throughput_note(spec: TransformerSpec) -> Optional[str]:
    """The warning an MoE model's prediction carries (``MOE_PUBLISHED_SHARE``)."""
    if not spec.experts:
        return None
    low, high = MOE_PUBLISHED_SHARE
    return (f"MoE: published Megatron-Core MoE runs ran at {low:.2f}-{high:.2f} of the planner's tokens/s, tuned "
            "recipes near it, earlier ones below (docs/plan.md); read this throughput as what a tuned stack reaches")


def tight_memory_note(memory: float, device_bytes: float) -> Optional[str]:
    """The warning a fitting prediction within ``TIGHT_MEMORY_SHARE`` of the device's memory carries."""
    if not TIGHT_MEMORY_SHARE * device_bytes < memory <= device_bytes:
        return None
    return (f"tight: {memory / device_bytes:.0%} of the device's memory; published runs' peaks sat at about "
            f"1.1 x the planner's prediction (docs/plan.md), so leave about a tenth free")


# The caching allocator's reservation over the live peak. Fitted as a constant on torchtitan's 128-GPU
# row (max reserved) beside the selective share on its 8-GPU row, it went to 1.0, its physical floor:
# the published reserved figures show no reservation beyond what the model counts live, so 1.0 until a
# run publishes both its max allocated and its max reserved.
ALLOCATOR_RESERVE = 1.0


# --- memory ------------------------------------------------------------------------------------------
def state_bytes(candidate: Candidate, spec: TransformerSpec, states: str = "fp32") -> tuple[float, float, float]:
    """Parameter, gradient and optimizer-state (Adam) bytes of the whole model, unsharded. Under amp the
    master weights, gradients and moments stay fp32 (``states``: see ``OPTIMIZER_STATES``; bf16 moments
    halve the last); pure half, or ``states="bf16"``, keeps everything in bf16."""
    n = spec.param_count
    if candidate.precision == "half_bf16" or (states == "bf16" and candidate.precision != "fp32"):
        return 2.0 * n, 2.0 * n, 4.0 * n
    return 4.0 * n, 4.0 * n, (4.0 if states == "bf16_moments" else 8.0) * n


def grad_buffer_bytes(candidate: Candidate, work: Workload, grads: float) -> float:
    """The gradients as the data dimension reduces them (the distributed optimizer's gradient buffer,
    FSDP's and zero2's reduce dtype): ``grads`` (fp32 gradients, as ``state_bytes`` counts them) unless
    that dtype is bf16 (``grad_reduce_dtype``) over fp32 gradients, then half of it."""
    fp32_grads = candidate.precision not in ("fp32", "half_bf16") and work.optimizer_states != "bf16"
    return grads / 2 if fp32_grads and work.grad_reduce_dtype == "bf16" else grads


def half_states(candidate: Candidate, work: Workload) -> Candidate:
    """The candidate as the state formulas see it: with ``optimizer_states="bf16"`` there is no fp32
    copy, so its weights, gradients and moments are counted as pure bf16 training's (the activations are
    still the candidate's own)."""
    if work.optimizer_states == "bf16" and candidate.precision.startswith("amp"):
        return dataclasses.replace(candidate, precision="half_bf16")
    return candidate


def checkpointing(candidate: Candidate, work: Workload) -> str:
    return work.activation_checkpointing or ("full" if candidate.checkpoint else "none")


def activation_bytes(candidate: Candidate, spec: TransformerSpec, work: Workload, tokens: float, *,
                     tensor: int = 1, layers: Optional[float] = None, in_flight: float = 1.0,
                     fp8: bool = False, head: bool = True) -> float:
    """Activations of ``tokens`` tokens (one data rank's share of the step) over ``layers`` blocks, with
    ``in_flight`` micro-batches of them alive at once (pipelines). Under fp8 the matmuls' inputs are
    saved as their fp8 casts (Transformer Engine keeps those for the weight gradient): 1 byte, not 2,
    where nothing else keeps them in bf16."""
    layers = spec.layers if layers is None else layers
    per_token = block_bytes_per_token(candidate, spec, work, tensor, fp8)
    width = 4 if candidate.precision == "fp32" else 2
    residual = 4 if residual_is_fp32(candidate, work) else width
    sequence = tensor if work.sequence_parallel else 1
    mode = checkpointing(candidate, work)
    selective = calibration.value("selective activation share") * work.selective_saved_scale
    kept = {"none": per_token, "selective": selective * per_token,
            "core_attention": per_token - materialised_saved_bytes(spec, work, tensor),
            "full": spec.hidden * residual / sequence}[mode]  # the block input, sequence-split too
    if mode == "full":  # the blocks not recomputed keep all their activations
        kept = work.recomputed_blocks * kept + (1 - work.recomputed_blocks) * per_token
    blocks = layers * kept * tokens * in_flight
    working = per_token * tokens * (2 if mode == "full" else 1)  # one block's backward (and its recompute)
    working += context_gather_bytes(candidate, spec, work, tokens, tensor)
    logits = loss_bytes(spec, work, tokens, tensor) if head else 0.0  # only the stage holding the head
    if head and gathers_whole(work, tensor):  # the output layer's gathered input, kept through the loss
        logits += tokens * spec.hidden * width
    # the loss's logits are freed before the first block's backward begins: the two peaks do not add
    return blocks + (working + logits if work.logits_kept else max(working, logits))


def block_bytes_per_token(candidate: Candidate, spec: TransformerSpec, work: Workload, tensor: int = 1,
                          fp8: bool = False) -> float:
    """Bytes one block keeps for its backward per token on a tensor rank (none checkpointed)."""
    width = 4 if candidate.precision == "fp32" else 2
    residual = 4 if residual_is_fp32(candidate, work) else width
    split = spec.split_activation_elements()
    unsplit = spec.block_activation_elements() - split  # norms and the residual stream
    if work.fused_swiglu and spec.gated:
        split -= spec.ffn  # the fused kernel does not save its silu output
    # tensor parallelism runs with sequence parallelism (Megatron, torchtitan): the norms and the
    # residual stream are split over the sequence, so every activation divides by the tensor size;
    # without it they are whole on every tensor rank
    sequence = tensor if work.sequence_parallel else 1
    per_token = split * width / tensor + unsplit * residual / sequence
    per_token += materialised_saved_bytes(spec, work, tensor)
    if fp8:
        # the two norm outputs and the MLP's activation output are saved only as the fp8 inputs of the
        # matmuls they feed; the attention output is saved twice, in bf16 by the attention (its backward
        # reads it) and in fp8 by the output projection
        per_token -= (2 * spec.hidden + spec.ffn) * (width - 1) / tensor
        per_token += spec.hidden / tensor
    if gathers_whole(work, tensor):  # the two norm outputs (their fp8 casts under fp8) saved gathered
        per_token += 2 * spec.hidden * (1 if fp8 else width) * (1 - 1 / tensor)
    return per_token


def materialised_saved_bytes(spec: TransformerSpec, work: Workload, tensor: int = 1) -> float:
    """What materialised attention saves per token beyond its inputs, per head and key: the softmax
    output, the dropout mask and the dropped-out probabilities (none under flash attention, or where the
    attention core is recomputed: ``core_attention``, which drops exactly these)."""
    if work.attention != "materialised":
        return 0.0
    return MATERIALISED_SAVED_BYTES * spec.heads * work.seq_len / tensor


def context_gather_bytes(candidate: Candidate, spec: TransformerSpec, work: Workload, tokens: float,
                         tensor: int = 1) -> float:
    """Context parallelism's transient in one block's attention backward: the other ranks' key and value
    shards gathered for ``tokens`` tokens of this rank's (in the compute dtype) and their gradients,
    accumulated in fp32 before they are sent back. Nothing is kept between blocks: each block's
    attention saves only its own shard."""
    if work.context == 1:
        return 0.0
    width = 4 if candidate.precision == "fp32" else 2
    return tokens * (work.context - 1) * 2 * local_kv_width(spec, tensor) * (width + 4)


def local_kv_width(spec: TransformerSpec, tensor: int) -> float:
    """A tensor rank's key (or value) width: its share of the key / value heads, at least one head
    (fewer key / value heads than tensor ranks are replicated)."""
    return max(spec.kv_dim / tensor, spec.head_dim)


def gathers_whole(work: Workload, tensor: int) -> bool:
    """Whether the column-parallel matmuls keep their sequence-gathered input whole for backward."""
    return tensor > 1 and work.sequence_parallel and work.saves_gathered_inputs


def cached_block_bytes(candidate: Candidate, spec: TransformerSpec, work: Workload, tokens: float, *,
                       tensor: int = 1, fp8: bool = False, head: bool = True) -> float:
    """What the caching allocator holds beyond the live tensors where the loss is the step's peak under
    full checkpointing: each checkpointed block's forward frees its activations as it goes, and their
    blocks stay cached in segments sized for a block's tensors; the loss's logits-sized tensors, larger
    than any of them, cannot be carved from those, so the allocator maps new segments beside them. One
    block's forward activations of ``tokens`` tokens then stay reserved at the peak (none where the
    loss is not the peak, or on a stage without the head)."""
    if not head or checkpointing(candidate, work) != "full" or work.logits_kept:
        return 0.0
    per_token = block_bytes_per_token(candidate, spec, work, tensor, fp8)
    if loss_bytes(spec, work, tokens, tensor) <= 2 * per_token * tokens:
        return 0.0
    return per_token * tokens


def loss_bytes(spec: TransformerSpec, work: Workload, tokens: float, tensor: int) -> float:
    """The loss's logits of ``tokens`` tokens at their peak: split on the vocabulary over the tensor ranks
    where the loss runs on the split logits (``vocab_parallel_loss``), else whole on every rank."""
    if tensor == 1 or not work.vocab_parallel_loss:
        return spec.vocab * tokens * work.logit_bytes
    return spec.vocab * tokens * (work.loss_parallel_logit_bytes or work.logit_bytes) / tensor


def residual_is_fp32(candidate: Candidate, work: Workload) -> bool:
    """Under autocast the weights stay fp32, so the embedding output and the residual stream (and the
    norms on it) are fp32; FSDP's mixed-precision policy casts the weights to bf16 first (fsdp, hsdp and
    zero2, which is FSDP without resharding after forward), and Megatron's distributed optimizer keeps the
    model itself in bf16 (its fp32 master weights live in the optimizer), so the residual stream is bf16
    under either."""
    if work.fp32_residual is not None:
        return work.fp32_residual
    if megatron_optimizer(candidate, work):
        return candidate.precision == "fp32"
    autocast_over_fp32 = candidate.precision.startswith("amp") and candidate.sharding not in FSDP_KINDS
    return candidate.precision == "fp32" or autocast_over_fp32


def fp8_state_candidate(candidate: Candidate) -> Candidate:
    """The candidate as the memory model counts its state: fp8 training keeps bf16 weights beside fp32
    master weights and moments, as amp_bf16 does (its fp8 weight copies are small beside them)."""
    return dataclasses.replace(candidate, precision="amp_bf16") if candidate.precision == "fp8" else candidate


def predict_memory(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                   facts: Optional[LayoutFacts] = None, reserved: bool = False) -> float:
    """Per-GPU peak bytes: the live tensors, or with ``reserved`` what the allocator holds then
    (``cached_block_bytes`` more). Data-parallel layouts go through ``cost_model.estimate`` with an
    analytical alone profile; tensor / pipeline layouts through ``layout_memory``. fp8 keeps bf16 state
    here (its fp8 weight copies are small beside the fp32 state) and saves its matmuls' inputs in fp8."""
    fp8 = candidate.precision == "fp8"
    candidate = fp8_state_candidate(candidate)
    world = cluster.world_size
    data = candidate.data_size(world)
    P, G, O = state_bytes(candidate, spec, work.optimizer_states)  # noqa: E741 (the docstring's P / G / O)
    if counted_per_stage(candidate, work) or work.expert > 1:
        return layout_memory(candidate, spec, work, facts, data, fp8, reserved)
    tokens = work.tokens / data
    if work.syncs_each_micro_step(candidate):  # one micro-batch's activations, no unsharded gradients kept
        tokens /= max(candidate.micro, 1)
        candidate = dataclasses.replace(candidate, micro=1)
    # autocast's bf16 weight copies stay alive to backward unless the matmuls run again there
    kept_casts = candidate.precision.startswith("amp") and checkpointing(candidate, work) in ("none", "core_attention")
    autocast_copies = 0.5 * P if kept_casts else 0.0
    act = activation_bytes(candidate, spec, work, tokens, fp8=fp8)
    stated = half_states(candidate, work)
    act += autocast_copies if stated is candidate else 0.0
    variant = VariantProfile(stated.precision, stated.checkpoint, work.global_batch // data,
                             int(P + G + O + act), 0.0, int(P), int(G), int(O))
    shard_group = shard_size(candidate, world)
    memory = estimate(stated, variant, shard_group, _profile(spec, P), _hardware(cluster)).memory_bytes
    cached = cached_block_bytes(candidate, spec, work, tokens / max(candidate.micro, 1), fp8=fp8) if reserved else 0.0
    memory -= apart_units_saving(stated, spec, work, shard_group, P)
    return memory + fp32_gather_bytes(candidate, spec, work, shard_group) + cached


def counted_per_stage(candidate: Candidate, work: Workload) -> bool:
    """Whether a rank's memory is counted as its stage's share of the model (``layout_memory``): under
    tensor / pipeline parallelism and Megatron's distributed optimizer; pure data parallelism goes
    through the search's cost model instead."""
    return candidate.tensor * candidate.pipeline > 1 or (candidate.sharding == "zero1" and work.distributed_optimizer)


def apart_units_saving(candidate: Candidate, spec: TransformerSpec, work: Workload, shard: int,
                       param_bytes: float) -> float:
    """What FSDP holds less where the embedding and the output layer are units of their own
    (``fsdp_units="embedding_and_head_apart"``): ``cost_model.estimate`` counts three of the largest unit
    gathered at once (a gathered unit, the prefetched next one and the unit's unsharded gradient), the
    root's remainder (embedding, final norm and output layer together) where that is larger than a block;
    apart, the largest unit is the larger of the embedding and the norm with the output layer."""
    if work.fsdp_units != "embedding_and_head_apart" or candidate.sharding not in ("fsdp", "hsdp") or shard <= 1:
        return 0.0
    per_param = param_bytes / max(spec.param_count, 1) * (0.5 if candidate.precision.startswith("amp") else 1.0)
    together = spec.embedding_params + spec.head_params + spec.hidden
    apart = max(spec.embedding_params, spec.head_params + spec.hidden)
    return 3 * per_param * (max(spec.block_params, together) - max(spec.block_params, apart))


def fp32_gather_bytes(candidate: Candidate, spec: TransformerSpec, work: Workload, shard: int) -> float:
    """FSDP without a mixed-precision policy (autocast over fp32 weights: ``fp32_residual``) gathers
    its units in fp32, twice the bf16 ``cost_model.estimate`` counts: a gathered unit, the prefetched next
    one and the unit's unsharded gradient, half of each again."""
    if not (candidate.sharding in ("fsdp", "hsdp") and shard > 1 and work.fp32_residual
            and half_states(candidate, work).precision.startswith("amp")):
        return 0.0
    root = spec.embedding_params + spec.head_params + spec.hidden
    return 3 * 0.5 * 4.0 * max(spec.block_params, root)


def layout_memory(candidate: Candidate, spec: TransformerSpec, work: Workload, facts: Optional[LayoutFacts],
                  data: int, fp8: bool = False, reserved: bool = False) -> float:
    """A tensor / pipeline rank's state (its share of the model) sharded over the data dimension as the
    sharding says: fsdp all of it (plus two gathered blocks), zero2 all of it plus its share's parameters
    whole in the compute dtype (FSDP2 without resharding after forward keeps them gathered through
    forward and backward: torchtitan's default under a pipeline) and its gradients until they are
    reduce-scattered (``unreduced_grads``),
    zero1 as Megatron's distributed optimizer (bf16 weights and fp32 gradients whole, fp32 master
    weights and Adam moments sharded), ddp none (plus its gradient buckets); and the activations of the
    micro-batches the schedule keeps in flight (1F1B: as many as stages on the first stage, plus one
    being received)."""
    t, p = candidate.tensor, candidate.pipeline
    micro = pipeline_micro_batches(candidate, work, data) if p > 1 else micro_steps(candidate, work, data)
    parts = layout_state_parts(candidate, spec, work, facts, data)
    at_step = parts.get(STEP_MAIN_GRADS, 0.0)  # alive at the optimizer step only, when the activations are not
    states = sum(parts.values()) - at_step
    tokens = work.tokens / data / micro
    if p > 1:
        # each stage's blocks times the micro-batches it holds (the first the most, the last the logits)
        act = max(activation_bytes(candidate, spec, work, tokens, tensor=t, layers=held_blocks(spec, work, p, k, micro),
                                   fp8=fp8, head=k == p - 1)
                  + kept_stage_outputs(candidate, spec, work, tokens, k, micro)
                  + (cached_block_bytes(candidate, spec, work, tokens, tensor=t, fp8=fp8, head=k == p - 1)
                     if reserved else 0.0) for k in range(p))
    else:
        act = activation_bytes(candidate, spec, work, tokens, tensor=t, fp8=fp8)
        act += cached_block_bytes(candidate, spec, work, tokens, tensor=t, fp8=fp8) if reserved else 0.0
    return states + max(act, at_step)


# Megatron's distributed optimizer over a bf16 gradient buffer casts its shard of the buffer to fp32 main
# gradients at the optimizer step (distrib_optimizer.py _copy_model_grads_to_main_grads:
# ``shard_main_param.grad = shard_model_grad.float()``), and its zero_grad at the next step's start sets them
# to None: they live beside the state at the step, after backward has freed the activations, never beside
# the activations (the peak is the larger of the two moments)
STEP_MAIN_GRADS = "fp32 main gradients (the rank's shard, at the optimizer step)"


def layout_state_parts(candidate: Candidate, spec: TransformerSpec, work: Workload, facts: Optional[LayoutFacts],
                       data: int) -> dict[str, float]:
    """``layout_memory``'s state, part by part (its docstring says what each sharding keeps), for the
    rank holding the largest stage."""
    t, p = candidate.tensor, candidate.pipeline
    P, G, O = state_bytes(candidate, spec, work.optimizer_states)  # noqa: E741 (the docstring's P / G / O)
    share = facts.state_share[(t, p)] if facts and (t, p) in facts.state_share else 1.0 / (t * p)
    if (work.pipeline_ends_as_layers or work.pipeline_layout) and p > 1:
        share = _largest_stage(spec, t, p, stage_blocks(spec, p, work)) / spec.param_count
    amp = half_states(candidate, work).precision.startswith("amp")
    micro = pipeline_micro_batches(candidate, work, data) if p > 1 else micro_steps(candidate, work, data)
    whole = whole_params_share(candidate, spec, work, share)  # what expert parallelism leaves a rank whole
    sharded = "weights, gradients and optimizer states (the rank's shard)"
    if candidate.sharding == "zero2" and data > 1:
        return {sharded: (P + G + O) * share / data,
                "weights gathered whole": (0.5 if amp else 1.0) * P * share * whole,
                "gradients before their reduce-scatter": unreduced_grads(candidate, spec, work, G * share * whole,
                                                                         micro)}
    if candidate.sharding in ("fsdp", "hsdp") and data > 1:
        block = rank_block_params(candidate, spec, work) * (2 if amp else P / spec.param_count)
        return {sharded: (P + G + O) * share / data, "two gathered blocks": 2 * block}
    if candidate.sharding == "zero1" and data > 1:
        weights = P / 2 if amp else P
        # a bf16 gradient buffer (grad_reduce_dtype): half the bytes, and the optimizer casts its own
        # shard of it to fp32 main gradients
        buffer = grad_buffer_bytes(candidate, work, G)
        main_grads = G / data if buffer < G else 0.0
        half_grads = P / 2 if amp and work.half_grads_kept else 0.0  # the parameters' own bf16 gradients
        cast_copy = buffer / 2 if amp and work.reduce_cast_copy and buffer == G else 0.0  # fp32 buffer, bf16 copy
        return {"weights": weights * whole * share, "gradient buffer": buffer * whole * share,
                "bf16 gradients kept": half_grads * whole * share,
                "the gradient buffer's bf16 copy": cast_copy * whole * share,
                STEP_MAIN_GRADS: main_grads * share,
                "fp32 master weights and optimizer states (the rank's shard)": ((P if amp else 0.0) + O) / data * share}
    return {"weights, gradients and optimizer states": (P + G + O) * share * whole,
            "gradient reduction buffers": G * share * whole if data > 1 else 0.0}


def unreduced_grads(candidate: Candidate, spec: TransformerSpec, work: Workload, grads: float,
                    micro_steps: int) -> float:
    """zero2's gradients not yet reduce-scattered, at their peak. Accumulated over ``micro_steps``
    before the one reduce-scatter: the rank's whole share (``grads``, the fp32 count), in the reduce
    dtype (FSDP2 upcasts each unsharded gradient it keeps to its policy's reduce dtype, fp32 under
    atorch's amp; ``grad_buffer_bytes``). Reduced at every backward (``sync_each_micro_step``, or a
    single pass): FSDP reduce-scatters each unit's gradients in its post-backward hook and frees
    them, so only a block's are whole at a time: in the compute dtype, and in the reduce dtype beside
    them where that differs (the reduce-scatter's input); the sharded sums are in the states."""
    amp = half_states(candidate, work).precision.startswith("amp")
    if micro_steps > 1 and not work.syncs_each_micro_step(candidate):
        return grad_buffer_bytes(candidate, work, grads)
    compute = 2.0 if amp else 4.0
    reduce_copy = 4.0 if amp and grad_buffer_bytes(candidate, work, 4.0) == 4.0 else 0.0
    return rank_block_params(candidate, spec, work) * (compute + reduce_copy)


def expert_tensor_size(candidate: Candidate, work: Workload) -> int:
    """The ranks each routed expert is split over: the workload's ``expert_tensor``, else the tensor size."""
    return work.expert_tensor or candidate.tensor


def rank_expert_params(candidate: Candidate, spec: TransformerSpec, work: Workload) -> float:
    """The routed-expert weights of one block a rank holds beyond what expert parallelism leaves it:
    without it every expert split over the tensor ranks; with it 1 / (expert x expert_tensor) of them."""
    held = spec.routed_expert_params / candidate.tensor
    return held - spec.routed_expert_params / (work.expert * expert_tensor_size(candidate, work))


def rank_block_params(candidate: Candidate, spec: TransformerSpec, work: Workload) -> float:
    """One block's parameters on a rank: its tensor share, less the routed experts expert parallelism
    deals to other ranks."""
    return spec.block_params / candidate.tensor - rank_expert_params(candidate, spec, work)


def whole_params_share(candidate: Candidate, spec: TransformerSpec, work: Workload, share: float) -> float:
    """The share of a rank's parameters (``share`` of the model: its tensor and pipeline share) it still
    holds under expert parallelism, where it holds them whole (weights, gradient buffers, gathered
    units): its stage's blocks' routed experts shrink to 1 / expert of them. Sharded states do not move:
    an expert's states are sharded over the data ranks that hold it, expert times fewer, so a rank keeps
    the same bytes of them."""
    if work.expert == 1 or not spec.experts:
        return 1.0
    blocks = max(stage_blocks(spec, candidate.pipeline, work))
    return 1.0 - blocks * rank_expert_params(candidate, spec, work) / (share * spec.param_count)


def kept_stage_outputs(candidate: Candidate, spec: TransformerSpec, work: Workload, tokens: float, stage: int,
                       micro: int) -> float:
    """The stage outputs ``stage`` keeps until their backward (``stage_outputs_kept``): one hidden-wide
    tensor per model chunk forward outstanding at its peak (``outstanding_chunks``), split over the
    tensor ranks only under sequence parallelism. The last stage sends nothing and keeps none."""
    p = candidate.pipeline
    if not work.stage_outputs_kept or stage == p - 1:
        return 0.0
    width = 4 if candidate.precision == "fp32" else 2
    sequence = candidate.tensor if work.sequence_parallel else 1
    return outstanding_chunks(p, max(work.virtual_stages, 1), stage, micro) * tokens * spec.hidden * width / sequence


def outstanding_chunks(pipeline: int, virtual: int, stage: int, micro: int) -> int:
    """Model chunk forwards ``stage`` has run whose backward has not run at its peak: 1F1B's p - k
    (``micro_batches_in_flight``), the interleaved schedule's 2 (p - k - 1) + (v - 1) p + 1; at most
    every micro-batch's chunks."""
    if virtual == 1:
        return int(min(micro_batches_in_flight(pipeline, 1, stage), micro))
    return min(2 * (pipeline - stage - 1) + (virtual - 1) * pipeline + 1, micro * virtual)


def stage_blocks(spec: TransformerSpec, pipeline: int, work: Optional[Workload] = None) -> list[int]:
    """Blocks on each pipeline stage: ceil(L / p) each, or, when the split counts the embedding and the
    output layer as a block each (``pipeline_ends_as_layers``), ceil((L + 2) / p) with one fewer on the
    first and the last stage."""
    if work and work.pipeline_layout and pipeline > 1:
        return [int(sum(chunks)) for chunks in chunk_blocks(spec, work, pipeline)]
    if not (work and work.pipeline_ends_as_layers) or pipeline < 2:
        return [math.ceil(spec.layers / pipeline)] * pipeline
    per = math.ceil((spec.layers + 2) / pipeline)
    return [per - 1] + [per] * (pipeline - 2) + [per - 1]


def held_blocks(spec: TransformerSpec, work: Workload, pipeline: int, stage: int, micro: int) -> float:
    """Blocks x micro-batches whose activations ``stage`` holds at its peak. 1F1B: its blocks times
    ``micro_batches_in_flight``. Interleaved (v chunks a stage, Megatron's order: chunk 0 for a round of
    ``pipeline`` micro-batches, then chunk 1, ...): the chunk forwards outstanding at the peak, 2 (p - k
    - 1) + (v - 1) p + 1, each holding its own chunk's blocks, so a chunk that holds only the embedding
    (or only the output layer and loss, ``pipeline_ends_as_layers``) holds none; at most all ``micro``
    micro-batches' chunks."""
    v = max(work.virtual_stages, 1)
    if v == 1:
        return stage_blocks(spec, pipeline, work)[stage] * min(micro_batches_in_flight(pipeline, 1, stage), micro)
    chunks = chunk_blocks(spec, work, pipeline)[stage]
    outstanding = outstanding_chunks(pipeline, v, stage, micro)
    return sum(chunks[(i // pipeline) % v] for i in range(outstanding))


def chunk_blocks(spec: TransformerSpec, work: Workload, pipeline: int) -> list[list[float]]:
    """Blocks of each model chunk, by stage: chunk j of stage k is the (j p + k)-th slice of the model.
    Evenly L / (p v) each; with ``pipeline_ends_as_layers`` the embedding and the output layer take a
    block's place at the two ends, so the very first and very last chunk hold one block fewer; an explicit
    ``pipeline_layout`` gives each chunk's own."""
    v = max(work.virtual_stages, 1)
    chunks = pipeline * v
    if work.pipeline_layout:
        return [[float(work.pipeline_layout[j * pipeline + k]) for j in range(v)] for k in range(pipeline)]
    if not work.pipeline_ends_as_layers:
        return [[spec.layers / chunks] * v for _ in range(pipeline)]
    per = (spec.layers + 2) / chunks
    return [[max(per - (j * pipeline + k == 0) - (j * pipeline + k == chunks - 1), 0.0) for j in range(v)]
            for k in range(pipeline)]


def micro_batches_in_flight(pipeline: int, virtual: int, stage: int = 0) -> float:
    """Micro-batches whose activations ``stage`` holds at its peak, in whole-stage units. 1F1B: its
    p - k - 1 warm-up forwards and the one whose backward it waits for, p - k on stage k (Narayanan et
    al. 2021; the first stage receives no activations, so none is in transit to it). Interleaved
    (Megatron's schedule, ``virtual`` chunks per stage): 2 (p - k - 1) + (v - 1) p warm-up chunks plus
    the one in flight, each 1/v of the stage: p + (p - 2k - 1) / v stages' worth (p + (p - 1) / v on the
    first, Korthikanti et al. 2022, section 4.2.3)."""
    if virtual > 1:
        return pipeline + (pipeline - 2 * stage - 1) / virtual
    return float(pipeline - stage)


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
    """A profile with the facts ``cost_model.estimate`` reads (the blocks: FSDP's units)."""
    scale = param_bytes / max(spec.param_count, 1)
    return ModelProfile(spec.param_count, int(param_bytes), spec.param_count, int(param_bytes), 0,
                        {spec.block: spec.layers}, {spec.block: int(spec.block_params * scale)}, {})


def _hardware(cluster: ClusterSpec) -> HardwareProfile:
    return HardwareProfile(cluster.device.name, cluster.device.memory_bytes, cluster.device.nvlink_bytes_per_s)


# --- time --------------------------------------------------------------------------------------------
# Bytes of memory-bound traffic (reads + writes) per token and block, forward and backward, in
# activation-width units, from counting the elementwise kernels of a pre-norm block (first principles,
# not fitted): two norms (read + write, x3 for forward + backward), two residual adds (read 2, write 1),
# rotary / dropout / casts on q, k, v and the output: about 30 hidden-widths; the MLP's activation
# (GELU: read + write, SwiGLU: read 2 + write 1) over the intermediate width, x3: 6 or 9 ffn-widths.
ELEMENTWISE_HIDDEN_WIDTHS = 30
ELEMENTWISE_FFN_WIDTHS = {True: 9, False: 6}  # gated (SwiGLU) or not
# Of those, the ones on the residual stream that sequence parallelism splits over the tensor ranks: the
# two norms (12) and the two residual adds (6)
ELEMENTWISE_UNSPLIT_HIDDEN_WIDTHS = 18
# Materialised attention, bytes per token, head and key (bf16 scores; first principles, Megatron's path):
# forward: the score matmul writes them (2), the fused scale-mask-softmax reads and writes them (4),
# attention dropout reads them, writes them and its mask (5), the value matmul reads them (2): 13;
# backward: the value matmul reads the probabilities (2) and writes their gradient (2), dropout's
# backward (5), the softmax's reads its output and gradient and writes the scores' gradient (6), the
# query and key matmuls read that (4): 21. Saved for backward: the softmax output, the mask and the
# dropped-out probabilities: 5 (Korthikanti et al. 2022's 5 a s / h per token).
MATERIALISED_FORWARD_BYTES = 13
MATERIALISED_BACKWARD_BYTES = 21
MATERIALISED_SAVED_BYTES = 5
# The optimizer step reads fp32 parameters, gradients and both Adam moments and writes three back,
# plus the bf16 copy: 30 bytes per parameter the rank updates (first principles); with bf16 moments
# 4 + 4 + 2 x 2 read, 4 + 2 x 2 written, the bf16 copy: 22; all in bf16 (no copy): 4 x 2 read, 3 x 2 written: 14.
OPTIMIZER_BYTES_PER_PARAM = {"fp32": 30, "bf16_moments": 22, "bf16": 14}
# fp8: bytes a cast-transpose moves per element (read bf16, write fp8 twice) and per weight (read the
# bf16 weight, write its fp8 copy and its transpose, plus the amax pass)
FP8_CAST_BYTES_PER_ELEMENT = 4
FP8_WEIGHT_CAST_BYTES = 6
# The loss reads and writes the logits a few times (softmax, its gradient): bytes per logit (first principles).
LOSS_BYTES_PER_LOGIT = 16
# Attention executed with flash attention and a causal mask: forward 4 * seq * d FLOPs per token and
# layer halved by the mask, backward 2.5 x the forward (it recomputes the scores): 7 * seq * d.
ATTENTION_FLOPS_PER_SEQ_DIM = 7.0
# Host time to launch one block's kernels, forward and backward (first principles: about 30 kernels at
# about 10 us of Python and driver time each); the GPU runs behind it, so it only bounds the step from below.
HOST_SECONDS_PER_BLOCK = 300e-6
# A Hopper-native attention kernel over FlashAttention-2 on H100: FlashAttention-3's paper (Shah et al.
# 2024, arXiv 2407.08608, abstract) measures 1.5-2.0x, FA2 at 35 % of the peak; the low end is taken.
HOPPER_NATIVE_ATTENTION_SPEEDUP = 1.5
# Launch latency of one collective (NCCL, first principles: tens of microseconds).
COLLECTIVE_LATENCY_S = 20e-6
# A ring collective's latency grows with its ranks: NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc
# @ 5067397, its default tuner constants for the Simple protocol, which large messages use): a base
# latency, then one step per rank of the ring, 3.4 us a step over NVLink and 14 us a step that crosses to
# another node (a ring all-gather or reduce-scatter over n ranks on N nodes takes n - 1 steps, N - 1 of
# them between nodes). NCCL also raises the NVLink steps of a ring that spans nodes to 3x its network
# overhead (1 us on Intel hosts, 2 on AMD ones): 3.4 covers the first. An all-reduce may run as a tree
# instead, whichever NCCL's model finds faster: the same base, then twice (the ranks a node holds - 1)
# NVLink hops at 4.0 us and log2(nodes) network hops at 14 us.
NCCL_RING_BASE_LATENCY_S = 8.4e-6
NCCL_RING_NVLINK_STEP_S = 3.4e-6
NCCL_RING_NETWORK_STEP_S = 14e-6
NCCL_TREE_NVLINK_STEP_S = 4.0e-6


def compute_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Matmul, attention and memory-bound time of the step on one GPU (at least the host's launch time),
    and the pipeline bubble."""
    p, world = candidate.pipeline, cluster.world_size
    data = candidate.data_size(world)
    tokens = work.tokens / data  # one data rank's tokens per step, shared by its t * p GPUs
    seconds = (matmul_seconds(candidate, spec, cluster, work) + attention_seconds(candidate, spec, cluster, work)
               + memory_bound_seconds(candidate, spec, cluster, work, tokens)
               + optimizer_seconds(candidate, spec, cluster, work)
               + accumulation_seconds(candidate, spec, cluster, work))
    seconds += head_stage_excess_seconds(candidate, spec, cluster, work)
    # the host launches asynchronously: its per-block cost is a floor under the GPU's time, not added to it
    host = HOST_SECONDS_PER_BLOCK * max(stage_blocks(spec, p, work)) * micro_steps(candidate, work, data)
    host *= 1 + recomputed_share(candidate, work) / 3  # recompute launches the forward's kernels again
    seconds = max(seconds, host)
    return seconds * (1 + pipeline_bubble(candidate, work, data))


def head_stage_excess_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                              work: Workload) -> float:
    """What the pipeline's slowest stage adds over the time counted evenly: every stage waits for the
    slowest one each micro-batch (Llama 3's paper, section 3.3.2: the output layer and the loss make the
    last stage the bottleneck). The blocks' matmuls and attention are dealt out by the blocks each rank
    holds (the sum of its model chunks: ``chunk_blocks``; the two ends a block lighter where the split
    counts the embedding and the output layer as blocks); the output layer's matmul and the loss's
    memory-bound passes run on the last stage alone. The even count spread the matmuls over all GPUs
    and the loss whole on each: the difference is returned (negative where a middle stage with one
    more block than the ends is the slowest and the loss was counted on it)."""
    p = candidate.pipeline
    if p == 1:
        return 0.0
    head = head_matmul_seconds(candidate, spec, cluster, work)
    blocks = matmul_seconds(candidate, spec, cluster, work) - head + attention_seconds(candidate, spec, cluster, work)
    loss = loss_seconds(candidate, spec, cluster, work.tokens / candidate.data_size(cluster.world_size))
    ranks = [sum(chunks) for chunks in chunk_blocks(spec, work, p)]
    stages = [blocks * p * held / sum(ranks) for held in ranks]
    stages[-1] += head * p + loss
    return max(stages) - (blocks + head + loss)


def loss_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, tokens: float) -> float:
    """The loss's memory-bound passes over a data rank's ``tokens`` logits, split over the tensor ranks."""
    hbm = cluster.device.hbm_bytes_per_s
    return LOSS_BYTES_PER_LOGIT * spec.vocab * tokens / candidate.tensor / hbm if hbm else 0.0


def pipeline_bubble(candidate: Candidate, work: Workload, data: int) -> float:
    """The pipeline's idle share over its busy time: (p - 1) / (m v) (Narayanan et al. 2021)."""
    p = candidate.pipeline
    if p == 1:
        return 0.0
    return (p - 1) / (pipeline_micro_batches(candidate, work, data) * max(work.virtual_stages, 1))


def micro_steps(candidate: Candidate, work: Workload, data: int) -> int:
    """Forward / backward passes per step on a data rank (gradient accumulation or pipeline micro-batches)."""
    if candidate.pipeline > 1:
        return pipeline_micro_batches(candidate, work, data)
    return max(candidate.micro, 1)


def matmul_efficiency(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                      peak: Optional[float] = None) -> float:
    """The chip's fitted efficiency, lower for narrow matmuls (small models, large tensor sizes). The
    width at which it halves is proportional to the chip's ridge point (``peak`` FLOPs over HBM bytes
    per second; bf16 unless given): a matmul of width w does about w FLOPs per byte it moves, so the
    faster the math beside the memory (Hopper over Ampere, fp8 over bf16) the wider a matmul must be
    to hide its loads. The proportion is fitted. This one is a hidden-square matmul split over the
    tensor ranks, 2 h (h / t) / (h + h / t) = 2 h / (1 + t): the reference attention's fitted share is
    taken of (``attention_seconds``); the weight matmuls are timed at their own shapes
    (``weight_matmul_efficiency``)."""
    return width_efficiency(2 * spec.hidden / (1 + candidate.tensor), cluster, peak)


def weight_matmul_efficiency(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                             peak: Optional[float] = None) -> float:
    """The efficiency of a block's weight matmuls, each at its own shape (``weight_matmul_width``)."""
    return width_efficiency(weight_matmul_width(spec, candidate.tensor), cluster, peak)


def weight_matmul_width(spec: TransformerSpec, tensor: int) -> float:
    """The width, in ``width_efficiency``'s sense, at which a block's weight matmuls together take the time
    they take each at their own: over many tokens an input-k by output-n matmul on a tensor rank moves
    about k + n values per k n multiply-adds, so its width is 2 k n / (k + n); the attention's
    (``TransformerSpec.attention_matmul_shapes``: the fused q / k / v projection, hidden by (q + 2 kv) / t,
    and the output one, its value width / t by hidden; latent attention's down and up projections), the MLP's input
    projection (hidden by 2 x ffn / t where gated: gate and up fused, Megatron-Core's linear_fc1) and its
    output one (ffn / t by hidden; under MoE the shared experts, the routed ones apart:
    ``expert_matmul_efficiency``). Their times add, each FLOPs x (1 + half / width), so the width that
    gives the sum is the FLOP-weighted harmonic mean of theirs."""
    t = tensor
    shapes = [(k, n, 1.0) for k, n in spec.attention_matmul_shapes(t)]
    # the MLPs by the share of the layers they run in: a dense model's every layer; an MoE model's shared
    # experts in its routed layers and its dense layers' MLP in the others
    mlps = [(spec.ffn, 1.0)]
    if spec.experts:
        mlps = [(spec.shared_ffn, spec.moe_share), (spec.dense_ffn, 1 - spec.moe_share)]
    for ffn, share in mlps:
        if ffn and share:
            shapes += [(spec.hidden, (2 if spec.gated else 1) * ffn / t, share), (ffn / t, spec.hidden, share)]
    flops = [k * n * share for k, n, share in shapes]
    return sum(flops) / sum(f * (k + n) / (2 * k * n) for f, (k, n, _) in zip(flops, shapes))


def width_efficiency(width: float, cluster: ClusterSpec, peak: Optional[float] = None) -> float:
    """The chip's efficiency on a matmul of ``width`` FLOPs per byte (``matmul_efficiency``)."""
    device = cluster.device
    ridge = (peak or device.bf16_flops) / device.hbm_bytes_per_s if device.hbm_bytes_per_s else 0.0
    half = calibration.value("matmul half width per ridge") * ridge
    return device.matmul_efficiency * width / (width + half)


def _peak(candidate: Candidate, cluster: ClusterSpec) -> float:
    device = cluster.device
    if candidate.precision == "fp32":
        return device.fp32_flops
    if candidate.precision == "fp8" and device.fp8_flops:
        return device.fp8_flops * calibration.value("fp8 efficiency")
    return device.bf16_flops


def matmul_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Weight matmuls: the blocks' 6 FLOPs per parameter and token, one more forward of the blocks under
    full recompute (or of their matmul-free parts under selective: none), and the output layer's
    (``head_matmul_seconds``)."""
    flops = 6.0 * (spec.active_param_count - spec.embedding_params - spec.head_params)
    flops += 2.0 * spec.layers * spec.active_block_params * recomputed_share(candidate, work)
    # a Mixture-of-Experts block's routed experts run as grouped matmuls of their own width on the few
    # tokens each expert gets: at the efficiency of that shape (``expert_matmul_efficiency``)
    routed = (6.0 + 2.0 * recomputed_share(candidate, work)) * spec.layers * spec.routed_active_params
    fp8 = candidate.precision == "fp8" and cluster.device.fp8_flops
    peak = cluster.device.fp8_flops if fp8 else None
    seconds = work.tokens * (flops - routed) / cluster.world_size / (
        _peak(candidate, cluster) * weight_matmul_efficiency(candidate, spec, cluster, peak))
    if routed:
        seconds += work.tokens * routed / cluster.world_size / (
            _peak(candidate, cluster) * expert_matmul_efficiency(candidate, spec, cluster, work, peak))
    return seconds + head_matmul_seconds(candidate, spec, cluster, work)


def head_matmul_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """The output layer's matmul (tied to the embedding or not): 6 FLOPs per token and weight, spread
    over the GPUs. In bf16 under fp8: the fp8 recipes convert the blocks' linear layers only
    (Megatron-Core builds the output layer as a plain ColumnParallelLinear outside Transformer Engine,
    torchtitan's float8 conversion filters the module named output, llm-foundry's te.Linear replaces the
    blocks' layers and MPT's head is its tied embedding)."""
    peak = cluster.device.bf16_flops if candidate.precision == "fp8" else _peak(candidate, cluster)
    flops = 6.0 * spec.vocab * spec.hidden
    columns = spec.vocab / candidate.tensor  # its own shape: hidden in, the rank's share of the vocabulary out
    width = 2.0 * spec.hidden * columns / (spec.hidden + columns)
    return work.tokens * flops / cluster.world_size / (peak * width_efficiency(width, cluster))


def expert_matmul_efficiency(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                             peak: Optional[float] = None) -> float:
    """The efficiency of a routed expert's matmuls: FLOPs per byte of an m x k by k x n matmul go as
    2 / (1/m + 1/k + 1/n) (the weight matmuls' 2 h / (1 + t) is its many-token limit), with k the hidden
    size, n the expert's width over its tensor ranks and m the tokens each expert gets in a micro-batch:
    the expert group's tokens (a data rank's micro-batch on each of ``expert`` ranks) times the experts
    a token goes to, over the experts."""
    data = candidate.data_size(cluster.world_size)
    tokens = work.tokens / data / max(micro_steps(candidate, work, data), 1)
    m = tokens * work.expert * spec.experts_per_token / spec.experts
    n = spec.expert_ffn / expert_tensor_size(candidate, work)
    return width_efficiency(2.0 / (1.0 / m + 1.0 / spec.hidden + 1.0 / n), cluster, peak)


def recomputed_share(candidate: Candidate, work: Workload) -> float:
    """Share of the blocks' forward that backward runs again: all of it under full checkpointing; under
    selective, what the policy does not keep is recomputed (torchtitan's op policy recomputes every
    other matmul, its layer policy every other block: about the half of the activations it drops)."""
    mode = checkpointing(candidate, work)
    if mode == "selective":
        return 1.0 - calibration.value("selective activation share")
    return full_recompute_share(candidate, work)


def full_recompute_share(candidate: Candidate, work: Workload) -> float:
    """The share of the blocks whose forward runs again whole: under full checkpointing every block, or
    the workload's ``recomputed_blocks`` of them (Megatron's block method); none otherwise."""
    return work.recomputed_blocks if checkpointing(candidate, work) == "full" else 0.0


def attention_recomputed_share(candidate: Candidate, work: Workload) -> float:
    """The share of the blocks whose attention core (scores, softmax, dropout, the value matmul) backward
    runs again: every block's under ``core_attention``, the fully recomputed blocks' under full."""
    if checkpointing(candidate, work) == "core_attention":
        return 1.0
    return full_recompute_share(candidate, work)


def recomputed_block_share(spec: TransformerSpec, work: Workload, pipeline: int, layers_per_chunk: int) -> float:
    """The share of all blocks that Megatron-Core's block method recomputes: the first
    ``layers_per_chunk`` blocks of every pipeline model chunk (``chunk_blocks``), all of a smaller one."""
    chunks = [blocks for stage in chunk_blocks(spec, work, pipeline) for blocks in stage]
    return sum(min(layers_per_chunk, blocks) for blocks in chunks) / sum(chunks)


def attention_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Causal flash attention's executed FLOPs at the fitted share of the matmul efficiency (bf16: flash
    attention does not run in fp8 here), over the attended length (``Workload.attended``: packed
    documents attend within themselves). Materialised attention runs its scores as batched matmuls over
    the whole s x s square (the causal mask skips nothing): 4 s d FLOPs per token, layer and head forward,
    8 backward, 4 more under full recompute, at the matmul efficiency of a matmul as wide as a head."""
    if work.attention == "materialised":
        per_token = ((12.0 + 4.0 * attention_recomputed_share(candidate, work)) * spec.layers * spec.attention_width
                     * work.seq_len)
        peak = cluster.device.fp32_flops if candidate.precision == "fp32" else cluster.device.bf16_flops
        efficiency = width_efficiency(spec.head_dim, cluster)
        return work.tokens * per_token / cluster.world_size / (peak * efficiency)
    length = spec.attention_length(work.attended)  # over the layers: sliding windows count their window
    per_token = ATTENTION_FLOPS_PER_SEQ_DIM * spec.attention_width * length
    per_token += 2.0 * spec.attention_width * length * attention_recomputed_share(candidate, work)
    peak = cluster.device.fp32_flops if candidate.precision == "fp32" else cluster.device.bf16_flops
    family = attention_family(cluster)
    efficiency = matmul_efficiency(candidate, spec, cluster) * calibration.value(f"{family} attention efficiency")
    if family == "hopper" and work.hopper_attention:
        efficiency *= HOPPER_NATIVE_ATTENTION_SPEEDUP
    return work.tokens * per_token / cluster.world_size / (peak * efficiency)


def attention_family(cluster: ClusterSpec) -> str:
    """Flash attention's kernels differ by architecture (FlashAttention-2 is tuned for Ampere's mma
    instructions and reaches a smaller share of Hopper's peak than its matmuls do), so its share of the
    matmul efficiency is fitted per architecture: Ampere, or Hopper for every Hopper part. Blackwell
    takes Hopper's: no row here publishes a Blackwell run long enough for its attention to be fitted."""
    return "ampere" if cluster.device.family == "ampere" else "hopper"


def memory_bound_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload,
                         tokens: float) -> float:
    """Norms, activations, residual adds, casts and the loss: bytes over HBM bandwidth. ``tokens``: a
    data rank's, split over its tensor group (sequence parallel) and its pipeline stages."""
    hbm = cluster.device.hbm_bytes_per_s
    if not hbm:
        return 0.0
    width = 4 if candidate.precision == "fp32" else 2
    t = candidate.tensor
    # without sequence parallelism every tensor rank runs the norms and residual adds whole
    unsplit = 0 if work.sequence_parallel or t == 1 else (t - 1) * ELEMENTWISE_UNSPLIT_HIDDEN_WIDTHS
    per_block = block_elementwise_bytes(spec, work, width) + unsplit * spec.hidden * width
    per_block *= 1 + recomputed_share(candidate, work) / 3  # the forward's share once more
    per_block += expert_permute_bytes(spec, work, width)
    per_block += fp8_cast_bytes(spec) if candidate.precision == "fp8" else 0.0
    if work.attention == "materialised":  # the scores, per head and key, forward (again under recompute), backward
        again = max(recomputed_share(candidate, work), attention_recomputed_share(candidate, work))
        scores = MATERIALISED_FORWARD_BYTES * (1 + again) + MATERIALISED_BACKWARD_BYTES
        per_block += scores * spec.heads * work.seq_len
    blocks = per_block * spec.layers * tokens / (t * candidate.pipeline)
    weights = 0.0
    if candidate.precision == "fp8":  # each weight cast (and transposed) once per step, per micro-step
        gathers_per_micro_step = candidate.sharding in FSDP_KINDS
        passes = micro_steps(candidate, work, candidate.data_size(cluster.world_size)) if gathers_per_micro_step else 1
        weights = (FP8_WEIGHT_CAST_BYTES * spec.layers * spec.block_params
                   / (candidate.tensor * candidate.pipeline) * passes)
    return (blocks + weights) / hbm + loss_seconds(candidate, spec, cluster, tokens)


def block_elementwise_bytes(spec: TransformerSpec, work: Workload, width: int) -> float:
    """Bytes per token a block's memory-bound kernels move, forward and backward: the fused count
    (``ELEMENTWISE_HIDDEN_WIDTHS`` / ``ELEMENTWISE_FFN_WIDTHS`` elements of ``width`` bytes), or the
    implementation's own, counted from its ops (``Workload.elementwise_bytes`` as given, else the module's
    own where the spec came from one: ``TransformerSpec.elementwise_bytes``; at 16-bit compute, scaled
    by ``width`` / 2)."""
    counted = work.elementwise_bytes or spec.elementwise_bytes
    if counted is None:
        return (ELEMENTWISE_HIDDEN_WIDTHS * spec.hidden + ELEMENTWISE_FFN_WIDTHS[spec.gated] * spec.ffn) * width
    per_hidden, per_ffn, per_kv = counted
    return (per_hidden * spec.hidden + per_ffn * spec.ffn + per_kv * spec.kv_dim) * width / 2


def fp8_cast_bytes(spec: TransformerSpec) -> float:
    """Bytes per token and block that fp8 matmuls add (Transformer Engine's cast-transpose, first
    principles): every GEMM input in the forward (the attention and MLP inputs, the attention output,
    the MLP's intermediate) and every output gradient in the backward is read in bf16 (2 bytes, its
    amax in the same pass) and written as fp8 twice, row- and column-major (1 + 1). The routed experts'
    input is the token's copy for each of its experts (and its output gradient one per expert), the
    shared experts' the token itself."""
    mlp_out = (2 if spec.gated else 1) * spec.ffn
    mlp_in = spec.hidden
    if spec.experts:  # over the layers: the routed ones' copies (and their shared experts' input), the dense ones'
        routed = spec.experts_per_token * spec.hidden + (spec.hidden if spec.shared_ffn else 0)
        mlp_in = spec.moe_share * routed + (1 - spec.moe_share) * spec.hidden
    forward = 2 * spec.hidden + mlp_in + spec.ffn
    backward = (spec.hidden + 2 * spec.kv_dim) + spec.hidden + mlp_out + mlp_in
    return FP8_CAST_BYTES_PER_ELEMENT * (forward + backward)


def expert_permute_bytes(spec: TransformerSpec, work: Workload, width: int) -> float:
    """Bytes per token and block that grouping the routed tokens by expert moves, where the dispatch
    kernels do not do it themselves (``Workload.expert_permute_fused``; first principles, k the experts a
    token goes to, in hidden-wide elements): forward, the permutation gathers the token's k copies into
    expert order (read k, write k) and the unpermutation reads the k expert outputs and adds them, weighted,
    into the token (read k, write 1); under expert parallelism with more than one expert a rank, the copies
    a rank receives are sorted by its local experts and sorted back after them (read k, write k, twice).
    Backward runs each pass's mirror, and the routing weights' gradient reads the k outputs once more."""
    if not spec.experts or work.expert_permute_fused:
        return 0.0
    k = spec.experts_per_token
    forward = 2 * k + (k + 1)
    if work.expert > 1 and spec.experts // work.expert > 1:
        forward += 2 * 2 * k
    backward = forward + k
    return spec.moe_share * (forward + backward) * spec.hidden * width  # the routed layers' share of them


def optimizer_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                      work: Optional[Workload] = None) -> float:
    """Adam over the parameters this GPU updates (sharded ones: its shard), in the workload's state dtypes
    (a fused kernel's passes), or the bytes per parameter the workload counted from its optimizer."""
    hbm = cluster.device.hbm_bytes_per_s
    if not hbm:
        return 0.0
    params = spec.param_count / (candidate.tensor * candidate.pipeline)
    if candidate.sharding != "ddp":
        params /= shard_size(candidate, cluster.world_size)
    if work is not None and work.optimizer_bytes_per_param is not None:
        return work.optimizer_bytes_per_param * params / hbm
    states = "bf16" if candidate.precision == "half_bf16" else (work.optimizer_states if work else "fp32")
    return OPTIMIZER_BYTES_PER_PARAM[states] * params / hbm


def accumulation_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Adding each micro-batch's gradients into the optimizer's buffer outside the matmuls
    (``Workload.grad_accumulation_bytes_per_param``), over the parameters this GPU holds whole (its tensor
    and pipeline share; a distributed optimizer shards only its own states), once per micro-step."""
    hbm = cluster.device.hbm_bytes_per_s
    if not hbm or not work.grad_accumulation_bytes_per_param:
        return 0.0
    params = spec.param_count / (candidate.tensor * candidate.pipeline)
    steps = micro_steps(candidate, work, candidate.data_size(cluster.world_size))
    return work.grad_accumulation_bytes_per_param * params * steps / hbm


def data_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                      facts: Optional[LayoutFacts] = None, work: Optional[Workload] = None) -> float:
    """Gradient reduction and parameter gathers over the data dimension, per GPU (``data_comm_parts``)."""
    return sum(data_comm_parts(candidate, spec, cluster, facts, work))


def data_comm_parts(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec,
                    facts: Optional[LayoutFacts] = None, work: Optional[Workload] = None) -> tuple[float, float]:
    """(parameter gathers, gradient reductions) over the data dimension, seconds per GPU and step. FSDP
    gathers every unit again for each micro-step (forward and backward), zero2 once per micro-step;
    their gradients are reduced once per step, or at every micro-step under ``sync_each_micro_step``;
    DDP and zero1 reduce once per step; zero1 gathers the updated parameters once."""
    world, t, p = cluster.world_size, candidate.tensor, candidate.pipeline
    data = candidate.data_size(world)
    if data == 1:
        return 0.0, 0.0
    P, G, _ = state_bytes(candidate, spec, work.optimizer_states if work is not None else "fp32")
    share = facts.state_share.get((t, p), 1 / (t * p)) if facts and t * p > 1 else 1.0 / (t * p)
    # under expert parallelism a rank reduces (gathers) only the experts it holds, over their data ranks
    # (expert times fewer: counted as the data group here)
    share *= whole_params_share(candidate, spec, work, share) if work is not None else 1.0
    P, G = P * share, G * share
    # weights are gathered in the compute dtype: bf16 unless the whole run is fp32
    compute_params = (4.0 if candidate.precision == "fp32" else 2.0) * spec.param_count * share
    shard = shard_size(candidate, world)
    shed = 1 - 1 / shard
    steps = micro_steps(candidate, work, data) if work is not None and t * p == 1 else 1
    # a reduction at every micro-step: the data rank's passes, a pipeline's micro-batches too (its
    # stage's weights stay gathered over them, so ``steps`` stays one there)
    each = work is not None and work.syncs_each_micro_step(candidate) and candidate.sharding in ("fsdp", "zero2")
    syncs = micro_steps(candidate, work, data) if each else 1
    # FSDP and zero2 reduce-scatter in their reduce dtype (``grad_reduce_dtype``), DDP in the gradients'
    reduced_grads = grad_buffer_bytes(candidate, work, G) if work is not None else G
    gathered, reduced = {"ddp": (0.0, 2 * shed * G), "zero1": (shed * P, 2 * shed * G),
                         "zero2": (shed * steps * compute_params, shed * syncs * reduced_grads),
                         "fsdp": (shed * 2 * steps * compute_params, shed * syncs * reduced_grads)}[candidate.sharding]
    if candidate.sharding == "zero1" and (t * p > 1 or (work is not None and work.distributed_optimizer)):
        # Megatron: reduce-scatter gradients (in the buffer's dtype), gather bf16 weights
        buffer = grad_buffer_bytes(candidate, work, G) if work is not None else G
        gathered, reduced = shed * compute_params, shed * buffer
    stride = data_stride(candidate, work)
    link = cluster.link_bytes_per_s(shard, stride)
    gathers = {"ddp": 0, "zero1": 1, "zero2": spec.layers, "fsdp": 2 * spec.layers}[candidate.sharding]
    reductions = {"ddp": 1, "zero1": 1, "zero2": spec.layers, "fsdp": spec.layers}[candidate.sharding]
    # a collective's fixed cost: its launch, or its ring's steps where they take longer (many ranks)
    gather_latency = max(COLLECTIVE_LATENCY_S, ring_latency_s(cluster, shard, stride))
    reduce_latency = max(COLLECTIVE_LATENCY_S, ring_latency_s(cluster, shard, stride,
                                                              all_reduce=candidate.sharding == "ddp"))
    gather_s = gathered / link + steps * gathers * gather_latency
    reduce_s = reduced / link + max(steps, syncs) * reductions * reduce_latency
    if shard < data:  # hybrid: the shards' gradients are all-reduced across the replicas
        replicas = data // shard
        reduce_s += 2 * (1 - 1 / replicas) * reduced_grads / shard / cluster.link_bytes_per_s(replicas, stride * shard)
        reduce_s += syncs * reductions * ring_latency_s(cluster, replicas, stride * shard, all_reduce=True)
    return gather_s, reduce_s


def ring_latency_s(cluster: ClusterSpec, ranks: int, stride: int = 1, all_reduce: bool = False) -> float:
    """The fixed time of one collective over ``ranks`` ranks spaced ``stride`` apart, by NCCL's cost model
    (``NCCL_RING_*``): an all-gather's or reduce-scatter's ring steps run one after another, so at a few
    thousand ranks one costs milliseconds whatever it moves, which is what makes FSDP over a whole large
    cluster slower than sharding inside a node and replicating across (hsdp). ``all_reduce``: a ring of
    twice the steps or a tree, whichever is shorter (as NCCL picks)."""
    if ranks <= 1:
        return 0.0
    per_node = cluster.ranks_a_node(ranks, stride)
    nodes = -(-ranks // per_node)
    rounds = 2 if all_reduce else 1  # an all-reduce's ring: a reduce-scatter, then an all-gather
    ring = NCCL_RING_BASE_LATENCY_S + rounds * ((ranks - nodes) * NCCL_RING_NVLINK_STEP_S
                                                + (nodes - 1) * NCCL_RING_NETWORK_STEP_S)
    if not all_reduce:
        return ring
    tree = NCCL_RING_BASE_LATENCY_S + 2 * ((per_node - 1) * NCCL_TREE_NVLINK_STEP_S
                                           + math.log2(nodes) * NCCL_RING_NETWORK_STEP_S)
    return min(ring, tree)


def tensor_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Four activation all-reduces per block and step (two forward, two backward; two more when the
    forward is recomputed), on the layers this rank holds, on the critical path: half of them the
    attention's, half the MLP's. An MoE layer's routed experts run no such collective of their own (their
    tokens move with the dispatcher: ``expert_comm_seconds``), so its MLP half is its shared experts'
    alone, none without them; the dense layers' MLP keeps it."""
    t = candidate.tensor
    if t == 1:
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    activation = work.tokens / data * spec.hidden * width
    per_block = 4 + 2 * full_recompute_share(candidate, work)
    mlp_kept = 1.0
    if spec.experts:
        mlp_kept = (1 - spec.moe_share) + spec.moe_share * (1.0 if spec.shared_ffn else 0.0)
    collectives = per_block * (1 + mlp_kept) / 2
    layers = max(stage_blocks(spec, candidate.pipeline, work))
    latency = collectives * layers * micro_steps(candidate, work, data) * COLLECTIVE_LATENCY_S
    return collectives * layers * 2 * (1 - 1 / t) * activation / cluster.link_bytes_per_s(t) + latency


def pipeline_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Activations forward and gradients back across each stage boundary (each virtual stage's)."""
    t, p = candidate.tensor, candidate.pipeline
    if p == 1:
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    activation = work.tokens / data * spec.hidden * width / t
    link = cluster.link_bytes_per_s(p, pipeline_stride(candidate, work, data))
    return 2 * max(work.virtual_stages, 1) * activation / link


def context_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Context parallelism's key / value exchange over the rank's blocks: each attention gathers the other
    ``context - 1`` ranks' key and value shards in forward (once more under full recompute) and in backward,
    and sends their gradients back, each pass (c - 1) shards the size of the rank's own. The context group
    is the dimension next to the tensor group in all three frameworks' rank orders (tensor ranks apart)."""
    c = work.context
    if c == 1:
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    tokens = work.tokens / data  # this rank's shard of its sequences, per step
    shard = tokens * 2 * local_kv_width(spec, candidate.tensor) * width
    passes = 3 + full_recompute_share(candidate, work)
    layers = max(stage_blocks(spec, candidate.pipeline, work))
    latency = passes * layers * micro_steps(candidate, work, data) * COLLECTIVE_LATENCY_S
    return passes * layers * (c - 1) * shard / cluster.link_bytes_per_s(c, candidate.tensor) + latency


def expert_comm_seconds(candidate: Candidate, spec: TransformerSpec, cluster: ClusterSpec, work: Workload) -> float:
    """Expert parallelism's all-to-alls over the rank's blocks: each block sends every token's hidden
    state towards its ``experts_per_token`` experts and gets their outputs back, forward and backward (the
    dispatch once more under recompute), as many copies over NVLink and through the network as
    ``expert_copies`` counts, both links at once.
    Where each expert is split over ``expert_tensor`` > 1 ranks, the copies a rank receives are gathered
    over that group after the dispatch and reduce-scattered before the combine (Megatron-Core's alltoall
    dispatcher: gather_from_sequence_parallel_region on the expert-tensor group), (etp - 1) times the
    rank's own copies each pass, even without expert parallelism.
    The expert group's ranks are ``expert_tensor`` apart: Megatron-Core lays the expert layers out on a
    grid of their own (parallel_state.py: the expert rank generator's order tp-cp-ep-dp-pp with the
    expert tensor size as tp and no context dimension), so a group folded over the tensor ranks
    (expert_tensor 1 under tensor 2) holds a whole node's ranks."""
    e, etp = work.expert, expert_tensor_size(candidate, work)
    if not spec.experts or (e == 1 and etp == 1):
        return 0.0
    data = candidate.data_size(cluster.world_size)
    width = 4 if candidate.precision == "fp32" else 2
    sequence = candidate.tensor if work.sequence_parallel else 1
    token = work.tokens / data / sequence * spec.hidden * width  # one copy of each token, per pass and step
    token *= spec.moe_share  # only the routed layers send (a mean block's share)
    passes = 4 + 2 * full_recompute_share(candidate, work)
    layers = max(stage_blocks(spec, candidate.pipeline, work))
    micro = micro_steps(candidate, work, data)
    seconds = 0.0
    if e > 1:
        nvlink, network = expert_copies(spec, work, expert_ranks_a_node(candidate, cluster, work))
        link = max(token * nvlink / cluster.device.nvlink_bytes_per_s if nvlink else 0.0,
                   token * network / cluster.device.network_bytes_per_s if network else 0.0)
        seconds += passes * layers * (link + micro * COLLECTIVE_LATENCY_S)
    if etp > 1:  # the copies a rank received gathered over its expert-tensor group, reduce-scattered back
        sent = token * spec.experts_per_token
        seconds += passes * layers * (sent * (etp - 1) / cluster.link_bytes_per_s(etp) + micro * COLLECTIVE_LATENCY_S)
    return seconds


def expert_ranks_a_node(candidate: Candidate, cluster: ClusterSpec, work: Workload) -> int:
    """The expert group's ranks on one node: the group's ranks sit ``expert_tensor`` apart."""
    return cluster.ranks_a_node(work.expert, expert_tensor_size(candidate, work))


def expert_copies(spec: TransformerSpec, work: Workload, inside: int) -> tuple[float, float]:
    """Copies of a token a rank sends per pass over NVLink and through the network, with its expert group
    of ``work.expert`` ranks laid out ``inside`` to a node, the experts dealt out evenly in order and each
    token routed to k of them uniformly (the balanced routing the published runs force). "alltoall": each
    of the k copies goes to its expert's rank, (inside - 1) / e of them over NVLink and (e - inside) / e
    through the network (group-limited routing changes neither: by symmetry a copy's rank is any of the e).
    "hierarchical": one copy to each remote node holding one of its experts, (nodes - 1) x P(a node is
    hit), and over NVLink one to each rank hit, of its own node and, forwarded, of each remote node the
    rank receives for: (e - nodes) x P(a rank is hit) (``hit_probability``)."""
    e, k = work.expert, spec.experts_per_token
    nodes = max(math.ceil(e / inside), 1)
    if work.expert_dispatch == "alltoall":
        return k * (inside - 1) / e, k * (e - inside) / e
    return (e - nodes) * hit_probability(spec, e), (nodes - 1) * hit_probability(spec, nodes)


def hit_probability(spec: TransformerSpec, parts: int) -> float:
    """The chance that one of ``parts`` equal, consecutive parts of the experts (a rank's, a node's) holds
    at least one of a token's k experts. Routed over all E experts, k drawn without replacement:
    1 - C(E - S, k) / C(E, k), S = E / parts. Under group-limited routing (G groups of M, a token's k drawn
    among the g M experts of g groups it picks): a part inside one group is missed unless that group is
    picked (g / G) and then with C(g M - S, k) / C(g M, k); a part of c whole groups is missed with
    sum over j of P(j of them picked: hypergeometric) x C(g M - j M, k) / C(g M, k). A part that neither
    sits inside a group nor holds whole ones is counted as if routed over all experts."""
    experts, k = spec.experts, spec.experts_per_token
    size = experts // parts
    groups, picked = spec.expert_groups, spec.groups_per_token
    # a spec built by hand may name groups that limit nothing (or could not hold the k): routed over all
    limited = groups_limit_routing(groups, picked, experts, k)
    member = experts // groups if limited else 0
    if not limited or (member % size and size % member):
        return 1.0 - math.comb(experts - size, k) / math.comb(experts, k)
    pool = picked * member  # the experts of the groups a token picks
    if size <= member:
        return picked / groups * (1.0 - math.comb(pool - size, k) / math.comb(pool, k))
    whole = size // member
    missed = sum(math.comb(whole, j) * math.comb(groups - whole, picked - j) / math.comb(groups, picked)
                 * math.comb(pool - j * member, k) / math.comb(pool, k) for j in range(min(whole, picked) + 1))
    return 1.0 - missed


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


def _largest_stage(spec: TransformerSpec, t: int, p: int, blocks: Optional[list[int]] = None) -> float:
    blocks = blocks or stage_blocks(spec, p)
    split_block = spec.block_params - 2 * spec.hidden
    block = (spec.block_params - split_block) + split_block / t
    first = blocks[0] * block + spec.embedding_params / t + (0 if p > 1 else spec.head_params / t + spec.hidden)
    last = blocks[-1] * block + spec.head_params / t + spec.hidden + (spec.embedding_params / t if spec.tied else 0)
    return max(first, last, max(blocks) * block)
