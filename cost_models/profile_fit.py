"""Fitting an op profile (:class:`~polyparallel.cost_models.op_profile.OpProfile`) to measurements.

:mod:`polyparallel.backends.torch.op_timing` measures the model's nodes, optimizer step, wrappers and
the slowdown of sharing the machine; :func:`build_profile` turns them into the per-op curves the step
model reads (:mod:`.op_profile` says how). Kept apart from :mod:`.op_profile`, which the step model
imports, because fitting prices the optimizer step with the step model itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from polyparallel.ir import Graph

from .compute import op_cost
from .op_profile import OpProfile, _Points, fingerprint
from .parallel_config import ParallelConfig
from .step import estimate_step

__all__ = ["build_profile"]


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


def build_profile(graphs: Callable[[int], Graph], cluster: Any,
                  nodes: dict[int, tuple[list[tuple[str, float, float]], dict[str, float]]],
                  optimizer_s: dict[str, float], kappa: dict[int, float],
                  wrappers: dict[str, tuple[float, float, float]]) -> OpProfile:
    """The profile of measurements (module docstring): ``nodes[b]`` the per-node times and plain step
    of micro-batch ``b``, ``optimizer_s`` the optimizer step per optimizer, ``kappa`` the
    slowdown per world size, ``wrappers`` what a parallel wrapper adds; curves against the
    roofline of ``cluster``'s device (a calibrated ``local-cpu``), ``graphs(b)`` the priced graph."""
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
    b1 = batches[0]

    def points(name: str, d: int) -> _Points:
        return tuple(sorted({(roof[b][name][d], measured[b].get(name, (0.0, 0.0))[d])
                             for b in batches if name in roof[b]}))

    base = [(name, points(name, 0), points(name, 1)) for name in roof[b1]]
    opt_priced = _priced_optimizer(graphs(b1), cluster, list(optimizer_s))
    curves, opt, wraps = [], [], []
    for w, k in sorted(kappa.items()):
        curves.append((w, tuple((n, tuple((r, k * t) for r, t in f), tuple((r, k * t) for r, t in b))
                                for n, f, b in base)))
        opt.append((w, tuple((o, k * t / opt_priced[o]) for o, t in optimizer_s.items() if opt_priced.get(o))))
        wraps.append((w, tuple((key, *(k * x for x in v)) for key, v in sorted(wrappers.items()))))
    shared = ", ".join(f"{w} procs x{k:.2f}" for w, k in sorted(kappa.items()))
    src = (f"ops profiled on this machine ({time.strftime('%Y-%m-%d %H:%M')}, micro-batches "
           f"{', '.join(map(str, batches))}; sharing it: {shared})")
    return OpProfile(fingerprint(graphs(b1)), tuple(curves), tuple(opt), tuple(batches), src, tuple(wraps))


def _priced_optimizer(graph: Graph, cluster: Any, optimizers: Sequence[str]) -> dict[str, float]:
    """The calibration's price of one single-process optimizer step, per optimizer."""
    return {o: estimate_step(graph, cluster, ParallelConfig(optimizer=o)).breakdown()["optimizer"] for o in optimizers}
