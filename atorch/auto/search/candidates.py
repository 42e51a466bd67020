"""The candidate strategies for this world size, model and machine, and the rules that prune them.

A candidate is a point in six dimensions: the parallel layout (tensor and pipeline sizes, the rest
data parallel), sharding over the data dimension (ddp / zero1 / zero2 / fsdp), precision (fp32 /
amp bf16 / amp fp16 / half), activation checkpointing (off / on the main repeated block), micro-
batches per per-rank batch (1 / 2 / 4 / 8, gradient accumulation inside one step) and compute
methods (module_replace, native_dynamo). A split under fsdp also comes with its gradients synchronised
at each micro-step (micro_batch's ``grad_sync="each_micro_step"``, label ``mb2s``: sharded gradients
between micro-steps, more reduce-scatters). Every rule that removes a point lives in ``RULES`` below,
with the reason the report shows.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from atorch.auto import opt_lib
from atorch.auto.opt_lib.compat import check_compatible
from atorch.auto.opt_lib.micro_batch import EACH_MICRO_STEP, LAST_MICRO_STEP
from atorch.auto.search.analyser import ModelProfile
from atorch.auto.search.layouts import layouts_for, micro_batches
from atorch.auto.strategy import Strategy, StrategyItem
from atorch.errors import AtorchError, InputError

logger = logging.getLogger(__name__)

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "half_bf16")
COMPUTE_METHODS = ("module_replace", "native_dynamo")
PRECISION_METHODS = {"amp_bf16": ("amp_native", {"dtype": torch.bfloat16}),
                     "amp_fp16": ("amp_native", {"dtype": torch.float16}),
                     "half_bf16": ("half", "bf16")}
LAYOUT_METHODS = ("tensor_parallel", "pipeline_parallel", "mixed_parallel")
MICRO_BATCHES = (1, 2, 4, 8)  # micro-steps per per-rank batch (micro_batch's num_micro_batch; 1: unsplit)
# Shardings whose split is also searched with its gradients reduce-scattered at each micro-step. Only fsdp:
# the memory model holds zero2's whole gradients through its backward anyway (its parameters stay gathered,
# ``cost_model.estimate``), so there each-step sync would only add communication; DDP / zero1 keep whole
# gradients on every rank, where it is all-reduce after all-reduce. Both syncs are always enumerated (the
# estimate is cheap); ``needless_split`` leaves the each-step one out of the dry runs where the last-step
# one is predicted to fit, since it communicates more for the same numerics: it is tried only where memory
# asks for it.
SYNC_SEARCHED = ("fsdp",)
SEARCHED = {"zero1", "zero2", "fsdp", "amp_native", "half", "checkpoint", "micro_batch", *COMPUTE_METHODS,
            *LAYOUT_METHODS}


@dataclass(frozen=True)
class Candidate:
    sharding: str = "ddp"
    precision: str = "fp32"
    checkpoint: bool = False
    compute: tuple[str, ...] = ()
    forced: tuple[StrategyItem, ...] = ()  # items the user forced with ``included``
    block: Union[str, tuple[str, ...], None] = field(default=None, compare=False)  # class(es) of the layers
    tensor: int = 1    # tensor-parallel size
    pipeline: int = 1  # pipeline-parallel size
    micro: int = 1     # micro-batches per per-rank batch (micro_batch); 1: the batch in one piece
    shard: int = 0     # fsdp over this many ranks (a node), replicated across: hybrid sharding; 0: all data ranks
    grad_sync: str = LAST_MICRO_STEP  # with micro > 1: gradients reduced at the last micro-step, or at each

    @property
    def label(self) -> str:
        sharding = f"hsdp{self.shard}" if self.shard else self.sharding
        parts = [sharding, self.precision] + (["ckpt"] if self.checkpoint else [])
        sync = "s" if self.grad_sync == EACH_MICRO_STEP else ""
        parts += [f"mb{self.micro}{sync}"] * (self.micro > 1) + list(self.compute)
        parts += [f"tp{self.tensor}"] * (self.tensor > 1) + [f"pp{self.pipeline}"] * (self.pipeline > 1)
        parts += [item.name for item in self.forced]
        return "+".join(parts)

    @property
    def block_classes(self) -> tuple[str, ...]:
        if not self.block:
            return ()
        return self.block if isinstance(self.block, tuple) else (self.block,)

    @property
    def layout_method(self) -> Optional[str]:
        if self.tensor > 1 and self.pipeline > 1:
            return "mixed_parallel"
        if self.tensor > 1:
            return "tensor_parallel"
        return "pipeline_parallel" if self.pipeline > 1 else None

    def data_size(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline)

    def methods(self) -> set[str]:
        """The method names this candidate uses (for excluded / included)."""
        used = {self.sharding, *self.compute} | ({"checkpoint"} if self.checkpoint else set())
        used |= {"micro_batch"} if self.micro > 1 else set()
        if self.precision != "fp32":
            used.add(PRECISION_METHODS[self.precision][0])
        if self.layout_method:
            used.add(self.layout_method)
        return used

    def strategy(self, world_size: int) -> Strategy:
        """The strategy this candidate stands for on ``world_size`` ranks (configs not yet normalised)."""
        items: list = []
        if world_size > 1:
            dims = [(n, s) for n, s in (("tensor", self.tensor), ("pipeline", self.pipeline)) if s > 1]
            data = [("data", self.data_size(world_size))]
            if self.shard:  # zero first: its ranks are neighbours (one node)
                data = [("zero", self.shard), ("data", self.data_size(world_size) // self.shard)]
            items.append(("parallel_mode", (dims + data, None)) if dims or self.shard else "parallel_mode")
        if self.precision in PRECISION_METHODS:
            items.append(PRECISION_METHODS[self.precision])
        if self.checkpoint:
            items.append(("checkpoint", self.block_classes))
        if self.sharding == "fsdp":
            items.append(("fsdp", {"atorch_wrap_cls": self.block_classes} if self.block else {}))
        elif self.sharding in ("zero1", "zero2"):
            items.append(self.sharding)
        if self.layout_method:
            items.append(self.layout_method)
        if self.micro > 1:
            config = {"num_micro_batch": self.micro}
            if self.grad_sync != LAST_MICRO_STEP:
                config["grad_sync"] = self.grad_sync
            items.append(("micro_batch", config))
        items.extend(self.compute)
        items.extend(self.forced)
        return Strategy(items)


@dataclass
class SearchSpace:
    world_size: int
    device: torch.device
    profile: ModelProfile
    excluded: frozenset = frozenset()
    included: Strategy = field(default_factory=Strategy)  # every candidate has these methods
    per_rank_batch: int = 1  # under pure data parallelism
    ranks_per_node: int = 0  # 0: one node; else hybrid sharding (shard in a node, replicate across) is a candidate
    # why micro-batches (micro_batch, pipelines) cannot split this data pipeline's batches ("": they can):
    # it stacks an input's rows on a dimension other than the first (row_layout.check_rows_first)
    rows_elsewhere: str = ""


def _method_unavailable(name: str) -> Optional[str]:
    try:
        method = opt_lib.get_optimization(name)
    except AtorchError as error:
        return str(error)
    return method.requirements(method.normalize(None) if name not in ("checkpoint", "module_replace") else None)


def _precision_unavailable(precision: str, device: torch.device) -> Optional[str]:
    if precision == "amp_fp16" and device.type != "cuda":
        return "fp16 autocast is a GPU method (slow emulation on CPU)"
    if precision in ("amp_bf16", "half_bf16") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16"
    if precision == "half_bf16":
        return "pure half precision changes training numerics; only with included=['half']"
    return None


Rule = Callable[[Candidate, SearchSpace], Optional[str]]


def _rule_single_process(c: Candidate, space: SearchSpace) -> Optional[str]:
    if space.world_size == 1 and c.sharding != "ddp":
        return "sharding needs several data-parallel ranks"
    return None


def _rule_excluded(c: Candidate, space: SearchSpace) -> Optional[str]:
    hit = sorted(c.methods() & space.excluded)
    return f"excluded: {hit}" if hit else None


def _rule_included(c: Candidate, space: SearchSpace) -> Optional[str]:
    names = set(space.included.names())
    missing = sorted((names & SEARCHED) - c.methods())
    return f"lacks included {missing}" if missing else None


def _rule_layout(c: Candidate, space: SearchSpace) -> Optional[str]:
    """Tensor / pipeline layouts the model and batch support, with the sharding that composes."""
    if c.tensor * c.pipeline == 1:
        return None
    facts = space.profile.layouts
    reason = facts.reason(c.tensor, c.pipeline) if facts else "the model's layouts were not analysed"
    if reason:
        return reason
    if c.sharding not in ("ddp", "zero1"):
        return f"{c.sharding} is not searched with tensor / pipeline layouts (zero1 composes on the data dimension)"
    if c.sharding == "zero1" and c.data_size(space.world_size) == 1:
        return "zero1 needs a data dimension above 1"
    if c.pipeline > 1:
        if c.precision == "amp_fp16":
            return "pipeline schedules do not run fp16 loss scaling"
        batch = space.per_rank_batch * c.tensor * c.pipeline
        micro = micro_batches(c.pipeline, batch)
        if batch % micro:
            return f"the per-data-rank batch {batch} does not split into {micro} micro-batches"
    return None


def _rule_micro_batch(c: Candidate, space: SearchSpace) -> Optional[str]:
    """Micro-batches on pure data parallelism only, and only counts that divide the per-rank batch."""
    if c.micro == 1:
        return None
    if c.tensor * c.pipeline > 1:
        return "micro_batch is searched on pure data parallelism (a pipeline splits its batch itself)"
    if space.per_rank_batch % c.micro:
        return f"the per-rank batch {space.per_rank_batch} does not split into {c.micro} micro-batches"
    return None


def _rule_rows_first(c: Candidate, space: SearchSpace) -> Optional[str]:
    """Micro-batches (micro_batch's, a pipeline's) take rows on each input's first dimension: not searched
    where the data pipeline stacks them elsewhere (a sequence-first layout), which applying them refuses."""
    if space.rows_elsewhere and (c.micro > 1 or c.pipeline > 1):
        return space.rows_elsewhere
    return None


def _rule_grad_sync(c: Candidate, space: SearchSpace) -> Optional[str]:
    """Gradients synchronised at each micro-step: a split under fsdp / zero2 (``SYNC_SEARCHED``)."""
    if c.grad_sync == LAST_MICRO_STEP:
        return None
    if c.micro == 1:
        return "grad_sync needs micro-batches"
    if c.sharding not in ("fsdp", "zero2"):
        return f"each-micro-step sync under {c.sharding} only adds communication (gradients are whole on every rank)"
    return None


def needless_split(c: Candidate, fits: Callable[[Candidate], bool]) -> Optional[str]:
    """Why a split need not be dry-run: the same candidate with fewer micro-batches is predicted to fit
    (a split only adds per-micro-step overhead then), or, for one synchronising gradients at each
    micro-step, the same split synchronising at the last (which communicates less). Applied after the
    estimate, with its predictions."""
    if c.grad_sync != LAST_MICRO_STEP and fits(dataclasses.replace(c, grad_sync=LAST_MICRO_STEP)):
        return "the split fits with gradients synchronised at the last micro-step"
    fewer = next((m for m in MICRO_BATCHES if m < c.micro and fits(dataclasses.replace(c, micro=m))), None)
    if fewer is None:
        return None
    return "the batch fits unsplit" if fewer == 1 else f"the batch fits in {fewer} micro-batches"


def _rule_checkpoint_needs_block(c: Candidate, space: SearchSpace) -> Optional[str]:
    if c.checkpoint and not space.profile.main_block:
        return "no repeated block to checkpoint"
    return None


def _rule_compatible(c: Candidate, space: SearchSpace) -> Optional[str]:
    items = []
    for item in c.strategy(space.world_size):
        if item.name != "parallel_mode":
            items.append((item.name, opt_lib.get_optimization(item.name).normalize(item.config)))
    try:
        check_compatible(items)
    except AtorchError as error:
        return str(error)
    return None


RULES: tuple[Rule, ...] = (_rule_single_process, _rule_excluded, _rule_included, _rule_checkpoint_needs_block,
                           _rule_layout, _rule_micro_batch, _rule_rows_first, _rule_grad_sync, _rule_compatible)


def enumerate_candidates(space: SearchSpace) -> tuple[list[Candidate], dict[str, str]]:
    """(valid candidates, {label: why not} for the rest and for unavailable methods)."""
    skipped: dict[str, str] = {}
    shardings = [s for s in SHARDINGS if s == "ddp" or not _note(skipped, s, _method_unavailable(s))]
    precision_names = [p for p in PRECISIONS if not _note(skipped, p, _precision_unavailable(p, space.device))]
    included_names = set(space.included.names())
    if "half" in included_names and "half_bf16" not in precision_names:
        precision_names.append("half_bf16")
    compute = [m for m in COMPUTE_METHODS if not _note(skipped, m, _method_unavailable(m))]
    forced = tuple(_forced_items(space.included))
    classes = space.profile.block_classes
    block = classes if len(classes) > 1 else space.profile.main_block
    # compute methods forced by ``included`` are in every candidate; the others are tried as
    # refinements of the winner (their effect is not predictable from the single-rank profile)
    forced_compute = tuple(m for m in compute if m in included_names)
    candidates = []
    layouts = layouts_for(space.world_size) if space.world_size > 1 else [(1, 1)]
    for (tensor, pipeline), sharding, precision, ckpt, micro in itertools.product(
            layouts, shardings, precision_names, (False, True), MICRO_BATCHES):
        candidate = Candidate(sharding, precision, ckpt, forced_compute, forced, block, tensor, pipeline, micro)
        reason = next((why for rule in RULES if (why := rule(candidate, space))), None)
        if reason:
            skipped[candidate.label] = reason
        else:
            candidates.append(candidate)
    candidates += [s for s in sync_candidates(candidates) if not any(rule(s, space) for rule in RULES)]
    candidates += [h for h in hybrid_candidates(candidates, space.world_size, space.ranks_per_node)
                   if not any(rule(h, space) for rule in RULES)]
    if not candidates:
        raise InputError(f"no candidate strategy is valid for world size {space.world_size}: {skipped}")
    return candidates, skipped


def sync_candidates(candidates: list[Candidate]) -> list[Candidate]:
    """Each split under a ``SYNC_SEARCHED`` sharding once more with its gradients synchronised at each
    micro-step (pure data parallelism: the splits that are searched)."""
    return [dataclasses.replace(c, grad_sync=EACH_MICRO_STEP) for c in candidates
            if c.micro > 1 and c.sharding in SYNC_SEARCHED and c.grad_sync == LAST_MICRO_STEP]


def hybrid_candidates(candidates: list[Candidate], world: int, ranks_per_node: int) -> list[Candidate]:
    """fsdp sharded inside a node and replicated across nodes, for each pure data-parallel fsdp candidate
    (several nodes only): all-gathers stay on the fast links, only gradients cross the network. Not for
    each-micro-step sync: its gradients would cross the network every micro-step, which the hybrid model
    (``cost_model.topology_estimate``: one all-reduce across the replicas) does not count."""
    if not ranks_per_node or world <= ranks_per_node or world % ranks_per_node:
        return []
    return [dataclasses.replace(c, shard=ranks_per_node) for c in candidates
            if c.sharding == "fsdp" and c.tensor * c.pipeline == 1 and not c.shard and c.grad_sync == LAST_MICRO_STEP]


def refinements(space: SearchSpace, winner: Candidate) -> list[Candidate]:
    """The winner plus one compute method at a time (those available and not excluded)."""
    out = []
    for method in COMPUTE_METHODS:
        if method in winner.compute or method in space.excluded or _method_unavailable(method):
            continue
        candidate = dataclasses.replace(winner, compute=winner.compute + (method,))
        if not any(rule(candidate, space) for rule in RULES):
            out.append(candidate)
    return out


def _note(skipped: dict, name: str, reason: Optional[str]) -> bool:
    if reason:
        skipped[name] = reason
        logger.info("search: %s not searched: %s", name, reason)
    return bool(reason)


def _forced_items(included: Strategy) -> list[StrategyItem]:
    """Included methods outside the searched dimensions are added to every candidate."""
    out = []
    for item in included:
        if item.name in SEARCHED or item.name == "parallel_mode":
            continue
        opt_lib.get_optimization(item.name)  # unknown names raise with the nearest valid one
        out.append(item)
    return out
