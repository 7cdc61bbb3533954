"""Exact footprints of all devices at once, vectorised over the mesh.

For a block-distributed statement the share of device ``p`` is a box
``lo_d(p) <= i_d < hi_d(p)`` cut by the statement's constraints. For the affine
accesses of the IR each tensor axis ``j`` of the image is a one-dimensional set, and
the footprint is their product, so counting is a product of one-dimensional counts:

* **index sets.** ``f_j(i) = c + sum_k a_k i_k`` over independent intervals of length
  ``L_k``. Taking the terms by increasing ``|a_k|``, the values form one arithmetic
  progression of step ``g`` and ``n`` points as long as each next ``|a_k|`` is a
  multiple of ``g`` and at most ``g * n`` (no gap opens); then
  ``n <- n + (|a_k| / g) (L_k - 1)``. A stride-2 1x1 convolution gives step 2, a 3x3
  one a contiguous interval; a dilated window over a single output row opens gaps and
  is left to isl. ``ANY`` is the whole axis. Progressions are clipped to ``[0, N)``.
* **constraints.** Affine constraints (a causal ``s - t >= 0``) are propagated into the
  dims' bounds to a fixpoint; for difference constraints this gives the exact
  projection of the domain onto each dim. An access that uses two dims linked by a
  constraint has an image that is not a product (a triangle), and goes to isl.
* **unions and intersections.** The footprint of an operand is the union of its
  accesses' products; intersections of products are products of per-axis
  intersections (interval with progression in closed form, two progressions of equal
  step by congruence), and ``|U_i P_i|`` is inclusion-exclusion over the few pieces.

Devices where some piece is not representable are flagged; :mod:`._distribution` counts those
devices with isl (:mod:`._isl`), exactly.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from polyparallel.ir import ANY, AffineExpr, LoopNest, Statement

from ._mesh import DeviceMesh
from ._placement import Placement

__all__ = ["Grid", "Prog", "Region", "block_axis", "dim_bounds", "grid_cut", "operand_region", "statement_bounds"]

Bounds = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, eq=False)
class Prog:
    """Per-device arithmetic progressions ``start + step * [0, n)`` (arrays over devices)."""

    start: np.ndarray
    step: np.ndarray
    n: np.ndarray
    unit: bool = False  # every step is 1 (an interval): intersections are max/min

    @staticmethod
    def interval(lo: np.ndarray, hi: np.ndarray) -> Prog:
        return Prog(lo, np.ones_like(lo), np.maximum(hi - lo, 0), True)

    def normal(self) -> Prog:
        if self.unit:
            return self
        # a progression of <= 1 point has no meaningful step; step 1 keeps intersections closed-form
        step = np.where(self.n <= 1, 1, self.step)
        start = np.where(self.n <= 0, 0, self.start)
        return Prog(start, step, np.maximum(self.n, 0), bool((step == 1).all()))

    def clip(self, size: int) -> Prog:
        if self.unit and len(self.n) and int(self.n.min()) > 0 and int(self.start.min()) >= 0 and \
                int((self.start + self.n).max()) <= size:
            return self  # nonempty intervals inside [0, size): the intersection below is these arrays
        return self.intersect(Prog.interval(np.zeros_like(self.start), np.full_like(self.start, size)))[0]

    def same(self, other: Prog | Grid) -> bool:
        if self is other:
            return True
        if isinstance(other, Grid):
            return False
        a, b = self.normal(), other.normal()
        return bool(np.array_equal(a.n, b.n) and np.array_equal(a.start, b.start) and np.array_equal(a.step, b.step))

    def intersect(self, other: Prog | Grid) -> tuple[Prog, np.ndarray]:
        """(intersection, per-device mask of devices where it is not closed-form)."""
        if isinstance(other, Grid):
            return other.intersect(self)
        a, b = self.normal(), other.normal()
        if a.unit and b.unit:
            lo = np.maximum(a.start, b.start)
            hi = np.minimum(a.start + a.n, b.start + b.n)
            n = np.maximum(hi - lo, 0)
            return Prog(np.where(n > 0, lo, 0), a.step, n, True), _NO_BAD(len(n))
        # orient so that ``a`` is the one with the larger step
        swap = b.step > a.step
        a, b = (Prog(np.where(swap, b.start, a.start), np.where(swap, b.step, a.step), np.where(swap, b.n, a.n)),
                Prog(np.where(swap, a.start, b.start), np.where(swap, a.step, b.step), np.where(swap, a.n, b.n)))
        g = a.step
        # b is an interval [bl, bh]: keep the terms of a inside it
        bl, bh = b.start, b.start + (b.n - 1) * b.step
        k0 = np.maximum(0, -((a.start - bl) // g))  # ceil((bl - start) / g)
        k1 = np.minimum(a.n - 1, (bh - a.start) // g)
        n_iv = np.maximum(k1 - k0 + 1, 0)
        s_iv = a.start + k0 * g
        # both strided with equal step: congruent starts intersect as a progression
        congruent = ((a.start - b.start) % g) == 0
        n_eq = np.where(congruent, n_iv, 0)
        unsupported = (b.step > 1) & (b.step != a.step) & (a.n > 0) & (b.n > 0)
        n = np.where(b.step == 1, n_iv, n_eq)
        empty = (a.n <= 0) | (b.n <= 0)
        n = np.where(empty, 0, n)
        return Prog(s_iv, g, n).normal(), unsupported


@dataclass(frozen=True, eq=False)
class Grid:
    """Per-device two-level sets ``{start + c h + i : 0 <= h < H, 0 <= i < n}`` with ``c > n``.

    The footprint of a flattened index such as ``d + 64 h`` (heads x head-dim) when ``d``
    is split: ``H`` rows of ``n`` consecutive elements, ``c`` apart. Counted against an
    interval ``[a, b)`` in closed form: ``F(b) - F(a)`` with ``F(x)`` the elements below
    ``x``, ``F = w * #{full rows} + (the one partial row)``.
    """

    start: np.ndarray
    n: np.ndarray
    c: np.ndarray
    H: np.ndarray

    def size(self) -> np.ndarray:
        return np.maximum(self.n, 0) * np.maximum(self.H, 0)

    def same(self, other: object) -> bool:
        return isinstance(other, Grid) and all(np.array_equal(getattr(self, f), getattr(other, f))
                                               for f in ("start", "n", "c", "H"))

    def below(self, x: np.ndarray) -> np.ndarray:
        A = x - self.start
        w = np.maximum(self.n, 0)
        c = np.maximum(self.c, np.maximum(w, 1))
        full = np.clip((A - w) // c + 1, 0, self.H)
        hp = (A - 1) // c
        rest = A - c * hp
        partial = np.where((hp >= 0) & (hp < self.H) & (rest > 0) & (rest < w), rest, 0)
        return full * w + partial

    def count_in(self, iv: Prog) -> np.ndarray:
        """``|self ∩ [a, b)|`` per device: ``F(b) - F(a)`` (:meth:`below`), both ends in one pass."""
        A = np.stack((iv.start + iv.n, iv.start))
        A -= self.start
        w = np.maximum(self.n, 0)
        c = np.maximum(self.c, np.maximum(w, 1))
        # one division: x lies in row q = (A - 1) // c at offset r = A - c q in [1, c]; with w <= c the
        # rows ending at or below x number q + [r >= w] (``below``'s (A - w) // c + 1 where w > 0; w = 0
        # counts nothing either way), and row q is cut (a partial row) where r < w
        q = (A - 1) // c
        r = A - c * q
        whole = r >= w
        full = q + whole
        np.maximum(full, 0, out=full)
        np.minimum(full, self.H, out=full)
        full *= w
        full += np.where((q >= 0) & (q < self.H) & ~whole, r, 0)
        return np.where(iv.n > 0, full[0] - full[1], 0)

    def intersect(self, other: object) -> tuple[Prog, np.ndarray]:
        # a grid cut by another set is not a grid: only counts are closed-form (see count_in)
        z = np.zeros_like(self.start)
        return Prog(z, np.ones_like(z), z, True), np.ones(len(z), dtype=bool)


Axis = Prog | Grid
Product = tuple[Axis, ...]


def _size(a: Axis) -> np.ndarray:
    return a.size() if isinstance(a, Grid) else np.maximum(a.n, 0)


def _axis_common(a: Axis, b: Axis) -> tuple[np.ndarray, np.ndarray]:
    """``|a ∩ b|`` per device, and where that is not closed-form."""
    if isinstance(a, Prog) and isinstance(b, Prog) and a.unit and b.unit:
        # two intervals (n >= 0): what ``intersect`` counts, without building the intersection
        c = np.minimum(a.start + a.n, b.start + b.n)
        c -= np.maximum(a.start, b.start)
        np.maximum(c, 0, out=c)
        return c, _NO_BAD(len(c))
    if isinstance(a, Grid) or isinstance(b, Grid):
        g, o = (a, b) if isinstance(a, Grid) else (b, a)
        if isinstance(o, Grid):
            return _grid_common(g, o)
        o = o.normal()
        bad = (o.step != 1) & (o.n > 1)
        return g.count_in(o), bad
    c, bad = a.intersect(b)
    return c.n, bad


def _grid_common(a: Grid, b: Grid) -> tuple[np.ndarray, np.ndarray]:
    """``|a ∩ b|`` of two grids with the same row period ``c`` (rows at most ``c`` wide).

    With ``b.start - a.start = c q + r`` (``0 <= r < c``), row ``h`` of ``a`` can only meet
    rows ``h - q`` (shifted by ``r``) and ``h - q - 1`` (shifted by ``r - c``) of ``b``: the
    count is ``ov0 * rows0 + ov1 * rows1``, overlaps of two intervals times the number of
    row pairs that exist in both grids. Other periods: not closed-form (isl).
    """
    w1, w2 = np.maximum(a.n, 0), np.maximum(b.n, 0)
    c = np.maximum(a.c, 1)
    same = (a.c == b.c) & (w1 <= c) & (w2 <= c)
    d = b.start - a.start
    q = d // c
    r = d - c * q
    ov0 = np.maximum(np.minimum(w1, r + w2) - r, 0)
    ov1 = np.maximum(np.minimum(w1, r - c + w2), 0)
    h1, h2 = np.maximum(a.H, 0), np.maximum(b.H, 0)
    rows0 = np.maximum(np.minimum(h1, h2 + q) - np.maximum(0, q), 0)
    rows1 = np.maximum(np.minimum(h1, h2 + q + 1) - np.maximum(0, q + 1), 0)
    empty = (w1 == 0) | (w2 == 0) | (h1 == 0) | (h2 == 0)
    count = np.where(empty, 0, ov0 * rows0 + ov1 * rows1)
    return np.where(same, count, 0), ~same & ~empty


_AXIS_MEMO: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray | None]] = {}


def axis_key(a: Axis) -> bytes:
    """A content digest of a per-device 1-D set (memoised on the object: arrays are never mutated)."""
    k = a.__dict__.get("_key")
    if k is None:
        h = hashlib.blake2b(digest_size=16)
        fields = (a.start, a.n, a.c, a.H) if isinstance(a, Grid) else (a.start, a.step, a.n)
        h.update(b"G%d" % len(a.start) if isinstance(a, Grid) else b"P%d" % len(a.start))
        for f in fields:
            if f.dtype != np.int64 or not f.flags.c_contiguous:
                f = np.ascontiguousarray(f, dtype=np.int64)
            # a long field equal on every device (steps, often counts) is hashed as its one value:
            # tagged, so the encoding stays injective and a few KiB of hashing become 9 bytes
            # (short fields are hashed as they are: cheaper than looking)
            if len(f) > _SHORT and f[0] == f[-1] and (f == f[0]).all():
                h.update(b"c" + f[:1].tobytes())
            else:
                h.update(b"a")
                h.update(f.data)
        k = h.digest()
        object.__setattr__(a, "_key", k)
    return k


_SHORT = 128  # devices: fields up to this long are hashed without the equal-values check


def _axis_common_memo(a: Axis, b: Axis) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`_axis_common` memoised by content; the mask is None where every device is closed-form."""
    key = (axis_key(a), axis_key(b))
    hit = _AXIS_MEMO.get(key)
    if hit is None:
        c, bad = _axis_common(a, b)
        c.setflags(write=False)
        hit = (c, bad if bad.any() else None)
        if len(_AXIS_MEMO) > 1 << 16:
            _AXIS_MEMO.clear()
        _AXIS_MEMO[key] = hit
    return hit


def _NO_BAD(n: int) -> np.ndarray:
    return np.zeros(n, dtype=bool)


@dataclass(eq=False)
class Region:
    """A union of products of progressions per device, and the devices it cannot describe.

    ``pieces`` is a list of products (one :class:`Prog` per tensor axis); ``fallback[p]``
    marks devices whose set is not a union of such products (count them with isl);
    ``disjoint``: the pieces never overlap, so counts add up piece by piece.
    """

    shape: tuple[int, ...]
    pieces: list[Product]
    fallback: np.ndarray
    disjoint: bool = False

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-device exact point counts (inclusion-exclusion), and the not-closed-form mask."""
        if self.disjoint:
            n = len(self.fallback)
            return sum((_product_count(pc, n) for pc in self.pieces), np.zeros(n, dtype=np.int64)), \
                self.fallback.copy()
        return _union_count(self.pieces, self.fallback.copy(), len(self.fallback))

    def intersect_counts(self, other: Region) -> tuple[np.ndarray, np.ndarray]:
        """Per-device ``|self ∩ other|`` and the devices that need isl."""
        bad = self.fallback | other.fallback
        if (self.disjoint or len(self.pieces) == 1) and (other.disjoint or len(other.pieces) == 1) and \
                (len(self.pieces) > 1 or len(other.pieces) > 1):
            # disjoint unions: |(U_i P_i) ∩ (U_j Q_j)| = sum_ij |P_i ∩ Q_j|, each a product pair
            total = np.zeros(len(bad), dtype=np.int64)
            for p in self.pieces:
                for q in other.pieces:
                    c, b = Region(self.shape, [p], self.fallback).intersect_counts(Region(self.shape, [q],
                                                                                          other.fallback))
                    total = total + c
                    bad = bad | b
            return total, bad
        if len(self.pieces) == 1 and len(other.pieces) == 1:
            # a product meets a product axis by axis; the few distinct 1-D sets per tensor axis
            # recur across many layout pairs, so their per-device counts are memoised
            total = None
            for a, b in zip(self.pieces[0], other.pieces[0]):
                c, nb = _axis_common_memo(a, b)
                total = c.copy() if total is None else total * c
                if nb is not None:
                    bad = bad | nb
            return (np.ones(len(bad), dtype=np.int64) if total is None else total), bad
        pieces = []
        for p, q in itertools.product(self.pieces, other.pieces):
            prod, nb = _intersect_products(p, q)
            bad |= nb
            pieces.append(prod)
        return _union_count(pieces, bad, len(bad))


def grid_cut(g: Grid, iv: Prog) -> list[Axis]:
    """``g ∩ [lo, hi)`` per device as disjoint pieces: the full rows (a :class:`Grid`) and the
    partial first and last rows (intervals). Rows are ``[start + c h, start + c h + n)``."""
    lo, hi = iv.start, iv.start + np.maximum(iv.n, 0)
    w = np.maximum(g.n, 0)
    c = np.maximum(g.c, np.maximum(w, 1))
    # full rows: start + c h >= lo and start + c h + w <= hi
    h0 = np.maximum(-((g.start - lo) // c), 0)  # ceil((lo - start) / c)
    h1 = np.minimum((hi - w - g.start) // c, g.H - 1)
    nfull = np.maximum(h1 - h0 + 1, 0)
    full = Grid(g.start + c * h0, np.where(nfull > 0, w, 0), c, np.where(nfull > 0, nfull, 1))
    out: list[Axis] = [full]
    ha = (lo - g.start) // c  # the row holding lo
    hb = (hi - 1 - g.start) // c  # the row holding hi - 1
    for h, other in ((ha, None), (hb, ha)):
        row_lo = g.start + c * h
        a = np.maximum(lo, row_lo)
        b = np.minimum(hi, row_lo + w)
        ok = (h >= 0) & (h < g.H) & (b > a) & ~((a == row_lo) & (b == row_lo + w))  # partial rows only
        if other is not None:
            ok &= h != other
        out.append(Prog.interval(np.where(ok, a, 0), np.where(ok, b, 0)))
    return out


def _intersect_products(p: Product, q: Product) -> tuple[Product, np.ndarray]:
    out, bad = [], np.zeros(len(p[0].n) if p else 0, dtype=bool)
    for a, b in zip(p, q):
        c, nb = a.intersect(b)
        out.append(c)
        bad |= nb
    return tuple(out), bad


def _product_count(p: Product, ndev: int) -> np.ndarray:
    c = np.ones(ndev, dtype=np.int64)
    for a in p:
        c = c * _size(a)
    return c


def _union_count(pieces: list[Product], bad: np.ndarray, ndev: int) -> tuple[np.ndarray, np.ndarray]:
    """``|U pieces|`` per device by inclusion-exclusion, pruning subsets whose intersection is
    empty on every device (their supersets are empty too: disjoint pieces cost nothing)."""
    if not pieces:
        return np.zeros(ndev, dtype=np.int64), bad
    uniq = pieces  # operand_region removed duplicate pieces
    if len(uniq) == 1:
        return _product_count(uniq[0], ndev), bad
    if len(uniq) > 8:
        return np.zeros(ndev, dtype=np.int64), np.ones(ndev, dtype=bool)
    total = np.zeros(ndev, dtype=np.int64)
    # depth-first over subsets in increasing index order; (last index, intersection, size)
    stack = [(i, uniq[i], 1) for i in range(len(uniq))]
    while stack:
        i, acc, r = stack.pop()
        c = _product_count(acc, ndev)
        if not c.any():
            continue
        total += c if r % 2 else -c
        for j in range(i + 1, len(uniq)):
            nxt, nb = _intersect_products(acc, uniq[j])
            bad = bad | nb
            stack.append((j, nxt, r + 1))
    return total, bad


def dim_bounds(nest: LoopNest, placement: Placement, mesh: DeviceMesh) -> Bounds:
    """Per device ``[lo, hi)`` of every dim of the nest under the placement."""
    out: Bounds = {}
    for d in nest.dims:
        out[d.name] = mesh.bounds(d.extent, placement.axes_of(d.name))
    return out


def statement_bounds(st: Statement, bounds: Bounds,
                     ndev: int | None = None) -> tuple[Bounds, np.ndarray, np.ndarray, list[set[str]]]:
    """Tighten the box by the statement's constraints.

    Returns (bounds, empty, inexact, linked): ``empty[p]`` when the domain of ``p`` is
    empty, ``inexact[p]`` when propagation is not known to be exact there (not a
    difference constraint), and the groups of dims linked by constraints.
    """
    # tightening replaces arrays, never writes into them: the callers' arrays are shared, not copied
    b = {d: bounds[d] for d in st.dims}
    if ndev is None:
        ndev = len(next(iter(bounds.values()))[0]) if bounds else 1
    inexact = np.zeros(ndev, dtype=bool)
    linked: list[set[str]] = []
    for c in st.constraints:
        ds = set(c.dims)
        merged = [g for g in linked if g & ds]
        for g in merged:
            linked.remove(g)
            ds |= g
        linked.append(ds)
        coefs = [abs(k) for _, k in c.terms]
        if len(c.terms) > 2 or any(k != 1 for k in coefs) or (len(c.terms) == 2 and
                                                              c.terms[0][1] == c.terms[1][1]):
            inexact[:] = True
    for _ in range(len(st.constraints) * len(st.dims) + 1):
        changed = False
        for c in st.constraints:
            for d, k in c.terms:
                # k * x_d >= -const - max(sum of the other terms)
                rest = np.full(ndev, c.const, dtype=np.int64)
                for o, ko in c.terms:
                    if o != d:
                        lo, hi = b[o]
                        rest = rest + np.where(ko > 0, ko * (hi - 1), ko * lo)
                lo, hi = b[d]
                if k > 0:
                    new_lo = np.maximum(lo, -(rest // k))  # ceil(-rest / k)
                    changed |= bool((new_lo != lo).any())
                    b[d] = (new_lo, hi)
                else:
                    new_hi = np.minimum(hi, rest // (-k) + 1)
                    changed |= bool((new_hi != hi).any())
                    b[d] = (lo, new_hi)
        if not changed:
            break
    empty = np.zeros(ndev, dtype=bool)
    for d in st.dims:
        empty |= b[d][1] <= b[d][0]
    return b, empty, inexact, linked


def index_prog(e: AffineExpr, b: Mapping[str, tuple[np.ndarray, np.ndarray]],
               ndev: int) -> tuple[Prog | Grid, np.ndarray]:
    """The values of ``e`` over the box ``b`` per device: a progression, or a :class:`Grid`
    when the last growing term jumps past a contiguous run (``d + 64 h`` with ``d`` split);
    the mask marks devices where it is neither."""
    if len(e.terms) == 1 and abs(e.terms[0][1]) == 1:
        # ``c ± x`` (most accesses): an interval, the loop below specialised to one unit term
        # (same arrays; a dim of length <= 1 keeps one point, emptiness is the caller's mask)
        (d, a), = e.terms
        lo, hi = b[d]
        start = e.const + lo if a > 0 else e.const - (hi - 1)
        return Prog(start, np.ones(ndev, dtype=np.int64), np.maximum(hi - lo, 1), True), np.zeros(ndev, dtype=bool)
    return _index_prog_terms(e, b, ndev)


def _index_prog_terms(e: AffineExpr, b: Mapping[str, tuple[np.ndarray, np.ndarray]],
                      ndev: int) -> tuple[Prog | Grid, np.ndarray]:
    """:func:`index_prog` term by term (the general case; the reference of its one-term fast path)."""
    start = np.full(ndev, e.const, dtype=np.int64)
    step = np.ones(ndev, dtype=np.int64)
    n = np.ones(ndev, dtype=np.int64)
    gc = np.zeros(ndev, dtype=np.int64)
    gh = np.ones(ndev, dtype=np.int64)
    bad = np.zeros(ndev, dtype=bool)
    for d, a in sorted(e.terms, key=lambda t: abs(t[1])):
        lo, hi = b[d]
        length = np.maximum(hi - lo, 0)
        start = start + np.where(a > 0, a * lo, a * (hi - 1))
        aa = abs(a)
        trivial = length <= 1
        gridded = gh > 1
        first = (n == 1) & ~trivial & ~gridded
        fits = (aa % step == 0) & (aa <= step * n) & ~gridded
        grow = ~trivial & ~first & fits
        to_grid = ~trivial & ~first & ~fits & ~gridded & (step == 1)
        bad |= ~trivial & ~first & ~fits & ~to_grid
        n_new = np.where(first, length, np.where(grow, n + (aa // step) * (length - 1), n))
        step = np.where(first, aa, step)
        gc = np.where(to_grid, aa, gc)
        gh = np.where(to_grid, length, gh)
        n = n_new
    if (gh > 1).any():
        bad |= (gh == 1) & (step != 1) & (n > 1)
        return Grid(start, n, gc, gh), bad
    return Prog(start, step, n), bad


def operand_region(nest: LoopNest, operand: str, shape: Sequence[int], bounds: Bounds, *,
                   writes: bool | None = None, ndev: int | None = None) -> Region:
    """Footprint of every device on ``operand`` (optionally only write or only read accesses)."""
    if ndev is None:
        ndev = len(next(iter(bounds.values()))[0]) if bounds else 1
    pieces: list[Product] = []
    fallback = np.zeros(ndev, dtype=bool)
    tight: dict[int, tuple] = {}  # statement_bounds once per statement, not once per access
    for st, acc, is_write in nest.accesses(operand):
        if writes is not None and is_write != writes:
            continue
        if len(acc.index) != len(shape):
            raise ValueError(f"access {acc} has {len(acc.index)} indices but the tensor has shape {list(shape)}")
        if id(st) not in tight:
            tight[id(st)] = statement_bounds(st, bounds, ndev)
        b, empty, inexact, linked = tight[id(st)]
        used = [set(e.dims) for e in acc.index if e is not ANY]
        for g in linked:
            touching = [u for u in used if u & g]
            if len(touching) > 1 or any(len(u & g) > 1 for u in touching):
                fallback[:] = True  # the image is not a product of projections
            if touching:
                fallback |= inexact
        axes = []
        any_empty = bool(empty.any())
        for e, size in zip(acc.index, shape):
            if e is ANY:
                p = Prog.interval(np.zeros(ndev, dtype=np.int64), np.full(ndev, max(size, 0), dtype=np.int64))
            else:
                p, bad = index_prog(e, b, ndev)
                fallback |= bad
                if isinstance(p, Grid):
                    last = p.start + p.c * (p.H - 1) + p.n - 1
                    fallback |= (p.start < 0) | (last >= size)  # a grid is not clipped
                    axes.append(Grid(p.start, np.where(empty, 0, p.n), p.c, p.H))
                    continue
                p = p.clip(size)
            if p.unit:
                # an interval with start 0 wherever it is empty (clip and the ANY axis give that):
                # what ``normal()`` would return, without its passes over the devices
                if any_empty:
                    p = Prog(np.where(empty, 0, p.start), p.step, np.where(empty, 0, p.n), True)
                axes.append(p)
                continue
            axes.append(Prog(p.start, p.step, np.where(empty, 0, p.n)).normal())
        piece = tuple(axes)
        if not any(all(a.same(b) for a, b in zip(piece, q)) for q in pieces):
            pieces.append(piece)
    return Region(tuple(shape), pieces, fallback)


def block_axis(mesh: DeviceMesh, extent: int, axes: Sequence[str]) -> Prog:
    """The block of every device of ``[0, extent)`` split over ``axes``, as an interval: one shared,
    read-only object per (mesh, extent, axes), so every layout and every footprint equal to that
    block (``Distribution.block``) carries the same object, its digest taken and its overlaps
    with other sets memoised once."""
    key = (mesh, extent, tuple(axes))
    hit = _BLOCK_AXES.get(key)
    if hit is None:
        lo, hi = mesh.bounds(extent, key[2])
        n = np.maximum(hi - lo, 0)
        step = np.ones(len(lo), dtype=np.int64)
        for arr in (n, step):
            arr.setflags(write=False)
        if len(_BLOCK_AXES) > 1 << 16:
            _BLOCK_AXES.clear()
        hit = _BLOCK_AXES[key] = Prog(lo, step, n, True)
    return hit


_BLOCK_AXES: dict[tuple, Prog] = {}


def layout_region(shape: Sequence[int], shards: Sequence[Sequence[str]], mesh: DeviceMesh) -> Region:
    """The block of every device under a block layout (tensor axis ``i`` split over ``shards[i]``)."""
    axes = tuple(block_axis(mesh, n, s) for n, s in zip(shape, shards))
    return Region(tuple(shape), [axes], np.zeros(mesh.size, dtype=bool))
