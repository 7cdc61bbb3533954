r"""Per-op placements of one pipeline stage, chosen on the polyhedral model.

Given a stage's mesh (e.g. ``dp=2, tp=4``) and its ops, choose one legal placement per op
(:func:`polyparallel.poly.legal_placements`) to minimise the stage's time per micro-batch:

.. math::

    \min_{x, y}\ \sum_{o} \sum_{p \in P_o} c_{o,p}\, x_{o,p}
      + \sum_{e=(u \to v)} \sum_{p \in P_u} \sum_{q \in P_v} r_{e,p,q}\, y_{e,p,q}

    \text{s.t.}\quad \sum_{p} x_{o,p} = 1,\qquad
    y_{e,p,q} \ge x_{u,p} + x_{v,q} - 1,\qquad x \in \{0,1\},\ y \ge 0,

where ``c_{o,p}`` is the op's forward + backward compute at its per-device share of the
domain (roofline of :mod:`polyparallel.cost_models.compute`) plus the collectives the op
needs by itself under ``p`` (partial statistics, parameter-gradient all-reduces:
:func:`polyparallel.poly.comm_of_op`), and ``r_{e,p,q}`` the time to reshard the tensor
of edge ``e`` from what ``p`` leaves to what ``q`` needs (:func:`polyparallel.poly.edge_costs`),
twice (the backward pass moves the gradient back along the same route). Collective times
are α–β on the link the mesh axis spans. Minimising ``y`` drives it to
``max(0, x_u + x_v - 1)``, so the relaxation is exact at integral ``x``.

Solved as a MILP with HiGHS (``scipy.optimize.milp``). Candidates per op are its ``K``
cheapest placements by ``c_{o,p}`` (all of them with ``k=None``), so the optimum is over
that candidate set. A graph of a single chain could be solved by dynamic programming; the MILP covers
branching graphs (residual connections) with the same objective, and tests check it
against brute-force enumeration on small graphs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from polyparallel.cluster import Cluster
from polyparallel.ir import Graph, Op, TensorKind

__all__ = ["PlacementPlan", "PlacementTables", "price_placements", "solve_placements"]


@dataclass(frozen=True)
class PlacementPlan:
    """The chosen placement per op and the objective's parts."""

    placements: dict[str, str]
    objective_s: float
    compute_s: float
    comm_s: float
    candidates: int
    pairs: int
    solve_s: float
    status: str


def _axis_links(cluster: Cluster, mesh: object, devices: list[int]) -> dict[str, tuple[float, float]]:
    """(bandwidth bytes/s, latency s) of each mesh axis: the link between neighbours on it."""
    out = {}
    sizes = [a.size for a in mesh.axes]
    for k, ax in enumerate(mesh.axes):
        if ax.size == 1:
            out[ax.name] = (math.inf, 0.0)
            continue
        stride = math.prod(sizes[k + 1:])
        a, b = devices[0], devices[stride]
        bw, lat = cluster.link(a, b)
        out[ax.name] = (bw, lat)
    return out


def _collective_time(kind: str, axes: tuple[str, ...], nbytes: float, links: dict[str, tuple[float, float]],
                     group: int) -> float:
    if nbytes <= 0:
        return 0.0
    bw = min(links[a][0] for a in axes) if axes else math.inf
    lat = max(links[a][1] for a in axes) if axes else 0.0
    steps = 2 * (group - 1) if kind == "all-reduce" else max(1, group - 1)
    return nbytes / bw + steps * lat


@dataclass
class PlacementTables:
    """The priced candidates of a placement problem: per-op costs and per-edge reshard times."""

    ops: list[str]
    candidates: dict[str, list]
    own: dict[str, list[float]]
    own_comm: dict[str, list[float]]
    edges: list[tuple[str, str, np.ndarray]]  # (producer, consumer, seconds[i_u, j_v])
    pairs: int

    def objective(self, choice: dict[str, int]) -> float:
        """The objective of one assignment (candidate index per op), computed directly."""
        total = sum(self.own[o][choice[o]] for o in self.ops)
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)


def price_placements(graph: Graph, mesh: object, cluster: Cluster, *, dtype: str = "fp32",
                     devices: list[int] | None = None, ops: list[Op] | None = None,
                     k: int | None = 6) -> PlacementTables:
    """Price every op's candidate placements and every edge's candidate pairs."""
    from polyparallel.cost_models.compute import op_cost
    from polyparallel.poly import comm_of_op, edge_costs, legal_placements

    ops = list(ops if ops is not None else graph.ops)
    devices = devices or list(range(math.prod(a.size for a in mesh.axes)))
    links = _axis_links(cluster, mesh, devices)
    dt = cluster.device(devices[0]).type
    sizes = {a.name: a.size for a in mesh.axes}
    cand: dict[str, list] = {}
    own: dict[str, list[float]] = {}
    own_comm: dict[str, list[float]] = {}
    for op in ops:
        pls = legal_placements(graph, op, mesh)
        costs, comms = [], []
        for p in pls:
            oc = comm_of_op(graph, op, p, mesh)
            split = op.flops / oc.flops if oc.flops else 1.0
            c = op_cost(graph, op, dt, dtype, split=max(split, 1.0))
            comm = sum(_collective_time(col.kind, col.axes, col.bytes, links, math.prod(sizes[a] for a in col.axes))
                       for col in (*oc.forward, *oc.grad))
            costs.append(c.forward + c.backward + comm)
            comms.append(comm)
        order = sorted(range(len(pls)), key=lambda i: costs[i])[: (len(pls) if k is None else max(1, k))]
        cand[op.name] = [pls[i] for i in order]
        own[op.name] = [costs[i] for i in order]
        own_comm[op.name] = [comms[i] for i in order]
    in_set = {op.name for op in ops}
    edges = []
    pairs = 0
    for v in ops:
        for pos, t in enumerate(v.inputs):
            u = graph.producer(t)
            if u is None or u.name not in in_set or graph.tensors[t].kind is TensorKind.PARAM:
                continue
            ec = edge_costs(graph, t, v, f"in{pos}", mesh, cand[u.name], cand[v.name])
            m = np.zeros((len(cand[u.name]), len(cand[v.name])))
            for i in range(m.shape[0]):
                for j in range(m.shape[1]):
                    rs = ec.cost(i, j)
                    # forward activation and backward gradient take the same route
                    m[i, j] = 2 * sum(_collective_time(st.kind, st.axes, st.elements * rs.dtype_bytes, links, st.group)
                                      for st in rs.steps)
            pairs += m.size
            edges.append((u.name, v.name, m))
    return PlacementTables([op.name for op in ops], cand, own, own_comm, edges, pairs)


def solve_placements(graph: Graph, mesh: object, cluster: Cluster, *, dtype: str = "fp32",
                     devices: list[int] | None = None, ops: list[Op] | None = None, k: int | None = 6,
                     time_limit: float = 30.0) -> PlacementPlan:
    """Choose a placement per op (see the module docstring). ``ops`` defaults to all ops."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    t0 = time.perf_counter()
    tab = price_placements(graph, mesh, cluster, dtype=dtype, devices=devices, ops=ops, k=k)
    index: dict[tuple[str, int], int] = {}
    for name in tab.ops:
        for i in range(len(tab.candidates[name])):
            index[(name, i)] = len(index)
    nx = len(index)
    cost = [tab.own[name][i] for (name, i) in index]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for name in tab.ops:
        for i in range(len(tab.candidates[name])):
            rows.append(r)
            cols.append(index[(name, i)])
            vals.append(1.0)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    ny = 0
    for u, v, m in tab.edges:
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if m[i, j] <= 0:
                    continue
                y = nx + ny
                ny += 1
                cost.append(float(m[i, j]))
                rows += [r, r, r]  # y - x_u,i - x_v,j >= -1
                cols += [y, index[(u, i)], index[(v, j)]]
                vals += [1.0, -1.0, -1.0]
                lo.append(-1.0)
                hi.append(np.inf)
                r += 1
    n = nx + ny
    a = csr_matrix((vals, (rows, cols)), shape=(r, n))
    integrality = np.concatenate([np.ones(nx), np.zeros(ny)])
    res = milp(c=np.array(cost), constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n), np.concatenate([np.ones(nx), np.full(ny, np.inf)])),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        raise RuntimeError(f"placement MILP found no solution: {res.message}")
    choice = {name: max(range(len(tab.candidates[name])), key=lambda i: res.x[index[(name, i)]])
              for name in tab.ops}
    own_comm = sum(tab.own_comm[o][choice[o]] for o in tab.ops)
    compute = sum(tab.own[o][choice[o]] for o in tab.ops) - own_comm
    edge = sum(float(m[choice[u], choice[v]]) for u, v, m in tab.edges)
    return PlacementPlan(placements={o: str(tab.candidates[o][choice[o]]) for o in tab.ops},
                         objective_s=tab.objective(choice), compute_s=compute, comm_s=own_comm + edge,
                         candidates=nx, pairs=tab.pairs, solve_s=time.perf_counter() - t0,
                         status="optimal" if res.status == 0 else str(res.message))
