"""Every process raises, or none does: the agreement around each step of a collective save or load.

A step that fails on one process (a full disk, a key that does not fit) must raise on every process,
or the others would wait forever in the next collective. ``on_every_rank`` runs a local step and
agrees on its outcome; ``agree`` does the same for an error text already caught; ``main_rank_error``
gives every process the outcome of work only process 0 did (writing a strategy file, the metadata).
The error raised is a CheckpointError unless the caller names another ``AtorchError`` type.
"""
from __future__ import annotations

import uuid
from typing import Any, Callable, Optional

import torch.distributed as dist

from atorch.distributed.agreement import all_ranks_true, broadcast_flag, is_multi_rank
from atorch.errors import AtorchError, CheckpointError


def gather(value: Any, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every process's ``value`` (picklable), in rank order; ``[value]`` in one process."""
    if not is_multi_rank():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def on_every_rank(action: Callable[[], Any]) -> Any:
    """Run ``action`` here; when it raises on any process, every process raises (the first failing
    process's CheckpointError), so none is left waiting in the next collective."""
    try:
        value, error = action(), None
    except Exception as failure:  # anything, so that no process is left waiting
        value, error = None, failure
    if is_multi_rank() and not all_ranks_true(error is None):
        messages = gather(None if error is None else (str(error), getattr(error, "key", None)))
        rank, (message, key) = next((r, m) for r, m in enumerate(messages) if m is not None)
        if error is None:
            raise CheckpointError(f"{message} (on rank {rank})", key=key)
    if isinstance(error, AtorchError):
        raise error
    if error is not None:  # the same typed error the other processes raise
        raise CheckpointError(f"{type(error).__name__}: {error}") from error
    return value


def attempt(action: Callable[[], Any]) -> Optional[str]:
    """``None`` when ``action`` ran, else the text of its file or value error (to ``agree`` on)."""
    try:
        action()
    except (OSError, CheckpointError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def agree(error: Optional[str], what: str, where: str, only_main: bool = False,
          group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise CheckpointError on every process when ``error`` is set on any (rank 0's text when
    ``only_main``)."""
    if is_multi_rank():
        if only_main:
            error = _broadcast_text(error, group)
        elif not all_ranks_true(error is None, group):
            errors = gather(error, group)
            error = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    if error is not None:
        raise CheckpointError(f"{what} {where!r} failed: {error}")


def main_rank_error(error: Optional[str]) -> Optional[str]:
    """Process 0's ``error`` (``None``: its work succeeded) on every process: one flag broadcast,
    and the text only when it failed."""
    if is_multi_rank() and not broadcast_flag(error is None):
        return _broadcast_text(error)
    return error


def agreed_tmp_dir(target: str) -> str:
    """``<path>.tmp-<id>`` with one id for every process (process 0's, broadcast)."""
    token = [uuid.uuid4().hex[:12]]
    if is_multi_rank():
        dist.broadcast_object_list(token, src=0)
    return f"{target}.tmp-{token[0]}"


def _broadcast_text(text: Optional[str], group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    message = [text]
    dist.broadcast_object_list(message, src=0, group=group)
    return message[0]
