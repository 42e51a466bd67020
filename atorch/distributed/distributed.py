"""ATorch's process-level helpers: ``rank()``, ``local_rank()``, ``world_size()``,
``reset_distributed()``, ``get_data_partition_rank_and_size()`` and, at ATorch's import path,
``init_distributed`` (from ``atorch.distributed.init``).

Outside a process group (a plain single process), ``rank()`` and ``local_rank()`` return None, as
ATorch's do (its example tests ``atorch.rank() is None or atorch.rank() == 0``), and
``world_size()`` returns 1, so that arithmetic such as ``batch // atorch.world_size()`` works in
both cases.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from atorch.distributed import fault, mesh
from atorch.distributed.init import init_distributed

logger = logging.getLogger(__name__)


def rank() -> Optional[int]:
    """This process's global rank; None outside a process group."""
    return dist.get_rank() if dist.is_initialized() else None


def local_rank() -> Optional[int]:
    """This process's rank on its node (torchrun's LOCAL_RANK); None outside a process group."""
    if not dist.is_initialized():
        return None
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return dist.get_rank() % max(per_node, 1)


def world_size() -> int:
    """Number of ranks in the default process group; 1 outside a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def get_data_partition_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in the batch-splitting group: the ranks that read different
    data. From the mesh auto_accelerate built (its ``data``/``zero`` dimensions); without one, the
    whole world splits the data; (0, 1) in a single process."""
    if mesh.parallel_state() is not None:
        return mesh.data_parallel_rank(), mesh.data_parallel_size()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reset_distributed() -> None:
    """Destroy atorch's mesh state and the default process group (and every group made from it),
    so that a new ``init_distributed`` / ``auto_accelerate`` starts clean. A no-op when nothing is
    initialised. Drop the returned model and optimizer first: a DDP wrapper still holding the gloo
    group when it is freed after the group was destroyed can block that process."""
    mesh.destroy_parallel_group()
    fault.forget_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
        logger.info("process groups destroyed")


__all__ = ["init_distributed", "rank", "local_rank", "world_size", "get_data_partition_rank_and_size",
           "reset_distributed"]
