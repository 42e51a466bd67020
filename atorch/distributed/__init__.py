"""Process groups: ``parallel_group(name)`` and friends, all derived from one DeviceMesh."""
from atorch.distributed.distributed import (
    get_data_partition_rank_and_size,
    local_rank,
    rank,
    reset_distributed,
    world_size,
)
from atorch.distributed.init import init_distributed
from atorch.distributed.mesh import (
    data_parallel_mesh,
    data_parallel_rank,
    data_parallel_size,
    device_mesh,
    parallel_config,
    parallel_group,
    parallel_group_ranks,
    parallel_group_size,
    parallel_rank,
)

__all__ = [
    "init_distributed", "rank", "local_rank", "world_size", "reset_distributed", "get_data_partition_rank_and_size",
    "parallel_group", "parallel_group_size", "parallel_rank", "parallel_group_ranks",
    "data_parallel_size", "data_parallel_rank", "data_parallel_mesh", "device_mesh", "parallel_config",
]
