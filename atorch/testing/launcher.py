"""Run a function on N real processes (gloo over loopback) and collect every rank's return value.

One shared launcher with a hard timeout: if any rank raises, or the run outlives ``timeout_s``, every
rank is terminated and the caller gets an error naming the rank and its traceback, so a hang fails a
test instead of CI.

Ranks start from a fork server by default: one process imports torch and atorch once, and every rank
of every later launch is forked from it, ready in a fraction of a second instead of the seconds a fresh
interpreter spends importing torch (most of a short multi-rank test's time). A forked rank would see the
server's environment, so each launch sends the caller's environment and applies it before anything
runs (the working directory and ``sys.path`` multiprocessing sends itself). ``start_method="spawn"``
(or ``ATORCH_START_METHOD=spawn``) starts fresh interpreters instead: for what a process reads only
when it starts (glibc's ``MALLOC_*`` variables).
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atorch.distributed.init import init_distributed


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the run timed out."""

    native_crash: bool = False  # a rank was killed by a native crash's signal (run_distributed relaunches)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


START_METHODS = ("forkserver", "spawn")
# imported once by the fork server: what the ranks import anyway (see that module)
FORKSERVER_PRELOAD = ["atorch.testing.warm_imports"]


def _context(start_method: Optional[str]) -> Any:
    """The multiprocessing context for ``start_method`` (None: ``ATORCH_START_METHOD`` or forkserver)."""
    method = start_method or os.environ.get("ATORCH_START_METHOD") or "forkserver"
    if method not in START_METHODS:
        raise ValueError(f"start_method {method!r} is not one of {START_METHODS}")
    if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        method = "spawn"  # a platform without fork (Windows): fresh interpreters
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any,
            environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at launch, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    try:
        torch.set_num_threads(1)
        init_distributed(timeout_s=120)
        value = fn(*args)
        # plain pickle bytes: torch's queue would pass tensors as shared memory that dies with the rank
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report every failure to the parent, which ends the other ranks
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


# how long a failed launch waits for the other ranks' own reports: the first report to arrive may be a peer's
# "connection closed" while the rank that failed first is still writing its traceback
OTHER_RANKS_GRACE_S = 3.0


def _failure(message: str, procs: list, values: dict, may_die: tuple[int, ...]) -> DistributedRunError:
    """The launch's error, marked ``native_crash`` where a rank that sent no value was killed by a native
    crash's signal (``NATIVE_CRASH_EXIT_CODES``)."""
    error = DistributedRunError(message)
    error.native_crash = any(p.exitcode in NATIVE_CRASH_EXIT_CODES for i, p in enumerate(procs)
                             if i not in values and i not in may_die)
    return error


def _other_ranks(results: Any, procs: list, first: int, returned: Iterable[int] = ()) -> str:
    """What the other ranks reported (or how they exited) within ``OTHER_RANKS_GRACE_S`` of a failure, so
    the error names the rank that failed first, not only the one whose report arrived first. ``returned``:
    the ranks whose values arrived before the failure."""
    reports: dict[int, str] = {rank: "returned" for rank in returned if rank != first}
    deadline = time.monotonic() + OTHER_RANKS_GRACE_S
    while len(reports) < len(procs) - 1 and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if all(p.exitcode is not None for i, p in enumerate(procs) if i != first and i not in reports):
                break
            continue
        if rank != first:
            reports[rank] = "returned" if ok else f"failed:\n{value}"
    for i, proc in enumerate(procs):
        if i != first and i not in reports:
            reports[i] = (f"exited with code {proc.exitcode} without a report" if proc.exitcode not in (None, 0)
                          else "sent no report")
    return "".join(f"\n--- rank {rank} {report}" for rank, report in sorted(reports.items()))


# exit codes of a rank killed by the signal of a crash in native code (abort, segfault, bus error, illegal
# instruction, floating-point exception), as multiprocessing reports them; SIGKILL (the OOM killer, a test's
# own kill) is not among them
NATIVE_CRASH_EXIT_CODES = (-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE)
# launches run again after such a crash of a rank that sent no report
NATIVE_CRASH_RELAUNCHES = 1


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240.0,
                    may_die: tuple[int, ...] = (), start_method: Optional[str] = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new ranks; returns the values ordered by rank.

    ``fn`` must be importable (module level). Raises DistributedRunError on the first failure.
    Ranks in ``may_die`` (tests that kill a rank on purpose) may exit without a value: theirs is None.
    ``start_method``: "forkserver" (default) or "spawn", see the module's docstring.

    A launch in which a rank was killed by a native crash's signal without reporting (glibc's
    "malloc_consolidate(): invalid chunk size" abort, seen once in some tens of suite runs inside gloo's
    collectives, never reproduced on its own) runs once more, saying so on stderr: such a crash is
    not what a test checks, and one that recurs still fails, with both crashes named.
    """
    crashes: list[str] = []
    for _ in range(NATIVE_CRASH_RELAUNCHES + 1):
        try:
            return _launch(fn, world_size, args, timeout_s, may_die, start_method)
        except DistributedRunError as error:
            if not error.native_crash:
                raise
            crashes.append(str(error))
            print(f"atorch launcher: a rank of {getattr(fn, '__name__', fn)} crashed in native code "
                  f"(launch {len(crashes)}):\n{error}", file=sys.stderr, flush=True)
    raise DistributedRunError(f"{len(crashes)} launches each crashed in native code:\n" + "\n".join(crashes))


def _launch(fn: Callable, world_size: int, args: tuple, timeout_s: float, may_die: tuple[int, ...],
            start_method: Optional[str]) -> list[Any]:
    """One launch of ``run_distributed``'s; its DistributedRunError says whether a rank crashed in native
    code (``native_crash``)."""
    context = _context(start_method)
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, args, results, dict(os.environ)),
                        daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    gone: set[int] = set()  # ranks in may_die that exited
    try:
        deadline = time.monotonic() + timeout_s
        while len(values) + len(gone) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(f"timed out after {timeout_s:.0f}s; ranks done: {sorted(values)}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                gone = {i for i in dead if i in may_die}
                dead = [i for i in dead if i not in may_die]
                if dead:
                    raise _failure(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}",
                                   procs, values, may_die)
                continue
            if not ok:
                others = _other_ranks(results, procs, rank, values)
                raise _failure(f"rank {rank} failed:\n{value}" + others, procs, values, may_die)
            values[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(values) + len(gone) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return [values.get(rank) for rank in range(world_size)]
