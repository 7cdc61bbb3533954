"""Exact communication: what each device holds and needs, collectives inside an op, resharding.

Notation: device ``p``; ``H_T(p)`` the elements of tensor ``T`` that the producer's
placement leaves on ``p`` (its write footprint); ``N_T(p)`` the consumer's read
footprint. The data ``p`` must receive is ``N_T(p) \\ H_T(p)``, counted exactly
(``|N| - |N ∩ H|``, products of per-axis progressions, isl where that is not closed-form).

**Inside an op** (:func:`comm_of_op`): a statement that reduces a split dim leaves
partial sums on the mesh axes of that dim. Into a temporary (softmax/norm statistics,
attention scores) it needs an all-reduce of ``p``'s block of the temporary before the
statements that read it; into an output it leaves the output *Partial* on those axes
for the reshard to finish. For training, a parameter read by a statement that iterates
split dims absent from the parameter's index gets partial gradients on their mesh axes:
an all-reduce of ``p``'s block of the parameter (data parallel: the parameter count).

**Resharding** (:func:`reshard`): the route from a producer's distribution to a
consumer's need, one mesh axis at a time, for a block layout ``H`` and need ``N``
(``h(a)``/``n(a)``: the tensor axis that ``H``/``N`` splits on mesh axis ``a``):

1. partial on ``a``: reduce-scatter onto ``n(a)`` when ``N`` splits along ``a``,
   all-reduce otherwise;
2. ``h(a) = -``, ``n(a) = j``: local slice (free: ``a`` splits the held block innermost);
3. ``h(a) = i``, ``n(a) = j != i``: all-to-all over ``a``;
4. ``h(a) = i``, ``n(a) = -``: all-gather over ``a``;
5. what ``N(p)`` still lacks after that is a **halo** when ``N`` extends ``p``'s block
   along the same mesh axes (convolution windows), else **p2p** (irregular needs, or the
   same mesh axes in another order: a device permutation).

Each step is priced exactly as the elements ``p`` gains: ``|B'(p) \\ B(p)|`` for
gathers, all-to-all and halos, ``(n-1)|B'(p)|`` for a reduce-scatter over ``n`` devices
(``p`` receives its shard from every peer) and ``2(n-1)ceil(|B(p)|/n)`` for a ring
all-reduce. A route of several steps is the multi-step reshard; ``direct_elements`` is
the exact lower bound ``max_p |N(p) \\ H(p)|`` a single point-to-point exchange needs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

import islpy as isl
import numpy as np

from polyparallel.ir import ANY, DTYPE_BYTES, Graph, LoopNest, Op, Shape, TensorKind

from ._cache import CACHE
from ._cache import signature_of as _signature
from ._footprint import _AXIS_MEMO, Prog, Region, axis_key, dim_bounds, layout_region, operand_region
from ._isl import count, footprint_set, tensor_box
from ._mesh import DeviceMesh
from ._placement import Placement, check_placement, dim_split_kind, padding_of

__all__ = [
    "Collective",
    "Distribution",
    "EdgeCosts",
    "OpComm",
    "Reshard",
    "Step",
    "TensorLayout",
    "backward_reshard_edge",
    "comm_of_op",
    "edge_costs",
    "grad_held",
    "grad_needed",
    "grad_partial_axes",
    "layout_distribution",
    "operand_need",
    "output_layout",
    "reshard",
    "reshard_edge",
]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A block layout of a tensor: axis ``i`` split over mesh axes ``shards[i]``, Partial on ``partial``.

    ``str`` is ``S(0)@dp,S(2)@tp,P@pp`` (``R`` when replicated); :meth:`dtensor` gives
    DTensor's per-mesh-axis form.

    Examples:
        >>> lay = TensorLayout((8, 16), (("dp",), ()), partial=("tp",))
        >>> str(lay), lay.dtensor(DeviceMesh.of(dp=2, tp=2))
        ('S(0)@dp,P@tp', ('S(0)', 'P'))
    """

    shape: Shape
    shards: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.shards) != len(self.shape):
            raise ValueError(f"layout of shape {list(self.shape)} needs {len(self.shape)} shard entries, "
                             f"got {len(self.shards)}")
        used = [a for s in self.shards for a in s] + list(self.partial)
        if len(set(used)) != len(used):
            raise ValueError(f"layout {self}: a mesh axis is used twice")

    @classmethod
    def replicated(cls, shape: Sequence[int]) -> TensorLayout:
        return cls(tuple(shape), tuple(() for _ in shape))

    @classmethod
    def sharded(cls, shape: Sequence[int], partial: Sequence[str] = (), **axis_by_mesh: int) -> TensorLayout:
        """``TensorLayout.sharded((8, 16), dp=0, tp=1)``: mesh axis -> tensor axis."""
        shards: list[list[str]] = [[] for _ in shape]
        for a, i in axis_by_mesh.items():
            shards[i].append(a)
        return cls(tuple(shape), tuple(tuple(s) for s in shards), tuple(partial))

    def dtensor(self, mesh: DeviceMesh) -> tuple[str, ...]:
        out = []
        for a in mesh.names:
            i = next((i for i, s in enumerate(self.shards) if a in s), None)
            out.append("P" if a in self.partial else "R" if i is None else f"S({i})")
        return tuple(out)

    def __str__(self) -> str:
        parts = [f"S({i})@{'+'.join(s)}" for i, s in enumerate(self.shards) if s]
        if self.partial:
            parts.append(f"P@{'+'.join(self.partial)}")
        return ",".join(parts) or "R"


@dataclass(frozen=True, eq=False)
class Distribution:
    """What every device holds (a producer) or needs (a consumer) of one tensor.

    ``deps[i]``: mesh axes the footprint along tensor axis ``i`` depends on (outermost
    first); ``block[i]``: the footprint along ``i`` is exactly the block distribution
    over ``deps[i]``; ``layout``: the :class:`TensorLayout` when every axis is a block.
    """

    shape: Shape
    mesh: DeviceMesh
    region: Region
    deps: tuple[tuple[str, ...], ...]
    block: tuple[bool, ...]
    partial: tuple[str, ...]
    key: tuple
    isl_of: Callable[[int], isl.Set] = field(repr=False)
    boxes: tuple[np.ndarray, ...] = field(repr=False, default=())  # (2, ndev) bounds the sets depend on

    @cached_property
    def box_of(self) -> np.ndarray:
        """An id per device, equal for devices whose sets are equal (only needed for isl fallbacks)."""
        return _box_ids(list(self.boxes), self.mesh.size)

    @cached_property
    def reshard_key(self) -> tuple:
        """Cache key of the set each device holds: the layout when it is one (shared by every
        op that leaves or needs that layout), else a digest of the per-device sets when the
        region describes every device exactly (placements that differ only in dims the operand
        does not index need the same data), else the op-level key."""
        lay = self.layout
        if lay is not None:
            return ("layout", lay, self.mesh)
        if self.region.pieces and not self.region.fallback.any():
            content = tuple(tuple(axis_key(a) for a in piece) for piece in self.region.pieces)
            return ("sets", self.shape, content, self.deps, self.block, self.partial, self.mesh)
        return self.key

    @cached_property
    def rid(self) -> int:
        """A small int standing for :attr:`reshard_key` (equal keys, equal ids while the cache
        lives; ids are never reused), so cache keys hash a few ints instead of long tuples."""
        key = self.reshard_key
        rid = _RIDS.get(key)
        if rid is None:
            rid = _RIDS[key] = next(_RID_COUNTER)
        return rid

    @cached_property
    def layout(self) -> TensorLayout | None:
        if not all(self.block) or len(_unique_pieces(self.region)) != 1:
            return None
        return TensorLayout(self.shape, self.deps, self.partial)

    def counts(self) -> np.ndarray:
        """Exact elements on each device."""
        return self._counts

    @cached_property
    def _counts(self) -> np.ndarray:
        c, bad = self.region.counts()
        done: dict[int, int] = {}
        for p in np.nonzero(bad)[0]:
            k = int(self.box_of[p])
            if k not in done:
                done[k] = count(self.isl_of(int(p)))
            c[p] = done[k]
        return c

    def common(self, other: Distribution) -> np.ndarray:
        """Exact ``|self(p) ∩ other(p)|`` for each device ``p``."""
        return CACHE.get("common", (self.rid, other.rid), lambda: self._common(other))

    def _common(self, other: Distribution) -> np.ndarray:
        c, bad = self.region.intersect_counts(other.region)
        done: dict[tuple[int, int], int] = {}
        for p in np.nonzero(bad)[0]:
            k = (int(self.box_of[p]), int(other.box_of[p]))
            if k not in done:
                done[k] = count(self.isl_of(int(p)).intersect(other.isl_of(int(p))))
            c[p] = done[k]
        return c

    def missing(self, have: Distribution) -> np.ndarray:
        """Exact ``|self(p) \\ have(p)|``: what ``p`` must receive."""
        return self.counts() - self.common(have)

    def __str__(self) -> str:
        return self._str

    @cached_property
    def _str(self) -> str:
        lay = self.layout
        return str(lay) if lay is not None else f"irregular{[list(d) for d in self.deps]}"


_RIDS: dict[tuple, int] = {}
_RID_COUNTER = itertools.count()


def _box_ids(boxes: list[np.ndarray], ndev: int) -> np.ndarray:
    """An id per device, equal for devices whose (lo, hi) bounds are all equal."""
    if not boxes:
        return np.zeros(ndev, dtype=np.int64)
    rows = np.concatenate([b.reshape(2, ndev) for b in boxes], axis=0).T
    return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _unique_pieces(region: Region) -> list:
    uniq: list = []
    for p in region.pieces:
        if not any(all(a.same(b) for a, b in zip(p, q)) for q in uniq):
            uniq.append(p)
    return uniq


def layout_distribution(layout: TensorLayout, mesh: DeviceMesh) -> Distribution:
    """The :class:`Distribution` of a block layout."""
    for a in [x for s in layout.shards for x in s] + list(layout.partial):
        mesh.axis(a)

    def make() -> Distribution:
        region = layout_region(layout.shape, layout.shards, mesh)

        def isl_of(p: int) -> isl.Set:
            idx = [f"i{j}" for j in range(len(layout.shape))]
            cons = []
            for j, s in enumerate(layout.shards):
                lo, hi = mesh.bounds(layout.shape[j], s)
                cons.append(f"{int(lo[p])} <= i{j} < {int(hi[p])}")
            return isl.Set(f"{{ T[{', '.join(idx)}] : {' and '.join(cons) or 'true'} }}")

        boxes = [np.stack(mesh.bounds(n, s)) for n, s in zip(layout.shape, layout.shards)]
        return Distribution(tuple(layout.shape), mesh, region, layout.shards,
                            tuple(True for _ in layout.shape), layout.partial,
                            ("layout", layout, mesh), isl_of, tuple(boxes))

    return CACHE.get("distribution", ("layout", layout, mesh), make)


def _operand_shape(graph: Graph, op: Op, operand: str) -> Shape:
    name = op.operand_name(operand)
    if name is None:
        raise ValueError(f"op {op.name!r} has no operand {operand!r} (inputs {list(op.inputs)}, "
                         f"outputs {list(op.outputs)})")
    return graph.shape(name)


def _op_distribution(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh, operand: str,
                     writes: bool) -> Distribution:
    key = ("op", _signature(graph, op), placement, mesh, operand, writes)

    def make() -> Distribution:
        shape = _operand_shape(graph, op, operand)
        nest = op.nest
        if nest is None:
            region = layout_region(shape, tuple(() for _ in shape), mesh)
            return Distribution(shape, mesh, region, tuple(() for _ in shape), tuple(True for _ in shape), (),
                                key, lambda p: tensor_box("T", shape))
        check_placement(nest, placement, mesh, op=op.name)
        bounds = dim_bounds(nest, placement, mesh)
        region = operand_region(nest, operand, shape, bounds, writes=writes, ndev=mesh.size)
        deps: list[list[str]] = [[] for _ in shape]
        for _st, acc, is_write in nest.accesses(operand):
            if is_write != writes:
                continue
            for j, e in enumerate(acc.index):
                if e is ANY:
                    continue
                for d, _c in sorted(e.terms, key=lambda t: -abs(t[1])):
                    for a in placement.axes_of(d):
                        if a not in deps[j]:
                            deps[j].append(a)
        block = []
        for j, n in enumerate(shape):
            expect = Prog.interval(*mesh.bounds(n, tuple(deps[j])))
            block.append(bool(region.pieces) and all(pc[j].same(expect) for pc in region.pieces))
        partial = _partial_axes(nest, placement, operand) if writes else ()

        def isl_of(p: int) -> isl.Set:
            b = {d: (int(lo[p]), int(hi[p])) for d, (lo, hi) in bounds.items()}
            return footprint_set(nest, operand, shape, b, writes=writes).set_tuple_name("T")

        boxes = [np.stack(b) for b in bounds.values()]
        return Distribution(tuple(shape), mesh, region, tuple(tuple(d) for d in deps), tuple(block), partial,
                            key, isl_of, tuple(boxes))

    return CACHE.get("distribution", key, make)


def _partial_axes(nest: LoopNest, placement: Placement, operand: str) -> tuple[str, ...]:
    axes: list[str] = []
    for st in nest.statements:
        if not any(w.operand == operand for w in st.writes):
            continue
        for d in st.reduction_dims():
            axes += [a for a in placement.axes_of(d) if a not in axes]
    return tuple(axes)


def output_layout(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh, index: int = 0) -> Distribution:
    """What ``op`` under ``placement`` leaves on each device of output ``index`` (with Partial axes)."""
    return _op_distribution(graph, op, placement, mesh, f"out{index}", True)


def operand_need(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh, operand: str) -> Distribution:
    """What ``op`` under ``placement`` reads of input ``operand`` (``in0``, ``in1``, ...) on each device."""
    return _op_distribution(graph, op, placement, mesh, operand, False)


# -- resharding -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Step:
    """One collective of a reshard route.

    ``elements``: max over devices of the elements a device receives in it (exact, see
    the module docstring); ``total``: summed over devices; ``payload``: max per-device
    buffer the collective operates on; ``group``: devices per collective group.
    """

    kind: str  # all-reduce | reduce-scatter | all-gather | all-to-all | halo | p2p
    axes: tuple[str, ...]
    tensor_axis: int | None
    elements: int
    total: int
    payload: int
    group: int

    def __str__(self) -> str:
        on = f" dim {self.tensor_axis}" if self.tensor_axis is not None else ""
        return f"{self.kind}[{'+'.join(self.axes)}]{on}: {self.elements} el/device"


@dataclass(frozen=True, slots=True)
class Reshard:
    """Cost of moving a tensor from a producer's distribution to a consumer's need."""

    have: str
    need: str
    steps: tuple[Step, ...]
    direct_elements: int
    dtype_bytes: int

    @property
    def kind(self) -> str:
        return "+".join(s.kind for s in self.steps) or "none"

    @property
    def elements(self) -> int:
        """Elements received per device along the route (sum over steps of the per-step maximum)."""
        return sum(s.elements for s in self.steps)

    @property
    def volume_bytes_per_device(self) -> int:
        return self.elements * self.dtype_bytes

    def __str__(self) -> str:
        route = "; ".join(map(str, self.steps)) or "nothing to move"
        return f"{self.have} -> {self.need}: {route}"


def _as_distribution(x: Distribution | TensorLayout, mesh: DeviceMesh) -> Distribution:
    return x if isinstance(x, Distribution) else layout_distribution(x, mesh)


def reshard(have: Distribution | TensorLayout, need: Distribution | TensorLayout, mesh: DeviceMesh, *,
            dtype_bytes: int = 4) -> Reshard:
    """Route and exact cost from ``have`` (a producer's output) to ``need`` (a consumer's read).

    Examples:
        >>> m = DeviceMesh.of(tp=4)
        >>> r = reshard(TensorLayout((8, 16), ((), ()), ("tp",)), TensorLayout.replicated((8, 16)), m)
        >>> r.kind, r.elements        # ring all-reduce: 2 (n-1) ceil(128 / n)
        ('all-reduce', 192)
    """
    h, n = _as_distribution(have, mesh), _as_distribution(need, mesh)
    if h.shape != n.shape:
        raise ValueError(f"reshard between shapes {list(h.shape)} and {list(n.shape)}")
    if n.partial:
        raise ValueError(f"a consumer cannot need partial sums ({n})")
    return CACHE.get("reshard", (h.rid, n.rid, dtype_bytes),
                     lambda: _reshard(h, n, mesh, dtype_bytes))


def _reshard(h: Distribution, n: Distribution, mesh: DeviceMesh, dtype_bytes: int) -> Reshard:
    steps: list[Step] = []
    lay = h.layout
    if lay is None:
        # an irregular producer: settle partial sums in place, then one exchange of what is missing
        miss = n.missing(h)
        direct = int(miss.max(initial=0))
        for a in h.partial:
            steps.append(_all_reduce(h.counts(), a, mesh, None))
        if direct:
            steps.append(Step("p2p", tuple(sorted({x for d in n.deps for x in d} | {x for d in h.deps for x in d})),
                              None, direct, int(miss.sum()), int(n.counts().max()), 0))
        return Reshard(str(h), str(n), tuple(steps), direct, dtype_bytes)

    # steps 1-4 depend only on the layouts' shards and the need's mesh axes per tensor axis, and
    # step 5 only on (need, final layout): both are memoised, so the ~10^4 pairs of an edge
    # reduce to a few hundred routes and final exchanges
    shape = h.shape
    need_lay = n.layout
    steps_14, cur = _route(shape, lay.shards, lay.partial, n.deps, mesh)
    steps = list(steps_14)
    if need_lay is not None:
        direct = _gain(shape, need_lay.shards, lay.shards, mesh)[0]
        most, total, payload = _gain(shape, need_lay.shards, cur, mesh)
    else:
        direct = _missing_stats(n, lay.shards)[0]
        most, total, payload = _missing_stats(n, cur)
    if most:
        irregular = [i for i, b in enumerate(n.block) if not b]
        halo = bool(irregular) and all(n.deps[i] and set(n.deps[i]) == set(cur[i]) for i in irregular)
        axes = tuple(a for i in irregular for a in n.deps[i]) if halo else tuple(mesh.names)
        steps.append(Step("halo" if halo else "p2p", axes, irregular[0] if len(irregular) == 1 else None,
                          most, total, payload, 2 if halo else mesh.size))
    return Reshard(str(h), str(n), tuple(steps), direct, dtype_bytes)


def _missing_stats(n: Distribution, held: Shards) -> tuple[int, int, int]:
    """(max, total over devices) of ``|n(p) \\ held(p)|`` and ``max |n(p)|``, memoised per (need, layout)."""
    def make() -> tuple[int, int, int]:
        left = n.missing(layout_distribution(TensorLayout(n.shape, held), n.mesh))
        return int(left.max(initial=0)), int(left.sum()), int(n.counts().max(initial=0))

    return CACHE.get("missing", (n.rid, held), make)


@lru_cache(maxsize=1 << 16)
def _route(shape: Shape, plain: Shards, partial: tuple[str, ...], deps: Shards,
           mesh: DeviceMesh) -> tuple[tuple[Step, ...], Shards]:
    """Steps 1-4 of the route (module docstring) and the layout they end in."""
    steps: list[Step] = []
    shards = [list(x) for x in plain]
    need_axis = {a: i for i, d in enumerate(deps) for a in d}
    cur: Shards = plain

    def move(kind: str, axes: tuple[str, ...], axis: int | None) -> None:
        nonlocal cur
        nxt = tuple(tuple(x) for x in shards)
        if kind != "slice":
            most, total, payload = _gain(shape, nxt, cur, mesh)
            steps.append(Step(kind, axes, axis, most, total, payload, mesh.group_size(axes)))
        cur = nxt

    # 1. partial sums: reduce-scatter onto the axis the consumer splits on that mesh axis, else all-reduce
    for a in partial:
        j = need_axis.get(a)
        g = mesh.axis(a).size
        if j is not None:
            shards[j] = [*shards[j], a]  # innermost: each device keeps a piece of the block it summed
            nxt = tuple(tuple(x) for x in shards)
            before_max = _block_stats(shape, cur, mesh)[0]
            mine_max, mine_sum = _block_stats(shape, nxt, mesh)
            steps.append(Step("reduce-scatter", (a,), j, (g - 1) * mine_max, (g - 1) * mine_sum, before_max, g))
            cur = nxt
        else:
            steps.append(_all_reduce_of(shape, cur, a, mesh))

    have_axis = {a: i for i, x in enumerate(shards) for a in x}
    # 2. free local slices first: they shrink every later message
    for a in mesh.names:
        if a not in have_axis and a in need_axis:
            j = need_axis[a]
            shards[j] = [*shards[j], a]  # innermost, so the slice lies inside the block held
            move("slice", (a,), j)
    # 3. all-to-all where the split moves to another tensor axis
    for a in mesh.names:
        if a in have_axis and a in need_axis and have_axis[a] != need_axis[a]:
            i, j = have_axis[a], need_axis[a]
            shards[i] = [x for x in shards[i] if x != a]
            shards[j] = _ordered([*shards[j], a], deps[j])
            move("all-to-all", (a,), j)
    # 4. all-gather where the consumer does not split along the mesh axis
    gather = [a for a in mesh.names if a in have_axis and a not in need_axis]
    for i in sorted({have_axis[a] for a in gather}):
        axes = tuple(a for a in gather if have_axis[a] == i)
        shards[i] = [x for x in shards[i] if x not in axes]
        move("all-gather", axes, i)
    return tuple(steps), cur


Shards = tuple[tuple[str, ...], ...]


@lru_cache(maxsize=1 << 16)
def _even_blocks(shape: Shape, shards: Shards, mesh: DeviceMesh) -> tuple[int, ...] | None:
    """Block extents when every device's block is the same (even mesh, divisible extents)."""
    if not mesh.even:
        return None
    out = []
    for n, s in zip(shape, shards):
        k = mesh.group_size(s)
        if n % k:
            return None
        out.append(n // k)
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def _block_stats(shape: Shape, shards: Shards, mesh: DeviceMesh) -> tuple[int, int]:
    """(max, sum) over devices of the block size of a layout."""
    blocks = _even_blocks(shape, shards, mesh)
    if blocks is not None:
        b = math.prod(blocks)
        return b, b * mesh.size
    c = _block_counts(shape, shards, mesh)
    return int(c.max(initial=0)), int(c.sum())


def _block_counts(shape: Shape, shards: Shards, mesh: DeviceMesh) -> np.ndarray:
    blocks = _even_blocks(shape, shards, mesh)
    if blocks is not None:
        return np.full(mesh.size, math.prod(blocks), dtype=np.int64)
    return layout_distribution(TensorLayout(shape, shards), mesh).counts()


@lru_cache(maxsize=1 << 16)
def _all_reduce_of(shape: Shape, shards: Shards, axis: str, mesh: DeviceMesh) -> Step:
    """Ring all-reduce over ``axis`` of each device's block of the layout ``shards``."""
    blocks = _even_blocks(shape, shards, mesh)
    if blocks is None:
        return _all_reduce(_block_counts(shape, shards, mesh), axis, mesh, None)
    g = mesh.axis(axis).size
    b = math.prod(blocks)
    recv = 2 * (g - 1) * (-(-b // g))
    return Step("all-reduce", (axis,), None, recv, recv * mesh.size, b, g)


@lru_cache(maxsize=1 << 16)
def _gain(shape: Shape, nxt: Shards, cur: Shards, mesh: DeviceMesh) -> tuple[int, int, int]:
    """(max, total over devices, max block) of ``|nxt(p) \\ cur(p)|``.

    Closed form when both layouts have equal blocks on every device and, along every
    tensor axis, one list of mesh axes is a prefix of the other: the finer block then
    lies inside the coarser one of the same device, so the overlap is the smaller block.
    Otherwise the exact per-device count.
    """
    bn, bc = _even_blocks(shape, nxt, mesh), _even_blocks(shape, cur, mesh)
    if bn is not None and bc is not None and all(a[:len(b)] == b or b[:len(a)] == a for a, b in zip(nxt, cur)):
        size = math.prod(bn)
        g = size - math.prod(min(x, y) for x, y in zip(bn, bc))
        return g, g * mesh.size, size
    nd, cd = layout_distribution(TensorLayout(shape, nxt), mesh), layout_distribution(TensorLayout(shape, cur), mesh)
    gained = nd.missing(cd)
    return int(gained.max(initial=0)), int(gained.sum()), int(nd.counts().max(initial=0))


CACHE.on_clear(_AXIS_MEMO.clear, _RIDS.clear, _route.cache_clear, _even_blocks.cache_clear, _block_stats.cache_clear,
               _all_reduce_of.cache_clear, _gain.cache_clear)


def _ordered(axes: list[str], reference: Sequence[str]) -> list[str]:
    ref = [a for a in reference if a in axes]
    return ref + [a for a in axes if a not in ref]


def _all_reduce(block: np.ndarray, axis: str, mesh: DeviceMesh, operand: str | None) -> Step:
    g = mesh.axis(axis).size
    recv = 2 * (g - 1) * (-(-block // g))
    return Step("all-reduce", (axis,), None, int(recv.max(initial=0)), int(recv.sum()),
                int(block.max(initial=0)), g)


def reshard_edge(graph: Graph, tensor: str, producer_placement: Placement, consumer: Op,
                 consumer_placement: Placement, mesh: DeviceMesh) -> list[Reshard]:
    """Reshards of ``tensor`` from its producer (or a replicated graph input) into each of
    ``consumer``'s operands that read it."""
    prod = graph.producer(tensor)
    if prod is None:
        have: Distribution | TensorLayout = TensorLayout.replicated(graph.shape(tensor))
    else:
        have = output_layout(graph, prod, producer_placement, mesh, prod.outputs.index(tensor))
    nbytes = DTYPE_BYTES.get(graph.tensors[tensor].dtype, 4)
    out = []
    for i, t in enumerate(consumer.inputs):
        if t == tensor:
            need = operand_need(graph, consumer, consumer_placement, mesh, f"in{i}")
            out.append(reshard(have, need, mesh, dtype_bytes=nbytes))
    return out


# -- communication inside an op ---------------------------------------------------------------
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
    def grad_bytes(self) -> int:
        return sum(c.bytes for c in self.grad)

    @property
    def backward_bytes(self) -> int:
        return sum(c.bytes for c in self.backward)


def comm_of_op(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh) -> OpComm:
    """Collectives ``op`` needs under ``placement`` (raises IllegalPlacement when it is not legal)."""
    key = (_signature(graph, op), placement, mesh)
    return CACHE.get("op_comm", key, lambda: _comm_of_op(graph, op, placement, mesh))


def _comm_of_op(graph: Graph, op: Op, placement: Placement, mesh: DeviceMesh) -> OpComm:
    nest = op.nest
    check_placement(nest, placement, mesh, op=op.name)
    if nest is None:
        return OpComm(placement, (), (), (), (), (), float(op.flops))
    out_dtype = graph.tensors[op.outputs[0]].dtype if op.outputs else "float32"
    obytes = DTYPE_BYTES.get(out_dtype, 4)
    bounds = dim_bounds(nest, placement, mesh)
    ndev = mesh.size
    forward: list[Collective] = []
    partial: list[tuple[str, tuple[str, ...]]] = []
    flops = np.zeros(ndev)
    for st in nest.statements:
        flops += _points(nest, st, bounds, ndev) * st.flops_per_point
    for tmp in nest.operands():
        if tmp.startswith(("in", "out")) and tmp[3 if tmp.startswith("out") else 2:].isdigit():
            continue
        axes = _partial_axes(nest, placement, tmp)
        if axes:
            shape = _temporary_shape(nest, tmp)
            region = operand_region(nest, tmp, shape, bounds, writes=True, ndev=ndev)
            block, bad = region.counts()
            if bad.any():
                block, bad = _temporary_block(nest, tmp, bounds, block, bad, ndev)
            if bad.any():
                for p in np.nonzero(bad)[0]:
                    b = {d: (int(lo[p]), int(hi[p])) for d, (lo, hi) in bounds.items()}
                    block[p] = count(footprint_set(nest, tmp, shape, b, writes=True))
            for a in axes:
                s = _all_reduce(block, a, mesh, tmp)
                forward.append(Collective("all-reduce", (a,), tmp, s.payload, s.elements, obytes))
    for i in range(len(op.outputs)):
        axes = _partial_axes(nest, placement, f"out{i}")
        if axes:
            partial.append((f"out{i}", axes))
    grad: list[Collective] = []
    for i, t in enumerate(op.inputs):
        spec = graph.tensors[t]
        if spec.kind is not TensorKind.PARAM:
            continue
        operand = f"in{i}"
        axes_l = grad_partial_axes(nest, placement, operand, mesh)
        if not axes_l:
            continue
        need = operand_need(graph, op, placement, mesh, operand)
        block = need.counts()
        g = mesh.group_size(axes_l)
        recv = 2 * (g - 1) * (-(-block // g))
        grad.append(Collective("all-reduce", tuple(axes_l), operand, int(block.max(initial=0)),
                               int(recv.max(initial=0)), DTYPE_BYTES.get(spec.dtype, 4)))
    kinds = tuple((d, dim_split_kind(nest, d)) for d in placement.dims)
    pad = tuple(sorted(padding_of(nest, placement, mesh).items()))
    return OpComm(placement, tuple(forward), tuple(partial), tuple(grad), kinds, pad, float(flops.max(initial=0)),
                  tuple(forward))


def grad_partial_axes(nest: LoopNest, placement: Placement, operand: str, mesh: DeviceMesh) -> tuple[str, ...]:
    """Mesh axes on which the gradient of input ``operand`` is a partial sum.

    The gradient of a read ``in[f(i)]`` is ``d in[f(i)] += d out(i) * ...``: a statement
    that iterates a split dim absent from ``f`` sums, on every device, only its block of
    that dim; the gradient is Partial on the dim's mesh axes (column-parallel linear:
    ``dx[b, s, k] = sum_n dy[b, s, n] w[n, k]`` with ``n`` split over tp).
    """
    axes: list[str] = []
    for st, acc, is_write in nest.accesses(operand):
        if is_write:
            continue
        for d in st.dims:
            if d not in acc.dims:
                axes += [a for a in placement.axes_of(d) if a not in axes and mesh.axis(a).size > 1]
    return tuple(axes)


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
    from ._footprint import Grid, _intersect_products, grid_cut

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
    from polyparallel.ir import Statement

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
    from ._isl import domain_set

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


# -- pricing every producer x consumer placement pair of an edge --------------------------------
@dataclass(frozen=True, eq=False)
class EdgeCosts:
    """Reshard costs of one graph edge for every (producer placement, consumer placement) pair.

    Placements that leave (or need) the same distribution share a row (column):
    ``cost(i, j) = reshards[have_of[i]][need_of[j]]``. ``bytes`` is the matrix of bytes
    received per device along the route, indexed like ``reshards``.

    The backward pass moves the gradient the other way (:func:`backward_reshard_edge`):
    ``backward_cost(i, j) = backward[grad_have_of[j]][grad_need_of[i]]``, priced on first
    use (forward-only callers pay nothing for it). A graph input needs no gradient.
    """

    producer_placements: tuple[Placement, ...]
    consumer_placements: tuple[Placement, ...]
    have_of: np.ndarray
    need_of: np.ndarray
    reshards: tuple[tuple[Reshard, ...], ...]
    _backward: Callable[[], tuple[np.ndarray, np.ndarray, tuple[tuple[Reshard, ...], ...]]] | None = \
        field(default=None, repr=False)

    @cached_property
    def _backward_tables(self) -> tuple[np.ndarray, np.ndarray, tuple[tuple[Reshard, ...], ...]]:
        if self._backward is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), ()
        return self._backward()

    @property
    def backward(self) -> tuple[tuple[Reshard, ...], ...]:
        """Distinct backward reshards: rows by consumer gradient class, columns by producer need class."""
        return self._backward_tables[2]

    def backward_cost(self, i: int, j: int) -> Reshard | None:
        """Gradient reshard for producer placement ``i`` and consumer placement ``j`` (None: no gradient)."""
        grad_have_of, grad_need_of, table = self._backward_tables
        if not table:
            return None
        return table[int(grad_have_of[j])][int(grad_need_of[i])]

    @property
    def bytes(self) -> np.ndarray:
        return np.array([[r.volume_bytes_per_device for r in row] for row in self.reshards], dtype=np.int64)

    def cost(self, i: int, j: int) -> Reshard:
        return self.reshards[int(self.have_of[i])][int(self.need_of[j])]

    @property
    def pairs(self) -> int:
        return len(self.producer_placements) * len(self.consumer_placements)



def _distinct(placements: Sequence[Any], dist_of: Callable[[Any], Any]) -> tuple[np.ndarray, list[Any]]:
    """The distinct distributions ``dist_of(p)`` over ``placements`` (by :func:`_dedupe_key`), in
    first-seen order, and for each placement the index of its distribution among them."""
    index: dict = {}
    of = np.zeros(len(placements), dtype=np.int64)
    for i, p in enumerate(placements):
        d = dist_of(p)
        of[i] = index.setdefault(_dedupe_key(d), (len(index), d))[0]
    return of, [d for _, d in index.values()]


def edge_costs(graph: Graph, tensor: str, consumer: Op, operand: str, mesh: DeviceMesh,
               producer_placements: Sequence[Placement] | None = None,
               consumer_placements: Sequence[Placement] | None = None) -> EdgeCosts:
    """Price every producer x consumer placement pair of the edge ``tensor -> consumer.operand``.

    Defaults to all legal placements of both ops. A graph input has one "producer
    placement" (replicated). Cached by (producer signature, consumer signature, operand,
    mesh, placements), so the edges of repeated layers are lookups.
    """
    from ._placement import legal_placements

    prod = graph.producer(tensor)
    pp_ = tuple(producer_placements if producer_placements is not None else
                (legal_placements(graph, prod, mesh) if prod is not None else [Placement()]))
    cp_ = tuple(consumer_placements if consumer_placements is not None else legal_placements(graph, consumer, mesh))
    psig = _signature(graph, prod) if prod is not None else ("input", graph.shape(tensor))
    out_idx = prod.outputs.index(tensor) if prod is not None else 0
    key = (psig, out_idx, _signature(graph, consumer), operand, mesh, pp_, cp_, graph.tensors[tensor].dtype)

    def make() -> EdgeCosts:
        nbytes = DTYPE_BYTES.get(graph.tensors[tensor].dtype, 4)
        have_of, haves = _distinct(pp_, lambda p: output_layout(graph, prod, p, mesh, out_idx) if prod is not None
                                   else layout_distribution(TensorLayout.replicated(graph.shape(tensor)), mesh))
        need_of, needs = _distinct(cp_, lambda p: operand_need(graph, consumer, p, mesh, operand))
        rows = tuple(tuple(reshard(h, n, mesh, dtype_bytes=nbytes) for n in needs) for h in haves)

        def backward() -> tuple[np.ndarray, np.ndarray, tuple[tuple[Reshard, ...], ...]]:
            grad_need_of, gneeds = _distinct(
                pp_, lambda p: grad_needed(graph, prod, p, mesh, out_idx, reader=(consumer, operand)))
            grad_have_of, ghaves = _distinct(cp_, lambda p: grad_held(graph, consumer, p, mesh, operand))
            table = tuple(tuple(reshard(h, n, mesh, dtype_bytes=nbytes) for n in gneeds) for h in ghaves)
            return grad_have_of, grad_need_of, table

        return EdgeCosts(pp_, cp_, have_of, need_of, rows, backward if prod is not None else None)

    return CACHE.get("edge", key, make)


def _dedupe_key(d: Distribution) -> int:
    return d.rid
