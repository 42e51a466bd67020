"""The ranks of a tensor or pipeline group must be given the same batch: checked on the model's first calls.

Every rank of a tensor group computes its share of one forward over one batch; the split matmuls' collectives
add up those shares. A pipeline's first stage reads the batch's inputs and its last stage the same batch's
labels. Given different batches (a script's own DataLoader over a DistributedSampler of every rank, or a
tensor-parallel teacher called with a data-parallel student's batches) the sums are nonsense of the right
shape, or the loss compares one batch's outputs with another's labels: it trains, wrongly, with no error (a
tensor-parallel teacher's logits were 0.5 off per element, its student's weights 2e-3 off one process's after
4 steps). ``result.dataloader`` gives such a group one batch, so the dry runs and a script that uses it never
meet this; a script that brings its own data did, silently.

The model's first ``CHECKED_CALLS`` forwards in training, and as many in evaluation, compare a fingerprint of
their inputs over the group (one small all-gather each; then the hook removes itself) and raise
``InputError`` on every rank of the group where they differ. The group alone takes part: a script may call
one group's model where the others do not (an evaluation on the first data rank), and the fingerprints are
the same on all its ranks, so all of them raise together.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from atorch.distributed.agreement import comm_device
from atorch.errors import InputError

CHECKED_CALLS = 4  # the forwards checked in training and as many in evaluation; then the hook is gone
WHY = {"tensor": "each computes its share of the same matmuls",
       "pipeline": "the first stage reads the batch's inputs and the last its labels"}


def check_same_batch(model: nn.Module, group: Any, method: str, dimension: str) -> None:
    """Compare the inputs of ``model``'s first ``CHECKED_CALLS`` training forwards and first ``CHECKED_CALLS``
    evaluation forwards (``model.eval()`` or ``torch.no_grad()``) over ``group``'s ranks (the ``dimension``
    group ``method`` works over). Evaluation is counted apart: a script's evaluation often reads a loader of
    its own, long after its training's first calls."""
    calls = {"training": 0, "evaluation": 0}

    @torch._dynamo.disable
    def compare(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mode = "training" if module.training and torch.is_grad_enabled() else "evaluation"
        if calls[mode] >= CHECKED_CALLS:
            return
        calls[mode] += 1
        if min(calls.values()) >= CHECKED_CALLS:
            handle.remove()
        mine = input_fingerprint(args, kwargs).to(comm_device(group))
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        differing = [i for i, theirs in enumerate(everyone) if not same_fingerprint(theirs, everyone[0])]
        if differing:
            ranks = dist.get_process_group_ranks(group)
            raise InputError(
                f"{method}: the ranks of a {dimension} group were given different inputs at {mode} call "
                f"{calls[mode]} (ranks {ranks}: rank {ranks[differing[0]]}'s differ from rank {ranks[0]}'s); every "
                f"rank of a {dimension} group works on one batch with the others ({WHY[dimension]}), so each must be "
                "given the same batch: iterate result.dataloader, or split your own data by the data-parallel rank "
                "and size (atorch.distributed.distributed.get_data_partition_rank_and_size()), not by the global "
                "rank")

    handle = model.register_forward_pre_hook(compare, with_kwargs=True)


def same_fingerprint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (a fingerprint is never NaN from NaN inputs, ``input_fingerprint``; this keeps
    the comparison total all the same)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def input_fingerprint(args: tuple, kwargs: dict) -> torch.Tensor:
    """A few numbers that equal inputs give alike on every rank: the tensors' count, their sizes, and their
    values summed in float64, plainly and with each row weighted by its position (so swapped rows or arguments
    differ too). Reductions only: nothing the size of an input is allocated, except for a floating tensor
    holding NaN or an infinity (missing values a model masks itself, an additive attention mask), whose sums
    would be NaN or infinite for any batch: its finite values are summed, and where its NaN and infinities
    sit is counted apart. Keyword arguments are read in sorted order, so their order of writing does not
    matter."""
    leaves = [x for x in tree_leaves((args, [kwargs[k] for k in sorted(kwargs)]))
              if isinstance(x, torch.Tensor) and not x.is_meta]
    parts = [torch.zeros(6, dtype=torch.float64)]
    for index, tensor in enumerate(leaves):
        rows = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1) if tensor.numel() else \
            tensor.detach().reshape(1, 0)
        row_sums, special = _row_sums(rows)
        positions = torch.arange(1, row_sums.numel() + 1, dtype=torch.float64, device=row_sums.device)
        parts.append(torch.stack([torch.tensor(1.0, dtype=torch.float64), torch.tensor(float(tensor.numel())),
                                  row_sums.sum().cpu() * (index + 1), (row_sums * positions).sum().cpu(),
                                  special.sum().cpu() * (index + 1), (special * positions).sum().cpu()]))
    return torch.stack(parts).sum(0)


def _row_sums(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sum in float64, and each row's count of NaN (1), +inf (2) and -inf (3); where a floating
    tensor holds any of those, its finite values alone are summed."""
    sums = rows.sum(1, dtype=torch.float64)
    if not rows.is_floating_point() or bool(torch.isfinite(sums).all()):
        return sums, torch.zeros_like(sums)
    finite = torch.isfinite(rows)
    sums = torch.where(finite, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).sum(1, dtype=torch.float64)
    special = rows.isnan().sum(1, dtype=torch.float64) + 2 * (rows == float("inf")).sum(1, dtype=torch.float64)
    special += 3 * (rows == float("-inf")).sum(1, dtype=torch.float64)
    return sums, special
