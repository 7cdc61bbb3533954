"""Measured op prices of the user's model on this machine: what a profiled CPU search prices with.

A calibration measures kernels one by one, each on operands that stay in cache, and a CPU
training step does not run at those rates: its ops read what the previous op wrote, its
weights and optimizer state stream from memory, and a second process on the other core slows
both (the executor benchmark priced a small GPT's eager step 35-50% too fast from such rates).
Profiling-based planners (Alpa, Galvatron, nnScaler) measure the model's own layers instead;
a search on ``local-cpu:<P>`` with ``profile=True`` does that
(:mod:`polyparallel.backends.torch.op_timing` measures, :func:`build_profile` fits).

Every op of the priced graph gets a line ``t = a + c·r`` per direction through its two measured
micro-batch sizes: ``r`` is the op's roofline price (:func:`polyparallel.cost_models.compute.
op_cost`, eager), ``a`` what the op costs whatever its size (dispatch, autograd), ``c`` how much
slower than the roofline its work runs in a real step. A tensor- or sequence-parallel shard, or
another micro-batch, is priced from its own roofline through the same line (:func:`profiled_op`;
a DTensor's dispatch on top, as calibrated). The nodes a priced op absorbed (views, elementwise
ops fused into their producer) are charged to it; the step's time outside any node (autograd's
gradient accumulation, the loss's backward call) is spread over the ops in proportion, so the
profiled step adds up to the measured one. Lines, the optimizer's measured-over-priced ratio and
what FSDP2 adds are scaled per world size ``W`` by the measured slowdown of ``W`` processes
sharing the machine.

The profile belongs to one model (:func:`fingerprint` of the priced graph) and one machine; the
device type carries it (``DeviceType.op_profile``), so a graph it was not measured on is priced
from the calibration alone.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from polyparallel.ir import Graph, TensorKind

__all__ = ["OpProfile", "build_profile", "fingerprint", "profiled_op", "with_profile"]


@dataclass(frozen=True)
class OpProfile:
    """Fitted op prices of one model on one machine, by world size.

    Attributes:
        fingerprint: of the graph the ops were measured on (:func:`fingerprint`).
        lines: ``(world, ((op name, a_fwd, c_fwd, a_bwd, c_bwd), ...))``: ``t = a + c·roofline``.
        optimizer: ``(world, ((optimizer, measured / priced), ...))`` of the whole step.
        batches: the micro-batch sizes measured.
        source: how and when it was measured.
        wrappers: ``(world, ((key, forward, backward, optimizer), ...))``: seconds a parallel wrapper
            adds whatever it communicates (keys of ``backends/torch/op_timing.measure_wrappers``).
    """

    fingerprint: str
    lines: tuple[tuple[int, tuple[tuple[str, float, float, float, float], ...]], ...]
    optimizer: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    batches: tuple[int, ...]
    source: str = ""
    wrappers: tuple[tuple[int, tuple[tuple[str, float, float, float], ...]], ...] = ()

    def matches(self, graph: Graph) -> bool:
        """Whether ``graph`` is (a re-batching of) the graph this profile measured."""
        return _fingerprint_of(graph) == self.fingerprint

    def _world(self, world: int) -> int:
        have = [w for w, _ in self.lines]
        return min(have, key=lambda w: (abs(w - world), -w))

    @cached_property
    def _tables(self) -> dict[str, dict[int, dict[str, tuple[float, ...]]]]:
        """The tuples as lookups: ``{"lines"|"wrappers": {world: {name: values}}}``, built once."""
        return {"lines": {w: {n: tuple(v) for n, *v in rows} for w, rows in self.lines},
                "wrappers": {w: {k: tuple(v) for k, *v in rows} for w, rows in self.wrappers}}

    def line(self, world: int, op: str) -> tuple[float, ...] | None:
        """``(a_fwd, c_fwd, a_bwd, c_bwd)`` of ``op`` at the measured world size nearest ``world``."""
        return self._tables["lines"].get(self._world(world), {}).get(op)

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


def _attribute(rows: list[tuple[str, float, float]], graph: Graph) -> dict[str, tuple[float, float]]:
    """Node times summed per priced op: a node the graph has no op for (a view, an elementwise op
    fused into its producer) is charged to the op before it, or the first op if none is."""
    by_node = {op.source_node or op.name: op.name for op in graph.ops}
    first = next((by_node[n] for n, _, _ in rows if n in by_node), graph.ops[0].name if graph.ops else "")
    out: dict[str, list[float]] = {}
    current = first
    for node, f, b in rows:
        current = by_node.get(node, current)
        acc = out.setdefault(current, [0.0, 0.0])
        acc[0] += f
        acc[1] += b
    return {k: (v[0], v[1]) for k, v in out.items()}


def _fit(t1: float, r1: float, t2: float, r2: float) -> tuple[float, float]:
    """``(a, c)`` of ``t = a + c·r`` through two measurements; ``a, c ≥ 0``. Where the roofline does not
    grow between them (a batch-independent op) or the line would need a negative part, the ratio."""
    if r1 <= 0 and r2 <= 0:
        return (t1 + t2) / 2, 0.0
    if r2 > 1.05 * r1 > 0:
        c = (t2 - t1) / (r2 - r1)
        a = t1 - c * r1
        if c > 0 and a >= 0:
            return a, c
    return 0.0, (t1 + t2) / (r1 + r2)


def build_profile(graphs: Callable[[int], Graph], cluster: Any,
                  nodes: dict[int, tuple[list[tuple[str, float, float]], dict[str, float]]],
                  optimizer_s: dict[str, float], kappa: dict[int, float],
                  wrappers: dict[str, tuple[float, float, float]]) -> OpProfile:
    """The profile of measurements (module docstring): ``nodes[b]`` the per-node times and plain step
    of micro-batch ``b`` (two sizes), ``optimizer_s`` the optimizer step per optimizer, ``kappa`` the
    slowdown per world size, ``wrappers`` what a data-parallel wrapper adds; lines fitted to the
    roofline of ``cluster``'s device (a calibrated ``local-cpu``), ``graphs(b)`` the priced graph."""
    from polyparallel.cost_models.compute import op_cost

    device = cluster.device(0).type
    batches = sorted(nodes)
    measured: dict[int, dict[str, tuple[float, float]]] = {}
    roof: dict[int, dict[str, tuple[float, float]]] = {}
    for b in batches:
        rows, plain = nodes[b]
        g = graphs(b)
        per_op = _attribute(rows, g)
        # scaled to the plain step: what no node's interval holds (the hooks' own time, the engine's
        # start) is spread over the ops in proportion
        sf = plain["forward"] / max(sum(f for f, _ in per_op.values()), 1e-12)
        sb = plain["backward"] / max(sum(b_ for _, b_ in per_op.values()), 1e-12)
        measured[b] = {k: (f * sf, bw * sb) for k, (f, bw) in per_op.items()}
        roof[b] = {op.name: (c.forward, c.backward) for op in g.ops for c in [op_cost(g, op, device, eager=True)]}
    b1, b2 = batches[0], batches[-1]
    base = []
    for name in roof[b1]:
        t1, t2 = measured[b1].get(name, (0.0, 0.0)), measured[b2].get(name, (0.0, 0.0))
        r1, r2 = roof[b1][name], roof[b2].get(name, roof[b1][name])
        base.append((name, *_fit(t1[0], r1[0], t2[0], r2[0]), *_fit(t1[1], r1[1], t2[1], r2[1])))
    opt_priced = _priced_optimizer(graphs(b1), cluster, list(optimizer_s))
    lines, opt, wraps = [], [], []
    for w, k in sorted(kappa.items()):
        lines.append((w, tuple((n, af * k, cf * k, ab * k, cb * k) for n, af, cf, ab, cb in base)))
        opt.append((w, tuple((o, k * t / opt_priced[o]) for o, t in optimizer_s.items() if opt_priced.get(o))))
        wraps.append((w, tuple((key, *(k * x for x in v)) for key, v in sorted(wrappers.items()))))
    shared = ", ".join(f"{w} procs x{k:.2f}" for w, k in sorted(kappa.items()))
    src = (f"ops profiled on this machine ({time.strftime('%Y-%m-%d %H:%M')}, micro-batches "
           f"{', '.join(map(str, batches))}; sharing it: {shared})")
    return OpProfile(fingerprint(graphs(b1)), tuple(lines), tuple(opt), tuple(batches), src, tuple(wraps))


def _priced_optimizer(graph: Graph, cluster: Any, optimizers: Sequence[str]) -> dict[str, float]:
    """The calibration's price of one single-process optimizer step, per optimizer."""
    from polyparallel.cost_models import ParallelConfig, estimate_step

    return {o: estimate_step(graph, cluster, ParallelConfig(optimizer=o)).breakdown()["optimizer"] for o in optimizers}


def with_profile(cluster: Any, prof: OpProfile) -> Any:
    """``cluster`` with its (first) device type carrying ``prof``, its source saying so."""
    from dataclasses import replace

    dt = cluster.device(0).type
    new = replace(dt, op_profile=prof, source=f"{dt.source}; {prof.source}")
    nodes = tuple(replace(n, device_type=new) if n.device_type is dt else n for n in cluster.nodes)
    return replace(cluster, nodes=nodes,
                   devices=tuple(replace(d, type=new) if d.type is dt else d for d in cluster.devices),
                   device_types={**cluster.device_types, dt.name: new})


def profiled_op(graph: Graph, op: Any, device: Any, world: int, split: float, sharded: bool,
                dtype: str) -> tuple[float, float] | None:
    """Forward and backward seconds of ``op`` from the device's profile, ``None`` where it has none
    for this graph (another model) or this op."""
    from polyparallel.cost_models.compute import op_cost

    prof: OpProfile | None = device.op_profile
    if prof is None or dtype != "fp32" or not prof.matches(graph):
        return None
    line = prof.line(world, op.name)
    if line is None:
        return None
    a_f, c_f, a_b, c_b = line
    r = op_cost(graph, op, device, dtype, split=split, eager=True)
    fwd, bwd = a_f + c_f * r.forward, a_b + c_b * r.backward
    if sharded:  # a DTensor's dispatch is the host's, not the kernel's: added as measured
        tp = prof.wrapper(world, "tp/op")
        if tp is not None:
            fwd, bwd = fwd + tp[0], bwd + tp[1]
        else:
            s = op_cost(graph, op, device, dtype, split=split, eager=True, sharded=True)
            fwd, bwd = fwd + s.forward - r.forward, bwd + s.backward - r.backward
    return fwd, bwd


def _fingerprint_of(graph: Graph) -> str:
    from polyparallel.cost_models.memo import PRICES

    memo = PRICES.of(graph)
    if "fingerprint" not in memo:
        memo["fingerprint"] = fingerprint(graph)
    return memo["fingerprint"]
