"""A clean process exit after gloo collectives on tensors Python owns.

Why: with ZeroRedundancyOptimizer on gloo (plain PyTorch shows it too), a two-rank job that has
finished all its work aborts at interpreter exit in many runs ("terminate called without an
active exception", SIGABRT), so torchrun reports the job failed: here 17 of 20 atorch zero1 jobs.
gdb shows the cause: a gloo worker thread (``pt_gloo_runloop``) drops its last finished broadcast
after the main thread has moved on; freeing that broadcast's tensor, which Python owns, needs the
GIL; the main thread keeps the GIL until the interpreter is finalising, and a thread that asks for
the GIL then is ended by CPython with a forced unwind that C++ turns into ``std::terminate``.

The fix is local and cannot hang: at exit, before finalisation, the main thread gives the GIL away
in short sleeps, so any worker thread waiting for it finishes freeing its tensors first. It costs
``EXIT_GIL_RELEASE_S`` at exit in processes that ran a distributed strategy.
"""
from __future__ import annotations

import atexit
import time

EXIT_GIL_RELEASE_S = 0.2
_SLICE_S = 0.01
_state = {"registered": False}


def register_gil_release_at_exit() -> None:
    """Idempotent: let gloo worker threads finish with Python-owned tensors before finalisation."""
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_release_gil_before_finalisation)


def _release_gil_before_finalisation() -> None:
    deadline = time.monotonic() + EXIT_GIL_RELEASE_S
    while time.monotonic() < deadline:
        time.sleep(_SLICE_S)  # each sleep releases the GIL to any thread waiting for it
