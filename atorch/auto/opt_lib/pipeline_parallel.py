"""pipeline_parallel: the model cut into stages automatically, trained with a pipeline schedule.

The cut: the model's repeated blocks (transformer layers) are assigned to ``pipeline``-size
contiguous stages so that the largest stage cost is as small as possible (``balance_stages``); the
cost of a block is its matmul parameter count (FLOPs per token are proportional to it), the layers
before the first block ride with the first stage and those after the last block (final norm, pooler,
LM head) with the last. ``pivots`` (AutoDist's ``pipeline_pivots``) names the first module of every
stage but the first instead. Which layers run before and which after the blocks is read from one
traced forward of a dataset row (``pipeline_structure``), so an ``nn.Linear`` input layer is placed like
an embedding.

How a stage runs the user's unchanged model: each stage is a copy of the model holding only its own
blocks' parameters (plus the layers before the blocks on the first stage and those after on the
last); what other stages hold is a placeholder without parameters (a pass-through for a block, a
stand-in returning zeros of the right shape for other layers; attribute reads are answered by a
meta-device copy). It runs the model's own ``forward`` on the batch: the first owned block takes the
activation received from the previous stage in place of its input (a forward pre-hook), and after
the last owned block the stage returns that block's hidden state (a forward hook ends the forward
early). Masks, positions and other inputs every block needs are recomputed from the batch on every
stage, so any model built as layers → one chain of repeated blocks → layers works, and the owned
blocks are real modules that tensor_parallel and checkpoint apply to as usual.

Only tensors cross a stage boundary (``torch.distributed.pipelining.PipelineStage``): an inner stage
sends its last block's hidden state; the last stage flattens whatever the model returns (an HF
``ModelOutput``, a tuple, a dict) with ``torch.utils._pytree`` and rebuilds that object before the
user's ``loss_func`` sees it. HF models are called with ``use_cache=False`` (when their forward takes
it and the batch does not set it): a KV cache is no tensor and training does not use one.

Tied weights (GPT-2's and BERT's input / output embeddings): the first stage holds the embedding, the
last the head, both from the same initial weight. After each schedule the copies' gradients are
summed over the pipeline group (stages without a use add zeros), so the copies stay equal; the
gradient norm counts the copy on the lowest stage only, and ``full_state_dict`` returns the user's
names, each once. Under mixed_parallel a tied weight stays whole (not split on the vocabulary).

Refused, each with a ``MethodConfigError`` naming the reason: encoder-decoder models (T5: the decoder
reads the encoder's output too, so a cut would carry two activations), models whose blocks are not
one chain (CLIP's two towers, layers with parameters between blocks, a block run twice), BatchNorm
(micro-batches change the batch statistics, so no schedule can match the full batch), a module shared
between a block and the rest of the model, and fp16 amp. Every ``model_input_format`` runs: a batch of
positional inputs (``model(x, y)``, nanoGPT's ``forward(idx, targets)``) reaches every stage whole, as a
dict of keywords or a single input does.

Schedules: ``"1F1B"`` (default; EPL's PreferBackward), ``"GPipe"`` (EPL's PreferForward),
``"Interleaved1F1B"`` (``stages_per_rank`` >= 2, needs that many blocks per rank). ``num_micro_batch``
as in EPL (default: the pipeline size × 2, at most the per-rank batch).

The seed's loop runs unchanged: ``model(**batch)`` runs the whole schedule (forward, loss on the last
stage, backward) and returns a ``PipelineOutput``; ``loss_func(batch, output)`` returns the step's mean
loss (the same on every stage); ``optim.backward(loss)`` scales the call's gradients as the loop scaled
that loss (a loop accumulating over calls divides it: ``PipelineModule.settle``, which the data-parallel
average waits for; ``result.args.use_optim_backward`` is True); ``optim.step()`` updates this stage's
parameters. In evaluation (``model.eval()`` or ``torch.no_grad()``) ``model(**batch)`` runs the
forward-only schedule: the loss and no backward, so a validation pass leaves the gradients as they were;
the returned ``PipelineOutput`` also reads through to the model's own output for the whole batch, merged
from the last stage's micro-batches and sent to every stage (``eval_outputs``: ``eval_outputs.py``).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from atorch.auto.gradients import mark_counted_elsewhere
from atorch.auto.loss_items import MicroBatchItemWeights
from atorch.auto.loss_probe import with_scale_probe
from atorch.auto.opt_lib.base import SHARDED_STAGES, SHARDED_STAGES_WHY, Optimization
from atorch.auto.opt_lib.eval_outputs import MicroOutputs
from atorch.auto.opt_lib.pipeline_structure import (
    BlockStructure,
    PassThrough,
    StandIn,
    canonical_names,
    check_supported,
    held_parameters,
    no_cache_kwargs,
    positional_names,
    refuse_collecting_switches,
    replace_everywhere,
    shared_between_stages,
    structure_from_order,
    trace_structure,
)
from atorch.auto.opt_lib.read_through import read_through
from atorch.auto.opt_lib.row_layout import check_rows_first
from atorch.auto.opt_lib.same_batch import check_same_batch
from atorch.distributed import mesh
from atorch.errors import MethodConfigError
from atorch.utils.batch import (
    batch_of_call,
    batch_size_of,
    equal_chunks,
    first_tensor,
    loss_value,
    on_rows,
    select_rows,
    tensors,
)
from atorch.utils.config import MethodConfig, option
from atorch.utils.meta_init import sample_values
from atorch.utils.modules import block_stack, full_state_dict

logger = logging.getLogger(__name__)

# schedules kept for batch shapes seen before (PipelineModule.schedule_for)
SCHEDULES_KEPT = 4
SCHEDULES = {"1F1B": "Schedule1F1B", "PreferBackward": "Schedule1F1B", "GPipe": "ScheduleGPipe",
             "PreferForward": "ScheduleGPipe", "Interleaved1F1B": "ScheduleInterleaved1F1B"}


@dataclass(frozen=True)
class PipelineParallelConfig(MethodConfig):
    schedule: Literal[tuple(SCHEDULES)] = option("1F1B", doc="pipeline schedule (PreferBackward = 1F1B, "
                                                 "PreferForward = GPipe are accepted aliases)")
    num_micro_batch: Optional[int] = option(None, doc="micro-batches per step; None: 2 x the pipeline size, at most "
                                            "the per-rank batch", minimum=1)
    pivots: Optional[tuple[str, ...]] = option(None, doc="the first block of every stage but the first; None: "
                                               "balanced by matmul parameters")
    stages_per_rank: Optional[int] = option(None, doc="stages per rank (>= 2 only with Interleaved1F1B); None: 2 with "
                                            "Interleaved1F1B, else 1", minimum=1)
    eval_outputs: bool = option(True, doc="in evaluation, also return the model's outputs for the whole batch on "
                                "every stage (merged from the last stage's micro-batches); False: the loss only, "
                                "no outputs kept or sent")


# --- the cut -------------------------------------------------------------------------------------
def module_cost(module: nn.Module) -> int:
    """Matmul parameters: FLOPs per token are proportional to them (embedding lookups are free)."""
    return sum(m.weight.numel() for m in module.modules()
               if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and getattr(m, "weight", None) is not None)


def balance_stages(costs: list[float], num_stages: int) -> list[int]:
    """Start index of each stage over items with ``costs``: contiguous, non-empty, minimising the
    largest stage cost (exact dynamic programme; the lists are short)."""
    n = len(costs)
    if num_stages > n:
        raise MethodConfigError("pipeline_parallel", f"{n} repeated blocks cannot fill {num_stages} pipeline stages: "
                                "each stage needs at least one; lower the 'pipeline' size of parallel_mode")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for end in range(s, n + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], prefix[end] - prefix[start])
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    starts, end = [], n
    for s in range(num_stages, 0, -1):
        starts.append(cut[s][end])
        end = cut[s][end]
    return starts[::-1]


@dataclass
class StageSplit:
    block_names: list[str]
    starts: list[int]     # block index where each stage begins
    costs: list[float]    # per stage

    @property
    def split_points(self) -> list[str]:
        return [self.block_names[i] for i in self.starts[1:]]

    @property
    def imbalance(self) -> float:
        return max(self.costs) / (sum(self.costs) / len(self.costs))


def plan_stages(model: nn.Module, num_stages: int) -> StageSplit:
    blocks = _blocks(model, num_stages)
    costs = [float(module_cost(m)) for _, m in blocks]
    head = float(module_cost(model) - sum(costs))  # embeddings are free; the LM head is not
    costs_with_ends = list(costs)
    costs_with_ends[-1] += head  # the head runs on the last stage
    starts = balance_stages(costs_with_ends, num_stages)
    stage_costs = [sum(costs_with_ends[a:b]) for a, b in zip(starts, starts[1:] + [len(costs)])]
    return StageSplit([n for n, _ in blocks], starts, stage_costs)


# --- the runtime ---------------------------------------------------------------------------------
@dataclass
class PipelineOutput:
    """What ``model(**batch)`` returns under pipeline parallelism: the step already ran. ``loss``: the
    step's mean loss, the same on every stage. ``outputs``: in evaluation, the model's own output for the
    whole batch on every stage (``eval_outputs``), which the object reads through to: ``output.logits``,
    ``output[0]``, and torch functions on a model that returns a tensor. A training call's outputs were
    spent by the backward the schedule ran inside it: ``None``."""

    loss: torch.Tensor
    outputs: Any = None

    def __getattr__(self, name: str) -> Any:
        outputs = self.__dict__.get("outputs")
        if outputs is None or name.startswith("__"):
            raise AttributeError(f"PipelineOutput has no {name!r}: {_NO_OUTPUTS_WHY}")
        return getattr(outputs, name)

    def __getitem__(self, key: Any) -> Any:
        if self.outputs is None:
            raise TypeError(f"PipelineOutput cannot be indexed: {_NO_OUTPUTS_WHY}")
        return self.outputs[key]

    def __iter__(self) -> Any:
        if self.outputs is None:
            raise TypeError(f"PipelineOutput cannot be unpacked: {_NO_OUTPUTS_WHY}")
        return iter(self.outputs)

    def __len__(self) -> int:
        if self.outputs is None:
            raise TypeError(f"PipelineOutput has no length: {_NO_OUTPUTS_WHY}")
        return len(self.outputs)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """torch functions on the output of a model that returns a tensor (``output.softmax(-1)`` reads
        through ``__getattr__``; ``torch.softmax(output, -1)``, ``output == labels`` come here)."""
        def unwrap(value: Any) -> Any:
            if isinstance(value, PipelineOutput):
                if not isinstance(value.outputs, torch.Tensor):
                    raise TypeError(f"{getattr(func, '__name__', func)} takes tensors, and this PipelineOutput "
                                    f"holds {type(value.outputs).__name__}: {_NO_OUTPUTS_WHY}")
                return value.outputs
            return value

        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))


_NO_OUTPUTS_WHY = ("under a pipeline a training call returns the step's loss only (output.loss: the schedule ran the "
                   "backward inside the call and spent the outputs); in evaluation (model.eval() or torch.no_grad()) "
                   "it reads through to the model's own output for the whole batch, unless the method's eval_outputs "
                   "is False")


@dataclass
class _PendingCall:
    """A training call whose gradients wait for the user's backward: the window's earlier gradients,
    per trained parameter, and what each ready hook captured when the call began."""

    earlier: list[Optional[torch.Tensor]]
    captured: list[Any]


# why a pipeline's returned module does not offer the user's model's methods (``read_through``)
PIPELINE_WHY = ("this process holds some of its stages, and the model's own methods and submodules would run or "
                "name layers other processes hold. Train and evaluate with result.model(batch) (it returns the loss, "
                "and in evaluation the model's outputs), "
                "export with result.model.save_pretrained(...)")


class PipelineModule(nn.Module):
    """This rank's stage(s) and the schedule that drives them; ``parameters()`` are the stage's."""

    def __init__(self, stage_modules: list, build_schedule: Callable[[int], Any], micro: int,
                 chunk_rows: Optional[int] = None, *, loss_func,
                 input_format: Optional[str], group, is_last: bool, shared: Optional[SharedWeights] = None,
                 item_weights: Optional[MicroBatchItemWeights] = None, eval_outputs: bool = True,
                 shared_inputs: frozenset[str] = frozenset()):
        super().__init__()
        self.stage_modules = nn.ModuleList(stage_modules)
        self.build_schedule = build_schedule  # (micro-batches, how each input splits) -> a schedule
        self.micro, self.chunk_rows = micro, chunk_rows
        self.schedules: collections.OrderedDict = collections.OrderedDict()  # batch shapes -> schedule
        self.user_loss = loss_func
        self.input_format = input_format
        self.group = group
        self.is_last = is_last
        self.shared = shared
        self.item_weights = item_weights  # the micro-batches' losses weighted by loss_items (atorch.auto.loss_items)
        self.eval_outputs = eval_outputs
        self.micro_outputs = MicroOutputs()  # the last stage's micro-batch outputs in evaluation
        self.shared_inputs = shared_inputs  # the inputs the data pipeline stacks no rows into (row_layout): whole
        self._batch: Any = None
        self._batch_rows: Optional[int] = None  # the batch's rows (batch_size_of), read by micro_loss
        self._pending: Optional[_PendingCall] = None
        self._ready_hooks: list[tuple[Callable[[Any], None], Optional[Callable[[], Any]]]] = []

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            stages = self.__dict__.get("_modules", {}).get("stage_modules")
            return read_through(self, name, stages[-1].model if stages else None, PIPELINE_WHY)

    def register_gradients_ready_hook(self, hook: Callable[[Any], None],
                                      capture: Optional[Callable[[], Any]] = None) -> None:
        """``hook(captured)`` runs when a training call's gradients are final (scaled as the user's
        backward says, added to the window's earlier ones: ``settle``); ``captured`` is what ``capture()``
        returned when that call began (the data-parallel average reads its sync switch there)."""
        self._ready_hooks.append((hook, capture))

    def forward(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        batch = batch_of_call(args, kwargs, self.input_format)
        refuse_collecting_switches("pipeline_parallel", batch, kwargs)
        first = _first_tensor(batch)
        rows = batch_size_of(batch, self._planned_rows(), self.shared_inputs)
        self._batch, self._batch_rows = batch, rows
        index = torch.arange(rows, device=first.device)
        losses: list = []
        inputs = dict(batch) if self.input_format == "unpack_dict" else {"input": batch}
        target = index if self.is_last else None
        # every stage gets the batch (its blocks may need masks or positions made from it)
        training = self.training and torch.is_grad_enabled()
        # the last stage keeps its micro-batches' outputs in evaluation only (a training call's are spent)
        self.micro_outputs.begin(not training and self.eval_outputs and self.is_last)
        if self.item_weights is not None:
            self.item_weights.begin(batch, self._micro_batches_for(rows), training)
        if training:
            self.settle()
            pending = _PendingCall(self._set_gradients_aside(), [capture() if capture else None
                                                                  for _, capture in self._ready_hooks])
            stashed = self.shared.stash() if self.shared else None
            self.schedule_for(batch, rows).step(target=target, losses=losses, return_outputs=False, **inputs)
            if self.shared:
                self.shared.sum_gradients(stashed)
            self._pending = pending
        else:  # evaluation (model.eval() or torch.no_grad()): forward only, no gradients touched
            self.schedule_for(batch, rows).eval(target=target, losses=losses, return_outputs=False, **inputs)
        if losses:
            loss = torch.stack([micro_loss.detach().float() for micro_loss in losses]).mean()
            loss = self.item_weights.mean(loss) if self.item_weights is not None else loss
        else:
            loss = torch.zeros((), device=index.device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1),
                       group=self.group)
        if training:
            return PipelineOutput(self._scale_probe(loss, pending))
        if not self.eval_outputs:
            return PipelineOutput(loss)
        return PipelineOutput(loss, self.micro_outputs.share(self.item_weights, dist.get_world_size(self.group) - 1,
                                                             self.group, first.device))

    # --- the user's backward on a loss whose backward already ran -------------------------------------
    def _scale_probe(self, loss: torch.Tensor, pending: "_PendingCall") -> torch.Tensor:
        """The step's loss as a tensor the user's loop can still transform and call backward on. The
        schedule ran backward on the loss itself; a loop that accumulates gradients divides it first
        (``loss / steps``), a weighted one multiplies it. The returned loss carries a probe (value 0,
        derivative 1), so the user's backward leaves d(their loss)/d(loss) in the probe's gradient:
        this call's gradients are scaled by it then, exactly as that backward would have scaled them."""
        def scale(factor: float) -> None:
            if self._pending is pending:
                self.settle(factor)

        return with_scale_probe(loss, scale)

    def settle(self, scale: float = 1.0) -> None:
        """Make the last training call's gradients final: scaled by ``scale`` (what the user's backward
        said; 1 where no backward came before the next call or the optimizer's step), added to those the
        window's earlier calls left (set aside while the schedule ran), then the ready hooks."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with torch.no_grad():
            for param, earlier in zip(self._trained_parameters(), pending.earlier):
                if param.grad is not None and scale != 1.0:
                    param.grad.mul_(scale)
                if earlier is not None:
                    if param.grad is not None:
                        earlier.add_(param.grad)
                    param.grad = earlier
        for (hook, _), captured in zip(self._ready_hooks, pending.captured):
            hook(captured)

    def _set_gradients_aside(self) -> list[Optional[torch.Tensor]]:
        """The gradients earlier calls of an accumulation window left, taken off the parameters so the
        schedule accumulates this call's alone (``settle`` adds them back)."""
        earlier = []
        for param in self._trained_parameters():
            earlier.append(param.grad)
            param.grad = None
        return earlier

    def _trained_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def schedule_for(self, batch: Any, rows: int) -> Any:
        """The schedule for this batch's shapes. A stage learns the shapes it exchanges on its schedule's
        first step and keeps receive buffers of those shapes, so batches padded to their own longest row
        (a collator's ``padding=True``) need a schedule per shape: built on a new shape (the stages then
        exchange its shapes once, one extra forward of each stage), the last ``SCHEDULES_KEPT`` kept for
        shapes that come again. Every rank of the pipeline gets the same batch, so all build together.
        ``rows``: the batch's rows, as ``forward`` read them (``batch_size_of``)."""
        shapes = tuple(tuple(t.shape) for t in tensors(batch))
        schedule = self.schedules.pop(shapes, None)
        if schedule is None:
            if self.schedules:
                logger.info("pipeline_parallel: a batch of new shapes %s: its stages exchange them once (padding "
                            "batches to a few fixed lengths saves that forward)", shapes)
            schedule = self.build_schedule(self._micro_batches_for(rows), self._chunk_spec(batch, rows))
        self.schedules[shapes] = schedule
        while len(self.schedules) > SCHEDULES_KEPT:
            self.schedules.popitem(last=False)
        return schedule

    def _planned_rows(self) -> Optional[int]:
        """A batch's rows as planned (the per-rank batch), which tells them from an input the rows share."""
        return self.chunk_rows * self.micro if self.chunk_rows else None

    def _chunk_spec(self, batch: Any, rows: int) -> dict:
        """How the schedule splits each input into micro-batches: the tensors that hold the batch's rows on
        their first dimension by rows, the others whole to every micro-batch (``holds_rows``: a mask shared
        by every row, as ``nn.Transformer.generate_square_subsequent_mask`` makes, was split by its own first
        dimension, and every micro-batch's call failed on its shape), and so are the inputs the data pipeline
        stacks no rows into (``shared_inputs``), whatever their shape."""
        specs = on_rows(lambda _: TensorChunkSpec(0), batch, rows, self.shared_inputs)
        specs = pytree.tree_map(lambda spec: spec if isinstance(spec, TensorChunkSpec) else _Replicate(), specs)
        return dict(specs) if self.input_format == "unpack_dict" else {"input": specs}

    def _micro_batches_for(self, rows: int) -> int:
        """The configured micro-batch count, or for a batch of other rows (an epoch's last batch, without
        drop_last) the fewest equal micro-batches no larger than the configured ones (``equal_chunks``):
        every micro-batch of one step must have the same shape, equal ones keep the step's mean loss the
        batch's, and none is larger than memory was planned for."""
        count = equal_chunks(rows, self.micro, self.chunk_rows)
        if count != self.micro:
            logger.info("pipeline_parallel: a batch of %d rows runs as %d micro-batches, not %d", rows, count,
                        self.micro)
        return count

    @property
    def is_first(self) -> bool:
        return dist.get_rank(self.group) == 0

    def micro_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The user's loss_func on one micro-batch, given the user's own output object (the last
        stage sent only its tensors through the schedule)."""
        user_output = self.stage_modules[-1].rebuild_output(output)
        rows = select_rows(self._batch, index, self._batch_rows, self.shared_inputs)
        self.micro_outputs.keep(int(index[0]), user_output, len(index))
        loss = loss_value(self.user_loss(rows, user_output))
        return self.item_weights.weigh(rows, loss, int(index[0])) if self.item_weights is not None else loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights, gathered on every rank of the pipeline (names as in the user's
        model; a weight tied across stages is equal on all of them, any copy serves)."""
        mine = {}
        for module in self.stage_modules:
            mine.update({k.removeprefix("model."): v for k, v in full_state_dict(module).items()})
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        out = {}
        for part in gathered:
            out.update(part)
        return out


class SharedWeights:
    """Weights that several stages hold a copy of (tied input / output embeddings): after each
    schedule, the copies' gradients are summed over the pipeline group (a stage using its copy
    nowhere adds zeros), so every copy gets the gradient of the one weight and the copies stay
    equal. Only the copy on the lowest stage holding it counts in the gradient norm.

    Parameters are looked up by name when first needed, after tensor parallelism or checkpointing
    may have replaced or re-registered them."""

    def __init__(self, stages: list, holders: dict[str, list[int]], group, device: torch.device):
        self.stages = stages
        self.names = sorted(holders)
        self.holders = holders
        self.group = group
        self.device = device
        self._copies: Optional[dict[str, list[nn.Parameter]]] = None
        self._shapes: dict[str, torch.Size] = {}

    def __bool__(self) -> bool:
        return bool(self.names)

    def copies(self) -> dict[str, list[nn.Parameter]]:
        if self._copies is None:
            self._copies = {name: [] for name in self.names}
            for stage in self.stages:
                for name, param in stage.current_parameters().items():
                    if name in self._copies:
                        self._copies[name].append(param)
                        if stage.index != min(self.holders[name]):
                            mark_counted_elsewhere(param)
            self._shapes = self._agree_on_shapes()
            self._agree_on_values()
        return self._copies

    @torch.no_grad()
    def _agree_on_values(self) -> None:
        """Every copy takes the value of the lowest stage holding it. A model built whole has equal
        copies already; one built on the meta device initialises each stage's copy in that stage's
        module (an input embedding on one, an output layer on another), so they start equal only
        from here."""
        for name in self.names:
            owner = min(self.holders[name])
            source = dist.get_global_rank(self.group, owner % dist.get_world_size(self.group))
            mine = self._copies[name]
            value = _local(mine[0]).detach().float() if mine else torch.empty(self._shapes[name], device=self.device)
            dist.broadcast(value, src=source, group=self.group)
            for param in mine:
                _local(param).copy_(value)

    def _agree_on_shapes(self) -> dict[str, torch.Size]:
        mine = {name: tuple(_local(params[0]).shape) for name, params in self._copies.items() if params}
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        shapes: dict[str, set] = {}
        for part in gathered:
            for name, shape in part.items():
                shapes.setdefault(name, set()).add(shape)
        uneven = {name: sorted(s) for name, s in shapes.items() if len(s) > 1}
        if uneven:
            raise MethodConfigError("pipeline_parallel", f"weights tied between pipeline stages are laid out "
                                    f"differently on them {uneven} (tensor parallelism split one copy and not the "
                                    f"other); untie them")
        return {name: torch.Size(next(iter(s))) for name, s in shapes.items()}

    def stash(self) -> dict[str, list]:
        """Set the copies' gradients aside, so only this step's contributions are summed (the
        stashed, already equal part is added back after)."""
        stashed = {}
        for name, params in self.copies().items():
            stashed[name] = [p.grad for p in params]
            for p in params:
                p.grad = None
        return stashed

    @torch.no_grad()
    def sum_gradients(self, stashed: dict[str, list]) -> None:
        copies = self.copies()
        parts = []
        for name in self.names:
            grads = [_local(p.grad) for p in copies[name] if p.grad is not None]
            total = torch.zeros(self._shapes[name], dtype=torch.float32, device=self.device)
            for grad in grads:
                total += grad.float()
            parts.append(total.flatten())
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for name in self.names:
            size = self._shapes[name].numel()
            summed = flat[offset: offset + size].view(self._shapes[name])
            offset += size
            for param, old in zip(copies[name], stashed[name]):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                _local(param.grad).copy_(summed)
                if old is not None:
                    param.grad += old


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def pipeline_loss(batch: Any, output: Any) -> torch.Tensor:
    """The loss_func returned under pipeline parallelism: the schedule computed it already."""
    if isinstance(output, PipelineOutput):
        return output.loss
    raise TypeError("under pipeline_parallel, loss_func expects the PipelineOutput that model(...) returned")


def _first_tensor(data: Any) -> torch.Tensor:
    tensor = first_tensor(data)
    if tensor is None:
        raise MethodConfigError("pipeline_parallel",
                                f"the batch holds no tensor to split into micro-batches: {type(data)}")
    return tensor


# --- the method ----------------------------------------------------------------------------------
class PipelineParallelOptimization(Optimization):
    name = "pipeline_parallel"
    distributed_only = True
    config_class = PipelineParallelConfig
    stages = ("pipeline",)
    reads = ("model", "loss_func", "model_input_format", "amp_dtype", "per_rank_batch_size", "device", "dataset",
             "dataloader_args", "user_prepare_input", "input_dtype", "loss_items")
    writes = ("model", "loss_func", "model_parallel", "backward_in_forward", "items_weighted", "grad_partition_group",
              "settlers", "args")
    mesh_dims = ("pipeline",)
    excludes = {"pipeline parallel": "mixed_parallel already includes pipeline parallel",
                "micro-batches": "a pipeline splits the batch into micro-batches itself: set its num_micro_batch",
                SHARDED_STAGES: SHARDED_STAGES_WHY}

    def normalize(self, config: Any) -> PipelineParallelConfig:
        config = super().normalize(config)
        stages_per_rank(config, self.name)
        return config

    def transform(self, ctx, config: PipelineParallelConfig) -> None:
        ctx.add_wrapper("pipeline", self.name, lambda ctx: apply_pipeline(ctx, config))


def stages_per_rank(config: PipelineParallelConfig, method: str) -> int:
    """The stages each rank holds; MethodConfigError unless the schedule and the count go together."""
    interleaved = SCHEDULES[config.schedule] == "ScheduleInterleaved1F1B"
    per_rank = config.stages_per_rank or (2 if interleaved else 1)
    if per_rank < 2 and interleaved or per_rank > 1 and not interleaved:
        raise MethodConfigError(method,
                                "stages_per_rank above 1 goes with schedule 'Interleaved1F1B' (and only with it)")
    return per_rank


def apply_pipeline(ctx, config: PipelineParallelConfig) -> None:
    pp = mesh.parallel_group_size("pipeline")
    if pp <= 1:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:  # resolve_strategy refuses this first; a wrapper applied without it still must not no-op
            dims = list(mesh.parallel_config().dims) if mesh.parallel_config() else None
            raise MethodConfigError("pipeline_parallel", f"needs the 'pipeline' dimension of parallel_mode above 1, "
                                    f"but parallel_mode is {dims} on {world} ranks; add ('pipeline', N) to "
                                    "parallel_mode")
        logger.warning("pipeline_parallel: one process: nothing to split")
        return
    if ctx.amp_dtype == torch.float16:
        raise MethodConfigError("pipeline_parallel",
                                "fp16 amp's loss scaling inside the schedule is not supported; use bf16")
    shared_inputs = check_rows_first(ctx, "pipeline_parallel")
    group = mesh.parallel_group("pipeline")
    per_rank = stages_per_rank(config, "pipeline_parallel")
    num_stages = pp * per_rank
    structure, bounds, holders = cut_stages(ctx, num_stages, config.pivots or (),
                                            f" ({pp} pipeline ranks x {per_rank} per rank)")
    per_rank_batch = ctx.per_rank_batch_size
    micro = config.num_micro_batch or min(2 * pp, per_rank_batch)
    if per_rank_batch % micro:
        raise MethodConfigError("pipeline_parallel",
                                f"the per-rank batch {per_rank_batch} does not split into {micro} micro-batches")
    rank = dist.get_rank(group)
    indices = [rank + pp * v for v in range(per_rank)]
    modules = [StageModule(ctx.model if i == indices[-1] else copy.deepcopy(ctx.model), structure, i, bounds,
                           ctx.model_input_format, holders) for i in indices]
    holder: dict = {}
    loss_fn = lambda output, index: holder["module"].micro_loss(output, index)  # noqa: E731
    schedule_cls = getattr(schedules, SCHEDULES[config.schedule])

    def build_schedule(micro_batches: int, kwargs_chunk_spec: Optional[dict] = None) -> Any:
        for stage_module in modules:
            stage_module.agree_on_first_input(mesh.parallel_group("tensor"))
        stages = [PipelineStage(m, i, num_stages, ctx.device, group=group) for m, i in zip(modules, indices)]
        try:
            return schedule_cls(stages if len(stages) > 1 else stages[0], micro_batches, loss_fn=loss_fn,
                                kwargs_chunk_spec=kwargs_chunk_spec)
        except ValueError as error:  # a count the schedule cannot run (interleaving needs enough of them)
            raise MethodConfigError("pipeline_parallel", f"{config.schedule} cannot run {micro_batches} "
                                    f"micro-batches ({error}); a batch whose rows do not divide into {micro} "
                                    "micro-batches (an epoch's last) runs another count: set drop_last=True in "
                                    "dataloader_args") from error

    shared = SharedWeights(modules, holders, group, ctx.device)
    item_weights = MicroBatchItemWeights(ctx.loss_items, mesh.data_parallel_size(), ctx.device, "pipeline_parallel")
    module = PipelineModule(modules, build_schedule, micro, per_rank_batch // micro, loss_func=ctx.loss_func,
                            input_format=ctx.model_input_format,
                            group=group, is_last=(num_stages - 1) in indices, shared=shared, item_weights=item_weights,
                            eval_outputs=config.eval_outputs, shared_inputs=shared_inputs)
    holder["module"] = module
    check_same_batch(module, group, "pipeline_parallel", "pipeline")
    ctx.settlers.append(module.settle)
    ctx.model = module
    ctx.loss_func = pipeline_loss
    ctx.model_parallel = True
    ctx.backward_in_forward = True
    ctx.items_weighted = True
    ctx.grad_partition_group = group
    ctx.args.use_optim_backward = True
    ctx.args.extras["pipeline"] = {"stages": num_stages, "stage_indices": indices, "num_micro_batch": micro,
                                  "schedule": config.schedule, "blocks_per_stage": [b - a for a, b in bounds],
                                  "before_blocks": structure.before, "after_blocks": structure.after,
                                  "tied": {name: stages for name, stages in holders.items()}}


def cut_stages(ctx, num_stages: int, pivots: Iterable[str] = (),
               detail: str = "") -> tuple[BlockStructure, list[tuple[int, int]], dict[str, list[int]]]:
    """The model cut into ``num_stages`` stages at its repeated blocks (shared with ds_3d_parallel): the
    block structure read from a traced forward, each stage's [first, end) block, and the weights that
    several stages hold a copy of (``shared_between_stages``). MethodConfigError where no cut serves."""
    blocks = _blocks(ctx.model, num_stages, detail)
    structure = block_structure(ctx, blocks)
    starts = _stage_starts(ctx.model, blocks, tuple(pivots), num_stages)
    bounds = list(zip(starts, starts[1:] + [len(blocks)]))
    return structure, bounds, shared_between_stages(ctx.model, structure, bounds)


def _stage_starts(model: nn.Module, blocks: list, pivots: tuple, num_stages: int) -> list[int]:
    """The first block of every stage: the pivots given, or the balanced cut."""
    if pivots:
        return _starts_from_pivots(blocks, pivots, num_stages)
    split = plan_stages(model, num_stages)
    logger.info("pipeline_parallel: stages start at %s (cost imbalance max/mean %.2f)", split.split_points,
                split.imbalance)
    return split.starts


def block_structure(ctx, blocks: list[tuple[str, nn.Module]]) -> BlockStructure:
    """Which layers run before and after the blocks, from one traced forward of a sample row of the
    dataset (registration order when there is no dataset to take it from)."""
    check_supported(ctx.model, blocks)
    sample = ctx.sample_batch()
    if sample is None:
        logger.info("pipeline_parallel: no dataset to trace a forward with; layers registered before the first "
                    "block are taken to run before it")
        return structure_from_order(ctx.model, blocks)
    def run(model: nn.Module) -> Any:
        with sample_values(model):  # a model still on the meta device runs on sample values
            return call_stage_model(model, sample, ctx.model_input_format)

    return trace_structure(ctx.model, blocks, run)


def call_stage_model(model: nn.Module, batch: Any, input_format: Optional[str]) -> Any:
    """The user's model called on a batch as the user calls it, without a KV cache."""
    if input_format == "unpack_dict":
        return model(**batch, **no_cache_kwargs(model, batch))
    if input_format == "unpack_sequence":
        return model(*batch, **no_cache_kwargs(model, positional_names(model, len(batch))))
    return model(batch)


def _blocks(model: nn.Module, num_stages: int = 1, detail: str = "") -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order; MethodConfigError unless there are ``num_stages`` (one
    per stage at least)."""
    blocks = block_stack(model)
    if len(blocks) < max(num_stages, 1):
        check_supported(model, blocks)  # a model no cut can serve is refused for that, not for its block count
        what = f"{len(blocks)} ({type(blocks[0][1]).__name__})" if blocks else "none"
        raise MethodConfigError(
            "pipeline_parallel",
            f"needs at least one repeated block per stage to cut the model at (a module class with parameters that "
            f"occurs at least twice: the transformer layers): {num_stages} stage(s){detail}, found {what}; lower the "
            f"'pipeline' size of parallel_mode, or use a model with at least {num_stages} repeated blocks (pivots, the "
            "first block of every stage but the first, choose among the blocks found)")
    return blocks


def _starts_from_pivots(blocks: list, pivots: tuple, num_stages: int) -> list[int]:
    names = [n for n, _ in blocks]
    if len(pivots) != num_stages - 1:
        raise MethodConfigError("pipeline_parallel",
                                f"{len(pivots)} pivots make {len(pivots) + 1} stages; {num_stages} are needed")
    unknown = [p for p in pivots if p not in names]
    if unknown:
        raise MethodConfigError("pipeline_parallel", f"pivots {unknown} are not blocks; blocks: {names}")
    starts = [0] + [names.index(p) for p in pivots]
    if starts != sorted(set(starts)):
        raise MethodConfigError("pipeline_parallel",
                                f"pivots {list(pivots)} must be distinct, in model order, after the first block")
    return starts




_TENSOR = object()  # marks where a tensor leaf of the last stage's output was


class _StageExit(Exception):
    def __init__(self, output: Any):
        super().__init__("stage output")
        self.output = output


class StageModule(nn.Module):
    """One pipeline stage of the user's model (see the module docstring)."""

    def __init__(self, model: nn.Module, structure: BlockStructure, index: int, bounds: list[tuple[int, int]],
                 input_format: Optional[str], tied: Iterable[str] = ()):
        super().__init__()
        self.index = index
        self.is_first, self.is_last = index == 0, index == len(bounds) - 1
        self.model = model
        self.input_format = input_format
        self._incoming: Optional[torch.Tensor] = None
        self._output_spec: Any = None
        self.agree_group: Optional[dist.ProcessGroup] = None  # see agree_on_first_input
        blocks = [(name, model.get_submodule(name)) for name, _ in structure.blocks]
        structure = dataclasses.replace(structure, blocks=blocks)
        owned = range(*bounds[index])
        canonical = canonical_names(model)
        held = held_parameters(model, structure, owned, self.is_first, self.is_last)
        self._prune(structure, owned)
        held_ids = {id(p) for p in held.values()}
        self.names = {path: canonical[id(p)] for path, p in model.named_parameters(remove_duplicate=False)
                      if id(p) in held_ids}
        tied = set(tied)  # modules holding a weight tied to another stage (tensor_parallel keeps them whole)
        self.tied_modules = {f"model.{path.rpartition('.')[0]}" for path, name in self.names.items() if name in tied}
        first, last = structure.blocks[owned.start][1], structure.blocks[owned.stop - 1][1]
        if not self.is_first:
            first.register_forward_pre_hook(self._take_incoming, with_kwargs=True)
            # the block before it (a pass-through here) hands on the received activation too: a block the
            # user's own code checkpoints (timm's checkpoint_seq, HF's gradient checkpointing) is recomputed
            # in backward from the input it was called with, after this stage's forward has returned
            self.model.get_submodule(structure.blocks[owned.start - 1][0]).register_forward_hook(self._hand_on)
        if not self.is_last:
            last.register_forward_hook(self._leave)

    def _prune(self, structure: BlockStructure, owned: range) -> None:
        """Blocks of other stages become pass-throughs, units held elsewhere stand-ins."""
        for position, (_, block) in enumerate(structure.blocks):
            if position not in owned:
                replace_everywhere(self.model, block, PassThrough(block, structure.block_output_len))
        kept = set(structure.before if self.is_first else []) | set(structure.after if self.is_last else [])
        for unit in dict.fromkeys(structure.before + structure.after):
            if unit not in kept:
                module = self.model.get_submodule(unit)
                replace_everywhere(self.model, module, StandIn(module))

    def current_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters by the user's (canonical) name, as registered now."""
        out = {}
        for path, param in self.model.named_parameters():
            name = self.names.get(path.replace("_checkpoint_wrapped_module.", ""))
            if name is not None:
                out[name] = param
        return out

    def _take_incoming(self, module, args, kwargs):
        if self._incoming is None:  # a recomputation in backward: its saved input is the received activation
            return None
        if args:
            return (self._incoming,) + tuple(args[1:]), kwargs
        return args, dict(kwargs, hidden_states=self._incoming)

    def _hand_on(self, module, args, output):
        if self._incoming is None:
            return None
        return (self._incoming,) + tuple(output[1:]) if isinstance(output, tuple) else self._incoming

    @staticmethod
    def _leave(module, args, output):
        raise _StageExit(tensors(output)[0])

    def agree_on_first_input(self, group: Optional[dist.ProcessGroup]) -> None:
        """Make the ranks of ``group`` (this stage's tensor group) run their first call on equal inputs.

        The schedule's first call of a later stage infers the shapes it will exchange by running the
        stage on tensors it allocates and never fills, so each tensor rank holds different bytes. A
        stage whose control flow depends on the values (a router sending tokens to experts) then takes
        different branches on its tensor ranks, whose collectives no longer match, and every rank
        waits. One broadcast on that call makes the bytes equal; later calls receive equal
        activations from equal upstream ranks."""
        self.agree_group = None if self.is_first else group

    def _agree(self, received: tuple[torch.Tensor, ...]) -> None:
        group, self.agree_group = self.agree_group, None
        with torch.no_grad():
            for tensor in received:
                dist.broadcast(tensor, group_src=0, group=group)

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        if self.agree_group is not None:
            self._agree(received)
        self._incoming = received[0] if received else None
        try:
            output = call_stage_model(self.model, inputs if self.input_format == "unpack_dict" else inputs["input"],
                                      self.input_format)
        except _StageExit as exit_:
            return exit_.output
        finally:
            self._incoming = None
        return self._flatten_output(output)

    def _flatten_output(self, output: Any) -> tuple[torch.Tensor, ...]:
        """Only tensors cross a schedule: keep the output's structure and its other leaves (None, a
        cache object) here, to rebuild the user's object for the loss."""
        leaves, spec = pytree.tree_flatten(output)
        self._output_spec = (spec, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def rebuild_output(self, flat: Any) -> Any:
        """The user's output object from the tensors the schedule hands the loss function (a lone
        tensor when there was one)."""
        given = iter((flat,) if isinstance(flat, torch.Tensor) else flat)
        spec, others = self._output_spec
        return pytree.tree_unflatten([next(given) if other is _TENSOR else other for other in others], spec)
