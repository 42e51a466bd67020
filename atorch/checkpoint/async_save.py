"""Asynchronous saves: a thread writes the checkpoint while training goes on.

``save_checkpoint(..., async_save=True)`` copies the tensors to host memory, then hands the write to
``start_background``: one save at a time, on a thread that is not a daemon (the process's exit
waits for it), its collectives on a gloo group of their own (on the default group they would
interleave with training's: gloo and nccl match collectives by order). ``wait_for_checkpoint``
waits for it and raises its CheckpointError.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import torch.distributed as dist

from atorch.distributed.agreement import is_multi_rank
from atorch.distributed.timeouts import normal_timeout
from atorch.errors import CheckpointError

logger = logging.getLogger("atorch")

_background: dict[str, Any] = {"pending": None, "group": None, "world": None}


class PendingSave:
    """An asynchronous save that a background thread is writing. ``wait()`` returns once it is
    renamed into place on every process, and raises its CheckpointError when it failed."""

    def __init__(self, target: str, work: Callable[[], None]):
        self.target, self._work = target, work
        self.error: Optional[CheckpointError] = None
        self.thread = threading.Thread(target=self._run, name="atorch-checkpoint-writer")  # not a daemon: exit waits

    def _run(self) -> None:
        try:
            self._work()
        except CheckpointError as error:
            self.error = error
        except BaseException as error:  # the same typed error for anything else (DCP's is a BaseException)
            self.error = CheckpointError(f"save_checkpoint (asynchronous) to {self.target!r} failed: "
                                         f"{type(error).__name__}: {error}")
        if self.error is not None:
            logger.error("%s", self.error)

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()
        if _background["pending"] is self:
            _background["pending"] = None
        if self.error is not None:
            raise self.error


def wait_for_checkpoint() -> None:
    """Block until the asynchronous save in flight (if any) is renamed into place; raise its
    CheckpointError. ``save_checkpoint`` and ``load_checkpoint`` call it first; call it yourself
    before destroying the process group."""
    pending = _background["pending"]
    if pending is not None:
        pending.wait()


def start_background(target: str, write: Callable[[Optional[dist.ProcessGroup]], None]) -> PendingSave:
    """Start ``write(group)`` on a thread, ``group`` being the writer's own gloo group (collective:
    every process calls it in the same order)."""
    group = writer_group()
    pending = PendingSave(target, lambda: write(group))
    _background["pending"] = pending
    pending.thread.start()
    return pending


def writer_group() -> Optional[dist.ProcessGroup]:
    """Every process in a gloo group for the background writer, made once per default group
    (collective, so the save calls it on every process in the same order), with the default
    group's timeout (a new group's would be 30 minutes)."""
    if not is_multi_rank():
        return None
    world = dist.group.WORLD
    if _background["world"] is not world:
        group = dist.new_group(backend="gloo", timeout=normal_timeout())
        _background["group"], _background["world"] = group, world
    return _background["group"]
