"""Tensor-parallel ranks draw the same random numbers.

The ranks of a tensor group each compute a share of one model on the same tokens: the parts they
hold whole (embeddings' and residual dropout, timm's drop-path, a router's jitter noise) must come out
the same on every rank, or their copies of the replicated activations (and through them the
replicated weights: norms, biases, position embeddings) drift apart with no error. A script that seeds
each process apart, as nanoGPT does (``torch.manual_seed(1337 + rank)``), would do exactly that. So
before every forward of the split model, each rank of the group takes the random-number generator state
of the group's first rank (the CPU generator, and the CUDA device's where the model runs there): one
broadcast of a few kilobytes over the tensor group. Ranks of other groups (data, pipeline) keep their
own streams.

Inside the split parts (dropout on a rank's own heads, or on its own tokens under sequence parallelism)
the ranks then draw the same mask for their different shares: each element is still dropped with the
configured probability, but the masks of heads (tokens) at the same local position are alike.
Megatron-LM's RNG tracker draws those from a stream per rank; that is not done here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def share_random_state(module: nn.Module, tp_mesh) -> None:
    """Before each forward of ``module`` in training mode, every rank of the tensor group takes the
    group's first rank's generator states."""
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    device_type = tp_mesh.device_type

    def same_state(mod: nn.Module, args: tuple) -> None:
        if mod.training:
            cuda = _cuda_device(mod)
            torch.set_rng_state(_broadcast(torch.get_rng_state(), group, source, device_type))
            if cuda is not None:
                torch.cuda.set_rng_state(_broadcast(torch.cuda.get_rng_state(cuda), group, source, device_type), cuda)

    module.register_forward_pre_hook(same_state)


def _broadcast(state: torch.Tensor, group, source: int, device_type: str) -> torch.Tensor:
    """``state`` (a CPU byte tensor) as the source rank holds it, through the group's backend's device."""
    carried = state.to(device_type) if device_type != "cpu" else state.clone()
    dist.broadcast(carried, src=source, group=group)
    return carried.cpu()


def _cuda_device(module: nn.Module):
    """The CUDA device the module's first parameter is on, or None."""
    param = next(module.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    return param.device
