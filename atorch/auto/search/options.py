"""SearchOptions: what the user asked of the automatic search, validated once, with every default.

The search's keyword arguments arrive as ``auto_accelerate(**kargs)``, untyped. They are checked
here and nowhere else, so a bad value fails before any model is copied or any rank trains (not
deep inside the loop on one rank), each error names the argument and what it accepts, and every
default lives in one place: the dataclass fields below. ``dryrun_steps`` shares its default with
semi-automatic mode's dry run (``DEFAULT_DRYRUN_STEPS``), so the two modes cannot drift apart.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from atorch.auto import opt_lib
from atorch.auto.dryrun import DEFAULT_DRYRUN_STEPS
from atorch.auto.strategy import Strategy
from atorch.distributed.timeouts import DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S
from atorch.errors import InputError

# auto_accelerate keyword argument -> SearchOptions field (the user-facing names predate the fields)
SEARCH_KARGS: dict[str, str] = {
    "time_limit": "time_limit",
    "memory_limit": "memory_limit",
    "search_topk": "topk",
    "dryrun_steps": "dryrun_steps",
    "report_dir": "report_dir",
    "verbose": "verbose",
    "use_profile_cache": "use_cache",
    "search_exhaustive": "exhaustive",
    "dryrun_collective_timeout": "collective_timeout_s",
    "ranks_per_node": "ranks_per_node",
    "intra_node_bandwidth": "intra_node_bandwidth",
    "inter_node_bandwidth": "inter_node_bandwidth",
}

_MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_MEMORY_TEXT = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z]+)\s*$")
_MEMORY_VALID = ("give bytes as a positive int, or a string such as '6GiB', '512MiB', '2GB' "
                 "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")


@dataclass(frozen=True)
class SearchOptions:
    """Every knob of one search, with its default (the only place defaults are written)."""

    time_limit: Optional[float] = None        # seconds for the whole search; None: no limit
    memory_limit: Optional[int] = None        # bytes per rank; None: the device's (see measure.py)
    topk: int = 4                             # candidates dry-run (more if these fail, fewer if the rest cannot win)
    dryrun_steps: int = DEFAULT_DRYRUN_STEPS  # timed steps per dry run, after one warm-up step
    report_dir: Optional[str] = None          # None: no files; else the table, CSV and plot go there
    verbose: bool = False
    excluded: frozenset = frozenset()         # method names no candidate may use
    included: Strategy = field(default_factory=Strategy)  # items every candidate has (name, config)
    use_cache: bool = True                    # reuse single-rank profiles from earlier runs
    exhaustive: bool = False                  # dry-run every candidate predicted to fit (benchmarks)
    refine: bool = True                       # then try the winner with each compute method
    collective_timeout_s: float = DEFAULT_DRYRUN_COLLECTIVE_TIMEOUT_S  # a dry run's collectives give up after it
    ranks_per_node: Optional[int] = None      # None: LOCAL_WORLD_SIZE from the launcher (one node without it)
    intra_node_bandwidth: Optional[float] = None  # bytes/s per rank; None: measured inside each node
    inter_node_bandwidth: Optional[float] = None  # bytes/s per rank; None: measured across nodes (several nodes)

    def __post_init__(self) -> None:
        # constructed directly (tests, benchmarks): accept any iterable of names and any strategy form
        object.__setattr__(self, "excluded", frozenset(self.excluded))
        object.__setattr__(self, "included", Strategy(self.included))

    @classmethod
    def from_kargs(cls, kargs: Mapping[str, Any], excluded: Optional[Iterable[str]] = None,
                   included: Optional[Iterable[Any]] = None) -> "SearchOptions":
        """Options from ``auto_accelerate``'s kargs (others, such as ``find_unused_parameters``, are
        ignored here) and its ``excluded`` / ``included`` lists; raises ``InputError`` (or
        ``UnknownMethodError`` for a misspelt method) naming the first bad argument."""
        values = {name: _CHECKS[name](karg, kargs[karg]) for karg, name in SEARCH_KARGS.items() if karg in kargs}
        values["excluded"], values["included"] = _methods(excluded, included)
        return cls(**values)


def parse_memory_limit(value: Any) -> Optional[int]:
    """Bytes from a positive int, or a string such as '6GiB', '512MiB', '2GB' (units are
    case-insensitive; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10); None stays None."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # 6e9 is a whole number of bytes
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, "B"
    elif isinstance(value, str) and (match := _MEMORY_TEXT.match(value)):
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise InputError(f"memory_limit={value!r} is not valid: {_MEMORY_VALID}")
    factor = _MEMORY_UNITS.get(unit.upper())
    if factor is None:
        raise InputError(f"memory_limit={value!r} has an unknown unit {unit!r}: {_MEMORY_VALID}")
    if int(number * factor) <= 0:
        raise InputError(f"memory_limit={value!r} is not valid: it must be above 0 bytes; {_MEMORY_VALID}")
    return int(number * factor)


# --- one check per field ---------------------------------------------------------------------------
def _seconds(karg: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise InputError(f"{karg}={value!r} is not valid: give seconds as a positive number (int or float), or None "
                     "for no limit")


def _positive_seconds(karg: str, value: Any) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise InputError(f"{karg}={value!r} is not valid: give seconds as a positive number (int or float)")
    return float(value)


def _positive_int(karg: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise InputError(f"{karg}={value!r} is not valid: give a positive int (1, 2, ...)")


def _flag(karg: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise InputError(f"{karg}={value!r} is not valid: give True or False")


def _optional_positive_int(karg: str, value: Any) -> Optional[int]:
    return None if value is None else _positive_int(karg, value)


def _bandwidth(karg: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise InputError(f"{karg}={value!r} is not valid: give bytes per second as a positive number (e.g. 50e9), or "
                     "None for the measured bandwidth")


def _directory(karg: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise InputError(f"{karg}={value!r} is not valid: give a directory path (str or pathlib.Path), or None to "
                     "write no report files")


def _memory(karg: str, value: Any) -> Optional[int]:
    return parse_memory_limit(value)


_CHECKS = {"time_limit": _seconds, "memory_limit": _memory, "topk": _positive_int, "dryrun_steps": _positive_int,
           "report_dir": _directory, "verbose": _flag, "use_cache": _flag, "exhaustive": _flag,
           "collective_timeout_s": _positive_seconds, "ranks_per_node": _optional_positive_int,
           "intra_node_bandwidth": _bandwidth, "inter_node_bandwidth": _bandwidth}


def _methods(excluded: Optional[Iterable[str]], included: Optional[Iterable[Any]]) -> tuple[frozenset, Strategy]:
    """Known method names only (a misspelling raises with the nearest valid name), none both
    included and excluded."""
    if isinstance(excluded, str) or isinstance(included, str):
        raise InputError("excluded / included must be lists of method names, not a single string")
    names = frozenset(excluded or ())
    forced = Strategy(included or ())
    for item in forced:
        opt_lib.get_optimization(item.name)
        if item.name in names:
            raise InputError(f"method {item.name!r} is both included and excluded")
    for name in sorted(names, key=str):
        opt_lib.get_optimization(name)
    return names, forced

