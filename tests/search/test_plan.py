"""atorch.plan: the search's candidates ranked for a cluster that is not here, from a config alone.

No GPU, no real memory: models are shapes (a transformers config.json, a built-in name, or a module on
the meta device), devices are rows of a table. The command line is run in a subprocess as a user
would; the top plan is applied with ``load_strategy`` to a small real model."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest
import torch

import atorch
from atorch.auto import auto_accelerate
from atorch.errors import InputError
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.plan import PRECISIONS
from atorch.plan.analytic import COLLECTIVE_LATENCY_S, MATERIALISED_SAVED_BYTES
from atorch.plan.hardware_specs import DEVICES, ClusterSpec, cluster_spec, device_spec
from atorch.plan.model_specs import BUILTIN_CONFIGS, TransformerSpec, model_spec
from atorch.testing.families import FAMILIES
from atorch.testing.families import build as build_family

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
                    "rope_theta": 500000.0, "torch_dtype": "bfloat16"}



def test_atorch_plan_is_the_function_and_the_package_the_docs_name():
    """``atorch.plan(...)`` plans, and ``atorch.plan.plan_measured`` / ``atorch.plan.elementwise`` /
    ``import atorch.plan.elementwise`` reach the package, as docs/plan.md writes them: with the function
    re-exported in its place they raised (AttributeError, ImportError)."""
    import atorch.plan.elementwise as elementwise
    from atorch.plan import plan_measured

    assert atorch.plan.elementwise is elementwise and atorch.plan.plan_measured is plan_measured
    assert type(atorch.plan("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=8192)).__name__ == "Plan"

def test_cli_prints_the_ranked_table_for_a_transformers_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B_CONFIG))
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "atorch.plan", "--model", str(config), "--cluster", "8xH100-96GB",
                           "--global-batch", "16", "--seq-len", "8192", "--strategy-out", str(tmp_path / "top.json")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    assert "8.03 B parameters" in done.stdout and "tok/s/GPU" in done.stdout and "MFU" in done.stdout
    first = next(line for line in done.stdout.splitlines() if line.strip().startswith("1 "))
    assert first.rstrip().endswith("yes") and "amp_bf16" in first
    saved = atorch.Strategy.load(tmp_path / "top.json")
    assert "parallel_mode" in saved.names()


def test_a_plan_that_fits_within_a_tenth_of_the_device_is_flagged_tight():
    """Published runs' peaks sat at about 1.1 x the planner's predictions (docs/plan.md), so a plan that
    fits within the last tenth of the device's memory says so: a note on its prediction, "tight" in the
    table with a line saying why; the prediction itself, and whether it fits, are unchanged."""
    from atorch.plan import format_plan
    from atorch.plan.analytic import TIGHT_MEMORY_SHARE

    result = atorch.plan("llama3-8b", "8xH100-96GB", global_batch=16, seq_len=8192)
    device = result.cluster.device.memory_bytes
    tight = [p for p in result.predictions if p.fits and p.memory_bytes > TIGHT_MEMORY_SHARE * device]
    roomy = [p for p in result.predictions if p.fits and p.memory_bytes <= TIGHT_MEMORY_SHARE * device]
    assert tight and roomy
    assert all(any(n.startswith("tight:") for n in p.notes) for p in tight)
    assert not any(n.startswith("tight:") for p in roomy for n in p.notes)
    table = format_plan(result)
    assert sum(line.rstrip().endswith("tight") for line in table.splitlines()) == len(tight)
    footer = table.splitlines()[len(result.predictions) + 3:]  # the lines under the candidates
    assert sum("published runs' peaks sat at about 1.1 x" in line for line in footer) == 1


@pytest.mark.parametrize("layout", [
    dict(tensor=4, pipeline=4, sharding="zero1", distributed_optimizer=True, virtual_stages=5, micro_batch_size=1),
    dict(tensor=2, pipeline=4, sharding="zero2", micro_batch_size=1, activation_checkpointing="full"),
    dict(tensor=8, sharding="fsdp", activation_checkpointing="full"),
    dict(tensor=8, pipeline=2, sharding="ddp", activation_checkpointing="full", micro_batch_size=1),
    dict(sharding="fsdp", activation_checkpointing="full"),
])
def test_the_memory_breakdown_adds_up_to_the_predicted_peak(layout):
    """``analytic.memory_breakdown``: the state part by part and the activations under a layout (the pure
    data-parallel path, the search's cost model, as one figure), then the allocator's cached blocks; the
    parts add up to the peak ``estimate`` reports, and each is a size, none negative."""
    from atorch.plan import configuration
    from atorch.plan.analytic import memory_breakdown, spec_layout_facts

    args = dict(global_batch=64, seq_len=4096, **layout)
    pred = atorch.estimate("llama2-70b", "8x8xH100-80GB", **args)
    spec, cluster, candidate, work = configuration("llama2-70b", "8x8xH100-80GB", **args)
    parts = memory_breakdown(candidate, spec, cluster, work, spec_layout_facts(spec, cluster.world_size))
    peak = parts.pop("peak")
    assert peak == pytest.approx(pred.memory_bytes, abs=1.0)
    assert sum(parts.values()) == pytest.approx(peak)
    assert all(size >= 0 for size in parts.values()), parts
    layered = layout.get("tensor", 1) * layout.get("pipeline", 1) > 1
    assert ("activations (the stage that holds the most)" in parts) == layered


def test_the_distributed_optimizer_s_fp32_main_gradients_live_at_the_step_not_beside_the_activations():
    """Megatron's distributed optimizer over a bf16 gradient buffer casts its shard to fp32 main gradients
    at the optimizer step and frees them at the next step's zero_grad, after backward has freed the
    activations: the peak is the state plus the larger of the two, and the breakdown names the one at the
    peak. So a bf16 buffer saves exactly its half of the fp32 buffer where the activations are the peak."""
    from atorch.plan import configuration
    from atorch.plan.analytic import STEP_MAIN_GRADS, layout_state_parts, memory_breakdown, spec_layout_facts

    layout = dict(tensor=4, pipeline=4, sharding="zero1", distributed_optimizer=True, virtual_stages=5,
                  micro_batch_size=1)

    def breakdown(dtype: str, global_batch: int, seq_len: int) -> tuple[dict, dict]:
        args = dict(global_batch=global_batch, seq_len=seq_len, grad_reduce_dtype=dtype, **layout)
        spec, cluster, candidate, work = configuration("llama2-70b", "8x8xH100-80GB", **args)
        facts = spec_layout_facts(spec, cluster.world_size)
        state = layout_state_parts(candidate, spec, work, facts, candidate.data_size(cluster.world_size))
        return state, memory_breakdown(candidate, spec, cluster, work, facts)

    state, parts = breakdown("bf16", 64, 4096)
    assert state[STEP_MAIN_GRADS] > 0 and STEP_MAIN_GRADS not in parts
    activations = parts["activations (the stage that holds the most)"]
    assert activations > state[STEP_MAIN_GRADS]
    assert parts["peak"] == pytest.approx(sum(b for k, b in state.items() if k != STEP_MAIN_GRADS) + activations)
    fp32_state, fp32_parts = breakdown("fp32", 64, 4096)
    saved = fp32_state["gradient buffer"] - state["gradient buffer"]
    assert fp32_parts["peak"] - parts["peak"] == pytest.approx(saved)
    state, parts = breakdown("bf16", 64, 64)  # short sequences: the step's main gradients are the peak
    assert "activations (the stage that holds the most)" not in parts
    assert parts[STEP_MAIN_GRADS] == pytest.approx(state[STEP_MAIN_GRADS])
    assert parts["peak"] == pytest.approx(sum(state.values()))


def test_cli_breaks_down_the_plan_its_strategy_line_names(capsys):
    """Where selective checkpointing ranks first (no atorch method applies it), the table says so, and the
    step breakdown below it is the top applicable plan's, under that plan's own label, not the selective
    row's figures under the full-recompute label its candidate carries."""
    from atorch.plan.__main__ import main

    args = ["--model", "llama3-70b", "--cluster", "8x8xB200", "--global-batch", "64", "--seq-len", "8192"]
    assert main(args + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    result = atorch.plan("llama3-70b", "8x8xB200", global_batch=64, seq_len=8192)
    assert result.best.checkpointing == "selective" and result.applicable is not result.best
    assert "sel-ckpt: selective checkpointing" in out
    header = next(line for line in out.splitlines() if line.startswith("where the top plan's step goes"))
    assert f"({result.applicable.candidate.label})" in header
    step = next(line for line in out.splitlines() if line.strip().startswith("step "))
    assert float(step.split()[-1]) == pytest.approx(result.applicable.step_time_s, abs=1e-3)


def test_cli_names_a_bad_cluster_and_the_valid_devices():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "atorch.plan", "--model", "llama3-8b", "--cluster", "8xH100-69GB",
                           "--global-batch", "16", "--seq-len", "8192"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "H100-96GB" in done.stderr and "Did you mean" in done.stderr


def test_a_config_file_names_the_model_by_its_directory_or_its_own_name(tmp_path):
    """A checkpoint's config.json is named by its directory, any other JSON file by itself (not by the
    directory it happens to sit in)."""
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    (tmp_path / "qwen3-30b.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert model_spec(str(tmp_path / "llama-3-8b")).name == "llama-3-8b"
    assert model_spec(str(tmp_path / "llama-3-8b" / "config.json")).name == "llama-3-8b"
    assert model_spec(str(tmp_path / "qwen3-30b.json")).name == "qwen3-30b"


def test_a_config_file_s_own_error_is_not_called_bad_json(tmp_path):
    """A well-formed config.json the planner cannot read (a Mamba model: no attention heads) was reported as
    'not valid JSON'; its own reason comes through, and only a file that does not parse is called so."""
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(
        {"model_type": "mamba2", "hidden_size": 2560, "num_hidden_layers": 64, "vocab_size": 50280}))
    with pytest.raises(InputError) as refused:
        model_spec(str(tmp_path / "mamba"))
    assert "not valid JSON" not in str(refused.value) and "num_attention_heads" in str(refused.value)
    (tmp_path / "broken.json").write_text("{\"hidden_size\": 4096,")
    with pytest.raises(InputError, match="is not valid JSON"):
        model_spec(str(tmp_path / "broken.json"))


def test_an_encoder_decoder_config_is_refused_rather_than_counted_as_one_stack():
    """T5's config reads as 6 layers of 512 (its encoder alone: 35 M of its 60 M parameters): refused by
    name rather than planned at half its size."""
    t5 = {"model_type": "t5", "d_model": 512, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8,
          "d_ff": 2048, "vocab_size": 32128, "is_encoder_decoder": True}
    with pytest.raises(InputError, match="t5 is an encoder-decoder model"):
        model_spec(t5)


def test_a_multimodal_config_is_read_as_its_language_model():
    """Llama 4's and Gemma 3's config.json nest the decoder's shape in text_config: the planner reads
    that (named as the language model; the vision tower is not counted) instead of refusing the config."""
    multimodal = {"model_type": "llama4", "text_config": {**LLAMA3_8B_CONFIG, "model_type": "llama4_text"},
                  "vision_config": {"hidden_size": 1408, "num_hidden_layers": 34}}
    spec = model_spec(multimodal)
    assert spec.name == "llama4 (language model)"
    assert spec.param_count == model_spec(LLAMA3_8B_CONFIG).param_count
    with pytest.raises(InputError, match="missing or non-integer key"):
        model_spec({"model_type": "llama4", "vision_config": {"hidden_size": 1408}})


def test_builtin_shapes_have_their_published_parameter_counts():
    counts = {name: model_spec(name).param_count / 1e9 for name in BUILTIN_CONFIGS}
    assert counts["llama2-7b"] == pytest.approx(6.74, abs=0.01)
    assert counts["llama3-8b"] == pytest.approx(8.03, abs=0.01)
    assert counts["llama3-70b"] == pytest.approx(70.55, abs=0.05)
    assert counts["llama3.1-405b"] == pytest.approx(405.85, abs=0.05)  # the Hub's safetensors index total


# config.json shape keys of published models (their model cards give the parameter counts checked below)
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
                "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN15_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
              "vocab_size": 151936, "tie_word_embeddings": False}
QWEN3_32B = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
             "tie_word_embeddings": False}
GEMMA_7B = {"model_type": "gemma", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000,
            "tie_word_embeddings": True}


@pytest.mark.parametrize("config, total, active", [
    (MIXTRAL_8X7B, 46.70, 12.88), (QWEN3_30B_A3B, 30.53, 3.35), (QWEN15_MOE, 14.32, 2.69), (QWEN3_32B, 32.76, 32.76),
    (GEMMA_7B, 8.54, 8.54)])
def test_experts_and_head_sizes_from_the_config_give_the_published_parameter_counts(config, total, active):
    """A Mixture-of-Experts model holds every expert (its memory) but each token meets only its routed ones
    (its FLOPs); Qwen3's and Gemma's heads are wider than hidden / heads."""
    spec = model_spec(config)
    assert spec.param_count / 1e9 == pytest.approx(total, abs=0.01)
    assert spec.active_param_count / 1e9 == pytest.approx(active, abs=0.01)
    attention = 12.0 * spec.layers * spec.heads * spec.head_dim * 4096
    assert spec.model_flops_per_token(4096) == pytest.approx(6.0 * (spec.active_param_count - spec.embedding_params)
                                                             + attention)


# families whose layers the planner's shape does not describe (docs/plan.md): recurrent or convolution mixers
# beside attention (Jamba, Zamba, Nemotron-H, RecurrentGemma, LFM2), mixtures of attention experts (JetMoE)
SHAPES_NOT_MODELLED = {"jamba", "zamba", "nemotron_h", "recurrent_gemma", "lfm2", "jetmoe"}


def _llama4_interleaved():
    """Llama 4 Maverick's layout at toy size: every second layer routes, the others run a dense MLP of
    intermediate_size_mlp."""
    import transformers

    from atorch.testing.families import COMMON

    config = transformers.AutoConfig.for_model("llama4_text", **{
        **COMMON, "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 96, "head_dim": 8,
        "interleave_moe_layer_step": 2})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "glm4_moe", "llama4 interleaved"])
def test_latent_attention_and_dense_layers_beside_moe_ones_give_the_exact_parameter_counts(name):
    """DeepSeek-V2 / V3's multi-head latent attention (queries and keys / values through low-rank latents,
    keys with a shared rotary part, values narrower than keys) and MoE models whose other layers are dense
    (DeepSeek's and GLM-4-MoE's first_k_dense_replace, Llama 4's interleave_moe_layer_step): the config alone
    gives the model's parameter count to the parameter, and the parameters a token meets (every layer's
    but the experts its router skips)."""
    from atorch.testing.families import build

    model = _llama4_interleaved() if name == "llama4 interleaved" else build(name)
    spec = model_spec(model.config.to_dict())
    total = sum(p.numel() for p in model.parameters())
    assert spec.param_count == total
    routed_layers = spec.layers - spec.dense_layers
    assert 0 < routed_layers < spec.layers
    skipped = routed_layers * (spec.experts - spec.experts_per_token) * 3 * spec.hidden * spec.expert_ffn
    assert spec.active_param_count == total - skipped
    assert model_spec(model).param_count == total  # the module reads the same


class _TitanLatentAttention(torch.nn.Module):
    """torchtitan's deepseek_v3 Attention at toy size: queries through a latent (wq_a, q_norm, wq_b), keys and
    values through another (wkv_a, kv_norm, wkv_b) with a rotary key part shared by the heads, and wo."""

    def __init__(self, dim: int, n_heads: int = 4, q_lora_rank: int = 32, kv_lora_rank: int = 16,
                 qk_nope_head_dim: int = 8, qk_rope_head_dim: int = 4, v_head_dim: int = 6):
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.wq_a, self.q_norm = torch.nn.Linear(dim, q_lora_rank, bias=False), torch.nn.RMSNorm(q_lora_rank)
        self.wq_b = torch.nn.Linear(q_lora_rank, n_heads * qk, bias=False)
        self.wkv_a = torch.nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = torch.nn.RMSNorm(kv_lora_rank)
        self.wkv_b = torch.nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = torch.nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h, nope, rope, v = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(b, s, h, nope + rope)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, rope], dim=-1)
        k_nope, value = self.wkv_b(self.kv_norm(latent)).view(b, s, h, nope + v).split([nope, v], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, h, -1)], dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2),
                                                               value.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, h * v))


class _TitanDeepSeekBlock(torch.nn.Module):
    def __init__(self, dim: int, moe: bool):
        from atorch.testing.community_models import FeedForward, TitanMoE

        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attention = _TitanLatentAttention(dim)
        self.moe_enabled = moe
        self.mlp = TitanMoE(dim, 24, num_experts=4, top_k=2) if moe else FeedForward(dim, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class _TitanDeepSeek(torch.nn.Module):
    """torchtitan's DeepSeek-V3 layout at toy size: one block class, its first block dense, the others
    routing to a GroupedExperts bank beside a shared expert, every block's attention latent."""

    def __init__(self, dim: int = 32, layers: int = 3, vocab: int = 64):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_TitanDeepSeekBlock(dim, moe=i > 0) for i in range(layers))
        self.norm, self.output = torch.nn.RMSNorm(dim), torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def test_a_torchtitan_style_module_with_latent_attention_and_a_dense_first_block_is_read_off_its_modules():
    """No transformers config: the latent attention's ranks and head sizes are read off its attention's
    attributes (the names torchtitan's and transformers' modules keep them under), the dense blocks of the
    repeated class counted apart from the routed ones (their MLP width from their parameters), so the
    parameters a token meets are exact and the score / value widths are the heads' query and value sizes."""
    with torch.device("meta"):
        model = _TitanDeepSeek()
    spec = model_spec(model)
    total = sum(p.numel() for p in model.parameters())
    assert spec.param_count == total
    assert (spec.q_dim, spec.out_dim, spec.kv_lora_rank, spec.q_lora_rank) == (4 * 12, 4 * 6, 16, 32)
    assert (spec.dense_layers, spec.dense_ffn, spec.experts, spec.experts_per_token) == (1, 96, 4, 2)
    skipped = 2 * (4 - 2) * 3 * 32 * 24  # two routed blocks, two experts a token skips in each
    assert spec.active_param_count == total - skipped
    assert spec.layers * spec.block_params == pytest.approx(sum(p.numel() for p in model.layers.parameters()))


def test_latent_attention_runs_its_score_and_value_matmuls_at_their_own_widths():
    """Under latent attention a head's query / key size (nope + rope) and its value size differ: the score
    matmul runs over the heads' query width, the value one over their value width, so the MFU's attention
    term is 6 x (q + v) x length; its weight matmuls include the low-rank down projections, whole on every
    tensor rank; the saved activations count queries, keys and values at their own widths and the latents."""
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
              "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
              "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
              "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "head_dim": 64, "vocab_size": 129280, "tie_word_embeddings": False}
    spec = model_spec(config)
    assert (spec.q_dim, spec.out_dim, spec.key_dim, spec.value_dim) == (128 * 192, 128 * 128, 128 * 192, 128 * 128)
    assert spec.param_count / 1e9 == pytest.approx(671.0, abs=0.1)  # DeepSeek-V3 without its MTP module
    assert spec.active_param_count / 1e9 == pytest.approx(37.5, abs=0.1)
    attention = 6.0 * (spec.q_dim + spec.out_dim) * spec.layers * 4096
    assert spec.model_flops_per_token(4096) == pytest.approx(6.0 * (spec.active_param_count - spec.embedding_params)
                                                             + attention)
    shapes = spec.attention_matmul_shapes(8)
    assert (7168, 1536) in shapes and (7168, 512 + 64) in shapes  # the down projections, not split
    assert (1536, 128 * 192 / 8) in shapes and (512, 128 * (128 + 128) / 8) in shapes
    assert (128 * 128 / 8, 7168) in shapes
    latent = 2 * (1536 + 512) + 64
    mlp = 4 * spec.ffn + spec.moe_share * 8 * 7168
    assert spec.block_activation_elements() == pytest.approx(4 * 7168 + latent + 2 * 128 * 192 + 2 * 128 * 128 + mlp)
    with pytest.raises(InputError, match=r"kv_lora_rank=512 \(latent attention\) but \['v_head_dim'\]"):
        model_spec({k: v for k, v in config.items() if k != "v_head_dim"})


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - SHAPES_NOT_MODELLED))
def test_a_familys_config_dict_gives_the_parameter_count_of_the_model_it_builds(name):
    """The planner reads a config.json as the model does: Falcon's and GPT-BigCode's multi_query (one key /
    value head), GPT-2-style n_inner, Falcon's ffn_hidden_size, OPT's / XGLM's ffn_dim, MPT's
    expansion_ratio over an intermediate_size the model ignores, MPT's / GPT-Neo's / XGLM's own shape keys
    through transformers' attribute_map, and gated MLPs (gpt-oss, Qwen3-Next, MiniMax, OLMo 3, BitNet).
    Tiny configs (hidden 32): biases, norms and position tables the shape leaves out are up to 15 % here,
    a fraction of one at real sizes."""
    model = build_family(name)
    real = sum(p.numel() for p in model.parameters())
    assert model_spec(model.config.to_dict()).param_count == pytest.approx(real, rel=0.15)


@pytest.mark.parametrize("config, windowed, window", [
    ({"model_type": "gpt_oss", "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18}, 18,
     128),
    ({"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 6}, 30, 1024),
    ({"model_type": "gemma2", "sliding_window": 4096}, 18, 4096),
    ({"model_type": "mistral", "sliding_window": 4096}, 36, 4096),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, 0, 0),
    ({"model_type": "llama", "sliding_window": None}, 0, 0),
])
def test_sliding_window_layers_attend_over_their_window(config, windowed, window):
    """The layers a config puts in a sliding window (layer_types, Gemma 3's pattern, Gemma 2's alternation,
    Mistral's every layer; none where the window is off) count twice their window of attention length (a
    query sees the window where a causal one sees half the sequence), at most the sequence: attention's
    time and the MFU's attention term go with it, the weights' matmuls do not."""
    from atorch.plan import configuration
    from atorch.plan.analytic import attention_seconds, matmul_seconds

    base = {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
            "intermediate_size": 8192, "vocab_size": 32000}
    spec = model_spec({**base, **config})
    assert (spec.windowed_layers, spec.window) == (windowed, window)
    expected = (36 - windowed) * 32768 + windowed * min(2 * window, 32768)
    assert spec.attention_length(32768) == expected
    args = dict(global_batch=8, seq_len=32768, activation_checkpointing="full")
    full_config = {**base, "model_type": config["model_type"]}
    windows, whole = (configuration(c, "8xH100-80GB", **args) for c in ({**base, **config}, full_config))
    ratio = attention_seconds(windows[2], windows[0], windows[1], windows[3]) / attention_seconds(
        whole[2], whole[0], whole[1], whole[3])
    assert ratio == pytest.approx(expected / (36 * 32768))
    assert matmul_seconds(windows[2], windows[0], windows[1], windows[3]) == matmul_seconds(
        whole[2], whole[0], whole[1], whole[3])


def test_an_moe_block_keeps_the_copies_of_each_token_dispatched_to_its_experts():
    """Beside the routed experts' intermediate tensors (as a dense MLP's, at the width a token runs
    through), an MoE block saves each token's hidden state once per expert it goes to: the dispatched
    copies the experts' first matmuls keep for their weight gradient (Qwen3-30B-A3B: 8 x 2048 a token)."""
    moe = model_spec(QWEN3_30B_A3B)
    dense_same_width = model_spec({**QWEN3_30B_A3B, "model_type": "qwen3", "num_experts": 0,
                                   "intermediate_size": moe.ffn})
    assert moe.ffn == dense_same_width.ffn == 8 * 768
    assert moe.block_activation_elements() - dense_same_width.block_activation_elements() == 8 * 2048
    assert moe.split_activation_elements() - dense_same_width.split_activation_elements() == 8 * 2048


def test_an_moe_model_is_planned_with_all_its_experts_in_memory_and_its_routed_ones_in_time():
    """Mixtral against the dense model of the same shape that runs one expert's MLP twice as wide (the same
    FLOPs per token): the same FLOPs but more compute time (each expert's matmuls run on the quarter of the
    tokens routed to it, 1024 of a sequence here, at a width of about 1550 where the dense model's wide MLP
    matmuls run at several times that: ``expert_matmul_efficiency``, ``weight_matmul_width``; about 1.2 x),
    FSDP gathers and reduces every expert (no expert parallelism), and every expert's state is held."""
    dense = {**MIXTRAL_8X7B, "model_type": "mistral", "num_local_experts": 0, "intermediate_size": 2 * 14336}
    kwargs = dict(global_batch=64, seq_len=4096, sharding="fsdp", precision="bf16")
    moe, same_flops = (atorch.estimate(c, "8x8xH100-80GB", **kwargs) for c in (MIXTRAL_8X7B, dense))
    assert 1.1 * same_flops.compute_s < moe.compute_s < 1.35 * same_flops.compute_s
    assert moe.comm_s > 2.5 * same_flops.comm_s  # 46.7 B parameters gathered against 14.2 B
    # the experts' extra state (bf16 weights, fp32 gradients, master weights and Adam moments: 16 bytes a parameter,
    # sharded over 64), and more for the larger gathered blocks
    extra = (model_spec(MIXTRAL_8X7B).param_count - model_spec(dense).param_count) * 16 / 64
    assert moe.memory_bytes - same_flops.memory_bytes > extra > 8e9
    with pytest.raises(InputError, match="num_experts_per_tok"):
        model_spec({**MIXTRAL_8X7B, "num_experts_per_tok": None})


def test_plan_ranks_fitting_plans_by_throughput_and_reports_memory():
    result = atorch.plan("llama3-8b", "8xH100-96GB", global_batch=16, seq_len=8192)
    fitting = [p for p in result.predictions if p.fits]
    assert fitting and result.best is fitting[0]
    # by whole tokens/s (plans within a token/s of each other: less memory first)
    ranked = [round(p.tokens_per_s_per_gpu) for p in fitting]
    assert ranked == sorted(ranked, reverse=True)
    assert all(0 < p.mfu < 1 for p in result.predictions)
    assert all(not p.fits for p in result.predictions if p.memory_bytes > DEVICES["H100-96GB"].memory_bytes)
    # plain data parallelism of an 8B model with Adam needs ~16 bytes per parameter on every GPU
    ddp = next(p for p in result.predictions if p.candidate.label == "ddp+amp_bf16")
    assert not ddp.fits and ddp.memory_bytes > 8e9 * 16


def test_user_device_from_a_dict_and_typed_errors():
    mine = device_spec({"base": "A100-80GB", "name": "A100-80GB-fast-net", "network_bytes_per_s": 100e9})
    assert mine.bf16_flops == DEVICES["A100-80GB"].bf16_flops and mine.network_bytes_per_s == 100e9
    assert cluster_spec({"nodes": 2, "gpus_per_node": 8, "device": "H200"}).world_size == 16
    with pytest.raises(InputError, match="valid keys"):
        device_spec({"base": "H200", "flops": 1})
    with pytest.raises(InputError, match="unknown key"):
        cluster_spec({"gpus": 8, "device": "H200"})
    with pytest.raises(InputError, match="required"):
        model_spec({"hidden_size": 64})
    with pytest.raises(InputError, match="llama3-8b"):
        model_spec("llama3-8")


def test_every_built_in_device_has_its_fitted_efficiency():
    """A device's family names the constant its matmuls run at (calibration.py): a device added without
    one would fail only when someone plans for it."""
    from atorch.plan import calibration

    for device in DEVICES.values():
        assert f"{device.family} efficiency" in calibration.FITTED, device.name
        assert 0 < device.matmul_efficiency < 1


def test_blackwell_parts_plan_with_their_own_efficiencies():
    """B200 (1000 W) and the 750 W part share the datasheet numbers and differ only in the efficiency each
    is fitted to (a Megatron-Bridge run, a torchao one): the capped part is predicted slower."""
    full = atorch.estimate("llama3-8b", "8xB200", global_batch=16, seq_len=8192, sharding="fsdp",
                           precision="bf16")
    capped = atorch.estimate("llama3-8b", "8xB200-750W", global_batch=16, seq_len=8192, sharding="fsdp",
                             precision="bf16")
    hopper = atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=8192, sharding="fsdp",
                             precision="bf16")
    assert capped.tokens_per_s_per_gpu < full.tokens_per_s_per_gpu
    assert hopper.tokens_per_s_per_gpu < full.tokens_per_s_per_gpu
    assert full.memory_bytes == capped.memory_bytes and full.fits
    result = atorch.plan("llama3-70b", "4x8xB200", global_batch=32, seq_len=8192)
    assert result.best is not None
    # the device's thin calibration is said on every prediction and once under the table
    assert all(any(n.startswith("B200: its efficiency is fitted on one") for n in p.notes) for p in result.predictions)
    assert result.table().count("note: B200: its efficiency is fitted on one published run") == 1
    assert not any(n.startswith("B200") for n in hopper.notes)


def test_tensor_groups_stay_inside_a_node():
    result = atorch.plan("llama3-8b", "2x4xH100-80GB", global_batch=16, seq_len=4096)
    assert max(p.candidate.tensor for p in result.predictions) == 4
    assert "span nodes" in result.skipped.get("ddp+amp_bf16+tp8", "") or any(
        "span nodes" in why for why in result.skipped.values())


def test_meta_module_and_the_top_plan_runs_with_load_strategy():
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    with torch.device("meta"):
        meta = GPT(config)
    result = atorch.plan(meta, "1xA100-80GB", global_batch=8, seq_len=16)
    assert result.model.param_count == sum(p.numel() for p in meta.parameters())
    strategy = result.strategy
    assert strategy is not None and "checkpoint" not in strategy.names()  # a tiny model needs no recompute
    torch.manual_seed(0)
    status, out, applied = auto_accelerate(GPT(config), torch.optim.SGD, SyntheticTokenDataset(16, 16, 64), gpt_loss,
                                           optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
                                           model_input_format="unpack_dict", load_strategy=strategy)
    assert status
    batch = out.prepare_input(next(iter(out.dataloader)))
    loss = out.loss_func(batch, out.model(**batch))
    loss.backward()
    out.optim.step()
    assert torch.isfinite(loss)


def test_estimate_of_the_top_plan_gives_the_figures_plan_reports():
    """estimate() runs the model plan() ranks with: the configuration plan() put first, named by hand,
    gets the same throughput, MFU, memory and fit."""
    result = atorch.plan("llama3-8b", "2x8xH100-80GB", global_batch=32, seq_len=8192)
    for best in [result.best] + [p for p in result.predictions if p.candidate.tensor * p.candidate.pipeline > 1][:3]:
        c = best.candidate
        data = c.data_size(16)
        sharding = "hsdp" if c.shard else c.sharding
        precision = {v: k for k, v in PRECISIONS.items()}[c.precision]
        mine = atorch.estimate("llama3-8b", "2x8xH100-80GB", global_batch=32, seq_len=8192, tensor=c.tensor,
                               pipeline=c.pipeline, sharding=sharding, precision=precision,
                               activation_checkpointing=best.checkpointing,
                               micro_batch_size=32 // data // c.micro if c.micro > 1 else None,
                               grad_sync=c.grad_sync, vocab_parallel_loss=False, sequence_parallel=False)
        assert mine.candidate == c
        assert mine.tokens_per_s_per_gpu == pytest.approx(best.tokens_per_s_per_gpu, rel=1e-9)
        assert mine.mfu == pytest.approx(best.mfu, rel=1e-9)
        assert mine.memory_bytes == best.memory_bytes and mine.fits == best.fits


@pytest.mark.parametrize("key, value, valid", [
    ("sharding", "fsdp2", "hsdp"), ("precision", "bfloat16", "pure_bf16"),
    ("activation_checkpointing", "op", "core_attention"), ("tensor", 3, "divide"), ("micro_batch_size", 0, "positive"),
    ("optimizer_states", "fp16", "bf16_moments"),
    ("grad_sync", "every", "each_micro_step"), ("tp_comm_overlap", "yes", "True"),
    ("grad_reduce_overlap", 1, "None"), ("param_gather_overlap", "on", "None"), ("pipeline_p2p_overlap", 0, "None"),
    ("distributed_optimizer", True, "zero1"), ("virtual_stages", 2, "pipeline > 1"), ("virtual_stages", 0, "positive"),
    ("fused_swiglu", "yes", "True"), ("vocab_parallel_loss", "no", "True"), ("saves_gathered_inputs", 1, "True"),
    ("grad_reduce_dtype", "fp16", "bf16"),
    ("attention", "eager", "materialised"), ("sequence_parallel", 1, "True"),
    ("half_grads_kept", "yes", "True"), ("half_grads_kept", True, "zero1"), ("stage_outputs_kept", 1, "True"),
    ("stage_outputs_kept", True, "pipeline > 1"), ("fsdp_units", "per_layer", "embedding_and_head_apart"),
])
def test_estimate_names_a_bad_value_and_the_valid_choices(key, value, valid):
    with pytest.raises(InputError, match=valid) as error:
        atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=4096, **{key: value})
    assert key in str(error.value)


def test_fsdp_units_apart_gather_the_larger_of_embedding_and_head_not_both():
    """torchtitan since 2025-07 shards the embedding and [norm, output] as FSDP units of their own: the
    three units FSDP holds gathered at once (the unit, the prefetched next, the unsharded gradient) are
    the output layer's size, not the root's embedding + output. Llama 3 8B under autocast (bf16 gathers):
    3 x 2 bytes x (embedding + output + norm - output - norm) = 6 bytes x the embedding's parameters less.
    Refused where it is not modelled (zero2 gathers everything; tensor / pipeline ranks count blocks)."""
    spec = model_spec("llama3-8b")
    args = dict(global_batch=8, seq_len=8192, activation_checkpointing="selective")
    root = atorch.estimate(spec, "8xH100-80GB", **args)
    apart = atorch.estimate(spec, "8xH100-80GB", fsdp_units="embedding_and_head_apart", **args)
    assert root.memory_bytes - apart.memory_bytes == pytest.approx(6 * spec.embedding_params, rel=1e-6)
    assert apart.tokens_per_s_per_gpu == root.tokens_per_s_per_gpu
    hsdp = dict(args, global_batch=16, sharding="hsdp")
    assert (atorch.estimate(spec, "2x8xH100-80GB", fsdp_units="embedding_and_head_apart", **hsdp).memory_bytes
            < atorch.estimate(spec, "2x8xH100-80GB", **hsdp).memory_bytes)
    with pytest.raises(InputError, match="fsdp_units='embedding_and_head_apart' is not valid with sharding='zero2'"):
        atorch.estimate(spec, "8xH100-80GB", sharding="zero2", fsdp_units="embedding_and_head_apart", **args)
    with pytest.raises(InputError, match="tensor=2, pipeline=1: it is modelled for FSDP's units over the whole"):
        atorch.estimate(spec, "8xH100-80GB", tensor=2, fsdp_units="embedding_and_head_apart", **args)


def test_fp8_is_refused_on_a_device_without_fp8_and_other_frameworks_sharding_names_are_pointed_at_ours():
    """fp8 on an A100 used to be predicted as bf16 matmuls plus fp8's casts, with fp8's smaller saved
    activations: a run the device cannot do, priced. DeepSpeed's / FSDP's names for a sharding are
    refused (no silent reading) with ours named."""
    with pytest.raises(InputError, match=r"precision='fp8' is not valid on A100-80GB: it has no fp8"):
        atorch.estimate("llama3-8b", "8xA100-80GB", global_batch=16, seq_len=4096, precision="fp8")
    assert atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=4096, precision="fp8").fits
    for theirs, ours in (("zero3", "fsdp"), ("full_shard", "fsdp"), ("shard_grad_op", "zero2"),
                         ("hybrid_shard", "hsdp")):
        with pytest.raises(InputError, match=rf"sharding='{theirs}' is not valid.*'{theirs}' is '{ours}' here"):
            atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=4096, sharding=theirs)


def test_selective_checkpointing_is_ranked_but_the_strategy_is_one_atorch_applies():
    """Selective checkpointing is a planner candidate (it keeps more than full recompute, so it is
    faster and bigger); no atorch method offers it, so the strategy is the best plan without it."""
    result = atorch.plan("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=8192)
    selective = [p for p in result.predictions if p.checkpointing == "selective"]
    assert selective and "sel-ckpt" in result.table()
    for p in selective:
        full = next(q for q in result.predictions if q.candidate == p.candidate and q.checkpointing == "full")
        assert p.step_time_s < full.step_time_s and p.memory_bytes > full.memory_bytes
    assert result.applicable.checkpointing != "selective"
    assert result.strategy.names() == result.applicable.candidate.strategy(8).names()
    mine = atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=8192,
                           sharding=selective[0].candidate.sharding, activation_checkpointing="selective")
    same = next(p for p in selective if p.candidate.label == mine.candidate.label)
    assert mine.tokens_per_s_per_gpu == pytest.approx(same.tokens_per_s_per_gpu, rel=1e-9)


@pytest.mark.parametrize("layout", [dict(tensor=4, pipeline=4, sharding="zero1"), dict(sharding="fsdp"),
                                    dict(sharding="zero1"), dict(sharding="ddp")])
def test_optimizer_state_precision_sets_the_state_bytes(layout):
    """Adam's state in bf16: the moments alone (bf16_moments) save 4 bytes per parameter, no fp32 copy
    at all (bf16: bf16 weights, gradients and moments) saves 8 of the 16 amp keeps; sharded as the
    layout shards the state; the activations do not change."""
    args = dict(global_batch=16, seq_len=4096, precision="bf16", **layout)
    spec = model_spec("llama2-70b" if layout.get("tensor") else "llama3-8b")
    cluster = "2x8xH100-80GB" if layout.get("tensor") else "8xH100-80GB"
    by = {s: atorch.estimate(spec, cluster, optimizer_states=s, **args) for s in ("fp32", "bf16_moments", "bf16")}
    gpus = 16 if layout.get("tensor") else 8
    model_parallel = 16 if layout.get("tensor") else 1
    data = gpus // model_parallel
    sharded = layout["sharding"] != "ddp" and data > 1
    moments = spec.param_count / model_parallel * 4 / (data if sharded else 1)
    saved = by["fp32"].allocated_bytes - by["bf16_moments"].allocated_bytes
    assert saved == pytest.approx(moments, rel=0.05)
    assert by["bf16"].allocated_bytes < by["bf16_moments"].allocated_bytes
    if not sharded:  # every byte of the state is on the GPU: 16 per parameter against 8 (DDP: its gradient
        # buckets in bf16 and no autocast copies of fp32 weights save 2 + 2 more)
        per_param = (by["fp32"].allocated_bytes - by["bf16"].allocated_bytes) / (spec.param_count / model_parallel)
        assert 8 <= per_param <= 12
    assert by["bf16"].tokens_per_s_per_gpu >= by["fp32"].tokens_per_s_per_gpu


def test_a_pipeline_split_that_counts_the_ends_as_blocks_peaks_on_the_second_stage():
    """Llama 3 405B's split: 126 blocks on 16 stages with the embedding and the output layer counted as a
    block each, so 7 blocks on the first and the last stage and 8 between. Under 1F1B stage k holds p - k
    micro-batches, so the peak moves to the second stage (8 blocks x 15) from the first (8 x 16 evenly)."""
    from atorch.plan import analytic, configuration

    spec = model_spec({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
                       "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
                       "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False})
    spec, cluster, candidate, work = configuration(spec, "1024x8xH100-80GB", global_batch=2048, seq_len=8192, tensor=8,
                                                   pipeline=16, sharding="fsdp", micro_batch_size=1)
    ends = dataclasses.replace(work, pipeline_ends_as_layers=True)
    assert analytic.stage_blocks(spec, 16, work) == [8] * 16
    assert analytic.stage_blocks(spec, 16, ends) == [7] + [8] * 14 + [7]
    assert [analytic.micro_batches_in_flight(16, 1, k) for k in (0, 1, 15)] == [16, 15, 1]
    assert analytic.micro_batches_in_flight(16, 4, 0) == 16 + 15 / 4
    even = analytic.layout_memory(candidate, spec, work, None, 64)
    split = analytic.layout_memory(candidate, spec, ends, None, 64)

    def blocks(n, in_flight):  # n blocks' activations for in_flight micro-batches of one sequence
        return analytic.activation_bytes(candidate, spec, work, 8192, tensor=8, layers=n, in_flight=in_flight,
                                         head=False)
    # the activations' peak drops from the first stage's 8 x 16 to the second's 8 x 15 (the state, sharded
    # over 64 data ranks, barely changes)
    assert even - split == pytest.approx(blocks(8, 16) - blocks(8, 15), rel=0.02)
    assert blocks(8, 15) > blocks(7, 16)
    named = atorch.estimate(spec, "1024x8xH100-80GB", global_batch=2048, seq_len=8192, tensor=8, pipeline=16,
                            micro_batch_size=1, pipeline_ends_as_layers=True)
    assert named.allocated_bytes == pytest.approx(split, rel=1e-9)


MPT_70B = {"model_type": "mpt", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
           "intermediate_size": 32768, "vocab_size": 50368, "tie_word_embeddings": True}


def test_reducing_every_micro_step_keeps_only_sharded_gradients_and_one_micro_batch():
    """MPT-70B with FSDP on 32 H100s, micro-batch 2 and 16 micro-steps, reduce-scattered every micro-step,
    fit in 80 GB (llm-foundry's table); kept unsharded to the last micro-step, the gradients of the whole
    model (and 16 micro-batches' checkpoints) would not. The throughput barely moves: the extra
    reduce-scatters hide behind each backward."""
    args = dict(global_batch=1024, seq_len=2048, micro_batch_size=2, activation_checkpointing="full")
    last = atorch.estimate(MPT_70B, "4x8xH100-80GB", grad_sync="last_micro_step", **args)
    each = atorch.estimate(MPT_70B, "4x8xH100-80GB", grad_sync="each_micro_step", **args)
    assert atorch.estimate(MPT_70B, "4x8xH100-80GB", **args).memory_bytes == last.memory_bytes  # the default
    assert not last.fits and each.fits
    # the candidate names it as atorch's micro_batch would run it (grad_sync, label mb16s)
    assert (last.candidate.label, each.candidate.label) == ("fsdp+amp_bf16+ckpt+mb16", "fsdp+amp_bf16+ckpt+mb16s")
    assert ("micro_batch", {"num_micro_batch": 16, "grad_sync": "each_micro_step"}) in [
        (item.name, item.config) for item in each.candidate.strategy(32)]
    # at least the unsharded bf16 gradients of the whole model are gone
    assert each.allocated_bytes < last.allocated_bytes - 2 * model_spec(MPT_70B).param_count * 0.9
    assert each.tokens_per_s_per_gpu == pytest.approx(last.tokens_per_s_per_gpu, rel=0.05)


def test_tensor_parallel_overlap_hides_the_tensor_collectives_only():
    """--tp-comm-overlap / async TP hide the tensor-parallel all-gathers and reduce-scatters behind the
    matmuls: faster at tensor 8, the same at tensor 1 (nothing to hide); memory unchanged."""
    args = dict(global_batch=64, seq_len=4096, activation_checkpointing="full")
    for tensor, faster in ((8, True), (1, False)):
        off = atorch.estimate("llama2-70b", "4x8xH100-80GB", tensor=tensor, **args)
        on = atorch.estimate("llama2-70b", "4x8xH100-80GB", tensor=tensor, tp_comm_overlap=True, **args)
        assert on.memory_bytes == off.memory_bytes
        if faster:
            assert on.tokens_per_s_per_gpu > 1.05 * off.tokens_per_s_per_gpu
        else:
            assert on.tokens_per_s_per_gpu == off.tokens_per_s_per_gpu


def test_the_distributed_optimizers_overlap_hides_its_reduce_scatter_and_gather():
    """Megatron's distributed optimizer overlaps neither its gradient reduce-scatter nor its parameter
    all-gather by default (--overlap-grad-reduce / --overlap-param-gather); each one turned on is faster,
    both faster still; across 8 nodes of 8 at 100 Gb/s per GPU the collectives are large enough to show.
    FSDP overlaps by default: turning its overlap off is slower."""
    cluster = ClusterSpec(8, 8, dataclasses.replace(DEVICES["H100-80GB"], network_bytes_per_s=100e9 / 8))
    args = dict(global_batch=512, seq_len=4096, tensor=4, pipeline=2, sharding="zero1", micro_batch_size=1)
    tokens = {(r, g): atorch.estimate("llama3-8b", cluster, grad_reduce_overlap=r, param_gather_overlap=g,
                                      **args).tokens_per_s_per_gpu
              for r in (False, True) for g in (False, True)}
    default = atorch.estimate("llama3-8b", cluster, **args).tokens_per_s_per_gpu
    assert default == tokens[False, False]
    assert tokens[True, False] > tokens[False, False] and tokens[False, True] > tokens[False, False]
    assert tokens[True, True] > max(tokens[True, False], tokens[False, True])
    fsdp = dict(global_batch=64, seq_len=4096)
    on = atorch.estimate("llama3-8b", cluster, **fsdp)
    off = atorch.estimate("llama3-8b", cluster, grad_reduce_overlap=False, param_gather_overlap=False, **fsdp)
    assert off.tokens_per_s_per_gpu < on.tokens_per_s_per_gpu
    assert on.tokens_per_s_per_gpu == atorch.estimate("llama3-8b", cluster, grad_reduce_overlap=True,
                                                      param_gather_overlap=True, **fsdp).tokens_per_s_per_gpu


def test_a_collectives_fixed_cost_grows_with_the_ranks_of_its_ring():
    """NCCL's cost model (its tuner constants, Simple protocol): a ring all-gather or reduce-scatter takes
    a base 8.4 us and one step per rank after the first, 3.4 us over NVLink and 14 us where it crosses to
    another node; an all-reduce takes the shorter of a ring of twice the steps and a tree (4.0 us NVLink
    hops, log2(nodes) network hops, both ways)."""
    from atorch.plan.analytic import ring_latency_s

    cluster = ClusterSpec(512, 8, DEVICES["H100-80GB"])
    assert ring_latency_s(cluster, 1) == 0.0
    assert ring_latency_s(cluster, 8) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert ring_latency_s(cluster, 4096) == pytest.approx(8.4e-6 + 3584 * 3.4e-6 + 511 * 14e-6)
    # one rank a node (a group strided by the node): every step crosses the network
    assert ring_latency_s(cluster, 512, stride=8) == pytest.approx(8.4e-6 + 511 * 14e-6)
    assert ring_latency_s(cluster, 512, stride=8, all_reduce=True) == pytest.approx(8.4e-6 + 2 * 9 * 14e-6)
    assert ring_latency_s(cluster, 8, all_reduce=True) == pytest.approx(8.4e-6 + 2 * 7 * 3.4e-6)


def test_fsdp_over_thousands_of_ranks_waits_on_its_rings_where_hsdp_does_not():
    """FSDP's per-block all-gathers and reduce-scatters over every rank of a 4096-GPU cluster cost some
    19 ms each in ring steps whatever they move: with one sequence a GPU the step waits on them, where
    sharding inside a node and all-reducing across (hsdp) does not. On 64 GPUs the two are alike."""
    from atorch.plan import analytic, configuration

    args = dict(seq_len=4096)
    small = {s: atorch.estimate("llama3-8b", "8x8xH100-80GB", global_batch=64, sharding=s, **args)
             for s in ("fsdp", "hsdp")}
    assert small["fsdp"].tokens_per_s_per_gpu == pytest.approx(small["hsdp"].tokens_per_s_per_gpu, rel=0.05)
    large = {s: atorch.estimate("llama3-8b", "512x8xH100-80GB", global_batch=4096, sharding=s, **args)
             for s in ("fsdp", "hsdp")}
    assert large["hsdp"].tokens_per_s_per_gpu > 3 * large["fsdp"].tokens_per_s_per_gpu
    assert large["hsdp"].tokens_per_s_per_gpu == pytest.approx(small["hsdp"].tokens_per_s_per_gpu, rel=0.05)
    spec, cluster, candidate, work = configuration("llama3-8b", "512x8xH100-80GB", global_batch=4096,
                                                   sharding="fsdp", **args)
    parts = analytic.step_breakdown(candidate, spec, cluster, work, analytic.spec_layout_facts(spec, 4096))
    collectives = 3 * spec.layers  # two gathers (forward, backward) and a reduce-scatter a block
    assert parts["data collectives"] > collectives * analytic.ring_latency_s(cluster, 4096)
    assert parts["communication not hidden"] > 0
    best = atorch.plan("llama3-8b", "512x8xH100-80GB", 4096, 4096).best
    assert best.candidate.sharding == "fsdp" and best.candidate.shard == 8  # the plan shards inside a node


def test_interleaving_shrinks_the_bubble_and_holds_more_micro_batches():
    """virtual_stages: the interleaved schedule's bubble is (p - 1) / (m v), so it is faster; its first
    stage holds p + (p - 1) / v micro-batches' activations, more than 1F1B's p; its sends overlap by default."""
    args = dict(global_batch=64, seq_len=4096, tensor=4, pipeline=4, sharding="zero1", micro_batch_size=1)
    plain = atorch.estimate("llama2-70b", "2x8xH100-80GB", **args)
    interleaved = atorch.estimate("llama2-70b", "2x8xH100-80GB", virtual_stages=4, **args)
    assert interleaved.tokens_per_s_per_gpu > plain.tokens_per_s_per_gpu
    assert interleaved.allocated_bytes > plain.allocated_bytes
    exposed = atorch.estimate("llama2-70b", "2x8xH100-80GB", virtual_stages=4, pipeline_p2p_overlap=False, **args)
    assert exposed.tokens_per_s_per_gpu < interleaved.tokens_per_s_per_gpu


def test_interleaved_chunks_that_hold_only_an_end_hold_no_block():
    """Llama 3 405B's interleaved split: 128 places (126 blocks, the embedding and the output layer) in
    16 x 8 one-place chunks, so the first stage's first chunk holds only the embedding. Its 2 (p - 1) +
    (v - 1) p + 1 = 143 outstanding chunk forwards hold 143 - 31 blocks (31 of them are that chunk's);
    the second stage's 141 each hold a block, so it peaks; with an even split the formula's stages'
    worth, p + (p - 2k - 1) / v, holds."""
    from atorch.plan import analytic, configuration

    spec = model_spec({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
                       "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
                       "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False})
    _, _, _, work = configuration(spec, "1024x8xH100-80GB", global_batch=2048, seq_len=8192, tensor=8,
                                  pipeline=16, micro_batch_size=1, virtual_stages=8, pipeline_ends_as_layers=True)
    assert analytic.held_blocks(spec, work, 16, 0, 32) == pytest.approx(143 - 31)
    assert analytic.held_blocks(spec, work, 16, 1, 32) == pytest.approx(141)
    assert analytic.held_blocks(spec, work, 16, 1, 4) == pytest.approx(4 * 8)  # 4 micro-batches x 8 chunks
    even = dataclasses.replace(work, pipeline_ends_as_layers=False)
    assert analytic.held_blocks(spec, even, 16, 0, 32) == pytest.approx(
        126 / 16 * analytic.micro_batches_in_flight(16, 8, 0))


def test_the_last_stage_runs_the_output_layer_and_the_loss_and_the_pipeline_waits_for_it():
    """Each micro-batch waits for the slowest stage. Under an even split the last stage runs its blocks plus
    the whole output layer, so the step is (p - 1) x the output layer's matmul (counted spread over the
    p stages) longer than an even count, whatever the vocabulary; counting the ends as blocks moves a block
    off the last stage, which then no longer bounds the step."""
    from atorch.plan import analytic, configuration

    def parts(vocab, ends=False):
        spec = model_spec({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                           "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
                           "num_key_value_heads": 4, "vocab_size": vocab, "tie_word_embeddings": False})
        spec, cluster, candidate, work = configuration(spec, "1x8xH100-80GB", global_batch=64, seq_len=4096,
                                                       tensor=2, pipeline=4, sharding="zero1", micro_batch_size=1,
                                                       pipeline_ends_as_layers=ends)
        return (analytic.head_stage_excess_seconds(candidate, spec, cluster, work),
                analytic.matmul_seconds(candidate, spec, cluster, work), spec, cluster, candidate, work)

    small, large = parts(32000), parts(256000)
    assert small[0] > 0
    assert large[0] - small[0] == pytest.approx(3 * (large[1] - small[1]), rel=1e-9)
    excess = large[0]
    ends = parts(256000, ends=True)[0]
    assert ends < excess  # 18 places, 4.5 a stage: 3.5, 4.5, 4.5, 3.5 blocks
    big = dict(global_batch=64, seq_len=4096, tensor=2, pipeline=4, sharding="zero1", micro_batch_size=1)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
              "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
              "num_key_value_heads": 4, "vocab_size": 256000, "tie_word_embeddings": False}
    assert (atorch.estimate(config, "1x8xH100-80GB", pipeline_ends_as_layers=True, **big).tokens_per_s_per_gpu
            > atorch.estimate(config, "1x8xH100-80GB", **big).tokens_per_s_per_gpu)


@pytest.mark.parametrize("name, tensor", [("llama2-7b", 1), ("llama2-70b", 4), ("llama3-8b", 8)])
def test_a_blocks_weight_matmuls_are_timed_each_at_its_own_shape(name, tensor):
    """Each weight matmul's width is 2 k n / (k + n) on its tensor rank (k in, n out) and its time FLOPs x
    (1 + half / width): the one width the block is timed at gives the same sum for any half-width, and it is
    wider than the hidden size alone said (2 h / (1 + t)), the MLP's matmuls being wider."""
    from atorch.plan import analytic

    spec = model_spec(name)
    t = tensor
    shapes = [(spec.hidden, (spec.q_dim + 2 * spec.kv_dim) / t), (spec.q_dim / t, spec.hidden),
              (spec.hidden, 2 * spec.ffn / t), (spec.ffn / t, spec.hidden)]
    width = analytic.weight_matmul_width(spec, t)
    for half in (100.0, 1000.0, 5000.0):
        each = sum(k * n * (1 + half * (k + n) / (2 * k * n)) for k, n in shapes)
        assert sum(k * n for k, n in shapes) * (1 + half / width) == pytest.approx(each, rel=1e-12)
    assert width > 2 * spec.hidden / (1 + t)


def test_under_fp8_the_output_layer_stays_in_bf16():
    """The fp8 recipes convert the blocks' linear layers, not the output layer: its matmul takes the same
    time under fp8 as under bf16, while the blocks' take less."""
    from atorch.plan import analytic, configuration

    def seconds(precision):
        spec, cluster, candidate, work = configuration("llama3-8b", "1x8xH100-80GB", global_batch=64, seq_len=4096,
                                                       sharding="zero1", micro_batch_size=1, precision=precision)
        head = analytic.head_matmul_seconds(candidate, spec, cluster, work)
        return head, analytic.matmul_seconds(candidate, spec, cluster, work) - head

    (head_bf16, blocks_bf16), (head_fp8, blocks_fp8) = seconds("bf16"), seconds("fp8")
    assert head_fp8 == pytest.approx(head_bf16) and head_fp8 > 0
    assert blocks_fp8 < 0.7 * blocks_bf16


LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_a_megatron_pipeline_layout_gives_each_chunk_its_blocks():
    """Megatron-Core's pipeline_model_parallel_layout: Megatron-Bridge's Llama 3 70B layout puts 3 blocks in
    chunk 35 (stage 3) and 1 beside the loss in chunk 39 (stage 7): stage 3 holds 11 blocks, stage 7 nine
    and the output layer. The even split written as a layout predicts exactly what the even split does."""
    from atorch.plan import analytic, configuration, parse_pipeline_layout

    chunks = parse_pipeline_layout("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL", 8, 80)
    assert len(chunks) == 40 and chunks[35] == 3 and chunks[39] == 1 and sum(chunks) == 80
    args = dict(global_batch=256, seq_len=8192, tensor=4, pipeline=8, sharding="zero1", micro_batch_size=1,
                precision="fp8")
    spec, _, _, work = configuration(LLAMA3_70B, "8x8xH100-80GB", pipeline_layout="Et*2|(t*2|)*34,t*3|(t*2|)*3,tL",
                                     **args)
    assert work.virtual_stages == 5
    assert analytic.stage_blocks(spec, 8, work) == [10, 10, 10, 11, 10, 10, 10, 9]
    even = atorch.estimate(LLAMA3_70B, "8x8xH100-80GB", virtual_stages=5, **args)
    written = atorch.estimate(LLAMA3_70B, "8x8xH100-80GB", pipeline_layout="E(t*2|)*39,t*2L", **args)
    assert written.step_time_s == pytest.approx(even.step_time_s) and written.memory_bytes == even.memory_bytes
    tuned = atorch.estimate(LLAMA3_70B, "8x8xH100-80GB", pipeline_layout="Et*2|(t*2|)*34,t*3|(t*2|)*3,tL", **args)
    assert tuned.step_time_s < even.step_time_s  # the last stage's output layer outweighs one block


@pytest.mark.parametrize("layout, extra, named", [
    ("Et*2|(t*2|)*38,t*2Lm", {}, "'m'"),
    ("Et*2|(t*2|)*38,t*2X", {}, "'X'"),
    ("Et*2|(t*2|)*37,t*2L", {}, "not a multiple"),
    ("t*2|E(t*2|)*38,L", {}, "embedding (E) must open"),
    ("Et*2|(t*2|)*38,tL", {}, "places 79 blocks"),
    ("E(t*2|)*39,t*2L", {"virtual_stages": 4}, "contradicts"),
    ("E(t*2|)*39,t*2L", {"pipeline_ends_as_layers": True}, "places the embedding and the loss itself"),
    ("", {}, "not a layout string"),
])
def test_a_bad_pipeline_layout_is_refused_by_name(layout, extra, named):
    with pytest.raises(InputError) as raised:
        atorch.estimate(LLAMA3_70B, "8x8xH100-80GB", global_batch=256, seq_len=8192, tensor=4, pipeline=8,
                        sharding="zero1", pipeline_layout=layout, **extra)
    assert named.replace("(", "").replace(")", "") in str(raised.value).replace("(", "").replace(")", "")


def test_logits_are_split_on_the_vocabulary_only_where_the_loss_runs_on_the_split_logits():
    """Megatron's vocab-parallel cross-entropy and torchtitan's loss_parallel hold 1/tp of the logits a tensor
    rank; atorch's tensor_parallel gathers them whole (the user's loss reads one tensor), and plan(), whose
    candidates are atorch's, counts them whole: at 8 tensor ranks and 8K tokens a sequence, Llama 3 8B's
    logits (128,256 a token, 10 bytes each) are 8.8 GiB whole against 1.1 split."""
    from atorch.plan.analytic import LOGIT_BYTES, LOSS_PARALLEL_LOGIT_BYTES, Workload, loss_bytes

    spec, work = model_spec("llama3-8b"), Workload(8, 8192)
    split = loss_bytes(spec, work, 8192, 8)
    whole = loss_bytes(spec, dataclasses.replace(work, vocab_parallel_loss=False), 8192, 8)
    assert whole == 8 * split == spec.vocab * 8192 * LOGIT_BYTES
    assert loss_bytes(spec, dataclasses.replace(work, loss_parallel_logit_bytes=LOSS_PARALLEL_LOGIT_BYTES), 8192, 8) \
        == spec.vocab * 8192 * LOSS_PARALLEL_LOGIT_BYTES / 8
    assert loss_bytes(spec, dataclasses.replace(work, vocab_parallel_loss=False), 8192, 1) == split * 8  # no tensor
    args = dict(global_batch=8, seq_len=8192, tensor=8, sharding="ddp", micro_batch_size=1)
    vocab_split = atorch.estimate("llama3-8b", "8xH100-80GB", **args)
    gathered = atorch.estimate("llama3-8b", "8xH100-80GB", vocab_parallel_loss=False, **args)
    assert gathered.memory_bytes - vocab_split.memory_bytes == pytest.approx(whole - split, rel=0.01)
    assert gathered.tokens_per_s_per_gpu == vocab_split.tokens_per_s_per_gpu
    seen = []
    original = vars(atorch.plan)["predict"]

    def spy(candidate, spec, cluster, work, facts=None):
        seen.append(work.vocab_parallel_loss)
        return original(candidate, spec, cluster, work, facts)

    vars(atorch.plan)["predict"] = spy
    try:
        atorch.plan("llama3-8b", "8xH100-80GB", global_batch=8, seq_len=8192)
    finally:
        vars(atorch.plan)["predict"] = original
    assert seen and not any(seen)


def test_dtensor_tensor_parallelism_keeps_its_gathered_inputs_whole():
    """Under sequence parallelism DTensor's column-parallel matmuls save the all-gathered input they ran
    on (torchtitan, atorch's tensor_parallel), where Megatron saves the sequence shard: per block and
    token the two norm outputs count whole, 2 x hidden x 2 bytes x (1 - 1/tp) more, and the output
    layer's gathered input stays through the loss. Without tensor parallelism nothing changes."""
    from atorch.plan import configuration
    from atorch.plan.analytic import activation_bytes, block_bytes_per_token

    args = dict(global_batch=64, seq_len=8192, tensor=8)
    spec, _, candidate, work = configuration("llama3-70b", "8x8xH100-80GB", **args)
    gathered = dataclasses.replace(work, saves_gathered_inputs=True)
    extra = block_bytes_per_token(candidate, spec, gathered, 8) - block_bytes_per_token(candidate, spec, work, 8)
    assert extra == pytest.approx(2 * spec.hidden * 2 * (1 - 1 / 8))
    assert block_bytes_per_token(candidate, spec, gathered, 1) == block_bytes_per_token(candidate, spec, work, 1)
    head = (activation_bytes(candidate, spec, gathered, 8192, tensor=8, layers=0)
            - activation_bytes(candidate, spec, work, 8192, tensor=8, layers=0))
    assert head >= 8192 * spec.hidden * 2  # the output layer's whole input (and the block's larger working set)
    megatron = atorch.estimate("llama3-70b", "8x8xH100-80GB", **args)
    dtensor = atorch.estimate("llama3-70b", "8x8xH100-80GB", saves_gathered_inputs=True, **args)
    assert dtensor.allocated_bytes > megatron.allocated_bytes
    assert dtensor.tokens_per_s_per_gpu == megatron.tokens_per_s_per_gpu


def test_under_full_checkpointing_the_loss_peak_reserves_a_blocks_freed_segments_beside_it():
    """Checkpointed blocks free their forward activations as they go, into segments sized for a
    block's tensors; where the loss is the peak its logits-sized tensors need new segments, so one
    block's forward activations stay reserved beyond the live tensors. Not where the blocks keep their
    activations (no checkpointing) or where a block's backward is the peak."""
    from atorch.plan import configuration
    from atorch.plan.analytic import block_bytes_per_token

    args = dict(global_batch=256, seq_len=8192, tensor=8)
    spec, cluster, candidate, work = configuration(LLAMA3_8B_CONFIG, "32x8xH100-80GB", activation_checkpointing="full",
                                                   **args)
    full = atorch.estimate(LLAMA3_8B_CONFIG, "32x8xH100-80GB", activation_checkpointing="full", **args)
    tokens = 256 * 8192 / 32
    per_block = block_bytes_per_token(candidate, spec, work, 8) * tokens
    assert full.memory_bytes - full.allocated_bytes == pytest.approx(per_block, rel=1e-6)
    kept = atorch.estimate(LLAMA3_8B_CONFIG, "32x8xH100-80GB", activation_checkpointing="none", **args)
    assert kept.memory_bytes == kept.allocated_bytes
    small_vocab = {**LLAMA3_8B_CONFIG, "vocab_size": 1024}
    no_loss_peak = atorch.estimate(small_vocab, "32x8xH100-80GB", activation_checkpointing="full", **args)
    assert no_loss_peak.memory_bytes == no_loss_peak.allocated_bytes


def test_a_compiled_blocks_selective_saved_scale_scales_only_the_selectively_kept_activations():
    """``selective_saved_scale`` (a compiled block's saved set over the eager one the selective share
    was fitted on, benchmarks/compiled_activations.py) scales the blocks' kept activations under
    selective checkpointing, and nothing under none or full."""
    from atorch.plan import configuration
    from atorch.plan.analytic import activation_bytes

    spec, _, candidate, work = configuration("llama3-8b", "8xH100-80GB", global_batch=16, seq_len=8192)
    scaled = dataclasses.replace(work, selective_saved_scale=0.5)
    for mode, ratio in (("selective", 0.5), ("none", 1.0), ("full", 1.0)):
        base, less = (dataclasses.replace(w, activation_checkpointing=mode) for w in (work, scaled))
        blocks = [activation_bytes(candidate, spec, w, 16384, layers=32, head=False)
                  - activation_bytes(candidate, spec, w, 16384, layers=0, head=False) for w in (base, less)]
        assert blocks[1] == pytest.approx(ratio * blocks[0]), mode


def test_a_fused_swiglu_saves_three_intermediate_widths_not_four():
    """fused_swiglu (Megatron-Core's bias_swiglu_fusion) keeps no silu output for backward: less memory on a
    gated MLP, by one intermediate width per token and block; the same speed; a GELU MLP is unchanged."""
    args = dict(global_batch=64, seq_len=4096, tensor=4, pipeline=2, sharding="zero1", micro_batch_size=1)
    eager = atorch.estimate("llama3-8b", "2x8xH100-80GB", **args)
    fused = atorch.estimate("llama3-8b", "2x8xH100-80GB", fused_swiglu=True, **args)
    assert fused.memory_bytes < eager.memory_bytes
    assert fused.tokens_per_s_per_gpu == eager.tokens_per_s_per_gpu
    gelu = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "intermediate_size": 8192,
            "vocab_size": 32000, "hidden_act": "gelu", "model_type": "gpt2"}
    assert (atorch.estimate(gelu, "8xH100-80GB", fused_swiglu=True, **{**args, "pipeline": 1}).memory_bytes
            == atorch.estimate(gelu, "8xH100-80GB", **{**args, "pipeline": 1}).memory_bytes)


def test_a_bf16_gradient_buffer_halves_the_distributed_optimizers_buffer_and_reduce_scatter():
    """grad_reduce_dtype="bf16" (Megatron's grad_reduce_in_fp32=False): the whole gradient buffer in 2 bytes
    a parameter, not 4 (the optimizer's own shard cast to fp32 beside it), and half the reduce-scatter."""
    from atorch.plan import configuration
    from atorch.plan.analytic import data_comm_parts

    args = dict(global_batch=64, seq_len=4096, tensor=4, pipeline=2, sharding="zero1", micro_batch_size=1)
    fp32 = atorch.estimate("llama3-8b", "4x8xH100-80GB", **args)
    bf16 = atorch.estimate("llama3-8b", "4x8xH100-80GB", grad_reduce_dtype="bf16", **args)
    assert bf16.memory_bytes < fp32.memory_bytes and bf16.comm_s < fp32.comm_s
    parts = {}
    for dtype in ("fp32", "bf16"):
        spec, cluster, candidate, work = configuration("llama3-8b", "4x8xH100-80GB", grad_reduce_dtype=dtype, **args)
        parts[dtype] = data_comm_parts(candidate, spec, cluster, None, work)
    assert parts["bf16"][0] == parts["fp32"][0]
    assert parts["bf16"][1] < parts["fp32"][1]


@pytest.mark.parametrize("layout, named", [(dict(sharding="ddp"), "sharding='ddp'"),
                                           (dict(sharding="zero1"), "sharding='zero1'"),
                                           (dict(sharding="fsdp", precision="fp32"), "precision='fp32'")])
def test_a_bf16_gradient_reduction_is_refused_where_gradients_are_not_reduced_in_their_own_dtype(layout, named):
    """DDP and plain ZeRO-1 all-reduce the fp32 gradients themselves, and fp32 training is modelled reducing
    fp32: grad_reduce_dtype='bf16' there is refused, naming the value and what would take it."""
    with pytest.raises(InputError, match="grad_reduce_dtype='bf16'") as error:
        atorch.estimate("llama3-8b", "2x8xH100-80GB", global_batch=16, seq_len=4096, grad_reduce_dtype="bf16",
                        **layout)
    assert named in str(error.value) and "'fp32'" in str(error.value)


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp", "zero2"])
def test_fsdp_reducing_in_bf16_halves_the_gradient_reduction_and_nothing_else(sharding):
    """FSDP's MixedPrecision reduce_dtype (fms-fsdp's bfSixteen; FSDP's default when only param_dtype is
    given): the reduce-scatter (and hsdp's all-reduce across replicas) moves 2 bytes a gradient, not 4;
    the parameter gathers and the memory stay as they were."""
    from atorch.plan import configuration
    from atorch.plan.analytic import COLLECTIVE_LATENCY_S, data_comm_parts, ring_latency_s

    args = dict(global_batch=32, seq_len=4096, sharding=sharding, micro_batch_size=1)
    fp32 = atorch.estimate("llama2-7b", "2x8xA100-80GB", **args)
    bf16 = atorch.estimate("llama2-7b", "2x8xA100-80GB", grad_reduce_dtype="bf16", **args)
    assert bf16.memory_bytes == fp32.memory_bytes and bf16.comm_s < fp32.comm_s
    parts = {}
    for dtype in ("fp32", "bf16"):
        spec, cluster, candidate, work = configuration("llama2-7b", "2x8xA100-80GB", grad_reduce_dtype=dtype, **args)
        parts[dtype] = data_comm_parts(candidate, spec, cluster, None, work)
    assert parts["bf16"][0] == parts["fp32"][0]
    # what does not halve: each reduction's fixed cost (two micro-steps, one reduction per block, over the
    # 16 ranks or, under hsdp, a node's 8), and hsdp's all-reduce across the two replicas once per block
    shard = 8 if sharding == "hsdp" else 16
    latency = 2 * spec.layers * max(COLLECTIVE_LATENCY_S, ring_latency_s(cluster, shard))
    if sharding == "hsdp":
        latency += spec.layers * ring_latency_s(cluster, 2, stride=8, all_reduce=True)
    assert parts["bf16"][1] - latency == pytest.approx((parts["fp32"][1] - latency) / 2, rel=1e-9)


def test_materialised_attention_is_slower_and_keeps_its_scores():
    """attention="materialised" (Megatron before flash attention): the whole s x s square as batched
    matmuls as narrow as a head, memory-bound softmax and dropout over the scores, and 5 bytes per head and
    key saved: slower and bigger than flash, more so with more heads (narrower heads, more scores)."""
    args = dict(global_batch=64, seq_len=4096, tensor=4, pipeline=2, sharding="zero1", micro_batch_size=1)
    flash = atorch.estimate("llama2-13b", "2x8xA100-80GB", **args)
    eager = atorch.estimate("llama2-13b", "2x8xA100-80GB", attention="materialised", **args)
    assert eager.tokens_per_s_per_gpu < 0.95 * flash.tokens_per_s_per_gpu
    assert eager.memory_bytes > flash.memory_bytes
    shape = {"hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 13824, "vocab_size": 32000,
             "model_type": "llama"}
    few, many = ({**shape, "num_attention_heads": heads} for heads in (20, 80))
    assert (atorch.estimate(many, "2x8xA100-80GB", attention="materialised", **args).tokens_per_s_per_gpu
            < atorch.estimate(few, "2x8xA100-80GB", attention="materialised", **args).tokens_per_s_per_gpu)


def test_core_attention_checkpointing_recomputes_the_attention_core_alone():
    """activation_checkpointing="core_attention" (Megatron's --recompute-granularity selective): under
    materialised attention it keeps every activation but the scores, exactly the 5 bytes per head and key
    a token of each block (Korthikanti et al.'s 5as/h), and pays their recompute: slower than keeping
    everything, faster than recomputing every block. Under flash attention there are no scores to drop:
    the same memory, the kernel's forward once more."""
    gpt_22b = {"model_type": "gpt2", "n_embd": 6144, "n_layer": 48, "n_head": 64, "n_inner": 24576,
               "vocab_size": 51200, "n_positions": 2048}
    args = dict(global_batch=4, seq_len=2048, tensor=8, sharding="ddp", micro_batch_size=4)
    modes = {mode: atorch.estimate(gpt_22b, "8xA100-80GB", attention="materialised", activation_checkpointing=mode,
                                   **args) for mode in ("none", "core_attention", "full")}
    scores = 48 * MATERIALISED_SAVED_BYTES * 64 * 2048 / 8 * (4 * 2048)  # layers x per token x the rank's tokens
    assert modes["none"].allocated_bytes - modes["core_attention"].allocated_bytes == pytest.approx(scores, rel=1e-6)
    assert modes["full"].memory_bytes < modes["core_attention"].memory_bytes
    speed = {mode: p.tokens_per_s_per_gpu for mode, p in modes.items()}
    assert speed["full"] < speed["core_attention"] < speed["none"]
    assert modes["core_attention"].checkpointing == "core_attention"
    flash = {mode: atorch.estimate(gpt_22b, "8xA100-80GB", activation_checkpointing=mode, **args)
             for mode in ("none", "core_attention")}
    assert flash["core_attention"].memory_bytes == flash["none"].memory_bytes
    assert flash["core_attention"].tokens_per_s_per_gpu < flash["none"].tokens_per_s_per_gpu


def test_without_sequence_parallelism_the_residual_stream_is_whole_on_every_tensor_rank():
    """sequence_parallel=False: the norms and residual adds run whole on each tensor rank (slower) and their
    activations are kept whole (bigger); at tensor 1 there is nothing to split, so nothing changes."""
    args = dict(global_batch=64, seq_len=4096, pipeline=2, sharding="zero1", micro_batch_size=1)
    on = atorch.estimate("llama2-13b", "2x8xA100-80GB", tensor=4, **args)
    off = atorch.estimate("llama2-13b", "2x8xA100-80GB", tensor=4, sequence_parallel=False, **args)
    assert off.tokens_per_s_per_gpu < on.tokens_per_s_per_gpu and off.memory_bytes > on.memory_bytes
    one = atorch.estimate("llama2-13b", "2x8xA100-80GB", tensor=1, **args)
    assert atorch.estimate("llama2-13b", "2x8xA100-80GB", tensor=1, sequence_parallel=False, **args) == one


def test_deepspeeds_bf16_copy_of_the_reduced_gradients_adds_two_bytes_a_parameter():
    """reduce_cast_copy (DeepSpeed's engine all-reduces the BF16 optimizer's fp32 gradient buffer through a
    bf16 copy): 2 bytes per parameter of the largest stage's share on top of the peak, time unchanged;
    refused where there is no fp32 distributed-optimizer buffer to copy, naming what would take it."""
    from atorch.plan import configuration
    from atorch.plan.analytic import _largest_stage

    args = dict(global_batch=64, seq_len=2048, tensor=4, pipeline=4, sharding="zero1", micro_batch_size=1,
                activation_checkpointing="full")
    base = atorch.estimate("llama2-13b", "4x8xA100-80GB", **args)
    copy = atorch.estimate("llama2-13b", "4x8xA100-80GB", reduce_cast_copy=True, **args)
    spec, cluster, candidate, work = configuration("llama2-13b", "4x8xA100-80GB", **args)
    assert copy.allocated_bytes - base.allocated_bytes == pytest.approx(2 * _largest_stage(spec, 4, 4), rel=1e-6)
    assert copy.step_time_s == base.step_time_s
    for bad in (dict(sharding="fsdp"), dict(grad_reduce_dtype="bf16"), dict(precision="fp32")):
        with pytest.raises(InputError, match="reduce_cast_copy=True is not valid") as error:
            atorch.estimate("llama2-13b", "4x8xA100-80GB", reduce_cast_copy=True, **{**args, **bad})
        assert "grad_reduce_dtype='fp32'" in str(error.value) and "zero1" in str(error.value)


def test_deepspeeds_kept_gradients_and_stage_outputs_add_their_exact_bytes():
    """half_grads_kept (DeepSpeed's BF16 optimizer keeps the model's bf16 gradients beside its fp32 buffer):
    2 bytes per parameter of the largest stage's share, time unchanged; stage_outputs_kept (DeepSpeed's
    pipeline engine keeps each in-flight micro-batch's stage output until its backward): on the first
    stage, p in-flight micro-batches x tokens x hidden x 2 bytes, whole on each tensor rank without
    sequence parallelism."""
    from atorch.plan import configuration
    from atorch.plan.analytic import _largest_stage, outstanding_chunks

    args = dict(global_batch=64, seq_len=2048, tensor=4, pipeline=4, sharding="zero1", micro_batch_size=1,
                activation_checkpointing="full", sequence_parallel=False)
    base = atorch.estimate("llama2-13b", "4x8xA100-80GB", **args)
    grads = atorch.estimate("llama2-13b", "4x8xA100-80GB", half_grads_kept=True, **args)
    spec, cluster, candidate, work = configuration("llama2-13b", "4x8xA100-80GB", **args)
    assert grads.allocated_bytes - base.allocated_bytes == pytest.approx(2 * _largest_stage(spec, 4, 4), rel=1e-6)
    assert grads.step_time_s == base.step_time_s
    outputs = atorch.estimate("llama2-13b", "4x8xA100-80GB", stage_outputs_kept=True, **args)
    micro = 64 // 2  # 32 data-rank micro-batches of one sequence (world 32 / tensor 4 / pipeline 4 = 2 data ranks)
    in_flight = outstanding_chunks(4, 1, 0, micro)
    assert in_flight == 4
    assert outputs.allocated_bytes - base.allocated_bytes == pytest.approx(in_flight * 2048 * spec.hidden * 2, rel=1e-6)


def test_packed_documents_attend_over_their_span_not_the_whole_sequence():
    """attention_span (packed fine-tuning, variable-length flash attention): causal attention's time and
    the MFU's attention term go with the documents' span; the weights' matmuls and the memory do not move.
    Exactly: the attention seconds scale by span / seq_len (no recompute here), and a span equal to the
    sequence changes nothing."""
    from atorch.plan import configuration
    from atorch.plan.analytic import attention_seconds, matmul_seconds

    args = dict(global_batch=32, seq_len=4096, sharding="zero1", micro_batch_size=1, precision="fp8")
    whole = atorch.estimate("llama2-7b", "8xH100-80GB", **args)
    packed = atorch.estimate("llama2-7b", "8xH100-80GB", attention_span=128, **args)
    assert packed.tokens_per_s_per_gpu > 1.1 * whole.tokens_per_s_per_gpu
    assert packed.memory_bytes == whole.memory_bytes
    assert atorch.estimate("llama2-7b", "8xH100-80GB", attention_span=4096, **args) == whole
    seconds = {}
    for span in (None, 128):
        spec, cluster, candidate, work = configuration("llama2-7b", "8xH100-80GB", attention_span=span, **args)
        seconds[span] = (attention_seconds(candidate, spec, cluster, work),
                         matmul_seconds(candidate, spec, cluster, work))
    assert seconds[128][0] == pytest.approx(seconds[None][0] * 128 / 4096, rel=1e-12)
    assert seconds[128][1] == seconds[None][1]


@pytest.mark.parametrize("bad, named", [
    (dict(attention_span=0), "attention_span=0"),
    (dict(attention_span=8192), "attention_span=8192 is not valid with seq_len=4096"),
    (dict(attention_span=1.5), "attention_span=1.5"),
    (dict(attention_span=512, attention="materialised"), "attention='materialised'"),
])
def test_a_bad_attention_span_is_refused_by_name(bad, named):
    with pytest.raises(InputError, match="attention_span") as error:
        atorch.estimate("llama2-7b", "8xH100-80GB", global_batch=32, seq_len=4096, **bad)
    assert named in str(error.value)


def test_context_parallelism_gives_a_rank_its_share_of_the_tokens_and_the_whole_sequences_keys():
    """context=c at c times the sequence and 1/c of the sequences: every rank holds as many tokens as
    the run without it (same matmuls, the same activations but the key / value gather of one block's
    attention), each attending over c times the keys (attention c times slower, the MFU's attention term
    at the whole sequence), plus the exchange of key / value shards, which the overlap option hides
    behind the attention. FSDP shards over data x context: the states are the same."""
    from atorch.plan import configuration
    from atorch.plan.analytic import attention_seconds, context_comm_seconds, context_gather_bytes, matmul_seconds

    common = dict(sharding="fsdp", activation_checkpointing="full", micro_batch_size=1)
    base_args = dict(global_batch=8, seq_len=8192, **common)
    split_args = dict(global_batch=4, seq_len=16384, context=2, **common)
    spec, cluster, candidate, base_work = configuration("llama3-8b", "8xH100-80GB", **base_args)
    *_, split_candidate, work = configuration("llama3-8b", "8xH100-80GB", **split_args)
    assert split_candidate == candidate  # the same layout: 8 ranks of data x context
    base, split = (candidate, spec, cluster, base_work), (candidate, spec, cluster, work)
    assert (work.seq_len, work.global_batch, work.sequence, work.attended) == (8192, 8, 16384, 16384)
    assert matmul_seconds(*split) == matmul_seconds(*base)
    assert attention_seconds(*split) == pytest.approx(2 * attention_seconds(*base), rel=1e-12)
    exchange = context_comm_seconds(*split)
    assert exchange > 0 and context_comm_seconds(*base) == 0
    # 4 passes (forward, its recompute, backward, gradients) x 32 blocks x 1 other shard of 8192 tokens'
    # keys and values (2 x 1024 bf16) at NVLink speed, plus each pass's latency
    volume = 4 * 32 * 8192 * 2 * 1024 * 2
    assert exchange == pytest.approx(volume / cluster.device.nvlink_bytes_per_s + 4 * 32 * COLLECTIVE_LATENCY_S)
    whole, shared = atorch.estimate("llama3-8b", "8xH100-80GB", **base_args), atorch.estimate(
        "llama3-8b", "8xH100-80GB", **split_args)
    transient = context_gather_bytes(candidate, spec, work, 8192)
    assert transient == 8192 * 2 * 1024 * (2 + 4)
    assert whole.allocated_bytes <= shared.allocated_bytes <= whole.allocated_bytes + transient
    assert shared.tokens_per_s_per_gpu < whole.tokens_per_s_per_gpu
    assert shared.mfu / shared.tokens_per_s_per_gpu == pytest.approx(
        spec.model_flops_per_token(16384) / spec.model_flops_per_token(8192) * whole.mfu / whole.tokens_per_s_per_gpu)
    hidden = atorch.estimate("llama3-8b", "8xH100-80GB", context_comm_overlap=True, **split_args)
    assert hidden.step_time_s == pytest.approx(shared.step_time_s - exchange, rel=1e-9)  # the attention outlasts it
    assert atorch.estimate("llama3-8b", "8xH100-80GB", context=1, **base_args) == whole


def test_context_parallelism_spans_the_data_groups_sharding_and_its_reduction():
    """The data ranks the batch splits over are world / (tensor x pipeline x context); the distributed
    optimizer shards its states over data x context, as Megatron-Core does (and FSDP in torchtitan)."""
    args = dict(global_batch=16, seq_len=8192, sharding="zero1", distributed_optimizer=True)
    from atorch.plan import configuration

    spec, cluster, candidate, work = configuration("llama3-8b", "16xH100-80GB", context=2, **args)
    assert candidate.data_size(cluster.world_size) == 16 and work.global_batch == 32
    with pytest.raises(InputError, match="global_batch=12 does not split over 8 data ranks"):
        atorch.estimate("llama3-8b", "16xH100-80GB", global_batch=12, seq_len=8192, context=2)


@pytest.mark.parametrize("bad, named", [
    (dict(context=0), "context=0 is not valid: give a positive int"),
    (dict(context=2.0), "context=2.0"),
    (dict(context=3), "context=3 is not valid with seq_len=4096"),
    (dict(context=16), "tensor=1 x pipeline=1 x context=16 does not divide the 8 GPUs"),
    (dict(context=2, attention="materialised"), "context=2 is not valid with attention='materialised'"),
    (dict(context_comm_overlap=True), "context_comm_overlap=True is not valid with context=1"),
    (dict(context=2, context_comm_overlap=1), "context_comm_overlap=1 is not valid; choose one of [True, False]"),
])
def test_a_bad_context_parallel_configuration_is_refused_by_name(bad, named):
    with pytest.raises(InputError) as error:
        atorch.estimate("llama2-7b", "8xH100-80GB", global_batch=32, seq_len=4096, **bad)
    assert named in str(error.value)


def test_recompute_layers_recomputes_the_first_blocks_of_each_pipeline_chunk():
    """Megatron-Core's block method: recompute_layers=N recomputes N blocks of each model chunk and keeps
    all activations of the rest. All of a chunk's blocks is full checkpointing exactly; fewer keep more
    memory and recompute less (monotone between none and full); the share counts per chunk, so with
    the embedding and the output layer taking a block's place at the two ends, the end chunks' smaller
    block counts are recomputed whole."""
    from atorch.plan import configuration
    from atorch.plan.analytic import recomputed_share

    args = dict(global_batch=64, seq_len=4096, tensor=4, pipeline=4, sharding="zero1", micro_batch_size=1)
    full = atorch.estimate("llama2-70b", "8x8xH100-80GB", activation_checkpointing="full", **args)
    none = atorch.estimate("llama2-70b", "8x8xH100-80GB", activation_checkpointing="none", **args)
    assert atorch.estimate("llama2-70b", "8x8xH100-80GB", activation_checkpointing="full", recompute_layers=20,
                           **args) == full  # 80 blocks / 4 stages: every block of every chunk
    partial = [atorch.estimate("llama2-70b", "8x8xH100-80GB", activation_checkpointing="full", recompute_layers=n,
                               **args) for n in (1, 5, 10, 19)]
    memory = [none.memory_bytes] + [p.memory_bytes for p in partial] + [full.memory_bytes]
    speed = [none.tokens_per_s_per_gpu] + [p.tokens_per_s_per_gpu for p in partial] + [full.tokens_per_s_per_gpu]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == len(memory)
    assert speed == sorted(speed, reverse=True) and len(set(speed)) == len(speed)
    *_, candidate, work = configuration("llama2-70b", "8x8xH100-80GB", activation_checkpointing="full",
                                        recompute_layers=5, **args)
    assert recomputed_share(candidate, work) == pytest.approx(5 / 20)
    # 40 blocks and the two ends over 2 stages x 3 chunks: 7 blocks a chunk, the first and the last 6
    # beside the embedding / output layer
    ends = dict(args, pipeline=2, activation_checkpointing="full", pipeline_ends_as_layers=True, virtual_stages=3)
    *_, candidate, work = configuration("llama2-13b", "8x8xH100-80GB", recompute_layers=6, **ends)
    assert recomputed_share(candidate, work) == pytest.approx(6 * 6 / 40)
    *_, candidate, work = configuration("llama2-13b", "8x8xH100-80GB", recompute_layers=7, **ends)
    assert recomputed_share(candidate, work) == 1.0


@pytest.mark.parametrize("bad, named", [
    (dict(recompute_layers=0, activation_checkpointing="full"), "recompute_layers=0 is not valid: give a positive int"),
    (dict(recompute_layers=2.0, activation_checkpointing="full"), "recompute_layers=2.0"),
    (dict(recompute_layers=2), "recompute_layers=2 is not valid with activation_checkpointing='none'"),
    (dict(recompute_layers=2, activation_checkpointing="selective"), "activation_checkpointing='selective'"),
    (dict(recompute_layers=9, activation_checkpointing="full", pipeline=4), "the largest pipeline chunk holds 8"),
])
def test_a_bad_recompute_layers_is_refused_by_name(bad, named):
    with pytest.raises(InputError) as error:
        atorch.estimate("llama2-7b", "8xH100-80GB", global_batch=32, seq_len=4096, **bad)
    assert named in str(error.value)


def test_expert_parallelism_deals_the_routed_experts_out_and_sends_tokens_to_them():
    """expert=E (Megatron-Core's expert parallelism, the distributed optimizer): a rank holds 1 / E of each
    block's routed experts whole (bf16 weights and the fp32 gradient buffer: 6 bytes a parameter less by
    (1 - 1 / E)), their sharded states the same bytes; every block sends each token's hidden state to its
    8 experts and back, forward and backward, (E - 1) / E of it leaving the rank, over NVLink inside a node;
    expert_comm_overlap hides that behind the compute. More tokens per expert make its matmuls more
    efficient, never as efficient as the dense ones."""
    from atorch.plan import configuration
    from atorch.plan.analytic import expert_comm_seconds, expert_matmul_efficiency, matmul_efficiency

    spec = model_spec(QWEN3_30B_A3B)
    args = dict(global_batch=64, seq_len=4096, sharding="zero1", distributed_optimizer=True, micro_batch_size=1)
    alone = atorch.estimate(QWEN3_30B_A3B, "8xH100-80GB", **args)
    dealt = {e: atorch.estimate(QWEN3_30B_A3B, "8xH100-80GB", expert=e, **args) for e in (2, 8)}
    for e, pred in dealt.items():
        saved = spec.layers * spec.routed_expert_params * (2 + 4) * (1 - 1 / e)
        assert alone.allocated_bytes - pred.allocated_bytes == pytest.approx(saved, rel=1e-6)
    spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "8xH100-80GB", expert=8, **args)
    sent = 64 * 4096 / 8 * 8 * spec.hidden * 2  # a rank's tokens x 8 experts x hidden x bf16, per pass
    volume = 4 * spec.layers * sent * 7 / 8
    latency = 4 * spec.layers * 8 * COLLECTIVE_LATENCY_S  # 8 micro-steps
    assert expert_comm_seconds(candidate, spec, cluster, work) == pytest.approx(
        volume / cluster.device.nvlink_bytes_per_s + latency)
    hidden = atorch.estimate(QWEN3_30B_A3B, "8xH100-80GB", expert=8, expert_comm_overlap=True, **args)
    assert hidden.tokens_per_s_per_gpu > dealt[8].tokens_per_s_per_gpu
    *_, alone_work = configuration(QWEN3_30B_A3B, "8xH100-80GB", **args)
    efficiency = [expert_matmul_efficiency(candidate, spec, cluster, w) for w in (alone_work, work)]
    assert efficiency[0] < efficiency[1] < matmul_efficiency(candidate, spec, cluster)


def test_grouping_the_routed_tokens_by_expert_is_memory_bound_traffic_unless_the_dispatcher_fuses_it():
    """An MoE block gathers each token's k copies into expert order and adds the experts' outputs back,
    forward and backward (under expert parallelism with several experts a rank, the received copies are
    sorted by local expert and back too): that traffic runs at HBM bandwidth over the rank's share of the
    tokens, and expert_permute_fused (a dispatcher that permutes inside its communication kernels) takes
    exactly it away. Under fp8 the routed experts cast each copy of the token, not the token once. A dense
    model has nothing to group."""
    from atorch.plan import configuration
    from atorch.plan.analytic import expert_permute_bytes, fp8_cast_bytes, memory_bound_seconds

    args = dict(global_batch=64, seq_len=4096, sharding="zero1", distributed_optimizer=True, micro_batch_size=1)
    spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "8xH100-80GB", expert=8, **args)
    fused = configuration(QWEN3_30B_A3B, "8xH100-80GB", expert=8, expert_permute_fused=True, **args)[3]
    k, h = spec.experts_per_token, spec.hidden
    forward = 2 * k + (k + 1) + 4 * k  # permute, unpermute, sort and unsort by the 16 local experts
    assert expert_permute_bytes(spec, work, 2) == (2 * forward + k) * h * 2
    assert expert_permute_bytes(spec, fused, 2) == 0.0
    tokens = work.tokens / candidate.data_size(cluster.world_size)
    difference = memory_bound_seconds(candidate, spec, cluster, work, tokens) - memory_bound_seconds(
        candidate, spec, cluster, fused, tokens)
    assert difference == pytest.approx(expert_permute_bytes(spec, work, 2) * spec.layers * tokens
                                       / cluster.device.hbm_bytes_per_s)
    alone = configuration(QWEN3_30B_A3B, "8xH100-80GB", **args)[3]  # every expert on the rank: no sort
    assert expert_permute_bytes(spec, alone, 2) == (2 * (3 * k + 1) + k) * h * 2
    dense = model_spec("llama2-7b")
    assert expert_permute_bytes(dense, work, 2) == 0.0
    assert fp8_cast_bytes(spec) - fp8_cast_bytes(dataclasses.replace(spec, experts_per_token=1)) == 4 * 2 * (k - 1) * h
    slower = atorch.estimate(QWEN3_30B_A3B, "8xH100-80GB", expert=8, **args)
    faster = atorch.estimate(QWEN3_30B_A3B, "8xH100-80GB", expert=8, expert_permute_fused=True, **args)
    assert faster.tokens_per_s_per_gpu > slower.tokens_per_s_per_gpu


def test_overlapped_expert_all_to_alls_hide_a_forwards_behind_a_backward_and_the_other_way_round():
    """Megatron-Core's overlap_moe_expert_parallel_comm merges one micro-batch's forward with another's
    backward: a forward's dispatch and combine (half the passes without recompute) run beside the
    backward's compute, the backward's beside the forward's (a third of the compute). Over two nodes the
    all-to-alls outweigh the forward, so part of the backward's shows; the overlap hides exactly what
    that pairing says. The expert group sits on Megatron-Core's expert grid, its ranks expert_tensor
    apart: folded over tensor 2 (expert_tensor 1), 8 ranks of a node are in the group, not 4; with each
    expert split over 2 ranks, the copies a rank receives are gathered over that pair after the dispatch
    and scattered back before the combine, with or without expert parallelism."""
    from atorch.plan import configuration
    from atorch.plan.analytic import expert_comm_seconds, step_breakdown, tensor_comm_seconds

    args = dict(global_batch=64, seq_len=4096, sharding="zero1", distributed_optimizer=True, micro_batch_size=1)
    parts = {}
    for overlap in (False, True):
        spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "2x8xH100-80GB", expert=16,
                                                       expert_comm_overlap=overlap, **args)
        parts[overlap] = step_breakdown(candidate, spec, cluster, work)
    a2a, compute = parts[True]["expert all-to-all"], parts[True]["compute"]
    forward, backward = compute / 3, compute * 2 / 3
    assert a2a / 2 > forward  # the backward's all-to-alls outlast the forward they hide behind
    shown = max(0.0, a2a / 2 - backward) + max(0.0, a2a / 2 - forward)
    assert parts[True]["communication not hidden"] == pytest.approx(
        parts[False]["communication not hidden"] - a2a + shown)
    on_grid = {}
    for expert_tensor in (1, 2):
        spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "4x8xH100-80GB", tensor=2, expert=16,
                                                       expert_tensor=expert_tensor, **args)
        on_grid[expert_tensor] = expert_comm_seconds(candidate, spec, cluster, work)
    sent = 64 * 4096 / 16 / 2 * 8 * spec.hidden * 2  # a tensor rank's half of the tokens (sequence parallel)
    passes, latency = 4 * spec.layers, 4 * spec.layers * 4 * COLLECTIVE_LATENCY_S
    network = cluster.device.network_bytes_per_s
    assert on_grid[1] == pytest.approx(passes * sent * 8 / 16 / network + latency)  # 8 of 16 in the node
    # split over 2 ranks, a rank's received copies are also gathered over that pair (NVLink) and scattered back
    gather = passes * sent / cluster.device.nvlink_bytes_per_s + latency
    assert on_grid[2] == pytest.approx(passes * sent * 12 / 16 / network + latency + gather)  # 4 of 16 a node
    spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "4x8xH100-80GB", tensor=2, **args)
    assert expert_comm_seconds(candidate, spec, cluster, work) == pytest.approx(gather)  # no expert parallelism
    # and the routed experts run no tensor collective of their own: Qwen3's layers (no shared expert) keep
    # only the attention's half of the four a block
    activation = 64 * 4096 / 16 * spec.hidden * 2
    attention_half = 2 * spec.layers * 2 * (1 - 1 / 2) * activation / cluster.device.nvlink_bytes_per_s
    assert tensor_comm_seconds(candidate, spec, cluster, work) == pytest.approx(
        attention_half + 2 * spec.layers * 4 * COLLECTIVE_LATENCY_S)


def test_a_hierarchical_dispatch_sends_a_token_to_each_remote_node_once_and_to_each_rank_once():
    """expert_dispatch="hierarchical" (DeepEP's normal kernels, Hybrid-EP): Qwen3 30B-A3B's 8 of 128 experts
    over 16 ranks on two nodes: the all-to-all sends 8 x 8 / 16 = 4 copies of a token through the network,
    the hierarchical dispatch one copy to the other node whenever one of its 64 experts is among the 8
    (1 - C(64, 8) / C(128, 8), about 0.997), and over NVLink one to each rank hit (each holds 8 experts:
    1 - C(120, 8) / C(128, 8)) among the 14 ranks other than itself and its peer. Within one node nothing
    crosses the network and a rank holding two of a token's experts gets the token once. The network part
    is the longer here, so the all-to-all time goes down about fourfold; the dispatch needs whole experts
    on each rank."""
    from atorch.plan import configuration
    from atorch.plan.analytic import expert_comm_seconds, expert_copies

    args = dict(global_batch=64, seq_len=4096, sharding="zero1", distributed_optimizer=True, micro_batch_size=1)
    seconds = {}
    for dispatch in ("alltoall", "hierarchical"):
        spec, cluster, candidate, work = configuration(QWEN3_30B_A3B, "2x8xH100-80GB", expert=16,
                                                       expert_dispatch=dispatch, **args)
        seconds[dispatch] = expert_comm_seconds(candidate, spec, cluster, work)
        copies = expert_copies(spec, work, inside=8)
    node_hit = 1 - comb(64, 8) / comb(128, 8)
    rank_hit = 1 - comb(120, 8) / comb(128, 8)
    assert copies == pytest.approx((14 * rank_hit, node_hit))
    assert expert_copies(spec, dataclasses.replace(work, expert_dispatch="alltoall"), inside=8) == (8 * 7 / 16, 4.0)
    token = 64 * 4096 / 16 * spec.hidden * 2  # a rank's tokens, one bf16 copy each, per pass
    passes, latency = 4 * spec.layers, 4 * spec.layers * 4 * COLLECTIVE_LATENCY_S  # 4 micro-steps
    network = token * node_hit / cluster.device.network_bytes_per_s
    assert network > token * 14 * rank_hit / cluster.device.nvlink_bytes_per_s  # the longer of the two links
    assert seconds["hierarchical"] == pytest.approx(passes * network + latency)
    assert seconds["alltoall"] == pytest.approx(passes * token * 4 / cluster.device.network_bytes_per_s + latency)
    assert 3.5 < seconds["alltoall"] / seconds["hierarchical"] < 4.0  # the latency is the same in both
    one_node = configuration(QWEN3_30B_A3B, "8xH100-80GB", expert=8, expert_dispatch="hierarchical", **args)[3]
    assert expert_copies(spec, one_node, inside=8) == pytest.approx((7 * (1 - comb(112, 8) / comb(128, 8)), 0.0))
    slower = atorch.estimate(QWEN3_30B_A3B, "2x8xH100-80GB", expert=16, **args)
    faster = atorch.estimate(QWEN3_30B_A3B, "2x8xH100-80GB", expert=16, expert_dispatch="hierarchical", **args)
    assert faster.tokens_per_s_per_gpu > slower.tokens_per_s_per_gpu


def _brute_force_hit(experts: int, k: int, parts: int, groups: int, picked: int) -> float:
    """The chance a part holding the first experts / parts experts gets one of a token's k, by enumerating
    every choice of groups and of k experts among them (all equally likely)."""
    from itertools import combinations

    member, size = experts // groups, experts // parts
    hits = total = 0.0
    for chosen in combinations(range(groups), picked):
        pool = [x for g in chosen for x in range(g * member, (g + 1) * member)]
        for drawn in combinations(pool, k):
            total += 1
            hits += any(x < size for x in drawn)
    return hits / total


@pytest.mark.parametrize("parts", [1, 2, 4, 8, 16])
def test_group_limited_routing_reaches_fewer_parts_as_counted_by_enumeration(parts):
    """hit_probability against every equally likely routing of a toy (16 experts in 4 groups, a token's 3
    chosen within 2 groups, and without groups): a part inside one group, a part of whole groups, and
    the routing over all experts."""
    from atorch.plan.analytic import hit_probability

    spec = TransformerSpec("toy", 64, 2, 4, 4, 64, 100, experts=16, experts_per_token=3)
    grouped = dataclasses.replace(spec, expert_groups=4, groups_per_token=2)
    assert hit_probability(grouped, parts) == pytest.approx(_brute_force_hit(16, 3, parts, 4, 2))
    assert hit_probability(spec, parts) == pytest.approx(_brute_force_hit(16, 3, parts, 1, 1))
    for limits_nothing in (dict(expert_groups=4, groups_per_token=0), dict(expert_groups=4, groups_per_token=4),
                           dict(expert_groups=8, groups_per_token=1)):  # the last: 2 experts cannot hold 3
        assert hit_probability(dataclasses.replace(spec, **limits_nothing), parts) == hit_probability(spec, parts)


def test_group_limited_routing_is_read_from_a_config_or_a_router_and_keeps_deepseeks_tokens_on_fewer_nodes():
    """DeepSeek-V3's n_group 8 / topk_group 4 (torchtitan's router: num_expert_groups / num_limited_groups)
    keep a token's 8 experts within 4 of 8 groups of 32: over 64 ranks on 8 nodes, a group a node, the
    hierarchical dispatch sends a token to 7 x 0.454 = 3.2 other nodes, not 7 x 0.662 = 4.6. A single group
    (Kimi K2), or as many picked as there are, limits nothing; the all-to-all's copies do not change."""
    from atorch.plan import configuration
    from atorch.plan.analytic import expert_copies

    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
              "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
              "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
              "vocab_size": 129280, "n_group": 8, "topk_group": 4}
    spec = model_spec(config)
    assert (spec.expert_groups, spec.groups_per_token) == (8, 4)
    for unlimited in (dict(n_group=1, topk_group=1), dict(n_group=8, topk_group=8), dict(n_group=None)):
        assert model_spec({**config, **unlimited}).expert_groups == 0
    args = dict(global_batch=512, seq_len=4096, pipeline=8, sharding="zero1", distributed_optimizer=True,
                micro_batch_size=1, expert=64)
    *_, work = configuration(config, "64x8xH100-80GB", expert_dispatch="hierarchical", **args)
    network = expert_copies(spec, work, inside=8)[1]
    assert network == pytest.approx(7 * (1 - 0.5 - 0.5 * comb(96, 8) / comb(128, 8)))
    assert 3.1 < network < 3.3
    ungrouped = dataclasses.replace(spec, expert_groups=0, groups_per_token=0)
    assert expert_copies(ungrouped, work, inside=8)[1] == pytest.approx(7 * (1 - comb(224, 8) / comb(256, 8)))
    alltoall = dataclasses.replace(work, expert_dispatch="alltoall")
    assert expert_copies(spec, alltoall, inside=8) == expert_copies(ungrouped, alltoall, inside=8)
    with torch.device("meta"):
        model = _TitanDeepSeek()
    for layer in model.layers[1:]:
        layer.mlp.router.num_expert_groups, layer.mlp.router.num_limited_groups = 2, 1
    assert (model_spec(model).expert_groups, model_spec(model).groups_per_token) == (2, 1)


@pytest.mark.parametrize("model, bad, named", [
    (QWEN3_30B_A3B, dict(expert=4, expert_dispatch="deepep"),
     "expert_dispatch='deepep' is not valid; choose one of ['alltoall', 'hierarchical']"),
    (QWEN3_30B_A3B, dict(expert_dispatch="hierarchical"), "expert_dispatch='hierarchical' is not valid with expert=1"),
    ("llama2-7b", dict(expert_dispatch="hierarchical"), "expert_dispatch='hierarchical' is not valid with expert=1"),
    (QWEN3_30B_A3B, dict(expert=2, tensor=2, expert_dispatch="hierarchical"),
     "expert_dispatch='hierarchical' is not valid with expert_tensor=2"),
    ("llama2-7b", dict(expert_permute_fused=True), "expert_permute_fused=True is not valid: llama2-7b has no"),
    (QWEN3_30B_A3B, dict(expert_permute_fused="yes"), "expert_permute_fused='yes' is not valid"),
    ("llama2-7b", dict(expert=2), "expert=2 is not valid: llama2-7b has no Mixture-of-Experts blocks"),
    (QWEN3_30B_A3B, dict(expert=3), "it must divide the 128 experts"),
    (QWEN3_30B_A3B, dict(expert=0), "expert=0 is not valid: give a positive int"),
    (QWEN3_30B_A3B, dict(expert=16), "expert=16 x expert_tensor=1 does not divide the 8 ranks"),
    (QWEN3_30B_A3B, dict(expert=4, tensor=2, expert_tensor=4), "expert=4 x expert_tensor=4 does not divide"),
    (QWEN3_30B_A3B, dict(expert=4, sharding="fsdp"), "modelled for Megatron-Core's layouts"),
    (QWEN3_30B_A3B, dict(expert_tensor=2), "expert_tensor is not valid with expert=1"),
    (QWEN3_30B_A3B, dict(expert_comm_overlap=True), "expert_comm_overlap is not valid with expert=1"),
    (QWEN3_30B_A3B, dict(expert=4, expert_comm_overlap="yes"), "expert_comm_overlap='yes' is not valid"),
])
def test_a_bad_expert_parallel_configuration_is_refused_by_name(model, bad, named):
    args = dict(global_batch=64, seq_len=4096, sharding="zero1", distributed_optimizer=True)
    if bad.get("sharding") == "fsdp":
        args.pop("distributed_optimizer")
    with pytest.raises(InputError) as error:
        atorch.estimate(model, "8xH100-80GB", **{**args, **bad})
    assert named in str(error.value)


def test_the_rank_order_decides_which_groups_stay_inside_a_node():
    """Two nodes of 8, pipeline 2 x data 8. atorch's order (tensor, pipeline, data) puts both stages of a
    pipeline on one node (sends over NVLink) and spreads each data group over both nodes (4 ranks a node:
    4 NICs); Megatron's and DeepSpeed's (the pipeline outermost) keep each data group on one node and send
    every stage boundary over the network, one NIC a rank."""
    from atorch.plan import configuration
    from atorch.plan.analytic import data_comm_parts, pipeline_comm_seconds, ring_latency_s

    args = dict(global_batch=64, seq_len=2048, pipeline=2, sharding="ddp")
    spec, cluster, candidate, ours = configuration("llama2-7b", "2x8xA100-80GB", **args)
    *_, pipeline_outer = configuration("llama2-7b", "2x8xA100-80GB", rank_order="tensor-data-pipeline", **args)
    nvlink, nic = cluster.device.nvlink_bytes_per_s, cluster.device.network_bytes_per_s
    sends = {order: pipeline_comm_seconds(candidate, spec, cluster, work)
             for order, work in (("ours", ours), ("outer", pipeline_outer))}
    assert sends["outer"] == pytest.approx(sends["ours"] * nvlink / nic, rel=1e-12)
    reduce_ours = data_comm_parts(candidate, spec, cluster, None, ours)[1]
    reduce_outer = data_comm_parts(candidate, spec, cluster, None, pipeline_outer)[1]
    latency = {}  # one all-reduce a step either way, its fixed cost by where its 8 ranks sit
    for order, stride in (("ours", 2), ("outer", 1)):
        latency[order] = max(COLLECTIVE_LATENCY_S, ring_latency_s(cluster, 8, stride, all_reduce=True))
    assert reduce_outer - latency["outer"] == pytest.approx(
        (reduce_ours - latency["ours"]) * min(4 * nic, nvlink) / nvlink, rel=1e-9)
    assert atorch.estimate("llama2-7b", "2x8xA100-80GB", **args) == atorch.estimate(
        "llama2-7b", "2x8xA100-80GB", rank_order="tensor-pipeline-data", **args)


def test_a_bad_rank_order_is_refused_by_name():
    with pytest.raises(InputError, match="rank_order") as error:
        atorch.estimate("llama2-7b", "2x8xA100-80GB", global_batch=64, seq_len=2048, pipeline=2,
                        rank_order="pipeline-data-tensor")
    assert "tensor-data-pipeline" in str(error.value)


class _OneMultiply(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


def test_the_traffic_counter_counts_what_each_memory_bound_kernel_reads_and_writes():
    """A multiply moves its input and output once forward and once backward: 4 tensors of hidden bf16
    elements a token, 8 bytes per hidden element; matmuls (priced by FLOPs) and views move nothing."""
    from atorch.plan.elementwise import block_traffic

    hidden = 64
    assert block_traffic(_OneMultiply(), hidden) == pytest.approx(8 * hidden, rel=0.01)
    matmuls = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2)))
    assert block_traffic(matmuls, hidden) == 0


class _EagerNormBlock(torch.nn.Module):
    """A gated MLP block with an eager fp32 RMSNorm (upcast, square, mean, rsqrt, scale, downcast)."""

    def __init__(self, hidden, heads, kv_heads, ffn, fused=False):
        super().__init__()
        self.fused = fused
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.k = torch.nn.Linear(hidden, hidden // heads * kv_heads, bias=False)
        self.gate, self.up = torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        if self.fused:
            y = x * self.weight
        else:
            xf = x.float()
            y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x)
        y = y + self.k(y).sum(-1, keepdim=True)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def test_an_eager_fp32_norm_counts_several_times_a_fused_ones_traffic_and_slows_the_estimate():
    """elementwise_bytes splits a block's traffic over the hidden, MLP and key / value widths; the eager
    norm's fp32 intermediates show in the hidden part only, and estimate() prices them: slower, same memory."""
    from atorch.plan.elementwise import elementwise_bytes

    eager = elementwise_bytes(lambda h, a, kv, f: _EagerNormBlock(h, a, kv, f))
    fused = elementwise_bytes(lambda h, a, kv, f: _EagerNormBlock(h, a, kv, f, fused=True))
    assert eager[0] > 3 * fused[0]
    assert eager[1] == pytest.approx(fused[1]) and eager[2] == pytest.approx(fused[2])
    assert eager[2] > 0  # the key projection's output is read by the sum: traffic that grows with kv heads
    args = dict(global_batch=64, seq_len=4096, sharding="fsdp", micro_batch_size=1)
    lean = atorch.estimate("llama2-7b", "8xH100-80GB", **args)
    heavy = atorch.estimate("llama2-7b", "8xH100-80GB", elementwise_bytes=eager, **args)
    assert heavy.tokens_per_s_per_gpu < lean.tokens_per_s_per_gpu and heavy.memory_bytes == lean.memory_bytes


@pytest.mark.parametrize("bad", [(1.0, 2.0), (1.0, -2.0, 3.0), (1.0, float("nan"), 3.0), "60,18,0", (True, 1, 1)])
def test_bad_elementwise_bytes_are_refused_by_name(bad):
    with pytest.raises(InputError, match="elementwise_bytes=") as error:
        atorch.estimate("llama2-7b", "8xH100-80GB", global_batch=32, seq_len=4096, elementwise_bytes=bad)
    assert "three non-negative numbers" in str(error.value)


def test_plan_ranks_with_the_workload_options_estimate_takes():
    """plan() passes attention_span and elementwise_bytes to every candidate, selective checkpointing's rows
    included (they once rebuilt the workload and dropped its options): eager traffic makes every row slower,
    packed documents every row faster; bad values are refused by name there too."""
    def times(**options):
        result = atorch.plan("llama2-7b", "8xH100-80GB", 64, 4096, **options)
        return result, {(p.candidate.label, p.checkpointing): p.step_time_s for p in result.predictions}

    _, plain = times()
    heavy, slower = times(elementwise_bytes=(415.0, 28.0, 69.0))
    packed, faster = times(attention_span=256)
    assert heavy.workload.elementwise_bytes == (415.0, 28.0, 69.0) and packed.workload.attention_span == 256
    assert set(slower) == set(plain) == set(faster)
    assert all(slower[key] > plain[key] > faster[key] for key in plain)
    with pytest.raises(InputError, match="attention_span=8192"):
        atorch.plan("llama2-7b", "8xH100-80GB", 64, 4096, attention_span=8192)
    with pytest.raises(InputError, match="elementwise_bytes="):
        atorch.plan("llama2-7b", "8xH100-80GB", 64, 4096, elementwise_bytes=(1.0, 2.0))


@pytest.mark.parametrize("layout", [dict(tensor=4, pipeline=4, virtual_stages=5, sharding="zero1"),
                                    dict(sharding="fsdp", micro_batch_size=1, activation_checkpointing="full")])
def test_the_step_breakdown_adds_up_to_the_predicted_step(layout):
    """step_breakdown's compute parts, the host's floor and the bubble add up to the compute, and with the
    communication no compute hides to the step predict() reports."""
    from atorch.plan import analytic, configuration

    spec, cluster, candidate, work = configuration("llama2-70b", "4x8xH100-80GB", global_batch=64, seq_len=4096,
                                                   **layout)
    facts = analytic.spec_layout_facts(spec, cluster.world_size)
    parts = analytic.step_breakdown(candidate, spec, cluster, work, facts)
    compute_parts = ["weight matmuls", "attention", "memory-bound", "optimizer", "gradient accumulation",
                     "slowest stage's excess", "host launch floor (above the GPU's work)", "pipeline bubble"]
    assert sum(parts[k] for k in compute_parts) == pytest.approx(parts["compute"])
    predicted = analytic.predict(candidate, spec, cluster, work, facts)
    assert parts["compute"] + parts["communication not hidden"] == pytest.approx(predicted.step_time_s)
    assert parts["step"] == pytest.approx(predicted.step_time_s)


def test_a_plans_breakdown_gives_each_ranked_rows_own_step():
    """Plan.breakdown: the parts of a ranked row's step under the workload it was ranked with (selective
    checkpointing's for its rows), ending at the step the table shows; a plan where nothing fits has no
    best to break down, and says so."""
    from atorch.plan import plan

    result = plan("llama3-8b", "2x8xH100-80GB", 64, 4096)
    selective = next(p for p in result.predictions if p.checkpointing == "selective")
    for prediction in (result.best, selective, result.predictions[-1]):
        assert result.breakdown(prediction)["step"] == pytest.approx(prediction.step_time_s)
    assert result.breakdown() == result.breakdown(result.best)
    nothing_fits = plan("llama2-70b", "1xA100-40GB", 8, 4096)
    assert nothing_fits.best is None
    with pytest.raises(InputError, match="no plan fits"):
        nothing_fits.breakdown()


def test_cli_estimates_the_one_configuration_its_layout_options_name(capsys):
    """--estimate: the layout flags and --set KEY=VALUE reach atorch.estimate, whose figures are printed;
    a key estimate() does not take is refused naming the valid ones, and a layout flag without
    --estimate is refused rather than ignored by the ranked table."""
    from atorch.plan.__main__ import main

    base = ["--model", "llama3-8b", "--cluster", "8xH100-80GB", "--global-batch", "4", "--seq-len", "16384"]
    assert main(base + ["--estimate", "--context", "2", "--sharding", "fsdp", "--activation-checkpointing", "full",
                        "--set", "context_comm_overlap=true", "--set", "rank_order=tensor-data-pipeline"]) == 0
    out = capsys.readouterr().out
    expected = atorch.estimate("llama3-8b", "8xH100-80GB", global_batch=4, seq_len=16384, context=2, sharding="fsdp",
                               activation_checkpointing="full", context_comm_overlap=True,
                               rank_order="tensor-data-pipeline")
    assert "tensor 1 x pipeline 1 x context 2 x data 4" in out and "context_comm_overlap=True" in out
    assert f"{expected.tokens_per_s_per_gpu:.0f} tokens/s per GPU" in out
    assert f"{expected.memory_bytes / 2**30:.1f} GiB per GPU reserved" in out and "-> fits" in out
    assert "where the step goes" in out and "context exchange" in out
    assert out.strip().splitlines()[-1].split() == ["step", f"{expected.step_time_s:.3f}"]
    assert main(base + ["--estimate", "--set", "tensor_overlap=true"]) == 2
    err = capsys.readouterr().err
    assert "--set 'tensor_overlap=true' is not valid" in err and "'tp_comm_overlap'" in err and "'seq_len'" not in err
    assert main(base + ["--estimate", "--context", "3"]) == 2
    assert "context=3 is not valid with seq_len=16384" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--tensor", "2"])
    assert "--tensor names one configuration: add --estimate" in capsys.readouterr().err


def test_cli_estimate_says_how_many_copies_of_a_token_the_expert_dispatch_sends(capsys, tmp_path):
    """Under expert parallelism --estimate prints the copies of a token a rank sends each pass, through the
    network and over NVLink (analytic.expert_copies), so a user sees what --set expert_dispatch changes."""
    from atorch.plan.__main__ import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B_A3B))
    base = ["--model", str(config), "--cluster", "2x8xH100-80GB", "--global-batch", "64", "--seq-len", "4096",
            "--estimate", "--expert", "16", "--sharding", "zero1", "--set", "distributed_optimizer=true"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "expert dispatch alltoall: 4.00 copies of a token through the network and 3.50 over NVLink" in out
    step_line = next(line for line in out.splitlines() if line.startswith("step:"))
    assert "(MoE: published Megatron-Core MoE runs ran at" in step_line  # the throughput's caveat, by it
    assert main(base + ["--set", "expert_dispatch=hierarchical"]) == 0
    nvlink = 14 * (1 - comb(120, 8) / comb(128, 8))  # the 14 ranks other than itself and its peer, 8 experts each
    assert f"expert dispatch hierarchical: 1.00 copies of a token through the network and {nvlink:.2f} over NVLink" in (
        capsys.readouterr().out)
    assert main(base[:-6] + ["--sharding", "fsdp"]) == 0
    assert "expert dispatch" not in capsys.readouterr().out  # no expert parallelism, nothing dispatched


def test_cli_takes_the_workload_options_and_refuses_a_malformed_triple(capsys):
    from atorch.plan.__main__ import main

    assert main(["--model", "llama2-7b", "--cluster", "8xH100-80GB", "--global-batch", "64", "--seq-len", "4096",
                 "--attention-span", "256", "--elementwise-bytes", "415,28,69", "--top", "3"]) == 0
    assert "llama2-7b" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "llama2-7b", "--cluster", "8xH100-80GB", "--global-batch", "64", "--seq-len", "4096",
              "--elementwise-bytes", "415,28"])
    assert "HIDDEN,FFN,KV" in capsys.readouterr().err


def test_a_module_s_own_block_traffic_is_counted_on_meta():
    """From an nn.Module the planner counts its block's memory-bound traffic on the meta device (no
    memory, milliseconds): the repo GPT, written with fused LayerNorm, GELU and SDPA, counts what the
    fused constants assume (within 25 %); transformers' eager Llama (fp32 RMSNorm, rotate_half rotary)
    several times that, and estimate() prices it: slower than the same shape from its config, same memory."""
    transformers = pytest.importorskip("transformers")
    from atorch.plan.analytic import ELEMENTWISE_FFN_WIDTHS, ELEMENTWISE_HIDDEN_WIDTHS
    from atorch.plan.model_specs import model_spec

    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=128))
    spec = model_spec(gpt)
    fused = 2 * (ELEMENTWISE_HIDDEN_WIDTHS * spec.hidden + ELEMENTWISE_FFN_WIDTHS[False] * spec.ffn) / spec.hidden
    assert 0.8 < spec.elementwise_bytes[0] / fused < 1.25, (spec.elementwise_bytes, fused)
    config = dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    counted = model_spec(llama).elementwise_bytes
    assert counted is not None and counted[0] > 3 * 2 * ELEMENTWISE_HIDDEN_WIDTHS
    args = dict(global_batch=16, seq_len=2048, sharding="fsdp", micro_batch_size=1)
    from_module = atorch.estimate(llama, "8xH100-80GB", **args)
    from_config = atorch.estimate({**config, "model_type": "llama"}, "8xH100-80GB", **args)
    assert from_module.tokens_per_s_per_gpu < from_config.tokens_per_s_per_gpu
    assert from_module.memory_bytes == from_config.memory_bytes


class _TinyBlock(torch.nn.Module):
    """One-head attention (its projections are what the planner reads it by) and a plain MLP."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(torch.relu(self.up(x)))


class _NeedsValues(torch.nn.Module):
    """A token model whose forward reads a value (no meta tensor has one): its traffic cannot be counted."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(_TinyBlock() for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        x = self.embed(ids)
        if x.abs().max().item() > 0:  # data-dependent
            x = x * 1.0
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_module_that_cannot_run_on_meta_keeps_the_fused_count():
    from atorch.plan.model_specs import model_spec

    with torch.device("meta"):
        model = _NeedsValues()
    assert model_spec(model).elementwise_bytes is None
    assert atorch.estimate(model, "1xA100-80GB", global_batch=8, seq_len=64).fits


def _experts_a_token_skips(model: torch.nn.Module, experts: int, top_k: int) -> int:
    """Parameters of the experts one token is not sent to, counted from the module's own parameters:
    (experts - top_k) experts in every block, an expert's size from a stacked bank's leading dimension
    or from one member of an expert list."""
    skipped = 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if getattr(module, "num_experts", None) == experts and params and all(p.shape[0] == experts for p in params):
            skipped += (experts - top_k) * sum(p[0].numel() for p in params)
        if isinstance(module, torch.nn.ModuleList) and len(module) == experts and module is not getattr(
                model, "blocks", None):
            skipped += (experts - top_k) * sum(p.numel() for p in module[0].parameters())
    return skipped


def test_a_mixture_of_experts_module_counts_the_experts_a_token_meets():
    """torchtitan's grouped bank (4 experts, top-2, a shared expert) and the repo MoE's list of Linear
    experts: the shape is read off the modules (experts, top-k, each expert's width, the shared MLP; heads
    and key / value heads from the attention's own counts), and the parameters a token meets, the FLOPs'
    basis, leave out exactly the experts it is not routed to; an MoE with no top-k to read is refused."""
    from atorch.testing.hf_models import ZOO

    for name, shared in (("titan_moe", 64), ("moe", 0)):
        model = ZOO[name].build()
        spec = model_spec(model)
        assert (spec.experts, spec.experts_per_token, spec.expert_ffn, spec.shared_ffn) == (4, 2, 64, shared), spec
        total = sum(p.numel() for p in model.parameters())
        assert spec.param_count == total
        assert spec.active_param_count == total - _experts_a_token_skips(model, 4, 2), name
    assert (model_spec(ZOO["titan_moe"].build()).heads, model_spec(ZOO["titan_moe"].build()).kv_heads) == (4, 2)
    model = ZOO["titan_moe"].build()
    for layer in model.layers.values():
        del layer.moe.router.top_k
    with pytest.raises(InputError, match=r"4 experts, but no top-k .*num_experts_per_tok"):
        model_spec(model)


def test_deepseek_and_llama4_are_read_as_mixtures_of_experts_with_their_shared_experts():
    """DeepSeek-V3's config names its experts n_routed_experts and its shared ones n_shared_experts (of
    the expert width), and its first layer is dense; Llama 4's MoE layers each have one shared expert of
    intermediate_size. Both gated. Read from the module and from the config alone."""
    from atorch.testing.hf_models import zoo_model

    for name, want in (("deepseek_v3", (4, 2, 32, 32)), ("llama4", (4, 1, 64, 64))):
        model = zoo_model(name).build()
        for spec in (model_spec(model), model_spec(model.config.to_dict())):
            assert (spec.experts, spec.experts_per_token, spec.expert_ffn, spec.shared_ffn) == want, (name, spec)
            assert spec.gated, name
    llama4 = zoo_model("llama4").build()
    total = sum(p.numel() for p in llama4.parameters())
    banks = [layer.feed_forward.experts for layer in llama4.model.layers]
    skipped = sum(3 * sum(p[0].numel() for p in bank.parameters()) for bank in banks)  # 3 of 4 experts a layer
    assert model_spec(llama4).active_param_count == total - skipped


def test_configs_naming_their_shape_otherwise_are_read_through_their_attribute_map():
    """MPT (d_model, n_layers, n_heads) and GPT-Neo (num_layers, num_heads) name their shape their own way;
    transformers maps those names to the standard ones, so a module of either is read as its config says
    (it was refused as missing hidden_size)."""
    import transformers

    models = (transformers.MptForCausalLM._from_config(transformers.MptConfig(
                  d_model=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)),
              transformers.GPTNeoForCausalLM._from_config(transformers.GPTNeoConfig(
                  hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                  vocab_size=64, max_position_embeddings=16)))
    for model in models:
        spec = model_spec(model)
        assert (spec.hidden, spec.layers, spec.heads, spec.vocab) == (32, 2, 4, 64), (type(model).__name__, spec)
        assert spec.param_count == sum(p.numel() for p in model.parameters())


def test_an_optimizer_step_is_counted_per_parameter_and_priced_by_estimate():
    """optimizer_step_bytes traces one step: SGD reads the parameter and its gradient and writes the
    parameter (12 bytes in fp32, exactly); torch's AdamW moves more than a fused Adam's 30 and its
    per-tensor loop more than its foreach path. estimate() charges the difference over the HBM bandwidth,
    per parameter the GPU updates; a bad value is refused by name."""
    from atorch.plan.elementwise import optimizer_step_bytes

    assert optimizer_step_bytes(lambda ps: torch.optim.SGD(ps, lr=0.1)) == pytest.approx(12.0, abs=1e-3)
    foreach = optimizer_step_bytes(lambda ps: torch.optim.AdamW(ps, foreach=True))
    loop = optimizer_step_bytes(lambda ps: torch.optim.AdamW(ps, foreach=False))
    assert 30 < foreach < loop
    args = dict(global_batch=2, seq_len=2048, sharding="ddp")
    fused = atorch.estimate("llama2-7b", "1xH200", **args)
    counted = atorch.estimate("llama2-7b", "1xH200", optimizer_bytes_per_param=foreach, **args)
    params = model_spec("llama2-7b").param_count
    extra = (foreach - 30) * params / DEVICES["H200"].hbm_bytes_per_s
    assert counted.step_time_s - fused.step_time_s == pytest.approx(extra, rel=1e-9)
    assert counted.memory_bytes == fused.memory_bytes
    with pytest.raises(InputError, match="optimizer_bytes_per_param=0"):
        atorch.estimate("llama2-7b", "1xH200", optimizer_bytes_per_param=0, **args)


def test_gradient_accumulation_traffic_is_charged_per_micro_step_on_the_parameters_a_gpu_holds():
    """DeepSpeed's BF16 optimizer adds every micro-batch's bf16 gradients into an fp32 buffer through a new
    fp32 copy: 18 bytes a parameter and micro-batch, over the tensor and pipeline share of the parameters a
    GPU holds, once per micro-step, inside the pipeline's busy time (the bubble scales it too); memory is
    unchanged; a negative or non-numeric value is refused by name."""
    from atorch.plan import configuration
    from atorch.plan.analytic import micro_steps, pipeline_bubble

    args = dict(global_batch=64, seq_len=2048, tensor=2, pipeline=4, sharding="zero1", micro_batch_size=1)
    plain = atorch.estimate("llama2-7b", "2x8xA100-80GB", **args)
    charged = atorch.estimate("llama2-7b", "2x8xA100-80GB", grad_accumulation_bytes_per_param=18, **args)
    spec, cluster, candidate, work = configuration("llama2-7b", "2x8xA100-80GB", **args)
    data = candidate.data_size(cluster.world_size)
    steps = micro_steps(candidate, work, data)
    assert steps == 32  # 64 sequences over 2 data ranks, one a micro-batch
    extra = 18 * spec.param_count / 8 * steps / DEVICES["A100-80GB"].hbm_bytes_per_s
    extra *= 1 + pipeline_bubble(candidate, work, data)
    assert charged.compute_s - plain.compute_s == pytest.approx(extra, rel=1e-9)
    assert charged.memory_bytes == plain.memory_bytes
    for bad in (-1, "18", True, float("nan")):
        with pytest.raises(InputError, match="grad_accumulation_bytes_per_param"):
            atorch.estimate("llama2-7b", "2x8xA100-80GB", grad_accumulation_bytes_per_param=bad, **args)


def test_zero2_under_a_pipeline_keeps_its_stage_gathered():
    """zero2 is FSDP2 without resharding after forward (torchtitan's default when a pipeline runs): a
    pipeline stage keeps its share of the parameters gathered in bf16 through forward and backward, and
    its gradients whole until they are reduce-scattered, on top of its shard of the fp32 state (fsdp holds
    two gathered blocks instead). Both run FSDP's bf16 policy, so their activations are counted alike and
    the difference is the state alone, to the byte. Over the pipeline's micro-batches the whole gradients
    accumulate in the fp32 reduce dtype (FSDP2's to_accumulated_grad_if_needed; Llama 3's "FP32 gradient
    accumulation"); reduce-scattered at every micro-step, FSDP reduces each block's gradients in its
    post-backward hook, so one block's are whole at a time (bf16, and the fp32 copy it reduce-scatters),
    and the data dimension moves the stage's gradients once per micro-batch, not once per step."""
    from atorch.plan import configuration
    from atorch.plan.analytic import data_comm_parts, spec_layout_facts, state_bytes

    args = dict(global_batch=32, seq_len=4096, pipeline=2, micro_batch_size=1)
    ddp = atorch.estimate("llama2-7b", "2x8xA100-80GB", sharding="ddp", **args)
    zero2 = atorch.estimate("llama2-7b", "2x8xA100-80GB", sharding="zero2", **args)
    zero2_each = atorch.estimate("llama2-7b", "2x8xA100-80GB", sharding="zero2", grad_sync="each_micro_step", **args)
    fsdp = atorch.estimate("llama2-7b", "2x8xA100-80GB", sharding="fsdp", **args)
    spec, cluster, candidate, work = configuration("llama2-7b", "2x8xA100-80GB", sharding="zero2", **args)
    params, grads, moments = state_bytes(candidate, spec)
    share = spec_layout_facts(spec, cluster.world_size).state_share[(1, 2)]
    data = 8
    sharded = (params + grads + moments) * share / data
    zero2_state = sharded + (0.5 * params + grads) * share
    fsdp_state = sharded + 2 * 2 * spec.block_params
    assert zero2.allocated_bytes - fsdp.allocated_bytes == pytest.approx(zero2_state - fsdp_state, rel=1e-6)
    one_block = spec.block_params * (2 + 4)
    assert zero2.allocated_bytes - zero2_each.allocated_bytes == pytest.approx(grads * share - one_block, rel=1e-6)
    assert fsdp.allocated_bytes < zero2_each.allocated_bytes < zero2.allocated_bytes < ddp.allocated_bytes
    each_candidate, each_work = configuration("llama2-7b", "2x8xA100-80GB", sharding="zero2",
                                              grad_sync="each_micro_step", **args)[2:]
    facts = spec_layout_facts(spec, cluster.world_size)
    once = data_comm_parts(candidate, spec, cluster, facts, work)
    every = data_comm_parts(each_candidate, spec, cluster, facts, each_work)
    micro_batches = 32 // data
    assert every[0] == once[0]  # the stage stays gathered over its micro-batches either way
    assert every[1] == pytest.approx(micro_batches * once[1], rel=0.05)  # latency aside


class _EncoderLM(torch.nn.Module):
    """A token model on PyTorch's nn.TransformerEncoder: blocks named layers.0.self_attn / linear1 / norm1."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 512)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)))


def test_block_traffic_is_counted_on_models_named_unlike_the_zoo():
    """The counted block comes from the module tree, not from names: nn.TransformerEncoder's layers and an
    unnamed nn.Sequential of blocks are counted on meta like the zoo's; a flat Sequential mixing the blocks
    with the embedding has no stack to cut, and keeps the fused count (None, no error)."""
    from atorch.plan.elementwise import model_block_traffic

    with torch.device("meta"):
        encoder = _EncoderLM()
        nested = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Sequential(*(_TinyBlock() for _ in range(3))),
                                     torch.nn.Linear(32, 64))
        flat = torch.nn.Sequential(torch.nn.Embedding(64, 32), *(_TinyBlock() for _ in range(3)),
                                   torch.nn.Linear(32, 64))
    assert model_block_traffic(encoder) > 0
    assert model_block_traffic(nested) > 0
    assert model_block_traffic(flat) is None
