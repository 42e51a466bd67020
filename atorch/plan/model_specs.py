"""Decoder-only transformers described by their shape, for planning without building them.

The search profiles the model it is given (``analyser.py``); the planner predicts for models far
too large for this machine, so it reads their shape instead: from a transformers ``config.json``
(a path, or the dict), from a built-in name (a few well-known configs written below, so nothing is
downloaded), or from an ``nn.Module`` built on the meta device (its own parameters are counted).
From the shape follow exactly the numbers the cost model needs: parameter counts (per block, the
embeddings, the head), FLOPs per token, and activation elements per token and block.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from atorch.errors import InputError, nearest_name
from atorch.plan.elementwise import model_block_traffic
from atorch.utils.modules import repeated_blocks

logger = logging.getLogger("atorch")

# transformers config.json contents of well-known models (the shape keys only)
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False}
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama2-7b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "llama2-13b": {**_LLAMA, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                   "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000},
    "llama2-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000},
    "llama3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "llama3-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
    # the Llama 3 paper's Table 3 (126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads)
    "llama3-405b": {**_LLAMA, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                    "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256},
}
BUILTIN_CONFIGS["llama3.1-8b"] = BUILTIN_CONFIGS["llama3-8b"]    # same shape, longer RoPE context
BUILTIN_CONFIGS["llama3.1-70b"] = BUILTIN_CONFIGS["llama3-70b"]
BUILTIN_CONFIGS["llama3.1-405b"] = BUILTIN_CONFIGS["llama3-405b"]

# model types whose MLP is gated (gate, up, down: three matrices)
GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
                     "olmo2", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granite", "granitemoe", "llama4",
                     "llama4_text", "deepseek_v2", "deepseek_v3", "cohere", "helium", "smollm3", "glm", "stablelm",
                     "exaone4", "seed_oss", "ernie4_5", "ernie4_5_moe", "gpt_oss", "olmo3", "qwen3_next", "glm4",
                     "glm4_moe", "minimax", "jamba", "bitnet", "cohere2", "granitemoeshared", "zamba", "zamba2"}
# ... and those whose MLP is plain (up, activation, down: two), so that neither list needs a model built
PLAIN_MLP_MODEL_TYPES = {"gpt2", "mpt", "bloom", "opt", "gpt_neox", "gpt_neo", "gptj", "falcon", "gpt_bigcode",
                         "codegen", "phi", "starcoder2", "xglm", "biogpt"}
# the keys a complete config.json has (transformers writes them): its model can be built as the file says
_WRITTEN_BY_TRANSFORMERS = "transformers_version"
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# ... the experts a token is routed to (Mixtral / Qwen / DeepSeek, Bailing / Kimi, Aria, ERNIE 4.5, Gemma 4),
# and the shared experts beside them (DeepSeek, Bailing / Kimi, Aria / ERNIE 4.5)
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
_SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# any key a config counts attention heads under (a config with none of them has no attention)
_HEAD_COUNT_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                    "encoder_attention_heads")
_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_inner": "intermediate_size"}


@dataclass(frozen=True)
class TransformerSpec:
    """The shape of a decoder-only transformer."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True
    block: str = "Block"            # class name of the repeated block (checkpoint / FSDP unit)
    param_count_override: int = 0   # a real module's exact count, when known
    # a module's own block traffic (``elementwise.model_block_traffic``, bytes per token and hidden element,
    # forward and backward), in ``Workload.elementwise_bytes``' form; None: fused kernels are assumed
    elementwise_bytes: Optional[tuple[float, float, float]] = None
    head_size: int = 0              # each head's size where the config gives it (Qwen3, Gemma); 0: hidden / heads
    # a Mixture-of-Experts MLP (0 experts: dense): ``ffn`` is then the MLP width each token runs through
    # (its experts_per_token experts and the shared experts), the parameters count every expert
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0             # one routed expert's width
    shared_ffn: int = 0             # the shared (always-on) experts' total width
    # an MoE model whose other layers run a dense MLP (DeepSeek-V3's first 3 of 61, Llama 4 Maverick's
    # every other one, Qwen-MoE's mlp_only_layers): how many, and their MLP's width. The planner's block is
    # then the layers' mean: ``ffn`` the mean width a token runs through, the parameters the mean block's
    dense_layers: int = 0
    dense_ffn: int = 0
    # group-limited routing (DeepSeek-V3's n_group / topk_group, torchtitan's num_expert_groups /
    # num_limited_groups): the experts split into ``expert_groups`` equal groups and a token's experts all
    # chosen within ``groups_per_token`` of them, so that laid out a group a node it reaches few nodes
    # (``analytic.hit_probability``); 0: routed over every expert
    expert_groups: int = 0
    groups_per_token: int = 0
    # sliding-window attention: ``windowed_layers`` of the layers attend to the last ``window`` tokens
    # only (gpt-oss, Gemma 2 / 3, Mistral 7B v0.1); 0: every layer attends to the whole sequence
    window: int = 0
    windowed_layers: int = 0
    # multi-head latent attention (DeepSeek-V2 / V3, Kimi K2): queries and keys / values are projected
    # down to ranks of their own (0: straight from the hidden state) and up to every head again, whose
    # query / key size (``head_size``) holds a rotary part of ``rope_head_size`` shared by the heads'
    # keys, and whose values are ``value_head_size`` wide (0: the head size, as in every other model)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_size: int = 0
    value_head_size: int = 0

    @property
    def head_dim(self) -> int:
        """A head's query / key size."""
        return self.head_size or self.hidden // self.heads

    @property
    def value_head_dim(self) -> int:
        return self.value_head_size or self.head_dim

    @property
    def q_dim(self) -> int:
        """The width of the queries: heads x head size."""
        return self.heads * self.head_dim

    @property
    def out_dim(self) -> int:
        """The width of the attention output (what the output projection reads): heads x value size."""
        return self.heads * self.value_head_dim

    @property
    def key_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.kv_heads * self.value_head_dim

    @property
    def kv_dim(self) -> int:
        """A key's or a value's width (their mean where they differ: latent attention)."""
        return (self.key_dim + self.value_dim) // 2

    @property
    def attention_width(self) -> float:
        """The mean of the query and the value widths: attention's score and value matmuls run over
        ``q_dim`` and ``out_dim`` per key, 2 x this together."""
        return (self.q_dim + self.out_dim) / 2

    @property
    def attention_params(self) -> int:
        """The attention's projections: queries, keys and values, and the output. Under latent attention
        the down projections (and their norms) and the up projections to every head's query, key (less
        its shared rotary part, which comes down with the latent) and value."""
        h = self.hidden
        if not self.kv_lora_rank:
            return h * self.q_dim + h * (self.key_dim + self.value_dim) + self.out_dim * h
        q = h * self.q_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_dim
        up = self.heads * (self.head_dim - self.rope_head_size + self.value_head_dim)
        kv = h * (self.kv_lora_rank + self.rope_head_size) + self.kv_lora_rank + self.kv_lora_rank * up
        return q + kv + self.out_dim * h

    def attention_matmul_shapes(self, tensor: int) -> list[tuple[float, float]]:
        """(input, output) widths of the attention's weight matmuls on a tensor rank: the fused query /
        key / value projection and the output one; under latent attention the down projections (whole on
        every tensor rank, as Megatron-Core duplicates them), the up projections and the output one."""
        t, h = tensor, self.hidden
        if not self.kv_lora_rank:
            return [(h, (self.q_dim + self.key_dim + self.value_dim) / t), (self.out_dim / t, h)]
        up = self.heads * (self.head_dim - self.rope_head_size + self.value_head_dim)
        shapes = [(h, self.kv_lora_rank + self.rope_head_size), (self.kv_lora_rank, up / t), (self.out_dim / t, h)]
        if self.q_lora_rank:
            return [(h, self.q_lora_rank), (self.q_lora_rank, self.q_dim / t)] + shapes
        return [(h, self.q_dim / t)] + shapes

    @property
    def _matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def moe_share(self) -> float:
        """The share of the layers that route to experts: all of an MoE model's but its dense layers."""
        return (self.layers - self.dense_layers) / self.layers if self.experts else 0.0

    @property
    def dense_mlp_params(self) -> int:
        """An MoE model's dense layers' MLP (0 where every layer routes)."""
        return self._matrices * self.hidden * self.dense_ffn if self.dense_layers else 0

    @property
    def mlp_params(self) -> float:
        """Every expert's weights (and the router's) in an MoE block (the mean over the layers where some
        are dense); the MLP's in a dense one."""
        if not self.experts:
            return self._matrices * self.hidden * self.ffn
        router = self.hidden * self.experts
        moe = self._matrices * self.hidden * (self.experts * self.expert_ffn + self.shared_ffn) + router
        return self.moe_share * moe + (1 - self.moe_share) * self.dense_mlp_params

    @property
    def block_params(self) -> float:
        return self.attention_params + self.mlp_params + 2 * self.hidden

    @property
    def routed_expert_params(self) -> float:
        """One block's routed experts' weights (not the shared experts', not the router's): what expert
        parallelism deals out (the layers' mean); 0 for a dense block."""
        return self.moe_share * self._matrices * self.hidden * self.experts * self.expert_ffn

    @property
    def routed_active_params(self) -> float:
        """The routed experts' weights one token multiplies with in a block (its experts_per_token)."""
        return self.moe_share * self._matrices * self.hidden * self.experts_per_token * self.expert_ffn

    @property
    def active_block_params(self) -> float:
        """The parameters one token's forward multiplies with: its routed experts, not all of them."""
        if not self.experts:
            return self.block_params
        width = self.experts_per_token * self.expert_ffn + self.shared_ffn
        routed = self._matrices * self.hidden * width + self.hidden * self.experts
        active_mlp = self.moe_share * routed + (1 - self.moe_share) * self.dense_mlp_params
        return self.block_params - self.mlp_params + active_mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def param_count(self) -> int:
        if self.param_count_override:
            return self.param_count_override
        return round(self.layers * self.block_params) + self.embedding_params + self.head_params + self.hidden

    @property
    def active_param_count(self) -> int:
        """The parameters one token meets: all of a dense model's, the routed experts only of an MoE's.
        Where a module's exact count replaces the shape's, what it adds (norms, biases) is counted as met;
        where it is smaller (a hybrid whose other layers the shape counts as blocks), the shape's share."""
        inactive = round(self.layers * (self.block_params - self.active_block_params))
        shape_total = round(self.layers * self.block_params) + self.embedding_params + self.head_params + self.hidden
        share = (shape_total - inactive) / shape_total
        return max(self.param_count - inactive, round(self.param_count * share))

    def model_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token as MFU is usually counted (torchtitan, PaLM): 6 per
        non-embedding parameter a token meets plus attention's 12 * layers * (heads x head size) * sequence
        (a sliding-window layer's twice its window: ``attention_length``; under latent attention, whose
        values are narrower than its queries and keys, the mean of the two widths: ``attention_width``)."""
        attention = 12.0 * self.attention_width * self.attention_length(seq_len)
        return 6.0 * (self.active_param_count - self.embedding_params) + attention

    def recompute_flops_per_token(self, seq_len: int) -> float:
        """One more forward of every block (full activation checkpointing)."""
        attention = 4.0 * self.attention_width * self.attention_length(seq_len)
        return 2.0 * self.layers * self.active_block_params + attention

    def attention_length(self, attended: float) -> float:
        """The attention length summed over the layers, in the units causal attention over ``attended``
        tokens counts: a layer of the whole sequence ``attended`` (its queries see attended / 2 keys on
        average), a sliding-window layer twice its window (its queries see the window), at most
        ``attended``."""
        windowed = self.windowed_layers if self.window else 0
        return (self.layers - windowed) * attended + windowed * min(2 * self.window, attended)

    def block_activation_elements(self) -> float:
        """Elements a block saves for backward, per token, with fused (flash / SDPA) attention: norm
        inputs and outputs, q / k / v, the attention output, and the MLP's intermediate tensors; under
        latent attention also the latents, before and after their norms, and the keys' rotary part."""
        latent = 2 * (self.q_lora_rank + self.kv_lora_rank) + self.rope_head_size if self.kv_lora_rank else 0
        return 4 * self.hidden + latent + self.split_activation_elements()

    def split_activation_elements(self) -> float:
        """The part of ``block_activation_elements`` that tensor parallelism splits (heads, MLP width). An
        MoE block also keeps the token's hidden state once for each expert it is routed to: the copies
        dispatched to the experts, which their first matmuls save for the weight gradient."""
        mlp = (4 if self.gated else 2) * self.ffn + self.moe_share * self.experts_per_token * self.hidden
        return self.q_dim + self.out_dim + self.key_dim + self.value_dim + mlp


def model_spec(value: Union[str, Mapping[str, Any], nn.Module, TransformerSpec]) -> TransformerSpec:
    """A built-in name, a config.json path or directory, a config dict, or a (meta) ``nn.Module``."""
    if isinstance(value, TransformerSpec):
        return value
    if isinstance(value, nn.Module):
        return from_module(value)
    if isinstance(value, Mapping):
        return from_hf_config(value)
    if isinstance(value, (str, Path)):
        text = str(value)
        if text in BUILTIN_CONFIGS:
            return from_hf_config(BUILTIN_CONFIGS[text], name=text)
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except ValueError as error:
                raise InputError(f"model config {text!r} is not valid JSON: {error}") from error
            # named by its directory (a checkpoint's config.json), or by the file itself
            named = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
            return from_hf_config(config, name=named)
        close = nearest_name(text, BUILTIN_CONFIGS)
        hint = f" Did you mean {close!r}?" if close else ""
        raise InputError(f"model {text!r} is neither a built-in name nor a config.json file.{hint} Built-in: "
                         f"{sorted(BUILTIN_CONFIGS)}")
    raise InputError(f"model {value!r} is not valid: give a built-in name, a config.json path, a dict or an nn.Module")


def from_hf_config(config: Mapping[str, Any], name: str = "", structure: bool = True) -> TransformerSpec:
    """The shape keys of a transformers config (GPT-2's n_embd / n_layer / n_head are accepted too).

    With ``structure``, what the keys cannot say is read off the model itself, built on the meta device
    from the config where transformers knows its model type (``_with_structure``): whether its MLP is
    gated, for a model type in neither list above, and, for a complete config.json, its exact parameter
    count where the shape's own count misses more than 1 % of it."""
    data = _standard_names({_ALIASES.get(k, k): v for k, v in config.items()})
    if data.get("is_encoder_decoder"):
        raise InputError(f"model config: {data.get('model_type') or 'this model'} is an encoder-decoder model "
                         "(is_encoder_decoder), which the planner does not describe: it reads decoder-only "
                         "transformers, and would count one stack of the two; give a decoder-only config")
    missing = [k for k in _REQUIRED if not isinstance(data.get(k), int)]
    if missing and isinstance(data.get("text_config"), Mapping):
        # a multimodal config (Llama 4, Gemma 3, Mistral 3): its language model, the vision tower left out
        text = dict(data["text_config"])
        if _WRITTEN_BY_TRANSFORMERS in data:  # written whole with its model's config: as complete
            text.setdefault(_WRITTEN_BY_TRANSFORMERS, data[_WRITTEN_BY_TRANSFORMERS])
        label = name or data.get("_name_or_path") or data.get("model_type") or "model"
        return from_hf_config(text, name=f"{label} (language model)", structure=structure)
    if missing:
        hint = (f" ({data.get('model_type') or 'this model'} has no attention heads: a state-space or recurrent model, "
                "Mamba's or RWKV's, is not a transformer the planner describes)"
                if "num_attention_heads" in missing and not any(k in data for k in _HEAD_COUNT_KEYS) else "")
        raise InputError(f"model config: missing or non-integer key(s) {missing}; required: {list(_REQUIRED)}{hint}")
    hidden, model_type = data["hidden_size"], str(data.get("model_type", ""))
    arch = (data.get("architectures") or [""])[0]
    gated = model_type in GATED_MODEL_TYPES
    head_size = data.get("head_dim")
    latent = _latent_attention(data)
    if latent:  # its config's head_dim is the rotary part's (transformers' DeepseekV3Config)
        head_size = latent.pop("head_size")
    mlp = {"ffn": _mlp_width(config, data), **_experts(data), **_sliding_window(data), **latent}
    spec = TransformerSpec(
        name=name or data.get("_name_or_path") or model_type or "model", hidden=hidden,
        layers=data["num_hidden_layers"], heads=data["num_attention_heads"],
        kv_heads=_kv_heads(data), vocab=data["vocab_size"],
        tied=bool(data.get("tie_word_embeddings", not gated)), gated=gated,
        block=arch.replace("ForCausalLM", "DecoderLayer") if arch.endswith("ForCausalLM") else "Block",
        head_size=head_size if isinstance(head_size, int) else 0, **mlp)
    return _with_structure(spec, data) if structure else spec


def _with_structure(spec: TransformerSpec, data: Mapping[str, Any]) -> TransformerSpec:
    """The spec with what only the model's structure says, where it must be built to say it: a model type
    in neither ``GATED_MODEL_TYPES`` nor ``PLAIN_MLP_MODEL_TYPES`` (its MLP read off its first block; where
    it cannot be built, a SiLU / SwiGLU activation is taken as gated, as those models are), the experts a
    config names under keys this reader does not know, and a complete config's exact parameter count where
    the shape's count is more than 1 % off it (per-layer widths, extra embeddings: the memory goes with the
    parameters the model really has). Within 1 % the shape's count stands (biases and norms it leaves out)."""
    model_type = str(data.get("model_type", ""))
    known = model_type in GATED_MODEL_TYPES or model_type in PLAIN_MLP_MODEL_TYPES
    complete = _WRITTEN_BY_TRANSFORMERS in data
    if known and not complete:
        return spec
    model = _built_on_meta(data)
    if model is None:
        return spec if known else replace(spec, gated=_gated_by_activation(data))
    spec = _with_module_mlp(spec, model, data)
    blocks, _ = repeated_blocks(model)
    spec = replace(spec, block=next(iter(blocks), spec.block))  # the block class the model really repeats
    if spec.experts and not spec.dense_layers:  # dense layers placed by keys this reader does not know
        spec = _with_module_dense_layers(spec, model)
    exact = sum(p.numel() for p in model.parameters())
    if complete and abs(spec.param_count - exact) > 0.01 * exact:
        spec = replace(spec, param_count_override=exact)
    return spec


def _with_module_mlp(spec: TransformerSpec, model: nn.Module, data: Mapping[str, Any]) -> TransformerSpec:
    """What a config's keys leave to the module: experts under keys this reader does not know, and, for a
    model type in neither list, whether its MLP is gated (off its first block; else by its activation)."""
    if not spec.experts:
        moe = _first_moe_block(model, spec.hidden)
        spec = replace(spec, **moe) if moe else spec
    if str(data.get("model_type", "")) in GATED_MODEL_TYPES | PLAIN_MLP_MODEL_TYPES:
        return spec
    gated = _module_gated(model, spec)
    return replace(spec, gated=_gated_by_activation(data) if gated is None else gated)


def _built_on_meta(data: Mapping[str, Any]) -> Optional[nn.Module]:
    """The causal language model a config describes, built on the meta device (nothing allocated), or None
    where transformers is absent, does not know the model type as a causal LM, or cannot build it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    model_type = data.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as error:  # a config transformers refuses: the shape keys alone are read
        logger.info("model config: transformers could not build %s on meta (%s: %s); its keys alone are read",
                    model_type, type(error).__name__, error)
        return None


def _gated_by_activation(data: Mapping[str, Any]) -> bool:
    """A model that cannot be built: SiLU / SwiGLU MLPs are gated in every model family that uses them."""
    act = data.get("hidden_act") or data.get("activation_function") or data.get("hidden_activation")
    return str(act).lower() in ("silu", "swiglu", "swish")


def _module_gated(model: nn.Module, spec: TransformerSpec) -> Optional[bool]:
    """Whether the first repeated block's MLP is gated: an expert's parameters over hidden x its width
    (3 matrices or 2), or, in a dense block, the projections into the MLP's width beside the one out of it
    (``ffn`` -> hidden): gate and up (or one fused, twice as wide) against up alone. None where neither is
    found."""
    blocks, _ = repeated_blocks(model)
    block = next((m for m in model.modules() if type(m).__name__ in blocks), None)
    if block is None:
        return None
    found = _expert_bank(block) or _expert_list(block, spec.hidden)
    if found is not None and spec.expert_ffn:
        matrices = round(found[2] / (spec.hidden * spec.expert_ffn))
        return {3: True, 2: False}.get(matrices)
    return next((gated for width, gated in _mlp_groups(block, spec.hidden) if width == spec.ffn), None)


def _mlp_groups(block: nn.Module, hidden: int) -> list[tuple[int, bool]]:
    """(width, gated) of every group of sibling linear layers that projects the hidden state into one width
    ``w`` (gate and up, or one fused twice as wide: gated; up alone: plain) beside one projection ``w`` ->
    hidden: a block's MLP, and where they look alike its attention."""
    found = []
    for parent in block.modules():
        shapes = [shape for child in parent.children() if (shape := _linear_shape(child))]
        for width in {inp for inp, out in shapes if out == hidden}:
            into = sum(out for inp, out in shapes if inp == hidden and out in (width, 2 * width))
            if into in (width, 2 * width):
                found.append((width, into == 2 * width))
    return found


def _linear_shape(module: nn.Module) -> Optional[tuple[int, int]]:
    """(in, out) features of a linear layer: ``nn.Linear``, or GPT-2's transposed ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight, out = getattr(module, "weight", None), getattr(module, "nf", None)
    if isinstance(out, int) and weight is not None and weight.dim() == 2:
        return int(weight.shape[0]), out
    return None


def _latent_attention(data: Mapping[str, Any]) -> dict[str, int]:
    """Multi-head latent attention's shape from a DeepSeek-V2 / V3-style config (``kv_lora_rank``,
    ``q_lora_rank``: None or 0 where queries come straight from the hidden state, ``qk_nope_head_dim`` +
    ``qk_rope_head_dim`` per query / key head, ``v_head_dim``); {} for any other attention."""
    rank = data.get("kv_lora_rank")
    if not isinstance(rank, int) or rank <= 0:
        return {}
    keys = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    bad = [k for k in keys if not isinstance(data.get(k), int) or data[k] < 0]
    if bad:
        raise InputError(f"model config: kv_lora_rank={rank} (latent attention) but {bad} missing or not "
                         f"non-negative integers; latent attention reads {list(keys)}")
    q_rank = data.get("q_lora_rank") or 0
    if not isinstance(q_rank, int) or q_rank < 0:
        raise InputError(f"model config: q_lora_rank={q_rank!r} is not valid: give a positive int, or null "
                         "where queries are projected straight from the hidden state")
    return {"head_size": data["qk_nope_head_dim"] + data["qk_rope_head_dim"], "q_lora_rank": q_rank,
            "kv_lora_rank": rank, "rope_head_size": data["qk_rope_head_dim"], "value_head_size": data["v_head_dim"]}


def _standard_names(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict whose shape keys are named as its model names them (MPT's d_model / n_layers /
    n_heads, GPT-Neo's num_layers / num_heads, XGLM's attention_heads) gets the standard names too,
    through its transformers config class's ``attribute_map`` (as a module's config is read); only
    where a required key is missing, and only when transformers knows the model type."""
    if all(isinstance(data.get(k), int) for k in _REQUIRED):
        return data
    try:
        from transformers import CONFIG_MAPPING
        config_class = CONFIG_MAPPING[str(data.get("model_type"))]
    except (ImportError, KeyError):
        return data
    for standard, own in getattr(config_class, "attribute_map", {}).items():
        if not isinstance(data.get(standard), int) and isinstance(data.get(own), int):
            data[standard] = data[own]
    return data


def _sliding_window(data: Mapping[str, Any]) -> dict[str, int]:
    """Which layers attend within a sliding window, as the model's config says: its ``layer_types``
    ("sliding_attention": gpt-oss, Gemma 2 / 3, and the configs transformers writes), Gemma 3's
    ``sliding_window_pattern`` (all but every p-th layer), Gemma 2's alternation, every layer of
    Mistral / Mixtral with a ``sliding_window``; {} where none does (Qwen2's window is off unless
    ``use_sliding_window``)."""
    window, layers = data.get("sliding_window"), data["num_hidden_layers"]
    if not isinstance(window, int) or window <= 0 or data.get("use_sliding_window") is False:
        return {}
    types = data.get("layer_types")
    if isinstance(types, list) and types:
        windowed = sum(str(t).startswith("sliding") for t in types)
    elif isinstance(data.get("sliding_window_pattern"), int) and data["sliding_window_pattern"] > 0:
        windowed = layers - layers // data["sliding_window_pattern"]
    elif data.get("model_type") == "gemma2":
        windowed = layers - layers // 2
    elif data.get("model_type") in ("mistral", "mixtral"):
        windowed = layers
    else:
        return {}
    return {"window": window, "windowed_layers": windowed} if windowed else {}


def _mlp_width(config: Mapping[str, Any], data: Mapping[str, Any]) -> int:
    """The MLP's width as the model reads it: GPT-2-style models read ``n_inner``, Falcon
    ``ffn_hidden_size``, OPT and XGLM ``ffn_dim`` (4 x hidden where unset), MPT ``expansion_ratio`` x
    d_model, whatever else the config holds; the rest ``intermediate_size`` (the mean where it gives one
    width a layer, as Gemma 3n does)."""
    hidden = data["hidden_size"]
    for own in ("n_inner", "ffn_hidden_size", "ffn_dim"):
        if own in config:
            return config[own] or 4 * hidden
    if isinstance(config.get("expansion_ratio"), (int, float)):
        return int(config["expansion_ratio"] * hidden)
    width = data.get("intermediate_size")
    if isinstance(width, list) and width and all(isinstance(w, int) for w in width):
        return round(sum(width) / len(width))  # one width a layer (Gemma 3n): their mean
    return width or 4 * hidden


def _kv_heads(data: Mapping[str, Any]) -> int:
    """Key / value heads as the model reads them: Falcon's new decoder architecture its ``num_kv_heads``;
    Falcon-7B's and GPT-BigCode's ``multi_query`` flag one shared head (the key those models read, not
    ``num_key_value_heads``); otherwise ``num_key_value_heads`` (grouped-query attention), or every head."""
    heads = data["num_attention_heads"]
    if data.get("new_decoder_architecture") and isinstance(data.get("num_kv_heads"), int):
        return data["num_kv_heads"]
    if "multi_query" in data:
        return 1 if data["multi_query"] else heads
    value = data.get("num_key_value_heads")
    return value if isinstance(value, int) and value > 0 else heads


def _experts(data: Mapping[str, Any]) -> dict[str, int]:
    """A Mixture-of-Experts MLP's shape (Mixtral's num_local_experts, Qwen-MoE's and OLMoE's num_experts,
    DeepSeek's n_routed_experts; moe_intermediate_size or intermediate_size per expert; Qwen-MoE's shared
    expert, DeepSeek's n_shared_experts of the expert width, Llama 4's one of intermediate_size), with
    ``ffn`` set to the width a token runs through; {} for a dense model. Models that mix dense and MoE
    layers (DeepSeek's first_k_dense_replace, Llama 4's interleave_moe_layer_step, ``_dense_layers``) are
    counted by their layers' mean: ``ffn`` the mean width, ``dense_layers`` and ``dense_ffn`` the rest."""
    experts = next((data[k] for k in _EXPERT_KEYS if isinstance(data.get(k), int) and data[k] > 1), 0)
    if not experts or data.get("is_moe") is False:  # Doge's experts off: a dense MLP
        return {}
    per_token = next((data[k] for k in _TOP_K_KEYS if isinstance(data.get(k), int)), None)
    if not isinstance(per_token, int) or per_token < 1:
        raise InputError(f"model config: {experts} experts but no integer {' / '.join(_TOP_K_KEYS)} (the experts "
                         "each token is routed to)")
    expert_ffn = data.get("moe_intermediate_size") or _mlp_width(data, data)
    shared = data.get("shared_expert_intermediate_size") or 0
    shared_count = next((data[k] for k in _SHARED_EXPERT_KEYS if isinstance(data.get(k), int)), None)
    if not shared and shared_count:
        shared = shared_count * expert_ffn
    if not shared and str(data.get("model_type", "")).startswith("llama4"):
        shared = expert_ffn
    dense, dense_ffn = _dense_layers(data, experts)
    moe_share = (data["num_hidden_layers"] - dense) / data["num_hidden_layers"]
    routed_width = per_token * expert_ffn + shared
    mean_width = round(moe_share * routed_width + (1 - moe_share) * dense_ffn)
    return {"experts": experts, "experts_per_token": per_token, "expert_ffn": expert_ffn, "shared_ffn": shared,
            "ffn": mean_width, "dense_layers": dense, "dense_ffn": dense_ffn if dense else 0,
            **_expert_groups(data.get("n_group"), data.get("topk_group"), experts, per_token)}


def _expert_groups(groups: Any, per_token: Any, experts: int, top_k: int) -> dict[str, int]:
    """Group-limited routing's two counts where they limit anything (``groups_limit_routing``; DeepSeek-V3:
    8 groups of 32, 4 a token); {} otherwise (Kimi K2's one group, a config without them)."""
    if not groups_limit_routing(groups, per_token, experts, top_k):
        return {}
    return {"expert_groups": groups, "groups_per_token": per_token}


def groups_limit_routing(groups: Any, per_token: Any, experts: int, top_k: int) -> bool:
    """Whether group-limited routing's counts limit anything: integers, more than one group, a token's
    experts chosen within fewer of them than there are, the groups dividing the experts and holding the
    token's top-k between them (the one rule for a config, a module and a spec built by hand)."""
    counts = (groups, per_token)
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
        return False
    return 1 <= per_token < groups and experts % groups == 0 and per_token * (experts // groups) >= top_k


def _dense_layers(data: Mapping[str, Any], experts: int) -> tuple[int, int]:
    """(layers with a dense MLP, its width) in an MoE model, as its config places them: DeepSeek's and
    GLM-4-MoE's first ``first_k_dense_replace`` (and DeepSeek-V2's ``moe_layer_freq``), Llama 4's
    ``moe_layers`` or every ``interleave_moe_layer_step``-th routed (the others ``intermediate_size_mlp``
    wide), Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``; the dense width is
    ``intermediate_size`` elsewhere. (0, 0) where every layer routes."""
    layers = data["num_hidden_layers"]
    indices = range(layers)
    routed: Any = indices
    if isinstance(data.get("moe_layers"), list):  # Llama 4's explicit list
        routed = [i for i in indices if i in set(data["moe_layers"])]
    elif isinstance(data.get("interleave_moe_layer_step"), int) and data["interleave_moe_layer_step"] > 1:
        step = data["interleave_moe_layer_step"]
        routed = [i for i in indices if (i + 1) % step == 0]
    if isinstance(data.get("first_k_dense_replace"), int):
        freq = data.get("moe_layer_freq") if isinstance(data.get("moe_layer_freq"), int) else 1
        routed = [i for i in routed if i >= data["first_k_dense_replace"] and i % max(freq, 1) == 0]
    if isinstance(data.get("moe_layer_start_index"), int):  # ERNIE 4.5's span and interval
        end = data.get("moe_layer_end_index") if isinstance(data.get("moe_layer_end_index"), int) else layers - 1
        interval = max(data.get("moe_layer_interval") or 1, 1)
        routed = [i for i in routed if data["moe_layer_start_index"] <= i <= end and (i + 1) % interval == 0]
    if isinstance(data.get("expert_layer_period"), int) and data["expert_layer_period"] > 1:  # Jamba's
        period, offset = data["expert_layer_period"], data.get("expert_layer_offset") or 0
        routed = [i for i in routed if i % period == offset]
    if isinstance(data.get("decoder_sparse_step"), int) and data["decoder_sparse_step"] > 1:
        routed = [i for i in routed if (i + 1) % data["decoder_sparse_step"] == 0]
    if isinstance(data.get("mlp_only_layers"), list):
        routed = [i for i in routed if i not in set(data["mlp_only_layers"])]
    dense = layers - len(list(routed))
    if not dense:
        return 0, 0
    width = data.get("intermediate_size_mlp") or data.get("intermediate_size") or 4 * data["hidden_size"]
    return dense, width


def from_module(model: nn.Module) -> TransformerSpec:
    """Shape of a module (meta tensors are fine): a transformers model through its ``config``; any
    other from its embedding, its repeated blocks and its exact parameter count. Its block's
    memory-bound traffic is counted from the module's own ops where it runs on token ids on the meta
    device (``elementwise.model_block_traffic``): the norms and rotary embedding as this code writes them."""
    return _with_traffic(_module_shape(model), model)


def _module_shape(model: nn.Module) -> TransformerSpec:
    config = getattr(model, "config", None)
    data = _config_dict(config) if config is not None and hasattr(config, "to_dict") else None
    if data is not None and all(isinstance(data.get(k), int) for k in _REQUIRED):
        spec = from_hf_config(data, name=type(model).__name__, structure=False)
        return _with_block(_with_module_mlp(spec, model, data), model)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    blocks, block_bytes = repeated_blocks(model)
    if not embeddings or not blocks:
        raise InputError(f"{type(model).__name__}: the planner needs a token embedding and repeated blocks "
                         "(a transformer); give its transformers config instead")
    hidden, vocab = embeddings[0].embedding_dim, embeddings[0].num_embeddings
    block, layers = next(iter(blocks.items()))
    module = next(m for m in model.modules() if type(m).__name__ == block)
    block_params = sum(p.numel() for p in module.parameters())
    total = sum(p.numel() for p in model.parameters())
    moe = _first_moe_block(model, hidden)
    if moe:
        latent = _module_latent(module)
        head_size = latent.pop("head_size", 0)
        if latent:
            heads = _int_attribute(module, HEAD_COUNT_NAMES) or max(hidden // 64, 1)
            kv_heads = _int_attribute(module, KV_HEAD_COUNT_NAMES) or heads
        else:
            widths = {moe["expert_ffn"], moe["shared_ffn"]}
            heads, kv_heads, head_size = _module_heads(module, hidden, _module_attention(module, hidden, widths))
        spec = TransformerSpec(type(model).__name__, hidden, layers, heads, kv_heads, vocab=vocab, gated=True,
                               block=block, param_count_override=total, head_size=head_size, **latent, **moe)
        return _with_module_dense_layers(spec, model)
    mlp = _module_mlp(module, hidden)
    attention = _module_attention(module, hidden, {mlp[0]} if mlp else set())
    if attention is None and not _int_attribute(module, HEAD_COUNT_NAMES) and not _has_attention_module(module):
        raise InputError(f"{type(model).__name__}: its repeated block {block} has no attention the planner can find "
                         "(no output projection beside query / key / value projections, no head count): a "
                         "state-space or recurrent model (Mamba's, RWKV's) is not a transformer the planner "
                         "describes; a transformer written otherwise can be given as its config")
    heads, kv_heads, head_size = _module_heads(module, hidden, attention)
    # no MLP found: its width solved from the block's parameters less the attention's (plain, two matrices)
    attention_params = (2 * hidden * (heads + kv_heads) * head_size) if head_size else 4 * hidden * hidden
    ffn, gated = mlp if mlp else (max((block_params - attention_params) // (2 * hidden), hidden), False)
    return TransformerSpec(type(model).__name__, hidden, layers, heads, kv_heads, ffn, vocab, gated=gated, block=block,
                           param_count_override=total, head_size=head_size)


def _module_mlp(block: nn.Module, hidden: int) -> Optional[tuple[int, bool]]:
    """(width, gated) of a dense block's MLP read off its linear layers, or None: a module whose linear
    children project the hidden state into one width ``w`` (gate and up, or one fused twice as wide: gated;
    up alone: plain) beside one projection ``w`` -> hidden. The attention (queries, keys and values into
    heads x head size, its output back) can look alike, so a width equal to the hidden size is not taken
    and, of several candidates, the widest is (an MLP is wider than its attention in every model here)."""
    found = [group for group in _mlp_groups(block, hidden) if group[0] != hidden]
    return max(found) if found else None


def _module_attention(block: nn.Module, hidden: int, mlp_widths: set[int]) -> Optional[tuple[int, int]]:
    """(query width, key width) of a block's attention read off its projections, or None: the linear
    children of one module (through ``nn.Sequential`` wrappers; the MLP's, of a width in ``mlp_widths``
    with its projection back to the hidden size beside them, set apart) that are an output
    projection ``q`` -> hidden beside projections of the hidden state into the queries (``q``) and the keys
    and values: separate (``kv`` each), keys and values fused (``2 kv``), or all three fused (``q + 2 kv``);
    ``nn.MultiheadAttention``'s packed input weight counts as the fused one. Grouped-query attention is
    then read from the shapes the weights have, whatever the attributes holding the head counts are
    called (a width the names would give wrong: every head's keys counted where a few are shared)."""
    for parent in block.modules():
        shapes = [shape for child in _unwrapped_children(parent) if (shape := _linear_shape(child))]
        packed = getattr(parent, "in_proj_weight", None) if isinstance(parent, nn.MultiheadAttention) else None
        if packed is not None:
            shapes.append((int(packed.shape[1]), int(packed.shape[0])))
        mlp = {i for i, o in shapes if o == hidden and i in mlp_widths}  # the MLP's, where it is this module's
        shapes = [(i, o) for i, o in shapes
                  if not (i == hidden and (o in mlp or o / 2 in mlp) or o == hidden and i in mlp)]
        for j, (q, out) in enumerate(shapes):
            widths = _key_width(q, [o for k, (i, o) in enumerate(shapes) if k != j and i == hidden], len(shapes) - 1)
            if out == hidden and widths:
                return q, widths
    return None


def _has_attention_module(block: nn.Module) -> bool:
    """Whether ``block`` holds PyTorch's ``nn.MultiheadAttention``."""
    return any(isinstance(m, nn.MultiheadAttention) for m in block.modules())


def _unwrapped_children(module: nn.Module) -> list[nn.Module]:
    """A module's children, those of an ``nn.Sequential`` child in its place (an output projection
    written ``nn.Sequential(nn.Linear(...), nn.Dropout(...))``)."""
    return [grand for child in module.children()
            for grand in (child.children() if isinstance(child, nn.Sequential) else (child,))]


def _key_width(q: int, inputs: list[int], others: int) -> int:
    """A key's width from the widths the hidden state is projected into beside an output projection
    that reads ``q`` (``_module_attention``); 0 where they are not an attention's (or another linear
    layer sits beside them)."""
    if len(inputs) != others or not 1 <= len(inputs) <= 3:
        return 0
    if len(inputs) == 1:  # queries, keys and values fused
        rest = inputs[0] - q
        return rest // 2 if rest > 0 and rest % 2 == 0 else 0
    if q not in inputs:
        return 0
    rest = list(inputs)
    rest.remove(q)
    if len(rest) == 1:  # keys and values fused
        return rest[0] // 2 if rest[0] % 2 == 0 else 0
    return rest[0] if rest[0] == rest[1] else 0


def _module_heads(block: nn.Module, hidden: int, attention: Optional[tuple[int, int]]) -> tuple[int, int, int]:
    """(heads, key / value heads, head size; 0: hidden / heads) of a block's attention. Its widths read
    off the projections (``_module_attention``) decide; the head counts the attention keeps as attributes
    (``HEAD_COUNT_NAMES``) split them where they divide them, else a head of 64 (or the widths' largest
    common divisor) does: the FLOPs and bytes the planner counts go by the widths, not the head count.
    Without widths, the attributes alone (one head per 64 features, and as many key / value heads,
    where none is found)."""
    named = _int_attribute(block, HEAD_COUNT_NAMES)
    if attention is None:
        heads = named or max(hidden // 64, 1)
        return heads, _int_attribute(block, KV_HEAD_COUNT_NAMES) or heads, 0
    q, kv = attention
    if named and q % named == 0 and kv % (q // named) == 0:
        size = q // named
    else:
        size = 64 if q % 64 == 0 and kv % 64 == 0 else math.gcd(q, kv)
    return q // size, kv // size, 0 if q == hidden else size


def _config_dict(config: Any) -> dict[str, Any]:
    """A transformers config as a dict, with the standard names its ``attribute_map`` gives to its own
    keys (MPT's d_model / n_layers / n_heads, GPT-Neo's num_layers / num_heads, XGLM's attention_heads
    read as hidden_size, num_hidden_layers, num_attention_heads). A config that still lacks them leaves
    the module to be read from its structure."""
    data = dict(config.to_dict())
    for key in (*_REQUIRED, "num_key_value_heads", "intermediate_size", "head_dim"):
        if not isinstance(data.get(key), int):
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                data[key] = value
    return data


def _first_moe_block(model: nn.Module, hidden: int) -> dict[str, int]:
    """The MoE shape of the first repeated block that holds experts (a model may start with dense
    blocks, as DeepSeek-V3 does); {} when none does."""
    blocks, _ = repeated_blocks(model)
    for module in model.modules():
        if type(module).__name__ in blocks:
            moe = _module_experts(module, hidden)
            if moe:
                return moe
    return {}


# attribute names latent attention keeps its shape under (transformers' DeepseekV3Attention, torchtitan's
# deepseek_v3 Attention: the config keys' names)
LATENT_NAMES = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _module_latent(block: nn.Module) -> dict[str, int]:
    """Multi-head latent attention's shape off a block's attention module (``_latent_attention``'s keys as
    its attributes); {} for any other attention."""
    for sub in block.modules():
        rank = getattr(sub, "kv_lora_rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0:
            return _latent_attention({name: getattr(sub, name, None) for name in LATENT_NAMES})
    return {}


def _with_module_dense_layers(spec: TransformerSpec, model: nn.Module) -> TransformerSpec:
    """An MoE module's blocks of the repeated class that hold no experts (DeepSeek-V3's first dense
    layers, in torchtitan's layout one block class for both): their count and MLP width (the block's
    parameters less the attention's and the two norms', over 3 hidden-wide matrices), the spec's MLP
    width then the layers' mean."""
    dense = [m for m in model.modules() if type(m).__name__ == spec.block and not _module_experts(m, spec.hidden)]
    if not dense:
        return spec
    mlp = sum(p.numel() for p in dense[0].parameters()) - spec.attention_params - 2 * spec.hidden
    dense_ffn = max(mlp, 0) // (3 * spec.hidden)
    share = (spec.layers - len(dense)) / spec.layers
    width = round(share * spec.ffn + (1 - share) * dense_ffn)
    return replace(spec, dense_layers=len(dense), dense_ffn=dense_ffn, ffn=width)


# attribute names a block's attention keeps its head counts under (PyTorch, torchtitan, nanoGPT, HF)
HEAD_COUNT_NAMES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads")
KV_HEAD_COUNT_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
# ... and an MoE layer or its router the experts each token is sent to
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "experts_per_token", "topk", "k")
# ... and its group-limited routing's groups, and the groups a token's experts are chosen within (HF's
# DeepSeek-V3 router, torchtitan's TokenChoiceTopKRouter)
EXPERT_GROUP_NAMES = ("n_group", "num_expert_groups")
LIMITED_GROUP_NAMES = ("topk_group", "num_limited_groups")


def _int_attribute(module: nn.Module, names: tuple[str, ...]) -> int:
    """The first positive integer attribute of that name on ``module`` or below (0: none)."""
    for sub in module.modules():
        for name in names:
            value = getattr(sub, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def _module_experts(block: nn.Module, hidden: int) -> dict[str, int]:
    """A Mixture-of-Experts block's MLP shape, read off its modules: the experts (a bank stacking their
    weights on a leading expert dimension, torchtitan's GroupedExperts or transformers' banks; or an
    ``nn.ModuleList`` of like experts beside a router ``Linear(hidden, experts)``), each expert's width
    (its parameters over 3 hidden-wide matrices: SwiGLU), the always-on (shared) MLP beside them, and how
    many experts a token goes to (the MoE layer's or its router's top-k). {} for a dense block; an MoE
    whose top-k cannot be read is refused (its FLOPs per token would be off by experts / top-k)."""
    found = _expert_bank(block) or _expert_list(block, hidden)
    if found is None:
        return {}
    layer, experts, per_expert, expert_ids = found
    per_token = _int_attribute(layer, TOP_K_NAMES)
    if not 1 <= per_token <= experts:
        raise InputError(f"{type(block).__name__}: a Mixture-of-Experts block with {experts} experts, but no "
                         f"top-k (one of the attributes {list(TOP_K_NAMES)} on {type(layer).__name__}) says how "
                         "many a token goes to; give the model's config (num_experts, num_experts_per_tok) instead")
    router = experts * hidden
    others = sum(p.numel() for p in layer.parameters() if id(p) not in expert_ids) - router
    expert_ffn, shared_ffn = per_expert // (3 * hidden), max(others, 0) // (3 * hidden)
    groups = _expert_groups(_int_attribute(layer, EXPERT_GROUP_NAMES), _int_attribute(layer, LIMITED_GROUP_NAMES),
                            experts, per_token)
    return {"experts": experts, "experts_per_token": per_token, "expert_ffn": expert_ffn, "shared_ffn": shared_ffn,
            "ffn": per_token * expert_ffn + shared_ffn, **groups}


def _expert_bank(block: nn.Module) -> Optional[tuple[nn.Module, int, int, set[int]]]:
    """(the MoE layer holding the bank, experts, parameters per expert, the bank's parameter ids)."""
    for name, module in block.named_modules():
        experts = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if (name and isinstance(experts, int) and experts > 1 and params
                and all(p.dim() >= 3 and p.shape[0] == experts for p in params)):
            layer = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
            return layer, experts, sum(p[0].numel() for p in params), {id(p) for p in params}
    return None


def _expert_list(block: nn.Module, hidden: int) -> Optional[tuple[nn.Module, int, int, set[int]]]:
    """The same for experts held as an ``nn.ModuleList`` of like MLPs (two or more Linears on the
    hidden width each) with a router beside it (a ``Linear(hidden, experts)``)."""
    for layer in block.modules():
        for child in layer.children():
            members = list(child.children()) if isinstance(child, nn.ModuleList) else []
            sizes = {(type(m), sum(p.numel() for p in m.parameters())) for m in members}
            if len(members) < 2 or len(sizes) != 1 or not _is_mlp(members[0], hidden):
                continue
            routers = [m for m in layer.modules() if isinstance(m, nn.Linear) and m.out_features == len(members)
                       and m.in_features == hidden]
            if routers:
                ids = {id(p) for m in members for p in m.parameters()}
                return layer, len(members), next(iter(sizes))[1], ids
    return None


def _is_mlp(module: nn.Module, hidden: int) -> bool:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return len(linears) >= 2 and all(hidden in (m.in_features, m.out_features) for m in linears)


def _with_traffic(spec: TransformerSpec, model: nn.Module) -> TransformerSpec:
    traffic = model_block_traffic(model)
    return spec if traffic is None else replace(spec, elementwise_bytes=(traffic / spec.hidden, 0.0, 0.0))


def _with_block(spec: TransformerSpec, model: nn.Module) -> TransformerSpec:
    blocks, _ = repeated_blocks(model)
    block = next(iter(blocks), spec.block)
    return replace(spec, block=block, param_count_override=sum(p.numel() for p in model.parameters()))
