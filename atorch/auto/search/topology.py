"""Where the ranks are: nodes x ranks per node, and the rules the layout follows because of it.

Links inside a node (NVLink) are an order of magnitude faster than between nodes, and tensor
parallelism all-reduces activations in every block, so a tensor group that spans nodes is almost
never worth it: the search and atorch.plan only propose tensor groups that fit in one node (the
``tensor`` dimension comes first in ``parallel_mode``, so its ranks are neighbours), while the
pipeline and data dimensions may cross nodes. A user's own ``parallel_mode`` is not checked here.

The topology comes from the launcher's environment (``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``, which
torchrun sets) or from the search options (``ranks_per_node``), which is how tests simulate nodes. With
several nodes the two links are measured apart (``measure.measure_links``) unless the options give them.
The estimate that costs each collective on its link is ``atorch.cost_model.topology_estimate`` (the cost
model imports ``Topology`` and ``Links`` from here, so nothing here imports it back).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from atorch.auto.search.layouts import LayoutFacts


@dataclass(frozen=True)
class Topology:
    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def crosses_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of ``group_size`` ranks spaced ``stride`` apart (the mesh lays the first
        dimension fastest) spans more than one node."""
        return group_size > 1 and group_size * stride > self.ranks_per_node


def topology_for(world_size: int, ranks_per_node: Optional[int] = None) -> Topology:
    """Nodes x ranks per node: ``ranks_per_node`` when given, else ``LOCAL_WORLD_SIZE`` from the
    launcher; one node when neither divides the world size."""
    local = ranks_per_node or _env_int("LOCAL_WORLD_SIZE")
    if not local or local < 1 or world_size % local:
        return Topology(1, max(world_size, 1))
    return Topology(world_size // local, local)


def keep_tensor_in_node(facts: LayoutFacts, topology: Topology) -> LayoutFacts:
    """Mark tensor sizes larger than a node unsupported (the report shows the reason)."""
    for size in range(2, topology.world_size + 1):
        if topology.world_size % size == 0 and size > topology.ranks_per_node:
            facts.unsupported.setdefault(
                f"tp{size}", f"a tensor group of {size} would span nodes ({topology.ranks_per_node} ranks per node)")
    for key in [k for k in facts.state_share if facts.reason(*k)]:
        del facts.state_share[key]
    return facts


@dataclass(frozen=True)
class Links:
    """All-reduce bandwidth (bytes/s per rank) inside a node and between nodes. The search fills both from the
    ``HardwareProfile`` (each measured on its own link, or given by the options); None: the all-ranks one."""

    intra_node: Optional[float] = None
    inter_node: Optional[float] = None


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None
