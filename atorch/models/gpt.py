"""A small GPT-style causal language model for examples, tests and benchmarks.

Deliberately plain PyTorch (separate q/k/v projections, SDPA attention, pre-norm blocks) so that
every method can be checked on it, and sized by a dataclass so tests stay fast on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    tie_weights: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, S, E) -> (B, H, S, D); -1 keeps TP-sharded widths working
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = self.attend(q, k, v, dropout=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        """Causal attention core on (B, H, S, D) tensors (module_replace swaps in atorch's dispatch)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: Optional[GPTConfig] = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_loss(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; matches the seed's ``loss_func(input, output)`` signature."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


class SyntheticTokenDataset(Dataset):
    """Token sequences with learnable structure (noisy arithmetic progressions mod vocab), so a
    falling loss shows real learning; generated from a seed, no files or downloads."""

    def __init__(self, num_samples: int = 256, seq_len: int = 32, vocab_size: int = 128, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
        stride = torch.randint(1, 4, (num_samples, 1), generator=generator)
        tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        noise = torch.rand(tokens.shape, generator=generator) < 0.05
        tokens = torch.where(noise, torch.randint(0, vocab_size, tokens.shape, generator=generator), tokens)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.inputs[index], "labels": self.labels[index]}
