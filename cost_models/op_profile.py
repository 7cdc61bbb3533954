"""Measured op prices of the user's model on this machine: what a profiled CPU search prices with.

A calibration measures kernels one by one, each on operands that stay in cache, and a CPU
training step does not run at those rates: its ops read what the previous op wrote, its
weights and optimizer state stream from memory, and a second process on the other core slows
both (the executor benchmark priced a small GPT's eager step 35-50% too fast from such rates).
Profiling-based planners (Alpa, Galvatron, nnScaler) measure the model's own layers instead;
a search on ``local-cpu:<P>`` with ``profile=True`` does that
(:mod:`polyparallel.backends.torch.op_timing` measures,
:func:`polyparallel.cost_models.profile_fit.build_profile` fits).

Every op of the priced graph gets a curve per direction: its measured seconds against its roofline
price ``r`` (:func:`polyparallel.cost_models.compute.op_cost`, eager) at each measured micro-batch
size (1, 2, 4, 8 by default). Between two measured points an op costs ``t = a + c·r`` on the line
through them (:func:`on_curve`): ``a`` what the op costs whatever its size (dispatch, autograd),
``c`` how much slower than the roofline its work runs in a real step (a step whose working set
leaves the cache gets slower per sample, so one line through two small batches would price a
large one too fast). A tensor- or sequence-parallel shard, or another micro-batch, is priced from
its own roofline on the same curve (:func:`profiled_op`), a sharded op with DTensor's measured
dispatch on top. The nodes a priced op absorbed (views, elementwise ops fused into their producer)
are charged to it; the step's time outside any node (autograd's gradient accumulation, the
loss's backward call) is spread over the ops in proportion, so the profiled step adds up to the
measured one. Curves, the optimizer's measured-over-priced ratio and what the parallel wrappers
add are scaled per world size ``W`` by the measured slowdown of ``W`` processes sharing the machine.

The profile belongs to one model (:func:`fingerprint` of the priced graph) and one machine; the
device type carries it (``DeviceType.op_profile``), so a graph it was not measured on is priced
from the calibration alone.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from polyparallel.ir import Graph, TensorKind

from .compute import op_cost
from .memo import PRICES

__all__ = ["OpProfile", "fingerprint", "on_curve", "profile_for", "profiled_op", "with_profile"]


_Points = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class OpProfile:
    """Fitted op prices of one model on one machine, by world size.

    Attributes:
        fingerprint: of the graph the ops were measured on (:func:`fingerprint`).
        curves: ``(world, ((op name, forward points, backward points), ...))``, each point
            ``(roofline seconds, measured seconds)`` at one measured micro-batch, by roofline.
        optimizer: ``(world, ((optimizer, measured / priced), ...))`` of the whole step.
        batches: the micro-batch sizes measured.
        source: how and when it was measured.
        wrappers: ``(world, ((key, forward, backward, optimizer), ...))``: seconds a parallel wrapper
            adds whatever it communicates (keys of ``backends/torch/op_timing.measure_wrappers``).
    """

    fingerprint: str
    curves: tuple[tuple[int, tuple[tuple[str, _Points, _Points], ...]], ...]
    optimizer: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    batches: tuple[int, ...]
    source: str = ""
    wrappers: tuple[tuple[int, tuple[tuple[str, float, float, float], ...]], ...] = ()

    def matches(self, graph: Graph) -> bool:
        """Whether ``graph`` is (a re-batching of) the graph this profile measured."""
        return _fingerprint_of(graph) == self.fingerprint

    def _world(self, world: int) -> int:
        have = [w for w, _ in self.curves]
        return min(have, key=lambda w: (abs(w - world), -w))

    @cached_property
    def _tables(self) -> dict[str, dict[int, dict[str, tuple[float, ...]]]]:
        """The tuples as lookups: ``{"curves"|"wrappers": {world: {name: values}}}``, built once."""
        return {"curves": {w: {n: tuple(v) for n, *v in rows} for w, rows in self.curves},
                "wrappers": {w: {k: tuple(v) for k, *v in rows} for w, rows in self.wrappers}}

    def curve(self, world: int, op: str) -> tuple[tuple[tuple[float, float], ...], ...] | None:
        """``(forward points, backward points)`` of ``op`` at the measured world size nearest ``world``."""
        return self._tables["curves"].get(self._world(world), {}).get(op)

    def wrapper(self, world: int, key: str) -> tuple[float, ...] | None:
        """``(forward, backward, optimizer)`` seconds the wrapper ``key`` adds, at the measured world
        size nearest ``world``."""
        return self._tables["wrappers"].get(self._world(world), {}).get(key)

    def optimizer_ratio(self, world: int, optimizer: str) -> float | None:
        """Measured over priced seconds of the model's ``optimizer`` step at the world size nearest ``world``."""
        return dict(dict(self.optimizer).get(self._world(world), ())).get(optimizer)


def fingerprint(graph: Graph) -> str:
    """What identifies a model's graph whatever its batch: op names and targets, parameter shapes."""
    h = hashlib.sha1()
    for op in graph.ops:
        h.update(f"{op.name}|{op.target}|{op.source_node};".encode())
    for name, spec in graph.tensors.items():
        if spec.kind is TensorKind.PARAM:
            h.update(f"{name}{tuple(spec.shape)};".encode())
    return h.hexdigest()[:16]


def on_curve(points: Sequence[tuple[float, float]], r: float) -> float:
    """Measured seconds at roofline seconds ``r``: on the line through the two measured points around
    ``r`` (the nearest two at either end). Below the first point the line is not followed under
    proportional scaling of that point; where the points are not a rising line (noise, or an op
    whose roofline does not grow with the batch) the pooled ratio scales ``r``."""
    if not points:
        return 0.0
    if len(points) == 1:
        r0, t0 = points[0]
        return t0 * r / r0 if r0 > 0 else t0
    i = min(max(bisect_left([p[0] for p in points], r), 1), len(points) - 1)
    (r1, t1), (r2, t2) = points[i - 1], points[i]
    if r2 <= r1 * 1.01 or t2 < t1:
        return (t1 + t2) / (r1 + r2) * r if r1 + r2 > 0 else (t1 + t2) / 2
    t = t1 + (t2 - t1) / (r2 - r1) * (r - r1)
    return max(t, t1 * r / r1) if r < r1 and r1 > 0 else t


def with_profile(cluster: Any, prof: OpProfile, link: tuple[float, float] | None = None) -> Any:
    """``cluster`` with its (first) device type carrying ``prof``, its source saying so; with ``link``
    ``(α seconds, bytes/s)``, its nodes' links carry collectives at that measured α and bandwidth."""
    dt = cluster.device(0).type
    new = replace(dt, op_profile=prof, source=f"{dt.source}; {prof.source}")

    def intra(lk: Any) -> Any:
        if link is None:
            return lk
        return replace(lk, latency=link[0], up=link[1], down=link[1],
                       source=f"gloo all-reduce between training passes, measured by the profile: alpha "
                              f"{1e6 * link[0]:.0f} us, {link[1] / 1e9:.2f} GB/s")

    nodes = tuple(replace(n, device_type=new, intra=intra(n.intra)) if n.device_type is dt else n
                  for n in cluster.nodes)
    return replace(cluster, nodes=nodes,
                   devices=tuple(replace(d, type=new) if d.type is dt else d for d in cluster.devices),
                   device_types={**cluster.device_types, dt.name: new})


def profile_for(device: Any, graph: Graph, dtype: str) -> OpProfile | None:
    """The device's profile if it was measured on ``graph`` (or a re-batching of it) and prices a
    ``dtype`` plan, else ``None``: it measured fp32 training, so a bf16/fp16 plan (autocast's casts,
    other kernels, fp32 master weights) is priced from the calibration alone, all its parts alike."""
    prof: OpProfile | None = device.op_profile
    return prof if prof is not None and dtype == "fp32" and prof.matches(graph) else None


def profiled_op(graph: Graph, op: Any, device: Any, world: int, split: float, sharded: bool,
                dtype: str) -> tuple[float, float] | None:
    """Forward and backward seconds of ``op`` from the device's profile, ``None`` where it has none
    for this graph (another model) or this op."""
    prof = profile_for(device, graph, dtype)
    if prof is None:
        return None
    curve = prof.curve(world, op.name)
    if curve is None:
        return None
    r = op_cost(graph, op, device, dtype, split=split, eager=True)
    fwd, bwd = on_curve(curve[0], r.forward), on_curve(curve[1], r.backward)
    if sharded:  # a DTensor's dispatch is the host's, not the kernel's: added as measured
        tp = prof.wrapper(world, "tp/op")
        if tp is not None:
            fwd, bwd = fwd + tp[0], bwd + tp[1]
        else:
            s = op_cost(graph, op, device, dtype, split=split, eager=True, sharded=True)
            fwd, bwd = fwd + s.forward - r.forward, bwd + s.backward - r.backward
    return fwd, bwd


def _fingerprint_of(graph: Graph) -> str:
    memo = PRICES.of(graph)
    if "fingerprint" not in memo:
        memo["fingerprint"] = fingerprint(graph)
    return memo["fingerprint"]
