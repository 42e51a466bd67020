"""The planner's predictions against published training runs: throughput, memory and feasibility.

The rows live in ``benchmarks/published_runs.json`` (source, configuration, published figures, and
``role``: calibration rows set the constant named in ``sets``, held-out rows only test). Each row is
predicted in its own configuration through ``atorch.plan.estimate``'s model. The script prints every
row, then per source and per device, separately for calibration and held-out rows: the rows, the
share within +-10 % and +-20 % of the published tokens/s, the mean absolute error, how many are
predicted to fit (all of them ran) and the memory error where memory was published. It asserts
nothing. ``--fit`` refits every constant of ``atorch/plan/calibration.py`` on its own
calibration rows only and prints the values; ``--explain TEXT`` prints where the predicted step of every
row whose id contains TEXT goes (compute parts, collectives before and after overlap, memory).

    .venv/bin/python benchmarks/plan_vs_published.py [--fit] [--rows] [--explain TEXT]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _block_implementations import (  # noqa: E402
    FmsLlamaBlock,
    TorchtitanFusedNormLlamaBlock,
    TorchtitanLlamaBlock,
)

from atorch.plan import (
    analytic,  # noqa: E402
    calibration,  # noqa: E402
    configuration,  # noqa: E402
)
from atorch.plan.analytic import LOSS_PARALLEL_LOGIT_BYTES, Prediction, predict, spec_layout_facts  # noqa: E402
from atorch.plan.elementwise import elementwise_bytes  # noqa: E402
from atorch.plan.hardware_specs import DEVICES, ClusterSpec  # noqa: E402
from atorch.plan.model_specs import from_hf_config, model_spec  # noqa: E402
from atorch.utils.plotting import headless_pyplot  # noqa: E402

DATA = Path(__file__).resolve().parent / "published_runs.json"
GIB = 2**30
# A compiled cross-entropy (Inductor fuses the fp32 upcast, the log-softmax and its backward) holds the bf16
# logits and their bf16 gradient: 2 + 2 bytes a logit, the least a loss can hold (first principles;
# benchmarks/compiled_loss.py measures 4.00 on CPU, where eager holds 14.00: the GPU's eager 10 plus one
# fp32 tensor its CPU backward keeps). Used where a source's code compiles the loss with the model.
COMPILED_LOSS_LOGIT_BYTES = 4

# torchtitan's parallelism as its code runs it (the torchtitan sources' workload notes): the device mesh
# ["pp", "dp", "cp", "tp"], the pipeline outermost; DTensor tensor parallelism saving each column-parallel
# matmul's gathered input; the loss under loss_parallel
TORCHTITAN_PARALLELISM = {"rank_order": "tensor-data-pipeline", "saves_gathered_inputs": True,
                          "loss_parallel_logit_bytes": LOSS_PARALLEL_LOGIT_BYTES}
# Megatron-Bridge's performance runs (its H100 and its B200 tables alike): Megatron-Core's distributed
# optimizer with overlapped gradient reduce and parameter gather, tensor-parallel overlap, a bf16 gradient
# buffer, fused SwiGLU, Transformer Engine's attention and context-parallel ring, Megatron's rank order
# (the sources' notes and the comments at their entries below say where each is read)
MEGATRON_BRIDGE = {"distributed_optimizer": True, "hopper_attention": True, "tp_comm_overlap": True,
                   "grad_reduce_overlap": True, "param_gather_overlap": True, "grad_reduce_dtype": "bf16",
                   "fused_swiglu": True, "rank_order": "tensor-data-pipeline", "context_comm_overlap": True}
# source-level facts of how a run's code differs from the planner's defaults (never one row's)
SOURCE_WORKLOAD = {"atorch": {"logit_bytes": 18, "fp32_residual": True, "logits_kept": True},
                   # Composer reduce-scatters every micro-batch; MPT's default loss is flash-attn's fused
                   # cross-entropy (llmfoundry/models/mpt/modeling_mpt.py: loss_fn='fused_crossentropy'):
                   # bf16 logits and their bf16 gradient, no fp32 copy: 4 bytes per logit
                   "llm-foundry": {"sync_each_micro_step": True, "logit_bytes": 4},
                   # fms-fsdp's FSDP mixed precision policy (bfSixteen) reduces gradients in bf16; its block
                   # is eager PyTorch (fp32 RMSNorm, fp32 rotation-matrix rotary): traffic counted from its ops
                   "fms-fsdp": {"grad_reduce_dtype": "bf16", "elementwise_bytes": elementwise_bytes(FmsLlamaBlock)},
                   # torchtitan's Llama: eager complex rotary and SwiGLU; the A100 table's configs set
                   # norm_type 'fused_rmsnorm' (train_configs/llama*.toml @ 04133643), the H100 table's 'rmsnorm'
                   # (@ eaea6f6a), the eager fp32 one
                   "torchtitan-a100": {"elementwise_bytes": elementwise_bytes(TorchtitanFusedNormLlamaBlock)},
                   # torchtitan's device mesh is ["pp", "dp", "cp", "tp"]: the pipeline outermost
                   # its tensor-parallel rows compute the loss under loss_parallel (train.py @ 9dec370:
                   # enable_loss_parallel unless disable_loss_parallel): DTensor's decomposed log-softmax
                   # its DTensor tensor parallelism saves the matmuls' all-gathered inputs (parallelize_llama.py:
                   # ColwiseParallel / Float8ColwiseParallel with input_layouts Shard(1), the output layer too)
                   "torchtitan-h100": {"elementwise_bytes": elementwise_bytes(TorchtitanLlamaBlock),
                                       **TORCHTITAN_PARALLELISM},
                   # torchtitan's async-TP benchmark of 2025-06 runs the same code paths at 820504e (its source's
                   # workload note: DTensor's gathered inputs, loss_parallel, the mesh order)
                   "torchtitan-asynctp": TORCHTITAN_PARALLELISM,
                   # Trainy's H200 runs of torchtitan @ e7c0cae: torchtitan's mesh order (its source's workload note);
                   # that version compiles the loss with the model (components/loss.py: loss_fn = torch.compile)
                   "trainy-whitefiber": {"rank_order": "tensor-data-pipeline",
                                         "logit_bytes": COMPILED_LOSS_LOGIT_BYTES},
                   # torchao's B200 runs of torchtitan @ 6fc499f: FSDP alone; that version compiles the loss with
                   # the model (components/loss.py, as Trainy's); its apply_fsdp (models/llama3/infra/parallelize.py)
                   # shards the embedding and [norm, output] as units of their own (#1094, 2025-07-28: after
                   # Trainy's e7c0cae, before 6fc499f)
                   "torchao": {"logit_bytes": COMPILED_LOSS_LOGIT_BYTES, "fsdp_units": "embedding_and_head_apart"},
                   # Megatron-Core's distributed optimizer; Transformer Engine's attention, which prefers
                   # cuDNN's fused kernel on Hopper (TransformerEngine dot_product_attention/utils.py)
                   # NeMo-Framework-Launcher's Llama configs (launcher_scripts/conf/training/llama/*.yaml @
                   # 0446d2c0603733cb7252ff36999b32b76e7cf1c4): optim overlap_grad_sync and overlap_param_sync
                   # true, overlap_p2p_comm true; the 70B config lists a tensor-parallel overlap (userbuffers)
                   # configuration for H100, TP 4, sequence 4096 among its defaults (ub_tp_comm_overlap)
                   # Megatron-Core lays ranks out tensor fastest, the pipeline outermost (its RankGenerator's
                   # order "tp-cp-ep-dp-pp"), as Megatron-Bridge's runs and DeepSpeed's topology below do
                   # Megatron-Core's context parallelism exchanges keys and values in Transformer Engine's ring
                   # (cp_comm_type "p2p", its default) beside the attention it feeds: context_comm_overlap
                   # the launcher's H100 FP8 Llama pretraining scripts (examples/training/llama/h100/llama*_fp8.sh
                   # @ 9352b045: the table's global batch 128 and node counts) and its SFT config reduce gradients in
                   # bf16 (optim.grad_sync_dtype=bf16: Apex's DistributedFusedAdam keeps a bf16 gradient buffer)
                   "nemo": {"distributed_optimizer": True, "hopper_attention": True, "grad_reduce_overlap": True,
                            "grad_reduce_dtype": "bf16",
                            "param_gather_overlap": True, "pipeline_p2p_overlap": True, "tp_comm_overlap": True,
                            "rank_order": "tensor-data-pipeline", "context_comm_overlap": True},
                   # the pipeline split counts the embedding and the output layer + loss as a block each: one
                   # block fewer on the first and the last stage (the paper's section 3.3.2; 126 = 16 x 8 - 2).
                   # The same section runs the interleaved schedule and says the first stage's first model chunk
                   # then holds only the embedding (the last one's only the output layer and loss): one-block
                   # chunks, 128 / 16 = 8 a stage (the rows' virtual column, 1, was an assumption: the table read
                   # does not give it); its point-to-point communication is asynchronous. Its rank order,
                   # [TP, CP, PP, DP] (the paper's section 3.3), is the planner's default
                   "llama3": {"pipeline_ends_as_layers": True, "virtual_stages": 8, "pipeline_p2p_overlap": True},
                   # Megatron-DeepSpeed with DeepSpeed's BF16 optimizer (ZeRO-1: fp32 master weights and moments
                   # sharded); --pp-partition-method 'type:transformer|embedding' gives the embedding and the tied
                   # output layer a block's slot each (tr11-176B-ml: 70 + 2 blocks = 12 stages x 6)
                   # 2022 Megatron-DeepSpeed has neither flash attention nor sequence parallelism: the scores
                   # run as baddbmm / bmm with the fused scale-mask-softmax and attention dropout between them
                   # (dropout not set in tr11-176B-ml.slurm: Megatron's default 0.1), and every tensor rank runs
                   # the norms and residual adds whole
                   # DeepSpeed's pipeline engine keeps each micro-batch's bf16 gradients after adding them into the
                   # BF16 optimizer's fp32 buffer (update_hp_grads(clear_lp_grads=False) after every backward) and
                   # each in-flight micro-batch's stage output until its backward (pipe_buffers['outputs']);
                   # each update_hp_grads adds every bf16 gradient into the fp32 buffer through a new fp32 copy
                   # of it (hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)): 2 + 4 + 4 + 4 + 4 bytes a
                   # parameter and micro-batch); its _bf16_reduce_grads all-reduces the fp32 buffer through a
                   # bf16 copy (engine.py allreduce_bucket: communication_data_type is bf16 under bf16;
                   # ds_config sets none)
                   "bigscience": {"distributed_optimizer": True, "pipeline_ends_as_layers": True,
                                  "attention": "materialised", "sequence_parallel": False,
                                  "half_grads_kept": True, "stage_outputs_kept": True, "reduce_cast_copy": True,
                                  "grad_accumulation_bytes_per_param": 18, "rank_order": "tensor-data-pipeline"},
                   # Megatron-Core, as NeMo (recipes/llama/h100/llama3.py: use_distributed_optimizer). The
                   # perf recipes (perf_recipes/llama/h100/llama3.py, perf_recipes/_common.py @ 56ae11dff): the
                   # pretraining recipe builds on recipes/llama/h100/llama3.py's 70B config (overlap_grad_reduce,
                   # overlap_param_gather, CommOverlapConfig(tp_comm_overlap=True)), the SFT recipe sets
                   # CommOverlapConfig(tp_comm_overlap=True), whose defaults turn on the gradient reduce and
                   # parameter gather overlap at data-parallel size > 1 (training/comm_overlap.py); both run
                   # _benchmark_common: ddp.grad_reduce_in_fp32 = False (a bf16 gradient buffer); the Llama
                   # model provider sets bias_activation_fusion (models/llama/llama_bridge.py: fused SwiGLU)
                   "megatron-bridge": MEGATRON_BRIDGE,
                   # the same archive's B200 rows: the same stack and settings at the release tag v0.2.0
                   # (recipes/llama/llama3.py _llama3_common: the distributed optimizer, overlapped gradient
                   # reduce and parameter gather; set_llama3*_common_configs: bf16 gradient reduction; the Llama
                   # provider's bias_activation_fusion; the 405B recipe's tensor-parallel overlap)
                   "megatron-bridge-b200": MEGATRON_BRIDGE,
                   # Megatron-LM in 2021 (Narayanan et al., sections 4.2 and 5): no flash attention (the scores
                   # materialised through the fused scale-mask-softmax, Megatron's default attention dropout) and
                   # no sequence parallelism; Megatron's rank order (tensor, then data, then pipeline)
                   "megatron-2021": {"attention": "materialised", "sequence_parallel": False,
                                     "rank_order": "tensor-data-pipeline"},
                   # Megatron-LM in 2022 (Korthikanti et al., sections 4-6): still no flash attention; its
                   # "present work" runs sequence parallelism (the default here), its full-recompute rows do
                   # not (a row fact below); Megatron's rank order
                   "megatron-2022": {"attention": "materialised", "rank_order": "tensor-data-pipeline"},
                   # Megatron-LM's MoE recipes (examples/moe_recipes @ d48bd6be, pretrain_gpt.py arguments): the
                   # distributed optimizer, Transformer Engine's fused attention (NVTE_FUSED_ATTN), a bf16
                   # gradient buffer (accumulate_allreduce_grads_in_fp32 unset), the fused SwiGLU
                   # (bias_swiglu_fusion, Megatron-LM's default), Megatron's rank order, the flex dispatcher on
                   # Hybrid-EP (moe_flex_dispatcher_backend hybridep) in every H100 recipe counted; no TP
                   # communication overlap (tp_comm_overlap unset)
                   "megatron-lm-moe": {"distributed_optimizer": True, "hopper_attention": True,
                                       "grad_reduce_dtype": "bf16", "fused_swiglu": True,
                                       "rank_order": "tensor-data-pipeline", "expert_dispatch": "hierarchical"}}


# facts of single rows that their source's other rows do not share
# torchtitan splits a pipeline's layers by generate_split_points (pipelining_utils.py @ 9dec370): L // stages
# each, the remainder one more to the middle stages, the first and the last without: Llama 3.1 405B's 126
# layers as [15, 16 x 6, 15] over 8 stages and [7, 8 x 14, 7] over 16 chunks, which for 126 layers is the
# split that counts the two ends as a block each (pipeline_ends_as_layers)
TORCHTITAN_405B_SPLIT = {"tp_comm_overlap": True, "pipeline_ends_as_layers": True}
ROW_WORKLOAD = {"titan llama3.1-70b 256xH100 2d asyncTP fp8+compile": {"tp_comm_overlap": True},
                # the 2022 paper's full-recompute baseline runs tensor parallelism without sequence parallelism
                # (Table 5: "full recomputation without sequence parallelism", section 6.3)
                **{f"megatron2022 gpt {run} full-recompute": {"sequence_parallel": False}
                   for run in ("22b 8gpu tp8", "175b 64gpu tp8pp8vp3", "530b 280gpu tp8pp35vp3", "1t 512gpu tp8pp64")},
                **{f"asynctp llama3.1-{size} {precision} asyncTP": {"tp_comm_overlap": True}
                   for size in ("70b 256xH100", "8b 64xH100") for precision in ("bf16", "fp8")},
                "titan llama3.1-405b 512xH100 3d 1F1B fp8+compile": TORCHTITAN_405B_SPLIT,
                "titan llama3.1-405b 512xH100 3d interleaved fp8+compile": TORCHTITAN_405B_SPLIT,
                "titan llama3.1-405b 512xH100 3d 32k 1F1B fp8+compile": TORCHTITAN_405B_SPLIT,
                "titan llama3.1-405b 512xH100 4d 64k cp2 1F1B fp8+compile": TORCHTITAN_405B_SPLIT,
                "titan llama3.1-405b 512xH100 4d 128k cp4 1F1B fp8+compile": TORCHTITAN_405B_SPLIT,
                "titan llama3.1-405b 512xH100 4d 256k cp8 1F1B fp8+compile": TORCHTITAN_405B_SPLIT,
                # NeMo-Framework-Launcher's gpt3/175b.yaml @ 9352b045: ub_tp_comm_overlap False
                "nemo gpt3-175b pretrain 128gpu tp4pp8vp6": {"tp_comm_overlap": False},
                "nemo gpt3-175b pretrain 512gpu tp4pp8vp6": {"tp_comm_overlap": False},
                # the 70B pretraining row runs Megatron's even split (2 blocks a chunk, the embedding on the first
                # stage, the output layer and the loss on the last): every release tag from v0.3.0 to v0.6.0
                # (scripts/performance/configs/llama: LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V2 over a recipe
                # with pipeline_model_parallel_layout None); the explicit layout of the later perf recipe
                # ("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL") came on 2026-08-06 (52c756963, "rebalance H100 70B pipeline
                # stages"), after the 26.04.01 container's run: no row fact
                # the 405B recipe sets account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split
                # (recipes/llama/h100/llama3.py llama31_405b_pretrain_256gpu_h100_bf16_config @ 067f987d)
                "mbridge llama3.1-405b pretrain 1024gpu tp8pp8cp2vp8 26.06": {"pipeline_ends_as_layers": True},
                # its B200 row's recipe at v0.2.0 sets both accounts too (recipes/llama/llama3.py
                # llama31_405b_pretrain_config)
                "mbridge llama3.1-405b pretrain 128gpu b200 tp4pp8cp2vp8 25.11": {"pipeline_ends_as_layers": True},
                # perf_recipes/qwen/h100/qwen3_moe.py qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config (@ 067f987d):
                # moe_token_dispatcher_type "flex" on moe_flex_dispatcher_backend "hybridep", 8 ranks an NVLink
                # domain (NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN): a token crosses to the other node once
                "mbridge qwen3-30b-a3b pretrain 16gpu ep16 26.06": {"expert_dispatch": "hierarchical"},
                # the v0.3.0 tag's scripts/performance/configs/qwen/qwen3_workload_base_configs.py
                # QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: moe_flex_dispatcher_backend "deepep" (DeepEP's normal
                # kernels: one copy to each rank hit, the node being one) and moe_a2a_overlap, which
                # utils/overrides.py turns into overlap_moe_expert_parallel_comm
                "mbridge qwen3-30b-a3b pretrain 16gpu pp2vp12ep8 26.02.01": {
                    "expert_dispatch": "hierarchical", "expert_comm_overlap": True},
                # recipes/qwen/h100/qwen3_moe.py qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config (@ 067f987d):
                # expert_tensor_parallel_size 1 and both pipeline-split accounts; its perf recipe
                # (perf_recipes/qwen/h100/qwen3_moe.py @ 56ae11df) sets moe_a2a_overlap and
                # overlap_moe_expert_parallel_comm
                # and CommOverlapConfig(tp_comm_overlap=False) (the v0.4.1 tag's qwen3_llm_pretrain.py
                # qwen3_235b_a22b_pretrain_config_h100, the container's era, and the perf recipe @ 56ae11df alike):
                # its TP 2 collectives are not overlapped, where the source's other TP rows overlap theirs
                "mbridge qwen3-235b-a22b pretrain 256gpu tp2pp8vp4ep32 26.04.01": {
                    "expert_tensor": 1, "pipeline_ends_as_layers": True, "expert_comm_overlap": True,
                    "tp_comm_overlap": False},
                # the Qwen3 30B BF16 recipe (recipes/qwen/h100/qwen3_moe.py
                # qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config @ 067f987d): HybridEP (moe_flex_dispatcher_backend
                # "hybridep"); the A/B's second row and the canonical run overlap the expert all-to-alls
                # (overlap_moe_expert_parallel_comm), the canonical run fuses the permutation into HybridEP (the perf
                # recipe's moe_permute_fusion_into_hybridep)
                "mbridge qwen3-30b-a3b pretrain 16gpu ep16 bf16 hybridep no-overlap 2026-07": {
                    "expert_dispatch": "hierarchical"},
                "mbridge qwen3-30b-a3b pretrain 16gpu ep16 bf16 hybridep overlap 2026-07": {
                    "expert_dispatch": "hierarchical", "expert_comm_overlap": True},
                "mbridge qwen3-30b-a3b pretrain 16gpu ep16 bf16 hybridep canonical 2026-08": {
                    "expert_dispatch": "hierarchical", "expert_comm_overlap": True, "expert_permute_fused": True},
                # examples/moe_recipes/qwen3_30b/h100/bf16_32GPU_TP1PP1EP8.yaml @ d48bd6be: overlap_grad_reduce
                # and overlap_param_gather
                "mlm qwen3-30b-a3b bf16 32gpu ep8": {"grad_reduce_overlap": True, "param_gather_overlap": True},
                # examples/moe_recipes/qwen3_235b/h100/bf16_256GPU_TP2PP8EP32.yaml @ d48bd6be: neither overlap set
                # (the gradient reduce and parameter gather exposed), account_for_embedding / loss_in_pipeline_split,
                # expert_tensor_parallel_size 1, overlap_moe_expert_parallel_comm with delay_wgrad_compute
                "mlm qwen3-235b-a22b bf16 256gpu tp2pp8vp4ep32": {
                    "expert_tensor": 1, "pipeline_ends_as_layers": True, "expert_comm_overlap": True}}


def load(path: Path = DATA) -> tuple[dict, list[dict]]:
    data = json.loads(path.read_text())
    rows = [dict(zip(data["columns"], values)) for values in data["rows"]]
    return data, rows


# A compiled block's saved activations under torchtitan's op-level selective checkpointing over the
# eager block's: benchmarks/compiled_activations.py (torchtitan's block at Llama 3 8B's proportions,
# CPU, 2026-11-28: 13.56 / 15.56 bytes per token and hidden element; the partitioner drops the down
# projection's output, which the policy caches eager although no backward reads it). Measured, not fitted.
COMPILED_SELECTIVE_SAVED = 0.8715


def compiled(row: dict) -> dict:
    """A row that ran torch.compile on each block: Inductor fuses the block's memory-bound ops (norms,
    rotary, activation, residual adds), so its traffic is the fused count, not its source's eager one;
    under selective checkpointing it saves what ``COMPILED_SELECTIVE_SAVED`` says of eager's (full
    checkpointing keeps the block's input either way)."""
    if "torch.compile" not in row["note"]:
        return {}
    return {"elementwise_bytes": None, "selective_saved_scale": COMPILED_SELECTIVE_SAVED}


def row_spec(row: dict, models: dict):
    """The row's model: from its HF config when the data file gives one, else by name."""
    if row["model"] in models:
        return from_hf_config(models[row["model"]], name=row["model"])
    return model_spec(row["model"])


def predict_row(row: dict, models: dict) -> Prediction:
    spec, cluster, candidate, work = row_configuration(row, models)
    return predict(candidate, spec, cluster, work, spec_layout_facts(spec, cluster.world_size))


def row_configuration(row: dict, models: dict) -> tuple:
    """The row's model, cluster, candidate and workload as the planner predicts them: its columns through
    ``configuration``, then its source's and its own facts."""
    spec = row_spec(row, models)
    device = DEVICES[row["device"]]
    if row["network_gbps_per_gpu"]:
        device = dataclasses.replace(device, network_bytes_per_s=row["network_gbps_per_gpu"] * 1e9 / 8)
    cluster = ClusterSpec(row["nodes"], row["gpus_per_node"], device)
    data = cluster.world_size // (row["tensor"] * row["pipeline"] * row["context"])
    divides = row["micro_batch"] and (row["global_batch"] // data) % row["micro_batch"] == 0
    micro = row["micro_batch"] if divides else None
    spec, cluster, candidate, work = configuration(
        spec, cluster, global_batch=row["global_batch"], seq_len=row["seq_len"], tensor=row["tensor"],
        pipeline=row["pipeline"], sharding=row["sharding"], precision=row["precision"],
        activation_checkpointing=row["checkpointing"], micro_batch_size=micro,
        optimizer_states=row["optimizer_states"], attention_span=row["attention_span"], context=row["context"],
        **expert_arguments(row))
    # a source-level fact overrides a column the row could only assume
    work = dataclasses.replace(work, **{"virtual_stages": row["virtual"], **SOURCE_WORKLOAD.get(row["source"], {}),
                                        **ROW_WORKLOAD.get(row["id"], {}), **compiled(row)})
    return spec, cluster, candidate, work


def explain(row: dict, models: dict) -> str:
    """Where a row's predicted step goes (``analytic.step_breakdown``), with its memory beside the published."""
    spec, cluster, candidate, work = row_configuration(row, models)
    facts = spec_layout_facts(spec, cluster.world_size)
    prediction = predict(candidate, spec, cluster, work, facts)
    data = candidate.data_size(cluster.world_size)
    published = row["tokens_per_s_per_gpu"] or "-"
    lines = [f"{row['id']}: {prediction.tokens_per_s_per_gpu:.0f} tokens/s per GPU predicted, {published} published; "
             f"{prediction.memory_bytes / GIB:.1f} GiB ({row['memory_gib'] or '-'} published)",
             f"  {analytic.micro_steps(candidate, work, data)} micro-steps a step, weight matmuls at "
             f"{analytic.weight_matmul_width(spec, candidate.tensor):.0f} wide"]
    parts = analytic.step_breakdown(candidate, spec, cluster, work, facts)
    lines += [f"  {name:<42} {seconds:9.3f} s" for name, seconds in parts.items()]
    lines.append("  memory (one GPU):")
    memory = analytic.memory_breakdown(candidate, spec, cluster, work, facts)
    lines += [f"    {name:<62} {size / GIB:7.1f} GiB" for name, size in memory.items()]
    return "\n".join(lines)


def expert_arguments(row: dict) -> dict:
    """A row's expert parallelism as ``configuration`` checks it: its size, with the facts of its source and
    row it is checked against (the distributed optimizer, the expert tensor size)."""
    if row["expert"] == 1:
        return {}
    facts = {**SOURCE_WORKLOAD.get(row["source"], {}), **ROW_WORKLOAD.get(row["id"], {})}
    return {"expert": row["expert"], **{k: facts[k] for k in ("distributed_optimizer", "expert_tensor",
                                                               "expert_comm_overlap", "expert_dispatch")
                                        if k in facts}}


def published_tokens(row: dict, models: dict) -> float:
    """tokens/s per GPU as published, or converted from TFLOPs/GPU with the planner's FLOPs per token
    (with one more forward when the source's TFLOPs count recompute: ATorch's)."""
    if row["tokens_per_s_per_gpu"]:
        return row["tokens_per_s_per_gpu"]
    spec = row_spec(row, models)
    flops = spec.model_flops_per_token(row["seq_len"])
    if row["source"] == "atorch" and row["checkpointing"] == "full":
        flops += spec.recompute_flops_per_token(row["seq_len"])
    return row["tflops_per_gpu"] * 1e12 / flops


def evaluate(rows: list[dict], models: dict, sources: Optional[dict] = None) -> list[dict]:
    """Each row predicted; its memory compared with what the source measured: the allocator's
    reservation (max reserved) unless the source says it published the live tensors (max allocated)."""
    sources = sources if sources is not None else load()[0]["sources"]
    out = []
    for row in rows:
        p = predict_row(row, models)
        published = published_tokens(row, models)
        allocated = sources.get(row["source"], {}).get("memory") == "allocated"
        memory = (p.allocated_bytes if allocated else p.memory_bytes) / GIB
        out.append({**row, "pred": p, "published": published, "ratio": p.tokens_per_s_per_gpu / published,
                    "mem_ratio": memory / row["memory_gib"] if row["memory_gib"] else None})
    return out


def summary(results: list[dict]) -> str:
    """rows, within +-10 %, within +-20 %, mean absolute error, fits, memory error."""
    n = len(results)
    if not n:
        return "-"
    errors = [abs(r["ratio"] - 1) for r in results]
    fits = sum(r["pred"].fits for r in results)
    mem = [abs(r["mem_ratio"] - 1) for r in results if r["mem_ratio"]]
    mem_text = f"{len(mem)} mem MAE {100 * sum(mem) / len(mem):4.1f}%" if mem else ""
    within_10, within_20 = sum(e <= 0.10 for e in errors) / n, sum(e <= 0.20 for e in errors) / n
    return (f"{n:>3} rows  +-10%: {within_10:4.0%}  +-20%: {within_20:4.0%}"
            f"  MAE {100 * sum(errors) / n:5.1f}%  fit {fits:>3}/{n:<3} {mem_text}")


def print_rows(results: list[dict]) -> None:
    header = f"{'row':<46}{'role':<12}{'tok/s pub':>10}{'pred':>9}{'ratio':>7}{'GiB pred':>9}{'pub':>6}  fits"
    print(header + "\n" + "-" * len(header))
    for r in results:
        p = r["pred"]
        mem = f"{r['memory_gib']:>6.1f}" if r["memory_gib"] else f"{'':>6}"
        predicted = r["memory_gib"] * r["mem_ratio"] if r["mem_ratio"] else p.memory_bytes / GIB
        print(f"{r['id']:<46}{r['role']:<12}{r['published']:>10.0f}{p.tokens_per_s_per_gpu:>9.0f}{r['ratio']:>7.2f}"
               f"{predicted:>9.1f}{mem}  {'yes' if p.fits else 'NO'}")


def print_tables(results: list[dict]) -> None:
    for role in ("held-out", "calibration"):
        subset = [r for r in results if r["role"] == role]
        print(f"\n{role} rows (tokens/s per GPU, predicted vs published)")
        print(f"  {'all':<22}{summary(subset)}")
        for key in ("source", "device"):
            for value in dict.fromkeys(r[key] for r in subset):
                print(f"  {value:<22}{summary([r for r in subset if r[key] == value])}")


def plot_results(results: list[dict], path: Path) -> Optional[Path]:
    """Predicted against published, one point a row, by source: throughput (log-log, the ±20 % band
    around the diagonal; calibration rows hollow) and, where the source published it, memory (the ±15 %
    band). None where matplotlib is not installed (``.[plot]``)."""
    plt = headless_pyplot("published-runs plot")
    if plt is None:
        return None
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 6))
    colours = plt.get_cmap("tab20")
    for i, source in enumerate(dict.fromkeys(r["source"] for r in results)):
        rows = [r for r in results if r["source"] == source]
        labelled = False
        for role, face in (("held-out", colours(i)), ("calibration", "none")):
            chosen = [r for r in rows if r["role"] == role]
            if chosen:
                speed.scatter([r["published"] for r in chosen], [r["pred"].tokens_per_s_per_gpu for r in chosen],
                              s=22, facecolors=face, edgecolors=colours(i), label=None if labelled else source)
                labelled = True
        with_memory = [r for r in rows if r["mem_ratio"]]
        if with_memory:
            predicted = [r["memory_gib"] * r["mem_ratio"] for r in with_memory]
            memory.scatter([r["memory_gib"] for r in with_memory], predicted, s=22, color=colours(i), label=source)
    _diagonal(speed, [r["published"] for r in results], 0.20, log=True)
    _diagonal(memory, [r["memory_gib"] for r in results if r["mem_ratio"]], 0.15, log=False)
    speed.set(xlabel="published tokens/s per GPU", ylabel="predicted tokens/s per GPU",
              title="throughput (hollow: calibration rows)")
    memory.set(xlabel="published GiB per GPU", ylabel="predicted GiB per GPU", title="memory, where published")
    speed.legend(fontsize=7)
    memory.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _diagonal(ax, values: list[float], band: float, log: bool) -> None:
    """The y = x line and the ±``band`` lines around it over ``values``' range."""
    low, high = min(values) * 0.7, max(values) * 1.3
    for factor, style in ((1.0, "-"), (1 + band, "--"), (1 - band, "--")):
        ax.plot([low, high], [low * factor, high * factor], style, color="grey", linewidth=0.8)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")


# --- fitting -----------------------------------------------------------------------------------------
@contextmanager
def constants(values: dict[str, float]) -> Iterator[None]:
    """The calibration table with ``values`` in place of the fitted ones, for the duration."""
    saved = dict(calibration.FITTED)
    try:
        for name, v in values.items():
            calibration.FITTED[name] = dataclasses.replace(calibration.FITTED[name], value=v)
        yield
    finally:
        calibration.FITTED.clear()
        calibration.FITTED.update(saved)


def loss(name: str, rows: list[dict], models: dict) -> float:
    """Mean squared log-ratio of the constant's own rows (throughput or memory, as it is fitted to)."""
    memory = calibration.FITTED[name].target == "memory"
    total = 0.0
    for r in evaluate(rows, models):
        ratio = r["mem_ratio"] if memory else r["ratio"]
        total += math.log(ratio) ** 2
    return total / max(len(rows), 1)


def fit(rows: list[dict], models: dict, rounds: int = 4) -> dict[str, float]:
    """Each constant by golden-section search on its own calibration rows (the rows named in
    ``calibration.FITTED``, looked up in ``rows``), the others held at their current values; a few
    rounds, since the constants interact a little. Held-out rows are never read."""
    by_id = {r["id"]: r for r in rows}
    values = {name: f.value for name, f in calibration.FITTED.items()}
    for _ in range(rounds):
        for name, fitted in calibration.FITTED.items():
            own = [by_id[i] for i in fitted.rows]

            def objective(v: float) -> float:
                with constants({**values, name: v}):
                    return loss(name, own, models)
            values[name] = golden_section(objective, fitted.low, fitted.high)
    return values


def golden_section(f, low: float, high: float, iterations: int = 40) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true",
                        help="refit the calibrated constants on their rows and print them")
    parser.add_argument("--rows", action="store_true", help="print every row")
    parser.add_argument("--plot", metavar="PNG", type=Path,
                        help="also draw predicted against published, by source (needs matplotlib: .[plot])")
    parser.add_argument("--explain", metavar="TEXT",
                        help="print where the predicted step goes for every row whose id contains TEXT")
    args = parser.parse_args(argv)
    data, rows = load()
    models = data["models"]
    if args.explain:
        chosen = [row for row in rows if args.explain in row["id"]]
        if not chosen:
            raise SystemExit(f"--explain {args.explain!r}: no row's id contains it")
        print("\n\n".join(explain(row, models) for row in chosen))
        return
    if args.fit:
        calibration_only = [r for r in rows if r["role"] == "calibration"]
        values = fit(calibration_only, models)
        for name, v in values.items():
            print(f"fitted {name}: {v:.4g} (in calibration.py: {calibration.value(name):.4g})")
        return
    results = evaluate(rows, models)
    if args.rows:
        print_rows(results)
    print_tables(results)
    if args.plot:
        drawn = plot_results(results, args.plot)
        print(f"\nplot: {drawn}" if drawn else "\nno plot: matplotlib is not installed (pip install -e '.[plot]')")
    sources = data["sources"]
    print(f"\n{len(rows)} rows from {len(sources)} sources; "
          f"{sum(r['role'] == 'calibration' for r in rows)} calibration rows")
    for key, source in sources.items():
        print(f"- {key}: {source['where']}; MFU counted as: {source['mfu']}")
    print("calibrated constants: " + "; ".join(f"{name} = {f.value:.4g} on {len(f.rows)} row(s)"
                                               for name, f in calibration.FITTED.items()))


if __name__ == "__main__":
    main()
