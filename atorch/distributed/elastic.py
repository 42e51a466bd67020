"""A fresh rendezvous namespace per torchrun attempt, so ``torchrun --max-restarts N`` restarts work.

Why: since torch 2.5 torchrun's c10d rendezvous shares its agent's TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; MASTER_ADDR:MASTER_PORT is the agent's store) and keeps that
store across restarts. ``init_process_group`` writes every rank's address under the same keys in
every attempt, so after a restart a fast rank reads the dead attempt's addresses: gloo's
``connectFullMesh`` fails with "Connection refused" or hangs, NCCL reads a stale unique id
(pytorch/pytorch#135712, #167288). Here 13 of 19 restarts of a 2-process job failed that way.
``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts, so
nodes disagree (#135712).

What atorch does instead: rank 0 opens a new attempt number on the agent's store (an atomic
counter), every other rank announces itself there with a token of its own, and rank 0 answers each
token. A rank that read the previous attempt's number (rank 0 had not counted yet) gets no answer
to its token and reads the number again. When every rank is answered, all of them build the
process group on ``PrefixStore("atorch/attempt/<n>/", agent store)``, where no earlier attempt
wrote. The keys are unique per process, so nothing stale can pass for an answer, and the attempts
agree across nodes. Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or another
launcher) nothing changes: rank 0 hosts a new store on a new port every attempt.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from typing import Optional

import torch.distributed as dist

from atorch.errors import RankLostError

logger = logging.getLogger(__name__)

ATTEMPT_KEY = "atorch/attempt"
POLL_S = 0.05  # how often a rank reads the attempt number and looks for rank 0's answer


def uses_agent_store() -> bool:
    """Whether torchrun asked the workers to reuse its agent's TCPStore (MASTER_ADDR:MASTER_PORT)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The agent's store under this attempt's own prefix (every rank calls it once per
    ``init_process_group``)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    attempt = agree_attempt(store, rank, world_size, timeout_s)
    logger.info("rank %d joined rendezvous attempt %d on the agent's store", rank, attempt)
    return dist.PrefixStore(f"{ATTEMPT_KEY}/{attempt}/", store)


def agree_attempt(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """A new attempt number on ``store``, the same on every rank (collective on the store).
    RankLostError when a rank does not join within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    return _open_attempt(store, world_size, deadline) if rank == 0 else _join_attempt(store, rank, deadline)


def _open_attempt(store: dist.Store, world_size: int, deadline: float) -> int:
    """Rank 0: count a new attempt, wait for every other rank's token there and answer each."""
    attempt = store.add(ATTEMPT_KEY, 1)
    hellos = [f"{ATTEMPT_KEY}/{attempt}/hello/{r}" for r in range(1, world_size)]
    try:
        store.wait(hellos, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except dist.DistStoreError as error:
        missing = [r for r, key in enumerate(hellos, start=1) if not store.check([key])]
        raise RankLostError(f"init_distributed: rank(s) {missing} did not join rendezvous attempt {attempt} within "
                            f"the timeout ({error})", lost_ranks=missing) from error
    for r, key in enumerate(hellos, start=1):
        store.set(f"{ATTEMPT_KEY}/{attempt}/welcome/{r}", store.get(key))
    return attempt


def _join_attempt(store: dist.Store, rank: int, deadline: float) -> int:
    """Any other rank: announce a token in the current attempt until rank 0 answers that token.
    Polls with ``check`` (a ``wait`` that times out logs a warning each time)."""
    token, announced = uuid.uuid4().hex.encode(), None
    while time.monotonic() < deadline:
        attempt = store.add(ATTEMPT_KEY, 0)  # the current number; 0: rank 0 has not counted yet
        if attempt and attempt != announced:
            store.set(f"{ATTEMPT_KEY}/{attempt}/hello/{rank}", token)
            announced = attempt
        welcome = f"{ATTEMPT_KEY}/{attempt}/welcome/{rank}"
        if attempt and store.check([welcome]) and store.get(welcome) == token:
            return attempt  # another token there: a dead attempt's answer, and rank 0 has not counted yet
        time.sleep(POLL_S)
    raise RankLostError(f"init_distributed: rank 0 did not open a rendezvous attempt for rank {rank} within the "
                        "timeout", lost_ranks=[0])


def agent_attempt_store(timeout_s: float) -> Optional[dist.Store]:
    """``attempt_store`` for this process when torchrun shares its agent's store, else None."""
    if not uses_agent_store():
        return None
    return attempt_store(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s)
