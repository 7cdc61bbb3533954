"""Per-device distributions of tensors: what every device holds of a tensor, or needs of it.

Notation: device ``p``; ``H_T(p)`` the elements of tensor ``T`` that the producer's
placement leaves on ``p`` (its write footprint); ``N_T(p)`` the consumer's read
footprint. The data ``p`` must receive is ``N_T(p) \\ H_T(p)``, counted exactly
(``|N| - |N ∩ H|``, products of per-axis progressions, isl where that is not closed-form).

A :class:`TensorLayout` is a block layout (tensor axis ``i`` split over mesh axes
``shards[i]``, Partial on others); :func:`layout_distribution` gives its
:class:`Distribution`. An op under a placement leaves :func:`output_layout` on each device
(Partial on the mesh axes of the split dims its statements reduce) and reads
:func:`operand_need`. A :class:`Distribution` counts each device's set and its
intersection with another distribution's exactly (:meth:`Distribution.counts`,
:meth:`Distribution.common`, :meth:`Distribution.missing`).

The distributions of an operand under many placements are built in one batch: the
footprints of :mod:`._footprint` are elementwise over devices, so ``k`` placements on
``n`` devices are one computation over ``k n`` virtual devices (:func:`_op_distributions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import islpy as isl
import numpy as np

from polyparallel.ir import ANY, Graph, LoopNest, Op, Shape

from ._cache import CACHE
from ._cache import signature_of as _signature
from ._footprint import (
    _AXIS_MEMO,
    _BLOCK_AXES,
    Grid,
    Prog,
    Region,
    axis_key,
    block_axis,
    dim_bounds,
    layout_region,
    operand_region,
)
from ._isl import count, footprint_set, tensor_box
from ._mesh import DeviceMesh
from ._placement import _KIND_MEMO, _LEGAL_MEMO, _PAD_MEMO, Placement, check_placement

__all__ = ["Distribution", "TensorLayout", "layout_distribution", "operand_need", "output_layout"]


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
    placement's representative devices (None: all). A single placement is computed over
    the real devices directly.
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
    """For each tensor axis, the dims its accesses use, largest coefficient first, first occurrence kept,
    then the dims the statement's constraints link to them: under a causal or sliding-window mask
    ``s - t >= 0`` the keys ``k[t]`` a device reads depend on its block of queries ``s`` (a prefix,
    or a window reaching into the previous block), not on ``t``'s split alone."""
    dims: list[dict[str, None]] = [{} for _ in range(rank)]
    for st, acc, is_write in nest.accesses(operand):
        if is_write != writes:
            continue
        for j, e in enumerate(acc.index):
            if e is ANY:
                continue
            for d, _c in sorted(e.terms, key=lambda t: -abs(t[1])):
                dims[j].setdefault(d)
            linked = set(e.dims)
            for _ in range(len(st.constraints)):
                grow = {d for c in st.constraints if set(c.dims) & linked for d in c.dims} - linked
                if not grow:
                    break
                linked |= grow
            for c in st.constraints:
                for d in c.dims:
                    if d in linked:
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


CACHE.on_clear(_AXIS_MEMO.clear, _RIDS.clear, _SIDE_MEMO.clear, _NEST_MEMO.clear, _LEGAL_MEMO.clear, _KIND_MEMO.clear,
               _PAD_MEMO.clear, _BLOCK_AXES.clear, _has_empty_block.cache_clear, _BOUNDS_MEMO.clear)
