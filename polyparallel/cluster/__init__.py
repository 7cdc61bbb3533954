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

The package, by layer: :mod:`.units` (quantities, the spec error), :mod:`.devices` (device types,
links, devices, nodes, centers), :mod:`.calibration` (device types from measurements),
:mod:`.spec` (the YAML/JSON schema, presets, this machine), :mod:`.topology` (the :class:`Cluster`
and its queries).

Examples:
    >>> from polyparallel.cluster import Cluster
    >>> c = Cluster.preset("dgx-a100x2")
    >>> c.num_devices, c.level(0, 1), c.level(0, 8)
    (16, 'intra_node', 'inter_node')
"""

from polyparallel.cluster.calibration import default_calibration_path, gpu_calibrated_type
from polyparallel.cluster.devices import FRAMEWORKS, LEVELS, Center, Device, DeviceType, Link, Node
from polyparallel.cluster.topology import PRESET_NAMES, Cluster
from polyparallel.cluster.units import ClusterSpecError, format_bandwidth, format_duration, parse_quantity

__all__ = [
    "FRAMEWORKS",
    "LEVELS",
    "PRESET_NAMES",
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
