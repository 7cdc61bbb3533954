r"""Per-op placements of one pipeline stage, chosen on the polyhedral model.

Given a stage's mesh (e.g. ``dp=2, tp=4``) and its ops, choose one legal placement per op
(:func:`polyparallel.poly.legal_placements`) to minimise the stage's time per micro-batch:

.. math::

    \min_{x}\ \sum_{o} c_{o, x_o} + \sum_{e=(u \to v)} r_{e, x_u, x_v}

where ``x_o`` is the candidate placement of op ``o``;

* ``c_{o,p}``: the op's forward + backward compute at its per-device share of the domain
  (roofline of :mod:`polyparallel.cost_models.compute`) plus the collectives the op needs
  by itself under ``p`` (:func:`polyparallel.poly.comm_of_op`: partial statistics forward
  and backward, parameter-gradient all-reduces);
* ``r_{e,p,q}``: the time to reshard the tensor of edge ``e`` from what ``p`` leaves to what
  ``q`` needs (forward, :func:`polyparallel.poly.edge_costs`) plus the time to move its
  gradient back (``EdgeCosts.backward_cost``: e.g. a column-parallel linear leaves its
  input gradient Partial over tp: one all-reduce).

Every collective is priced by :func:`polyparallel.cost_models.comm.collective_time` (ring /
tree / hierarchical by the cluster's links, as the step model does) on the device group
the mesh axes span (the group through the stage's first device): poly's kinds
``all-reduce`` / ``reduce-scatter`` / ``all-gather`` / ``all-to-all`` map to the cost
model's ``all_reduce`` ..., with the full per-device buffer (poly's ``payload``, elements
x dtype bytes) as the message; a halo is a neighbour exchange of the exact halo a device
receives (``comm``'s ``halo``: from its two neighbours, all devices at once); an irregular
exchange is an all-to-all whose per-rank receive ``(p-1)/p * n`` equals poly's exact count.

**Candidates.** An op's candidates are its legal placements that pass ``expressible(op, p)``
(default: all; a backend that runs only some layouts passes its own predicate), cut to the ``K``
cheapest by ``c_{o,p}`` (all of them with ``k=None``), plus ``include(op)`` when given (e.g. a
rule's placement: then the optimum is never worse than the rule under the same prices).
``edge_rule(graph, u, p_u, v, p_v, pos)`` (``v`` reads ``u``'s output as its input ``pos``)
says how the target runs an edge: ``"free"`` moves nothing although the block layouts differ
(the torch backend regroups a fused ``qkv`` projection's rows so each rank's column shard holds
whole heads), ``"forbid"`` cannot be run, ``"local"`` passes local shards only (allowed where
the reshard moves nothing), ``"forward"`` prices the forward reshard only (the target's gradient
needs no communication back, e.g. a residual added after a row-parallel all-reduce), ``None`` is
priced as above. A forbidden pair costs ``FORBIDDEN``
seconds, so the optimum avoids it whenever any assignment does. ``param_cost(op, p)`` adds
seconds per micro-batch that depend on how ``p`` shards the op's parameters (the optimizer step
over the local shard, amortised over the micro-batches), reported as ``param_s``. Bytes
on the wire use the training ``dtype`` for floating-point tensors. An op on sharded parameters
pays the device's DTensor dispatch (``sharded`` in :func:`~polyparallel.cost_models.compute.op_cost`),
as the step model prices it.

**Solvers** (all exact on the candidate set):

* *variable elimination* (min-sum dynamic programming over the graph): eliminating op
  ``o`` replaces the terms that mention it by
  ``g(N(o)) = min_{x_o} [c_{o,x_o} + sum of the terms on o]``, a table over its
  neighbours ``N(o)``; ops are eliminated smallest-table first, and the argmin tables
  give the optimum back. On a chain this *is* the DP along the chain; with residual
  connections the tables stay small (a transformer block's width is 2-3).
* *blocks*: for repeated blocks (:func:`polyparallel.layers.find_repeated_blocks`)
  one instance is solved with its boundary as DP state: eliminating the interior of
  instance ``m`` leaves ``F(s_in, s_out)``, a table over the placements of the ops that
  feed it (state in) and of its ops read later (state out). Instances ``1..L-1`` of a
  block have the same ``F`` (same signatures, same edges), so it is computed once per
  (block signature, mesh) and the chain is the min-plus product
  ``V_m(s) = min_{s'} V_{m-1}(s') + F(s', s)``: a 96-layer model costs one block.
* *MILP* (HiGHS, ``scipy.optimize.milp``) as the fallback when an elimination table would
  exceed ``max_table`` entries (wide, branchy graphs):

  .. math::

      \min \sum_{o,p} c_{o,p} x_{o,p} + \sum_{e,p,q} r_{e,p,q} y_{e,p,q}\quad
      \text{s.t.}\ \sum_p x_{o,p} = 1,\ y_{e,p,q} \ge x_{u,p} + x_{v,q} - 1,\ x \in \{0,1\},\ y \ge 0

  (``y`` is driven to ``max(0, x_u + x_v - 1)``, so the relaxation is exact at integral ``x``).

Memory is not a constraint here: the step model's memory ladder (ZeRO, recompute) decides
what fits; this chooses the fastest placements inside a stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models.comm import collective_time
from polyparallel.cost_models.memo import PRICES
from polyparallel.cost_models.step import op_seconds
from polyparallel.ir import ANY as _ANY
from polyparallel.ir import FLOAT_DTYPES, TRAINING_DTYPE_BYTES, Graph, Op, TensorKind, element_bytes
from polyparallel.layers import find_repeated_blocks
from polyparallel.poly import comm_of_op, edge_costs, legal_placements
from polyparallel.poly._cache import signature_of

__all__ = ["FORBIDDEN", "PlacementPlan", "PlacementTables", "param_split", "price_placements", "solve_placements",
           "solve_stage", "work_split"]

Expressible = Callable[[Op, Any], bool]  # (op, Placement) -> whether the target runs it
Include = Callable[[Op], Any]  # op -> a Placement that must be a candidate, or None
ParamCost = Callable[[Op, Any], float]  # (op, Placement) -> seconds per micro-batch
EdgeRule = Callable[[Graph, Op, Any, Op, Any, int], "str | None"]  # "free"/"forbid"/"local"/"forward"/None
FORBIDDEN = 1e6  # seconds: an edge layout pair the target cannot run

_KIND = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter", "all-gather": "all_gather",
         "all-to-all": "all_to_all"}


@dataclass(frozen=True)
class PlacementPlan:
    """The chosen placement per op and the objective's parts (seconds per micro-batch).

    ``compute_s``: forward + backward compute; ``own_comm_s``: collectives inside ops
    (statistics, parameter gradients); ``forward_reshard_s`` / ``backward_reshard_s``: the
    edges, activations forward and their gradients backward; ``comm_s`` their sum; ``param_s``:
    the ``param_cost`` terms.
    """

    placements: dict[str, str]
    objective_s: float
    compute_s: float
    comm_s: float
    candidates: int
    pairs: int
    solve_s: float
    status: str
    solver: str = "milp"
    own_comm_s: float = 0.0
    forward_reshard_s: float = 0.0
    backward_reshard_s: float = 0.0
    blocks: tuple[str, ...] = ()
    param_s: float = 0.0

    def breakdown(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "own_comm_s": self.own_comm_s,
                "forward_reshard_s": self.forward_reshard_s, "backward_reshard_s": self.backward_reshard_s,
                "param_s": self.param_s}


# -- pricing --------------------------------------------------------------------------------------
@dataclass
class _Pricer:
    """Prices candidates and edges for one (graph, mesh, cluster, devices), memoised by signature."""

    graph: Graph
    mesh: Any
    cluster: Cluster
    devices: list[int]
    dtype: str
    k: int | None
    expressible: Expressible | None = None
    include: Include | None = None
    edge_rule: EdgeRule | None = None
    param_cost: ParamCost | None = None
    _coll: dict = field(default_factory=dict)
    _cands: dict = field(default_factory=dict)
    _param: dict = field(default_factory=dict)
    _groups: dict = field(default_factory=dict)
    _ops: dict = field(default_factory=dict)
    _edges: dict = field(default_factory=dict)
    _keys: dict = field(default_factory=dict)

    def group(self, axes: Sequence[str]) -> list[int]:
        """Device ids of the group spanned by ``axes`` through the stage's first device."""
        key = tuple(axes)
        g = self._groups.get(key)
        if g is None:
            idx = [self.mesh.index(a) for a in axes]
            others = [i for i in range(len(self.mesh.axes)) if i not in idx]
            coords = self.mesh.coords
            members = np.nonzero((coords[:, others] == 0).all(axis=1))[0] if others else np.arange(self.mesh.size)
            g = [self.devices[int(i)] for i in members]
            self._groups[key] = g
        return g

    def collective(self, kind: str, axes: Sequence[str], payload_bytes: float, received_bytes: float) -> float:
        """Seconds of one poly collective (see the module docstring for the mapping)."""
        if received_bytes <= 0 and payload_bytes <= 0:
            return 0.0
        key = (kind, tuple(axes), payload_bytes, received_bytes)
        t = self._coll.get(key)
        if t is None:
            group = self.group(axes)
            p = len(group)
            if p <= 1:
                t = 0.0
            elif kind in _KIND:
                t = collective_time(self.cluster, _KIND[kind], float(payload_bytes), group).seconds
            elif kind == "halo":
                t = collective_time(self.cluster, "halo", float(received_bytes), group).seconds
            elif kind == "p2p":
                t = collective_time(self.cluster, "all_to_all", float(received_bytes) * p / (p - 1), group).seconds
            else:
                raise ValueError(f"unknown collective kind {kind!r} from the polyhedral model")
            self._coll[key] = t
        return t

    def reshard_s(self, rs: Any, width: float) -> float:
        """Seconds of a poly reshard whose elements are ``width`` bytes each."""
        if rs is None:
            return 0.0
        return sum(self.collective(st.kind, st.axes, st.payload * width, st.elements * width) for st in rs.steps)

    def width(self, tensor: str) -> float:
        """Bytes per element on the wire: the training dtype for floating-point tensors."""
        return _wire_bytes(self.graph, tensor, self.dtype)

    def legal(self, op: Op) -> tuple:
        """The op's legal placements the target can run, plus the included one."""
        hit = self._cands.get(op.name)
        if hit is None:
            pls = legal_placements(self.graph, op, self.mesh)
            if self.expressible is not None:
                pls = [p for p in pls if self.expressible(op, p)]
            forced = self.include(op) if self.include is not None else None
            if forced is not None and forced not in pls:
                if forced not in legal_placements(self.graph, op, self.mesh):
                    raise ValueError(f"include: placement {forced} is not legal for op {op.name!r} on {self.mesh}")
                pls.append(forced)
            if not pls:
                raise ValueError(f"op {op.name!r}: no legal placement passes the expressible predicate on {self.mesh}; "
                                 "the predicate must keep at least the replicated placement")
            hit = self._cands[op.name] = (tuple(pls), forced)
        return hit

    def key(self, op: Op) -> tuple:
        """What an op's prices depend on: its signature and its candidate set (kept per op name:
        the pricer's graph is fixed, and each op's key is asked for once per edge it is on)."""
        hit = self._keys.get(op.name)
        if hit is None:
            pls, forced = self.legal(op)
            extra = tuple(self.param_cost(op, p) for p in pls) if self.param_cost is not None else None
            hit = self._keys[op.name] = (signature_of(self.graph, op), pls, forced, extra)
        return hit

    def op(self, op: Op) -> tuple[list, list[float], list[float], list[float]]:
        """(candidates, total own seconds, compute seconds, own-collective seconds), K cheapest."""
        key = self.key(op)
        hit = self._ops.get(key)
        if hit is not None:
            return hit
        dt = self.cluster.device(self.devices[0]).type
        pls, forced = self.legal(op)
        extra = key[3] or (0.0,) * len(pls)
        w = TRAINING_DTYPE_BYTES.get(self.dtype, 4)  # collectives inside an op move partial sums / gradients
        costs: list[float] = []
        computes: list[float] = []
        comms: list[float] = []
        # the step model's price of each candidate as the torch backend runs it (eager on accelerators)
        run = ParallelConfig(dtype=self.dtype)
        for p in pls:
            oc = comm_of_op(self.graph, op, p, self.mesh)
            split = work_split(op, oc, p, self.mesh)
            fw, bw = op_seconds(self.graph, op, dt, run, max(split, 1.0), param_split(self.graph, op, p, self.mesh) > 1)
            comm = sum(self.collective(col.kind, col.axes, col.payload * w, col.elements * w)
                       for col in (*oc.forward, *oc.backward, *oc.grad))
            computes.append(fw + bw)
            comms.append(comm)
            costs.append(fw + bw + comm + extra[len(costs)])
        order = sorted(range(len(pls)), key=lambda i: costs[i])[: (len(pls) if self.k is None else max(1, self.k))]
        if forced is not None and pls.index(forced) not in order:
            order.append(pls.index(forced))
        hit = ([pls[i] for i in order], [costs[i] for i in order], [computes[i] for i in order],
               [comms[i] for i in order])
        self._ops[key] = hit
        self._param[key] = [extra[i] for i in order]
        return hit

    def params(self, op: Op) -> list[float]:
        """``param_cost`` of the op's candidates (as :meth:`op` orders them)."""
        self.op(op)
        return self._param[self.key(op)]

    def edge(self, tensor: str, u: Op, v: Op, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(forward seconds, backward seconds) matrices over (candidates of u, candidates of v)."""
        key = (self.key(u), u.outputs.index(tensor), self.key(v), pos)
        hit = self._edges.get(key)
        if hit is not None:
            return hit
        cu, cv = self.op(u)[0], self.op(v)[0]
        ec = edge_costs(self.graph, tensor, v, f"in{pos}", self.mesh, cu, cv)
        w = self.width(tensor)
        fwd = np.zeros((len(cu), len(cv)))
        bwd = np.zeros((len(cu), len(cv)))
        for i in range(len(cu)):
            for j in range(len(cv)):
                how = self.edge_rule(self.graph, u, cu[i], v, cv[j], pos) if self.edge_rule is not None else None
                if how == "free":
                    continue
                rs = ec.cost(i, j)
                if how == "forbid" or (how == "local" and rs is not None and rs.steps):
                    fwd[i, j] = FORBIDDEN
                    continue
                fwd[i, j] = self.reshard_s(rs, w)
                if how != "forward" and self.graph.tensors[tensor].dtype in FLOAT_DTYPES:  # no gradient into indices
                    bwd[i, j] = self.reshard_s(ec.backward_cost(i, j), w)
        self._edges[key] = (fwd, bwd)
        return fwd, bwd




def _wire_bytes(graph: Graph, tensor: str, dtype: str) -> float:

    t = graph.tensors[tensor].dtype
    return element_bytes(t, dtype)


def work_split(op: Op, oc: Any, placement: Any, mesh: Any) -> float:
    """Ways the op's work is divided, read off its largest statement (most domain points): its
    FLOPs over the busiest device's when that statement computes (exact for uneven blocks), else
    (a lookup or copy, priced by the bytes it moves) the number of blocks its split dims cut it in."""
    if op.nest is None or not placement.splits:
        return 1.0
    ext = op.nest.extents
    big = max(op.nest.statements, key=lambda st: math.prod(ext[d] for d in st.dims))
    if big.flops_per_point and op.flops and oc.flops:
        return max(1.0, op.flops / oc.flops)
    return float(math.prod(mesh.group_size(axes) for d, axes in placement.splits if d in big.dims))


def param_split(graph: Graph, op: Op, placement: Any, mesh: Any) -> int:
    """Ways ``placement`` shards the op's parameters: the product of the mesh axes splitting a
    dim that indexes a parameter operand (1 when every parameter is replicated)."""
    if op.nest is None or not placement.splits:
        return 1
    params = {f"in{i}" for i, t in enumerate(op.inputs) if graph.tensors[t].kind is TensorKind.PARAM}
    if not params:
        return 1
    dims = {d for st in op.nest.statements for a in st.reads if a.operand in params
            for e in a.index if e is not _ANY for d in e.dims}
    return math.prod(mesh.group_size(axes) for d, axes in placement.splits if d in dims)


def in_edges(graph: Graph, v: Op) -> list[tuple[str, Op, int]]:
    out = []
    for pos, t in enumerate(v.inputs):
        u = graph.producer(t)
        if u is None or graph.tensors[t].kind is TensorKind.PARAM:
            continue
        out.append((t, u, pos))
    return out


@dataclass
class PlacementTables:
    """The priced candidates of a placement problem: per-op costs and per-edge reshard times."""

    ops: list[str]
    candidates: dict[str, list]
    own: dict[str, list[float]]
    own_comm: dict[str, list[float]]
    edges: list[tuple[str, str, np.ndarray]]  # (producer, consumer, forward + backward seconds[i_u, j_v])
    pairs: int
    edge_parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (forward, backward)
    param: dict[str, list[float]] = field(default_factory=dict)  # the param_cost part of ``own``

    def objective(self, choice: dict[str, int]) -> float:
        """The objective of one assignment (candidate index per op), computed directly."""
        total = sum(self.own[o][choice[o]] for o in self.ops)
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)


def _pricer(graph: Graph, mesh: Any, cluster: Cluster, dtype: str, devices: list[int] | None,
            k: int | None, expressible: Expressible | None = None, include: Include | None = None,
            edge_rule: EdgeRule | None = None, param_cost: ParamCost | None = None) -> _Pricer:
    devices = list(devices or range(mesh.size))
    if len(devices) != mesh.size:
        raise ValueError(f"the stage mesh {mesh} has {mesh.size} devices but {len(devices)} device ids were given")
    return _Pricer(graph, mesh, cluster, devices, dtype, k, expressible, include, edge_rule, param_cost)


def price_placements(graph: Graph, mesh: Any, cluster: Cluster, *, dtype: str = "fp32",
                     devices: list[int] | None = None, ops: list[Op] | None = None,
                     k: int | None = 6, expressible: Expressible | None = None,
                     include: Include | None = None, edge_rule: EdgeRule | None = None,
                     param_cost: ParamCost | None = None) -> PlacementTables:
    """Price every op's candidate placements and every edge's candidate pairs (candidates as
    :func:`solve_stage` takes them)."""
    pr = _pricer(graph, mesh, cluster, dtype, devices, k, expressible, include, edge_rule, param_cost)
    return _tables(pr, list(ops if ops is not None else graph.ops))


def _tables(pr: _Pricer, ops: list[Op]) -> PlacementTables:
    cand, own, own_comm, param = {}, {}, {}, {}
    for op in ops:
        c, total, _compute, comm = pr.op(op)
        cand[op.name], own[op.name], own_comm[op.name], param[op.name] = c, total, comm, pr.params(op)
    in_set = {op.name for op in ops}
    edges, parts, pairs = [], [], 0
    for v in ops:
        for t, u, pos in in_edges(pr.graph, v):
            if u.name not in in_set:
                continue
            fwd, bwd = pr.edge(t, u, v, pos)
            edges.append((u.name, v.name, fwd + bwd))
            parts.append((fwd, bwd))
            pairs += fwd.size
    return PlacementTables([op.name for op in ops], cand, own, own_comm, edges, pairs, parts, param)


# -- variable elimination ------------------------------------------------------------------------
class _TooWide(Exception):
    pass


Factor = tuple[tuple[str, ...], np.ndarray]


def _combine(factors: list[Factor], scope: tuple[str, ...], size: dict[str, int]) -> np.ndarray:
    total = np.zeros([size[v] for v in scope])
    for vars_, table in factors:
        order = sorted(range(len(vars_)), key=lambda i: scope.index(vars_[i]))
        t = np.transpose(table, order) if order != list(range(len(vars_))) else table
        total = total + t.reshape([size[v] if v in vars_ else 1 for v in scope])
    return total


@dataclass
class _Trace:
    """Argmin tables of eliminated variables, in elimination order (for back-substitution)."""

    steps: list[tuple[str, tuple[str, ...], np.ndarray]] = field(default_factory=list)

    def assign(self, values: dict[str, int], rename: Callable[[str], str] = lambda v: v) -> None:
        for var, scope, arg in reversed(self.steps):
            values[rename(var)] = int(arg[tuple(values[rename(s)] for s in scope)]) if scope else int(arg)


def _eliminate(factors: list[Factor], size: dict[str, int], eliminate: set[str],
               max_table: int) -> tuple[list[Factor], _Trace]:
    """Min-sum elimination of ``eliminate`` (smallest resulting table first); the remaining factors
    are over the other variables. Raises _TooWide when a table would exceed ``max_table``."""
    factors = list(factors)
    by_var: dict[str, set[int]] = {}
    for i, (vars_, _) in enumerate(factors):
        for v in vars_:
            by_var.setdefault(v, set()).add(i)
    alive = set(range(len(factors)))
    trace = _Trace()
    todo = set(eliminate)
    while todo:
        best, best_size, best_scope = None, None, None
        for x in sorted(todo):
            scope = tuple(dict.fromkeys(v for i in sorted(by_var.get(x, ())) for v in factors[i][0]))
            n = math.prod(size[v] for v in scope)
            if best_size is None or n < best_size:
                best, best_size, best_scope = x, n, scope
        assert best is not None and best_scope is not None and best_size is not None
        if best_size > max_table:
            raise _TooWide(f"eliminating {best} needs a table of {best_size} entries")
        x = best
        ids = sorted(by_var.get(x, ()))
        scope = best_scope if best_scope else (x,)
        total = _combine([factors[i] for i in ids], scope, size) if ids else np.zeros(size[x])
        ax = scope.index(x)
        rest = tuple(v for v in scope if v != x)
        arg = np.argmin(total, axis=ax)
        new = np.min(total, axis=ax)
        trace.steps.append((x, rest, arg))
        for i in ids:
            alive.discard(i)
            for v in factors[i][0]:
                by_var[v].discard(i)
        factors.append((rest, new))
        nid = len(factors) - 1
        alive.add(nid)
        for v in rest:
            by_var.setdefault(v, set()).add(nid)
        todo.discard(x)
    return [factors[i] for i in sorted(alive)], trace


def _problem(tab: PlacementTables) -> tuple[list[Factor], dict[str, int]]:
    size = {o: len(tab.candidates[o]) for o in tab.ops}
    factors: list[Factor] = [((o,), np.asarray(tab.own[o], dtype=float)) for o in tab.ops]
    factors += [((u, v), m) for u, v, m in tab.edges]
    return factors, size


def _solve_elimination(tab: PlacementTables, max_table: int) -> dict[str, int]:
    factors, size = _problem(tab)
    _, trace = _eliminate(factors, size, set(tab.ops), max_table)
    values: dict[str, int] = {}
    trace.assign(values)
    return values


# -- MILP -----------------------------------------------------------------------------------------
def _solve_milp(tab: PlacementTables, time_limit: float) -> tuple[dict[str, int], str]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

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
    return choice, "optimal" if res.status == 0 else str(res.message)


def _plan(tab: PlacementTables, pr: _Pricer, choice: dict[str, int], t0: float, status: str, solver: str,
          blocks: tuple[str, ...] = ()) -> PlacementPlan:
    compute = own_comm = params = 0.0
    for o in tab.ops:
        own_comm += tab.own_comm[o][choice[o]]
        p = tab.param[o][choice[o]] if o in tab.param else 0.0
        params += p
        compute += tab.own[o][choice[o]] - tab.own_comm[o][choice[o]] - p
    fwd = sum(float(f[choice[u], choice[v]]) for (u, v, _), (f, _b) in zip(tab.edges, tab.edge_parts))
    bwd = sum(float(b[choice[u], choice[v]]) for (u, v, _), (_f, b) in zip(tab.edges, tab.edge_parts))
    return PlacementPlan(placements={o: str(tab.candidates[o][choice[o]]) for o in tab.ops},
                         objective_s=tab.objective(choice), compute_s=compute, comm_s=own_comm + fwd + bwd,
                         candidates=sum(len(c) for c in tab.candidates.values()), pairs=tab.pairs,
                         solve_s=time.perf_counter() - t0, status=status, solver=solver, own_comm_s=own_comm,
                         forward_reshard_s=fwd, backward_reshard_s=bwd, blocks=blocks, param_s=params)


def solve_placements(graph: Graph, mesh: Any, cluster: Cluster, *, dtype: str = "fp32",
                     devices: list[int] | None = None, ops: list[Op] | None = None, k: int | None = 6,
                     time_limit: float = 30.0, solver: str = "auto", max_table: int = 1 << 20,
                     expressible: Expressible | None = None, include: Include | None = None,
                     edge_rule: EdgeRule | None = None, param_cost: ParamCost | None = None) -> PlacementPlan:
    """Choose a placement per op over the whole op list (see the module docstring).

    ``solver``: ``"elimination"`` (exact DP; raises when a table exceeds ``max_table``),
    ``"milp"``, or ``"auto"`` (elimination, MILP when too wide).
    """
    if solver not in ("auto", "elimination", "milp"):
        raise ValueError(f"solver must be 'auto', 'elimination' or 'milp', not {solver!r}")
    t0 = time.perf_counter()
    pr = _pricer(graph, mesh, cluster, dtype, devices, k, expressible, include, edge_rule, param_cost)
    tab = _tables(pr, list(ops if ops is not None else graph.ops))
    if solver != "milp":
        try:
            return _plan(tab, pr, _solve_elimination(tab, max_table), t0, "optimal", "elimination")
        except _TooWide:
            if solver == "elimination":
                raise
    choice, status = _solve_milp(tab, time_limit)
    return _plan(tab, pr, choice, t0, status, "milp")


# -- blocks: solve one instance with its boundary as DP state, chain the rest ---------------------
_BLOCK_CACHE: dict[tuple, tuple[tuple[str, ...], np.ndarray, _Trace]] = {}


def _block_factor(pr: _Pricer, inst: list[Op], prev: list[Op] | None, in_set: set[str], max_table: int,
                  ) -> tuple[tuple[str, ...], np.ndarray, _Trace, Callable[[str], str], list[str]]:
    """The instance's transfer table ``F(boundary)`` in role names, its trace, and the renaming.

    Roles: ``b{i}`` op ``i`` of this instance, ``p{i}`` op ``i`` of the previous instance,
    ``x:NAME`` any other op feeding the instance.
    """

    g = pr.graph
    pos = {op.name: i for i, op in enumerate(inst)}
    ppos = {op.name: i for i, op in enumerate(prev)} if prev is not None else {}
    later = _read_later(g, inst)

    def role(name: str) -> str:
        if name in pos:
            return f"b{pos[name]}"
        if name in ppos:
            return f"p{ppos[name]}"
        return f"x:{name}"

    names = {role(op.name): op.name for op in inst}
    pattern = []
    edges: list[list[tuple[str, Op, int]]] = []  # per op of the instance, its edges from this stage
    for op in inst:
        r = role(op.name)
        edges.append([])
        for t, u, p in in_edges(g, op):
            if u.name not in in_set:
                continue  # produced in an earlier stage: not this stage's choice
            ru = role(u.name)
            names[ru] = u.name
            edges[-1].append((t, u, p))
            pattern.append((ru, r, p, u.outputs.index(t)))
    keep = {role(op.name) for op in inst if op.name in later}
    key = (tuple(pr.key(op) for op in inst), tuple(pattern), tuple(sorted(keep)), pr.mesh,
           id(pr.cluster), tuple(pr.devices), pr.dtype, pr.k, max_table, pr.edge_rule,
           tuple(pr.key(u) for op in inst for _t, u, _p in in_edges(g, op) if u.name not in pos and u.name in in_set))
    hit = _BLOCK_CACHE.get(key)
    if hit is None:  # the instance's factors, needed only to solve it (its repeats share the table)
        factors: list[Factor] = []
        size: dict[str, int] = {}
        for op, op_edges in zip(inst, edges):
            c, total, _, _ = pr.op(op)
            r = role(op.name)
            size[r] = len(c)
            factors.append(((r,), np.asarray(total, dtype=float)))
            for t, u, p in op_edges:
                ru = role(u.name)
                size[ru] = len(pr.op(u)[0])
                fwd, bwd = pr.edge(t, u, op, p)
                factors.append(((ru, r), fwd + bwd))
        interior = {role(op.name) for op in inst} - keep
        rest, trace = _eliminate(factors, size, interior, max_table)
        scope = tuple(dict.fromkeys(v for vars_, _ in rest for v in vars_))
        table = _combine(rest, scope, size) if scope else np.array(sum(float(t) for _, t in rest))
        hit = (scope, table, trace)
        if len(_BLOCK_CACHE) > 256:
            _BLOCK_CACHE.clear()
        _BLOCK_CACHE[key] = hit
    scope, table, trace = hit
    return scope, table, trace, lambda r: names[r], [names[r] for r in scope]


def _read_later(g: Graph, inst: list[Op]) -> set[str]:
    """Ops of ``inst`` whose outputs are read by an op outside it."""
    inside = {op.name for op in inst}
    out = set()
    for op in inst:
        for t in op.outputs:
            if any(c.name not in inside for c in g.consumers(t)):
                out.add(op.name)
    return out


def solve_stage(graph: Graph, mesh: Any, cluster: Cluster, *, dtype: str = "fp32",
                devices: list[int] | None = None, ops: list[Op] | None = None, k: int | None = 6,
                max_table: int = 1 << 20, time_limit: float = 30.0, expressible: Expressible | None = None,
                include: Include | None = None, edge_rule: EdgeRule | None = None,
                param_cost: ParamCost | None = None) -> PlacementPlan:
    """Per-op placements of one stage (``ops``, default the whole graph) on ``mesh``.

    Repeated blocks are solved once per (block signature, mesh) with their boundary as DP
    state and chained (module docstring); the rest by variable elimination; the MILP when
    a table would exceed ``max_table``. The plan's ``solver`` says which ran, ``blocks``
    the repeated blocks used.

    Args:
        mesh: the stage's :class:`polyparallel.poly.DeviceMesh` (axes outermost first).
        cluster: prices the collectives (:func:`polyparallel.cost_models.comm.collective_time`).
        devices: the stage's global device ids in the mesh's row-major order (default
            ``0..n-1``); a mesh axis's collective group is the devices that differ from the
            first device only along that axis.
        ops: the stage's ops (default the whole graph); edges from ops outside are not priced.
        k: candidates per op (its ``k`` cheapest placements by compute + own collectives);
            ``None`` keeps every legal placement.
        expressible: ``(op, placement) -> bool``: only placements it accepts are candidates
            (a backend's executable layouts); it must accept the replicated placement.
        include: ``op -> placement or None``: a placement that is always a candidate.
        edge_rule: ``(graph, u, p_u, v, p_v, pos) -> "free" | "forbid" | "local" | "forward" | None``: how the
            target runs an edge (module docstring); pass a module-level function (it keys the
            block cache).
        param_cost: ``(op, placement) -> seconds per micro-batch`` added to the op's cost (module
            docstring).
    """
    t0 = time.perf_counter()
    ops = list(ops if ops is not None else graph.ops)
    pr = _pricer(graph, mesh, cluster, dtype, devices, k, expressible, include, edge_rule, param_cost)
    index = {op.name: i for i, op in enumerate(graph.ops)}
    idx = sorted(index[op.name] for op in ops)
    lo, hi = (idx[0], idx[-1] + 1) if idx else (0, 0)
    contiguous = idx == list(range(lo, hi))
    runs: list[tuple[str, list[range]]] = []
    if ops and contiguous:
        # the same graph is solved once per tensor-parallel degree: its blocks are found once
        memo = PRICES.of(graph)
        blocks = memo.get(("repeated_blocks",))
        if blocks is None:
            blocks = memo[("repeated_blocks",)] = find_repeated_blocks(graph)
        for b in blocks:
            # a pipeline stage may cut a run of layers: keep the instances wholly inside it
            inside = [r for r in b.instances if r.start >= lo and r.stop <= hi]
            if len(inside) >= 2:
                runs.append((b.key, inside))
    if not runs:
        plan = solve_placements(graph, mesh, cluster, dtype=dtype, devices=devices, ops=ops, k=k,
                                time_limit=time_limit, max_table=max_table, expressible=expressible, include=include,
                                edge_rule=edge_rule, param_cost=param_cost)
        return plan
    try:
        return _solve_chain(pr, ops, runs, t0, max_table)
    except _TooWide:
        tab = _tables(pr, ops)
        choice, status = _solve_milp(tab, time_limit)
        return _plan(tab, pr, choice, t0, status, "milp")


def _solve_chain(pr: _Pricer, ops: list[Op], runs: list[tuple[str, list[range]]], t0: float,
                 max_table: int) -> PlacementPlan:
    g = pr.graph
    in_block: dict[str, int] = {}
    instances: list[tuple[list[Op], list[Op] | None]] = []
    for _key, ranges in runs:
        prev = None
        for r in ranges:
            inst = [g.ops[i] for i in r]
            instances.append((inst, prev))
            for op in inst:
                in_block[op.name] = len(instances) - 1
            prev = inst
    outside = [op for op in ops if op.name not in in_block]
    in_set = {op.name for op in ops}
    factors: list[Factor] = []
    size: dict[str, int] = {}
    for op in outside:
        c, total, _, _ = pr.op(op)
        size[op.name] = len(c)
        factors.append(((op.name,), np.asarray(total, dtype=float)))
        for t, u, p in in_edges(g, op):
            if u.name not in in_set:
                continue
            size[u.name] = len(pr.op(u)[0])
            fwd, bwd = pr.edge(t, u, op, p)
            factors.append(((u.name, op.name), fwd + bwd))
    traces = []
    for inst, prev in instances:
        scope, table, trace, rename, names = _block_factor(pr, inst, prev, in_set, max_table)
        for dim, n in zip(scope, names):
            size[n] = table.shape[scope.index(dim)]
        factors.append((tuple(names), table))
        traces.append((trace, rename))
    _, top = _eliminate(factors, size, set(size), max_table)
    values: dict[str, int] = {}
    top.assign(values)
    for trace, rename in reversed(traces):
        trace.assign(values, rename)
    tab = _tables(pr, ops)
    choice = {op.name: values[op.name] for op in ops}
    keys = tuple(dict.fromkeys(key[:8] for key, _ in runs))
    return _plan(tab, pr, choice, t0, "optimal", "blocks", keys)
