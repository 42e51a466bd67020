"""A memory cgroup around one process: what it allocates after entering, beyond a limit, gets it killed.

A device runs out of memory where a CPU process would only grow; a memory cgroup (Linux's v1 memory
controller, which needs root) makes the CPU behave like the device: the kernel kills a process whose
charged memory passes the cgroup's limit. A process moved into a cgroup keeps the pages it already
held charged where they were (``memory.move_charge_at_immigrate`` is 0), so the cage charges only what
the process allocates after entering it: its growth, as a per-device ``memory_limit`` bounds it. The
tests use it to enforce that limit on the search itself (``tests/search/test_search_at_scale.py``),
beside the resident-growth figure that says by how much.

``cage_unavailable()`` says why a machine has no such controller (not Linux, cgroup v2 only, not
root); callers then fall back to the resident-growth check alone and say so.
"""
from __future__ import annotations

import os
from typing import Optional

CGROUP_MEMORY = "/sys/fs/cgroup/memory"
PREFIX = "atorch-cage-"


def _own_cgroup() -> Optional[str]:
    """This process's memory cgroup directory (v1), or None."""
    try:
        with open("/proc/self/cgroup") as handle:
            for line in handle:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return os.path.join(CGROUP_MEMORY, path.lstrip("/"))
    except OSError:
        return None
    return None


def cage_unavailable() -> Optional[str]:
    """Why no memory cage can be made here, or None when one can."""
    parent = _own_cgroup()
    if parent is None or not os.path.isfile(os.path.join(parent, "memory.limit_in_bytes")):
        return "no cgroup v1 memory controller for this process"
    if not os.access(parent, os.W_OK):
        return f"cannot create a cgroup under {parent} (needs root)"
    return None


class MemoryCage:
    """``with MemoryCage(limit) as cage:`` runs the block with this process in a fresh memory cgroup
    limited to ``limit`` bytes of new allocations; on leaving, ``cage.peak_bytes`` is the most it held
    and the process is back in its own cgroup. A process over the limit is killed by the kernel (exit
    -9), which a multi-process launcher reports as a lost rank."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self.peak_bytes = 0
        self.path: Optional[str] = None
        self.parent: Optional[str] = None

    def __enter__(self) -> "MemoryCage":
        reason = cage_unavailable()
        if reason is not None:
            raise OSError(reason)
        self.parent = _own_cgroup()
        _remove_stale_cages(self.parent)
        self.path = os.path.join(self.parent, f"{PREFIX}{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        _write(self.path, "memory.limit_in_bytes", self.limit_bytes)
        if os.path.exists(os.path.join(self.path, "memory.swappiness")):
            _write(self.path, "memory.swappiness", 0)  # over the limit is killed, not swapped out
        _write(self.path, "cgroup.procs", os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.path is not None and self.parent is not None
        with open(os.path.join(self.path, "memory.max_usage_in_bytes")) as handle:
            self.peak_bytes = int(handle.read())
        _write(self.parent, "cgroup.procs", os.getpid())
        try:
            os.rmdir(self.path)
        except OSError:  # still emptying; _remove_stale_cages takes it next time
            pass


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as handle:
        handle.write(str(value))


def _remove_stale_cages(parent: str) -> None:
    """Cages left by processes that were killed in them (the kernel keeps an empty cgroup)."""
    for name in os.listdir(parent):
        if name.startswith(PREFIX):
            pid = name[len(PREFIX):]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


__all__ = ["MemoryCage", "cage_unavailable"]
