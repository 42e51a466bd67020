"""Process-group set-up from torchrun's environment."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from atorch.distributed.elastic import agent_attempt_store
from atorch.errors import InputError

logger = logging.getLogger(__name__)


def init_distributed(backend: Optional[str] = None, set_cuda_device_using_local_rank: bool = False,
                     timeout_s: float = 600.0, timeout: Optional[datetime.timedelta] = None) -> bool:
    """Initialise the default process group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR...).

    Returns True when a process group is ready (already initialised, or initialised now), False in a
    plain single process (no env). The backend defaults to nccl with CUDA and gloo otherwise; "nccl"
    asked for on a machine without CUDA falls back to gloo (with a warning), so one script serves
    both. With CUDA, each rank's device is set to its LOCAL_RANK whether or not
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
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    use_cuda = torch.cuda.is_available()
    if backend == "nccl" and not use_cuda:
        logger.warning("init_distributed: nccl needs CUDA, which this machine lacks; using gloo")
        backend = "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif set_cuda_device_using_local_rank:
        logger.info("init_distributed: set_cuda_device_using_local_rank ignored: no CUDA device")
    store = agent_attempt_store(timeout_s)  # None: torch's own env:// rendezvous
    rendezvous = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                           "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **rendezvous)
    logger.info("initialised %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return True
