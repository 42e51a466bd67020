"""The candidate strategies for this world size, model and machine, and the rules that prune them.

A candidate is a point in four dimensions: sharding (ddp / zero1 / zero2 / fsdp), precision
(fp32 / amp bf16 / amp fp16 / half), activation checkpointing (off / on the main repeated block)
and compute methods (module_replace, native_dynamo). Every rule that removes a point lives in
``RULES`` below, with the reason the report shows.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from atorch.auto import opt_lib
from atorch.auto.opt_lib.compat import check_compatible
from atorch.errors import AtorchError, InputError
from atorch.auto.search.analyser import ModelProfile

logger = logging.getLogger(__name__)

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "half_bf16")
COMPUTE_METHODS = ("module_replace", "native_dynamo")
PRECISION_METHODS = {"amp_bf16": ("amp_native", {"dtype": torch.bfloat16}),
                     "amp_fp16": ("amp_native", {"dtype": torch.float16}),
                     "half_bf16": ("half", "bf16")}
SEARCHED = {"zero1", "zero2", "fsdp", "amp_native", "half", "checkpoint", *COMPUTE_METHODS}


@dataclass(frozen=True)
class Candidate:
    sharding: str = "ddp"
    precision: str = "fp32"
    checkpoint: bool = False
    compute: tuple[str, ...] = ()
    forced: tuple = ()  # (name, config) items the user forced with ``included``
    block: Optional[str] = field(default=None, compare=False)

    @property
    def label(self) -> str:
        parts = [self.sharding, self.precision] + (["ckpt"] if self.checkpoint else []) + list(self.compute)
        parts += [name for name, _ in self.forced]
        return "+".join(parts)

    def strategy(self, world_size: int) -> list:
        items: list = ["parallel_mode"] if world_size > 1 else []
        if self.precision in PRECISION_METHODS:
            items.append(PRECISION_METHODS[self.precision])
        if self.checkpoint:
            items.append(("checkpoint", (self.block,)))
        if self.sharding == "fsdp":
            items.append(("fsdp", {"atorch_wrap_cls": (self.block,)} if self.block else {}))
        elif self.sharding in ("zero1", "zero2"):
            items.append(self.sharding)
        items.extend(self.compute)
        items.extend(self.forced)
        return items


@dataclass
class SearchSpace:
    world_size: int
    device: torch.device
    profile: ModelProfile
    excluded: frozenset = frozenset()
    included: tuple = ()  # names or (name, config)


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
    used = {c.sharding} | set(c.compute) | ({"checkpoint"} if c.checkpoint else set())
    if c.precision != "fp32":
        used.add(PRECISION_METHODS[c.precision][0])
    hit = sorted(used & space.excluded)
    return f"excluded: {hit}" if hit else None


def _rule_included(c: Candidate, space: SearchSpace) -> Optional[str]:
    names = {n if isinstance(n, str) else n[0] for n in space.included}
    present = {c.sharding, *c.compute} | ({"checkpoint"} if c.checkpoint else set())
    if c.precision != "fp32":
        present.add(PRECISION_METHODS[c.precision][0])
    missing = sorted((names & SEARCHED) - present)
    return f"lacks included {missing}" if missing else None


def _rule_checkpoint_needs_block(c: Candidate, space: SearchSpace) -> Optional[str]:
    if c.checkpoint and not space.profile.main_block:
        return "no repeated block to checkpoint"
    return None


def _rule_compatible(c: Candidate, space: SearchSpace) -> Optional[str]:
    items = []
    for item in c.strategy(space.world_size):
        name, config = (item, None) if isinstance(item, str) else item
        if name == "parallel_mode":
            continue
        items.append((name, opt_lib.get_optimization(name).normalize(config)))
    try:
        check_compatible(items)
    except AtorchError as error:
        return str(error)
    return None


RULES: tuple[Rule, ...] = (_rule_single_process, _rule_excluded, _rule_included, _rule_checkpoint_needs_block,
                           _rule_compatible)


def enumerate_candidates(space: SearchSpace) -> tuple[list[Candidate], dict[str, str]]:
    """(valid candidates, {label: why not} for the rest and for unavailable methods)."""
    skipped: dict[str, str] = {}
    shardings = [s for s in SHARDINGS if s == "ddp" or not _note(skipped, s, _method_unavailable(s))]
    precision_names = [p for p in PRECISIONS if not _note(skipped, p, _precision_unavailable(p, space.device))]
    included_names = {n if isinstance(n, str) else n[0] for n in space.included}
    if "half" in included_names and "half_bf16" not in precision_names:
        precision_names.append("half_bf16")
    compute = [m for m in COMPUTE_METHODS if not _note(skipped, m, _method_unavailable(m))]
    forced = tuple(_forced_items(space.included))
    block = space.profile.main_block
    # compute methods forced by ``included`` are in every candidate; the others are tried as
    # refinements of the winner (their effect is not predictable from the single-rank profile)
    forced_compute = tuple(m for m in compute if m in included_names)
    candidates = []
    for sharding, precision, ckpt in itertools.product(shardings, precision_names, (False, True)):
        candidate = Candidate(sharding, precision, ckpt, forced_compute, forced, block)
        reason = next((why for rule in RULES if (why := rule(candidate, space))), None)
        if reason:
            skipped[candidate.label] = reason
        else:
            candidates.append(candidate)
    if not candidates:
        raise InputError(f"no candidate strategy is valid for world size {space.world_size}: {skipped}")
    return candidates, skipped


def refinements(space: SearchSpace, winner: Candidate) -> list[Candidate]:
    """The winner plus one compute method at a time (those available and not excluded)."""
    out = []
    for method in COMPUTE_METHODS:
        if method in winner.compute or method in space.excluded or _method_unavailable(method):
            continue
        candidate = Candidate(winner.sharding, winner.precision, winner.checkpoint, winner.compute + (method,),
                              winner.forced, winner.block)
        if not any(rule(candidate, space) for rule in RULES):
            out.append(candidate)
    return out


def _note(skipped: dict, name: str, reason: Optional[str]) -> bool:
    if reason:
        skipped[name] = reason
        logger.info("search: %s not searched: %s", name, reason)
    return bool(reason)


def _forced_items(included: tuple) -> list:
    """Included methods outside the searched dimensions are added to every candidate."""
    out = []
    for item in included:
        name, config = (item, None) if isinstance(item, str) else (item[0], item[1])
        if name in SEARCHED or name == "parallel_mode":
            continue
        opt_lib.get_optimization(name)  # unknown names raise with the nearest valid one
        out.append((name, config))
    return out
