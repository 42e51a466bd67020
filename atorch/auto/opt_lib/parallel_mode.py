"""parallel_mode: the device mesh every other method reads its process groups from."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from atorch.auto.opt_lib.base import Optimization
from atorch.distributed import mesh


class ParallelModeOptimization(Optimization):
    name = "parallel_mode"
    distributed_only = True
    config_class = mesh.ParallelModeConfig  # default: data parallelism over every rank

    def normalize(self, config: Any) -> mesh.ParallelModeConfig:
        """Also accepts the seed's ``([(name, size), ...], rank_order_or_None)``; the data size is
        fitted to the world size."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return mesh.normalize_parallel_config(config, world_size)

    def transform(self, ctx, config: mesh.ParallelModeConfig) -> None:
        def build_mesh(ctx) -> None:
            mesh.create_parallel_group(config, ctx.device.type)

        ctx.add_wrapper("parallel_mode", self.name, build_mesh)
