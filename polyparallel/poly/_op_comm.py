"""The communication of one op under a placement, forward and backward, apart from resharding its inputs.

**Inside an op** (:func:`comm_of_op`): a statement that reduces a split dim leaves
partial sums on the mesh axes of that dim. Into a temporary (softmax/norm statistics,
attention scores) it needs an all-reduce of ``p``'s block of the temporary before the
statements that read it; into an output it leaves the output *Partial* on those axes
for the reshard to finish. For training, a parameter read by a statement that iterates
split dims absent from the parameter's index gets partial gradients on their mesh axes:
an all-reduce of ``p``'s block of the parameter (data parallel: the parameter count).
The op's FLOPs are the maximum over devices of the statement-domain points each computes.

**Gradients** (:func:`grad_partial_axes`, :func:`grad_held`, :func:`grad_needed`): the
gradient of an input is Partial on the mesh axes of the split dims a read iterates without
indexing by; :func:`backward_reshard_edge` moves it from what each reader leaves to what
the producer needs, the dual of :func:`reshard_edge`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from polyparallel.ir import ANY, DTYPE_BYTES, Graph, LoopNest, Op, Shape, Statement, TensorKind

from ._cache import CACHE, MISSING
from ._cache import signature_of as _signature
from ._distribution import (
    Distribution,
    _dim_bounds,
    _footprint_axes,
    _of_nest,
    _op_distributions,
    _partial_axes,
    _side_by_side,
    operand_need,
    output_layout,
)
from ._footprint import Grid, Prog, Region, _intersect_products, grid_cut, operand_region
from ._isl import count, domain_set, footprint_set
from ._mesh import DeviceMesh
from ._placement import Placement, check_placement, dim_split_kind, legal_placements, padding_of
from ._reshard import Reshard, _all_reduce, reshard

__all__ = ["Collective", "OpComm", "backward_reshard_edge", "comm_of_op", "grad_held", "grad_needed",
           "grad_partial_axes"]


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective an op needs by itself: ``operand`` block of ``payload`` elements over ``axes``."""

    kind: str
    axes: tuple[str, ...]
    operand: str
    payload: int
    elements: int
    dtype_bytes: int

    @property
    def bytes(self) -> int:
        return self.elements * self.dtype_bytes

    def __str__(self) -> str:
        return f"{self.kind}[{'+'.join(self.axes)}] {self.operand}: {self.payload} el"


@dataclass(frozen=True, slots=True)
class OpComm:
    """What an op needs under a placement, apart from resharding its inputs.

    ``forward``: all-reduces of partial temporaries (statistics, scores) inside the op;
    ``partial_outputs``: output -> mesh axes it is left Partial on; ``grad``: parameter
    gradient all-reduces of the backward pass; ``split_kinds``: dim -> parallel |
    normalised | reduction; ``padding``: padded elements per unevenly split dim;
    ``points``: max over devices of the statement-domain points each device computes;
    ``backward``: the backward pass's all-reduces of partial statistics inside the op, the
    dual of ``forward`` (softmax/norm backward sums ``dy * y`` over the normalised dim into
    a temporary of the statistics' shape, so a split normalised dim all-reduces the same
    volume again). Input-activation gradients are priced per edge
    (:func:`backward_reshard_edge`, ``EdgeCosts.backward``).
    """

    placement: Placement
    forward: tuple[Collective, ...]
    partial_outputs: tuple[tuple[str, tuple[str, ...]], ...]
    grad: tuple[Collective, ...]
    split_kinds: tuple[tuple[str, str], ...]
    padding: tuple[tuple[str, int], ...]
    flops: float
    backward: tuple[Collective, ...] = ()

    @property
    def forward_bytes(self) -> int:
        return sum(c.bytes for c in self.forward)

    @property
    def backward_bytes(self) -> int:
        return sum(c.bytes for c in self.backward)


def comm_of_op(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh) -> OpComm:
    """Collectives ``op`` needs under ``placement`` (raises IllegalPlacement when it is not legal).

    The first miss of a legal placement prices every legal placement of the op not yet
    cached in one batch (:func:`_comm_of_ops`): callers price them all anyway.
    """
    # every placement of every op of every repeated layer comes here: the signature's own results first
    # (no key tuple, no mesh hash), then the cache, then the batch
    sig = _signature(graph, op)
    mine = _OP_COMM.get(sig)
    if mine is not None and mine[0] is mesh:
        got = mine[1].get(placement)
        if got is not None:
            CACHE.hits["op_comm"] = CACHE.hits.get("op_comm", 0) + 1
            return got
    else:
        if len(_OP_COMM) > 100_000:
            _OP_COMM.clear()
        mine = _OP_COMM[sig] = (mesh, {})
    key = (sig, placement, mesh)
    hit = CACHE.hit("op_comm", key)
    if hit is not MISSING:
        mine[1][placement] = hit
        return hit

    def make() -> OpComm:
        check_placement(op.nest, placement, mesh, op=op.name)
        legal = legal_placements(graph, op, mesh)
        table = CACHE.tables.get("op_comm", {})
        batch = [placement]
        if placement in legal:
            batch += [p for p in legal if p != placement and (sig, p, mesh) not in table]
        got = _comm_of_ops(graph, op, batch, mesh)
        for p in batch[1:]:
            CACHE.get("op_comm", (sig, p, mesh), lambda p=p: got[p])
        return got[placement]

    out = mine[1][placement] = CACHE.get("op_comm", key, make)
    return out


_OP_COMM: dict[str, tuple[DeviceMesh, dict[Placement, OpComm]]] = {}  # signature -> (mesh object, its results)
CACHE.on_clear(_OP_COMM.clear)


def _comm_of_ops(graph: Graph, op: Op, placements: Sequence[Placement], mesh: DeviceMesh) -> dict[Placement, OpComm]:
    """:class:`OpComm` of each placement; the per-device counts of all of them in one pass over
    ``k n`` virtual devices (each placement's bounds side by side, as :func:`_op_distributions`)."""
    nest = op.nest
    for p in placements:
        check_placement(nest, p, mesh, op=op.name)
    if nest is None:
        return {p: OpComm(p, (), (), (), (), (), float(op.flops)) for p in placements}
    out_dtype = graph.tensors[op.outputs[0]].dtype if op.outputs else "float32"
    obytes = DTYPE_BYTES.get(out_dtype, 4)
    per = [_dim_bounds(nest, p, mesh) for p in placements]
    everything, take, nv = _flop_bounds(nest, per, placements, mesh)
    flops = np.zeros(nv)
    for st in nest.statements:
        flops += _points(nest, st, everything, nv) * st.flops_per_point
    flops_max = [float(flops[t].max(initial=0)) for t in take]
    # partial temporaries: the block of each device, for the placements that split a dim they reduce
    blocks: dict[tuple[str, int], np.ndarray] = {}
    tmp_axes: dict[str, list[tuple[str, ...]]] = {}
    for tmp in nest.operands():
        if tmp.startswith(("in", "out")) and tmp[3 if tmp.startswith("out") else 2:].isdigit():
            continue
        tmp_axes[tmp] = [_partial_axes(nest, p, tmp) for p in placements]
        rows = [i for i, ax in enumerate(tmp_axes[tmp]) if ax]
        if not rows:
            continue
        keep = [_footprint_axes(nest, placements[i], mesh, tmp, True) for i in rows]
        bounds, sub_take, sub_nv, _reps = _side_by_side([per[i] for i in rows], [placements[i] for i in rows],
                                                        mesh, nest, keep)
        shape = _temporary_shape(nest, tmp)
        region = operand_region(nest, tmp, shape, bounds, writes=True, ndev=sub_nv)
        block, bad = region.counts()
        if bad.any():
            block, bad = _temporary_block(nest, tmp, bounds, block, bad, sub_nv)
        if bad.any():
            for v in np.nonzero(bad)[0]:
                b = {d: (int(lo[v]), int(hi[v])) for d, (lo, hi) in bounds.items()}
                block[v] = count(footprint_set(nest, tmp, shape, b, writes=True))
        for pos, i in enumerate(rows):
            blocks[(tmp, i)] = block[sub_take[pos]]
    # parameter gradients: each device's block of the parameter, all-reduced over the partial axes
    grad_axes: dict[int, list[tuple[str, ...]]] = {}
    needs: dict[tuple[int, int], Distribution] = {}
    for j, t in enumerate(op.inputs):
        if graph.tensors[t].kind is not TensorKind.PARAM:
            continue
        grad_axes[j] = [grad_partial_axes(nest, p, f"in{j}", mesh) for p in placements]
        rows = [i for i, ax in enumerate(grad_axes[j]) if ax]
        if rows:
            for i, d in zip(rows, _op_distributions(graph, op, [placements[i] for i in rows], mesh, f"in{j}", False)):
                needs[(j, i)] = d
    out: dict[Placement, OpComm] = {}
    for i, placement in enumerate(placements):
        forward: list[Collective] = []
        for tmp, axes_per in tmp_axes.items():
            for a in axes_per[i]:
                s = _all_reduce(blocks[(tmp, i)], a, mesh, tmp)
                forward.append(Collective("all-reduce", (a,), tmp, s.payload, s.elements, obytes))
        partial = [(f"out{o}", ax) for o in range(len(op.outputs)) if (ax := _partial_axes(nest, placement, f"out{o}"))]
        grad: list[Collective] = []
        for j, axes_per in grad_axes.items():
            axes_l = axes_per[i]
            if not axes_l:
                continue
            block = needs[(j, i)].counts()
            g = mesh.group_size(axes_l)
            recv = 2 * (g - 1) * (-(-block // g))
            grad.append(Collective("all-reduce", tuple(axes_l), f"in{j}", int(block.max(initial=0)),
                                   int(recv.max(initial=0)), DTYPE_BYTES.get(graph.tensors[op.inputs[j]].dtype, 4)))
        kinds = tuple((d, dim_split_kind(nest, d)) for d in placement.dims)
        pad = tuple(sorted(padding_of(nest, placement, mesh).items()))
        # backward: a partial temporary's gradient is itself partial only where the statements that read the
        # temporary iterate the split dim (softmax / norm: d stats sums over the normalised dim); a sum read
        # pointwise over the other dims (a row-parallel linear's product before its fused bias / residual
        # epilogue) gets the whole gradient on every device, as Megatron's backward of a row-parallel layer
        backward = tuple(c for c in forward if any(placement.dim_of(a) in st.dims for a in c.axes
                                                   for st in nest.statements
                                                   if any(r.operand == c.operand for r in st.reads)))
        out[placement] = OpComm(placement, tuple(forward), tuple(partial), tuple(grad), kinds, pad,
                                flops_max[i], backward)
    return out


def _flop_bounds(nest: LoopNest, per: Sequence[dict], placements: Sequence[Placement],
                 mesh: DeviceMesh) -> tuple[dict, list[np.ndarray | slice], int]:
    """Virtual devices whose statement points have the same maximum as every device's.

    A statement's points on a device are the points of its constrained dims times the
    block lengths of the others (the domain is a product over them), so they grow with
    each unconstrained dim's block length; each mesh axis splits one dim, so a device
    with the longest block of every unconstrained dim at once exists, whatever its
    coordinates along the constrained dims' axes. A placement thus needs one virtual device
    per coordinate of its constrained dims' axes, every other dim at its longest block:
    the maximum over them of the summed flops is the maximum over all devices (exact).
    One placement alone is computed over every device (the reference of the batch)."""
    if len(placements) == 1:
        return per[0], [slice(0, mesh.size)], mesh.size
    linked = _of_nest(nest, ("linked",), lambda: frozenset(d for st in nest.statements for c in st.constraints
                                                           for d in c.dims))
    keep = [tuple(a for d, ax in p.splits if d in linked for a in ax) for p in placements]
    cat, take, nv, reps = _side_by_side(per, placements, mesh, nest, keep)
    sizes = np.array([mesh.size if r is None else len(r) for r in reps], dtype=np.int64)
    out = dict(cat)
    for d in nest.dims:
        if d.name in linked:
            continue
        ends = np.array([_longest_block(mesh, d.extent, p.axes_of(d.name)) for p in placements], dtype=np.int64)
        out[d.name] = (np.repeat(ends[:, 0], sizes), np.repeat(ends[:, 1], sizes))
    return out, take, nv


@lru_cache(maxsize=1 << 14)
def _longest_block(mesh: DeviceMesh, extent: int, axes: tuple[str, ...]) -> tuple[int, int]:
    lo, hi = mesh.bounds(extent, axes)
    j = int(np.argmax(hi - lo))
    return int(lo[j]), int(hi[j])


CACHE.on_clear(_longest_block.cache_clear)


def grad_partial_axes(nest: LoopNest, placement: Placement, operand: str, mesh: DeviceMesh) -> tuple[str, ...]:
    """Mesh axes on which the gradient of input ``operand`` is a partial sum.

    The gradient of a read ``in[f(i)]`` is ``d in[f(i)] += d out(i) * ...``: a statement
    that iterates a split dim absent from ``f`` sums, on every device, only its block of
    that dim; the gradient is Partial on the dim's mesh axes (column-parallel linear:
    ``dx[b, s, k] = sum_n dy[b, s, n] w[n, k]`` with ``n`` split over tp).
    """
    axes: list[str] = []
    for d in _of_nest(nest, ("grad-dims", operand), lambda: _grad_dims(nest, operand)):
        axes += [a for a in placement.axes_of(d) if a not in axes and mesh.axis(a).size > 1]
    return tuple(axes)


def _grad_dims(nest: LoopNest, operand: str) -> tuple[str, ...]:
    """The dims some read of ``operand`` iterates without indexing by, in access order, first
    occurrence kept (a dim's mesh axes are the same wherever it recurs, so the axes keep their order)."""
    dims: dict[str, None] = {}
    for st, acc, is_write in nest.accesses(operand):
        if is_write:
            continue
        for d in st.dims:
            if d not in acc.dims:
                dims.setdefault(d)
    return tuple(dims)


def grad_held(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh, operand: str) -> Distribution:
    """What ``op`` leaves of the gradient of input ``operand``: its read footprint, Partial on
    :func:`grad_partial_axes` (the backward dual of :func:`operand_need`)."""
    need = operand_need(graph, op, placement, mesh, operand)
    axes = grad_partial_axes(op.nest, placement, operand, mesh) if op.nest is not None else ()
    if not axes:
        return need
    return CACHE.get("distribution", ("grad", need.key, axes),
                     lambda: replace(need, partial=axes, key=("grad", need.key, axes)))


def grad_needed(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh, index: int = 0, *,
                reader: tuple[Op, str] | None = None) -> Distribution:
    """What ``op`` needs of the gradient of output ``index`` to run its backward: the block it
    wrote, complete (a Partial output's summands each need the whole gradient of the sum).

    With ``reader=(consumer, operand)``, only the part of that block the reader reads at
    all (its footprint over the whole domain, ``U``): elements no device reads get no
    gradient from this reader, so nothing is sent for them (attention reading the q slice
    of a fused qkv contributes only to q's gradient): ``H(p) ∩ U``.
    """
    out = output_layout(graph, op, placement, mesh, index)
    base = out if not out.partial else CACHE.get(
        "distribution", ("grad-need", out.key), lambda: replace(out, partial=(), key=("grad-need", out.key)))
    if reader is None:
        return base
    u = operand_need(graph, reader[0], Placement(), mesh, reader[1])
    if int(u.counts().min(initial=0)) == math.prod(u.shape):
        return base  # the reader reads the whole tensor
    return CACHE.get("distribution", ("grad-need", base.key, u.key), lambda: _restrict(base, u))


def _restrict(a: Distribution, u: Distribution) -> Distribution:
    """``a(p) ∩ u(p)`` on every device (pieces intersected pairwise; isl where not closed-form)."""
    fallback = a.region.fallback | u.region.fallback
    pieces = []
    disjoint = len(a.region.pieces) == 1 and len(u.region.pieces) == 1
    for p in a.region.pieces:
        for q in u.region.pieces:
            if not disjoint:
                prod, bad = _intersect_products(p, q)
                fallback = fallback | bad
                pieces.append(prod)
                continue
            # one product each: intersect axis by axis; a grid cut by an interval (a block of a
            # head-interleaved axis read by rotate_half) splits into disjoint closed-form pieces
            per_axis: list[list] = []
            for x, y in zip(p, q):
                g, o = (x, y) if isinstance(x, Grid) else (y, x)
                if isinstance(g, Grid) and not isinstance(o, Grid) and bool(((o.normal().step == 1)
                                                                             | (o.n <= 1)).all()):
                    per_axis.append(grid_cut(g, o.normal()))
                else:
                    c, bad = x.intersect(y)
                    fallback = fallback | bad
                    per_axis.append([c])
            pieces.extend(itertools.product(*per_axis))
    full = [all(q[j].same(Prog.interval(np.zeros(a.mesh.size, dtype=np.int64),
                                        np.full(a.mesh.size, n, dtype=np.int64))) for q in u.region.pieces)
            for j, n in enumerate(a.shape)]
    block = tuple(b and f for b, f in zip(a.block, full))
    key = ("restrict", a.key, u.key)
    return Distribution(a.shape, a.mesh, Region(a.shape, pieces, fallback, disjoint), a.deps, block, a.partial, key,
                        lambda p: a.isl_of(p).intersect(u.isl_of(p)), a.boxes + u.boxes)


def backward_reshard_edge(graph: Graph, tensor: str, producer_placement: Placement, consumer: Op,
                          consumer_placement: Placement, mesh: DeviceMesh) -> list[Reshard]:
    """Backward dual of :func:`reshard_edge`: the gradient of ``tensor`` moves from what each of
    ``consumer``'s operands that read it leaves (:func:`grad_held`) to what the producer needs
    (:func:`grad_needed`). A graph input needs no gradient: an empty list."""
    prod = graph.producer(tensor)
    if prod is None:
        return []
    nbytes = DTYPE_BYTES.get(graph.tensors[tensor].dtype, 4)
    out = []
    for i, t in enumerate(consumer.inputs):
        if t == tensor:
            need = grad_needed(graph, prod, producer_placement, mesh, prod.outputs.index(tensor),
                               reader=(consumer, f"in{i}"))
            out.append(reshard(grad_held(graph, consumer, consumer_placement, mesh, f"in{i}"), need, mesh,
                               dtype_bytes=nbytes))
    return out


def _temporary_block(nest: LoopNest, tmp: str, bounds, block: np.ndarray, bad: np.ndarray,
                     ndev: int) -> tuple[np.ndarray, np.ndarray]:
    """Count a temporary written as ``tmp[d1, .., dk]`` (plain dims) by a constrained statement:
    its block is the domain projected onto ``d1..dk``, i.e. the points of the statement
    restricted to those dims when every constraint lives on them (attention scores)."""
    writers = [(st, w) for st in nest.statements for w in st.writes if w.operand == tmp]
    if len(writers) != 1:
        return block, bad
    st, w = writers[0]
    plain = [e.dims[0] for e in w.index if e is not ANY and len(e.terms) == 1 and e.terms[0][1] == 1
             and e.const == 0]
    if len(plain) != len(w.index) or len(set(plain)) != len(plain) or \
            any(not set(c.dims) <= set(plain) for c in st.constraints):
        return block, bad
    sub = Statement(st.name, tuple(plain), reads=(), writes=(w,), constraints=st.constraints)
    return np.where(bad, _points(nest, sub, bounds, ndev), block), np.zeros_like(bad)


def _temporary_shape(nest: LoopNest, tmp: str) -> Shape:
    """Extent of each axis of a temporary: one past the largest index any access reaches."""
    shape: list[int] | None = None
    for _st, acc, _w in nest.accesses(tmp):
        ext = []
        for e in acc.index:
            if e is ANY:
                raise ValueError(f"temporary {tmp!r} is indexed by a data-dependent index")
            ext.append(1 + e.const + sum(max(k, 0) * (nest.dim(d).extent - 1) for d, k in e.terms))
        shape = ext if shape is None else [max(a, b) for a, b in zip(shape, ext)]
    return tuple(shape or ())


def _points(nest: LoopNest, st, bounds, ndev: int) -> np.ndarray:
    """Domain points of the statement on each device (exact).

    Unconstrained: the box volume. One constraint ``cx x + cy y + c0 >= 0`` with unit
    coefficients (a causal mask, a scan): for each ``x`` the admissible ``y`` of
    ``[c, d)`` number ``clip(cx x + m, 0, d - c)`` (``m = c0 + 1 - c`` when ``cy = -1``,
    ``c0 + d`` when ``cy = 1``), and the sum over ``x`` of a clipped linear function is
    closed-form (:func:`_sum_clip`). Anything else: isl, once per distinct device box.
    """
    box = np.ones(ndev, dtype=np.int64)
    for d in st.dims:
        lo, hi = bounds[d]
        box = box * np.maximum(hi - lo, 0)
    if not st.constraints:
        return box
    if len(st.constraints) == 1 and len(st.constraints[0].terms) == 2 and \
            all(abs(k) == 1 for _, k in st.constraints[0].terms):
        c = st.constraints[0]
        (x, cx), (y, cy) = c.terms
        a, b = bounds[x]
        lo_y, hi_y = bounds[y]
        width = np.maximum(hi_y - lo_y, 0)
        m = c.const + 1 - lo_y if cy == -1 else c.const + hi_y
        if cx == 1:
            pairs = _sum_clip(a + m, b + m, width)
        else:
            pairs = _sum_clip(m - b + 1, m - a + 1, width)
        rest = box // np.maximum((b - a) * width, 1)
        return np.where((b > a) & (width > 0), pairs * rest, 0)
    keys = np.stack([np.stack(bounds[d]) for d in st.dims]).reshape(-1, ndev).T
    out = np.zeros(ndev, dtype=np.int64)
    seen: dict[bytes, int] = {}
    for p in range(ndev):
        k = keys[p].tobytes()
        if k not in seen:
            b = {d: (int(bounds[d][0][p]), int(bounds[d][1][p])) for d in st.dims}
            seen[k] = count(domain_set(nest, st, b))
        out[p] = seen[k]
    return out


def _sum_clip(lo: np.ndarray, hi: np.ndarray, top: np.ndarray) -> np.ndarray:
    """``sum_{u=lo}^{hi-1} min(max(u, 0), top)`` elementwise."""
    a = np.maximum(lo, 0)
    b = np.minimum(hi, top + 1)
    n = np.maximum(b - a, 0)
    linear = n * (a + b - 1) // 2  # sum of u over [a, b)
    flat = np.maximum(hi - np.maximum(lo, top + 1), 0) * top
    return linear + flat
