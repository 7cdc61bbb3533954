"""Cluster specs as written (YAML/JSON, validated with pydantic), the presets, and their translation
into the fields of a :class:`~polyparallel.cluster.Cluster`: every mistake is a ``ClusterSpecError``
naming the file, the field and the fix."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyparallel.cluster.calibration import (
    calibrated_cpu_type,
    default_calibration_path,
    gpu_calibrated_type,
    read_calibration,
)
from polyparallel.cluster.devices import DTYPE_FALLBACK, FRAMEWORKS, Center, Device, DeviceType, Link, Node
from polyparallel.cluster.units import UNIT_KINDS, ClusterSpecError, parse_quantity

# a bare number is read in SI base units; outside these ranges it is surely a number whose unit
# was left out (``bandwidth: 450`` meaning 450 GB/s, not 450 B/s)
_BARE_RANGE = {"bandwidth": (1e5, 1e15, "450 GB/s"), "bytes": (1e6, 1e16, "80 GB"),
               "flops": (1e6, 1e19, "312 TFLOP/s"), "time": (0.0, 60.0, "5 us")}


def _qty(kind: str, positive: bool = True):
    def check(v: Any) -> float:
        x = parse_quantity(v, kind)
        lo, hi, example = _BARE_RANGE[kind]
        if isinstance(v, int | float) and not isinstance(v, bool) and x and not lo <= x <= hi:
            raise ValueError(f"{v!r} has no unit, so it reads as {v} {_SI[kind]}, which no cluster has; write the "
                             f"unit, e.g. '{example}'")
        if positive and not x > 0:
            raise ValueError(f"must be > 0, got {v!r}: write a positive {UNIT_KINDS[kind]}")
        if not positive and x < 0:
            raise ValueError(f"must be >= 0, got {v!r}")
        return x
    return check


_SI = {"bandwidth": "B/s", "bytes": "B", "flops": "FLOP/s", "time": "s"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _doc(description: str, example: Any, default: Any = ..., **kw: Any) -> Any:
    """A field with its meaning and one example value: the reference page (docs/cluster-spec.md,
    ``docs/cluster_spec.py``) is generated from them."""
    return Field(default, description=description, examples=[example], **kw)


class _DeviceTypeSpec(_Strict):
    """A device type of one's own, beside the catalog's (``presets/devices.yaml``)."""

    kind: Literal["gpu", "npu", "cpu"] = _doc("what the device is", "gpu", "gpu")
    vendor: str = _doc("who makes it (shown by `cluster show`)", "nvidia", "")
    peak: dict[str, float | str] = _doc("dense peak throughput per dtype (fp32, tf32, bf16, fp16, fp8); a dtype "
                                        "not given falls back to a listed one",
                                        {"bf16": "989 TFLOP/s", "fp32": "67 TFLOP/s"})
    memory: float | str = _doc("device memory", "80 GB")
    memory_bandwidth: float | str = _doc("device memory bandwidth", "3.35 TB/s")
    launch_overhead: float | str = _doc("the smallest time a kernel takes (launch and sync floor)", "5 us", 5e-6)
    sms: int | None = _doc("streaming multiprocessors (GPUs: how many blocks run at once)", 132, None, ge=1)
    source: str = _doc("where the figures come from (a datasheet, a measurement)", "H100 SXM datasheet", "")
    calibration: str | None = _doc("a `polyparallel calibrate --device cuda` file (relative to the spec) whose "
                                   "measured rates replace the nominal ones", "h100-calibration.json", None)

    @field_validator("peak")
    @classmethod
    def _peak(cls, v: dict[str, Any]) -> dict[str, float]:
        if not v:
            raise ValueError("give at least one dtype, e.g. {fp32: '19.5 TFLOP/s'}")
        out = {}
        for k, x in v.items():
            if k not in DTYPE_FALLBACK:
                raise ValueError(f"unknown dtype {k!r}; use one of {sorted(DTYPE_FALLBACK)}")
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
    """A link: inside a node (``intra``), a node's network ports (``nic``), a center's WAN uplink
    (``wan``) or the WAN backbone. Give ``bandwidth`` (both directions) or ``up`` and ``down``."""

    kind: str = _doc("what the link is (shown, and how collectives are priced on it: nvlink, infiniband, "
                     "ethernet, ...)", "nvlink", "link")
    bandwidth: float | str | None = _doc("per-direction bandwidth, both directions", "450 GB/s", None)
    up: float | str | None = _doc("bandwidth out of the node or center (with 'down', instead of 'bandwidth')",
                                  "10 Gb/s", None)
    down: float | str | None = _doc("bandwidth into the node or center", "10 Gb/s", None)
    latency: float | str = _doc("one-way latency of a message", "3 us", 0.0)
    ports: int = _doc("ports per node (a nic's rails): the bandwidth is per port", 8, 1, ge=1)
    efficiency: float = _doc("the fraction of the bandwidth transfers reach", 0.8, 1.0, gt=0, le=1)
    oversubscription: float = _doc("how many senders share the fabric's bandwidth (>= 1)", 2.0, 1.0, ge=1)
    source: str = _doc("where the figures come from", "measured with nccl-tests", "")

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
        assert up is not None and down is not None  # _dirs: bandwidth, or both up and down
        return Link(self.kind, float(up), float(down), float(self.latency), self.ports, self.efficiency,
                    self.oversubscription, self.source)


class _NodeGroupSpec(_Strict):
    """``count`` identical nodes of a center."""

    name: str = _doc("the nodes' name (numbered when count > 1)", "dgx", "node")
    count: int = _doc("how many such nodes", 4, 1, ge=1)
    device: str = _doc("a device type: the catalog's (`polyparallel cluster list` shows them) or one under "
                       "device_types", "a100-80gb-sxm")
    devices_per_node: int = _doc("devices in each node", 8, ge=1)
    intra: _LinkSpec | None = _doc("the link between the devices of a node; needed with devices_per_node > 1",
                                   {"kind": "nvlink", "bandwidth": "300 GB/s", "latency": "3 us"}, None)
    nic: _LinkSpec | None = _doc("each node's network ports; needed with several nodes",
                                 {"kind": "infiniband", "bandwidth": "200 Gb/s", "ports": 8}, None)


class _ResidencySpec(_Strict):
    """What may leave a center: the collaborative search keeps data (and, if set, activations) home."""

    data_may_leave: bool = _doc("whether training data may be sent to other centers", False, False)
    activations_may_leave: bool = _doc("whether activations may cross to other centers (pipeline stages "
                                       "spanning centers)", True, True)


class _CenterSpec(_Strict):
    """A compute center: its nodes, its framework, its WAN uplink, what may leave it."""

    name: str = _doc("a unique name", "beijing")
    city: str = _doc("where it is (shown)", "Beijing", "")
    framework: str = _doc("the training framework its centers run (torch, mindspore, paddle, tensorflow)",
                          "torch", "torch")
    residency: _ResidencySpec = _doc("what may leave the center", {"data_may_leave": False}, _ResidencySpec())
    nodes: list[_NodeGroupSpec] = _doc("its node groups (at least one)",
                                       [{"device": "a100-80gb-sxm", "devices_per_node": 8,
                                         "intra": {"kind": "nvlink", "bandwidth": "300 GB/s"}}], [])
    wan: _LinkSpec | None = _doc("its uplink to the other centers; needed with several centers",
                                 {"up": "10 Gb/s", "down": "10 Gb/s", "latency": "10 ms"}, None)

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
    """Between centers: a shared backbone and latencies per pair of centers."""

    backbone: _LinkSpec | None = _doc("a link every inter-center transfer also crosses",
                                      {"bandwidth": "100 Gb/s", "latency": "5 ms"}, None)
    latency: dict[str, float | str] = _doc("one-way latency between two centers, keyed 'centerA-centerB' "
                                           "(instead of adding their uplinks' latencies)",
                                           {"beijing-wuhan": "12 ms"}, {})

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
    """A cluster: one or more centers of nodes of devices, and the links between them."""

    name: str = _doc("the cluster's name (in strategies and reports)", "two-centers")
    description: str = _doc("free text", "two A100 centers 1000 km apart", "")
    device_types: dict[str, _DeviceTypeSpec] = _doc("device types of one's own, by name",
                                                    {"my-gpu": {"peak": {"bf16": "400 TFLOP/s"}, "memory": "48 GB",
                                                                "memory_bandwidth": "1 TB/s"}}, {})
    centers: list[_CenterSpec] = _doc("the centers (at least one)", [{"name": "a", "nodes": [
        {"device": "h100-sxm", "devices_per_node": 1}]}], min_length=1)
    wan: _WanSpec = _doc("what lies between the centers", {"latency": {"a-b": "20 ms"}}, _WanSpec())


def _explain(source: str, err: ValidationError) -> str:
    """The first bad field on the first line (``SOURCE: invalid cluster spec: FIELD: what to do``),
    any others on indented lines after it."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "required field is missing: add it"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field: remove it or check its spelling"
        elif e["type"] == "too_short" and loc.endswith("centers"):
            msg = "a cluster needs at least one center"
        lines.append(f"{loc or '(top level)'}: {msg}")
    return "\n  ".join([f"{source}: invalid cluster spec: {lines[0]}", *lines[1:]])


_CATALOG_CACHE: dict[str, DeviceType] | None = None


def catalog() -> dict[str, DeviceType]:
    global _CATALOG_CACHE
    if _CATALOG_CACHE is None:
        raw = yaml.safe_load(resources.files("polyparallel").joinpath("presets/devices.yaml").read_text())
        _CATALOG_CACHE = {k: _device_type(k, _DeviceTypeSpec.model_validate(v), None) for k, v in raw.items()}
    return _CATALOG_CACHE


def _device_type(name: str, s: _DeviceTypeSpec, base: Path | None) -> DeviceType:
    peak = tuple(sorted((k, float(v)) for k, v in s.peak.items()))
    dt = DeviceType(name=name, kind=s.kind, peak=peak, memory=float(s.memory),
                    memory_bandwidth=float(s.memory_bandwidth), launch_overhead=float(s.launch_overhead),
                    vendor=s.vendor, source=s.source, sms=s.sms or 0)
    if s.calibration:
        p = Path(s.calibration)
        if base is not None and not p.is_absolute():
            p = base / p
        cal = read_calibration(p)
        dt = gpu_calibrated_type(dt, cal) if cal.get("kind") == "cuda" else calibrated_cpu_type(name, cal, 1, base=dt)
    return dt


def build_fields(spec: _ClusterSpec, source: str) -> dict[str, Any]:
    """The fields of the Cluster a validated spec describes."""
    base = Path(source).parent if Path(source).is_file() else None
    types = dict(catalog())
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
            for i in range(g.count):
                nid = len(nodes)
                nname = f"{c.name}/{g.name}{i}" if g.count > 1 else f"{c.name}/{g.name}"
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
    return dict(name=spec.name, centers=tuple(centers), nodes=tuple(nodes), devices=tuple(devices),
                device_types=types, backbone=spec.wan.backbone.link() if spec.wan.backbone else None,
                pair_latency=tuple(pairs), source=source)


def _split_pair(key: str, names: Sequence[str]) -> tuple[str | None, str | None]:
    for a in names:
        if key.startswith(a + "-") and key[len(a) + 1:] in names:
            return a, key[len(a) + 1:]
    return None, None


def preset_raw(stem: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("polyparallel").joinpath(f"presets/{stem}.yaml").read_text())


def local_cpu_fields(procs: int) -> dict[str, Any]:
    """The fields of the ``local-cpu:<procs>`` Cluster: this machine's processes, at the rates
    ``polyparallel calibrate`` measured (nominal figures before that)."""
    path = default_calibration_path()
    cores = os.cpu_count() or 1
    if path.is_file():
        cal = read_calibration(path)
        cal = {**cal, "path": str(path)}
        dt = calibrated_cpu_type("cpu-process", cal, procs)
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
    return dict(name=f"local-cpu:{procs}", centers=(center,), nodes=(node,), devices=devs,
                device_types={**catalog(), dt.name: dt}, source=f"preset local-cpu:{procs}", calibration=cal)


def fields_from_dict(raw: Any, source: str) -> dict[str, Any]:
    """Validate a spec given as plain data (what a YAML/JSON file holds); the Cluster's fields."""
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"{source}: a cluster spec is a mapping with 'name' and 'centers', "
                               f"got {type(raw).__name__}")
    try:
        spec = _ClusterSpec.model_validate(raw)
    except ValidationError as e:
        raise ClusterSpecError(_explain(source, e)) from None
    return build_fields(spec, source)
