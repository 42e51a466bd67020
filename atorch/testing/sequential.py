"""A small nn.Sequential model and (input, target) data for the DeepSpeed pipeline path."""
from __future__ import annotations

import torch
from torch import nn

from atorch.auto.accelerate import auto_accelerate
from atorch.testing.training import global_mean
from atorch.utils.modules import full_state_dict


class TakeInput(nn.Module):
    """First layer: the batch is (input, target); the model consumes the input."""

    def forward(self, batch):
        return batch[0] if isinstance(batch, (tuple, list)) else batch


def tiny_sequential(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(TakeInput(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=generator)
        self.y = torch.randn(n, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def pair_loss(batch, output) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


def train_sequential(strategy, steps: int = 5, global_batch: int = 8) -> dict:
    status, result, _ = auto_accelerate(tiny_sequential(), torch.optim.SGD, PairDataset(global_batch * steps),
                                        pair_loss, optim_args={"lr": 0.1, "momentum": 0.9},
                                        dataloader_args={"batch_size": global_batch}, load_strategy=strategy)
    losses = []
    for batch in result.dataloader:
        batch = result.prepare_input(batch)
        loss = result.loss_func(batch, result.model(batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(global_mean(loss.detach().float()))
    return {"losses": losses, "weights": full_state_dict(result.model)}
