"""micro_batch: each per-rank batch runs as ``num_micro_batch`` micro-steps with gradient accumulation.

Why: a per-rank batch whose activations do not fit otherwise forces checkpointing (recompute, about
a third more compute) or sharding (communication). Splitting it into micro-batches keeps the global
batch and the numerics (the mean of equal micro-batch means is the batch mean; gradients add up
before the one optimizer step) and holds only one micro-batch's activations at a time, for a small
per-micro-step overhead. DeepSpeed's autotuner tunes the same pair (micro-batch size, accumulation).

How the seed's loop runs unchanged (as under pipeline_parallel): the dataloader yields the same
per-rank batches; ``model(**batch)`` runs every micro-step (forward, the user's loss on the
micro-batch divided by ``num_micro_batch``, backward; gradient communication as ``grad_sync`` says,
through the data-parallel wrapper's accumulation switch) and returns a ``MicroBatchOutput``;
``loss_func(batch, output)`` returns the batch's mean loss; ``optim.backward(loss)`` only tells how
the loop scaled that loss (a loop accumulating over calls divides it), which the window's gradients are
scaled by before ``optim.step()`` steps once (``atorch.auto.loss_probe``; ``result.args.use_optim_backward``
is True). Without
gradients (``torch.no_grad()`` or ``model.eval()``) the model runs the whole batch and returns the
user's own output, and ``loss_func`` is the user's.

The loss must be a mean over rows of equal weight (the usual cross-entropy over equal-length rows):
a loss summed over rows, or normalised by a count that differs between micro-batches, would be
weighted differently. Layers that mix rows (BatchNorm) see micro-batches, as under pipelines.

Gradient synchronisation, ``grad_sync`` (the same numerics either way):

- ``"last_micro_step"`` (default): gradients are communicated once, after the last micro-step (DDP's
  no_sync, FSDP's ``set_requires_gradient_sync(False)`` before it). The least communication, but
  under fsdp / zero2 every rank keeps the whole model's unsharded gradients between micro-steps.
- ``"each_micro_step"``: every micro-step's backward reduce-scatters (fsdp / zero2), so gradients stay
  sharded between micro-steps: about the unsharded gradients (less the rank's shard) less memory per
  rank, for ``num_micro_batch - 1`` more gradient reduce-scatters a step. Under DDP and zero1 it
  all-reduces every micro-step: allowed, but it only adds communication (DDP's gradients are whole on
  every rank anyway). The search offers it under fsdp, for a split whose last-step variant does not fit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from atorch.auto.loss_items import MicroBatchItemWeights
from atorch.auto.loss_probe import WindowScales
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.read_through import read_through
from atorch.auto.opt_lib.row_layout import check_rows_first
from atorch.auto.optimizer import AtorchOptimizer
from atorch.errors import MethodConfigError
from atorch.utils.batch import batch_of_call, batch_size_of, call_with_batch, equal_chunks, loss_value, narrow_rows
from atorch.utils.config import MethodConfig, option

logger = logging.getLogger(__name__)

LAST_MICRO_STEP, EACH_MICRO_STEP = "last_micro_step", "each_micro_step"
GRAD_SYNCS = (LAST_MICRO_STEP, EACH_MICRO_STEP)


@dataclass(frozen=True)
class MicroBatchConfig(MethodConfig):
    num_micro_batch: int = option(2, doc="micro-steps per per-rank batch; it must divide the per-rank batch",
                                  minimum=1)
    grad_sync: str = option(LAST_MICRO_STEP, doc="when gradients are communicated: once after the last micro-step "
                            "(unsharded gradients kept between micro-steps under fsdp / zero2), or after each one "
                            "(reduce-scattered, so they stay sharded; under DDP an all-reduce each, only slower)",
                            choices=GRAD_SYNCS)


@dataclass
class MicroBatchOutput:
    """What ``model(...)`` returns under micro_batch: the micro-steps already ran (forward and backward)."""

    loss: torch.Tensor  # the batch's mean loss, detached but for a probe of how the loop scales it


class MicroBatchOptimizer(AtorchOptimizer):
    """``backward`` only tells the model how the loop scaled the loss (the model ran backward per
    micro-step; ``atorch.auto.loss_probe``); the user's own accumulation boundary is remembered so
    micro-steps communicate only at the user's boundary."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if loss.requires_grad:
            loss.backward(**kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.is_gradient_accumulation_boundary = bool(is_boundary)  # applied to the last micro-step


# why micro_batch's returned module does not offer the model's methods (``read_through``)
MICRO_BATCH_WHY = ("a method of the model inside runs its own forward, without the micro-steps (and, under data "
                   "parallelism, its gradient synchronisation): for inference, call it on result.model.module")


class MicroBatchModule(nn.Module):
    """Runs ``num_micro_batch`` forward / loss / backward micro-steps on one per-rank batch."""

    def __init__(self, model: nn.Module, loss_func: Any, optim: Optional[AtorchOptimizer], outer: Any,
                 num_micro_batch: int, input_format: Optional[str], grad_sync: str = LAST_MICRO_STEP,
                 chunk_rows: Optional[int] = None, item_weights: Optional[MicroBatchItemWeights] = None,
                 shared_inputs: frozenset[str] = frozenset()):
        super().__init__()
        self.module = model
        self.shared_inputs = shared_inputs  # the inputs the data pipeline stacks no rows into (row_layout): whole
        self.user_loss, self.optim, self.outer = loss_func, optim, outer
        self.num_micro_batch, self.input_format, self.grad_sync = num_micro_batch, input_format, grad_sync
        self.chunk_rows = chunk_rows  # a micro-step's rows as planned; a batch of other rows keeps to it
        self.window = WindowScales("micro_batch")
        self.item_weights = item_weights  # the micro-steps' losses weighted by loss_items (atorch.auto.loss_items)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return read_through(self, name, self.__dict__.get("_modules", {}).get("module"), MICRO_BATCH_WHY)

    def settle(self) -> None:
        """Scale the window's gradients as the loop scaled its calls' losses (before the optimizer reads them)."""
        self.window.settle(p for p in self.module.parameters() if p.requires_grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.training):
            return self.module(*args, **kwargs)  # evaluation: the whole batch, the user's output
        batch = batch_of_call(args, kwargs, self.input_format)
        rows = batch_size_of(batch, self.chunk_rows * self.num_micro_batch if self.chunk_rows else None,
                             self.shared_inputs)
        k = equal_chunks(rows, self.num_micro_batch, self.chunk_rows)
        if k != self.num_micro_batch:
            logger.info("micro_batch: a batch of %d rows runs as %d micro-steps, not %d", rows, k, self.num_micro_batch)
        if self.item_weights is not None:
            self.item_weights.begin(batch, k, True)
        losses = []
        for index in range(k):
            micro = narrow_rows(batch, index * rows // k, rows // k, rows, self.shared_inputs)
            self._set_sync(index == k - 1 or self.grad_sync == EACH_MICRO_STEP)
            loss = loss_value(self.user_loss(micro, call_with_batch(self.module, micro, self.input_format)))
            if self.item_weights is not None:
                loss = self.item_weights.weigh(micro, loss, index)
            self._backward(loss / k)
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        return MicroBatchOutput(self.window.probe(self.item_weights.mean(mean) if self.item_weights else mean))

    def _set_sync(self, last: bool) -> None:
        """Gradients are communicated on the micro-steps ``grad_sync`` names (the last, or each) of the
        user's boundary only (the data-parallel wrapper's switch: DDP's no_sync, FSDP's
        requires_gradient_sync)."""
        if self.optim is not None:
            self.optim.set_gradient_accumulation_boundary(last and self.outer.is_gradient_accumulation_boundary)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.optim is not None:
            self.optim.backward(loss)  # amp's grad scaler scales it
        else:
            loss.backward()


def micro_batch_loss(user_loss: Any):
    """The loss function returned with the model: the micro-steps' mean, or the user's own loss on
    a whole-batch output (evaluation)."""

    def loss_func(batch: Any, output: Any) -> Any:
        if isinstance(output, MicroBatchOutput):
            return output.loss
        return user_loss(batch, output)

    return loss_func


class MicroBatchOptimization(Optimization):
    name = "micro_batch"
    config_class = MicroBatchConfig
    stages = ("micro_batch",)
    reads = ("model", "loss_func", "optim", "model_input_format", "per_rank_batch_size", "backward_in_forward",
             "loss_items", "local", "data_parallel_size", "device",
             # where the data pipeline stacks a batch's rows (row_layout.check_rows_first)
             "dataset", "dataloader_args", "user_prepare_input", "input_dtype")
    writes = ("model", "loss_func", "optim", "items_weighted", "args")
    excludes = {"micro-batches": "a pipeline splits the batch into micro-batches itself: set its num_micro_batch"}

    def normalize(self, config: Any) -> MicroBatchConfig:
        """Also accepts the count alone: ``("micro_batch", 4)``."""
        if isinstance(config, int) and not isinstance(config, bool):
            config = {"num_micro_batch": config}
        return super().normalize(config)

    def transform(self, ctx, config: MicroBatchConfig) -> None:
        ctx.add_wrapper("micro_batch", self.name, lambda ctx: apply_micro_batch(ctx, config))


def apply_micro_batch(ctx, config: MicroBatchConfig) -> None:
    """Wrap the finished model, loss and optimizer (after amp) so one call runs every micro-step."""
    k = config.num_micro_batch
    batch = ctx.per_rank_batch_size
    if batch is not None and batch % k:
        raise MethodConfigError("micro_batch", f"num_micro_batch={k} does not divide the per-rank batch {batch}; "
                                f"choose one of {[d for d in range(1, batch + 1) if batch % d == 0]}")
    if ctx.backward_in_forward:
        raise MethodConfigError("micro_batch", "the model already runs backward inside forward (a pipeline "
                                "schedule, which splits the batch into micro-batches itself): set the pipeline's "
                                "num_micro_batch instead")
    shared_inputs = check_rows_first(ctx, "micro_batch")
    outer = MicroBatchOptimizer(ctx.optim) if ctx.optim is not None else None
    item_weights = MicroBatchItemWeights(ctx.loss_items, 1 if ctx.local else ctx.data_parallel_size, ctx.device,
                                         "micro_batch")
    ctx.model = MicroBatchModule(ctx.model, ctx.loss_func, ctx.optim, outer, k, ctx.model_input_format,
                                 config.grad_sync, batch // k if batch is not None else None, item_weights,
                                 shared_inputs)
    if outer is not None:
        outer.settlers.append(ctx.model.settle)
    ctx.loss_func = micro_batch_loss(ctx.loss_func)
    ctx.items_weighted = True
    ctx.optim = outer
    ctx.args.use_optim_backward = True
    ctx.args.extras["micro_batch"] = {"num_micro_batch": k,
                                      "micro_batch_size": batch // k if batch is not None else None,
                                      "grad_sync": config.grad_sync}
