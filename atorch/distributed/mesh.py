"""parallel_mode → one DeviceMesh, the single source of every process group.

``([("tensor", 4), ("pipeline", 2), ("data", 2)], None)``: the FIRST name varies fastest, so on 16
ranks tensor groups are [0..3], [4..7], ...; pipeline [0, 4], [1, 5], ...; data [0, 8], [1, 9], ....
The mesh is built outermost dimension first (the reversed list); the optional rank order is a
permutation of range(world_size) laid onto the grid in place of 0..N-1.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, _redistribute

from atorch.distributed.timeouts import apply_cap_to_new_groups
from atorch.errors import ParallelModeError
from atorch.utils.config import MethodConfig, option, validate_config

logger = logging.getLogger(__name__)

PARALLEL_DIMS = ("data", "zero", "tensor", "pipeline")
DATA_DIMS = ("data", "zero")  # dimensions over which the batch is split


@dataclass(frozen=True)
class ParallelModeConfig(MethodConfig):
    """A parallel_mode: dims in the user's order (the first varies fastest) and a rank order."""

    dims: tuple[tuple[str, int], ...] = option(
        (), doc="(name, size) pairs, names among 'data', 'zero', 'tensor', 'pipeline'; the first varies fastest; "
        "data is fitted to the world size")
    rank_order: Optional[tuple[int, ...]] = option(
        None, doc="a permutation of range(world size) laid onto the grid in place of 0..N-1")

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)


def parse_parallel_config(config: Any) -> ParallelModeConfig:
    """A parallel_mode config as given (not yet fitted to a world size), checked: None, the seed's
    ``([(name, size), ...], rank_order_or_None)``, the list of pairs alone, a dict or an instance."""
    if config is None:
        config = {}
    elif not isinstance(config, (Mapping, ParallelModeConfig)):
        config = _seed_form(config)
    parsed = validate_config("parallel_mode", ParallelModeConfig, config)
    seen: set[str] = set()
    for name, size in parsed.dims:
        if name not in PARALLEL_DIMS:
            raise ParallelModeError(f"parallel_mode: unknown dimension {name!r}; valid names: {list(PARALLEL_DIMS)}")
        if name in seen:
            raise ParallelModeError(f"parallel_mode: dimension {name!r} is given twice")
        if size < 1:
            raise ParallelModeError(f"parallel_mode: size of {name!r} must be a positive int, got {size!r}")
        seen.add(name)
    return parsed


def normalize_parallel_config(config: Any, world_size: int) -> ParallelModeConfig:
    """Validate a parallel_mode config and fit its ``data`` size to ``world_size``.

    The non-data sizes must divide ``world_size``; ``data`` becomes world_size / their product (added
    when missing and needed). Raises ParallelModeError naming the bad entry otherwise.
    """
    parsed = parse_parallel_config(config)
    dims = list(parsed.dims)
    fixed = math.prod(size for name, size in dims if name != "data")
    if world_size % fixed:
        detail = " x ".join(f"{n}={s}" for n, s in dims if n != "data")
        raise ParallelModeError(
            f"parallel_mode: {detail} (product {fixed}) does not divide the world size {world_size}"
        )
    data = world_size // fixed
    if any(name == "data" for name, _ in dims):
        dims = [(n, data if n == "data" else s) for n, s in dims]
    elif data > 1:
        dims = dims + [("data", data)]
    if not dims:
        dims = [("data", world_size)]
    rank_order = parsed.rank_order
    if rank_order is not None and sorted(rank_order) != list(range(world_size)):
        raise ParallelModeError(
            f"parallel_mode: rank order must be a permutation of range({world_size}), got {list(rank_order)}"
        )
    return ParallelModeConfig(tuple(dims), rank_order)


def _seed_form(config: Any) -> dict:
    """``([(name, size), ...], rank_order_or_None)`` or the list of pairs alone → a dict."""
    if isinstance(config, (tuple, list)) and len(config) == 2 and _pairs(config[0]) and (
        config[1] is None or isinstance(config[1], (list, tuple))
    ):
        return {"dims": config[0], "rank_order": config[1]}
    if _pairs(config):
        return {"dims": config}
    raise ParallelModeError(
        "parallel_mode config must be ([(name, size), ...], rank_order_or_None), "
        f"e.g. ([('tensor', 2), ('data', 2)], None); got {config!r}"
    )


def _pairs(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(d, (list, tuple)) for d in value)


def rank_grid(config: ParallelModeConfig) -> torch.Tensor:
    """Ranks laid out outermost-first (mesh shape = reversed dims), first dim fastest."""
    order = config.rank_order or tuple(range(config.world_size))
    shape = [size for _, size in reversed(config.dims)]
    return torch.tensor(order, dtype=torch.int).reshape(shape)


def group_ranks(config: ParallelModeConfig, names: Sequence[str] | None = None) -> dict[str, list[list[int]]]:
    """Rank lists of every group along each dimension, computed without any process (pure function).

    With several ``names`` in one key (e.g. ("zero", "data")), the groups span those dimensions jointly.
    """
    grid = rank_grid(config)
    mesh_names = [name for name, _ in reversed(config.dims)]
    result = {}
    for name in names or [n for n, _ in config.dims]:
        result[name] = _groups_along(grid, mesh_names, [name])
    return result


def _groups_along(grid: torch.Tensor, mesh_names: list[str], names: Sequence[str]) -> list[list[int]]:
    axes = [mesh_names.index(n) for n in names]
    others = [a for a in range(grid.dim()) if a not in axes]
    moved = grid.permute(others + axes).reshape(-1, math.prod(grid.shape[a] for a in axes))
    return sorted((row.tolist() for row in moved), key=lambda r: r[0])


class ParallelState:
    """The live mesh and the groups derived from it (one per process)."""

    def __init__(self, config: ParallelModeConfig, device_type: str):
        self.config = config
        names = tuple(name for name, _ in reversed(config.dims))
        self.mesh = DeviceMesh(device_type, rank_grid(config), mesh_dim_names=names)
        self._groups: dict[str, Any] = {name: self.mesh.get_group(name) for name in names}
        present = [n for n in DATA_DIMS if n in names]
        if len(present) == 2:  # batch split over zero x data jointly
            rank_lists = _groups_along(rank_grid(config), list(names), present)
            group, _ = dist.new_subgroups_by_enumeration(rank_lists)
            self._groups["data_parallel"] = group
        elif present:
            self._groups["data_parallel"] = self._groups[present[0]]

    def group(self, name: str):
        if name not in self._groups:
            return None
        return self._groups[name]


_STATE: Optional[ParallelState] = None


def create_parallel_group(config: ParallelModeConfig, device_type: Optional[str] = None) -> ParallelState:
    """Build the mesh on every rank (collective: all ranks must call it with the same config)."""
    global _STATE
    if not dist.is_initialized():
        raise ParallelModeError("parallel_mode needs torch.distributed; call atorch.init_distributed() first")
    if config.world_size != dist.get_world_size():
        raise ParallelModeError(
            f"parallel_mode covers {config.world_size} ranks but the world size is {dist.get_world_size()}"
        )
    if _STATE is not None and _STATE.config == config:
        return _STATE
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    _STATE = ParallelState(config, device_type)
    apply_cap_to_new_groups()
    logger.info("parallel_mode mesh %s: %s", dict(config.dims), _STATE.mesh)
    return _STATE


def destroy_parallel_group() -> None:
    """Forget the mesh; called where its process groups are destroyed (a failure's rebuild,
    ``reset_distributed``), so DTensor's caches of meshes are dropped with it (``forget_cached_meshes``)."""
    global _STATE
    _STATE = None
    forget_cached_meshes()


def forget_cached_meshes() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches. Their entries hold the DeviceMesh
    of the op they were computed for, and meshes compare equal by shape, ranks and names, not by their
    process groups: after the groups are destroyed and rebuilt (a rank's failure in a dry run), a new
    mesh of the same shape would be served an old entry, and the old mesh's collectives would name a
    process group that no longer exists ("Could not resolve the process group registered under the
    name 8", seen on 4 ranks after a refused candidate)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    for name in ("_gen_transform_infos", "_planner_cache"):  # private, and moving between releases
        cached = getattr(_redistribute, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
        elif isinstance(cached, dict):
            cached.clear()


def parallel_state() -> Optional[ParallelState]:
    return _STATE


def parallel_config() -> Optional[ParallelModeConfig]:
    return None if _STATE is None else _STATE.config


def device_mesh() -> Optional[DeviceMesh]:
    return None if _STATE is None else _STATE.mesh


def data_parallel_mesh() -> Optional[DeviceMesh]:
    """The sub-mesh that splits the batch: ``data`` or ``zero`` alone (1-D), or both as a 2-D
    ``(data, zero)`` mesh (replicate over data, shard over zero: hybrid sharding). None when the
    strategy has no batch-splitting dimension or there is no mesh."""
    if _STATE is None:
        return None
    names = _STATE.mesh.mesh_dim_names or ()
    present = tuple(n for n in ("data", "zero") if n in names)
    if not present:
        return None
    if len(names) == 1:
        return _STATE.mesh
    return _STATE.mesh[present if len(present) > 1 else present[0]]


def parallel_group(name: str):
    """Process group of ``name`` ("data", "zero", "tensor", "pipeline", or "data_parallel" for the
    joint batch-splitting group); None in a single process or when the dimension is absent."""
    if name not in PARALLEL_DIMS + ("data_parallel",):
        raise ParallelModeError(f"unknown parallel group {name!r}; valid: {list(PARALLEL_DIMS) + ['data_parallel']}")
    return None if _STATE is None else _STATE.group(name)


def parallel_group_size(name: str) -> int:
    group = parallel_group(name)
    return 1 if group is None else dist.get_world_size(group)


def parallel_rank(name: str) -> int:
    group = parallel_group(name)
    return 0 if group is None else dist.get_rank(group)


def parallel_group_ranks(name: str) -> list[int]:
    group = parallel_group(name)
    if group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(group)


def data_parallel_size() -> int:
    return parallel_group_size("data_parallel")


def data_parallel_rank() -> int:
    return parallel_rank("data_parallel")



__all__ = [
    "PARALLEL_DIMS", "ParallelModeConfig", "parse_parallel_config", "normalize_parallel_config", "group_ranks",
    "rank_grid",
    "create_parallel_group", "destroy_parallel_group", "parallel_group", "parallel_group_size",
    "parallel_rank", "parallel_group_ranks", "data_parallel_size", "data_parallel_rank", "device_mesh",
    "data_parallel_mesh",
    "parallel_config", "parallel_state",
]
