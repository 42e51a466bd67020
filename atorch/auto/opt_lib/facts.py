"""Tables derived from what the registered methods declare (``base.Optimization``'s facts).

Nothing here names a method: the stage contract, the mesh dimensions each method needs, the
exclusive groups and the record-time facts are read off the registry, so a method registered with
``register_optimization`` is in them exactly as a built-in one is.
"""
from __future__ import annotations

from typing import Iterable

from atorch.auto.opt_lib import data_parallel
from atorch.auto.opt_lib.registry import registered_methods
from atorch.auto.stages import CONTEXT_WORK, STAGES, StageContract


def _union(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for group in groups for name in group))


def stage_contract() -> tuple[StageContract, ...]:
    """One row per stage, in ``STAGES`` order: the methods registered there (with the default
    data-parallel wrapper and the context itself where they act), and the union of what they
    declare they read and write."""
    rows = []
    for stage in STAGES:
        methods = [m for m in registered_methods() if stage in m.stages]
        actors = [m.name for m in methods]
        reads = [m.facts_at(stage)[0] for m in methods]
        writes = [m.facts_at(stage)[1] for m in methods]
        if stage in data_parallel.STAGES:
            actors.append(f"{data_parallel.NAME} (default)")
            reads.append(data_parallel.READS)
            writes.append(data_parallel.WRITES)
        work = CONTEXT_WORK.get(stage)
        if work is not None:
            actors.append("context")
            reads.append(work.reads)
            writes.append(work.writes)
        rows.append(StageContract(stage, tuple(actors), _union(*reads), _union(*writes)))
    return tuple(rows)


def record_time_facts() -> dict[str, tuple[str, ...]]:
    """Fact -> the methods whose ``transform`` sets it when the strategy is recorded."""
    facts: dict[str, list[str]] = {}
    for method in registered_methods():
        for fact in method.record_writes:
            facts.setdefault(fact, []).append(method.name)
    return {fact: tuple(names) for fact, names in facts.items()}


def required_dims() -> dict[str, tuple[str, ...]]:
    """Method -> the ``parallel_mode`` dimensions it works on (methods that need none left out)."""
    return {m.name: tuple(m.mesh_dims) for m in registered_methods() if m.mesh_dims}


def exclusive_groups() -> list[tuple[str, tuple[str, ...], str]]:
    """(group, its members, why) in the order groups are first declared: at most one member of each
    may be in a strategy."""
    groups: dict[str, tuple[list[str], str]] = {}
    for method in registered_methods():
        for group, why in method.excludes.items():
            groups.setdefault(group, ([], why))[0].append(method.name)
    return [(group, tuple(members), why) for group, (members, why) in groups.items()]
