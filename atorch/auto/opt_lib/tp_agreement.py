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

Inside the split parts (dropout on a rank's own heads, between a column-wise projection and its
row-wise one) a shared stream would give each rank the same mask for its different heads: heads at the
same local position would be dropped alike. So, as Megatron-LM's RNG tracker does, a split part draws
from a stream of each rank's own: where the first column-wise projection's output appears, every rank
draws one seed from the shared stream (the same on all ranks), puts the shared state aside and seeds
its generator with that seed plus its tensor rank; at the row-wise projection's input (or at the end of
the module holding the split, whichever comes first) the shared state comes back (as before the seed
was drawn where the part drew nothing: a model with no random numbers in its split parts, such as one
whose dropout is only on embeddings and residual branches, draws exactly what one process draws). Activation
checkpointing's recomputation restores the shared state it started from, so it draws the same masks.

Tokens split by sequence parallelism are a rank's own too: between a region's first block (where the
hidden states are cut into sequence shards) and its last block's output (where they are gathered) the
residual stream's dropout acts on this rank's tokens, so it draws from a stream of the rank's own in
the same way (Megatron-LM forks its tracker there under sequence parallelism); before, token i of rank
0 and token i of rank 1 were dropped alike. Modules the region runs whole (a gathered attention or
MoE layer whose output is cut back to this rank's tokens) draw from it too: each token's output is
computed with its own rank's numbers, and only that rank keeps it. Not done: code compiled by
native_dynamo with scope "model" (its graphs keep the shared stream; compiled blocks are entered and
left outside their graphs).
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

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
    group's first rank's generator states (and leaves any split part an earlier forward did not
    leave, one that raised)."""
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    device_type = tp_mesh.device_type

    def same_state(mod: nn.Module, args: tuple) -> None:
        if mod.training:
            for streams in getattr(mod, OWN_STREAMS_ATTR, ()):
                streams.shared = None
            cuda = _cuda_device(mod)
            torch.set_rng_state(_broadcast(torch.get_rng_state(), group, source, device_type))
            if cuda is not None:
                torch.cuda.set_rng_state(_broadcast(torch.cuda.get_rng_state(cuda), group, source, device_type), cuda)

    module.register_forward_pre_hook(same_state)


OWN_STREAMS_ATTR = "_atorch_own_streams"


class OwnStream:
    """Which stream a rank draws from: the tensor group's shared one, or (inside a split part, or on a
    sequence shard) its own. While such a part runs, ``shared`` holds the states to return to: as they
    were before the part's seed was drawn, and after. Parts nest (a split part inside a sequence-sharded
    region): each returns to the stream it was entered from."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.shared: Optional[tuple] = None

    def enter(self, module: nn.Module, args: tuple, output) -> None:
        if not module.training or self.shared is not None or torch.compiler.is_compiling():
            return
        cuda = _cuda_device(module)
        before = _states(cuda)
        seed = int(torch.randint(0, 2 ** 62, (1,))) + self.tp_rank  # the shared stream's draw, plus the rank
        after_seed = _states(cuda)
        torch.default_generator.manual_seed(seed)
        if cuda is not None:
            torch.cuda.default_generators[cuda.index].manual_seed(seed)
        self.shared = (cuda, before, after_seed, _states(cuda))

    def enter_before(self, module: nn.Module, args: tuple) -> None:
        """``enter`` as a forward pre-hook (a bound method, so a deep copy of the model hooks its own copy)."""
        self.enter(module, args, None)

    def leave(self, *_: Any) -> None:
        """Back to the shared stream: past the part's seed where the part drew random numbers, else as
        if the part had not been entered (a model whose split parts draw nothing draws exactly what one
        process draws)."""
        if self.shared is None or torch.compiler.is_compiling():
            return
        cuda, before, after_seed, seeded = self.shared
        self.shared = None
        drew = any(not torch.equal(now, then) for now, then in zip(_states(cuda), seeded))
        cpu_state, *cuda_state = after_seed if drew else before
        torch.set_rng_state(cpu_state)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda_state[0], cuda)


def _states(cuda) -> tuple:
    """The CPU generator's state, and the CUDA device's where the model runs there."""
    return (torch.get_rng_state(),) + ((torch.cuda.get_rng_state(cuda),) if cuda is not None else ())


def draw_apart_in_split_parts(model: nn.Module, colwise: list[nn.Module], rowwise: list[nn.Module],
                              regions: list[nn.Module], tp_rank: int) -> None:
    """Random numbers drawn between a column-wise projection's output and the row-wise projection's
    input come from a stream of each rank's own (see the module's docstring); ``model`` is the module
    ``share_random_state`` hooks, which resets them each forward."""
    streams = _own_stream(model, tp_rank)
    for module in colwise:
        module.register_forward_hook(streams.enter)
    for module in rowwise:
        module.register_forward_pre_hook(streams.leave)
    for module in regions:
        module.register_forward_hook(streams.leave)


def draw_apart_on_token_shards(model: nn.Module, regions: list[tuple[nn.Module, nn.Module]], tp_rank: int) -> None:
    """Random numbers drawn between each sequence-parallel region's first block's input and its last block's
    output come from a stream of each rank's own (see the module's docstring). ``regions``: (first block, last
    block) of each region."""
    streams = _own_stream(model, tp_rank)
    for first, last in regions:
        first.register_forward_pre_hook(streams.enter_before)
        last.register_forward_hook(streams.leave)


def _own_stream(model: nn.Module, tp_rank: int) -> OwnStream:
    """A new ``OwnStream`` that ``share_random_state``'s hook on ``model`` resets before each forward."""
    streams = OwnStream(tp_rank)
    setattr(model, OWN_STREAMS_ATTR, [*getattr(model, OWN_STREAMS_ATTR, ()), streams])
    return streams


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
