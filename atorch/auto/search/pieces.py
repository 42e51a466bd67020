"""Measure a model by its pieces: the model with its stack of repeated blocks cut to one block or none.

A transformer's cost is its embedding and output layer once plus its repeated block times the number
of blocks, so the search never needs to train the whole model in one process (which a model built on
the meta device because no process can hold it could not do). It trains a copy of the user's model
whose block stack keeps ``k`` blocks, for two consecutive ``k`` (0 and 1, or 1 and 2 where a model
cannot run without blocks), and extrapolates every measured quantity linearly to the full count:

    whole = at(k) + (blocks - k) * (at(k + 1) - at(k))

The stack is found from the module tree, not from names: the one container (``ModuleList``,
``ModuleDict`` or ``Sequential``) whose children are all the instances of the largest repeated module
class. The cut copy shares nothing with the user's model: the container's children are hidden while
``copy.deepcopy`` runs, so the blocks left out are never copied (a meta model stays meta until the
piece's strategy materialises it). A copy that holds more parameters than the cut promised (a block
also referenced from elsewhere) is refused, and the caller measures the whole model instead.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from torch import nn

from atorch.auto.search.measure import VariantProfile
from atorch.utils.modules import repeated_blocks

STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Bytes of training state per parameter byte that a piece is assumed to need before it runs: the
# parameters, their gradients and two Adam moments. A piece predicted over the memory limit is not run.
STATE_PER_PARAM_BYTE = 4


@dataclass(frozen=True)
class BlockStack:
    """Where the repeated blocks are: the container's qualified name, how many blocks it holds and the
    parameter bytes of the model outside it (the "rest": embeddings, final norm, output layer)."""

    name: str
    blocks: int
    block_param_bytes: int
    rest_param_bytes: int

    def param_bytes(self, kept: int) -> int:
        return self.rest_param_bytes + kept * self.block_param_bytes


@dataclass
class PieceRun:
    """One measurement the search made: which setting, how many blocks the piece kept, the parameter
    bytes it held, and what it measured (the search's record of what it ran)."""

    setting: str
    kept_blocks: Optional[int]  # None: the whole model
    total_blocks: int
    param_bytes: int
    peak_bytes: int = 0
    step_time_s: float = 0.0
    error: Optional[str] = None
    batch: int = 0  # the per-rank batch it trained (0: not recorded)

    @property
    def label(self) -> str:
        if self.kept_blocks is None:
            return "whole model"
        return f"{self.kept_blocks} of {self.total_blocks} blocks"


def find_block_stack(model: nn.Module) -> Optional[BlockStack]:
    """The container of the largest repeated block class, when all its children are such blocks and
    there are at least three of them (with fewer, cutting saves nothing); None otherwise."""
    counts, sizes = repeated_blocks(model)
    if not counts:
        return None
    block_class = next(iter(counts))
    for name, module in model.named_modules():
        if not isinstance(module, STACKS):
            continue
        children = list(module.children())
        if len(children) >= 3 and all(type(child).__name__ == block_class for child in children):
            if len(children) != counts[block_class]:
                return None  # the class also appears elsewhere: the stack is not all of it
            total = _param_bytes(model)
            stack_bytes = _param_bytes(module)
            return BlockStack(name, len(children), sizes[block_class], total - stack_bytes)
    return None


def cut_copy(model: nn.Module, stack: BlockStack, kept: int) -> nn.Module:
    """A deep copy of ``model`` whose stack keeps its first ``kept`` blocks; the others are not copied.
    Raises ``ValueError`` when the copy holds more parameter bytes than the cut promises."""
    container = model.get_submodule(stack.name)
    hidden = container._modules
    container._modules = OrderedDict(list(hidden.items())[:kept])
    try:
        piece = copy.deepcopy(model)
    finally:
        container._modules = hidden
    held = _param_bytes(piece)
    if held > stack.param_bytes(kept):
        raise ValueError(f"a copy keeping {kept} of {stack.blocks} blocks holds {held} parameter bytes, more than "
                         f"the {stack.param_bytes(kept)} the cut leaves (a block is also referenced from elsewhere)")
    return piece


def whole_model(at_low: float, at_high: float, low_blocks: int, total_blocks: int) -> float:
    """One measured quantity of the whole model from two pieces that differ by one block (see the module
    doc). A block's share is never negative: step-time noise must not make a block look free."""
    return at_low + (total_blocks - low_blocks) * max(at_high - at_low, 0.0)


def extrapolate(low: VariantProfile, high: VariantProfile, low_blocks: int, total_blocks: int) -> VariantProfile:
    """The whole model's profile from two pieces that differ by one block (``whole_model``)."""
    def whole(at_low: float, at_high: float) -> float:
        return whole_model(at_low, at_high, low_blocks, total_blocks)

    return VariantProfile(
        low.precision, low.checkpoint, low.batch,
        peak_bytes=int(whole(low.peak_bytes, high.peak_bytes)),
        step_time_s=whole(low.step_time_s, high.step_time_s),
        params=int(whole(low.params, high.params)),
        grads=int(whole(low.grads, high.grads)),
        optim_state=int(whole(low.optim_state, high.optim_state)),
        forward_backward_peak_bytes=int(whole(low.forward_backward_peak_bytes, high.forward_backward_peak_bytes)),
        forward_saved_bytes=int(whole(low.forward_saved_bytes, high.forward_saved_bytes)),
        blocks_step_time_s=total_blocks * max(high.step_time_s - low.step_time_s, 0.0),
        optimizer_step_time_s=whole(low.optimizer_step_time_s, high.optimizer_step_time_s),
    )


def state_bytes_needed(param_bytes: int) -> int:
    """The training state a piece holding ``param_bytes`` is assumed to need (``STATE_PER_PARAM_BYTE``)."""
    return STATE_PER_PARAM_BYTE * param_bytes


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def describe_pieces(runs: list[PieceRun]) -> str:
    """One report line: what each setting's alone measurement trained (so a reader sees that no step held
    the whole model), e.g. ``measured alone: fp32 on 0 and 1 of 12 blocks``."""
    batches: dict[str, set] = {}
    for run in runs:
        batches.setdefault(run.setting, set()).add(run.batch)
    by_setting: dict[str, list[str]] = {}
    for run in runs:
        text = run.label if run.error is None else f"{run.label} (failed)"
        key = run.setting if len(batches[run.setting]) == 1 else f"{run.setting} at batch {run.batch}"
        by_setting.setdefault(key, []).append(text)
    parts = [f"{setting} on {', '.join(labels)}" for setting, labels in by_setting.items()]
    return "measured alone: " + "; ".join(parts) if parts else ""
