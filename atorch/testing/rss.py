"""A process's resident memory (RSS) and its peak since a chosen point, on Linux.

The peak is read from ``VmHWM`` in ``/proc/self/status`` and reset with ``/proc/self/clear_refs``
("5": the peak becomes the current RSS), not from ``getrusage(RUSAGE_SELF).ru_maxrss``: in a process
started by ``spawn`` (fork + exec), ru_maxrss never drops below the RSS its parent had when it
forked (the kernel keeps the pre-exec memory's peak in the signal struct, and clear_refs does not
reset that), so a parent holding a model would inflate every rank's figure. ``VmHWM`` is the peak
of this process's own memory only. Both count file pages mapped in (a safetensors file read
through mmap), as RSS does.
"""
from __future__ import annotations

import gc
import os
import resource
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss_bytes() -> int:
    """Resident bytes now (``/proc/self/statm``'s second field)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    """The highest resident bytes since the process began or the last ``reset_peak_rss``."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> bool:
    """Make the peak the current RSS; False where the kernel does not allow it (the peak then
    counts from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def ru_maxrss_bytes() -> int:
    """``getrusage``'s peak (KiB on Linux), for comparison: see the module docstring."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class RssGrowth:
    """Peak RSS growth from the moment it is made (after a ``gc.collect``): ``mark(name)`` records
    the peak growth reached by each named point, ``growth()`` the peak growth so far."""

    baseline: int = 0
    reset: bool = False
    marks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        gc.collect()
        self.reset = reset_peak_rss()
        self.baseline = current_rss_bytes()

    def growth(self) -> int:
        return peak_rss_bytes() - self.baseline

    def mark(self, name: str) -> int:
        self.marks[name] = self.growth()
        return self.marks[name]


__all__ = ["RssGrowth", "current_rss_bytes", "peak_rss_bytes", "reset_peak_rss", "ru_maxrss_bytes"]
