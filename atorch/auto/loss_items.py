"""A loss averaged over items (labelled tokens), weighted as one process on the global batch weighs it.

Why: an HF causal LM's loss, like ``cross_entropy(..., ignore_index=-100)``, is the mean over the labelled
tokens of the batch it is given. One process on the global batch averages over every labelled token
of it. Data parallelism averages the ranks' gradients, and a pipeline or ``micro_batch`` averages its
micro-batches', each of them the gradient of that piece's own mean: a piece of few labelled tokens
(short rows padded with -100, SFT's masked prompts) weighs as much as one of many. The step then
trains on another objective than the script's one-process run, silently (DDP does the same).

``auto_accelerate(..., loss_items=...)`` names how to count the items ``loss_func`` averages over in a
batch: ``"next_token_labels"`` (``labels[..., 1:] != -100``: HF causal LMs shift their labels by one),
``"labels"`` (``labels != -100``: masked LMs, token classification), a function ``batch -> count``, or
``"sum"`` for a loss summed over the batch (``reduction="sum"``), whose pieces' sums add up instead.
Each piece's loss is then weighted by ``its items x pieces / the global batch's items`` (the pieces the
gradients are averaged over: data-parallel ranks times the call's micro-batches; one all-reduce of a
count per step), so the averaged gradient is the global batch's item mean: one process's, exactly.
The loss a rank's ``loss_func`` returns keeps its value (the rank's own item mean); only its gradient
is weighted, so a loop that prints it or divides it for its own accumulation runs as before.

Without ``loss_items``, a data-parallel, pipelined or micro-batched run warns once when a batch's rows
hold different numbers of labelled tokens (``labels`` other than -100), saying what to pass.
"""
from __future__ import annotations

import collections
import collections.abc
import warnings
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from atorch.auto.given_model import user_frame_level
from atorch.distributed import mesh
from atorch.errors import InputError
from atorch.utils.batch import loss_value

IGNORE_INDEX = -100  # the label torch's cross_entropy and HF's losses do not count


def _labels(batch: Any, preset: str) -> torch.Tensor:
    labels = batch.get("labels") if isinstance(batch, collections.abc.Mapping) else None
    if not isinstance(labels, torch.Tensor):
        raise InputError(f"loss_items={preset!r} counts the batch's 'labels' tensor, but the batch "
                         f"({type(batch).__name__}) has none: give loss_items a function batch -> count of the "
                         "items loss_func averages over")
    return labels


def _next_token_labels(batch: Any) -> torch.Tensor:
    labels = _labels(batch, "next_token_labels")
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def _all_labels(batch: Any) -> torch.Tensor:
    return (_labels(batch, "labels") != IGNORE_INDEX).sum()


PRESETS: dict[str, Callable[[Any], Any]] = {"next_token_labels": _next_token_labels, "labels": _all_labels}
SUMMED = "sum"  # loss_func sums over the batch (reduction="sum"): every piece's loss counts whole


class LossItems:
    """How many items ``loss_func`` averages over in a batch (``count``), and the weights that make
    the pieces' means the global batch's mean; or (``summed``) a loss summed over the batch, whose
    pieces' sums add up to the global batch's: each weighs the count of pieces averaged. Counts stay
    tensors on the training device (no wait on it each step), checked on the host for the first
    ``CHECKED_COUNTS`` batches only."""

    def __init__(self, counter: Optional[Callable[[Any], Any]], name: str, summed: bool = False):
        self.counter = counter
        self.name = name
        self.summed = summed
        self.checked = 0

    def weight(self, items: torch.Tensor, pieces: int, total: Optional[torch.Tensor]) -> torch.Tensor:
        """The gradient weight of one of ``pieces`` pieces averaged (``total``: the global batch's items)."""
        if self.summed or total is None:
            return torch.full_like(items, float(pieces))
        return piece_weight(items, pieces, total)

    def count(self, batch: Any, device: torch.device) -> torch.Tensor:
        """The batch's items as a float64 scalar on ``device``; InputError for what is not a count."""
        if self.summed:  # a sum is its pieces' total: no count needed (1 a piece: the call's value sums them)
            return torch.ones((), dtype=torch.float64, device=device)
        try:
            value = self.counter(batch)
        except InputError:
            raise
        except Exception as error:  # the user's function: its failure named as loss_items'
            raise InputError(f"loss_items ({self.name}) raised {type(error).__name__} on a batch: {error}") from error
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            count = value.detach().to(device=device, dtype=torch.float64).reshape(())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            count = torch.tensor(float(value), dtype=torch.float64, device=device)
        else:
            raise InputError(f"loss_items ({self.name}) must count a batch's items as a non-negative number, got "
                             f"{value!r}")
        if self.checked < CHECKED_COUNTS:
            self.checked += 1
            if not float(count) >= 0:
                raise InputError(f"loss_items ({self.name}) must count a batch's items as a non-negative number, "
                                 f"got {float(count)!r}")
        return count

    def total(self, local: torch.Tensor, across_data: bool) -> torch.Tensor:
        """``local`` summed over the data-parallel ranks (``across_data``; else this process's alone). The
        group is looked up at the call, not kept: a rank whose work failed drops every hold on the process
        group so that its peers' collectives fail at once (``run_isolated``)."""
        group = mesh.parallel_group("data_parallel") if across_data else None
        if self.summed or group is None or dist.get_world_size(group) == 1:
            return local
        count = local.clone()
        dist.all_reduce(count, group=group)
        return count


CHECKED_COUNTS = 4  # batches whose count is checked on the host (a wait on the device each)


def resolve_loss_items(value: Union[None, str, Callable[[Any], Any]]) -> Optional[LossItems]:
    """``auto_accelerate``'s ``loss_items``: None, a preset's name or a function; InputError otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == SUMMED:
            return LossItems(None, repr(value), summed=True)
        if value not in PRESETS:
            raise InputError(f"loss_items={value!r} is not valid; choose one of {sorted([*PRESETS, SUMMED])} or give "
                             "a function batch -> count of the items loss_func averages over")
        return LossItems(PRESETS[value], repr(value))
    if callable(value):
        return LossItems(value, getattr(value, "__name__", type(value).__name__))
    raise InputError(f"loss_items must be one of {sorted([*PRESETS, SUMMED])} or a function batch -> count, got "
                     f"{type(value).__name__}: {value!r}")


def item_weighted(loss: torch.Tensor, weight: Union[float, torch.Tensor]) -> torch.Tensor:
    """``loss`` of the same value whose gradient is ``weight`` times its own (a weight tensor in at least
    fp32: a bf16 weight would round the share by up to 0.4 %)."""
    kept = loss.detach()
    if isinstance(weight, torch.Tensor):
        weight = weight.to(device=loss.device, dtype=torch.promote_types(loss.dtype, torch.float32))
    return (loss - kept) * weight + kept


def piece_weight(items: torch.Tensor, pieces: int, total: torch.Tensor) -> torch.Tensor:
    """The weight of a piece's mean when ``pieces`` such means are averaged: its share of the ``total``
    items, times ``pieces``. A global batch with no item at all keeps the plain average (its mean is
    undefined, as one process's is)."""
    return torch.where(total > 0, items * pieces / total.clamp_min(1e-300), torch.ones_like(items))


_WARNED: set = set()
_CHECKED: collections.Counter = collections.Counter()
CHECKED_CALLS = 16  # batches looked at per place: each look reads the labels' counts on the host (a device sync)


def warn_unweighted(batch: Any, pieces: int, where: str) -> None:
    """Once per process: the batch's rows hold different numbers of labelled tokens while ``pieces``
    piece means are averaged without ``loss_items``. Only the first ``CHECKED_CALLS`` batches of each
    place are looked at, so a long run does not wait on the device for it every step."""
    if pieces <= 1 or where in _WARNED or _CHECKED[where] >= CHECKED_CALLS:
        return
    _CHECKED[where] += 1
    if not isinstance(batch, collections.abc.Mapping):
        return
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
        return
    per_row = (labels != IGNORE_INDEX).flatten(1).sum(dim=1)
    if per_row.numel() < 2 or bool((per_row == per_row[0]).all()):
        return
    _WARNED.add(where)
    warnings.warn(
        f"atorch: the rows of a batch hold different numbers of labelled tokens ('labels' other than -100) and "
        f"{where} averages {pieces} pieces' own mean losses alike, so a piece of few tokens weighs as much as one "
        "of many: the step's gradient is not one process's mean over the global batch's tokens. Pass "
        "auto_accelerate(..., loss_items='next_token_labels') for a causal LM's shifted labels (HF's loss), "
        "'labels' for unshifted ones, or a function batch -> count of the items loss_func averages over",
        UserWarning, stacklevel=user_frame_level())


class DataParallelItemLoss:
    """``result.loss_func`` under data parallelism with ``loss_items``: the rank's loss, its gradient
    weighted by the rank's share of the global batch's items times the data-parallel size (the ranks'
    gradients are averaged). Only where the loss has a gradient: evaluation (one rank alone, under
    ``no_grad``) runs no collective. Without ``loss_items`` (``items`` None) it only warns."""

    def __init__(self, loss_func: Callable, items: Optional[LossItems], size: int, device: torch.device):
        self.loss_func, self.items, self.size, self.device = loss_func, items, size, device

    def __call__(self, batch: Any, output: Any) -> Any:
        value = self.loss_func(batch, output)
        loss = loss_value(value)
        if not loss.requires_grad:
            return value
        if self.items is None:
            warn_unweighted(batch, self.size, "data parallelism")
            return value
        local = self.items.count(batch, self.device)
        weighted = item_weighted(loss, self.items.weight(local, self.size, self.items.total(local, True)))
        return (weighted, *value[1:]) if isinstance(value, (list, tuple)) else weighted


class MicroBatchItemWeights:
    """One model call run as ``micro`` micro-batches (a pipeline's, ``micro_batch``'s) on each of
    ``size`` data-parallel ranks, whose gradients are averaged over both: each micro-batch's loss is
    weighted by its items times ``micro x size`` over the global batch's items, and the call's loss value
    is the item mean of its micro-batches' (plain: their mean). ``begin`` once per call, with the whole
    per-rank batch; ``weigh`` each micro-batch's loss, keyed by the micro-batch (a schedule may compute
    one twice: torch's pipeline infers its backward's shapes from micro-batch 0's loss first); ``mean``
    the call's value. Without ``loss_items`` it only warns."""

    def __init__(self, items: Optional[LossItems], size: int, device: torch.device, where: str):
        self.items, self.size, self.device, self.where = items, size, device, where
        self.micro: int = 1
        self.total: Optional[torch.Tensor] = None
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (items, loss value)

    def begin(self, batch: Any, micro: int, training: bool) -> None:
        self.micro, self.total, self.seen = micro, None, {}
        if self.items is None:
            if training:
                warn_unweighted(batch, micro * self.size, self.where)
        elif training:  # evaluation reports the item mean without a collective (one rank may evaluate alone)
            self.total = self.items.total(self.items.count(batch, self.device), self.size > 1)

    def weigh(self, micro_batch: Any, loss: torch.Tensor, key: int) -> torch.Tensor:
        if self.items is None:
            return loss
        count = self.items.count(micro_batch, self.device)
        self.seen[key] = (count, loss.detach().float())
        if self.total is None:
            return loss
        return item_weighted(loss, self.items.weight(count, self.micro * self.size, self.total))

    def counts(self) -> Optional[dict[int, float]]:
        """The call's micro-batches' loss items, by micro-batch key (None without ``loss_items``)."""
        if self.items is None:
            return None
        return {key: float(count) for key, (count, _) in self.seen.items()}

    def mean(self, plain: torch.Tensor) -> torch.Tensor:
        if self.items is None or not self.seen:
            return plain
        counts = torch.stack([count.to(plain.device) for count, _ in self.seen.values()])
        values = torch.stack([value.to(plain.device, torch.float64) for _, value in self.seen.values()])
        total = (counts * values).sum()
        if self.items.summed:  # a sum's call value is its micro-batches' sum
            return total.reshape(plain.shape).to(plain.dtype)
        items = counts.sum()
        return torch.where(items > 0, total / items.clamp_min(1e-300), plain.to(torch.float64)).reshape(
            plain.shape).to(plain.dtype)
