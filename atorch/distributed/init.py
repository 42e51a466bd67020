"""Process-group set-up from torchrun's environment."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> bool:
    """Initialise the default process group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR...).

    Returns True when a process group is ready, False in a plain single process (no env). The backend
    defaults to nccl with CUDA and gloo otherwise. ``timeout_s`` bounds every collective, so a rank
    that dies cannot leave the others waiting for ever.
    """
    if dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("initialised %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return True
