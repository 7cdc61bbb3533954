"""Reshard tables: every (have, need) pair of two lists of distributions priced at once, as arrays.

An edge between two ops has a reshard for each producer x consumer placement pair
(:func:`edge_costs`, ~10^4 pairs for an attention edge). :func:`reshard_table` prices them
together: the route's collectives (steps 1-4 of :mod:`._reshard`) depend only on the
have's layout and the need's mesh axes per tensor axis, and the last exchange on
``max_p`` / ``sum_p`` of ``|N(p) \\ L(p)|``, counted for all pairs at once over classes of
devices equal in every count (:func:`_missing_pairs`). Each cell equals what
:func:`reshard` returns for the pair.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from polyparallel.ir import DTYPE_BYTES, Graph, Op

from ._cache import CACHE, MISSING
from ._cache import signature_of as _signature
from ._distribution import Distribution, TensorLayout, _op_distributions, layout_distribution
from ._footprint import Region, _axis_common_memo, _intersect_products, _product_count, axis_key
from ._mesh import DeviceMesh
from ._op_comm import grad_held, grad_needed
from ._placement import Placement, legal_placements
from ._reshard import Reshard, Shards, Step, _all_reduce, _last_exchange, _route, _routes, reshard

__all__ = ["EdgeCosts", "ReshardTable", "edge_costs", "reshard_table"]


@dataclass(frozen=True, eq=False)
class ReshardTable:
    """Every ``reshard(haves[i], needs[j])`` of two lists of distributions, priced as arrays.

    ``elements[i, j]`` is the route's elements per device (:attr:`Reshard.elements`),
    ``direct[i, j]`` its exact lower bound; :meth:`cell` gives the :class:`Reshard` itself,
    assembled on first use from the memoised route and these counts (equal to what
    :func:`reshard` returns for the pair; ``tests/test_poly_fast.py`` compares them). A
    table of at most ``_SMALL_TABLE`` pairs is priced pair by pair (its cells given).

    How (:func:`reshard_table`): the route's collectives (steps 1-4 of
    :mod:`._reshard`) depend only on the have's layout and the need's mesh axes per tensor axis,
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
        if not any(s.elements for s in steps):
            cur = lays[x].shards  # a route that moves nothing: the last exchange is from the have (_reshard)
        if most:
            steps = (*steps, _last_exchange(n, cur, self.mesh, most, int(self.total[i, j]), int(self.payload[j])))
        return Reshard(str(h), str(n), steps, direct, self.dtype_bytes)


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
    # a route that moves nothing leaves the have in place: its last exchange is counted against the have
    o_end = np.where(layout_row & (route_elems[route_of] > 0), route_other[route_of], o_direct)
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
    one-dimensional overlaps of the terms' axes (:func:`_term_pairs`); that is evaluated for
    all pairs at once, per group of pairs whose counts vary along the same mesh axes (on one
    slice of the mesh, weighted by the devices it stands for), over classes of devices equal in
    every count (see :class:`ReshardTable`; :func:`_count_closed_form`). Other pairs:
    :meth:`Distribution.missing`.
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
    rows = _term_pairs(n_terms, o_terms, pn, po, fast, rank, mesh)
    idx = np.nonzero(fast)[0]
    if len(idx):
        _count_closed_form(needs, pn, idx, rows, mesh, mx, sm)
    for k in np.nonzero(~fast)[0]:
        miss = needs[pn[k]].missing(others[po[k]])
        mx[k], sm[k] = int(miss.max(initial=0)), int(miss.sum())
    return mx, sm


@dataclass(frozen=True)
class _TermPairs:
    """The rows of the closed-form count: one per (term ``t`` of the need, term ``u`` of the other)
    of each pair, a pair's rows consecutive, pair after pair. ``|N(p) ∩ O(p)|`` of a pair is the
    sum over its rows of ``sign * prod_k tables[k][combos[k]](p)``."""

    pair: np.ndarray  # the pair of each row
    sign: np.ndarray  # s_t s_u of each row
    combos: list[np.ndarray]  # per tensor axis k: each row's entry in tables[k]
    tables: list[np.ndarray]  # per tensor axis k: the distinct one-dimensional overlaps, a count per device


def _signed_products(terms: Sequence[list | None]) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """The terms of every set in one list: per set its number of terms and the offset of its first,
    then every term's product and sign."""
    length = np.array([len(t) if t is not None else 0 for t in terms], dtype=np.int64)
    offset = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    prods = [pc for t in terms if t is not None for _, pc in t]
    sign = np.array([sg for t in terms if t is not None for sg, _ in t] or [0], dtype=np.int64)
    return length, offset, prods, sign


def _term_pairs(n_terms: Sequence[list | None], o_terms: Sequence[list | None], pn: np.ndarray, po: np.ndarray,
                fast: np.ndarray, rank: int, mesh: DeviceMesh) -> _TermPairs:
    """The rows of the pairs in ``fast``. A pair with a one-dimensional overlap that is not closed-form
    on some device leaves ``fast`` (in place; the per-pair path counts it with isl), and its rows
    are dropped."""
    n_len, n_off, n_prods, n_sign = _signed_products(n_terms)
    o_len, o_off, o_prods, o_sign = _signed_products(o_terms)
    # rows: every (term of the need, term of the other) of every fast pair, pair after pair
    fidx = np.nonzero(fast)[0]
    cnt = n_len[pn[fidx]] * o_len[po[fidx]]
    row_pair = np.repeat(fidx, cnt)
    within = np.arange(len(row_pair)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    row_n = n_off[pn[row_pair]] + within // np.maximum(o_len[po[row_pair]], 1)
    row_o = o_off[po[row_pair]] + within % np.maximum(o_len[po[row_pair]], 1)
    combos, tables = _axis_overlaps(n_prods, o_prods, row_n, row_o, row_pair, fast, rank, mesh)
    keep = fast[row_pair]
    row_n, row_o = row_n[keep], row_o[keep]
    return _TermPairs(row_pair[keep], n_sign[row_n] * o_sign[row_o], [c[keep] for c in combos], tables)


def _axis_overlaps(n_prods: list, o_prods: list, row_n: np.ndarray, row_o: np.ndarray, row_pair: np.ndarray,
                   fast: np.ndarray, rank: int, mesh: DeviceMesh) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per tensor axis ``k``: the distinct one-dimensional overlaps ``|N_k(p) ∩ O_k(p)|`` of the rows'
    (need term, other term) pairs (a count per device, memoised), and each row's index among them.
    A pair with an overlap that is not closed-form on some device leaves ``fast`` (in place)."""
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
    return combos, tables


def _count_closed_form(needs: Sequence[Distribution], pn: np.ndarray, idx: np.ndarray, rows: _TermPairs,
                       mesh: DeviceMesh, mx: np.ndarray, sm: np.ndarray) -> None:
    """``mx``/``sm`` of the pairs ``idx`` (those with rows), in place: the pairs grouped by the mesh axes
    their counts vary along (their support), each group counted on one slice of the mesh
    (:func:`_count_on_slice`)."""
    ncount = np.zeros((len(needs), mesh.size), dtype=np.int64)
    for a in np.unique(pn[idx]):
        ncount[a] = needs[a].counts()
    # rows of pair idx[q]: [start[q], start[q] + count[q])
    per_pair = np.bincount(np.searchsorted(idx, rows.pair), minlength=len(idx))
    start = np.concatenate([[0], np.cumsum(per_pair)[:-1]]).astype(np.int64)
    # the mesh axes each count varies along; a pair's counts are constant along every other axis
    support = _support(ncount, mesh)[pn[idx]]
    row_support = np.zeros(len(rows.pair), dtype=np.int64)
    for table, combo in zip(rows.tables, rows.combos):
        row_support |= _support(table, mesh)[combo]
    if len(rows.pair):
        support |= np.bitwise_or.reduceat(row_support, start)
    for s_mask in np.unique(support):
        group = np.nonzero(support == s_mask)[0]  # positions in idx
        _count_on_slice(int(s_mask), idx[group], start[group], per_pair[group], pn, ncount, rows, mesh, mx, sm)


def _slice_classes(s_mask: int, tables: Sequence[np.ndarray], ncount: np.ndarray,
                   mesh: DeviceMesh) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The slice of the mesh at coordinate 0 on the mesh axes not in ``s_mask``, cut into classes of
    devices equal in every count (translated blocks): the overlap tables and need counts per class,
    and how many devices each class stands for."""
    off = [a for a in range(len(mesh.shape)) if not (s_mask >> a) & 1]
    devs = np.nonzero((mesh.coords[:, off] == 0).all(axis=1))[0] if off else np.arange(mesh.size)
    times = math.prod(mesh.shape[a] for a in off)
    sub = [t[:, devs] for t in tables]
    nsub = ncount[:, devs]
    rep, cls = _column_classes([*sub, nsub])
    if len(rep) == len(devs):  # every device its own class: the columns as they are (max and sum
        return sub, nsub, np.full(len(devs), times, dtype=np.int64)  # do not depend on their order)
    weight = np.bincount(cls, minlength=len(rep)).astype(np.int64) * times
    return [t[:, rep] for t in sub], nsub[:, rep], weight


def _count_on_slice(s_mask: int, pairs: np.ndarray, start: np.ndarray, count: np.ndarray, pn: np.ndarray,
                    ncount: np.ndarray, rows: _TermPairs, mesh: DeviceMesh, mx: np.ndarray, sm: np.ndarray) -> None:
    """``mx``/``sm`` of ``pairs``, whose counts vary along the mesh axes in ``s_mask`` only, in place:
    ``|N(p)|`` less the sum of each pair's rows (``count`` rows from ``start``), over the classes
    of :func:`_slice_classes`, in chunks of pairs."""
    sub, nsub, weight = _slice_classes(s_mask, rows.tables, ncount, mesh)
    rank, width = len(sub), nsub.shape[1]
    # the group's rows, pair after pair (pair j of the group: rows roff[j] .. roff[j + 1]), indexed once
    c = count
    sel = np.repeat(start, c) + (np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c))
    roff = np.concatenate([[0], np.cumsum(c)])
    g_combos = [cb[sel] for cb in rows.combos]
    g_sign = rows.sign[sel]
    signed = not bool((g_sign == 1).all())
    single = bool((c == 1).all())
    g_need = pn[pairs]
    # chunks of ~256 KiB of rows x classes: the products stay in cache
    step = max(1, (1 << 15) // max(width * int(c.max(initial=1)), 1))
    for s0 in range(0, len(pairs), step):
        s1 = min(len(pairs), s0 + step)
        r0, r1 = int(roff[s0]), int(roff[s1])
        prod = sub[0][g_combos[0][r0:r1]] if rank else np.ones((r1 - r0, width), dtype=np.int64)
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
        mx[pairs[s0:s1]] = miss.max(axis=1, initial=0)
        sm[pairs[s0:s1]] = miss @ weight


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
