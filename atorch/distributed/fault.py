"""Failure isolation across ranks: work that raises on one rank fails on every rank, promptly.

Why this is needed: a rank that raises inside a dry run leaves its peers blocked inside a
collective (an FSDP all-gather, DDP's gradient all-reduce). If the failing rank then joined an
agreement all-reduce, the ranks would be inside different collectives: gloo aborts the process or
both ranks wait until the collective timeout.

How: ``run_isolated(fn)`` runs ``fn`` on every rank with every collective's timeout capped
(``atorch.distributed.timeouts``). A rank whose ``fn`` raises records why in the rendezvous store
(the first record wins), drops what the work built (the frames its exception kept, and the caller's
``release``: the wrapped model and optimizer hold the group) and aborts the process group. NCCL stops
at once; gloo closes a group's connections only once nothing holds it, and then its peers' collectives
fail at once; where something still holds it (the user's own model, wrapped in place), its peers give up
when the capped timeout ends, also in a point-to-point wait, which the cap bounds too.
The peers' failed collectives send them down the
same path. Every rank then waits, bounded, for all ranks to reach this point (a rank that never
does was lost: killed or hung, and ``RankLostError`` names it), rebuilds the default process group
on the same store under a new prefix, and returns the first failure's reason. When ``fn``
succeeds on every rank the only cost is one small all-reduce. Groups made from the old process
group (the device mesh, a user's own subgroups) are gone after a failure; atorch rebuilds its mesh
with the next strategy it applies.
"""
from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from atorch.distributed import mesh
from atorch.distributed.agreement import all_ranks_true, forget_store_rounds, is_multi_rank
from atorch.distributed.timeouts import DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S, collective_timeout_cap, normal_timeout
from atorch.errors import AtorchError, RankLostError

logger = logging.getLogger("atorch")

RANKS_REACH_RECOVERY_S = 10.0  # beyond the collective cap: how long a live rank may take to notice
_PREFIX = "atorch/fault"
_state: dict[str, Any] = {"generation": 0, "root_store": None}
_rebuild_callbacks: list[Callable[[], None]] = []


def register_rebuild_callback(callback: Callable[[], None]) -> None:
    """``callback()`` runs after the process group is rebuilt: libraries that cache groups of the
    aborted one (DeepSpeed) forget them there."""
    if callback not in _rebuild_callbacks:
        _rebuild_callbacks.append(callback)


register_rebuild_callback(forget_store_rounds)  # the rebuilt group's store starts its agreements afresh


@dataclass
class Outcome:
    """What ``run_isolated`` returns: the value on success, else the first failure on any rank."""

    ok: bool
    value: Any = None
    error: Optional[str] = None
    failed_rank: Optional[int] = None


def describe(error: BaseException) -> str:
    """``Type: message``, with the error it was raised from where a wrapper's message leaves that out
    (``torch.distributed.pipelining`` re-raises a stage's error as "[Stage 1] failed to run forward")."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    if cause is not None and str(cause) not in text:
        text += f" (raised from {describe(cause)})"
    return text


def run_isolated(fn: Callable[[], Any], collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S,
                 release: Optional[Callable[[], None]] = None) -> Outcome:
    """Run ``fn()`` on every rank; all ranks get the same ``Outcome`` and a usable process group.

    ``collective_timeout_s`` bounds every collective inside ``fn``: a healthy collective must finish
    within it, and a rank whose peer failed waits at most that long (on gloo, only while the failed
    rank's process group stays referenced: ``release()``, called on a failure before the group is
    destroyed, drops what ``fn`` built outside its own frames, so the failed rank's connections close and
    its peers' collectives fail at once)."""
    if not is_multi_rank():
        return run_here(fn)
    _remember_root_store()
    wait_s = collective_timeout_s + RANKS_REACH_RECOVERY_S
    with collective_timeout_cap(collective_timeout_s):
        try:
            value = fn()
        except Exception as error:
            logger.info("isolated work failed on this rank: %s", describe(error), exc_info=True)
            return _recover(error, wait_s, release)
        try:
            all_ranks_true(True)  # completes only if no rank failed
        except Exception as error:
            return _recover(error, wait_s, release)
    return Outcome(True, value)


def run_here(fn: Callable[[], Any]) -> Outcome:
    """Run ``fn()`` on this rank alone, with no collective inside it: its failure is its own ``Outcome``,
    and nothing is aborted (no peer waits on this rank while it runs)."""
    try:
        return Outcome(True, fn())
    except Exception as error:
        logger.info("work on this rank alone failed: %s", describe(error), exc_info=True)
        return Outcome(False, error=describe(error), failed_rank=dist.get_rank() if is_multi_rank() else 0)


def forget_process_group() -> None:
    """Drop the remembered root store (``reset_distributed``: the next process group brings its own)."""
    _state["root_store"] = None
    _state["generation"] = 0


def _remember_root_store() -> None:
    """The store of the process group as first seen: every rebuilt group is a prefix of it."""
    if _state["root_store"] is None:
        _state["root_store"] = dist.distributed_c10d._get_default_store()
        _state["backend"] = dist.get_backend()
        _state["timeout"] = normal_timeout()


def _recover(error: BaseException, timeout_s: float, release: Optional[Callable[[], None]] = None) -> Outcome:
    store, rank, world = _state["root_store"], dist.get_rank(), dist.get_world_size()
    generation = _state["generation"]
    _state["generation"] += 1
    key = f"{_PREFIX}/{generation}"
    record = json.dumps({"rank": rank, "error": describe(error), "deliberate": isinstance(error, AtorchError)})
    try:
        store.compare_set(f"{key}/first", "", record)  # the first failing rank wins; later ones are echoes
        store.set(f"{key}/error/{rank}", record)
        _release_failed_work(error, release)
        _abort_process_group()
        if release is not None:  # the wrappers' reference cycles hold the group last
            gc.collect()
        store.set(f"{key}/reached/{rank}", "1")
        _wait_for_every_rank(store, key, world, timeout_s)
        first = _the_reason(store, key, world)
        _rebuild_process_group(store, generation, rank, world)
    except RankLostError:
        raise
    except Exception as store_error:  # the store's host (rank 0 or the launcher) is gone
        raise RankLostError(f"the rendezvous store stopped answering after a failure ({describe(store_error)}); "
                            f"rank 0 or the launcher was lost; this rank's failure: {describe(error)}",
                            lost_ranks=[0]) from error
    logger.warning("rank %d failed (%s); every rank stopped that work and the process group was rebuilt",
                   first["rank"], first["error"])
    return Outcome(False, error=first["error"], failed_rank=first["rank"])


def _release_failed_work(error: Optional[BaseException], release: Optional[Callable[[], None]]) -> None:
    """Drop what the failed work still holds (its wrapped model, optimizer, pipeline stages: in the
    frames its exception kept, and through ``release``): they hold the process group, and gloo closes a
    group's connections only when nothing does, so until then a peer blocked in a collective with this
    rank waits for the collective timeout; once the group is destroyed and unheld, the peer's collective
    fails at once. Only where the caller asked (``release`` given: a dry run, whose error is reported as
    text): an error re-raised to the user keeps its frames' locals for their debugger."""
    if release is None:
        return
    release()
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _the_reason(store: Any, key: str, world: int) -> dict:
    """The failure to report on every rank: the first one, unless it was a collective's error and
    another rank raised an atorch error (a refusal, a typed failure). That rank failed on purpose,
    and the collectives its peers were in failed because of it, whichever was recorded first."""
    first = json.loads(store.get(f"{key}/first"))
    if first.get("deliberate"):
        return first
    for rank in range(world):
        if store.check([f"{key}/error/{rank}"]):
            record = json.loads(store.get(f"{key}/error/{rank}"))
            if record.get("deliberate"):
                return record
    return first


def _abort_process_group() -> None:
    mesh.destroy_parallel_group()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:  # pragma: no cover - older torch
            dist.destroy_process_group()
    except Exception as error:  # already broken: nothing left to close
        logger.debug("abort of the process group: %s", describe(error))
    if dist.is_initialized():  # pragma: no cover
        dist.destroy_process_group()


def _wait_for_every_rank(store: Any, key: str, world: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    keys = [f"{key}/reached/{r}" for r in range(world)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            lost = [r for r, k in enumerate(keys) if not store.check([k])]
            first = store.get(f"{key}/first").decode() if store.check([f"{key}/first"]) else "{}"
            raise RankLostError(
                f"rank(s) {lost} stopped answering within {timeout_s:.0f} s after a failure "
                f"(killed, or hung outside atorch); first failure: {json.loads(first).get('error', 'unknown')}",
                lost_ranks=lost,
            )
        time.sleep(0.05)


def _rebuild_process_group(store: Any, generation: int, rank: int, world: int) -> None:
    prefixed = dist.PrefixStore(f"{_PREFIX}/pg/{generation}", store)
    dist.init_process_group(_state["backend"], store=prefixed, rank=rank, world_size=world, timeout=_state["timeout"])
    for callback in _rebuild_callbacks:
        callback()
