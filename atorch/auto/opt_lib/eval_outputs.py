"""The model's outputs in evaluation under a pipeline (pipeline_parallel, ds_3d_parallel).

A training call under a pipeline returns the step's loss only: the schedule spent the outputs on the
backward it ran inside the call. An evaluation loop reads the outputs themselves (accuracy from
``output.logits``, a metric over the predictions), and only the last stage ever holds them, one
micro-batch at a time. In evaluation the last stage keeps each micro-batch's output (``MicroOutputs``),
merges them into what one call on the whole batch returns (``merge_micro_outputs``) and sends that to
every stage of its pipeline (``share_from``), so every process's ``model(batch)`` reads as one
process's would.

The merge, leaf by leaf of the output (an HF ``ModelOutput``, a tuple, a dict, a tensor): a tensor
holding the micro-batch's rows on its first dimension is concatenated, a scalar (a loss the model
computes itself) is the micro-batches' mean weighted by their loss items (their rows where the loss has
no item count), anything else (a tensor every row shares, ``None``) is the first micro-batch's.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from atorch.errors import MethodConfigError


class _Slot:
    """Where the ``index``-th shared tensor goes in the output's skeleton (what ``share_from`` pickles)."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


class _Failed:
    """What the sending rank broadcasts in place of a skeleton when it could not build one, so every rank
    of the group raises the same error instead of waiting for tensors that never come."""

    def __init__(self, reason: str):
        self.reason = reason


class MicroOutputs:
    """The last stage's micro-batch outputs of one evaluation call, keyed by the micro-batch's first row
    (a schedule may run one micro-batch's loss twice: the later call replaces the earlier)."""

    def __init__(self) -> None:
        self.collecting = False
        self.chunks: dict[int, tuple[Any, int]] = {}

    def begin(self, collecting: bool) -> None:
        self.collecting, self.chunks = collecting, {}

    def keep(self, key: int, output: Any, rows: int) -> None:
        if self.collecting:
            self.chunks[key] = (pytree.tree_map(_detached, output), rows)

    def share(self, item_weights: Any, source: int, group: Any, device: torch.device) -> Any:
        """The call's output for the whole batch, merged here on ``source`` (the last stage's group rank),
        on every rank of ``group``; ``item_weights`` (``MicroBatchItemWeights`` or None) weigh its scalars."""
        weights = item_weights.counts() if item_weights is not None else None
        return share_from(lambda: self.merged(weights), source, group, device)

    def merged(self, weights: Optional[dict[int, float]] = None) -> Any:
        """The whole batch's output; ``weights`` (micro-batch key -> loss items) weigh the scalars."""
        keys = sorted(self.chunks)
        outputs = [self.chunks[key][0] for key in keys]
        rows = [self.chunks[key][1] for key in keys]
        weighed = [float(weights[key]) if weights and key in weights else float(r) for key, r in zip(keys, rows)]
        self.chunks = {}
        return merge_micro_outputs(outputs, rows, weighed)


def _detached(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def merge_micro_outputs(outputs: list[Any], rows: list[int], weights: list[float]) -> Any:
    """One output from the micro-batches' (see the module docstring for the rule, leaf by leaf)."""
    if not outputs:
        raise MethodConfigError("pipeline", "evaluation ran no micro-batch on the last stage: no output to return")
    flat = [pytree.tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise MethodConfigError("pipeline", "the model returned outputs of different structure for the micro-batches "
                                "of one call, so they do not merge into the batch's output; return the same keys "
                                "for every batch, or evaluate with the pipeline method's eval_outputs=False (the "
                                "loss only)")
    merged = [_merge_leaf([leaves[i] for leaves, _ in flat], rows, weights) for i in range(len(flat[0][0]))]
    return pytree.tree_unflatten(merged, spec)


def _merge_leaf(values: list[Any], rows: list[int], weights: list[float]) -> Any:
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 0:
        total = sum(weights) or float(len(values))
        shares = weights if sum(weights) else [1.0] * len(values)
        mean = sum(value.double() * share for value, share in zip(values, shares)) / total
        return mean.to(first.dtype)
    if all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == r for v, r in zip(values, rows)):
        return torch.cat(values, dim=0)
    return first


def share_from(make: Callable[[], Any], source: int, group: Any, device: torch.device) -> Any:
    """``make()``'s value, run on the group's rank ``source`` (a group rank), on every rank of ``group``:
    its structure and non-tensor leaves pickled, its tensors broadcast. A failure of ``make`` (or of the
    pickling) on the source is raised on every rank, after the one broadcast every rank takes part in."""
    mine = dist.get_rank(group) == source
    value, tensors, payload = None, [], [None]
    if mine:
        try:
            value = make()
            payload = [_skeleton(value, tensors, device)]
        except Exception as error:  # every rank raises it below
            payload = [_Failed(f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(payload, group=group, group_src=source,
                               device=device if device.type != "cpu" else None)
    if isinstance(payload[0], _Failed):
        raise MethodConfigError("pipeline", f"the last stage could not send the evaluation outputs to the other "
                                f"stages ({payload[0].reason}); evaluate with the pipeline method's "
                                "eval_outputs=False (the loss only)")
    leaves, spec = [], None
    if not mine:
        leaves, spec = pytree.tree_flatten(pickle.loads(payload[0]))
        tensors = [torch.empty(leaf.shape, dtype=leaf.dtype, device=device) for leaf in leaves
                   if isinstance(leaf, _Slot)]
    for tensor in tensors:
        dist.broadcast(tensor, group=group, group_src=source)
    if mine:
        return value
    return pytree.tree_unflatten([tensors[leaf.index] if isinstance(leaf, _Slot) else leaf for leaf in leaves], spec)


def _skeleton(value: Any, tensors: list[torch.Tensor], device: torch.device) -> bytes:
    """``value`` pickled with its tensors replaced by slots; the tensors (on ``device``) appended to
    ``tensors`` in slot order."""
    leaves, spec = pytree.tree_flatten(value)
    skeleton = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            skeleton.append(_Slot(len(tensors), tuple(leaf.shape), leaf.dtype))
            tensors.append(leaf.contiguous().to(device))
        else:
            skeleton.append(leaf)
    return pickle.dumps(pytree.tree_unflatten(skeleton, spec))
