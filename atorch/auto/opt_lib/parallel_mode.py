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
    provides_mesh = True
    stages = ("parallel_mode",)
    reads = ("device",)

    def check_structure(self, config: Any) -> mesh.ParallelModeConfig:
        """One process: the config's form only (there is no world size to fit it to)."""
        return mesh.parse_parallel_config(config)

    def missing_dims_message(self, missing: list[str], dims: list, world_size: int) -> str:
        """What to tell a user whose parallel_mode lacks dimensions a method works on."""
        add = ", ".join(f"({d!r}, N)" for d in missing)
        example = [(d, 2) for d in missing]
        return (f"needs the {' and '.join(repr(d) for d in missing)} dimension(s) of parallel_mode above 1, but "
                f"parallel_mode is {dims} on {world_size} rank(s), so it would do nothing; add {add} to "
                f"parallel_mode (N ranks each, dividing the world size), e.g. (\"parallel_mode\", ({example}, None))")

    def normalize(self, config: Any) -> mesh.ParallelModeConfig:
        """Also accepts the seed's ``([(name, size), ...], rank_order_or_None)``; the data size is
        fitted to the world size."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return mesh.normalize_parallel_config(config, world_size)

    def transform(self, ctx, config: mesh.ParallelModeConfig) -> None:
        def build_mesh(ctx) -> None:
            mesh.create_parallel_group(config, ctx.device.type)

        ctx.add_wrapper("parallel_mode", self.name, build_mesh)
