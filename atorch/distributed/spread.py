"""Work spread over the ranks: each rank does its share alone, then every rank has every result.

Why: the search measures each (precision, checkpoint) setting on one rank training alone. Every rank used to
measure every setting, the same work on each; spread, N ranks measure N settings at once, so measuring takes
the time of ceil(settings / N) settings instead of all of them.

How: the items go out in rounds of N, one to each rank; in a round with fewer items than ranks, the ranks left
over do the round's items again (round robin), so every rank is busy in every round. On a device per rank that
costs nothing; on CPU cores that the ranks share, a rank measuring while the others sleep would have the cores
to itself and time a step faster than training, where every rank computes at once, will run it (measured on
4 ranks sharing 2 cores: half the step time). Each item's results come back from every rank that did it.

The work is local (no collective inside it), so an item that raises is that rank's result, an error, and no
process group is aborted. The ranks then wait for each other's results through the rendezvous store, not a
collective: a collective's timeout would have to cover the longest share, and a rank still working is not a
rank lost. A rank that dies is noticed instead by its heartbeat: a thread counts up a store key every
``HEARTBEAT_S`` while the rank works, and a peer whose count has not moved for ``lost_after_s`` is reported
with ``RankLostError``. A share that raised is raised again on every rank, naming the rank and the item, after
every rank has its results: no rank is left waiting.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar

import torch.distributed as dist

from atorch.distributed.agreement import is_multi_rank, next_store_key, world_size
from atorch.errors import RankLostError

Item = TypeVar("Item")

HEARTBEAT_S = 0.5
POLL_S = 0.02


class ShareFailedError(RuntimeError):
    """A rank's share raised: every rank raises this, naming the rank and the item, with its error."""


def spread_over_ranks(items: Sequence[Item], work: Callable[[Item], str], lost_after_s: float,
                      describe: Callable[[Item], str] = str) -> list[list[str]]:
    """``work(item)`` for every item on the ranks ``assignment`` gives it; every rank gets, for each item in
    the order of ``items``, the results of the ranks that did it (in rank order). ``work`` must not run
    collectives (its peers are doing other items). In one process: ``work`` on each item in turn."""
    if not is_multi_rank():
        return [[work(item)] for item in items]
    rank, world = dist.get_rank(), world_size()
    store, key = dist.distributed_c10d._get_default_store(), next_store_key("atorch/spread")
    mine: dict[int, str] = {}
    failure: Optional[dict] = None
    with _Heartbeat(store, f"{key}/alive/{rank}"):
        for index in assignment(len(items), world)[rank]:
            try:
                mine[index] = work(items[index])
            except Exception as error:  # the share's own failure: reported to every rank below
                failure = {"rank": rank, "item": describe(items[index]), "error": f"{type(error).__name__}: {error}"}
                break
    store.set(f"{key}/result/{rank}", json.dumps({"results": mine, "failure": failure}))
    records = _wait_for_results(store, key, world, lost_after_s)
    failures = [record["failure"] for record in records if record["failure"]]
    if failures:
        first = failures[0]
        raise ShareFailedError(f"rank {first['rank']} failed on {first['item']}: {first['error']}")
    results: list[list[str]] = [[] for _ in items]
    for record in records:
        for index, text in record["results"].items():
            results[int(index)].append(text)
    return results


def assignment(count: int, world: int) -> list[list[int]]:
    """The item indices each rank does: round k gives items kN .. kN + N - 1 to ranks 0 .. N - 1, and a round
    with m < N items gives rank r item kN + r % m, so that no rank is idle while the others work."""
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, count, world):
        in_round = min(world, count - start)
        for rank in range(world):
            shares[rank].append(start + rank % in_round)
    return shares


def _wait_for_results(store, key: str, world: int, lost_after_s: float) -> list[dict]:
    """Every rank's record, waiting while each missing rank's heartbeat still moves."""
    try:
        return _poll_results(store, key, world, lost_after_s)
    except RankLostError:
        raise
    except Exception as error:  # the store's host (rank 0 or the launcher) is gone
        raise RankLostError(f"the rendezvous store stopped answering while the ranks shared out work "
                            f"({type(error).__name__}: {error}); rank 0 or the launcher was lost",
                            lost_ranks=[0]) from error


def _poll_results(store, key: str, world: int, lost_after_s: float) -> list[dict]:
    result_keys = [f"{key}/result/{r}" for r in range(world)]
    beats: dict[int, tuple[Optional[bytes], float]] = {}  # rank -> (last count seen, when it last moved)
    while not store.check(result_keys):
        now = time.monotonic()
        for r in range(world):
            if store.check([result_keys[r]]):
                continue
            count = store.get(f"{key}/alive/{r}") if store.check([f"{key}/alive/{r}"]) else None
            seen, since = beats.get(r, (None, now))
            if count != seen or r not in beats:
                beats[r] = (count, now)
            elif now - since > lost_after_s:
                raise RankLostError(f"rank {r} stopped answering while the ranks shared out work (no heartbeat "
                                    f"for {lost_after_s:.0f} s: killed, or hung outside atorch)", lost_ranks=[r])
        time.sleep(POLL_S)
    return [json.loads(store.get(k).decode()) for k in result_keys]


class _Heartbeat:
    """Counts up ``key`` in the store every ``HEARTBEAT_S`` while the block runs (from a thread: the rank's
    own work does not have to)."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="atorch-heartbeat", daemon=True)

    def __enter__(self) -> "_Heartbeat":
        self.store.set(self.key, "0")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _beat(self) -> None:
        count = 0
        while not self.done.wait(HEARTBEAT_S):
            count += 1
            try:
                self.store.set(self.key, str(count))
            except Exception:  # the store is gone (the launcher ended the job): nothing left to tell
                return
