"""Small reference models for examples, tests and benchmarks."""
from atorch.models.gpt import GPT, GPTBlock, GPTConfig, SyntheticTokenDataset, gpt_loss

__all__ = ["GPT", "GPTBlock", "GPTConfig", "SyntheticTokenDataset", "gpt_loss"]
