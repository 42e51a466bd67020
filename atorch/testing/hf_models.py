"""The model zoo of the conformance matrix: tiny random-weight configs of the model families users
bring (no downloads), two plain PyTorch models written here, and transformers written the way
non-HF codebases write them (``atorch.testing.community_models``: nn.TransformerEncoder, a
torchtitan Llama, a timm ViT, nanoGPT, a lucidrains block, a parallel block, a Mixture of Experts).

Every entry is a ``ZooModel``: how to build it, what a batch looks like (``make_dataset``), how the
model is called (``input_format``, auto_accelerate's ``model_input_format``) and the loss. Builders
are module-level so spawned ranks can unpickle them. Token models share SMALL_GPT's data shape
(vocab 64, sequence 16); HF models compute their loss from ``labels`` (causal LMs shift them
internally; BERT predicts them in place) and ``hf_loss`` reads it.

Losses are per-sample means, so a global batch split over ranks or micro-batches gives the same
update: CLIP is trained on the paired-embedding similarity (its contrastive loss depends on the whole
batch, which no data-parallel method can keep), and the CNN's BatchNorm normalises per forward, so its
reference runs the per-rank chunks one after another (``norm_chunks``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from atorch.models import SyntheticTokenDataset
from atorch.testing.community_models import (
    MoELM,
    NanoGPT,
    ParallelLM,
    PerceiverLM,
    TimmViT,
    TitanLlama,
    TitanMoELM,
    TorchEncoderLM,
    UpDownMLP,
)
from atorch.testing.family_configs import FAMILIES, SEQ, VOCAB
from atorch.testing.family_configs import build as build_family


# --- HF families -----------------------------------------------------------------------------------
def tiny_gpt2(tie: bool = True) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel._from_config(config)


def tiny_gpt2_untied() -> nn.Module:
    return tiny_gpt2(tie=False)


def _decoder_config(cls_name: str, **extra: Any):
    import transformers

    sizes = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": SEQ, **extra}
    return getattr(transformers, cls_name)(bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
                                           **sizes)


def tiny_llama() -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM._from_config(_decoder_config("LlamaConfig"))


def tiny_qwen2() -> nn.Module:
    import transformers

    return transformers.Qwen2ForCausalLM._from_config(_decoder_config("Qwen2Config"))


def tiny_mistral() -> nn.Module:
    import transformers

    return transformers.MistralForCausalLM._from_config(_decoder_config("MistralConfig", sliding_window=None))


def tiny_qwen3() -> nn.Module:
    """Qwen3: an RMSNorm over each head's features on the query and key (tensor_parallel's per-head norms)."""
    import transformers

    return transformers.Qwen3ForCausalLM._from_config(_decoder_config("Qwen3Config", head_dim=8))


def tiny_neox() -> nn.Module:
    """GPT-NeoX (Pythia): one query_key_value projection laid out head by head, parallel attention and MLP,
    rotary on a quarter of each head."""
    import transformers

    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout=0.0,
                                        attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoXForCausalLM._from_config(config)


def tiny_mixtral() -> nn.Module:
    """Mixtral: a sparse MoE layer (router, and experts held as 3-D parameters, which tensor_parallel splits by
    expert)."""
    import transformers

    return transformers.MixtralForCausalLM._from_config(
        _decoder_config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, sliding_window=None))


def tiny_bloom() -> nn.Module:
    """BLOOM: ALiBi attention scores through ``alibi.baddbmm(q, k)`` with the batch and the heads merged
    (the bias built once for every head, outside the blocks); its attention adds the residual itself."""
    import transformers

    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0,
                                      attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.BloomForCausalLM._from_config(config)


def tiny_opt() -> nn.Module:
    """OPT: learned positions, and its layers flatten the stream to [batch x tokens, hidden] around the MLP."""
    import transformers

    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.OPTForCausalLM._from_config(config)


def tiny_bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.BertForMaskedLM._from_config(config)


def tiny_t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration._from_config(config)


def tiny_vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=4,
                                    num_attention_heads=4, intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification._from_config(config)


def tiny_clip() -> nn.Module:
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    vision = dict(image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel._from_config(config)


# --- plain PyTorch models --------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """Called as ``model(x)``: a Linear input layer, residual blocks, a Linear head."""

    def __init__(self, in_dim: int = 32, dim: int = 64, depth: int = 4, out_dim: int = 8):
        super().__init__()
        self.input = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(ResidualBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """Called as ``model(images)``: a stem, residual Conv / BatchNorm / ReLU blocks, pooling, a head."""

    def __init__(self, channels: int = 8, depth: int = 4, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.layers = nn.Sequential(*(ConvBlock(channels) for _ in range(depth)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(images))), 1))


# --- data and losses -------------------------------------------------------------------------------
class RowsDataset(Dataset):
    """Fixed rows generated from a seed (a dict per row, or a tensor per row)."""

    def __init__(self, rows: list):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


def token_dataset(num_samples: int, seed: int = 0) -> Dataset:
    return SyntheticTokenDataset(num_samples=num_samples, seq_len=SEQ, vocab_size=VOCAB, seed=seed)


def token_rows_dataset(num_samples: int, seed: int = 0) -> Dataset:
    """token_dataset's sequences as bare tensor rows: a batch is the (batch, SEQ) token tensor that
    ``model(tokens)`` takes (the community token models)."""
    return RowsDataset(list(token_dataset(num_samples, seed).inputs))


def t5_dataset(num_samples: int, seed: int = 0) -> Dataset:
    tokens = token_dataset(num_samples, seed)
    return RowsDataset([{"input_ids": tokens.inputs[i], "labels": tokens.labels[i, : SEQ // 2].flip(0)}
                        for i in range(num_samples)])


def image_dataset(num_samples: int, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, 16, 16, generator=generator)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, 0].mean(dim=(1, 2)) > 0).long()
    return RowsDataset([{"pixel_values": images[i], "labels": labels[i]} for i in range(num_samples)])


def clip_dataset(num_samples: int, seed: int = 0) -> Dataset:
    tokens, images = token_dataset(num_samples, seed), image_dataset(num_samples, seed)
    return RowsDataset([{"input_ids": tokens.inputs[i], "pixel_values": images[i]["pixel_values"]}
                        for i in range(num_samples)])


def vector_dataset(num_samples: int, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    return RowsDataset(list(torch.randn(num_samples, 32, generator=generator)))


def picture_dataset(num_samples: int, seed: int = 0) -> Dataset:
    return RowsDataset([row["pixel_values"] for row in image_dataset(num_samples, seed)])


def hf_loss(batch: dict, output) -> torch.Tensor:
    return output.loss


def clip_pair_loss(batch: dict, output) -> torch.Tensor:
    """Per-sample: raise each image's scaled similarity to its own caption (the diagonal of CLIP's
    logits, which uses every parameter, logit_scale included)."""
    return -torch.diagonal(output.logits_per_image).mean() / 10


def next_token_loss(batch: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits at each position against the next token of the row (every row has
    the same number of predicted tokens, so the mean over tokens is the mean of per-sample means)."""
    logits = output[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def mlp_loss(batch: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Regress the first 8 input features, squared (a target the MLP can learn)."""
    return ((output - batch[:, :8].pow(2)) ** 2).mean()


def cnn_loss(batch: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    labels = (batch.mean(dim=(1, 2, 3)) > 0).long() + 2 * (batch[:, 0].mean(dim=(1, 2)) > 0).long()
    return torch.nn.functional.cross_entropy(output, labels)


# --- the zoo ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], nn.Module]
    make_dataset: Callable[[int, int], Dataset]
    loss_func: Callable
    input_format: Optional[str]
    block: str                  # the repeated block class (checkpoint / fsdp wrap class)
    kind: str                   # decoder, encoder, encoder-decoder, vision, multimodal, plain
    norm_chunks: bool = False   # BatchNorm: statistics per forward, so the reference runs per-rank chunks
    hf: bool = True

    @property
    def transformer(self) -> bool:
        return self.kind != "plain"


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("gpt2", tiny_gpt2, token_dataset, hf_loss, "unpack_dict", "GPT2Block", "decoder"),
    ZooModel("gpt2_untied", tiny_gpt2_untied, token_dataset, hf_loss, "unpack_dict", "GPT2Block", "decoder"),
    ZooModel("llama", tiny_llama, token_dataset, hf_loss, "unpack_dict", "LlamaDecoderLayer", "decoder"),
    ZooModel("qwen2", tiny_qwen2, token_dataset, hf_loss, "unpack_dict", "Qwen2DecoderLayer", "decoder"),
    ZooModel("mistral", tiny_mistral, token_dataset, hf_loss, "unpack_dict", "MistralDecoderLayer", "decoder"),
    ZooModel("qwen3", tiny_qwen3, token_dataset, hf_loss, "unpack_dict", "Qwen3DecoderLayer", "decoder"),
    ZooModel("neox", tiny_neox, token_dataset, hf_loss, "unpack_dict", "GPTNeoXLayer", "decoder"),
    ZooModel("mixtral", tiny_mixtral, token_dataset, hf_loss, "unpack_dict", "MixtralDecoderLayer", "decoder"),
    ZooModel("bloom", tiny_bloom, token_dataset, hf_loss, "unpack_dict", "BloomBlock", "decoder"),
    ZooModel("opt", tiny_opt, token_dataset, hf_loss, "unpack_dict", "OPTDecoderLayer", "decoder"),
    ZooModel("bert", tiny_bert, token_dataset, hf_loss, "unpack_dict", "BertLayer", "encoder"),
    ZooModel("t5", tiny_t5, t5_dataset, hf_loss, "unpack_dict", "T5Block", "encoder-decoder"),
    ZooModel("vit", tiny_vit, image_dataset, hf_loss, "unpack_dict", "ViTLayer", "vision"),
    ZooModel("clip", tiny_clip, clip_dataset, clip_pair_loss, "unpack_dict", "CLIPEncoderLayer", "multimodal"),
    ZooModel("mlp", ResidualMLP, vector_dataset, mlp_loss, None, "ResidualBlock", "plain", hf=False),
    ZooModel("cnn", SmallResNet, picture_dataset, cnn_loss, None, "ConvBlock", "plain", norm_chunks=True, hf=False),
    # written like non-HF codebases (atorch.testing.community_models); token models take model(tokens)
    ZooModel("torch_encoder", TorchEncoderLM, token_rows_dataset, next_token_loss, None, "TransformerEncoderLayer",
             "decoder", hf=False),
    ZooModel("titan_llama", TitanLlama, token_rows_dataset, next_token_loss, None, "TransformerBlock", "decoder",
             hf=False),
    ZooModel("timm_vit", TimmViT, picture_dataset, cnn_loss, None, "Block", "vision", hf=False),
    ZooModel("nanogpt", NanoGPT, token_rows_dataset, next_token_loss, None, "NanoBlock", "decoder", hf=False),
    ZooModel("perceiver_block", PerceiverLM, token_rows_dataset, next_token_loss, None, "PerceiverBlock", "decoder",
             hf=False),
    ZooModel("parallel_block", ParallelLM, token_rows_dataset, next_token_loss, None, "ParallelBlock", "decoder",
             hf=False),
    ZooModel("moe", MoELM, token_rows_dataset, next_token_loss, None, "MoEBlock", "decoder", hf=False),
    ZooModel("titan_moe", TitanMoELM, token_rows_dataset, next_token_loss, None, "TransformerBlock", "decoder",
             hf=False),
    ZooModel("mlp_updown", UpDownMLP, vector_dataset, mlp_loss, None, "UpDownBlock", "plain", hf=False),
)}



def tiny_qwen2_moe() -> nn.Module:
    """Qwen2-MoE: stacked expert banks beside a shared expert with its own sigmoid gate."""
    import transformers

    return transformers.Qwen2MoeForCausalLM._from_config(_decoder_config(
        "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[]))


def tiny_qwen3_moe() -> nn.Module:
    """Qwen3-MoE: stacked expert banks, per-head q / k norms."""
    import transformers

    return transformers.Qwen3MoeForCausalLM._from_config(_decoder_config(
        "Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[]))


def tiny_olmoe() -> nn.Module:
    """OLMoE: stacked expert banks, q / k norms over the whole projection."""
    import transformers

    return transformers.OlmoeForCausalLM._from_config(_decoder_config("OlmoeConfig", num_experts=4,
                                                                     num_experts_per_tok=2))


def tiny_olmo2() -> nn.Module:
    """OLMo 2: q / k RMSNorms over every head's features (the whole projection), norms after the
    attention and the MLP."""
    import transformers

    return transformers.Olmo2ForCausalLM._from_config(_decoder_config("Olmo2Config"))


def tiny_cohere() -> nn.Module:
    """Cohere (Command R): q / k LayerNorms over each head's features with a weight per head and feature
    ([heads, head size]), the attention and the MLP in parallel on one norm's output, logits scaled."""
    import transformers

    return transformers.CohereForCausalLM._from_config(_decoder_config("CohereConfig", use_qk_norm=True))


def tiny_bitnet() -> nn.Module:
    """BitNet b1.58 (unquantised): Llama's layout with an RMSNorm over the attention's whole output before
    ``o_proj`` (``attn_sub_norm``) and one over the MLP's product before ``down_proj`` (``ffn_sub_norm``)."""
    import transformers

    return transformers.BitNetForCausalLM._from_config(_decoder_config("BitNetConfig"))


def tiny_apertus() -> nn.Module:
    """Apertus: Llama's layout with an MLP of up / down projections around xIELU, an activation with two
    learned scalar parameters (and constant buffers) applied to every feature."""
    import transformers

    return transformers.ApertusForCausalLM._from_config(_decoder_config("ApertusConfig"))


def tiny_mpt() -> nn.Module:
    """MPT: ALiBi, a position bias built once for every head ([heads, 1, keys]) and added to each
    attention's scores, a fused Wqkv."""
    import transformers

    config = transformers.MptConfig(n_layers=4, d_model=32, n_heads=4, expansion_ratio=2, vocab_size=VOCAB,
                                    max_seq_len=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.MptForCausalLM._from_config(config)


def tiny_jamba() -> nn.Module:
    """Jamba: Mamba and attention layers of two classes alternating in one ``model.layers`` list (every
    second layer's MLP a Mixture-of-Experts): the pipeline's blocks are all the list's layers."""
    import transformers

    return transformers.JambaForCausalLM._from_config(_decoder_config(
        "JambaConfig", attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=4, mamba_dt_rank=4))


def tiny_llama4() -> nn.Module:
    """Llama 4's text model: a bank called with every expert's rows (each token repeated per expert,
    scaled by its score) beside a shared expert, complex-valued rotary embeddings, per-head L2 q / k
    norms, and layers without rotary embeddings that scale the queries by position."""
    import transformers

    config = _decoder_config("Llama4TextConfig", num_local_experts=4, num_experts_per_tok=1,
                             intermediate_size_mlp=64, head_dim=8)
    return transformers.Llama4ForCausalLM._from_config(config)


def tiny_deepseek_v3() -> nn.Module:
    """DeepSeek-V3: multi-head latent attention (queries and keys / values through low-rank latents,
    one rotary key head shared by all heads, keys assembled by copies into slices) and routed experts
    beside a shared one after a first dense layer. Sizes chosen so that head counts and per-head widths
    coincide (4 heads, 4 rotary and 4 non-rotary features a head), as real ones can."""
    import transformers

    config = _decoder_config("DeepseekV3Config", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1)
    return transformers.DeepseekV3ForCausalLM._from_config(config)


def tiny_gemma_mqa() -> nn.Module:
    """Gemma with one key / value head (multi-query attention, as Gemma 2B and Gemma 3 1B), in separate
    projections: the query heads split, the key / value projections whole."""
    import transformers

    return transformers.GemmaForCausalLM._from_config(_decoder_config("GemmaConfig", num_key_value_heads=1,
                                                                      head_dim=8))


def tiny_starcoder() -> nn.Module:
    """GPTBigCode (StarCoder, SantaCoder): multi-query attention in one fused projection, [q | k | v] with
    one key / value head; the attention stays whole, the MLP splits."""
    import transformers

    config = transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                                           multi_query=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPTBigCodeForCausalLM._from_config(config)


def tiny_phi3() -> nn.Module:
    """Phi-3 (Phi-3.5, Phi-4-mini): one fused [q | k | v] projection with grouped keys / values (4 query, 2
    key / value heads: unequal parts), cut by slices whose bounds its code computes from the full head
    counts (``qkv[..., query_pos:query_pos + kv_width]``), and one fused [gate | up] MLP input."""
    import transformers

    return transformers.Phi3ForCausalLM._from_config(_decoder_config("Phi3Config", resid_pdrop=0.0, embd_pdrop=0.0,
                                                                     attention_dropout=0.0))


def tiny_swin() -> nn.Module:
    """Swin: windowed attention with a learned relative position bias table per layer, [relative positions,
    heads], indexed and added to each head's scores; two stages of 2 and 4 heads with patch merging."""
    import transformers

    config = transformers.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2],
                                     num_heads=[2, 4], window_size=4, num_labels=4, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return transformers.SwinForImageClassification._from_config(config)


def tiny_falcon() -> nn.Module:
    """Falcon-7B: multi-query attention in one fused [q | k | v] projection, the attention and the MLP in
    parallel on one LayerNorm's output."""
    import transformers

    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                       multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                       alibi=False, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.FalconForCausalLM._from_config(config)


def tiny_falcon40() -> nn.Module:
    """Falcon-40B (its new decoder architecture): grouped keys / values in one fused projection laid out
    group by group ([q q k v] per group), a LayerNorm for each of the two parallel branches."""
    import transformers

    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                       num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, alibi=False,
                                       bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.FalconForCausalLM._from_config(config)


def tiny_gptj() -> nn.Module:
    """GPT-J: rotary embeddings on part of each head (rotary_dim), interleaved, and the attention and the
    MLP in parallel on one LayerNorm's output."""
    import transformers

    config = transformers.GPTJConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, rotary_dim=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)
    return transformers.GPTJForCausalLM._from_config(config)


def tiny_codegen() -> nn.Module:
    """CodeGen: one fused qkv projection laid out in 4 blocks of [q | v | k] (mp_num 4, as its model
    parallel training wrote it), partial rotary."""
    import transformers

    config = transformers.CodeGenConfig(vocab_size=VOCAB, n_positions=SEQ, n_ctx=SEQ, n_embd=32, n_layer=4, n_head=4,
                                        rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.CodeGenForCausalLM._from_config(config)


def tiny_gemma2() -> nn.Module:
    """Gemma 2: soft-capped attention scores and logits, sliding-window layers alternating with global
    ones, norms before and after the attention and the MLP, queries scaled by query_pre_attn_scalar."""
    import transformers

    return transformers.Gemma2ForCausalLM._from_config(_decoder_config(
        "Gemma2Config", head_dim=8, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=8))


def tiny_stablelm() -> nn.Module:
    """StableLM 2: rotary embeddings on half of each head, q / k / v biases, a LayerNorm per head on the
    queries and the keys (a weight per head and feature)."""
    import transformers

    return transformers.StableLmForCausalLM._from_config(_decoder_config(
        "StableLmConfig", partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0))


def tiny_starcoder2() -> nn.Module:
    """StarCoder2: grouped keys / values, a plain MLP with biases (c_fc / c_proj), a sliding window."""
    import transformers

    return transformers.Starcoder2ForCausalLM._from_config(_decoder_config(
        "Starcoder2Config", sliding_window=8, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0))


def tiny_phi() -> nn.Module:
    """Phi-2: the attention and the MLP in parallel on one LayerNorm, rotary on half of each head, the
    attention's output projection called ``dense``."""
    import transformers

    return transformers.PhiForCausalLM._from_config(_decoder_config(
        "PhiConfig", num_key_value_heads=4, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0))


def tiny_gpt_neo() -> nn.Module:
    """GPT-Neo: global and local (windowed) attention layers alternating, unscaled attention scores."""
    import transformers

    config = transformers.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32, num_layers=4,
                                       num_heads=4, attention_types=[[["global", "local"], 2]], window_size=8,
                                       resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                                       eos_token_id=0, pad_token_id=0)
    return transformers.GPTNeoForCausalLM._from_config(config)


def tiny_granite() -> nn.Module:
    """Granite: Llama's layout with scalar multipliers on the embedding, the residual branches, the
    attention scores and the logits."""
    import transformers

    return transformers.GraniteForCausalLM._from_config(_decoder_config(
        "GraniteConfig", embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125,
        logits_scaling=8.0))


def tiny_deberta() -> nn.Module:
    """DeBERTa-v3 (disentangled attention, its key / query projections shared with the relative
    positions): its attention block holds the self-attention module whose ``num_attention_heads`` the
    code reads to view the projections as heads."""
    import transformers

    config = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                          intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                          relative_attention=True,
                                          position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                                          share_att_key=True, norm_rel_ebd="layer_norm", hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.DebertaV2ForMaskedLM._from_config(config)


def tiny_gpt_oss() -> nn.Module:
    """gpt-oss: a learned sink logit per head joined to the attention scores, expert banks with biases
    (2-D beside the 3-D weights) whose eager kernel one-hot encodes over its own expert count, sliding
    and full attention layers alternating."""
    import transformers

    config = _decoder_config("GptOssConfig", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                             sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    return transformers.GptOssForCausalLM._from_config(config)


def tiny_roberta() -> nn.Module:
    """RoBERTa (and XLM-R): its LM head's bias is held twice, by the head and by its decoder
    (``self.decoder.bias = self.bias``), the decoder tied to the token embedding."""
    import transformers

    config = transformers.RobertaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ + 4,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                                        bos_token_id=0,
                                        eos_token_id=0)
    return transformers.RobertaForMaskedLM._from_config(config)


def tiny_modernbert() -> nn.Module:
    """ModernBERT: its MLP's one input Linear computes [input | gate] (``Wi(x).chunk(2, -1)``), its attention
    one fused [q | k | v], local and global attention layers alternating."""
    import transformers

    config = transformers.ModernBertConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                                           num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                           global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                                           bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
                                           attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0)
    return transformers.ModernBertForMaskedLM._from_config(config)


# transformers' other families, MoE most of them, trained by the tests that name them (tensor_parallel's
# expert banks, multi-head latent attention, norms over a split projection); kept out of ZOO, whose every
# model the conformance matrix runs, for the suite's time
MORE_MOE: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("qwen2_moe", tiny_qwen2_moe, token_dataset, hf_loss, "unpack_dict", "Qwen2MoeDecoderLayer", "decoder"),
    ZooModel("qwen3_moe", tiny_qwen3_moe, token_dataset, hf_loss, "unpack_dict", "Qwen3MoeDecoderLayer", "decoder"),
    ZooModel("olmoe", tiny_olmoe, token_dataset, hf_loss, "unpack_dict", "OlmoeDecoderLayer", "decoder"),
    ZooModel("olmo2", tiny_olmo2, token_dataset, hf_loss, "unpack_dict", "Olmo2DecoderLayer", "decoder"),
    ZooModel("cohere", tiny_cohere, token_dataset, hf_loss, "unpack_dict", "CohereDecoderLayer", "decoder"),
    ZooModel("bitnet", tiny_bitnet, token_dataset, hf_loss, "unpack_dict", "BitNetDecoderLayer", "decoder"),
    ZooModel("apertus", tiny_apertus, token_dataset, hf_loss, "unpack_dict", "ApertusDecoderLayer", "decoder"),
    ZooModel("mpt", tiny_mpt, token_dataset, hf_loss, "unpack_dict", "MptBlock", "decoder"),
    ZooModel("jamba", tiny_jamba, token_dataset, hf_loss, "unpack_dict", "JambaAttentionDecoderLayer", "decoder"),
    ZooModel("llama4", tiny_llama4, token_dataset, hf_loss, "unpack_dict", "Llama4TextDecoderLayer", "decoder"),
    ZooModel("deepseek_v3", tiny_deepseek_v3, token_dataset, hf_loss, "unpack_dict", "DeepseekV3DecoderLayer",
             "decoder"),
    ZooModel("gemma_mqa", tiny_gemma_mqa, token_dataset, hf_loss, "unpack_dict", "GemmaDecoderLayer", "decoder"),
    ZooModel("gpt_oss", tiny_gpt_oss, token_dataset, hf_loss, "unpack_dict", "GptOssDecoderLayer", "decoder"),
    ZooModel("roberta", tiny_roberta, token_dataset, hf_loss, "unpack_dict", "RobertaLayer", "encoder"),
    ZooModel("modernbert", tiny_modernbert, token_dataset, hf_loss, "unpack_dict", "ModernBertEncoderLayer", "encoder"),
    ZooModel("starcoder", tiny_starcoder, token_dataset, hf_loss, "unpack_dict", "GPTBigCodeBlock", "decoder"),
    ZooModel("phi3", tiny_phi3, token_dataset, hf_loss, "unpack_dict", "Phi3DecoderLayer", "decoder"),
    ZooModel("swin", tiny_swin, image_dataset, hf_loss, "unpack_dict", "SwinLayer", "vision"),
    ZooModel("deberta", tiny_deberta, token_dataset, hf_loss, "unpack_dict", "DebertaV2Layer", "encoder"),
    # timm's grad_checkpointing: the blocks' nn.Sequential is iterated (checkpoint_seq), never called
    ZooModel("timm_vit_checkpoint_seq", functools.partial(TimmViT, grad_checkpointing=True), picture_dataset,
             cnn_loss, None, "Block", "vision", hf=False),
)}


# transformers' families beyond the zoo and MORE_MOE (parallel attention and MLP, fused and grouped
# projections laid out otherwise, partial rotary, soft-capping, multipliers, per-head norm modules):
# the conformance test runs the structure-derived columns on them (tests/methods/test_conformance.py)
MORE_FAMILIES: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("falcon", tiny_falcon, token_dataset, hf_loss, "unpack_dict", "FalconDecoderLayer", "decoder"),
    ZooModel("falcon40", tiny_falcon40, token_dataset, hf_loss, "unpack_dict", "FalconDecoderLayer", "decoder"),
    ZooModel("gptj", tiny_gptj, token_dataset, hf_loss, "unpack_dict", "GPTJBlock", "decoder"),
    ZooModel("codegen", tiny_codegen, token_dataset, hf_loss, "unpack_dict", "CodeGenBlock", "decoder"),
    ZooModel("gemma2", tiny_gemma2, token_dataset, hf_loss, "unpack_dict", "Gemma2DecoderLayer", "decoder"),
    ZooModel("stablelm", tiny_stablelm, token_dataset, hf_loss, "unpack_dict", "StableLmDecoderLayer", "decoder"),
    ZooModel("starcoder2", tiny_starcoder2, token_dataset, hf_loss, "unpack_dict", "Starcoder2DecoderLayer",
             "decoder"),
    ZooModel("phi", tiny_phi, token_dataset, hf_loss, "unpack_dict", "PhiDecoderLayer", "decoder"),
    ZooModel("gpt_neo", tiny_gpt_neo, token_dataset, hf_loss, "unpack_dict", "GPTNeoBlock", "decoder"),
    ZooModel("granite", tiny_granite, token_dataset, hf_loss, "unpack_dict", "GraniteDecoderLayer", "decoder"),
)}


# every family of atorch.testing.family_configs (the tensor-parallel share table's) as a zoo row
# "family:<model_type>", for the structure-derived tensor-parallel columns only (their block class, which
# the checkpoint and fsdp columns wrap, is not named here)
FAMILY_MODELS: dict[str, ZooModel] = {
    f"family:{name}": ZooModel(f"family:{name}", functools.partial(build_family, name), token_dataset, hf_loss,
                               "unpack_dict", "", "decoder")
    for name in FAMILIES}


def zoo_model(name: str) -> ZooModel:
    """A model of ZOO, MORE_MOE, MORE_FAMILIES or FAMILY_MODELS."""
    for table in (ZOO, MORE_MOE, MORE_FAMILIES):
        if name in table:
            return table[name]
    return FAMILY_MODELS[name]


# the names earlier tests use
HF_BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}
