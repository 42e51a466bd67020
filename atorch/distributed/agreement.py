"""Rank agreement: small collectives that make every rank take the same decision.

A dry run or a search step that fails on one rank must fail on all of them, and a time-limit
decision must not differ between ranks, or the next collective would hang. These helpers are the
one place those decisions are reduced; in a single process they return their input.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from atorch.distributed.timeouts import current_timeout

_store_rounds: dict[tuple, itertools.count] = {}


def is_multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where agreement tensors live: nccl reduces CUDA tensors only, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(values: Sequence[float], group: Optional[dist.ProcessGroup] = None) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (float64, so byte counts stay exact); over
    ``group`` (every rank's, such as the checkpoint writer's gloo group) when given."""
    if not is_multi_rank():
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def min_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise minimum of ``values`` over all ranks (for example the slowest rank's bandwidth)."""
    return [-v for v in max_over_ranks([-float(v) for v in values])]


def all_ranks_true(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True only when ``flag`` is True on every rank."""
    return max_over_ranks([0.0 if flag else 1.0], group)[0] == 0.0


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (for decisions such as 'out of time' that must not differ)."""
    if not is_multi_rank():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    dist.broadcast(value, src=0)
    return bool(value.item())


def exchange_outside_collectives(value: str, group: Optional[dist.ProcessGroup] = None) -> list[str]:
    """Every rank's ``value`` (in the order of ``group``'s ranks), through the rendezvous store
    instead of a collective.

    For a decision taken after work that may have failed on this rank alone: its peers may still be
    inside one of that work's collectives, and a collective of another shape would be paired with it
    (gloo aborts the process). Through the store, this rank waits while the peers' collective times
    out and they arrive with their own reason; after twice the current collective timeout it raises
    ``TimeoutError``."""
    if not is_multi_rank():
        return [value]
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world_size()))
    store = dist.distributed_c10d._get_default_store()
    key = next_store_key("atorch/exchange", ranks)
    store.set(f"{key}/{dist.get_rank()}", value)
    keys = [f"{key}/{rank}" for rank in ranks]
    try:
        store.wait(keys, 2 * current_timeout())
    except Exception as error:  # the store's own timeout error type differs between torch versions
        raise TimeoutError(f"ranks {list(ranks)} did not all reach the exchange within "
                           f"{2 * current_timeout().total_seconds():.0f} s ({type(error).__name__})") from error
    return [store.get(k).decode() for k in keys]


def next_store_key(prefix: str, ranks: Optional[tuple[int, ...]] = None) -> str:
    """A fresh rendezvous-store key for one exchange among ``ranks`` (default: all): every rank that takes
    part gets the same key, as long as they take part in the same exchanges in the same order."""
    ranks = ranks if ranks is not None else tuple(range(world_size()))
    round_ = next(_store_rounds.setdefault((prefix, *ranks), itertools.count()))
    return f"{prefix}/{'-'.join(map(str, ranks))}/{round_}"


def forget_store_rounds() -> None:
    """After the process group is rebuilt (``run_isolated``): ranks may have taken part in different
    numbers of agreements before the failure, so every rank numbers them from zero again."""
    _store_rounds.clear()
