"""Small HF transformers models (no downloads) shaped like SMALL_GPT's data: vocab 64, seq 16.

Module-level builders so spawned ranks can unpickle them. ``hf_loss`` reads the loss the model
computes from ``labels`` (causal LMs shift them internally; BERT predicts them in place)."""
from __future__ import annotations

import torch


def tiny_gpt2() -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel._from_config(config)


def tiny_llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM._from_config(config)


def tiny_bert() -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.BertForMaskedLM._from_config(config)


HF_BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


def hf_loss(batch: dict, output) -> torch.Tensor:
    return output.loss
