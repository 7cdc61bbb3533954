"""The :class:`Cluster`: centers, nodes, devices and links, with the queries the cost models ask
(link level, bandwidth and latency between two devices, devices of a center or node)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from polyparallel.cluster.devices import Center, Device, DeviceType, Link, Node
from polyparallel.cluster.spec import fields_from_dict, local_cpu_fields, preset_raw
from polyparallel.cluster.units import ClusterSpecError

PRESET_NAMES = ("dgx-a100x<N>", "dgx-h100x<N>", "dgx-h200x<N>", "aisynergy-5", "local-cpu:<P>")


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
        return cls(**fields_from_dict(raw, source))

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A named preset: ``dgx-a100x<N>``, ``dgx-h100x<N>``, ``dgx-h200x<N>``, ``aisynergy-5``,
        ``local-cpu:<P>`` (``local-cpu`` alone means one process per core)."""
        m = re.fullmatch(r"dgx-(a100|h100|h200)(?:x(\d+))?", name)
        if m:
            n = int(m.group(2) or 1)
            if n < 1:
                raise ClusterSpecError(f"preset {name!r}: the node count must be >= 1")
            raw = preset_raw(f"dgx-{m.group(1)}")
            raw["name"] = f"dgx-{m.group(1)}x{n}"
            raw["centers"][0]["nodes"][0]["count"] = n
            return cls.from_dict(raw, source=f"preset {name}")
        if name == "aisynergy-5":
            return cls.from_dict(preset_raw("aisynergy-5"), source="preset aisynergy-5")
        m = re.fullmatch(r"local-cpu(?::(\d+))?", name)
        if m:
            procs = int(m.group(1)) if m.group(1) else (os.cpu_count() or 1)
            if procs < 1:
                raise ClusterSpecError(f"preset {name!r}: the process count must be >= 1")
            return cls(**local_cpu_fields(procs))
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
