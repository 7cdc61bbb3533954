"""Cluster spec: compute centers → nodes → devices, and the links between them.

A cluster is a tree. A :class:`Center` (a site, in one city) runs one framework (``torch``
or ``mindspore``) and declares whether training data and activations may leave it. It holds
node groups of identical :class:`Node` s; a node holds identical devices of one
:class:`DeviceType` (peak FLOP/s per dtype, memory, memory bandwidth). Three link levels
connect devices:

* ``intra_node`` — NVLink / NVSwitch / HCCS / PCIe / shared memory between devices of a node;
* ``inter_node`` — the node's network ports (InfiniBand, RoCE) on the center's fabric;
* ``inter_center`` — each center's WAN uplink/downlink, optionally sharing one backbone.

Every :class:`Link` has an up (send) and a down (receive) bandwidth in bytes/s, a latency
in seconds, a number of parallel ports (a DGX A100 has 8 HDR ports) and an efficiency (the
fraction of the wire rate a collective library reaches). A point-to-point transfer from
device ``a`` to device ``b`` runs on the slowest link of the path: for two centers,
``min(up_a, down_b, backbone share)`` with latency ``lat_a + lat_b`` (or the pair's declared
latency).

Specs are YAML or JSON files validated with pydantic; a mistake is reported as a
:class:`ClusterSpecError` naming the file, the field and the fix. Quantities carry their units
as strings (``"200 Gb/s"``, ``"25 GB/s"``, ``"5 us"``, ``"80 GB"``, ``"312 TFLOP/s"``); a bare
number is in SI base units (bytes/s, seconds, bytes, FLOP/s).

Examples:
    >>> from polyparallel.cluster import Cluster
    >>> c = Cluster.preset("dgx-a100x2")
    >>> c.num_devices, c.level(0, 1), c.level(0, 8)
    (16, 'intra_node', 'inter_node')
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "FRAMEWORKS",
    "LEVELS",
    "Center",
    "Cluster",
    "ClusterSpecError",
    "Device",
    "DeviceType",
    "Link",
    "Node",
    "default_calibration_path",
    "format_bandwidth",
    "format_duration",
    "gpu_calibrated_type",
    "parse_quantity",
]

FRAMEWORKS = ("torch", "mindspore")
LEVELS = ("intra_node", "inter_node", "inter_center")
PRESET_NAMES = ("dgx-a100x<N>", "dgx-h100x<N>", "dgx-h200x<N>", "aisynergy-5", "local-cpu:<P>")


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be used: says which file, which field, and what to do."""


# --------------------------------------------------------------------------------------------
# units
# --------------------------------------------------------------------------------------------

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_UNIT_KINDS = {
    "bandwidth": "bytes/s (e.g. '200 Gb/s', '25 GB/s')",
    "time": "seconds (e.g. '5 us', '20 ms')",
    "bytes": "bytes (e.g. '80 GB', '32 GiB')",
    "flops": "FLOP/s (e.g. '312 TFLOP/s')",
}
_QTY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def _unit_factor(kind: str, unit: str) -> float | None:
    if kind == "time":  # divisors, so that "5 us" is exactly 5e-06
        div = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}.get(unit)
        return None if div is None else -div
    if kind == "flops":
        m = re.fullmatch(r"([kKMGTP]?)(?:FLOP/s|FLOPS|flop/s|OP/s|OPS)", unit)
        if unit == "":
            return 1.0
        return _PREFIX[m.group(1)] if m else None
    if kind == "bytes":
        m = re.fullmatch(r"([kKMGTP]i?)?B", unit)
        if unit == "":
            return 1.0
        return _PREFIX[m.group(1) or ""] if m else None
    if kind == "bandwidth":
        if unit == "":
            return 1.0
        m = re.fullmatch(r"([kKMGTP]i?)?(B|b)(?:/s|ps)", unit)
        if not m:
            return None
        return _PREFIX[m.group(1) or ""] * (1.0 if m.group(2) == "B" else 1.0 / 8)
    raise KeyError(kind)


def parse_quantity(value: Any, kind: str) -> float:
    """Parse ``"200 Gb/s"`` / ``"5 us"`` / ``"80 GB"`` / ``"312 TFLOP/s"`` into SI base units.

    Args:
        value: a number (already in SI base units) or a string with a unit.
        kind: ``bandwidth`` (bytes/s; ``b`` is bits, ``B`` bytes), ``time`` (s), ``bytes``,
            ``flops`` (FLOP/s).

    Raises:
        ValueError: the string has no number or an unknown unit.

    Examples:
        >>> parse_quantity("200 Gb/s", "bandwidth"), parse_quantity("5 us", "time")
        (25000000000.0, 5e-06)
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {_UNIT_KINDS[kind]}, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {_UNIT_KINDS[kind]}, got {value!r}")
    m = _QTY.match(value)
    factor = _unit_factor(kind, m.group(2)) if m else None
    if m is None or factor is None:
        raise ValueError(f"cannot read {value!r} as {_UNIT_KINDS[kind]}")
    return float(m.group(1)) / -factor if factor < 0 else float(m.group(1)) * factor


# --------------------------------------------------------------------------------------------
# runtime values
# --------------------------------------------------------------------------------------------

# Which dtype's figure prices an op when the device publishes none for the dtype asked:
# same width first (bf16 <-> fp16: both run on the same 16-bit units), then the 16-bit rate
# for fp32/tf32 (NPUs without an fp32 matrix unit cast to fp16, as MindSpore does on Ascend).
_DTYPE_FALLBACK = {
    "fp32": ("tf32", "fp16", "bf16"), "tf32": ("fp32", "fp16", "bf16"),
    "bf16": ("fp16", "fp32"), "fp16": ("bf16", "fp32"),
    "fp8": ("int8", "fp16", "bf16"), "int8": ("fp8", "fp16", "bf16", "fp32"),
}
_TORCH_TO_SHORT = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                   "int8": "int8", "uint8": "int8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
                   "float64": "fp32", "tf32": "tf32"}


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator or CPU process.

    Args:
        name: catalog name (``a100-80gb-sxm``).
        kind: ``gpu``, ``npu`` or ``cpu``.
        peak: peak FLOP/s per dtype (``fp32``, ``bf16``, ``fp16``, ``int8``...), as pairs.
        memory: capacity in bytes.
        memory_bandwidth: bytes/s.
        launch_overhead: seconds: the floor of any kernel.
        source: where the numbers come from.
        matmul_curve: measured ``(flops, seconds)`` of matmuls by size (calibrated devices).
        sharded_op_overhead: seconds a sharded-tensor (DTensor) op adds on the host over a plain
            one (calibrated CPU processes); 0 where the host runs ahead of the device.
        matmul_curves: measured ``(flops, seconds)`` curves per dtype (calibrated GPUs, ``polyparallel
            calibrate --device cuda``), as ``(dtype, curve)`` pairs; preferred over ``matmul_curve``.
        attention_curves: measured fused-attention ``(flops, forward_s, backward_s)`` per dtype.
        conv_curves: measured convolution ``(flops, forward_s, backward_s)`` rows per ``dtype/class``
            key, class ``1x1`` (pointwise) or ``kxk`` (a larger kernel) (calibrated GPUs).
        streaming_rows: measured ``(numel, forward_s, backward_s)`` rows of streaming kernels per
            ``dtype/kind`` key (``batch_norm``, ``layer_norm``, ``elementwise``; calibrated GPUs).
        host_op_seconds: measured host seconds of one eager op, forward + backward, by class
            (``linear``, ``conv``, ``batch_norm`` ...; calibrated GPUs): what a step waits for when
            its kernels are shorter than their dispatch; ``dtype/class`` keys: measured under autocast.
        optimizer_host: measured host seconds of an optimizer step as ``(optimizer/mode, fixed,
            per tensor)`` (mode ``foreach`` or ``fused``; calibrated GPUs).
        misaligned_factor: measured slowdown of a 16-bit GEMM with a dimension that is not a
            multiple of 8 against the same GEMM padded (median over the calibrated shapes; 1: none).
        memory_efficiency: measured fraction of ``memory_bandwidth`` a streaming kernel reaches
            (``None``: the compute model's modelled default).
        training_op_overhead: seconds of host work an eager training op pays per kernel forward
            and per backward kernel beyond ``launch_overhead`` (module call, autograd node and
            engine, gradient accumulation; calibrated CPU processes); 0 where the host runs ahead
            of the device.
        optimizer_tensor_overhead: measured seconds per parameter tensor of the framework's
            optimizer step, as ``(optimizer, seconds)`` pairs (calibrated CPU processes: torch
            updates tensor by tensor there); empty: priced from ``launch_overhead``.
        optimizer_element_rates: measured seconds per parameter element of that step by total
            elements, as ``(optimizer, ((elements, seconds), ...))`` pairs (calibrated CPU
            processes); empty: priced by streaming the optimizer state at the memory bandwidth.
        gemm_rates: measured skinny-GEMM seconds as ``(role, small, large, seconds)`` rows (role
            ``out`` or ``reduce``; calibrated CPU processes; see
            :func:`polyparallel.cost_models.compute.gemm_rate`); empty: the square curve alone.
        grad_accumulation: seconds per gradient element autograd adds into an existing gradient
            (every micro-batch after the first; calibrated CPU processes); 0: not priced.
        optimizer_dtensor_overhead: measured seconds per *sharded* (DTensor) parameter tensor of
            the optimizer step, as ``(optimizer, seconds)`` pairs (calibrated CPU processes, FSDP2 and
            tensor parallelism); empty: the plain per-tensor cost plus ``k`` DTensor dispatches.
    """

    name: str
    kind: str
    peak: tuple[tuple[str, float], ...]
    memory: float
    memory_bandwidth: float
    launch_overhead: float = 5e-6
    vendor: str = ""
    source: str = ""
    matmul_curve: tuple[tuple[float, float], ...] = ()
    sharded_op_overhead: float = 0.0
    matmul_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    attention_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    memory_efficiency: float | None = None
    conv_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    streaming_rows: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    host_op_seconds: tuple[tuple[str, float], ...] = ()
    optimizer_host: tuple[tuple[str, float, float], ...] = ()
    misaligned_factor: float = 1.0
    training_op_overhead: float = 0.0
    optimizer_tensor_overhead: tuple[tuple[str, float], ...] = ()
    optimizer_element_rates: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    gemm_rates: tuple[tuple[str, int, int, float], ...] = ()
    grad_accumulation: float = 0.0
    optimizer_dtensor_overhead: tuple[tuple[str, float], ...] = ()

    @cached_property
    def cache_key(self) -> tuple[str, int]:
        """``(name, hash of every figure)``, computed once: prices cached per graph stay apart for
        two types that share a name (``local-cpu:1`` and ``local-cpu:4`` are both ``cpu-process``)."""
        return (self.name, hash(self))

    def curve(self, dtype: str) -> tuple[tuple[float, float], ...]:
        """The measured matmul curve for ``dtype`` (GPU calibrations), else the dtype-less one (CPU)."""
        short = _TORCH_TO_SHORT.get(dtype, dtype)
        return dict(self.matmul_curves).get(short, self.matmul_curve)

    def attention_curve(self, dtype: str) -> tuple[tuple[float, float, float], ...]:
        """Measured fused-attention ``(flops, forward_s, backward_s)`` rows for ``dtype`` (may be empty)."""
        return dict(self.attention_curves).get(_TORCH_TO_SHORT.get(dtype, dtype), ())

    def conv_curve(self, dtype: str, pointwise: bool) -> tuple[tuple[float, float, float], ...]:
        """Measured convolution ``(flops, forward_s, backward_s)`` rows for ``dtype`` and kernel class
        (``pointwise``: a 1x1 kernel); empty when not calibrated."""
        key = f"{_TORCH_TO_SHORT.get(dtype, dtype)}/{'1x1' if pointwise else 'kxk'}"
        return dict(self.conv_curves).get(key, ())

    def host_table(self, dtype: str) -> dict[str, float]:
        """Measured host seconds of one eager op by class for a step at ``dtype``: a class measured
        under that dtype's autocast (``bf16/linear``) where present, else the plain one."""
        prefix = f"{_TORCH_TO_SHORT.get(dtype, dtype)}/"
        return {**{k: v for k, v in self.host_op_seconds if "/" not in k},
                **{k.removeprefix(prefix): v for k, v in self.host_op_seconds if k.startswith(prefix)}}

    def streaming_curve(self, dtype: str, kind: str) -> tuple[tuple[float, float, float], ...]:
        """Measured ``(numel, forward_s, backward_s)`` rows of a streaming kernel (``batch_norm``,
        ``layer_norm``, ``elementwise``) for ``dtype``; empty when not calibrated."""
        return dict(self.streaming_rows).get(f"{_TORCH_TO_SHORT.get(dtype, dtype)}/{kind}", ())

    def peak_flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s for a dtype (``fp32``/``bf16``.. or torch names), with documented fallbacks."""
        short = _TORCH_TO_SHORT.get(dtype, dtype)
        table = dict(self.peak)
        for d in (short, *_DTYPE_FALLBACK.get(short, ())):
            if d in table:
                return table[d]
        return max(table.values())

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction (bytes/s), latency (s), ports, efficiency.

    ``bandwidth`` is the usable rate of one direction over all ports: ``min(up, down) * ports
    * efficiency / oversubscription``. ``algorithms``: the collective algorithms the link's
    communication library runs over it (NCCL/HCCL: ring and tree; gloo: ring only, and its
    α–β is fitted with the ring formula).
    """

    kind: str
    up: float
    down: float
    latency: float
    ports: int = 1
    efficiency: float = 1.0
    oversubscription: float = 1.0
    source: str = ""
    algorithms: tuple[str, ...] = ("ring", "tree")

    @property
    def bandwidth(self) -> float:
        return min(self.up, self.down) * self.ports * self.efficiency / self.oversubscription

    @property
    def up_bandwidth(self) -> float:
        return self.up * self.ports * self.efficiency / self.oversubscription

    @property
    def down_bandwidth(self) -> float:
        return self.down * self.ports * self.efficiency / self.oversubscription

    def __str__(self) -> str:
        bw = f"{format_bandwidth(self.up_bandwidth)}" if self.up == self.down else \
            f"up {format_bandwidth(self.up_bandwidth)} / down {format_bandwidth(self.down_bandwidth)}"
        return f"{self.kind} {bw}, {format_duration(self.latency)}"


@dataclass(frozen=True)
class Device:
    """One device of the cluster; ``id`` is its global rank order (centers, nodes, devices)."""

    id: int
    name: str
    type: DeviceType
    center: int
    node: int
    local: int


@dataclass(frozen=True)
class Node:
    name: str
    center: int
    index: int
    device_type: DeviceType
    devices: tuple[int, ...]
    intra: Link
    nic: Link | None


@dataclass(frozen=True)
class Center:
    name: str
    index: int
    city: str
    framework: str
    data_may_leave: bool
    activations_may_leave: bool
    nodes: tuple[int, ...]
    wan: Link | None


@dataclass(frozen=True)
class Cluster:
    """A validated cluster: centers, nodes, devices and links, with queries for the cost models."""

    name: str
    centers: tuple[Center, ...]
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    device_types: Mapping[str, DeviceType] = field(hash=False, compare=False)
    backbone: Link | None = None
    pair_latency: tuple[tuple[tuple[str, str], float], ...] = ()
    source: str = ""
    calibration: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Load and validate a YAML or JSON cluster spec."""
        p = Path(path)
        if not p.is_file():
            raise ClusterSpecError(f"{p}: no such cluster spec file (presets: {', '.join(PRESET_NAMES)})")
        text = p.read_text()
        try:
            raw = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ClusterSpecError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
        return cls.from_dict(raw, source=str(p))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<dict>") -> Cluster:
        """Validate a spec given as plain data (what a YAML/JSON file holds)."""
        if not isinstance(raw, dict):
            raise ClusterSpecError(f"{source}: a cluster spec is a mapping with 'name' and 'centers', "
                                   f"got {type(raw).__name__}")
        try:
            spec = _ClusterSpec.model_validate(raw)
        except ValidationError as e:
            raise ClusterSpecError(_explain(source, e)) from None
        return _build(spec, source)

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A named preset: ``dgx-a100x<N>``, ``dgx-h100x<N>``, ``dgx-h200x<N>``, ``aisynergy-5``,
        ``local-cpu:<P>`` (``local-cpu`` alone means one process per core)."""
        m = re.fullmatch(r"dgx-(a100|h100|h200)(?:x(\d+))?", name)
        if m:
            n = int(m.group(2) or 1)
            if n < 1:
                raise ClusterSpecError(f"preset {name!r}: the node count must be >= 1")
            raw = _preset_raw(f"dgx-{m.group(1)}")
            raw["name"] = f"dgx-{m.group(1)}x{n}"
            raw["centers"][0]["nodes"][0]["count"] = n
            return cls.from_dict(raw, source=f"preset {name}")
        if name == "aisynergy-5":
            return cls.from_dict(_preset_raw("aisynergy-5"), source="preset aisynergy-5")
        m = re.fullmatch(r"local-cpu(?::(\d+))?", name)
        if m:
            procs = int(m.group(1)) if m.group(1) else (os.cpu_count() or 1)
            if procs < 1:
                raise ClusterSpecError(f"preset {name!r}: the process count must be >= 1")
            return _local_cpu(procs)
        raise ClusterSpecError(f"unknown cluster preset {name!r}; presets are {', '.join(PRESET_NAMES)} "
                               "(or give the path of a YAML/JSON spec)")

    @classmethod
    def resolve(cls, name_or_path: str | os.PathLike[str]) -> Cluster:
        """A spec file if the path exists (or looks like a file), else a preset name."""
        s = str(name_or_path)
        if Path(s).exists() or s.endswith((".yaml", ".yml", ".json")):
            return cls.load(s)
        return cls.preset(s)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device(self, i: int) -> Device:
        return self.devices[i]

    def level(self, a: int, b: int) -> str:
        """The highest link level between two devices: ``intra_node``, ``inter_node``, ``inter_center``."""
        da, db = self.devices[a], self.devices[b]
        if da.center != db.center:
            return "inter_center"
        if da.node != db.node:
            return "inter_node"
        return "intra_node"

    def link(self, a: int, b: int) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency s)`` of a transfer from device ``a`` to device ``b``.

        One device's share of its node's ports is used for inter-node traffic (rail-aligned
        NICs: port ``i`` serves local device ``i mod ports``), the center's WAN uplink and the
        peer's downlink for inter-center traffic.
        """
        if a == b:
            return math.inf, 0.0
        da, db = self.devices[a], self.devices[b]
        lvl = self.level(a, b)
        if lvl == "intra_node":
            lk = self.nodes[da.node].intra
            return lk.bandwidth, lk.latency
        if lvl == "inter_node":
            na, nb = self.nodes[da.node], self.nodes[db.node]
            bw = min(_per_device(na), _per_device(nb))
            return bw, max(_nic(na).latency, _nic(nb).latency)
        ca, cb = self.centers[da.center], self.centers[db.center]
        wa, wb = _wan(ca), _wan(cb)
        bw = min(wa.up_bandwidth, wb.down_bandwidth)
        if self.backbone is not None:
            bw = min(bw, self.backbone.bandwidth)
        return bw, self.center_latency(da.center, db.center)

    def center_latency(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        na, nb = self.centers[a].name, self.centers[b].name
        for (x, y), lat in self.pair_latency:
            if {x, y} == {na, nb}:
                return lat
        return _wan(self.centers[a]).latency + _wan(self.centers[b]).latency + (
            self.backbone.latency if self.backbone is not None else 0.0)

    def node_bandwidth(self, node: int) -> float:
        """Aggregate one-direction bandwidth of a node's network ports (bytes/s)."""
        return _nic(self.nodes[node]).bandwidth

    def center_bandwidth(self, center: int, flows: int = 1) -> float:
        """One-direction WAN bandwidth of a center, shared with ``flows`` concurrent flows on the backbone."""
        w = _wan(self.centers[center])
        bw = min(w.up_bandwidth, w.down_bandwidth)
        if self.backbone is not None:
            bw = min(bw, self.backbone.bandwidth / max(1, flows))
        return bw

    def devices_of(self, center: int | None = None, node: int | None = None) -> list[int]:
        return [d.id for d in self.devices
                if (center is None or d.center == center) and (node is None or d.node == node)]

    @cached_property
    def totals(self) -> dict[str, Any]:
        by_type: dict[str, int] = {}
        for d in self.devices:
            by_type[d.type.name] = by_type.get(d.type.name, 0) + 1
        return {
            "centers": len(self.centers),
            "nodes": len(self.nodes),
            "devices": len(self.devices),
            "devices_by_type": by_type,
            "memory_bytes": sum(d.type.memory for d in self.devices),
            "peak_flops": {dt: sum(d.type.peak_flops(dt) for d in self.devices) for dt in ("fp32", "bf16")},
            "frameworks": sorted({c.framework for c in self.centers}),
        }

    def to_dict(self) -> dict[str, Any]:
        """A plain echo of the cluster (for strategies and JSON output); units are SI."""
        def link(lk: Link | None) -> dict[str, Any] | None:
            if lk is None:
                return None
            return {"kind": lk.kind, "up_Bps": lk.up, "down_Bps": lk.down, "latency_s": lk.latency,
                    "ports": lk.ports, "efficiency": lk.efficiency, "oversubscription": lk.oversubscription}

        return {
            "name": self.name,
            "totals": self.totals,
            "centers": [{
                "name": c.name, "city": c.city, "framework": c.framework,
                "data_may_leave": c.data_may_leave, "activations_may_leave": c.activations_may_leave,
                "wan": link(c.wan),
                "nodes": [{"name": self.nodes[n].name, "device_type": self.nodes[n].device_type.name,
                           "devices": list(self.nodes[n].devices), "intra": link(self.nodes[n].intra),
                           "nic": link(self.nodes[n].nic)} for n in c.nodes],
            } for c in self.centers],
            "backbone": link(self.backbone),
            "device_types": {k: {"kind": v.kind, "peak_flops": dict(v.peak), "memory_bytes": v.memory,
                                 "memory_bandwidth_Bps": v.memory_bandwidth, "source": v.source}
                             for k, v in self.device_types.items()
                             if any(d.type.name == k for d in self.devices)},
        }


def _nic(node: Node) -> Link:
    if node.nic is None:
        raise ClusterSpecError(f"node {node.name!r} has no network ports ('nic') but talks to another node; "
                               "add a 'nic' link to its node group")
    return node.nic


def _wan(center: Center) -> Link:
    if center.wan is None:
        raise ClusterSpecError(f"center {center.name!r} has no 'wan' link but talks to another center; "
                               "add 'wan: {up: ..., down: ..., latency: ...}' to it")
    return center.wan


def _per_device(node: Node) -> float:
    nic = _nic(node)
    share = math.ceil(len(node.devices) / nic.ports) if nic.ports < len(node.devices) else 1
    return nic.bandwidth / nic.ports / share


def format_bandwidth(bps: float) -> str:
    for unit, f in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= f:
            return f"{bps / f:.4g} {unit}"
    return f"{bps:.4g} B/s"


def format_duration(s: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= f:
            return f"{s / f:.4g} {unit}"
    return f"{s * 1e9:.4g} ns"


# --------------------------------------------------------------------------------------------
# schema (pydantic) and its translation into runtime values
# --------------------------------------------------------------------------------------------

def _qty(kind: str, positive: bool = True):
    def check(v: Any) -> float:
        x = parse_quantity(v, kind)
        if positive and not x > 0:
            raise ValueError(f"must be > 0, got {v!r}: write a positive {_UNIT_KINDS[kind]}")
        if not positive and x < 0:
            raise ValueError(f"must be >= 0, got {v!r}")
        return x
    return check


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _DeviceTypeSpec(_Strict):
    kind: Literal["gpu", "npu", "cpu"] = "gpu"
    vendor: str = ""
    peak: dict[str, float | str]
    memory: float | str
    memory_bandwidth: float | str
    launch_overhead: float | str = 5e-6
    source: str = ""
    calibration: str | None = None

    @field_validator("peak")
    @classmethod
    def _peak(cls, v: dict[str, Any]) -> dict[str, float]:
        if not v:
            raise ValueError("give at least one dtype, e.g. {fp32: '19.5 TFLOP/s'}")
        out = {}
        for k, x in v.items():
            if k not in _DTYPE_FALLBACK:
                raise ValueError(f"unknown dtype {k!r}; use one of {sorted(_DTYPE_FALLBACK)}")
            out[k] = _qty("flops")(x)
        return out

    @field_validator("memory")
    @classmethod
    def _mem(cls, v: Any) -> float:
        return _qty("bytes")(v)

    @field_validator("memory_bandwidth")
    @classmethod
    def _mbw(cls, v: Any) -> float:
        return _qty("bandwidth")(v)

    @field_validator("launch_overhead")
    @classmethod
    def _lo(cls, v: Any) -> float:
        return _qty("time", positive=False)(v)


class _LinkSpec(_Strict):
    kind: str = "link"
    bandwidth: float | str | None = None
    up: float | str | None = None
    down: float | str | None = None
    latency: float | str = 0.0
    ports: int = Field(1, ge=1)
    efficiency: float = Field(1.0, gt=0, le=1)
    oversubscription: float = Field(1.0, ge=1)
    source: str = ""

    @field_validator("bandwidth", "up", "down")
    @classmethod
    def _bw(cls, v: Any) -> float | None:
        return None if v is None else _qty("bandwidth")(v)

    @field_validator("latency")
    @classmethod
    def _lat(cls, v: Any) -> float:
        return _qty("time", positive=False)(v)

    @model_validator(mode="after")
    def _dirs(self) -> _LinkSpec:
        if self.bandwidth is None and (self.up is None or self.down is None):
            raise ValueError("give 'bandwidth' (both directions) or both 'up' and 'down', e.g. "
                             "bandwidth: '200 Gb/s'")
        return self

    def link(self) -> Link:
        up = self.up if self.up is not None else self.bandwidth
        down = self.down if self.down is not None else self.bandwidth
        return Link(self.kind, float(up), float(down), float(self.latency), self.ports, self.efficiency,
                    self.oversubscription, self.source)


class _NodeGroupSpec(_Strict):
    name: str = "node"
    count: int = Field(1, ge=1)
    device: str
    devices_per_node: int = Field(ge=1)
    intra: _LinkSpec | None = None
    nic: _LinkSpec | None = None


class _ResidencySpec(_Strict):
    data_may_leave: bool = False
    activations_may_leave: bool = True


class _CenterSpec(_Strict):
    name: str
    city: str = ""
    framework: str = "torch"
    residency: _ResidencySpec = _ResidencySpec()
    nodes: list[_NodeGroupSpec] = []
    wan: _LinkSpec | None = None

    @field_validator("framework")
    @classmethod
    def _fw(cls, v: str) -> str:
        if v not in FRAMEWORKS:
            raise ValueError(f"unsupported framework {v!r}; use one of {', '.join(FRAMEWORKS)}")
        return v

    @model_validator(mode="after")
    def _has_devices(self) -> _CenterSpec:
        if not self.nodes:
            raise ValueError(f"center {self.name!r} has no devices: add a node group, e.g. "
                             "nodes: [{device: a100-80gb-sxm, devices_per_node: 8}]")
        return self


class _WanSpec(_Strict):
    backbone: _LinkSpec | None = None
    latency: dict[str, float | str] = {}

    @field_validator("latency")
    @classmethod
    def _pairs(cls, v: dict[str, Any]) -> dict[str, float]:
        out = {}
        for k, x in v.items():
            if k.count("-") < 1:
                raise ValueError(f"pair latency key {k!r} must be 'centerA-centerB'")
            out[k] = _qty("time", positive=False)(x)
        return out


class _ClusterSpec(_Strict):
    name: str
    description: str = ""
    device_types: dict[str, _DeviceTypeSpec] = {}
    centers: list[_CenterSpec] = Field(min_length=1)
    wan: _WanSpec = _WanSpec()


def _explain(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid cluster spec"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "required field is missing: add it"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field: remove it or check its spelling"
        elif e["type"] == "too_short" and loc.endswith("centers"):
            msg = "a cluster needs at least one center"
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


_CATALOG_CACHE: dict[str, DeviceType] | None = None


def _catalog() -> dict[str, DeviceType]:
    global _CATALOG_CACHE
    if _CATALOG_CACHE is None:
        raw = yaml.safe_load(resources.files("polyparallel").joinpath("presets/devices.yaml").read_text())
        _CATALOG_CACHE = {k: _device_type(k, _DeviceTypeSpec.model_validate(v), None) for k, v in raw.items()}
    return _CATALOG_CACHE


def _device_type(name: str, s: _DeviceTypeSpec, base: Path | None) -> DeviceType:
    dt = DeviceType(name=name, kind=s.kind, peak=tuple(sorted(s.peak.items())), memory=float(s.memory),
                    memory_bandwidth=float(s.memory_bandwidth), launch_overhead=float(s.launch_overhead),
                    vendor=s.vendor, source=s.source)
    if s.calibration:
        p = Path(s.calibration)
        if base is not None and not p.is_absolute():
            p = base / p
        cal = _read_calibration(p)
        dt = gpu_calibrated_type(dt, cal) if cal.get("kind") == "cuda" else _calibrated_type(name, cal, 1, base=dt)
    return dt


def _fwd_bwd_rows(table: Mapping[str, Sequence[Mapping[str, Any]]],
                  size: str = "flops") -> tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...]:
    """Measured ``{key: [{size, "forward_s", "backward_s"}, ...]}`` rows as sorted ``(key, ((size,
    forward, backward), ...))`` pairs, keys without rows left out (attention, conv, streaming kernels)."""
    return tuple(sorted((key, tuple(sorted((float(r[size]), float(r["forward_s"]), float(r["backward_s"]))
                                           for r in rows)))
                        for key, rows in table.items() if rows))


def gpu_calibrated_type(base: DeviceType, cal: Mapping[str, Any]) -> DeviceType:
    """``base`` (data-sheet figures) with a GPU calibration's measurements
    (:mod:`polyparallel.cost_models.calibrate_gpu`) laid over it.

    Kept from the data sheet: peaks (for dtypes not measured and for vector ops) and the
    bandwidth figure; the copy bandwidth measured becomes ``memory_efficiency`` = measured /
    data sheet, so a streaming kernel is priced at what this GPU reaches. Measured matmul curves
    per dtype, fused-attention rows, convolution rows per dtype and kernel class, the tiny-op floor
    and the memory capacity replace the modelled values.
    """
    curves = tuple(sorted((dt, tuple(sorted((float(r["flops"]), float(r["seconds"])) for r in rows)))
                          for dt, rows in cal["matmul"].items() if rows))
    conv: dict[str, list] = {}
    for key, rows in cal.get("conv", {}).items():  # "bf16/3x3", "bf16/1x1": one class per kernel size > 1 or = 1
        dt, _, k = key.partition("/")
        conv.setdefault(f"{dt}/{'1x1' if k == '1x1' else 'kxk'}", []).extend(rows)
    att, convs = _fwd_bwd_rows(cal.get("attention", {})), _fwd_bwd_rows(conv)
    streams = _fwd_bwd_rows(cal.get("streaming", {}), size="numel")
    host = tuple(sorted([(k, float(v)) for k, v in cal.get("training_ops", {}).items()] +
                        [(f"{dt}/{k}", float(v)) for dt in ("bf16", "fp16")
                         for k, v in cal.get(f"training_ops_{dt}", {}).items()]))
    opt_host = tuple(sorted((k, float(v["fixed"]), float(v["per_tensor"]))
                            for k, v in cal.get("optimizer_host", {}).items()))
    ratios = sorted(float(r["seconds"]) / float(r["padded_seconds"])
                    for rows in cal.get("misaligned", {}).values() for r in rows if float(r["padded_seconds"]) > 0)
    misaligned = ratios[len(ratios) // 2] if ratios else 1.0
    eff = min(1.0, float(cal["memory_bandwidth"]) / base.memory_bandwidth)
    return replace(base, misaligned_factor=max(1.0, misaligned), memory=float(cal.get("memory_bytes", base.memory)),
                   launch_overhead=float(cal["launch_overhead"]), matmul_curves=curves, attention_curves=att,
                   conv_curves=convs, streaming_rows=streams, host_op_seconds=host, optimizer_host=opt_host,
                   memory_efficiency=eff,
                   source=f"{base.source}; calibrated {cal.get('device_name', '?')} ({cal.get('host', '?')}, "
                          f"{cal.get('date', '?')}, torch {cal.get('torch', '?')})")


def _build(spec: _ClusterSpec, source: str) -> Cluster:
    base = Path(source).parent if Path(source).is_file() else None
    types = dict(_catalog())
    for k, v in spec.device_types.items():
        types[k] = _device_type(k, v, base)
    centers: list[Center] = []
    nodes: list[Node] = []
    devices: list[Device] = []
    names = [c.name for c in spec.centers]
    if len(set(names)) != len(names):
        raise ClusterSpecError(f"{source}: centers: duplicate center names {names}: give each a unique name")
    for ci, c in enumerate(spec.centers):
        node_ids: list[int] = []
        for gi, g in enumerate(c.nodes):
            if g.device not in types:
                raise ClusterSpecError(
                    f"{source}: centers.{ci}.nodes.{gi}.device: unknown device type {g.device!r}; known types "
                    f"are {', '.join(sorted(types))} (or define it under 'device_types:')")
            if g.devices_per_node > 1 and g.intra is None:
                raise ClusterSpecError(f"{source}: centers.{ci}.nodes.{gi}.intra: a node with "
                                       f"{g.devices_per_node} devices needs an 'intra' link "
                                       "(e.g. {kind: nvlink, bandwidth: '300 GB/s', latency: '3 us'})")
            if (g.count > 1 or len(c.nodes) > 1) and g.nic is None:
                raise ClusterSpecError(f"{source}: centers.{ci}.nodes.{gi}.nic: several nodes need network "
                                       "ports: add nic: {kind: infiniband, bandwidth: '200 Gb/s', ports: 8}")
            dt = types[g.device]
            intra = g.intra.link() if g.intra else Link("none", math.inf, math.inf, 0.0)
            for k in range(g.count):
                nid = len(nodes)
                nname = f"{c.name}/{g.name}{k}" if g.count > 1 else f"{c.name}/{g.name}"
                ids = tuple(range(len(devices), len(devices) + g.devices_per_node))
                for j, did in enumerate(ids):
                    devices.append(Device(did, f"{nname}/{dt.kind}{j}", dt, ci, nid, j))
                nodes.append(Node(nname, ci, nid, dt, ids, intra, g.nic.link() if g.nic else None))
                node_ids.append(nid)
        if len(spec.centers) > 1 and c.wan is None:
            raise ClusterSpecError(f"{source}: centers.{ci}.wan: a multi-center cluster needs each center's "
                                   "WAN link: add wan: {up: '10 Gb/s', down: '10 Gb/s', latency: '10 ms'}")
        centers.append(Center(c.name, ci, c.city, c.framework, c.residency.data_may_leave,
                              c.residency.activations_may_leave, tuple(node_ids),
                              c.wan.link() if c.wan else None))
    pairs = []
    for k, lat in spec.wan.latency.items():
        a, b = _split_pair(k, names)
        if a is None:
            raise ClusterSpecError(f"{source}: wan.latency.{k}: not a pair of center names from {names}")
        pairs.append(((a, b), float(lat)))
    return Cluster(name=spec.name, centers=tuple(centers), nodes=tuple(nodes), devices=tuple(devices),
                   device_types=types, backbone=spec.wan.backbone.link() if spec.wan.backbone else None,
                   pair_latency=tuple(pairs), source=source)


def _split_pair(key: str, names: Sequence[str]) -> tuple[str | None, str | None]:
    for a in names:
        if key.startswith(a + "-") and key[len(a) + 1:] in names:
            return a, key[len(a) + 1:]
    return None, None


def _preset_raw(stem: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("polyparallel").joinpath(f"presets/{stem}.yaml").read_text())


# --------------------------------------------------------------------------------------------
# this machine: local-cpu:<P>
# --------------------------------------------------------------------------------------------

def default_calibration_path() -> Path:
    """``$POLYPARALLEL_CALIBRATION``, else ``~/.cache/polyparallel/calibration.json``."""
    env = os.environ.get("POLYPARALLEL_CALIBRATION")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "polyparallel" / "calibration.json"


def _read_calibration(p: Path) -> dict[str, Any]:
    try:
        cal = json.loads(p.read_text())
    except FileNotFoundError:
        raise ClusterSpecError(f"calibration file {p} not found: run `polyparallel calibrate --out {p}`") from None
    except json.JSONDecodeError as e:
        raise ClusterSpecError(f"calibration file {p} is not valid JSON ({e}): run `polyparallel calibrate` "
                               "again") from None
    need = ("matmul", "memory_bandwidth", "launch_overhead") if cal.get("kind") == "cuda" else \
        ("cores", "matmul", "memory_bandwidth")
    for key in need:
        if key not in cal:
            raise ClusterSpecError(f"calibration file {p} lacks {key!r}: run `polyparallel calibrate` again")
    return cal


def _calibrated_type(name: str, cal: Mapping[str, Any], procs: int, base: DeviceType | None = None) -> DeviceType:
    """A CPU process's device type from a calibration; ``procs`` processes share the cores.

    Each process computes on ``threads_per_process`` intra-op threads (1: what the torch
    backend's workers run). Rates measured with ``procs`` processes at once (``per_processes``:
    matmul curve, copy bandwidth, kernel floor, training-op floor, fused-attention rows) are
    used as they are; otherwise the rates of one process alone (``per_processes["1"]``, or
    the 1-thread ``matmul`` curve of an older calibration) are scaled by the core share
    ``min(1, cores / procs)`` (processes beyond the core count time-share).
    """
    cores = int(cal["cores"])
    threads = int(cal.get("threads_per_process", 1))
    per = cal.get("per_processes", {})
    measured = per.get(str(procs))
    if measured:  # taken with `procs` processes computing at once: no scaling to guess
        curve = tuple(sorted((float(p["flops"]), float(p["seconds"])) for p in measured["matmul"]))
        mem_bw = float(measured["memory_bandwidth"])
        floor = float(measured["launch_overhead"])
        training = float(measured.get("training_op_overhead", 0.0))  # older calibrations: not measured
        att = measured.get("attention", [])
        opt = dict(measured.get("optimizer_tensor_overhead", {}))
        framework, share = measured, 1.0
    else:
        share = min(1.0, cores / procs)
        alone = per.get("1")
        if alone:
            rows, mem_bw, floor = alone["matmul"], float(alone["memory_bandwidth"]), float(alone["launch_overhead"])
            training = float(alone.get("training_op_overhead", 0.0))
            att = alone.get("attention", [])
            opt = dict(alone.get("optimizer_tensor_overhead", {}))
            framework = alone
        else:
            by_threads = {int(k): v for k, v in cal["matmul"].items()}
            rows = by_threads[1] if 1 in by_threads else by_threads[min(by_threads)]
            # an all-core copy bandwidth: one process gets its share of the cores
            mem_bw = float(cal["memory_bandwidth"]) / cores
            floor = float(cal.get("launch_overhead", 5e-6))
            training, att, opt, framework = 0.0, [], {}, {}
        att = [{**r, "forward_s": float(r["forward_s"]) / share, "backward_s": float(r["backward_s"]) / share}
               for r in att]
        curve = tuple(sorted((float(p["flops"]), float(p["seconds"]) / share) for p in rows))
        mem_bw *= share
        floor /= share
        training /= share
        opt = {o: float(v) / share for o, v in opt.items()}
    elem, gemm, acc = _framework_rates(cal, procs, framework, share)
    peak = max(f / s for f, s in curve)
    # DTensor's dispatch cost, measured with >= 2 processes: the nearest measured process count
    dts = {int(k): float(v["dtensor_overhead"]) for k, v in per.items() if "dtensor_overhead" in v}
    sharded = dts[min(dts, key=lambda k: (abs(k - procs), -k))] if dts else 0.0
    # a tensor-parallel Linear's kernels, and the optimizer per sharded tensor, where measured (nearest P)
    tps = {int(k): v for k, v in per.items() if "tp_op_overhead" in v}
    near = tps[min(tps, key=lambda k: (abs(k - procs), -k))] if tps else {}
    try:
        if near:
            sharded = float(near["tp_op_overhead"])
        opt_dt = tuple(sorted((str(o), float(v)) for o, v in near.get("optimizer_dtensor_overhead", {}).items()))
    except (TypeError, ValueError, AttributeError) as e:
        raise ClusterSpecError(f"calibration file {cal.get('path', '?')}: malformed tp_op_overhead / "
                               f"optimizer_dtensor_overhead ({type(e).__name__}: {e}); run `polyparallel calibrate` "
                               "again") from None
    if sharded < 0 or any(v < 0 for _, v in opt_dt):
        raise ClusterSpecError(f"calibration file {cal.get('path', '?')}: negative DTensor overhead "
                               f"(tp_op_overhead {sharded}, optimizer_dtensor_overhead {dict(opt_dt)}); run "
                               "`polyparallel calibrate` again")
    return DeviceType(name=name, kind="cpu", peak=(("fp32", peak),), vendor="this machine",
                      memory=float(cal.get("memory_bytes", 8 * 2**30)) / procs, memory_bandwidth=mem_bw,
                      launch_overhead=floor, sharded_op_overhead=sharded, training_op_overhead=training,
                      attention_curves=_fwd_bwd_rows({"fp32": att}),
                      optimizer_tensor_overhead=tuple(sorted((o, float(v)) for o, v in opt.items())),
                      optimizer_element_rates=elem, gemm_rates=gemm, grad_accumulation=acc,
                      optimizer_dtensor_overhead=opt_dt,
                      source=f"calibration {cal.get('path', '')} ({cal.get('host', '?')}, {cal.get('date', '?')}, "
                             f"{threads} thread(s)/process, {procs} processes on {cores} cores)",
                      matmul_curve=curve)


def _framework_rates(cal: Mapping[str, Any], procs: int, k: Mapping[str, Any], share: float) -> tuple[
        tuple[tuple[str, tuple[tuple[float, float], ...]], ...], tuple[tuple[str, int, int, float], ...], float]:
    """The optimizer-per-element, skinny-GEMM and gradient-accumulation rates of one ``per_processes``
    entry ``k`` (times scaled by ``1 / share`` when measured with fewer processes), checked: a bad
    entry is a :class:`ClusterSpecError` naming the file, the key and the fix."""
    where = f"calibration file {cal.get('path', '?')}, per_processes[{procs}]"
    fix = "run `polyparallel calibrate` again"
    try:
        elem = tuple(sorted((str(o), tuple(sorted((float(e), float(r) / share) for e, r in rows)))
                            for o, rows in k.get("optimizer_element", {}).items()))
        gemm = tuple(sorted((str(r["role"]), int(r["small"]), int(r["large"]), float(r["seconds"]) / share)
                            for r in k.get("gemm", [])))
        acc = float(k.get("grad_accumulation", 0.0)) / share
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ClusterSpecError(f"{where}: malformed optimizer_element / gemm / grad_accumulation entry "
                               f"({type(e).__name__}: {e}); {fix}") from None
    for o, rows in elem:
        if not rows or any(e <= 0 or r < 0 for e, r in rows):
            raise ClusterSpecError(f"{where}.optimizer_element[{o!r}]: needs [elements > 0, seconds >= 0] rows, "
                                   f"got {list(rows)}; {fix}")
    for role, small, large, sec in gemm:
        if role not in ("out", "reduce") or small < 1 or large < 1 or sec <= 0:
            raise ClusterSpecError(f"{where}.gemm: row (role {role!r}, small {small}, large {large}, seconds {sec}) "
                                   f"needs role 'out' or 'reduce', sizes >= 1 and seconds > 0; {fix}")
    if acc < 0:
        raise ClusterSpecError(f"{where}.grad_accumulation: {acc} s per element is negative; {fix}")
    return elem, gemm, acc


def _local_cpu(procs: int) -> Cluster:
    path = default_calibration_path()
    cores = os.cpu_count() or 1
    if path.is_file():
        cal = _read_calibration(path)
        cal = {**cal, "path": str(path)}
        dt = _calibrated_type("cpu-process", cal, procs)
        coll = cal.get("collectives", {})
        by_p = {int(k): v for k, v in coll.get("fit_by_group_size", {}).items()}
        # the fit measured with P processes alive, else the nearest group size, else the pooled fit
        near = min(by_p, key=lambda k: (abs(k - procs), -k)) if by_p else None
        ar = by_p[near] if near is not None else coll.get("fit", {})
        lat, bw = float(ar.get("alpha", 50e-6)), float(ar.get("bandwidth", 1e9))
        src = f"gloo fit ({near or 'pooled'} processes) from {path}"
    else:
        # Nominal figures until `polyparallel calibrate` has measured this machine, for one thread
        # per process (as the torch backend runs them): an AVX2 core retires 2 FMA x 8 fp32
        # lanes = 32 FLOP/cycle at ~2.5 GHz; ~10 GB/s of DRAM per core;
        # gloo over loopback TCP ~50 us and ~1 GB/s. Prices from these are indicative only.
        cal = None
        share = min(1.0, cores / procs)
        dt = DeviceType(name="cpu-process", kind="cpu", peak=(("fp32", 80e9 * share),), vendor="nominal",
                        memory=8 * 2**30 / procs, memory_bandwidth=10e9 * share,
                        launch_overhead=5e-6 / share,
                        source=f"nominal (no calibration at {path}: run `polyparallel calibrate`)")
        lat, bw, src = 50e-6, 1e9, "nominal gloo loopback (uncalibrated)"
    shm = Link("gloo-loopback", bw, bw, lat, source=src, algorithms=("ring",))
    node = Node("local/host", 0, 0, dt, tuple(range(procs)), shm, None)
    center = Center("local", 0, "", "torch", True, True, (0,), None)
    devs = tuple(Device(i, f"local/host/cpu{i}", dt, 0, 0, i) for i in range(procs))
    return Cluster(name=f"local-cpu:{procs}", centers=(center,), nodes=(node,), devices=devs,
                   device_types={**_catalog(), dt.name: dt}, source=f"preset local-cpu:{procs}", calibration=cal)
