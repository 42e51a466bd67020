"""Model-parallel layouts in the search: which tensor / pipeline sizes a model supports, and what
share of the model a rank holds under each. Facts only: the memory and time formulas that use them
are in ``atorch/cost_model.py`` with every other formula.

The facts come from the same plan finders the methods use (``find_tp_plan``, ``plan_stages``), run on
the model without changing it, so the search never proposes a layout the method would refuse, and
the shares are counted from the modules each stage really keeps, not assumed to be 1/p. With a
sample forward (``run``) the tensor plan is found from the recorded dataflow, as the method finds it
(on a copy when ``nn.MultiheadAttention`` must first be swapped for separate projections).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from atorch.auto.opt_lib.pipeline_parallel import plan_stages
from atorch.auto.opt_lib.pipeline_structure import (
    BlockStructure,
    check_supported,
    held_parameters,
    structure_from_order,
    trace_structure,
)
from atorch.auto.opt_lib.tp_mha import split_mha
from atorch.auto.opt_lib.tp_plan import find_tp_plan, split_param_ids
from atorch.errors import AtorchError
from atorch.utils.dataflow import Dataflow, record_dataflow
from atorch.utils.modules import repeated_blocks

logger = logging.getLogger(__name__)

def divisors_above_one(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def layouts_for(world: int) -> list[tuple[int, int]]:
    """Every (tensor, pipeline) size pair whose product divides the world size, (1, 1) first."""
    sizes = [1] + divisors_above_one(world)
    return [(t, p) for t in sizes for p in sizes if world % (t * p) == 0]


@dataclass
class LayoutFacts:
    """What the search needs to know about tensor / pipeline layouts of one model."""

    param_bytes: int = 0
    hidden_size: int = 0
    blocks: int = 0
    unsupported: dict[str, str] = field(default_factory=dict)          # "tp2" / "pp4" -> why not
    state_share: dict[tuple[int, int], float] = field(default_factory=dict)  # (t, p) -> largest rank's share
    split_share: float = 0.0                                            # parameter share tensor parallelism splits
    stage_block_share: dict[int, float] = field(default_factory=dict)   # p -> largest stage's share of the blocks

    def reason(self, tensor: int, pipeline: int) -> Optional[str]:
        return self.unsupported.get(f"tp{tensor}") or self.unsupported.get(f"pp{pipeline}")


def layout_facts(model: nn.Module, world: int, run: Optional[Callable[[nn.Module], Any]] = None) -> LayoutFacts:
    """Run the tensor and pipeline plan finders for every size that divides ``world``; ``run(model)``
    (one forward of a sample batch) lets the pipeline plan finder trace which layers run before and after
    the blocks, as the method does."""
    facts = LayoutFacts(param_bytes=sum(_bytes_of(p) for p in model.parameters()))
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    facts.hidden_size = max((m.embedding_dim for m in embeddings), default=0)
    facts.blocks = next(iter(repeated_blocks(model)[0].values()), 0)
    sizes = divisors_above_one(world)
    split_ids = _tensor_facts(model, sizes, facts, run)
    stages = _pipeline_facts(model, sizes, split_ids, facts, run)
    stages[1] = [(facts.param_bytes, facts.split_share * facts.param_bytes)]
    for t, p in layouts_for(world):
        if facts.reason(t, p) or p not in stages:
            continue
        facts.state_share[(t, p)] = (max(total - split * (1 - 1 / t) for total, split in stages[p])
                                     / max(facts.param_bytes, 1))
    return facts


def _tensor_facts(model: nn.Module, sizes: list[int], facts: LayoutFacts,
                  run: Optional[Callable[[nn.Module], Any]] = None) -> set[int]:
    """Record which tensor sizes the plan supports; returns the ids of the parameters it splits
    (projections and vocabulary) at the largest supported size."""
    analysed, flow = _recorded(model, run)
    split_ids: set[int] = set()
    for t in sizes:
        try:
            plan = find_tp_plan(analysed, t, flow)
        except AtorchError as error:  # the method's own refusal: heads not dividing, nothing to split
            facts.unsupported[f"tp{t}"] = str(error)
            continue
        split_ids = split_param_ids(model, plan, held_by=_held_by)
    facts.split_share = sum(_bytes_of(p) for p in model.parameters() if id(p) in split_ids) / max(facts.param_bytes, 1)
    return split_ids


def _held_by(model: nn.Module, name: str) -> nn.Module:
    """The module ``name`` in ``model``, or the nearest one above it (a swapped MultiheadAttention's
    projections are its packed weight)."""
    while name:
        try:
            return model.get_submodule(name)
        except AttributeError:
            name = name.rpartition(".")[0]
    return nn.Module()


def _recorded(model: nn.Module, run: Optional[Callable[[nn.Module], Any]]) -> tuple[nn.Module, Optional[Dataflow]]:
    """The model the tensor plan is read from (a copy with MultiheadAttention swapped, when it has
    any) and its recorded forward (None without a sample: the name lists then serve)."""
    if run is None:
        return model, None
    analysed = model
    if any(type(m) is nn.MultiheadAttention for m in model.modules()):
        analysed = copy.deepcopy(model)
        split_mha(analysed)
    try:
        return analysed, record_dataflow(analysed, run)
    except Exception as error:  # the sample cannot run as given: the name lists serve
        logger.info("search: no recorded forward for the tensor plan (%s: %s); using projection names",
                    type(error).__name__, error)
        return model, None


def _pipeline_facts(model: nn.Module, sizes: list[int], split_ids: set[int], facts: LayoutFacts,
                    run: Optional[Callable[[nn.Module], Any]] = None) -> dict[int, list[tuple[int, int]]]:
    """Record which pipeline sizes the stage plan finder supports; returns per size the (parameter
    bytes, tensor-split bytes) of each stage."""
    stages: dict[int, list[tuple[int, int]]] = {}
    layouts: dict[str, Any] = {}
    for p in sizes:
        try:
            split = plan_stages(model, p)
            blocks = [(name, model.get_submodule(name)) for name in split.block_names]
            if "layout" not in layouts:  # the same for every size: traced once
                layouts["layout"] = _block_structure(model, blocks, run)
            layout = layouts["layout"]
        except AtorchError as error:
            facts.unsupported[f"pp{p}"] = str(error)
            continue
        if len(blocks) < p:
            facts.unsupported[f"pp{p}"] = f"{len(blocks)} blocks cannot fill {p} stages"
            continue
        bounds = list(zip(split.starts, split.starts[1:] + [len(blocks)]))
        stages[p] = [_stage_bytes(model, layout, range(a, b), i == 0, i == p - 1, split_ids)
                     for i, (a, b) in enumerate(bounds)]
        facts.stage_block_share[p] = max(b - a for a, b in bounds) / len(blocks)
    return stages


def _block_structure(model: nn.Module, blocks: list, run: Optional[Callable[[nn.Module], Any]]) -> BlockStructure:
    """The method's own layout: refusals first, then the traced forward when a sample can be run
    (registration order otherwise). A model the method refuses raises the method's error."""
    check_supported(model, blocks)
    if run is None:
        return structure_from_order(model, blocks)
    try:
        return trace_structure(model, blocks, run)
    except AtorchError:
        raise
    except Exception as error:  # the sample cannot run as given (device, a loss needing more): estimate without it
        logger.info("search: no traced forward for the pipeline layout (%s: %s); using registration order",
                    type(error).__name__, error)
        return structure_from_order(model, blocks)


def _bytes_of(param) -> int:
    return param.numel() * param.element_size()


def _stage_bytes(model: nn.Module, layout, owned: range, first: bool, last: bool,
                 split_ids: set[int]) -> tuple[int, int]:
    """(parameter bytes, tensor-split bytes) a stage holds, counted from what ``StageModule`` keeps
    (``held_parameters``; layers around the blocks placed by registration order, as the search has
    no sample batch to trace). A weight tied across stages counts on each stage holding a copy."""
    held = held_parameters(model, layout, owned, first, last).values()
    total = sum(_bytes_of(p) for p in held)
    return total, sum(_bytes_of(p) for p in held if id(p) in split_ids)


def micro_batches(pipeline: int, per_data_rank_batch: int) -> int:
    """The pipeline method's default micro-batch count."""
    return min(2 * pipeline, per_data_rank_batch)
