"""Process-group set-up from torchrun's environment."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from atorch.common.util_func import find_free_port
from atorch.distributed.elastic import agent_attempt_store
from atorch.errors import InputError

logger = logging.getLogger(__name__)


def init_distributed(backend: Optional[str] = None, set_cuda_device_using_local_rank: bool = False,
                     timeout_s: float = 600.0, timeout: Optional[datetime.timedelta] = None) -> bool:
    """Initialise the default process group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR...).

    Returns True when a process group is ready (already initialised, or initialised now). In a plain
    single process (no launcher's env) it creates a one-process group, as ATorch does: rank 0 of 1,
    meeting at MASTER_ADDR / MASTER_PORT when set, else on loopback at a free port (the environment
    is left as it was). auto_accelerate itself calls ``init_from_launcher``. The backend defaults to
    nccl with CUDA and gloo otherwise; "nccl" asked for on a machine without CUDA falls back to gloo
    (with a warning), so one script serves both. With CUDA, each rank's device is set to its
    LOCAL_RANK whether or not
    ``set_cuda_device_using_local_rank`` (ATorch's name, accepted) is True: that is the only layout
    auto_accelerate supports. ``timeout_s`` (or ATorch's ``timeout``, a timedelta) bounds every
    collective, so a rank that dies cannot leave the others waiting for ever.

    Under torchrun's shared agent store, the group is built on a namespace of its own per attempt
    (``atorch.distributed.elastic``), so ``torchrun --max-restarts N`` restarts work.
    """
    if backend is not None and not isinstance(backend, str):
        raise InputError(f"init_distributed: backend must be a string such as 'nccl' or 'gloo', got {backend!r}")
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            raise InputError(f"init_distributed: timeout must be a datetime.timedelta, got {timeout!r} "
                             f"(or pass timeout_s, in seconds)")
        timeout_s = timeout.total_seconds()
    if dist.is_initialized():
        return True
    rendezvous = {} if launched() else _single_process_rendezvous()  # launched: the attempt's store, below
    use_cuda = torch.cuda.is_available()
    if backend == "nccl" and not use_cuda:
        logger.warning("init_distributed: nccl needs CUDA, which this machine lacks; using gloo")
        backend = "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif set_cuda_device_using_local_rank:
        logger.info("init_distributed: set_cuda_device_using_local_rank ignored: no CUDA device")
    if launched():
        store = agent_attempt_store(timeout_s)  # None: torch's own env:// rendezvous
        rendezvous = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                               "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **rendezvous)
    logger.info("initialised %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return True


def launched() -> bool:
    """Whether a launcher (torchrun and the like) described this process's group in the env."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_from_launcher() -> bool:
    """auto_accelerate's call: the process group a launcher described, or the one the user made;
    False in a plain process, which then trains alone (distributed-only methods are dropped)
    rather than in a one-process group."""
    return dist.is_initialized() or (launched() and init_distributed())


def _single_process_rendezvous() -> dict:
    """``init_process_group``'s arguments for a one-process group without a launcher."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT") or find_free_port(address)
    return {"init_method": f"tcp://{address}:{port}", "rank": 0, "world_size": 1}
