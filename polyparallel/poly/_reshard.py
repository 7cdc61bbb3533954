"""Resharding: the route and exact cost from a producer's distribution to a consumer's need.

:func:`reshard` routes one mesh axis at a time, for a block layout ``H`` and need ``N``
(``h(a)``/``n(a)``: the tensor axis that ``H``/``N`` splits on mesh axis ``a``):

1. partial on ``a``: reduce-scatter onto ``n(a)`` when ``N`` splits along ``a``,
   all-reduce otherwise;
2. ``h(a) = -``, ``n(a) = j``: local slice (free: ``a`` splits the held block innermost);
3. ``h(a) = i``, ``n(a) = j != i``: all-to-all over ``a``;
4. ``h(a) = i``, ``n(a) = -``: all-gather over ``a``;
5. what ``N(p)`` still lacks after that (after a route that moves nothing: what it lacks of
   ``H(p)`` itself) is a **halo** when ``N`` extends ``p``'s block along the same mesh axes
   (convolution and pooling windows; axes held whole may be strided or clipped), priced as a
   neighbour exchange over the devices along those axes when every device's need stays within
   its neighbours' blocks; else **p2p**: over the devices along those axes when the need only
   reaches further along them (the keys a causal mask reads: every earlier block), over the
   whole mesh for irregular needs (or the same mesh axes in another order: a permutation).

Each step is priced exactly as the elements ``p`` gains: ``|B'(p) \\ B(p)|`` for
gathers, all-to-all and halos, ``(n-1)|B'(p)|`` for a reduce-scatter over ``n`` devices
(``p`` receives its shard from every peer) and ``2(n-1)ceil(|B(p)|/n)`` for a ring
all-reduce. A route of several steps is the multi-step reshard; ``direct_elements`` is
the exact lower bound ``max_p |N(p) \\ H(p)|`` a single point-to-point exchange needs.
An irregular producer (no block layout) settles its partial sums in place, then sends
what is missing in one exchange. :func:`reshard_edge` applies this to a graph edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from polyparallel.ir import DTYPE_BYTES, Graph, Op, Shape

from ._cache import CACHE
from ._distribution import Distribution, TensorLayout, layout_distribution, operand_need, output_layout
from ._footprint import Prog
from ._mesh import DeviceMesh
from ._placement import Placement

__all__ = ["Reshard", "Step", "reshard", "reshard_edge"]


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
    # a route that moves nothing (local slices only) leaves every device all it held: the last
    # exchange is what the need lacks of the have itself (a replicated input of a conv split over
    # its rows already holds the halo)
    last = cur if any(s.elements for s in steps_14) else lay.shards
    if need_lay is not None:
        direct = _gain(shape, need_lay.shards, lay.shards, mesh)[0]
        most, total, payload = _gain(shape, need_lay.shards, last, mesh)
    else:
        direct = _missing_stats(n, lay.shards)[0]
        most, total, payload = _missing_stats(n, last)
    if most:
        steps.append(_last_exchange(n, last, mesh, most, total, payload))
    return Reshard(str(h), str(n), tuple(steps), direct, dtype_bytes)


def _last_exchange(n: Distribution, cur: Shards, mesh: DeviceMesh, most: int, total: int, payload: int) -> Step:
    """Step 5: what ``n`` still lacks after the route (``cur``), a **halo** when it only extends the
    held blocks: every tensor axis where the need is not a block is either split over the same mesh
    axes as the held block (a window reaching into the neighbours' rows) or not split at all and held
    whole (a strided or clipped window: nothing can be missing along it). A halo is a neighbour
    exchange along its mesh axes (``group``: the devices along them); anything else is an irregular
    point-to-point exchange over the whole mesh."""
    irregular = [i for i, b in enumerate(n.block) if not b]
    split = [i for i in irregular if n.deps[i]]
    along = bool(split) and all(set(n.deps[i]) == set(cur[i]) for i in split) and \
        all(not cur[i] for i in irregular if not n.deps[i])
    axis = split[0] if len(split) == 1 else None
    if along:
        axes = tuple(a for i in split for a in n.deps[i])
        # within reach of the neighbours' blocks: a halo; further (the prefix of keys a causal
        # mask reads): an exchange among the devices along those axes
        near = CACHE.get("neighbours", (n.rid, cur), lambda: _within_neighbours(n, cur, split))
        return Step("halo" if near else "p2p", axes, axis, most, total, payload, mesh.group_size(axes))
    return Step("p2p", tuple(mesh.names), irregular[0] if len(irregular) == 1 else None, most, total, payload,
                mesh.size)


def _within_neighbours(n: Distribution, cur: Shards, split: Sequence[int]) -> bool:
    """Whether every device's need along each tensor axis in ``split`` lies inside its own block of
    ``cur`` and the blocks just before and after it (the blocks along an axis are consecutive
    intervals; a neighbour is the next one, whatever mesh coordinates hold it)."""
    if n.region.fallback.any() or not n.region.pieces:
        return False
    for i in split:
        lo, hi = n.mesh.bounds(n.shape[i], cur[i])
        blocks = sorted({(a, b) for a, b in zip(lo.tolist(), hi.tolist()) if b > a})
        pos = {blk: k for k, blk in enumerate(blocks)}
        reach_lo, reach_hi = lo.copy(), hi.copy()
        for p, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            k = pos.get((a, b))
            if k is None:
                continue
            reach_lo[p] = blocks[k - 1][0] if k > 0 else a
            reach_hi[p] = blocks[k + 1][1] if k + 1 < len(blocks) else b
        for piece in n.region.pieces:
            ax = piece[i]
            if not isinstance(ax, Prog):
                return False
            ax = ax.normal()
            has = ax.n > 0
            first, last = ax.start, ax.start + (ax.n - 1) * ax.step
            if bool((has & ((first < reach_lo) | (last >= reach_hi))).any()):
                return False
    return True


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
    docstring updates these columns for all pairs at once (a method of :class:`_RoutePairs`
    each). A step is priced in closed form where the layouts it moves between have equal
    blocks on every device (even mesh, each extent divisible by its group): a reduce-scatter
    over ``g`` devices receives ``(g-1)|B'|``, an all-reduce ``2(g-1)ceil(|B|/g)``, a gather or
    all-to-all ``|B'| - prod_k min(b'_k, b_k)``
    when along every tensor axis one list of mesh axes is a prefix of the other (the finer
    block lies inside the coarser one of the same device; :func:`_gain`). Other gathers and
    all-to-alls are counted per device as :func:`_gain` does (blocks are products of per-axis
    intervals, so is their intersection), for all distinct (B', B) at once; other reductions
    by the memoised scalar functions :func:`_route` uses, once per distinct (layout, mesh
    axis). The result is exactly :func:`_route`'s, without its Python work per pair
    (``tests/test_poly_fast.py`` compares them on random layouts).
    """
    pairs = _RoutePairs(shape, lays, deps, mesh)
    pairs.settle_partials()
    pairs.slice_locally()
    pairs.all_to_all()
    pairs.all_gather()
    end, ends = pairs.ends()
    return pairs.elems.reshape(len(lays), len(deps)), end.reshape(len(lays), len(deps)), ends


def _split_columns(shards: Sequence[Shards], pos: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per layout (a row) and mesh axis (a column): the tensor axis the mesh axis splits (-1: none)
    and its place in that tensor axis' list of mesh axes (0: outermost)."""
    t = np.full((len(shards), len(pos)), -1, dtype=np.int64)
    r = np.zeros((len(shards), len(pos)), dtype=np.int64)
    for i, sh in enumerate(shards):
        for k, s in enumerate(sh):
            for q, a in enumerate(s):
                t[i, pos[a]], r[i, pos[a]] = k, q
    return t, r


class _RoutePairs:
    """Every (layout, need axes) pair of :func:`_routes` on its way along steps 1-4, one row a pair.

    Per mesh axis ``a`` (a column): ``t[:, a]`` the tensor axis the pair's current layout
    splits on ``a`` (-1: none) and ``r[:, a]`` a rank ordering the mesh axes of one tensor axis
    (outermost first); ``need`` and ``need_r`` the same for the need's mesh axes; ``elems`` the
    elements the steps so far gain. ``b_cur``, ``e_cur`` and ``s_cur`` are the current layout's
    :meth:`blocks` and :meth:`seqs`, kept up to date by the steps. Each step method updates the
    rows it moves, all at once.
    """

    def __init__(self, shape: Shape, lays: Sequence[TensorLayout], deps: Sequence[Shards],
                 mesh: DeviceMesh) -> None:
        H, D, m = len(lays), len(deps), len(mesh.names)
        self.shape, self.mesh, self.m, self.rank = shape, mesh, m, len(shape)
        pos = {a: i for i, a in enumerate(mesh.names)}
        self.size = np.array(mesh.shape, dtype=np.int64)
        th, rh = _split_columns([lay.shards for lay in lays], pos)
        order = np.full((H, m), -1, dtype=np.int64)  # partial axes, in the layout's order
        for i, lay in enumerate(lays):
            for q, a in enumerate(lay.partial):
                order[i, q] = pos[a]
        tn, rn = _split_columns(deps, pos)
        self.P = H * D
        self.t = np.repeat(th, D, axis=0)
        self.r = np.repeat(rh, D, axis=0)
        self.partial_order = np.repeat(order, D, axis=0)
        self.need = np.tile(tn, (H, 1))
        self.need_r = np.tile(rn, (H, 1))
        self.even_mesh = bool(mesh.even)
        self.elems = np.zeros(self.P, dtype=np.int64)
        self.ext = np.asarray(shape, dtype=np.int64)
        self.base = m + 1
        self.rows = np.arange(self.P)
        self.inner = m  # ranks of appended axes: larger than any rank so far (innermost)
        self.b_cur, self.e_cur = self.blocks(self.t)
        self.s_cur = self.seqs(self.t, self.r)

    # ---- layouts as columns: blocks, codes of the lists of mesh axes, distinct rows

    def blocks(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair: the block extents of the layout ``t`` (as if every device's were equal), and
        whether they are (an even mesh, every extent divisible by its group)."""
        # group[k]: the product of the sizes of the mesh axes splitting tensor axis k (contiguous rows)
        tt = np.ascontiguousarray(t.T)
        group = np.ones((self.rank, self.P), dtype=np.int64)
        for a in range(self.m):
            for k in range(self.rank):
                group[k] = np.where(tt[a] == k, group[k] * self.size[a], group[k])
        group = group.T
        return self.ext // group, (self.ext % group == 0).all(axis=1) & self.even_mesh

    def seqs(self, t: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per tensor axis: the ordered list of its mesh axes as a base-(m+1) code (first axis most
        significant, digit = mesh axis + 1) and its length."""
        m, rank, P = self.m, self.rank, self.P
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
            digit = (a + 1) * self.base ** (m - 1 - place)
            for k in range(rank):
                on = tt[a] == k
                code[k] += np.where(on, digit, 0)
                length[k] += on
        return code.T, length.T

    def decode_axes(self, c: int) -> tuple[str, ...]:
        """The list of mesh axes a code of :meth:`seqs` stands for."""
        axes: list[str] = []
        for _ in range(self.m):
            c, dgt = divmod(c, self.base)
            if dgt:
                axes.append(self.mesh.names[dgt - 1])
        return tuple(reversed(axes))

    def decode(self, row: np.ndarray) -> Shards:
        return tuple(self.decode_axes(c) for c in row.tolist())

    def unique_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows of ``rows`` (codes and mesh axes) and the index of each row among them."""
        radix = self.base ** self.m  # every column is a code below it (or a mesh axis)
        if radix ** rows.shape[1] < 1 << 62:  # rows packed into one int: a 1-D unique
            key = rows @ (radix ** np.arange(rows.shape[1], dtype=np.int64))
            _u, first, inv = np.unique(key, return_index=True, return_inverse=True)
            return rows[first], inv.reshape(-1)
        uniq, inv = np.unique(rows, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)

    # ---- prices where blocks differ between devices

    def exact_gains(self, rows: np.ndarray) -> np.ndarray:
        """``max_p |B'(p) \\ B(p)|`` for each row (codes of ``B'`` then of ``B``): :func:`_gain`'s
        per-device interval products, for all rows at once (intervals tabled per distinct list)."""
        rank, mesh = self.rank, self.mesh
        U, ndev = len(rows), mesh.size
        out = np.zeros(U, dtype=np.int64)
        if not rank:
            return out
        tabs = []  # per tensor axis: the distinct lists' interval tables, each row's two entries
        for k in range(rank):
            codes, inv = np.unique(np.concatenate([rows[:, k], rows[:, rank + k]]), return_inverse=True)
            bounds = [mesh.bounds(int(self.shape[k]), self.decode_axes(int(c))) for c in codes]
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

    def exact(self, mask: np.ndarray, cols: np.ndarray, fn: Callable[[np.ndarray], int]) -> np.ndarray:
        """``fn`` of each distinct row of ``cols`` among the pairs in ``mask`` (the scalar, memoised
        prices), as an array over all pairs (0 outside ``mask``)."""
        out = np.zeros(self.P, dtype=np.int64)
        idx = np.nonzero(mask)[0]
        if len(idx):
            uniq, inv = self.unique_rows(cols[idx])
            out[idx] = np.array([fn(u) for u in uniq], dtype=np.int64)[inv]
        return out

    def move(self, t2: np.ndarray, r2: np.ndarray, moved: np.ndarray) -> None:
        """Price the move to (t2, r2) of the pairs in ``moved`` (a gather or an all-to-all) and make it
        their current layout."""
        base, m = self.base, self.m
        b_nxt, e_nxt = self.blocks(t2)
        s_nxt = self.seqs(t2, r2)
        (c1, l1), (c2, l2) = s_nxt, self.s_cur
        cut = base ** (m - np.minimum(l1, l2))
        prefix = (c1 // cut == c2 // cut).all(axis=1)
        closed = e_nxt & self.e_cur & prefix
        g = b_nxt.prod(axis=1) - np.minimum(b_nxt, self.b_cur).prod(axis=1)
        self.elems[moved & closed] += g[moved & closed]
        idx = np.nonzero(moved & ~closed)[0]
        if len(idx):
            uniq, inv = self.unique_rows(np.concatenate([c1, c2], axis=1)[idx])
            self.elems[idx] += self.exact_gains(uniq)[inv]
        sel = moved[:, None]
        self.t, self.r = np.where(sel, t2, self.t), np.where(sel, r2, self.r)
        self.b_cur, self.e_cur = np.where(sel, b_nxt, self.b_cur), np.where(moved, e_nxt, self.e_cur)
        self.s_cur = (np.where(sel, s_nxt[0], self.s_cur[0]), np.where(sel, s_nxt[1], self.s_cur[1]))

    # ---- the steps of the route (module docstring)

    def settle_partials(self) -> None:
        """Step 1, partial sums in the layout's order: a reduce-scatter onto the tensor axis the need
        splits on that mesh axis (innermost), else an all-reduce."""
        shape, mesh, rank, size, rows = self.shape, self.mesh, self.rank, self.size, self.rows
        for q in range(self.m):
            a = self.partial_order[:, q]
            has = a >= 0
            if not has.any():
                continue
            ai = np.maximum(a, 0)
            j = self.need[rows, ai]
            g = size[ai]
            rs = has & (j >= 0)
            ar = has & (j < 0)
            blk = self.b_cur.prod(axis=1)
            self.elems[ar & self.e_cur] += (2 * (g - 1) * (-(-blk // g)))[ar & self.e_cur]
            self.elems[:] += self.exact(
                ar & ~self.e_cur, np.concatenate([self.s_cur[0], ai[:, None]], axis=1),
                lambda u: _all_reduce_of(shape, self.decode(u[:rank]), mesh.names[u[rank]], mesh).elements)
            if rs.any():
                t2, r2 = self.t.copy(), self.r.copy()
                t2[rows[rs], ai[rs]] = j[rs]
                r2[rows[rs], ai[rs]] = self.inner
                self.inner += 1
                b_nxt, e_nxt = self.blocks(t2)
                self.elems[rs & e_nxt] += ((g - 1) * b_nxt.prod(axis=1))[rs & e_nxt]
                self.elems[:] += self.exact(
                    rs & ~e_nxt, np.concatenate([self.seqs(t2, r2)[0], ai[:, None]], axis=1),
                    lambda u: (size[u[rank]] - 1) * _block_stats(shape, self.decode(u[:rank]), mesh)[0])
                sel = rs[:, None]
                self.t, self.r = np.where(sel, t2, self.t), np.where(sel, r2, self.r)
                self.b_cur = np.where(sel, b_nxt, self.b_cur)
                self.e_cur = np.where(rs, e_nxt, self.e_cur)
                self.s_cur = self.seqs(self.t, self.r)

    def slice_locally(self) -> None:
        """Step 2, free local slices: each mesh axis the need splits on and the layout does not, innermost."""
        for a in range(self.m):
            sl = (self.t[:, a] < 0) & (self.need[:, a] >= 0)
            if sl.any():
                self.t, self.r = self.t.copy(), self.r.copy()
                self.t[sl, a], self.r[sl, a] = self.need[sl, a], self.inner
                self.inner += 1
        self.b_cur, self.e_cur = self.blocks(self.t)
        self.s_cur = self.seqs(self.t, self.r)

    def all_to_all(self) -> None:
        """Step 3, all-to-all: the mesh axis moves to the need's tensor axis, whose list is reordered as
        the need's."""
        need = self.need
        for a in range(self.m):
            t, r = self.t, self.r  # as the moves of the mesh axes before left them
            mv = (t[:, a] >= 0) & (need[:, a] >= 0) & (t[:, a] != need[:, a])
            if not mv.any():
                continue
            j = need[:, a]
            t2 = t.copy()
            t2[mv, a] = j[mv]
            on_j = (t2 == j[:, None]) & mv[:, None]
            # _ordered: the need's axes first in its order, then the others as they were
            in_need = need == j[:, None]
            r2 = np.where(on_j, np.where(in_need, self.need_r, r + (1 << 20)), r)
            self.move(t2, r2, mv)

    def all_gather(self) -> None:
        """Step 4, all-gather of the mesh axes the need does not split along, per tensor axis in
        increasing order."""
        for k in range(self.rank):
            ga = (self.t == k) & (self.need < 0)
            mv = ga.any(axis=1)
            if mv.any():
                self.move(np.where(ga, -1, self.t), np.where(ga, 0, self.r), mv)

    def ends(self) -> tuple[np.ndarray, list[Shards]]:
        """The layouts the routes end in: the index of each pair's among them, and the distinct ones."""
        uniq, inv = self.unique_rows(self.seqs(self.t, self.r)[0])
        return inv, [self.decode(u) for u in uniq]


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


CACHE.on_clear(_route.cache_clear, _even_blocks.cache_clear, _block_stats.cache_clear, _all_reduce_of.cache_clear,
               _gain.cache_clear)


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
