"""The planner reads a transformers config.json as the model it builds: what its keys do not say (whether
the MLP is gated for a model type the planner does not list, experts under other keys, parameters the shape
does not describe) is read off the model built on the meta device. Checked against transformers' own
configs at their defaults: the planner's parameter count against the built model's."""
from __future__ import annotations

import warnings

import pytest
import torch

from atorch.errors import InputError
from atorch.plan import estimate
from atorch.plan.hardware_specs import cluster_spec, device_spec
from atorch.plan.model_specs import GATED_MODEL_TYPES, PLAIN_MLP_MODEL_TYPES, _module_gated, from_hf_config, model_spec

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402


def _default(model_type: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type]().to_dict()


def _built(config: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**{
            k: v for k, v in config.items() if k != "model_type"}))


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# model types in neither list (their MLP read off the built model): gated ones and a plain one (CTRL's ReLU MLP)
UNLISTED = {"internlm3": True, "cwm": True, "diffllama": True, "emu3": True, "ctrl": False}


@pytest.mark.parametrize("model_type, gated", sorted(UNLISTED.items()))
def test_a_model_type_the_planner_does_not_list_has_its_mlp_read_off_the_built_model(model_type, gated):
    assert model_type not in GATED_MODEL_TYPES | PLAIN_MLP_MODEL_TYPES
    config = _default(model_type)
    config.pop("transformers_version")  # the shape's own count, not the built model's
    spec = model_spec(config)
    assert spec.gated is gated
    if gated:  # CTRL's untied, biased output layer aside
        assert spec.param_count == pytest.approx(_count(_built(config)), rel=0.01)


LISTED = sorted(t for t in GATED_MODEL_TYPES | PLAIN_MLP_MODEL_TYPES if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                and t not in ("jamba", "zamba", "zamba2", "minimax", "qwen3_next", "bitnet"))


def test_the_listed_model_types_are_gated_as_their_built_models_are():
    """The two name lists are a fast path, not the rule: each listed type's default model, built on meta,
    has the MLP its list says (hybrids whose first block is not an attention block are left out)."""
    wrong, checked = {}, 0
    for model_type in LISTED:
        config = _default(model_type)
        try:
            spec = from_hf_config(config, structure=False)
            model = _built(config)
        except Exception:  # a default config without its top-k (InputError), or one transformers cannot build
            continue
        seen = _module_gated(model, spec)
        checked += seen is not None
        if seen is not None and seen != (model_type in GATED_MODEL_TYPES):
            wrong[model_type] = seen
    assert not wrong, wrong
    assert checked >= 0.8 * len(LISTED), (checked, len(LISTED))  # transformers 5.23: 47 of 50


def test_a_complete_config_counts_what_its_shape_does_not_describe():
    """Gemma 3n gives one MLP width a layer and per-layer embeddings: the shape's count misses 35 % of the
    model, which a complete config.json (transformers_version) replaces with the built model's count."""
    config = _default("gemma3n_text")
    exact = _count(_built(config))
    assert model_spec(config).param_count == exact
    shape_only = dict(config)
    shape_only.pop("transformers_version")
    assert model_spec(shape_only).param_count < 0.8 * exact  # read, not refused: the widths' mean


def test_a_multimodal_config_written_whole_counts_its_language_model_exactly():
    config = _default("gemma4")
    text = transformers.AutoConfig.for_model(**config["text_config"])
    with torch.device("meta"):
        exact = _count(AutoModelForCausalLM.from_config(text))
    assert model_spec(config).param_count == exact


@pytest.mark.parametrize("model_type, experts, per_token, shared", [
    ("aria_text", 8, 2, 2 * 4096),       # moe_num_experts, moe_topk, moe_num_shared_experts
    ("ernie4_5_moe", 64, 6, 2 * 1536),   # moe_num_experts, moe_k, moe_num_shared_experts
])
def test_experts_under_other_families_keys_are_read(model_type, experts, per_token, shared):
    config = _default(model_type)
    config.pop("transformers_version")
    spec = model_spec(config)
    assert (spec.experts, spec.experts_per_token, spec.shared_ffn) == (experts, per_token, shared)
    assert spec.param_count == pytest.approx(_count(_built(config)), rel=0.01)


def test_a_config_that_turns_its_experts_off_is_dense():
    config = _default("doge")
    assert config["is_moe"] is False and config["num_experts"] > 1
    assert model_spec(config).experts == 0


def test_jambas_experts_every_other_layer_give_its_published_active_parameters():
    """Jamba: 52B parameters, 12B active (AI21's model card); experts on every other layer
    (expert_layer_period 2, offset 1), the others a dense MLP."""
    spec = model_spec(_default("jamba"))
    assert spec.dense_layers == 16
    assert spec.param_count / 1e9 == pytest.approx(51.6, abs=0.1)
    assert spec.active_param_count / 1e9 == pytest.approx(12.1, abs=0.5)


def test_a_model_type_transformers_does_not_know_is_gated_by_its_activation():
    base = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "vocab_size": 1000,
            "intermediate_size": 2816}
    assert model_spec({**base, "model_type": "my_swiglu_lm", "hidden_act": "silu"}).gated is True
    assert model_spec({**base, "model_type": "my_gelu_lm", "hidden_act": "gelu"}).gated is False


def test_common_device_names_resolve_and_an_ambiguous_one_is_refused_with_both():
    assert cluster_spec("8xH100").device.name == "H100-80GB"
    assert cluster_spec("4x8x h100 sxm").label == "4x8xH100-80GB"
    assert device_spec("NVIDIA H200").name == "H200"
    with pytest.raises(InputError, match=r"'A100' is ambiguous.*'A100-40GB', 'A100-80GB'"):
        device_spec("A100")
    prediction = estimate("llama3-8b", "8xH100", global_batch=8, seq_len=4096)
    assert prediction.tokens_per_s_per_gpu == estimate("llama3-8b", "8xH100-80GB", global_batch=8,
                                                       seq_len=4096).tokens_per_s_per_gpu


def test_the_export_parts_are_their_chips_with_the_nvlink_they_have():
    """H800 and A800: the H100 SXM's and the A100 80GB's chips (their fitted efficiencies), NVLink
    cut to 400 GB/s (the H100's 900, the A100's 600), so a tensor-parallel plan's collectives take 9 / 4 as
    long inside an H800 node."""
    h800, h100 = device_spec("H800-SXM5"), device_spec("H100")
    assert (h800.bf16_flops, h800.memory_bytes, h800.family) == (h100.bf16_flops, h100.memory_bytes, h100.family)
    assert h800.nvlink_bytes_per_s == h100.nvlink_bytes_per_s * 4 / 9
    assert device_spec("A800-SXM4-80GB").nvlink_bytes_per_s == device_spec("A100-80GB").nvlink_bytes_per_s * 2 / 3
    options = dict(global_batch=8, seq_len=4096, tensor=8, sharding="zero1")
    ours, theirs = estimate("llama3-70b", "8xH800", **options), estimate("llama3-70b", "8xH100", **options)
    assert ours.comm_s == pytest.approx(9 / 4 * theirs.comm_s, rel=0.05)  # all tensor collectives (data 1)


def test_a_user_device_is_checked_when_it_is_given():
    """A device of a family no published run fits (an MI300X here) used to fail inside the prediction
    with a bare KeyError('cdna3 efficiency'); it is refused at once naming the fitted families and the
    ``efficiency`` key, and runs once it has one. Numbers that are not numbers are refused there too."""
    mi300x = {"name": "MI300X", "memory_bytes": 192e9, "bf16_flops": 1.307e15, "hbm_bytes_per_s": 5.3e12,
              "nvlink_bytes_per_s": 64e9, "network_bytes_per_s": 50e9, "family": "cdna3"}
    with pytest.raises(InputError, match=r"family 'cdna3' has no fitted efficiency.*'ampere'.*'hopper'.*'efficiency'"):
        device_spec(mi300x)
    cluster = {"nodes": 1, "gpus_per_node": 8, "device": {**mi300x, "efficiency": 0.4}}
    assert estimate("llama3-8b", cluster, global_batch=8, seq_len=4096).tokens_per_s_per_gpu > 0
    with pytest.raises(InputError, match=r"bf16_flops='1e15' is not valid"):
        device_spec({"base": "H100", "bf16_flops": "1e15"})
    with pytest.raises(InputError, match=r"efficiency=1.5 is not valid.*\(0, 1\]"):
        device_spec({"base": "H100", "efficiency": 1.5})


@pytest.mark.parametrize("name, width, gated", [
    ("TitanLlama", 64, True),       # torchtitan's w1 / w3 into the width, w2 back: SwiGLU
    ("TorchEncoderLM", 64, False),  # nn.TransformerEncoderLayer's linear1 / linear2
    ("NanoGPT", 128, False),        # nanoGPT's c_fc / c_proj (its attention's c_attn / c_proj are hidden-wide)
    ("ParallelLM", 128, False),     # GPT-J-style parallel block: expand / contract
    ("PerceiverLM", 64, False),     # the MLP inside an nn.Sequential beside a norm
])
def test_a_module_without_a_config_has_its_mlp_read_off_its_linear_layers(name, width, gated):
    """Not solved from the block's parameter count (which took every MLP as plain): the projections into
    the MLP's width and the one back, whatever the layers are named."""
    from atorch.testing import community_models

    with torch.device("meta"):
        model = getattr(community_models, name)()
    spec = model_spec(model)
    assert (spec.ffn, spec.gated) == (width, gated)
    assert spec.param_count == _count(model)


class _Attention(torch.nn.Module):
    """Grouped-query attention whose head counts sit under names the planner does not know (``n_q``,
    ``groups``), its projections laid out as ``layout`` says; queries 96 wide on a hidden size of 64."""

    def __init__(self, layout: str, hidden: int = 64, q: int = 96, kv: int = 32):
        super().__init__()
        self.n_q, self.groups, self.layout = q // 16, kv // 16, layout
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        if layout == "separate":
            self.q, self.k, self.v = linear(hidden, q), linear(hidden, kv), linear(hidden, kv)
        elif layout == "kv_fused":
            self.q, self.kv = linear(hidden, q), linear(hidden, 2 * kv)
        else:
            self.qkv = linear(hidden, q + 2 * kv)
        self.proj = torch.nn.Sequential(linear(q, hidden), torch.nn.Dropout(0.0))


class _Block(torch.nn.Module):
    def __init__(self, layout: str, hidden: int = 64):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.mix = _Attention(layout, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 160, bias=False), torch.nn.Linear(160, hidden, bias=False)


class _GroupedLM(torch.nn.Module):
    def __init__(self, layout: str, hidden: int = 64, layers: int = 3, vocab: int = 100):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(_Block(layout, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)


@pytest.mark.parametrize("layout", ["separate", "kv_fused", "qkv_fused"])
def test_a_module_s_grouped_query_attention_is_read_off_its_projections(layout):
    """Head counts under attribute names the planner does not know used to be guessed (one head per 64
    features, as many key / value heads as heads): keys and values counted as wide as the queries here,
    the attention's parameters and FLOPs a third too many. The widths come from the projections' shapes."""
    with torch.device("meta"):
        model = _GroupedLM(layout)
    spec = model_spec(model)
    assert (spec.q_dim, spec.key_dim, spec.value_dim, spec.ffn, spec.gated) == (96, 32, 32, 160, False)
    assert spec.attention_params == 64 * 96 + 2 * 64 * 32 + 96 * 64
    assert spec.block_params == _count(model.blocks[0])  # its two norms counted too
    assert spec.param_count == _count(model)


def test_named_head_counts_split_the_widths_the_projections_give():
    """Where the attention's attributes name its head counts and they divide its widths (torchtitan's
    n_heads / n_kv_heads), the heads are theirs."""
    from atorch.testing import community_models

    with torch.device("meta"):
        model = community_models.TitanLlama()
    spec = model_spec(model)
    attention = model.layers["0"].attention
    assert (spec.heads, spec.kv_heads) == (attention.n_heads, attention.n_kv_heads) != (attention.n_heads,) * 2


def test_a_state_space_model_is_refused_naming_why_not_read_as_a_transformer():
    """Mamba built as a module used to be read as a transformer of one head (its block's projections taken
    for an attention and an MLP); its config was refused for a missing key alone."""
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    with pytest.raises(InputError, match=r"num_attention_heads.*mamba has no attention heads: a state-space"):
        model_spec(config.to_dict())
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(config)
    with pytest.raises(InputError, match=r"MambaBlock has no attention the planner can find.*state-space"):
        model_spec(model)
