"""Collective timeouts: bounded while atorch dry-runs work, normal otherwise.

Why: gloo cannot interrupt a collective that a peer will never join (aborting the group on the
failing rank does not close its connections while wrappers such as DDP still hold the group), and
groups made with ``new_group`` wait 30 minutes by default. While a dry run or a search candidate
runs, every group's timeout is therefore capped (``DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S``, or the
``collective_timeout_s`` the caller passes); a rank stuck in a collective with a failed peer then
fails within the cap. Afterwards every group gets the process group's normal timeout back.
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Iterator, Optional

import torch.distributed as dist

DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S = 10.0
_cap: dict[str, Optional[datetime.timedelta]] = {"value": None}


def normal_timeout() -> datetime.timedelta:
    """The default process group's timeout (what ``init_distributed(timeout_s=...)`` set)."""
    try:
        return dist.distributed_c10d._get_default_group().options._timeout  # type: ignore[attr-defined]
    except Exception:
        try:
            return dist.distributed_c10d._get_default_timeout(dist.get_backend())
        except Exception:  # pragma: no cover - private helpers moved
            return datetime.timedelta(minutes=10)


def current_timeout() -> datetime.timedelta:
    """How long a collective started now may wait: the active cap, else the normal timeout."""
    return _cap["value"] if _cap["value"] is not None else normal_timeout()


def _set_all(timeout: datetime.timedelta) -> None:
    for group in list(dist.distributed_c10d._world.pg_names):
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        except Exception:  # a group this rank is not part of, or one already torn down
            pass


def apply_cap_to_new_groups() -> None:
    """Called after atorch creates groups (the device mesh) so that they obey an active cap."""
    if _cap["value"] is not None and dist.is_initialized():
        _set_all(_cap["value"])


@contextlib.contextmanager
def collective_timeout_cap(seconds: float) -> Iterator[None]:
    """Every collective started inside the block gives up after ``seconds``. A nested block (a dry run
    inside a conformance cell) leaves the outer cap in force when it ends, not the normal timeout."""
    if not dist.is_initialized():
        yield
        return
    outer = _cap["value"]
    restore = outer if outer is not None else normal_timeout()
    _cap["value"] = datetime.timedelta(seconds=seconds)
    _set_all(_cap["value"])
    try:
        with _bounded_waits(dist.get_backend() == "gloo"):
            yield
    finally:
        _cap["value"] = outer
        if dist.is_initialized():
            _set_all(restore)


@contextlib.contextmanager
def _bounded_waits(active: bool) -> Iterator[None]:
    """``Work.wait()`` without a timeout waits at most the cap. On gloo such a wait has no bound at all
    (a group's timeout covers its collectives, not a point-to-point ``wait()``): a pipeline stage whose
    peer failed would wait in ``torch.distributed.pipelining``'s receive forever and never reach the
    recovery. Only for gloo: a timeout makes NCCL's wait block the CPU (its own abort ends NCCL's)."""
    if not active:
        yield
        return
    work = dist.distributed_c10d.Work
    unbounded = work.wait

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if not timeout and _cap["value"] is not None:
            timeout = _cap["value"]
        return unbounded(self, timeout)

    work.wait = wait
    try:
        yield
    finally:
        work.wait = unbounded
