"""parallel_mode: the device mesh every other method reads its process groups from."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from atorch.auto.opt_lib.base import Optimization
from atorch.distributed import mesh


class ParallelModeOptimization(Optimization):
    name = "parallel_mode"
    distributed_only = True
    default_config = None  # data parallelism over every rank

    def normalize(self, config: Any) -> tuple:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return mesh.normalize_parallel_config(config, world_size).as_strategy_config()

    def transform(self, ctx, config: Any) -> None:
        parallel = mesh.normalize_parallel_config(config, dist.get_world_size())

        def build_mesh(ctx) -> None:
            mesh.create_parallel_group(parallel, ctx.device.type)

        ctx.add_wrapper("parallel_mode", self.name, build_mesh)
