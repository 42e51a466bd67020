"""Per-rank peak-memory measurement of a training step.

Strategy search needs to know how much memory a step needs *on each rank*, so
every number here is local to the calling process:

* CUDA: the caching allocator already records a peak, so we reset it on entry
  and read ``max_memory_allocated`` on exit. What the region itself held is that
  peak less what was allocated at entry, plus the bytes of ``roots`` on the
  device: memory the process held before, reachable from nothing the region
  uses (a model the caller dropped whose reference cycle the garbage collector
  has not reached yet), would otherwise count, and a search that subtracts two
  such measurements (pieces of a model) reads its release mid-way as a block
  costing nothing. Garbage is collected on entry so such memory is not freed
  in the middle of the region either.
* CPU: there is no allocator peak, so we count live tensor storage bytes
  ourselves. Storages reachable from ``roots`` (model / optimizer) form the
  baseline; a ``TorchDispatchMode`` records every storage an op creates, and a
  weak reference to each storage subtracts its bytes when it is freed.
  Allocations made inside a C++ kernel that never surface as an op output
  (scratch workspaces, gloo/DDP internals) are invisible on this path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

try:  # DTensor is optional (torch built without distributed)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["MemoryStats", "PeakMemoryTracker", "collecting_only_new_objects", "measure_peak_memory",
           "release_host_memory", "state_bytes"]


def release_host_memory() -> None:
    """Collect garbage and hand the C allocator's free pages back to the system (glibc's
    ``malloc_trim``; a no-op elsewhere). A search builds and drops one model copy per candidate: without
    this, glibc keeps the freed pages of each in its arenas, and the process's resident memory ratchets
    up by a fraction of a candidate per dry run, though nothing is alive."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def collecting_only_new_objects(fn: Callable) -> Callable:
    """``fn`` runs with the objects alive when it starts frozen (``gc.freeze``): Python's collector skips
    them, so each full collection inside scans only what ``fn`` made. The search and a loaded strategy's
    dry run (what wraps it) collect after every candidate (``release_host_memory``, before each run's timed
    steps, after a failure) to free the copy they dropped; with transformers, dynamo and the user's objects
    in the heap, one such collection took 0.43 s, 23 s of a 4-process search's 80. Garbage is collected
    first, so none is frozen (that one collection is the cost: nothing that collects once or never, such as
    ``auto_accelerate`` without a dry run, is wrapped); everything is unfrozen when ``fn`` returns. A caller
    that froze objects itself keeps its own arrangement."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if gc.get_freeze_count() or not gc.isenabled():
            return fn(*args, **kwargs)
        gc.collect()
        gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.unfreeze()

    return wrapper


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


@dataclass
class MemoryStats:
    """Memory of one measured region on one rank, in bytes."""

    device: str  # "cpu" or "cuda:N"
    baseline_bytes: int  # live bytes at entry (params, grads, optimizer state already alive)
    peak_bytes: int  # highest live bytes seen during the region (includes baseline)
    end_bytes: int  # live bytes at exit

    @property
    def delta_bytes(self) -> int:
        """Transient bytes the region needed above what was already alive."""
        return self.peak_bytes - self.baseline_bytes


# ----------------------------------------------------------------- helpers


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """Storages that actually hold ``t``'s data on this rank.

    DTensor (and other wrapper subclasses) own no memory themselves; only their
    inner local tensors do, so we descend to those.
    """
    if DTensor is not None and isinstance(t, DTensor):
        yield from _storages(t.to_local())
    elif is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    elif t.device.type != "meta":
        yield t.untyped_storage()


def _distinct_storages(roots: object) -> Iterator[tuple[str, torch.UntypedStorage]]:
    """Each storage ``roots`` hold, once (tied weights, flat-parameter views), with the category of the
    first tensor that reached it."""
    seen: set[tuple[str, int]] = set()
    for kind, t in _root_tensors(roots):
        for st in _storages(t):
            key = (str(st.device), st.data_ptr())
            if st.nbytes() and key not in seen:
                seen.add(key)
                yield kind, st


def _device_bytes(roots: Iterable[object], device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` that ``roots`` hold."""
    return sum(st.nbytes() for _, st in _distinct_storages(list(roots)) if st.device == device)


def _root_tensors(root: object) -> Iterator[tuple[str, torch.Tensor]]:
    """(category, tensor) pairs held by a module, optimizer, tensor or container."""
    if isinstance(root, torch.nn.Module):
        for p in root.parameters():
            yield "params", p
            if p.grad is not None:
                yield "grads", p.grad
        for b in root.buffers():
            yield "params", b
    elif isinstance(root, torch.optim.Optimizer):
        for group in root.param_groups:
            for p in group["params"]:
                yield "params", p
                if p.grad is not None:
                    yield "grads", p.grad
        for s in root.state.values():
            for v in tree_leaves(s):
                if isinstance(v, torch.Tensor):
                    yield "optim_state", v
    elif isinstance(root, torch.Tensor):
        yield "params", root
    elif isinstance(root, dict):
        for v in root.values():
            yield from _root_tensors(v)
    elif isinstance(root, (list, tuple, set)):
        for v in root:
            yield from _root_tensors(v)


def state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state actually held locally.

    For DTensor / sharded parameters only the local shard counts (``to_local()``),
    because that is what occupies this rank's memory. Storages are deduplicated
    (tied weights, flat-parameter views) so shared memory is counted once, under
    the first category that reaches it. Returns
    ``{"params": ..., "grads": ..., "optim_state": ..., "total": ...}``.
    """
    out = {"params": 0, "grads": 0, "optim_state": 0}
    for kind, st in _distinct_storages([model] if optimizer is None else [model, optimizer]):
        out[kind] += st.nbytes()
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------- CPU tracking


class _LiveStorageCounter(TorchDispatchMode):
    """Counts live bytes of tracked storages on one device type; remembers the peak.

    Frees are detected with weakref callbacks on ``UntypedStorage`` objects:
    PyTorch keeps a storage's Python object alive as long as the C++ storage,
    so the callback fires exactly when the memory is released. Callbacks may
    come from other threads (autograd / DDP), hence the lock.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, nbytes)
        self._lock = threading.RLock()
        self._orig_resize: Callable[..., Any] | None = None

    def track(self, st: torch.UntypedStorage) -> None:
        """Start counting ``st`` unless it is already counted or on another device."""
        if st.device.type != self.device_type:
            return
        key = id(st)
        with self._lock:
            if key in self._live:
                return
            ref = weakref.ref(st, lambda r, k=key: self._on_free(k, r))
            self._live[key] = (ref, st.nbytes())
            self._add(st.nbytes())

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0] is ref:
                del self._live[key]
                self._add(-entry[1])

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let DTensor desugar to local ops first; we then see the real shard-sized allocations.
        if DTensor is not None and any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Outputs that alias an input (in-place ops, views) are not new memory, even
        # when the input predates the region and was never tracked.
        inputs = {
            id(st)
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
            for st in _storages(t)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    if id(st) not in inputs:
                        self.track(st)
        return out

    # ``UntypedStorage.resize_`` bypasses the dispatcher, but sharding schemes
    # (FSDP) use it to free / re-materialize unsharded parameters.
    def __enter__(self):  # type: ignore[no-untyped-def]
        self._orig_resize = orig = torch.UntypedStorage.resize_
        counter = self

        def resize_(st: torch.UntypedStorage, size: int):  # type: ignore[no-untyped-def]
            old = st.nbytes()
            res = orig(st, size)
            with counter._lock:
                entry = counter._live.get(id(st))
                if entry is not None:
                    counter._live[id(st)] = (entry[0], st.nbytes())
                    counter._add(st.nbytes() - entry[1])
                elif old == 0:  # growing an empty storage is a fresh allocation
                    counter.track(st)
            return res

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)


# ----------------------------------------------------------------- public API


class PeakMemoryTracker:
    """Context manager measuring this rank's peak memory over a region.

    ``with PeakMemoryTracker(device, roots=[model, optimizer]) as t: <run steps>``
    then ``t.stats`` is a :class:`MemoryStats`.

    On both devices ``roots`` define the baseline (their tensors alive at entry); tensors alive before
    entry but not reachable from ``roots`` are not counted (on CUDA: the allocator's figures less what
    was allocated at entry, plus the roots' bytes on the device; see the module doc).
    """

    def __init__(self, device: torch.device | str = "cpu", roots: Iterable[object] = ()) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device}; expected cpu or cuda")
        self.device = device
        self.roots = list(roots)
        self.stats: MemoryStats | None = None
        self._counter: _LiveStorageCounter | None = None
        self._baseline = 0
        self._earlier_phases_peak = 0  # the highest peak of the phases ``phase_peak`` closed
        self._foreign = 0  # CUDA: bytes allocated at entry that no root holds (not the region's)

    def __enter__(self) -> PeakMemoryTracker:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = _device_bytes(self.roots, self.device)
            self._foreign = max(torch.cuda.memory_allocated(self.device) - self._baseline, 0)
        else:
            self._counter = _LiveStorageCounter("cpu")
            for _, t in _root_tensors(self.roots):
                for st in _storages(t):
                    self._counter.track(st)
            self._baseline = self._counter.current
            self._counter.__enter__()
        return self

    def live_bytes(self) -> int:
        """The bytes alive now, as the region counts them (on CPU: only storages seen from the roots or
        made inside the region)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._foreign
        assert self._counter is not None, "live_bytes is read inside the tracked region"
        return self._counter.current

    def phase_peak(self) -> int:
        """The peak since entry or the previous call, and a new phase starts here: so a caller can tell
        the forward and backward's peak (activations) from the optimizer step's (its temporaries beside
        the whole state). The region's overall peak in ``stats`` still counts every phase."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._foreign
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self._counter is not None, "phase_peak is read inside the tracked region"
            peak = self._counter.peak
            self._counter.peak = self._counter.current
        self._earlier_phases_peak = max(self._earlier_phases_peak, peak)
        return peak

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._foreign
            end = torch.cuda.memory_allocated(self.device) - self._foreign
        else:
            assert self._counter is not None
            self._counter.__exit__(*exc)
            peak, end = self._counter.peak, self._counter.current
        peak = max(peak, self._earlier_phases_peak)
        self.stats = MemoryStats(str(self.device), self._baseline, peak, end)
        self._counter = None  # drop weakrefs; nothing is counted after exit


def measure_peak_memory(
    fn: Callable[[], Any], device: torch.device | str = "cpu", roots: Iterable[object] = ()
) -> tuple[Any, MemoryStats]:
    """Run ``fn()`` under a :class:`PeakMemoryTracker`; return ``(result, stats)``."""
    with PeakMemoryTracker(device, roots) as tracker:
        result = fn()
    assert tracker.stats is not None
    return result, tracker.stats


def training_state_bytes(result: Any) -> dict[str, int]:
    """``state_bytes`` of what auto_accelerate returned (model and the optimizer that holds state).

    ZeroRedundancyOptimizer keeps this rank's state in its local ``optim``; that is what counts.
    """
    optimizer = getattr(result.optim, "torch_optimizer", result.optim)
    local = getattr(optimizer, "optim", None) or getattr(optimizer, "inner", None)
    if isinstance(local, torch.optim.Optimizer):
        optimizer = local
    return state_bytes(result.model, optimizer)
