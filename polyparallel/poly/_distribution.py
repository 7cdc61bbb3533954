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

from ._cache import CACHE, MISSING
from ._cache import signature_of as _signature
from ._footprint import (
    _AXIS_MEMO,
    _BLOCK_AXES,
    Grid,
    Prog,
    Region,
    _axis_common_memo,
    _intersect_products,
    _product_count,
    axis_key,
    block_axis,
    dim_bounds,
    layout_region,
    operand_region,
)
from ._isl import count, footprint_set, tensor_box
from ._mesh import DeviceMesh
from ._placement import _KIND_MEMO, _LEGAL_MEMO, _PAD_MEMO, Placement, check_placement, dim_split_kind, padding_of

__all__ = [
    "Collective",
    "Distribution",
    "EdgeCosts",
    "OpComm",
    "Reshard",
    "ReshardTable",
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
    "reshard_table",
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
    boxes: tuple = field(repr=False, default=())  # (lo, hi) per-device bounds the sets depend on

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
    rows = np.concatenate([np.asarray(b).reshape(2, ndev) for b in boxes], axis=0).T
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

        boxes = [mesh.bounds(n, s) for n, s in zip(layout.shape, layout.shards)]  # (lo, hi), as ops give them
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
    return _op_distributions(graph, op, (placement,), mesh, operand, writes)[0]


def _op_distributions(graph: Graph, op: Op, placements: Sequence[Placement], mesh: DeviceMesh, operand: str,
                      writes: bool) -> list[Distribution]:
    """The distributions of ``operand`` under each placement, the uncached ones built in one batch.

    Every footprint computation of :mod:`._footprint` is elementwise over devices, so ``k``
    placements on a mesh of ``n`` devices are one computation over ``k n`` virtual devices
    (their bounds side by side), sliced afterwards: one pass of numpy calls instead of ``k``.
    The slices equal what a placement alone gives (pieces deduplicated per placement in the
    same order); the one decision :func:`index_prog` takes over all devices at once (a
    :class:`Grid` when any device's set is gridded) is re-checked per placement, and the
    placements whose own devices are not gridded are built again without the others.
    """
    sig = _signature(graph, op)
    keys = [("op", sig, p, mesh, operand, writes) for p in placements]
    table = CACHE.tables.get("distribution")
    todo = list(dict.fromkeys(p for p, k in zip(placements, keys) if table is None or k not in table))
    built = _build_distributions(graph, op, todo, mesh, operand, writes) if todo else {}
    # built entries are returned as built (a batch larger than the table would evict its own first entries)
    return [CACHE.get("distribution", k, lambda p=p: built[p] if p in built else
                      _build_distributions(graph, op, (p,), mesh, operand, writes)[p])
            for p, k in zip(placements, keys)]


def _build_distributions(graph: Graph, op: Op, placements: Sequence[Placement], mesh: DeviceMesh, operand: str,
                         writes: bool) -> dict[Placement, Distribution]:
    sig = _signature(graph, op)
    shape = _operand_shape(graph, op, operand)
    nest = op.nest
    out: dict[Placement, Distribution] = {}
    if nest is None:
        for p in placements:
            check_placement(nest, p, mesh, op=op.name)
            region = layout_region(shape, tuple(() for _ in shape), mesh)
            out[p] = Distribution(shape, mesh, region, tuple(() for _ in shape), tuple(True for _ in shape), (),
                                  ("op", sig, p, mesh, operand, writes), lambda q: tensor_box("T", shape))
        return out
    for p in placements:
        check_placement(nest, p, mesh, op=op.name)
    # placements that split the dims the footprint feels alike (differing only in dims it does not feel,
    # see _footprint_axes) have the same footprint on every device: the first of each is computed, the
    # others share its sets (their partial axes, keys and isl fallbacks stay their own)
    felt = [_felt_splits(nest, p, mesh, operand, writes) for p in placements]
    first: dict[tuple, int] = {}
    rep_of = [first.setdefault(f, i) for i, f in enumerate(felt)]
    if len(first) < len(placements):
        sub = _build_distributions(graph, op, [placements[i] for i in first.values()], mesh, operand, writes)
        for i, p in enumerate(placements):
            r = sub[placements[rep_of[i]]]
            if rep_of[i] == i:
                out[p] = r
                continue
            bounds = _dim_bounds(nest, p, mesh)
            partial = _partial_axes(nest, p, operand) if writes else ()
            d = out[p] = Distribution(tuple(shape), mesh, r.region, r.deps, r.block, partial,
                                      ("op", sig, p, mesh, operand, writes),
                                      _isl_of(nest, operand, shape, bounds, writes), tuple(bounds.values()))
            if partial == r.partial and r.reshard_key[0] in ("layout", "sets"):
                # the same sets, deps, block and partial axes: the same layout and reshard key (only a key that
                # falls back to the op's own, with isl-counted devices, differs between placements)
                d.__dict__.update(layout=r.layout, reshard_key=r.reshard_key, rid=r.rid)
        return out
    k = len(placements)
    if k > 1:
        # a flattened index (``d + 64 h``) is a two-level grid where a placement splits an inner term: batched
        # with placements that do not, the batch's grids would be rebuilt for those (below); two batches
        prone = _of_nest(nest, ("grid-prone", operand, writes), lambda: _grid_prone_dims(nest, operand, writes))
        inner = [any(d in prone for d in p.dims) for p in placements]
        if any(inner) and not all(inner):
            for part in ([p for p, x in zip(placements, inner) if x], [p for p, x in zip(placements, inner) if not x]):
                out.update(_build_distributions(graph, op, part, mesh, operand, writes))
            return out
    per = [_dim_bounds(nest, p, mesh) for p in placements]
    # the operand's footprint depends only on the mesh axes of the dims it can feel: one virtual device
    # per coordinate of those axes (a weight's footprint is the same on every data-parallel rank)
    keep = [tuple(a for _d, ax in f for a in ax) for f in felt]
    cat, take, nv, reps = _side_by_side(per, placements, mesh, nest, keep)
    region = operand_region(nest, operand, shape, cat, writes=writes, ndev=nv)
    deps_all = [_deps(nest, p, operand, writes, len(shape)) for p in placements]
    # block[i][j]: every piece is, along tensor axis j, the block distribution over the mesh axes
    # it depends on (Prog.same as an interval, all placements at once on the virtual devices)
    starts = np.array([t.start if isinstance(t, slice) else int(t[0]) for t in take], dtype=np.int64)
    block_all = np.zeros((k, len(shape)), dtype=bool)
    for j, n in enumerate(shape):
        if not region.pieces or any(isinstance(pc[j], Grid) for pc in region.pieces):
            continue
        ex = [mesh.bounds(n, d[j]) for d in deps_all]
        lo = np.concatenate([b[0] if r is None else b[0][r] for b, r in zip(ex, reps)])
        hi = np.concatenate([b[1] if r is None else b[1][r] for b, r in zip(ex, reps)])
        eq = np.ones(nv, dtype=bool)
        for pc in region.pieces:
            a = pc[j]
            eq &= (a.n == np.maximum(hi - lo, 0)) & (a.start == lo) & (a.step == 1)
        block_all[:, j] = np.logical_and.reduceat(eq, starts)
    gridded = [j for j in range(len(shape)) if any(isinstance(pc[j], Grid) for pc in region.pieces)]
    alone: list[Placement] = []
    for i, p in enumerate(placements):
        pieces: list = []
        # an axis equal to the block over its mesh axes (checked on every device above) is that block's
        # shared object: the same arrays, no slice, its digest and overlaps computed once per block
        canon = [block_axis(mesh, n, deps_all[i][j]) if block_all[i, j] else None for j, n in enumerate(shape)]
        for pc in region.pieces:
            sl = tuple(_take_axis(a, take[i]) if c is None else c for a, c in zip(pc, canon))
            if not any(all(a.same(b) for a, b in zip(sl, q)) for q in pieces):
                pieces.append(sl)
        if k > 1 and any(isinstance(pc[j], Grid) and not bool((pc[j].H > 1).any()) for pc in pieces for j in gridded):
            alone.append(p)  # alone, index_prog would have given this placement a progression
            continue
        fallback = region.fallback[take[i]]
        bounds = per[i]
        deps = deps_all[i]
        block = [bool(x) for x in block_all[i]]
        partial = _partial_axes(nest, p, operand) if writes else ()
        out[p] = Distribution(tuple(shape), mesh, Region(tuple(shape), pieces, fallback), deps, tuple(block),
                              partial, ("op", sig, p, mesh, operand, writes),
                              _isl_of(nest, operand, shape, bounds, writes), tuple(bounds.values()))
    # the re-checked ones as a batch of their own (one by one when that makes no progress)
    for batch in ([alone] if len(alone) < k else [[p] for p in alone]) if alone else []:
        out.update(_build_distributions(graph, op, batch, mesh, operand, writes))
    return out


def _side_by_side(per: Sequence[dict], placements: Sequence[Placement], mesh: DeviceMesh,
                  nest: LoopNest, keep: Sequence[tuple[str, ...]] | None = None
                  ) -> tuple[dict, list[np.ndarray | slice], int, list[np.ndarray | None]]:
    """The bounds of several placements as one computation over virtual devices.

    A device's bounds depend only on its coordinates along the mesh axes the placement
    uses: devices that differ only along the others have the same share (replicated
    work), so each placement contributes one device per coordinate of its axes (the mesh
    slice at coordinate 0 elsewhere). ``keep[i]``: only these of placement ``i``'s axes
    (the caller's result does not depend on the bounds of the dims the others split, see
    :func:`_footprint_axes`). Returns the bounds side by side, for each placement
    the index of each real device's virtual one, the number of virtual devices and each
    placement's representative devices (None: all). One
    placement alone is computed over the real devices, as before batching.
    """
    if len(placements) == 1:
        return per[0], [slice(0, mesh.size)], mesh.size, [None]
    axes = [p.mesh_axes for p in placements] if keep is None else [tuple(k) for k in keep]
    dims = tuple((d.name, d.extent) for d in nest.dims)
    # a function of the dims' extents, the placements, the kept axes and the mesh; the operands of an
    # op and its collectives batch the same placements: built once, shared
    key = (dims, tuple(placements), mesh, tuple(axes))
    hit = _SIDE_MEMO.get(key)
    if hit is not None:
        return hit
    out = _side_by_side_build(dims, placements, axes, mesh)
    for lo, hi in out[0].values():
        lo.setflags(write=False)
        hi.setflags(write=False)
    if len(_SIDE_MEMO) >= 4:  # an op's operands and one producer; batches of 1e5 virtual devices are MiBs each
        _SIDE_MEMO.pop(next(iter(_SIDE_MEMO)))
    _SIDE_MEMO[key] = out
    return out


_SIDE_MEMO: dict[tuple, tuple] = {}


def _side_by_side_build(dims: Sequence[tuple[str, int]], placements: Sequence[Placement],
                        axes: Sequence[tuple[str, ...]],
                        mesh: DeviceMesh) -> tuple[dict, list[np.ndarray | slice], int, list[np.ndarray | None]]:
    """Virtual device ``v`` of placement ``i`` is real device ``dev[v]`` (a representative);
    its bound on dim ``d`` is that of ``dev[v]`` under the dim's mesh axes in placement ``i``.
    A dim takes a few distinct axis lists over a batch: their bounds are stacked in a table,
    read for all virtual devices by one (list, device) index."""
    takes: list[np.ndarray | slice] = []
    reps: list[np.ndarray | None] = []
    devs: list[np.ndarray] = []
    sizes: list[int] = []
    slices: dict[tuple[str, ...], tuple[np.ndarray | None, np.ndarray]] = {}
    codes: list[dict[tuple[str, ...], int]] = [{} for _ in dims]
    rows: list[list[int]] = [[] for _ in dims]
    offset = 0
    for p, kept in zip(placements, axes):
        hit = slices.get(kept)
        if hit is None:
            hit = slices[kept] = _mesh_slice(mesh, kept)
        rep, local = hit
        n = mesh.size if rep is None else len(rep)
        takes.append(slice(offset, offset + n) if rep is None else local + offset)
        devs.append(_arange(mesh.size) if rep is None else rep)
        sizes.append(n)
        reps.append(rep)
        offset += n
        split = dict(p.splits)
        for j, (d, _n) in enumerate(dims):
            a = split.get(d, ())
            c = codes[j].get(a)
            if c is None:
                c = codes[j][a] = len(codes[j])
            rows[j].append(c)
    dev = np.concatenate(devs)
    counts = np.array(sizes, dtype=np.int64)
    cat = {}
    for j, (d, extent) in enumerate(dims):
        lists = list(codes[j])
        if len(lists) == 1:
            lo, hi = mesh.bounds(extent, lists[0])
            cat[d] = (lo.take(dev), hi.take(dev))
            continue
        flat = np.repeat(np.array(rows[j], dtype=np.int64) * mesh.size, counts)
        flat += dev
        tab = [mesh.bounds(extent, a) for a in lists]
        cat[d] = (np.concatenate([t[0] for t in tab]).take(flat), np.concatenate([t[1] for t in tab]).take(flat))
    return cat, takes, offset, reps


@lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    out = np.arange(n)
    out.setflags(write=False)
    return out


def _footprint_axes(nest: LoopNest, placement: Placement, mesh: DeviceMesh, operand: str,
                    writes: bool | None) -> tuple[str, ...]:
    """The mesh axes of ``placement`` the footprint of ``operand`` can depend on.

    In a statement that accesses the operand, the image of a device's box depends on the
    bounds of the dims the access indexes by, of the dims constraints tighten (a causal
    mask links ``t`` to ``s``), and on whether the box is empty at all. A dim outside those
    whose blocks are all nonempty (always, on even axes: legal splits give every device
    work; a weighted axis can leave a block empty) changes nothing: devices that differ only
    in the coordinates of its mesh axes have the same footprint.
    """
    return tuple(a for _d, ax in _felt_splits(nest, placement, mesh, operand, writes) for a in ax)


def _felt_splits(nest: LoopNest, placement: Placement, mesh: DeviceMesh, operand: str,
                 writes: bool | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The splits of ``placement`` whose mesh axes :func:`_footprint_axes` keeps."""
    felt, other = _of_nest(nest, ("felt", operand, writes), lambda: _felt_dims(nest, operand, writes))
    return tuple((d, ax) for d, ax in placement.splits
                 if d in felt or (d in other and _has_empty_block(mesh, nest.extents[d], ax)))


def _grid_prone_dims(nest: LoopNest, operand: str, writes: bool) -> frozenset[str]:
    """Dims of an index of several terms other than its largest-coefficient one: splitting them can make
    the footprint a :class:`Grid` (:func:`index_prog`), a batch-wide choice."""
    out: set[str] = set()
    for _st, acc, is_write in nest.accesses(operand):
        if is_write != writes:
            continue
        for e in acc.index:
            if e is not ANY and len(e.terms) > 1:
                out.update(d for d, _a in sorted(e.terms, key=lambda t: abs(t[1]))[:-1])
    return frozenset(out)


def _felt_dims(nest: LoopNest, operand: str, writes: bool | None) -> tuple[frozenset[str], frozenset[str]]:
    """(dims indexing an access of ``operand`` or in a constraint of a statement accessing it,
    the other dims of those statements)."""
    felt: set[str] = set()
    dims: set[str] = set()
    for st, acc, is_write in nest.accesses(operand):
        if writes is not None and is_write != writes:
            continue
        dims.update(st.dims)
        for e in acc.index:
            if e is not ANY:
                felt.update(e.dims)
        for c in st.constraints:
            felt.update(c.dims)
    return frozenset(felt), frozenset(dims - felt)


@lru_cache(maxsize=1 << 14)
def _has_empty_block(mesh: DeviceMesh, extent: int, axes: tuple[str, ...]) -> bool:
    lo, hi = mesh.bounds(extent, axes)
    return bool((hi <= lo).any())


@lru_cache(maxsize=1024)
def _mesh_slice(mesh: DeviceMesh, axes: tuple[str, ...]) -> tuple[np.ndarray | None, np.ndarray]:
    """The devices at coordinate 0 on every mesh axis not in ``axes`` (row-major; None: all of
    them), and for every device the position among them of the one with its coordinates along
    ``axes``."""
    used = sorted({mesh.index(a) for a in axes})
    others = [i for i in range(len(mesh.shape)) if i not in used and mesh.shape[i] > 1]
    if not others:
        return None, np.arange(mesh.size)
    coords = mesh.coords
    rep = np.nonzero((coords[:, others] == 0).all(axis=1))[0] if others else np.arange(mesh.size)
    local = np.zeros(mesh.size, dtype=np.int64)
    for i in used:  # row-major over the used axes, as the representatives are ordered
        local = local * mesh.shape[i] + coords[:, i]
    return rep, local


def _take_axis(a: Prog | Grid, idx: np.ndarray | slice) -> Prog | Grid:
    if isinstance(a, Grid):
        return Grid(a.start[idx], a.n[idx], a.c[idx], a.H[idx])
    start = a.start[idx]
    if a.unit:  # every step is 1: one shared read-only array instead of a copy per distribution
        return Prog(start, _ones(len(start)), a.n[idx], True)
    return Prog(start, a.step[idx], a.n[idx], a.unit)


@lru_cache(maxsize=64)
def _ones(n: int) -> np.ndarray:
    out = np.ones(n, dtype=np.int64)
    out.setflags(write=False)
    return out


_NEST_MEMO: dict[tuple, tuple[LoopNest, Any]] = {}


def _dim_bounds(nest: LoopNest, placement: Placement, mesh: DeviceMesh) -> dict:
    """:func:`dim_bounds`, memoised per (nest object, placement, mesh object): an op's operands and
    collectives each ask for the bounds of the same placements (the dict is shared: never written)."""
    key = (id(nest), placement)
    hit = _BOUNDS_MEMO.get(key)
    if hit is not None and hit[0] is nest and hit[1] is mesh:
        return hit[2]
    if len(_BOUNDS_MEMO) > 100_000:
        _BOUNDS_MEMO.clear()
    out = dim_bounds(nest, placement, mesh)
    _BOUNDS_MEMO[key] = (nest, mesh, out)  # holding the nest keeps its id from being reused
    return out


_BOUNDS_MEMO: dict[tuple, tuple[LoopNest, DeviceMesh, dict]] = {}


def _of_nest(nest: LoopNest, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` memoised by the nest object and ``key`` (hashing a whole nest costs more than
    the walks memoised here; holding the nest keeps its id from being reused)."""
    k = (id(nest), *key)
    hit = _NEST_MEMO.get(k)
    if hit is not None and hit[0] is nest:
        return hit[1]
    if len(_NEST_MEMO) > 100_000:
        _NEST_MEMO.clear()
    out = make()
    _NEST_MEMO[k] = (nest, out)
    return out


def _dims_per_axis(nest: LoopNest, operand: str, writes: bool, rank: int) -> tuple[tuple[str, ...], ...]:
    """For each tensor axis, the dims its accesses use, largest coefficient first, first occurrence kept."""
    dims: list[dict[str, None]] = [{} for _ in range(rank)]
    for _st, acc, is_write in nest.accesses(operand):
        if is_write != writes:
            continue
        for j, e in enumerate(acc.index):
            if e is ANY:
                continue
            for d, _c in sorted(e.terms, key=lambda t: -abs(t[1])):
                dims[j].setdefault(d)
    return tuple(tuple(x) for x in dims)


def _deps(nest: LoopNest, placement: Placement, operand: str, writes: bool, rank: int) -> tuple[tuple[str, ...], ...]:
    """Mesh axes the footprint along each tensor axis depends on, outermost first."""
    per_axis = _of_nest(nest, ("deps", operand, writes, rank),
                        lambda: _dims_per_axis(nest, operand, writes, rank))
    split = dict(placement.splits)
    return tuple(tuple(dict.fromkeys(a for d in dims if d in split for a in split[d])) for dims in per_axis)


def _isl_of(nest: LoopNest, operand: str, shape: Shape, bounds, writes: bool) -> Callable[[int], isl.Set]:
    def isl_of(p: int) -> isl.Set:
        b = {d: (int(lo[p]), int(hi[p])) for d, (lo, hi) in bounds.items()}
        return footprint_set(nest, operand, shape, b, writes=writes).set_tuple_name("T")

    return isl_of


def _reduced_dims(nest: LoopNest, operand: str) -> tuple[str, ...]:
    """The reduction dims of the statements writing ``operand``, in order, first occurrence kept."""
    dims: dict[str, None] = {}
    for st in nest.statements:
        if any(w.operand == operand for w in st.writes):
            for d in st.reduction_dims():
                dims.setdefault(d)
    return tuple(dims)


def _partial_axes(nest: LoopNest, placement: Placement, operand: str) -> tuple[str, ...]:
    axes: dict[str, None] = {}
    for d in _of_nest(nest, ("reduced", operand), lambda: _reduced_dims(nest, operand)):
        for a in placement.axes_of(d):
            axes.setdefault(a)
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


def _routes(shape: Shape, lays: Sequence[TensorLayout], deps: Sequence[Shards],
            mesh: DeviceMesh) -> tuple[np.ndarray, np.ndarray, list[Shards]]:
    """Steps 1-4 of every (layout, need mesh axes) route at once: what :func:`_route` gives, in numpy.

    Returns ``(elements, end, ends)``: ``elements[x, d]`` the route's sum of per-step elements
    (:attr:`Reshard.elements` before the last exchange) from ``lays[x]`` to the need axes
    ``deps[d]``, and ``ends[end[x, d]]`` the layout it ends in. The state of every pair is,
    per mesh axis ``a``, the tensor axis ``t[a]`` it splits (-1: none) and a rank ``r[a]``
    ordering the mesh axes of one tensor axis (outermost first); each step of the module
    docstring updates these columns for all pairs at once. A step is priced in closed form
    where the layouts it moves between have equal blocks on every device (even mesh, each
    extent divisible by its group): a reduce-scatter over ``g`` devices receives ``(g-1)|B'|``,
    an all-reduce ``2(g-1)ceil(|B|/g)``, a gather or all-to-all ``|B'| - prod_k min(b'_k, b_k)``
    when along every tensor axis one list of mesh axes is a prefix of the other (the finer
    block lies inside the coarser one of the same device; :func:`_gain`). Other gathers and
    all-to-alls are counted per device as :func:`_gain` does (blocks are products of per-axis
    intervals, so is their intersection), for all distinct (B', B) at once; other reductions
    by the memoised scalar functions :func:`_route` uses, once per distinct (layout, mesh
    axis). The result is exactly :func:`_route`'s, without its Python work per pair
    (``tests/test_poly_fast.py`` compares them on random layouts).
    """
    H, D, m, rank = len(lays), len(deps), len(mesh.names), len(shape)
    pos = {a: i for i, a in enumerate(mesh.names)}
    size = np.array(mesh.shape, dtype=np.int64)
    th = np.full((H, m), -1, dtype=np.int64)
    rh = np.zeros((H, m), dtype=np.int64)
    order = np.full((H, m), -1, dtype=np.int64)  # partial axes, in the layout's order
    for i, lay in enumerate(lays):
        for k, s in enumerate(lay.shards):
            for q, a in enumerate(s):
                th[i, pos[a]], rh[i, pos[a]] = k, q
        for q, a in enumerate(lay.partial):
            order[i, q] = pos[a]
    tn = np.full((D, m), -1, dtype=np.int64)
    rn = np.zeros((D, m), dtype=np.int64)
    for d, dk in enumerate(deps):
        for k, s in enumerate(dk):
            for q, a in enumerate(s):
                tn[d, pos[a]], rn[d, pos[a]] = k, q
    P = H * D
    t = np.repeat(th, D, axis=0)
    r = np.repeat(rh, D, axis=0)
    po = np.repeat(order, D, axis=0)
    need = np.tile(tn, (H, 1))
    need_r = np.tile(rn, (H, 1))
    even_mesh = bool(mesh.even)
    elems = np.zeros(P, dtype=np.int64)
    ext = np.asarray(shape, dtype=np.int64)
    base = m + 1
    rows = np.arange(P)
    inner = m  # ranks of appended axes: larger than any rank so far (innermost)

    def blocks(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # group[k]: the product of the sizes of the mesh axes splitting tensor axis k (contiguous rows)
        tt = np.ascontiguousarray(t.T)
        group = np.ones((rank, P), dtype=np.int64)
        for a in range(m):
            for k in range(rank):
                group[k] = np.where(tt[a] == k, group[k] * size[a], group[k])
        group = group.T
        return ext // group, (ext % group == 0).all(axis=1) & even_mesh

    def seqs(t: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per tensor axis: the ordered list of its mesh axes as a base-(m+1) code (first axis most
        significant, digit = mesh axis + 1) and its length."""
        # position of mesh axis a in its tensor axis' list: the axes of that list ranked before it
        # one contiguous row per mesh axis and per tensor axis (columns of (P, m) arrays are strided)
        tt, rr = np.ascontiguousarray(t.T), np.ascontiguousarray(r.T)
        code = np.zeros((rank, P), dtype=np.int64)
        length = np.zeros((rank, P), dtype=np.int64)
        for a in range(m):
            place = np.zeros(P, dtype=np.int64)
            for b in range(m):
                if a != b:
                    place += (tt[b] == tt[a]) & (rr[b] < rr[a])
            digit = (a + 1) * base ** (m - 1 - place)
            for k in range(rank):
                on = tt[a] == k
                code[k] += np.where(on, digit, 0)
                length[k] += on
        return code.T, length.T

    def decode_axes(c: int) -> tuple[str, ...]:
        axes: list[str] = []
        for _ in range(m):
            c, dgt = divmod(c, base)
            if dgt:
                axes.append(mesh.names[dgt - 1])
        return tuple(reversed(axes))

    def decode(row: np.ndarray) -> Shards:
        return tuple(decode_axes(c) for c in row.tolist())

    def exact_gains(rows: np.ndarray) -> np.ndarray:
        """``max_p |B'(p) \\ B(p)|`` for each row (codes of ``B'`` then of ``B``): :func:`_gain`'s
        per-device interval products, for all rows at once (intervals tabled per distinct list)."""
        U, ndev = len(rows), mesh.size
        out = np.zeros(U, dtype=np.int64)
        if not rank:
            return out
        tabs = []  # per tensor axis: the distinct lists' interval tables, each row's two entries
        for k in range(rank):
            codes, inv = np.unique(np.concatenate([rows[:, k], rows[:, rank + k]]), return_inverse=True)
            bounds = [mesh.bounds(int(shape[k]), decode_axes(int(c))) for c in codes]
            lo_t, hi_t = np.stack([b[0] for b in bounds]), np.stack([b[1] for b in bounds])
            inv = inv.reshape(-1)
            tabs.append((lo_t, hi_t, hi_t - lo_t, inv[:U], inv[U:]))
        chunk = max(1, (1 << 14) // ndev)  # ~128 KiB per (rows x devices) array: in cache, and from the heap
        for s0 in range(0, U, chunk):
            s1 = min(U, s0 + chunk)
            size = over = None
            for lo_t, hi_t, w_t, i1, i2 in tabs:
                a, b = i1[s0:s1], i2[s0:s1]
                ov = np.minimum(hi_t[a], hi_t[b])
                ov -= np.maximum(lo_t[a], lo_t[b])
                np.maximum(ov, 0, out=ov)
                if size is None:
                    size, over = w_t[a], ov
                else:
                    size *= w_t[a]
                    over *= ov
            size -= over
            out[s0:s1] = size.max(axis=1, initial=0)
        return out

    def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        radix = base ** m  # every column is a code below it (or a mesh axis)
        if radix ** rows.shape[1] < 1 << 62:  # rows packed into one int: a 1-D unique
            key = rows @ (radix ** np.arange(rows.shape[1], dtype=np.int64))
            _u, first, inv = np.unique(key, return_index=True, return_inverse=True)
            return rows[first], inv.reshape(-1)
        uniq, inv = np.unique(rows, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)

    def exact(mask: np.ndarray, cols: np.ndarray, fn: Callable[[np.ndarray], int]) -> np.ndarray:
        """``fn`` of each distinct row of ``cols`` among the pairs in ``mask`` (the scalar, memoised
        prices), as an array over all pairs (0 outside ``mask``)."""
        out = np.zeros(P, dtype=np.int64)
        idx = np.nonzero(mask)[0]
        if len(idx):
            uniq, inv = unique_rows(cols[idx])
            out[idx] = np.array([fn(u) for u in uniq], dtype=np.int64)[inv]
        return out

    b_cur, e_cur = blocks(t)
    s_cur = seqs(t, r)

    def gain(t2: np.ndarray, r2: np.ndarray, moved: np.ndarray) -> None:
        """Price the move to (t2, r2) of the pairs in ``moved`` and make it the current layout."""
        nonlocal b_cur, e_cur, s_cur, t, r
        b_nxt, e_nxt = blocks(t2)
        s_nxt = seqs(t2, r2)
        (c1, l1), (c2, l2) = s_nxt, s_cur
        cut = base ** (m - np.minimum(l1, l2))
        prefix = (c1 // cut == c2 // cut).all(axis=1)
        closed = e_nxt & e_cur & prefix
        g = b_nxt.prod(axis=1) - np.minimum(b_nxt, b_cur).prod(axis=1)
        elems[moved & closed] += g[moved & closed]
        idx = np.nonzero(moved & ~closed)[0]
        if len(idx):
            uniq, inv = unique_rows(np.concatenate([c1, c2], axis=1)[idx])
            elems[idx] += exact_gains(uniq)[inv]
        sel = moved[:, None]
        t, r = np.where(sel, t2, t), np.where(sel, r2, r)
        b_cur, e_cur = np.where(sel, b_nxt, b_cur), np.where(moved, e_nxt, e_cur)
        s_cur = (np.where(sel, s_nxt[0], s_cur[0]), np.where(sel, s_nxt[1], s_cur[1]))

    # 1. partial sums, in the layout's order
    for q in range(m):
        a = po[:, q]
        has = a >= 0
        if not has.any():
            continue
        ai = np.maximum(a, 0)
        j = need[rows, ai]
        g = size[ai]
        rs = has & (j >= 0)
        ar = has & (j < 0)
        blk = b_cur.prod(axis=1)
        elems[ar & e_cur] += (2 * (g - 1) * (-(-blk // g)))[ar & e_cur]
        elems[:] += exact(ar & ~e_cur, np.concatenate([s_cur[0], ai[:, None]], axis=1),
                          lambda u: _all_reduce_of(shape, decode(u[:rank]), mesh.names[u[rank]], mesh).elements)
        if rs.any():
            t2, r2 = t.copy(), r.copy()
            t2[rows[rs], ai[rs]] = j[rs]
            r2[rows[rs], ai[rs]] = inner
            inner += 1
            b_nxt, e_nxt = blocks(t2)
            elems[rs & e_nxt] += ((g - 1) * b_nxt.prod(axis=1))[rs & e_nxt]
            elems[:] += exact(rs & ~e_nxt, np.concatenate([seqs(t2, r2)[0], ai[:, None]], axis=1),
                              lambda u: (size[u[rank]] - 1) * _block_stats(shape, decode(u[:rank]), mesh)[0])
            sel = rs[:, None]
            t, r, b_cur = np.where(sel, t2, t), np.where(sel, r2, r), np.where(sel, b_nxt, b_cur)
            e_cur = np.where(rs, e_nxt, e_cur)
            s_cur = seqs(t, r)
    # 2. free local slices, innermost
    for a in range(m):
        sl = (t[:, a] < 0) & (need[:, a] >= 0)
        if sl.any():
            t, r = t.copy(), r.copy()
            t[sl, a], r[sl, a] = need[sl, a], inner
            inner += 1
    b_cur, e_cur = blocks(t)
    s_cur = seqs(t, r)
    # 3. all-to-all: the axis moves to the need's tensor axis, whose list is reordered as the need's
    for a in range(m):
        mv = (t[:, a] >= 0) & (need[:, a] >= 0) & (t[:, a] != need[:, a])
        if not mv.any():
            continue
        j = need[:, a]
        t2 = t.copy()
        t2[mv, a] = j[mv]
        on_j = (t2 == j[:, None]) & mv[:, None]
        # _ordered: the need's axes first in its order, then the others as they were
        in_need = need == j[:, None]
        r2 = np.where(on_j, np.where(in_need, need_r, r + (1 << 20)), r)
        gain(t2, r2, mv)
    # 4. all-gather of the axes the need does not split along, per tensor axis in increasing order
    for k in range(rank):
        ga = (t == k) & (need < 0)
        mv = ga.any(axis=1)
        if mv.any():
            gain(np.where(ga, -1, t), np.where(ga, 0, r), mv)
    # the final layouts
    uniq, inv = unique_rows(seqs(t, r)[0])
    return elems.reshape(H, D), inv.reshape(H, D), [decode(u) for u in uniq]


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
    # blocks are products of per-axis intervals, and so are their intersections
    size = np.ones(mesh.size, dtype=np.int64)
    over = np.ones(mesh.size, dtype=np.int64)
    for n, a, b in zip(shape, nxt, cur):
        lo, hi = mesh.bounds(n, a)
        lo2, hi2 = mesh.bounds(n, b)
        size *= hi - lo
        over *= np.maximum(np.minimum(hi, hi2) - np.maximum(lo, lo2), 0)
    gained = size - over
    return int(gained.max(initial=0)), int(gained.sum()), int(size.max(initial=0))


CACHE.on_clear(_AXIS_MEMO.clear, _RIDS.clear, _route.cache_clear, _even_blocks.cache_clear, _block_stats.cache_clear,
               _all_reduce_of.cache_clear, _gain.cache_clear, _SIDE_MEMO.clear, _NEST_MEMO.clear, _LEGAL_MEMO.clear,
               _KIND_MEMO.clear, _PAD_MEMO.clear, _BLOCK_AXES.clear,
               _has_empty_block.cache_clear, _BOUNDS_MEMO.clear)


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
        from ._placement import legal_placements

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
class ReshardTable:
    """Every ``reshard(haves[i], needs[j])`` of two lists of distributions, priced as arrays.

    ``elements[i, j]`` is the route's elements per device (:attr:`Reshard.elements`),
    ``direct[i, j]`` its exact lower bound; :meth:`cell` gives the :class:`Reshard` itself,
    assembled on first use from the memoised route and these counts (equal to what
    :func:`reshard` returns for the pair; ``tests/test_poly_fast.py`` compares them). A
    table of at most ``_SMALL_TABLE`` pairs is priced pair by pair (its cells given).

    How (:func:`reshard_table`): the route's collectives (steps 1-4 of the module
    docstring) depend only on the have's layout and the need's mesh axes per tensor axis,
    so they are computed once per (have, need axes), not per pair. What is left per pair
    is ``max_p`` and ``sum_p`` of ``|N(p) \\ L(p)|`` for ``L`` the have (the direct bound)
    and the route's final layout (the last exchange). For single-product sets that is
    ``|N(p)| - prod_k |N_k(p) ∩ L_k(p)|`` over tensor axes ``k``; the one-dimensional
    counts take a few distinct values per axis (memoised), and devices whose counts agree
    in every one of them are one class (the mesh symmetry: blocks of an even axis are
    translates, so their overlaps are equal) — the products are taken over classes, for
    all pairs at once in numpy, the sums weighted by class sizes. Pairs with a
    union-of-products or isl-counted set take the per-pair path.
    """

    haves: tuple[Distribution, ...]
    needs: tuple[Distribution, ...]
    mesh: DeviceMesh
    dtype_bytes: int
    elements: np.ndarray
    direct: np.ndarray
    most: np.ndarray  # the last exchange (halo / p2p): max elements per device, 0 when there is none
    total: np.ndarray  # ... and summed over devices
    payload: np.ndarray  # per need: max_p |N(p)|
    route_of: np.ndarray  # per pair: route x * len(deps) + d (-1: an irregular have)
    routes: tuple[tuple[TensorLayout, ...], tuple[Shards, ...]]  # (layouts x, need mesh axes d)
    prefix: tuple[tuple[Step, ...], ...]  # per irregular have: its in-place all-reduces
    cells: dict[tuple[int, int], Reshard] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.haves), len(self.needs)

    def cell(self, i: int, j: int) -> Reshard:
        r = self.cells.get((i, j))
        if r is None:
            r = self.cells[(i, j)] = self._assemble(i, j)
        return r

    def rows(self) -> tuple[tuple[Reshard, ...], ...]:
        return tuple(tuple(self.cell(i, j) for j in range(len(self.needs))) for i in range(len(self.haves)))

    def _assemble(self, i: int, j: int) -> Reshard:
        h, n = self.haves[i], self.needs[j]
        most, direct = int(self.most[i, j]), int(self.direct[i, j])
        r = int(self.route_of[i, j])
        if r < 0:
            steps = self.prefix[i]
            if direct:
                axes = tuple(sorted({x for d in n.deps for x in d} | {x for d in h.deps for x in d}))
                steps = (*steps, Step("p2p", axes, None, direct, int(self.total[i, j]), int(self.payload[j]), 0))
            return Reshard(str(h), str(n), steps, direct, self.dtype_bytes)
        lays, deps = self.routes
        x, d = divmod(r, max(len(deps), 1))
        steps, cur = _route(h.shape, lays[x].shards, lays[x].partial, deps[d], self.mesh)
        if most:
            steps = (*steps, _last_exchange(n, cur, self.mesh, most, int(self.total[i, j]), int(self.payload[j])))
        return Reshard(str(h), str(n), steps, direct, self.dtype_bytes)


def _last_exchange(n: Distribution, cur: Shards, mesh: DeviceMesh, most: int, total: int, payload: int) -> Step:
    """Step 5: what ``n`` still lacks after the route, a halo when it extends the block along the
    same mesh axes, else point-to-point."""
    irregular = [i for i, b in enumerate(n.block) if not b]
    halo = bool(irregular) and all(n.deps[i] and set(n.deps[i]) == set(cur[i]) for i in irregular)
    axes = tuple(a for i in irregular for a in n.deps[i]) if halo else tuple(mesh.names)
    return Step("halo" if halo else "p2p", axes, irregular[0] if len(irregular) == 1 else None,
                most, total, payload, 2 if halo else mesh.size)


def reshard_table(haves: Sequence[Distribution], needs: Sequence[Distribution], mesh: DeviceMesh, *,
                  dtype_bytes: int = 4) -> ReshardTable:
    """Price every (have, need) pair at once (see :class:`ReshardTable`); cached by the lists."""
    haves, needs = tuple(haves), tuple(needs)
    for n in needs:
        if n.partial:
            raise ValueError(f"a consumer cannot need partial sums ({n})")
    for h in haves:
        if needs and h.shape != needs[0].shape:
            raise ValueError(f"reshard between shapes {list(h.shape)} and {list(needs[0].shape)}")
    if len(haves) * len(needs) <= _SMALL_TABLE:
        return _table_of_cells(haves, needs, mesh, dtype_bytes)
    key = (tuple(h.rid for h in haves), tuple(n.rid for n in needs), dtype_bytes)
    return CACHE.get("table", key, lambda: _reshard_table(haves, needs, mesh, dtype_bytes))


_SMALL_TABLE = 16  # pairs; fewer are priced one by one (the per-pair cache serves solvers' single pairs)


def _table_of_cells(haves: tuple[Distribution, ...], needs: tuple[Distribution, ...], mesh: DeviceMesh,
                    dtype_bytes: int) -> ReshardTable:
    """A small table from per-pair :func:`reshard` calls (each cached), cells filled in."""
    cells = {(i, j): reshard(h, n, mesh, dtype_bytes=dtype_bytes) for i, h in enumerate(haves)
             for j, n in enumerate(needs)}
    shape = (len(haves), len(needs))
    elements = np.zeros(shape, dtype=np.int64)
    direct = np.zeros(shape, dtype=np.int64)
    for (i, j), r in cells.items():
        elements[i, j], direct[i, j] = r.elements, r.direct_elements
    zero = np.zeros(shape, dtype=np.int64)
    return ReshardTable(haves, needs, mesh, dtype_bytes, elements, direct, zero, zero,
                        np.zeros(len(needs), dtype=np.int64), np.full(shape, -1, dtype=np.int64), ((), ()),
                        tuple(() for _ in haves), cells)


def _reshard_table(haves: tuple[Distribution, ...], needs: tuple[Distribution, ...], mesh: DeviceMesh,
                   dtype_bytes: int) -> ReshardTable:
    H, N = len(haves), len(needs)
    shape = needs[0].shape if needs else (haves[0].shape if haves else ())
    # the routes: one per (layout have, need mesh axes per tensor axis)
    # the needs' mesh axes per tensor axis, in a canonical order: tables whose needs list them in another
    # order (the key read of a fused qkv after the query read) share one memoised set of routes
    deps = sorted({n.deps for n in needs})
    dep_index = {d: i for i, d in enumerate(deps)}
    dep_of = np.array([dep_index[n.deps] for n in needs], dtype=np.int64)
    others: dict[tuple, int] = {}  # the sets needs are compared with: layouts by shards, irregular haves by row
    other_list: list[Distribution] = []

    def other(key: tuple, make: Callable[[], Distribution]) -> int:
        k = others.get(key)
        if k is None:
            k = others[key] = len(other_list)
            other_list.append(make())
        return k

    def layout_other(shards: Shards) -> int:
        return other(("layout", shards), lambda: layout_distribution(TensorLayout(shape, shards), mesh))

    # route r = x * len(deps) + d: layout haves[lay_rows[x]] to the need axes deps[d]
    D = max(len(deps), 1)
    route_idx = np.full((H, D), -1, dtype=np.int64)
    have_other = np.zeros(H, dtype=np.int64)
    prefix: list[tuple[Step, ...]] = []
    prefix_elems = np.zeros(H, dtype=np.int64)
    lay_rows: list[int] = []
    for i, h in enumerate(haves):
        lay = h.layout
        if lay is None:
            have_other[i] = other(("have", i), lambda h=h: h)
            ar = tuple(_all_reduce(h.counts(), a, mesh, None) for a in h.partial)
            prefix.append(ar)
            prefix_elems[i] = sum(s.elements for s in ar)
            continue
        prefix.append(())
        have_other[i] = layout_other(lay.shards)
        route_idx[i] = len(lay_rows) * D + np.arange(D)
        lay_rows.append(i)
    lays = tuple(haves[i].layout for i in lay_rows)
    route_elems = np.zeros(len(lays) * D + 1, dtype=np.int64)  # the last entry: no route
    route_other = np.zeros(len(lays) * D + 1, dtype=np.int64)
    if lays and deps:
        # the routes depend on the have layouts and the needs' mesh axes only: the query, key and value
        # reads of a fused qkv (three tables) share them
        el, end, ends = CACHE.get("routes", (shape, lays, tuple(deps), mesh), lambda: _routes(shape, lays, deps, mesh))
        end_other = np.array([layout_other(cur) for cur in ends], dtype=np.int64)
        route_elems[:-1], route_other[:-1] = el.ravel(), end_other[end.ravel()]
    route_of = route_idx[:, dep_of] if N else np.zeros((H, 0), dtype=np.int64)
    layout_row = route_of >= 0
    # the (need, other) pairs to count: the have itself (direct bound) and the route's end
    jj = np.broadcast_to(np.arange(N), (H, N))
    o_direct = np.broadcast_to(have_other[:, None], (H, N))
    o_end = np.where(layout_row, route_other[route_of], o_direct)
    nother = max(len(other_list), 1)
    codes = np.concatenate([(jj * nother + o_direct).ravel(), (jj * nother + o_end).ravel()])
    uniq, inv = np.unique(codes, return_inverse=True)
    mx, sm = _missing_pairs(needs, other_list, uniq // nother, uniq % nother, mesh)
    inv = inv.reshape(2, H, N)
    payload = np.array([int(n.counts().max(initial=0)) for n in needs], dtype=np.int64)
    direct = mx[inv[0]]
    most, total = mx[inv[1]], sm[inv[1]]
    elems = np.where(layout_row, route_elems[route_of], prefix_elems[:, None]) + most
    return ReshardTable(haves, needs, mesh, dtype_bytes, elems, direct, most, total, payload, route_of,
                        (lays, tuple(deps)), tuple(prefix))


_MIX = np.random.default_rng(0x5EED).integers(1, 1 << 62, size=4096, dtype=np.int64) | 1


def _column_classes(rows: np.ndarray | Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Classes of equal columns of ``rows`` (or of the row blocks stacked): (a representative
    column per class, class of each column).

    Columns are grouped by a random linear hash (matrix-vector products, wrapping int64, block
    by block: the stacked matrix is never built), then every column is compared with its class
    representative; a collision, however unlikely, falls back to an exact lexicographic
    grouping, so the classes are always exact.
    """
    mats = [rows] if isinstance(rows, np.ndarray) else list(rows)
    k = sum(t.shape[0] for t in mats)
    mix = _MIX[:k] if k <= len(_MIX) else np.random.default_rng(k).integers(1, 1 << 62, size=k, dtype=np.int64) | 1
    h = np.zeros(mats[0].shape[1], dtype=np.int64)
    off = 0
    with np.errstate(over="ignore"):
        for t in mats:  # sum_i mix_i row_i, in the same wrapping arithmetic as one product
            h += mix[off:off + t.shape[0]] @ t
            off += t.shape[0]
    _u, rep, cls = np.unique(h, return_index=True, return_inverse=True)
    cls = cls.reshape(-1)
    if len(rep) == len(h):
        return rep, cls  # every hash distinct: equal columns hash alike, so every column is its own class
    col = rep[cls]
    if not all(np.array_equal(t[:, col], t) for t in mats):
        _u, rep, cls = np.unique(np.concatenate(mats, axis=0), axis=1, return_index=True, return_inverse=True)
        cls = cls.reshape(-1)
    return rep, cls


def _support(rows: np.ndarray, mesh: DeviceMesh) -> np.ndarray:
    """Bit ``a`` of entry ``r``: row ``r`` (a value per device) is not constant along mesh axis ``a``."""
    out = np.zeros(len(rows), dtype=np.int64)
    grid = rows.reshape(len(rows), *mesh.shape)
    for a in range(len(mesh.shape)):
        if mesh.shape[a] > 1:
            varies = (grid != np.take(grid, [0], axis=a + 1)).reshape(len(rows), -1).any(axis=1)
            out |= varies.astype(np.int64) << a
    return out


def _terms(region: Region) -> list[tuple[int, tuple]] | None:
    """A union of products as signed products, ``|U P_i ∩ L| = sum_t s_t |T_t ∩ L|`` for every
    product ``L`` (inclusion-exclusion; disjoint pieces add up). None when some device is
    counted by isl or an intersection of pieces is not closed-form there."""
    pieces = region.pieces
    if not pieces or region.fallback.any():
        return None
    if len(pieces) == 1 or region.disjoint:
        return [(1, pc) for pc in pieces]
    if len(pieces) > 4:
        return None
    out: list[tuple[int, tuple]] = []
    ndev = len(region.fallback)
    for r in range(1, len(pieces) + 1):
        for subset in itertools.combinations(pieces, r):
            prod = subset[0]
            for q in subset[1:]:
                prod, bad = _intersect_products(prod, q)
                if bad.any():
                    return None
            if r > 1 and not _product_count(prod, ndev).any():
                continue  # empty on every device
            out.append((1 if r % 2 else -1, prod))
    return out


def _missing_pairs(needs: Sequence[Distribution], others: Sequence[Distribution], pn: np.ndarray, po: np.ndarray,
                   mesh: DeviceMesh) -> tuple[np.ndarray, np.ndarray]:
    """``max_p`` and ``sum_p`` of ``|needs[pn[k]](p) \\ others[po[k]](p)|`` for each pair ``k`` (exact).

    Each set is a signed sum of products (:func:`_terms`), so
    ``|N(p) ∩ O(p)| = sum_{t,u} s_t s_u prod_k c_k(p)`` with ``c_k`` the memoised
    one-dimensional overlaps of the terms' axes; that is evaluated for all pairs at once,
    per group of pairs whose counts vary along the same mesh axes (on one slice of the
    mesh, weighted by the devices it stands for), over classes of devices equal in every
    count (see :class:`ReshardTable`). Other pairs: :meth:`Distribution.missing`.
    """
    npairs = len(pn)
    mx = np.zeros(npairs, dtype=np.int64)
    sm = np.zeros(npairs, dtype=np.int64)
    if not npairs:
        return mx, sm
    rank = len(needs[0].shape)
    n_terms = [_terms(n.region) if rank else None for n in needs]
    o_terms = [_terms(o.region) if rank else None for o in others]
    fast = np.array([t is not None for t in n_terms])[pn] & np.array([t is not None for t in o_terms])[po]

    def flat(terms: list) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
        length = np.array([len(t) if t is not None else 0 for t in terms], dtype=np.int64)
        offset = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
        prods = [pc for t in terms if t is not None for _, pc in t]
        sign = np.array([sg for t in terms if t is not None for sg, _ in t] or [0], dtype=np.int64)
        return length, offset, prods, sign

    n_len, n_off, n_prods, n_sign = flat(n_terms)
    o_len, o_off, o_prods, o_sign = flat(o_terms)
    # rows: every (term of the need, term of the other) of every fast pair, pair after pair
    fidx = np.nonzero(fast)[0]
    cnt = n_len[pn[fidx]] * o_len[po[fidx]]
    row_pair = np.repeat(fidx, cnt)
    within = np.arange(len(row_pair)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    row_n = n_off[pn[row_pair]] + within // np.maximum(o_len[po[row_pair]], 1)
    row_o = o_off[po[row_pair]] + within % np.maximum(o_len[po[row_pair]], 1)
    combos: list[np.ndarray] = []
    tables: list[np.ndarray] = []
    for k in range(rank):
        ids: dict[bytes, int] = {}
        n_id = np.array([ids.setdefault(axis_key(pc[k]), len(ids)) for pc in n_prods] or [0], dtype=np.int64)
        ids_o: dict[bytes, int] = {}
        o_id = np.array([ids_o.setdefault(axis_key(pc[k]), len(ids_o)) for pc in o_prods] or [0], dtype=np.int64)
        code = n_id[row_n] * max(len(ids_o), 1) + o_id[row_o]
        uc, first, ci = np.unique(code, return_index=True, return_inverse=True)
        arrays = []
        for c, r in zip(uc, first):
            cnt_k, bad = _axis_common_memo(n_prods[row_n[r]][k], o_prods[row_o[r]][k])
            if bad is not None:
                fast[row_pair[code == c]] = False  # not closed-form on some device: the per-pair path uses isl
            arrays.append(cnt_k)
        combos.append(ci.reshape(-1))
        tables.append(np.stack(arrays) if arrays else np.zeros((0, mesh.size), dtype=np.int64))
    keep = fast[row_pair]
    row_pair, row_n, row_o = row_pair[keep], row_n[keep], row_o[keep]
    combos = [c[keep] for c in combos]
    row_sign = n_sign[row_n] * o_sign[row_o]
    idx = np.nonzero(fast)[0]
    if len(idx):
        ncount = np.zeros((len(needs), mesh.size), dtype=np.int64)
        for a in np.unique(pn[idx]):
            ncount[a] = needs[a].counts()
        # rows of pair idx[q]: [start[q], start[q] + count[q])
        per_pair = np.bincount(np.searchsorted(idx, row_pair), minlength=len(idx))
        start = np.concatenate([[0], np.cumsum(per_pair)[:-1]]).astype(np.int64)
        # the mesh axes each count varies along; a pair's counts are constant along every other axis
        support = _support(ncount, mesh)[pn[idx]]
        row_support = np.zeros(len(row_pair), dtype=np.int64)
        for k in range(rank):
            row_support |= _support(tables[k], mesh)[combos[k]]
        if len(row_pair):
            support |= np.bitwise_or.reduceat(row_support, start)
        for s_mask in np.unique(support):
            group = np.nonzero(support == s_mask)[0]  # positions in idx
            # one slice of the mesh: coordinate 0 on the axes the group's counts do not vary along
            off = [a for a in range(len(mesh.shape)) if not (int(s_mask) >> a) & 1]
            devs = np.nonzero((mesh.coords[:, off] == 0).all(axis=1))[0] if off else np.arange(mesh.size)
            times = math.prod(mesh.shape[a] for a in off)
            sub = [t[:, devs] for t in tables]
            nsub = ncount[:, devs]
            # within the slice, devices equal in every count are one class (translated blocks)
            rep, cls = _column_classes([*sub, nsub])
            if len(rep) == len(devs):  # every device its own class: the columns as they are (max and sum
                weight = np.full(len(devs), times, dtype=np.int64)  # do not depend on their order)
            else:
                weight = np.bincount(cls, minlength=len(rep)).astype(np.int64) * times
                sub = [t[:, rep] for t in sub]
                nsub = nsub[:, rep]
            # the group's rows, pair after pair (pair j of the group: rows roff[j] .. roff[j + 1]), indexed once
            c = per_pair[group]
            rows = np.repeat(start[group], c) + (np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c))
            roff = np.concatenate([[0], np.cumsum(c)])
            g_combos = [cb[rows] for cb in combos]
            g_sign = row_sign[rows]
            signed = not bool((g_sign == 1).all())
            single = bool((c == 1).all())
            g_pairs = idx[group]
            g_need = pn[g_pairs]
            # chunks of ~256 KiB of rows x classes: the products stay in cache
            step = max(1, (1 << 15) // max(len(rep) * int(c.max(initial=1)), 1))
            for s0 in range(0, len(group), step):
                s1 = min(len(group), s0 + step)
                r0, r1 = int(roff[s0]), int(roff[s1])
                prod = sub[0][g_combos[0][r0:r1]] if rank else np.ones((r1 - r0, len(rep)), dtype=np.int64)
                for k in range(1, rank):
                    prod *= sub[k][g_combos[k][r0:r1]]
                if signed:
                    prod *= g_sign[r0:r1, None]
                if single:
                    common = prod  # one term each: no sum to take
                else:  # each pair's rows are consecutive: differences of running sums
                    run = np.cumsum(prod, axis=0)
                    ends = roff[s0 + 1:s1 + 1] - r0 - 1
                    common = run[ends]
                    common[1:] -= run[ends[:-1]]
                miss = nsub[g_need[s0:s1]]
                miss -= common
                mx[g_pairs[s0:s1]] = miss.max(axis=1, initial=0)
                sm[g_pairs[s0:s1]] = miss @ weight
    for k in np.nonzero(~fast)[0]:
        miss = needs[pn[k]].missing(others[po[k]])
        mx[k], sm[k] = int(miss.max(initial=0)), int(miss.sum())
    return mx, sm


@dataclass(frozen=True, eq=False)
class EdgeCosts:
    """Reshard costs of one graph edge for every (producer placement, consumer placement) pair.

    Placements that leave (or need) the same distribution share a row (column) of
    ``table`` (a :class:`ReshardTable`, every pair priced as arrays):
    ``cost(i, j) = table.cell(have_of[i], need_of[j])``; ``elements`` / ``bytes`` are its
    matrices of elements / bytes received per device along the route; ``reshards`` lists
    the :class:`Reshard` of every cell.

    The backward pass moves the gradient the other way (:func:`backward_reshard_edge`):
    ``backward_cost(i, j) = backward_table.cell(grad_have_of[j], grad_need_of[i])``, priced on
    first use (forward-only callers pay nothing for it). A graph input needs no gradient.
    """

    producer_placements: tuple[Placement, ...]
    consumer_placements: tuple[Placement, ...]
    have_of: np.ndarray
    need_of: np.ndarray
    table: ReshardTable
    _backward: Callable[[], tuple[np.ndarray, np.ndarray, ReshardTable]] | None = field(default=None, repr=False)

    @cached_property
    def _backward_tables(self) -> tuple[np.ndarray, np.ndarray, ReshardTable | None]:
        if self._backward is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), None
        return self._backward()

    @property
    def reshards(self) -> tuple[tuple[Reshard, ...], ...]:
        """Distinct forward reshards: rows by producer distribution, columns by consumer need."""
        return self.table.rows()

    @property
    def backward_table(self) -> ReshardTable | None:
        return self._backward_tables[2]

    @property
    def backward(self) -> tuple[tuple[Reshard, ...], ...]:
        """Distinct backward reshards: rows by consumer gradient class, columns by producer need class."""
        t = self._backward_tables[2]
        return t.rows() if t is not None else ()

    def backward_cost(self, i: int, j: int) -> Reshard | None:
        """Gradient reshard for producer placement ``i`` and consumer placement ``j`` (None: no gradient)."""
        grad_have_of, grad_need_of, table = self._backward_tables
        if table is None:
            return None
        return table.cell(int(grad_have_of[j]), int(grad_need_of[i]))

    @property
    def elements(self) -> np.ndarray:
        return self.table.elements

    @property
    def bytes(self) -> np.ndarray:
        return self.table.elements * self.table.dtype_bytes

    def cost(self, i: int, j: int) -> Reshard:
        return self.table.cell(int(self.have_of[i]), int(self.need_of[j]))

    @property
    def pairs(self) -> int:
        return len(self.producer_placements) * len(self.consumer_placements)


def _distinct(placements: Sequence[Any], dist_of: Callable[[Any], Distribution]) -> tuple[np.ndarray,
                                                                                       list[Distribution]]:
    """The distinct distributions ``dist_of(p)`` over ``placements`` (by :func:`_dedupe_key`),
    ordered by that key (edges with the same sets then share one :func:`reshard_table`), and
    for each placement the index of its distribution among them."""
    index: dict = {}
    of = np.zeros(len(placements), dtype=np.int64)
    for i, p in enumerate(placements):
        d = dist_of(p)
        of[i] = index.setdefault(_dedupe_key(d), (len(index), d))[0]
    keys = list(index)
    order = np.argsort(np.asarray(keys, dtype=np.int64), kind="stable")
    pos = np.empty(len(keys), dtype=np.int64)
    pos[order] = np.arange(len(keys))
    return pos[of], [index[keys[k]][1] for k in order]


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
    psig = _signature(graph, prod) if prod is not None else ("input", graph.shape(tensor))
    out_idx = prod.outputs.index(tensor) if prod is not None else 0
    # the default placements (all legal ones) are a function of the signatures and the mesh: keyed as
    # None, so a repeated layer's lookup hashes no list of placements
    pkey = None if producer_placements is None else tuple(producer_placements)
    ckey = None if consumer_placements is None else tuple(consumer_placements)
    key = (psig, out_idx, _signature(graph, consumer), operand, mesh, pkey, ckey, graph.tensors[tensor].dtype)
    hit = CACHE.hit("edge", key)
    if hit is not MISSING:
        return hit

    def make() -> EdgeCosts:
        pp_ = pkey if pkey is not None else \
            tuple(legal_placements(graph, prod, mesh) if prod is not None else [Placement()])
        cp_ = ckey if ckey is not None else tuple(legal_placements(graph, consumer, mesh))
        nbytes = DTYPE_BYTES.get(graph.tensors[tensor].dtype, 4)
        # every placement's distribution in one batch, then grouped by what it holds / needs
        outs = dict(zip(pp_, _op_distributions(graph, prod, pp_, mesh, f"out{out_idx}", True))) if prod is not None \
            else {}
        ins = dict(zip(cp_, _op_distributions(graph, consumer, cp_, mesh, operand, False)))
        have_of, haves = _distinct(pp_, lambda p: outs[p] if prod is not None
                                   else layout_distribution(TensorLayout.replicated(graph.shape(tensor)), mesh))
        need_of, needs = _distinct(cp_, ins.__getitem__)
        table = reshard_table(haves, needs, mesh, dtype_bytes=nbytes)

        def backward() -> tuple[np.ndarray, np.ndarray, ReshardTable]:
            grad_need_of, gneeds = _distinct(
                pp_, lambda p: grad_needed(graph, prod, p, mesh, out_idx, reader=(consumer, operand)))
            grad_have_of, ghaves = _distinct(cp_, lambda p: grad_held(graph, consumer, p, mesh, operand))
            return grad_have_of, grad_need_of, reshard_table(ghaves, gneeds, mesh, dtype_bytes=nbytes)

        return EdgeCosts(pp_, cp_, have_of, need_of, table, backward if prod is not None else None)

    return CACHE.get("edge", key, make)


def _dedupe_key(d: Distribution) -> int:
    return d.rid
