"""What the ranks of a tensor group must agree on: the weights they start from and the random numbers
they draw.

The ranks of a tensor group each compute a share of one model on the same tokens.

**Weights.** Each rank builds the user's model itself; a script that seeds each process apart before
building it, as nanoGPT does (``torch.manual_seed(1337 + rank)``), gives every rank another random
model. The split projections are scattered from the group's first rank (DTensor's default), but the
parts kept whole (norms, position embeddings, biases of row-wise projections) would stay each rank's
own, and the plan check, which compares the split model with each rank's unsplit one, refused a plan
that is right. So before the plan is found, every rank takes the group's first rank's parameters and
buffers (one broadcast each; tensors on the meta device, not yet materialised, are skipped), as DDP
takes its first rank's at construction.

**Random numbers.** The parts they hold whole (embeddings' and residual dropout, timm's drop-path, a
router's jitter noise) must come out the same on every rank, or their copies of the replicated
activations (and through them the replicated weights) drift apart with no error. So before every
forward of the split model in training, each rank of the group takes the random-number generator
state of the group's first rank (the CPU generator, and the CUDA device's where the model runs
there): one broadcast of a few kilobytes over the tensor group. Ranks of other groups (data,
pipeline) keep their own streams.

Inside the split parts (dropout on a rank's own heads, or on its own tokens under sequence parallelism)
the ranks then draw the same mask for their different shares: each element is still dropped with the
configured probability, but the masks of heads (tokens) at the same local position are alike.
Megatron-LM's RNG tracker draws those from a stream per rank; that is not done here.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def share_initial_weights(module: nn.Module, tp_mesh) -> None:
    """Every rank of the tensor group takes the group's first rank's parameters and buffers (those
    not on the meta device and not yet DTensors)."""
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.device.type == "meta" or isinstance(tensor, DTensor):
                continue
            received = _broadcast(tensor.data, group, source, tp_mesh.device_type)
            if received is not tensor.data:
                tensor.data.copy_(received)


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


def _broadcast(tensor: torch.Tensor, group, source: int, device_type: str) -> torch.Tensor:
    """``tensor`` as the source rank holds it (in place where it is a contiguous tensor on the group's
    backend's device, else carried there and back)."""
    carried = tensor if tensor.device.type == device_type and tensor.is_contiguous() else \
        tensor.contiguous().to(device_type)
    dist.broadcast(carried, src=source, group=group)
    return carried if carried is tensor else carried.to(tensor.device)


def _cuda_device(module: nn.Module):
    """The CUDA device the module's first parameter is on, or None."""
    param = next(module.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    return param.device
