"""Accelerators and clusters as data, for planning without the hardware.

The search measures the machine it runs on (``measure.py``); the planner (``atorch.plan``) predicts
for a machine it does not have, so it needs the machine's numbers written down: peak dense FLOP/s,
memory, memory bandwidth and the two link speeds (NVLink inside a node, the network between
nodes). They live here as one table of frozen dataclasses, so a prediction can always be traced
to the numbers it used, and a user adds a device by giving the same fields (a dict or a JSON file)
instead of editing code.

Bandwidths are per GPU and per direction, in bytes/s (NVLink 4 on H100: 900 GB/s bidirectional is
450e9 here; 400 Gb/s InfiniBand per GPU is 50e9). Memory is what ``torch.cuda`` reports as the
device's total, in bytes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from atorch.errors import InputError, nearest_name
from atorch.plan import calibration

GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model. ``efficiency`` is the share of ``bf16_flops`` that large dense training
    matmuls reach; None: the fitted value of the device's ``family`` (``calibration.py``: one per chip
    and power limit, fitted on published runs; see ``benchmarks/plan_vs_published.py``)."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fp8_flops: float = 0.0            # 0: no fp8 tensor cores
    hbm_bytes_per_s: float = 0.0
    nvlink_bytes_per_s: float = 0.0   # per GPU, one direction, inside a node
    network_bytes_per_s: float = 0.0  # per GPU, one direction, between nodes
    efficiency: Optional[float] = None
    source: str = ""                  # where the numbers come from
    family: str = "hopper"            # whose fitted efficiency applies when ``efficiency`` is None

    @property
    def matmul_efficiency(self) -> float:
        return self.efficiency if self.efficiency is not None else calibration.value(f"{self.family} efficiency")

    @property
    def fp32_flops(self) -> float:
        """fp32 training runs on TF32 tensor cores: half the bf16 rate."""
        return self.bf16_flops / 2


# Vendor datasheets (dense, no sparsity); bandwidths per GPU and direction. Distinct devices for one chip
# differ in memory size and bandwidth (the memory-bound part of a step) and, for the 500 W H100, in the
# clock its power limit allows (its own fitted efficiency).
_B200 = DeviceSpec("B200", int(178.35 * GIB), 2.25e15, 4.5e15, 7.67e12, 900e9, 50e9, None,
                   "NVIDIA B200 SXM (1000 W; HGX / DGX B200): dense bf16 2.25 and fp8 4.5 PFLOP/s; memory and "
                   "bandwidth as the device reports them (pytorch/ao #4002: 178.35 GiB, a 7680-bit bus at 3996 MHz, "
                   "7.67 TB/s); NVLink 5 1.8 TB/s; ConnectX-7 400 Gb/s per GPU (DGX B200)", "blackwell")
DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("A100-40GB", int(39.4 * GIB), 312e12, 0.0, 1.555e12, 300e9, 25e9, None,
               "NVIDIA A100 datasheet (SXM4 40GB: 1,555 GB/s HBM2, NVLink 600 GB/s), HDR InfiniBand 200 Gb/s per GPU",
               "ampere"),
    DeviceSpec("A100-80GB", int(79.2 * GIB), 312e12, 0.0, 2.039e12, 300e9, 25e9, None,
               "NVIDIA A100 datasheet (SXM4 80GB: 2,039 GB/s HBM2e, NVLink 600 GB/s), HDR InfiniBand 200 Gb/s per GPU",
               "ampere"),
    DeviceSpec("H100-80GB", int(79.1 * GIB), 989e12, 1979e12, 3.35e12, 450e9, 50e9, None,
               "NVIDIA H100 SXM5 datasheet (700 W, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s), NDR 400 Gb/s per GPU",
               "hopper"),
    DeviceSpec("H100-96GB", int(94.5 * GIB), 989e12, 1979e12, 2.4e12, 450e9, 50e9, None,
               "torchtitan's Grand Teton H100 (96 GB HBM2e, 2.4 TB/s, 500 W; SXM peak used as in its MFU), "
               "400 Gb/s RDMA per GPU", "hopper 500W"),
    DeviceSpec("H200", int(139.8 * GIB), 989e12, 1979e12, 4.8e12, 450e9, 50e9, None,
               "NVIDIA H200 SXM datasheet (700 W, 141 GB HBM3e 4.8 TB/s), NDR InfiniBand 400 Gb/s per GPU", "hopper"),
    _B200,
    replace(_B200, name="B200-750W", family="blackwell 750W",
            source="the B200 above power-capped to 750 W (torchao's B200 benchmarks); the same datasheet numbers, "
                   "its own fitted efficiency"),
    # the export parts: the same chips and memory as the A100 80GB and H100 SXM above (their fitted
    # efficiencies apply), NVLink cut to 400 GB/s (200 GB/s a direction)
    DeviceSpec("A800-80GB", int(79.2 * GIB), 312e12, 0.0, 2.039e12, 200e9, 25e9, None,
               "NVIDIA A800 SXM4 80GB datasheet (the A100 80GB's chip and 2,039 GB/s HBM2e, NVLink 400 GB/s), "
               "HDR InfiniBand 200 Gb/s per GPU", "ampere"),
    DeviceSpec("H800", int(79.1 * GIB), 989e12, 1979e12, 3.35e12, 200e9, 50e9, None,
               "NVIDIA H800 SXM5 (the H100 SXM5's chip, 80 GB HBM3 3.35 TB/s, 700 W; NVLink 400 GB/s), "
               "400 Gb/s per GPU", "hopper"),
    DeviceSpec("GH200", int(94.5 * GIB), 989e12, 1979e12, 4.0e12, 450e9, 50e9, None,
               "NVIDIA GH200 Grace Hopper datasheet (96 GB HBM3 4 TB/s, NVLink 900 GB/s), 400 Gb/s per GPU", "hopper"),
)}

# what people call the built-in parts (upper case, spaces as dashes): "H100" is the SXM5 80 GB part of
# DGX / HGX H100, the H100 of published runs unless they say otherwise; the 96 GB one is torchtitan's
DEVICE_ALIASES = {
    "H100": "H100-80GB", "H100-SXM": "H100-80GB", "H100-SXM5": "H100-80GB", "H100-SXM5-80GB": "H100-80GB",
    "H100-80G": "H100-80GB", "H100-SXM-80GB": "H100-80GB", "H200-141GB": "H200", "H200-SXM": "H200",
    "A100-80G": "A100-80GB", "A100-SXM4-80GB": "A100-80GB", "A100-40G": "A100-40GB", "A100-SXM4-40GB": "A100-40GB",
    "B200-SXM": "B200", "B200-1000W": "B200", "GH200-96GB": "GH200", "H800-80GB": "H800", "H800-SXM5": "H800",
    "A800-SXM4-80GB": "A800-80GB", "A800-80G": "A800-80GB",
}
# ... and the names that fit two parts whose memory differs: refused with both
AMBIGUOUS_DEVICES = {"A100": ["A100-40GB", "A100-80GB"], "A100-SXM4": ["A100-40GB", "A100-80GB"]}
_FIELDS = {f.name for f in fields(DeviceSpec)}
_CLUSTER_TEXT = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*x\s*(.+?)\s*$", re.I)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` machines of ``gpus_per_node`` identical devices."""

    nodes: int
    gpus_per_node: int
    device: DeviceSpec

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.device.name}"

    def ranks_a_node(self, group_size: int, stride: int = 1) -> int:
        """How many of a group's ``group_size`` ranks, spaced ``stride`` apart, share one node."""
        return min(group_size, max(1, self.gpus_per_node // max(stride, 1)))

    def link_bytes_per_s(self, group_size: int, stride: int = 1) -> float:
        """Per-GPU bandwidth of a ring over ``group_size`` ranks spaced ``stride`` apart: NVLink while
        the group fits in one node. Across nodes, NCCL runs one ring channel per NIC: with ``k`` of the
        group's ranks in each node (each with its own NIC), every channel carries 1/k of the data and
        crosses each node boundary once, so a rank's collective moves at k NICs' bandwidth (the node's
        aggregate when the whole node is in the group; one NIC for a strided group), NVLink at most."""
        inside = group_size * stride <= self.gpus_per_node or group_size == 1
        if inside:
            return self.device.nvlink_bytes_per_s
        network = self.device.network_bytes_per_s * self.ranks_a_node(group_size, stride)
        return min(network, self.device.nvlink_bytes_per_s) if self.device.nvlink_bytes_per_s else network


def device_spec(value: Union[str, Mapping[str, Any], DeviceSpec]) -> DeviceSpec:
    """A device by table name, or a user's own from a dict (the ``DeviceSpec`` fields; ``base`` names
    a table entry to start from)."""
    if isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str):
        if value in DEVICES:
            return DEVICES[value]
        key = re.sub(r"[\s_]+", "-", value.strip()).upper().removeprefix("NVIDIA-")
        named = {name.upper(): name for name in DEVICES} | DEVICE_ALIASES
        if key in named:
            return DEVICES[named[key]]
        if key in AMBIGUOUS_DEVICES:
            raise InputError(f"device {value!r} is ambiguous: name one of {AMBIGUOUS_DEVICES[key]} (their memory "
                             "differs)")
        close = nearest_name(value, DEVICES)
        hint = f" Did you mean {close!r}?" if close else ""
        raise InputError(f"unknown device {value!r}.{hint} Known devices: {sorted(DEVICES)}; or give a dict "
                         f"with the fields {sorted(_FIELDS)}")
    if isinstance(value, Mapping):
        data = dict(value)
        base = data.pop("base", None)
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise InputError(f"device: unknown key(s) {unknown}; valid keys: {sorted(_FIELDS | {'base'})}")
        if base is not None:
            return _checked_device(replace(device_spec(base), **data))
        missing = sorted({"name", "memory_bytes", "bf16_flops"} - set(data))
        if missing:
            raise InputError(f"device: missing key(s) {missing} (or give 'base', a known device: {sorted(DEVICES)})")
        return _checked_device(DeviceSpec(**data))
    raise InputError(f"device {value!r} is not valid: give a name among {sorted(DEVICES)} or a dict of "
                     f"{sorted(_FIELDS)}")


# a user's device: the fields that must be positive numbers, and those that may be 0 (none)
_POSITIVE_FIELDS = ("memory_bytes", "bf16_flops")
_NON_NEGATIVE_FIELDS = ("fp8_flops", "hbm_bytes_per_s", "nvlink_bytes_per_s", "network_bytes_per_s")


def fitted_families() -> list[str]:
    """The device families with a fitted efficiency: the table's (each has its ``<family> efficiency`` in
    ``calibration.py``)."""
    return sorted({device.family for device in DEVICES.values()})


def _checked_device(device: DeviceSpec) -> DeviceSpec:
    """A user's device refused at once where a prediction would fail on it later: a number that is not
    one (or not positive), an ``efficiency`` outside (0, 1], or a ``family`` with no fitted efficiency and
    no ``efficiency`` of its own (a V100 or an MI300X: no published run here fits theirs)."""
    for key in _POSITIVE_FIELDS + _NON_NEGATIVE_FIELDS:
        number = getattr(device, key)
        if (not isinstance(number, (int, float)) or isinstance(number, bool) or number < 0
                or (number == 0 and key in _POSITIVE_FIELDS)):
            least = "positive" if key in _POSITIVE_FIELDS else "0 or more"
            raise InputError(f"device {device.name!r}: {key}={number!r} is not valid: give a number, {least}")
    if device.efficiency is not None:
        if not isinstance(device.efficiency, (int, float)) or not 0 < device.efficiency <= 1:
            raise InputError(f"device {device.name!r}: efficiency={device.efficiency!r} is not valid: give the "
                             "share of bf16_flops large dense matmuls reach, in (0, 1]")
        return device
    families = fitted_families()
    if device.family not in families:
        raise InputError(f"device {device.name!r}: family {device.family!r} has no fitted efficiency (valid "
                         f"families: {families}); name the family whose chip it is, or give 'efficiency', the "
                         "share of bf16_flops its large dense matmuls reach (e.g. 0.5)")
    return device


def cluster_spec(value: Union[str, Mapping[str, Any], ClusterSpec]) -> ClusterSpec:
    """A cluster from ``"8xH100-96GB"`` (one node), ``"4x8xA100-80GB"`` (nodes x GPUs per node x
    device), a dict ``{"nodes", "gpus_per_node", "device"}`` (device: a name or a dict), or the path of
    a JSON file holding that dict."""
    if isinstance(value, ClusterSpec):
        return value
    if isinstance(value, str) and value.endswith(".json"):
        try:
            value = json.loads(Path(value).read_text())
        except (OSError, ValueError) as error:
            raise InputError(f"cluster file {value!r} cannot be read: {error}") from error
    if isinstance(value, str):
        match = _CLUSTER_TEXT.match(value)
        if not match:
            raise InputError(f"cluster {value!r} is not valid: write GPUSxDEVICE or NODESxGPUSxDEVICE, e.g. "
                             f"'8xH100-96GB' or '4x8xA100-80GB'; devices: {sorted(DEVICES)}")
        nodes, gpus, device = match.groups()
        return _checked(int(nodes or 1), int(gpus), device_spec(device))
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"nodes", "gpus_per_node", "device"})
        if unknown:
            raise InputError(f"cluster: unknown key(s) {unknown}; valid keys: ['device', 'gpus_per_node', 'nodes']")
        if "device" not in value or "gpus_per_node" not in value:
            raise InputError("cluster: 'device' and 'gpus_per_node' are required ('nodes' defaults to 1)")
        return _checked(value.get("nodes", 1), value["gpus_per_node"], device_spec(value["device"]))
    raise InputError(f"cluster {value!r} is not valid: give e.g. '8xH100-96GB', '4x8xA100-80GB' or a dict")


def _checked(nodes: Any, gpus: Any, device: DeviceSpec) -> ClusterSpec:
    for key, number in (("nodes", nodes), ("gpus_per_node", gpus)):
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise InputError(f"cluster: {key}={number!r} is not valid: give a positive int")
    return ClusterSpec(nodes, gpus, device)
