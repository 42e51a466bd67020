"""ModelProfile: what the search needs to know about a model, found without training it.

Static facts come from the module tree (parameter bytes, trainable share, the repeated blocks that
make natural checkpoint / sharding units, attention / linear / norm counts). FLOPs per sample come
from one forward + backward on the meta device (``FlopCounterMode`` over ``functional_call`` with
meta parameters: no memory, no compute), when the model and loss allow it.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from atorch.utils.batch import batch_size_of, to_meta
from atorch.utils.modules import layer_types, repeated_blocks

logger = logging.getLogger(__name__)

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass
class ModelProfile:
    param_count: int
    param_bytes: int
    trainable_count: int
    trainable_bytes: int
    buffer_bytes: int
    repeated_blocks: dict[str, int]          # class name -> count, largest repeated unit first
    block_param_bytes: dict[str, int]         # class name -> parameter bytes of one block
    module_counts: dict[str, int]             # attention / linear / norm / embedding
    flops_per_sample: Optional[float] = None  # forward + backward
    signature: str = ""                       # structure hash: the profile cache key
    tokens_per_sample: int = 1                # elements of the first input per sample (sequence length)
    layouts: Any = None                       # LayoutFacts: tensor / pipeline sizes the model supports
    notes: list[str] = field(default_factory=list)
    # the classes of a stack of layers of several classes (Jamba's Mamba and attention layers), in order
    layer_classes: tuple[str, ...] = ()

    @property
    def main_block(self) -> Optional[str]:
        return next(iter(self.repeated_blocks), None)

    @property
    def block_classes(self) -> tuple[str, ...]:
        """What a candidate checkpoints and shards as units: every class of the layer stack, or the main
        block alone (none without a repeated block)."""
        return self.layer_classes or ((self.main_block,) if self.main_block else ())

    def to_dict(self) -> dict:
        return asdict(self)


def layer_classes(model: nn.Module) -> tuple[str, ...]:
    """The classes of the model's layer stack (``block_stack``) where it holds more than one, in order of
    first appearance; () where the largest repeated class is the stack."""
    classes = tuple(t.__name__ for t in layer_types(model))
    return classes if len(classes) > 1 else ()


def analyse_model(model: nn.Module, sample_batch: Any = None, run_model: Optional[Callable] = None) -> ModelProfile:
    """Profile ``model``; with a sample batch and ``run_model(model, batch) -> loss`` it also counts
    FLOPs per sample on the meta device."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    blocks, block_bytes = repeated_blocks(model)
    profile = ModelProfile(
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        trainable_count=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        repeated_blocks=blocks,
        block_param_bytes=block_bytes,
        module_counts=module_counts(model),
        signature=model_signature(model),
        layer_classes=layer_classes(model),
    )
    if sample_batch is not None and run_model is not None:
        try:
            profile.flops_per_sample = count_flops(model, sample_batch, run_model)
        except Exception as error:  # a model or loss that needs real data (e.g. .item())
            profile.notes.append(f"FLOPs not counted on meta tensors: {type(error).__name__}: {error}")
    return profile


def module_counts(model: nn.Module) -> dict[str, int]:
    out = Counter()
    for module in model.modules():
        name = type(module).__name__
        if "Attention" in name:
            out["attention"] += 1
        elif isinstance(module, nn.Linear) or name == "Conv1D":
            out["linear"] += 1
        elif isinstance(module, NORM_TYPES) or name.endswith(("LayerNorm", "RMSNorm")):
            out["norm"] += 1
        elif isinstance(module, nn.Embedding):
            out["embedding"] += 1
    return dict(out)


def model_signature(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
    digest.update(type(model).__qualname__.encode())
    return digest.hexdigest()[:16]


def count_flops(model: nn.Module, sample_batch: Any, run_model: Callable) -> float:
    """Forward + backward FLOPs for one sample of ``sample_batch`` on meta tensors."""
    meta_state = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    }
    batch = to_meta(sample_batch)
    batch_size = batch_size_of(sample_batch)

    class Bound(nn.Module):  # the user's run_model, with the model's tensors swapped for meta ones
        def forward(self, data):
            return run_model(lambda *a, **k: functional_call(model, meta_state, a, k), data)

    counter = FlopCounterMode(display=False)
    with counter:
        loss = Bound()(batch)
        loss.backward()
    return counter.get_total_flops() / max(batch_size, 1)
