"""Tiny configs of transformers families beyond the conformance zoo, one per ``model_type``.

Each family is built from a config of its own (4 layers, hidden 32, 4 query heads and 2 key / value
heads where the family has grouped heads; its own keys for the rest), dropout off. Two readers:
``atorch.testing.families`` prints the share of each that tensor parallelism splits, and the
conformance matrix trains them under the structure-derived tensor-parallel columns as the zoo rows
``family:<name>`` (``atorch.testing.hf_models.FAMILY_MODELS``).
"""
from __future__ import annotations

from typing import Any

from torch import nn

VOCAB, SEQ = 64, 16  # the zoo's token data: vocabulary and sequence length (atorch.testing.hf_models reads them)
COMMON = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
              eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
               n_group=1, topk_group=1, n_shared_experts=1)
# model_type -> its own config keys beside COMMON ("model_type" overrides the name)
FAMILIES: dict[str, dict[str, Any]] = {
    "falcon (new decoder)": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2),
    "falcon (multi-query)": dict(model_type="falcon", multi_query=True, parallel_attn=True,
                                 new_decoder_architecture=False),
    "phi": {}, "phi3": {}, "gemma": dict(head_dim=8),
    "gemma (multi-query)": dict(model_type="gemma", head_dim=8, num_key_value_heads=1),
    "gemma2": dict(head_dim=8), "gemma3_text": dict(head_dim=8),
    "gptj": dict(rotary_dim=4), "gpt_bigcode": dict(multi_query=True), "stablelm": {}, "cohere": {}, "olmo": {},
    "olmo2": {}, "granite": {}, "starcoder2": {}, "mpt": {}, "persimmon": {}, "glm": dict(head_dim=8),
    "deepseek_v2": {**_MLA, **_ROUTED}, "deepseek_v3": {**_MLA, **_ROUTED}, "jetmoe": {},
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64, head_dim=8),
    "smollm3": {}, "ernie4_5": {}, "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=8),
    "codegen": dict(rotary_dim=4), "xglm": {}, "helium": dict(head_dim=8), "exaone4": {}, "seed_oss": {},
    "apertus": {}, "bitnet": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "olmo3": {}, "nemotron": {}, "glm4_moe": {}, "lfm2": {}, "minimax": {}, "qwen3_next": {},
    # hybrids of attention and recurrent (Mamba, RG-LRU) mixers: the recurrent mixers stay whole
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=4, mamba_dt_rank=4),
    "zamba": {}, "nemotron_h": {}, "recurrent_gemma": {},
}
DROPOUTS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout", "dropout",
            "attention_probs_dropout_prob", "hidden_dropout_prob", "embed_dropout", "resid_dropout", "residual_dropout")


def build(name: str) -> nn.Module:
    """The family's causal LM from its tiny config, dropout off."""
    import transformers

    extra = dict(FAMILIES[name])
    config = transformers.AutoConfig.for_model(extra.pop("model_type", name), **{**COMMON, **extra})
    for key in DROPOUTS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return transformers.AutoModelForCausalLM.from_config(config)
