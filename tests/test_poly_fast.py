"""The batched paths of the polyhedral model equal the per-pair / per-placement paths they replace.

* :func:`reshard_table` (every (have, need) pair of an edge as arrays, routes shared, device
  classes by mesh symmetry) against :func:`_reshard._reshard`, the per-pair route and count;
* distributions and op collectives of many placements computed side by side on virtual
  devices against one placement at a time (a batch of one is the per-placement code);
* the table's exact lower bound against a numpy enumeration of what each device lacks.

Meshes include 3:1 weights and extents that do not divide (uneven blocks).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polyparallel as pp
from polyparallel import poly
from polyparallel.models import load_model
from polyparallel.poly import (
    CACHE,
    DeviceMesh,
    _distribution,
    _op_comm,
    _reshard,
    _reshard_table,
    layout_distribution,
    reshard_table,
)
from polyparallel.transforms import canonicalize, fuse_elementwise

from .layouts import draw_layout, layout_touched, most_lacked

SETTINGS = settings(max_examples=int(os.environ.get("POLY_EXAMPLES", "8")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MESHES = ["dp=2,tp=2", "dp=2[3:1],tp=2", "a=3,b=2", "a=2,b=2[1:3],c=2"]


@pytest.fixture(scope="module")
def gpt():
    model, args, kwargs = load_model("gpt-tiny", batch_size=2, seq_len=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuse_elementwise(canonicalize(pp.capture(model, args, kwargs)))


def _edges(g):
    seen, out = set(), []
    for op in g.ops:
        for i, t in enumerate(op.inputs):
            prod = g.producer(t)
            if g.tensors[t].is_param or prod is None:
                continue
            key = (g.signature(prod), prod.outputs.index(t), g.signature(op), i)
            if key not in seen:
                seen.add(key)
                out.append((t, op, i))
    return out


def _same_table(table, mesh) -> int:
    n = 0
    for i, h in enumerate(table.haves):
        for j, need in enumerate(table.needs):
            ref = _reshard._reshard(h, need, mesh, table.dtype_bytes)
            got = table.cell(i, j)
            assert got == ref, (i, j, str(got), str(ref))
            assert table.elements[i, j] == ref.elements and table.direct[i, j] == ref.direct_elements
            n += 1
    return n


@SETTINGS
@given(data=st.data())
def test_edge_tables_equal_the_per_pair_reshard(gpt, data):
    """Every forward and backward cell of a captured GPT's edges (the attention reads of the fused
    qkv, norms, the MLP) equals the per-pair route and exact count."""
    mesh = DeviceMesh.parse(data.draw(st.sampled_from(MESHES)))
    edges = _edges(gpt)
    t, op, i = edges[data.draw(st.integers(0, len(edges) - 1))]
    CACHE.clear()
    ec = poly.edge_costs(gpt, t, op, f"in{i}", mesh)
    cells = _same_table(ec.table, mesh) + _same_table(ec.backward_table, mesh)
    assert cells == ec.table.elements.size + ec.backward_table.elements.size > 0
    # the placement-level lookups go through the table
    for a in range(0, len(ec.producer_placements), 7):
        for b in range(0, len(ec.consumer_placements), 5):
            h = _distribution.output_layout(gpt, gpt.producer(t), ec.producer_placements[a], mesh,
                                    gpt.producer(t).outputs.index(t))
            need = _distribution.operand_need(gpt, op, ec.consumer_placements[b], mesh, f"in{i}")
            assert ec.cost(a, b) == _reshard._reshard(h, need, mesh, ec.table.dtype_bytes)


def test_attention_reads_of_the_fused_qkv_on_a_three_axis_mesh(gpt):
    """The edges the batching was built for (10^4 pairs at scale), on a 3:1 three-axis mesh."""
    mesh = DeviceMesh.parse("a=2[3:1],b=2,c=2")
    CACHE.clear()
    n = 0
    for t, op, i in _edges(gpt):
        if op.kind.name == "ATTENTION" and i == 0:
            n += _same_table(poly.edge_costs(gpt, t, op, f"in{i}", mesh).table, mesh)
    assert n > 500


@SETTINGS
@given(data=st.data())
def test_batched_distributions_and_op_collectives_equal_one_placement_at_a_time(gpt, data):
    mesh = DeviceMesh.parse(data.draw(st.sampled_from(MESHES)))
    op = gpt.ops[data.draw(st.integers(0, len(gpt.ops) - 1))]
    legal = poly.legal_placements(gpt, op, mesh)
    CACHE.clear()
    batch = _op_comm._comm_of_ops(gpt, op, legal, mesh)
    for p in legal:
        assert batch[p] == _op_comm._comm_of_ops(gpt, op, [p], mesh)[p]
    operands = [(f"in{j}", False) for j in range(len(op.inputs))] + [(f"out{j}", True) for j in range(len(op.outputs))]
    for operand, writes in operands:
        many = _distribution._build_distributions(gpt, op, legal, mesh, operand, writes)
        for p in legal:
            one = _distribution._build_distributions(gpt, op, [p], mesh, operand, writes)[p]
            d = many[p]
            assert (d.deps, d.block, d.partial, str(d.layout)) == (one.deps, one.block, one.partial, str(one.layout))
            assert np.array_equal(d.counts(), one.counts())
            assert np.array_equal(d.region.fallback, one.region.fallback)
            assert len(d.region.pieces) == len(one.region.pieces)
            assert all(a.same(b) for pa, pb in zip(d.region.pieces, one.region.pieces) for a, b in zip(pa, pb))
            assert d.reshard_key[:1] == one.reshard_key[:1] and d.reshard_key[1:] == one.reshard_key[1:]


def _batch_mismatches(g, op, mesh) -> tuple[int, int]:
    """(operand distributions of all legal placements built as one batch that differ from the
    same placement built alone, distributions compared)."""
    legal = poly.legal_placements(g, op, mesh)
    operands = [(f"in{j}", False) for j in range(len(op.inputs))] + [(f"out{j}", True) for j in range(len(op.outputs))]
    bad = n = 0
    for operand, writes in operands:
        CACHE.clear()
        many = _distribution._build_distributions(g, op, legal, mesh, operand, writes)
        for p in legal:
            one = _distribution._build_distributions(g, op, [p], mesh, operand, writes)[p]
            d = many[p]
            n += 1
            bad += not (np.array_equal(d.counts(), one.counts()) and d.block == one.block and
                        np.array_equal(d.region.fallback, one.region.fallback) and
                        len(d.region.pieces) == len(one.region.pieces) and
                        all(a.same(b) for pa, pb in zip(d.region.pieces, one.region.pieces) for a, b in zip(pa, pb)))
    return bad, n


def test_batched_footprints_keep_every_mesh_axis_the_footprint_feels(gpt, monkeypatch):
    """A batch computes one placement per way of splitting the dims its operand's footprint can
    feel (``_felt_splits``: the dims the accesses index, the dims a constraint links (causal
    attention: a query row's keys), dims with an empty block (a 1:10 axis over an extent of
    2)), over one virtual device per coordinate of their mesh axes, and shares the sets with the
    placements that differ only elsewhere. Exact on such meshes; a rule that forgets the
    constraints or the empty blocks gives wrong footprints, and this comparison sees it."""
    ops = {op.name: op for op in gpt.ops}
    cases = [(ops["scaled_dot_product_attention"], DeviceMesh.parse("a=2,b=3")),
             (ops["linear_2"], DeviceMesh.parse("a=2[1:10],b=2"))]
    for op, mesh in cases:
        bad, n = _batch_mismatches(gpt, op, mesh)
        assert bad == 0 and n > 20
    # a virtual device kept on the slice at coordinate 0 of every other axis: e.g. the empty
    # batch block on the 1:10 axis would stand for the nonempty one
    from polyparallel.ir import ANY

    def indexed_only(nest, placement, mesh, operand, writes):
        dims = {d for _st, acc, w in nest.accesses(operand) if w == writes for e in acc.index if e is not ANY
                for d in e.dims}
        return tuple((d, ax) for d, ax in placement.splits if d in dims)

    monkeypatch.setattr(_distribution, "_felt_splits", indexed_only)
    for op, mesh in cases:
        assert _batch_mismatches(gpt, op, mesh)[0] > 0, op.name


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_table_of_layouts_against_numpy_enumeration(data):
    """Random block layouts on uneven meshes: every cell equals the per-pair reshard, and the
    direct bound is what a numpy enumeration says the neediest device lacks."""
    mesh = DeviceMesh.parse(data.draw(st.sampled_from(["a=2", "a=2[3:1],b=2", "a=3,b=2", "a=2,b=2,c=2[1:3]"])))
    shape = tuple(data.draw(st.sampled_from([2, 3, 5, 6, 8])) for _ in range(data.draw(st.integers(1, 3))))

    haves = list({str(x): x for x in (draw_layout(data, mesh, shape, True) for _ in range(4))}.values())
    needs = list({str(x): x for x in (draw_layout(data, mesh, shape, False) for _ in range(4))}.values())
    CACHE.clear()
    hd = [layout_distribution(x, mesh) for x in haves]
    nd = [layout_distribution(x, mesh) for x in needs]
    table = _reshard_table._reshard_table(tuple(hd), tuple(nd), mesh, 4)  # the array path, however small
    _same_table(table, mesh)
    small = reshard_table(hd, nd, mesh)  # <= 16 pairs: priced pair by pair
    assert np.array_equal(small.elements, table.elements) and np.array_equal(small.direct, table.direct)
    for i, h in enumerate(haves):
        for j, n in enumerate(needs):
            assert table.direct[i, j] == most_lacked(h, n, mesh)


ROUTE_MESHES = ["a=2,b=2,c=2", "a=4,b=2", "a=2,b=3,c=2", "a=2[3:1],b=2", "a=2,b=2,c=2[1:3]"]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_vectorised_routes_equal_the_scalar_route(data):
    """``_routes`` (every (layout, need axes) route in numpy, closed forms where blocks are even)
    against ``_route`` pair by pair: the same summed elements and the same final layout, on
    even meshes (closed forms, divisible or not) and 3:1 meshes (every step exact per device)."""
    mesh = DeviceMesh.parse(data.draw(st.sampled_from(ROUTE_MESHES)))
    shape = tuple(data.draw(st.sampled_from([2, 4, 5, 8, 12])) for _ in range(data.draw(st.integers(1, 3))))
    lays = list({x: None for x in (draw_layout(data, mesh, shape, True, any_order=True) for _ in range(6))})
    deps = list({x.shards: None for x in (draw_layout(data, mesh, shape, False, any_order=True) for _ in range(6))})
    CACHE.clear()
    elements, end, ends = _reshard._routes(shape, lays, deps, mesh)
    for x, lay in enumerate(lays):
        for d, dk in enumerate(deps):
            steps, cur = _reshard._route(shape, lay.shards, lay.partial, dk, mesh)
            assert ends[end[x, d]] == cur, (str(lay), dk)
            assert elements[x, d] == sum(s.elements for s in steps), (str(lay), dk, [str(s) for s in steps])


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_gain_against_numpy_enumeration(data):
    """``_gain`` (closed form for nested even blocks, per-device interval products otherwise) is
    what a numpy enumeration of each device's blocks says it gains."""
    mesh = DeviceMesh.parse(data.draw(st.sampled_from(ROUTE_MESHES)))
    shape = tuple(data.draw(st.sampled_from([2, 4, 5, 8])) for _ in range(data.draw(st.integers(1, 3))))
    nxt = draw_layout(data, mesh, shape, False, any_order=True).shards
    cur = draw_layout(data, mesh, shape, False, any_order=True).shards
    CACHE.clear()
    gained, size = [], []
    for p in range(mesh.size):
        blocks = []
        for shards in (nxt, cur):
            arr = np.zeros(shape, dtype=bool)
            idx = []
            for ext, s in zip(shape, shards):
                lo, hi = mesh.bounds(ext, s)
                idx.append(slice(int(lo[p]), int(hi[p])))
            arr[tuple(idx)] = True
            blocks.append(arr)
        gained.append(int((blocks[0] & ~blocks[1]).sum()))
        size.append(int(blocks[0].sum()))
    assert _reshard._gain(shape, nxt, cur, mesh) == (max(gained), sum(gained), max(size))


def test_column_classes_are_exact_even_when_the_hash_collides(monkeypatch):
    rows = np.array([[1, 2, 1, 3, 2], [0, 5, 0, 5, 5]], dtype=np.int64)
    rep, cls = _reshard_table._column_classes(rows)
    assert np.array_equal(rows[:, rep][:, cls], rows) and len(rep) == 3
    distinct = np.array([[1, 2, 1, 3], [0, 5, 5, 5]], dtype=np.int64)  # every column differs: singletons
    rep, cls = _reshard_table._column_classes(distinct)
    assert np.array_equal(distinct[:, rep][:, cls], distinct) and sorted(rep.tolist()) == [0, 1, 2, 3]
    # a hash that maps every column to one value: the exact grouping takes over
    monkeypatch.setattr(_reshard_table, "_MIX", np.zeros(4096, dtype=np.int64))
    rep, cls = _reshard_table._column_classes(rows)
    assert np.array_equal(rows[:, rep][:, cls], rows) and len(rep) == 3


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_one_term_index_prog_equals_the_term_loop(data):
    """``index_prog`` of ``c ± x`` (the interval fast path) gives the very arrays of the general
    term loop, on uneven / empty / one-point per-device bounds, and the footprints built from
    it (clipped, empty devices zeroed) equal a numpy enumeration of the access."""
    from polyparallel.ir import AffineExpr
    from polyparallel.poly import _footprint as fp

    ndev = data.draw(st.integers(1, 6))
    lo = np.array(data.draw(st.lists(st.integers(-3, 9), min_size=ndev, max_size=ndev)), dtype=np.int64)
    ln = np.array(data.draw(st.lists(st.integers(-2, 6), min_size=ndev, max_size=ndev)), dtype=np.int64)
    b = {"x": (lo, lo + ln)}
    a, c, size = data.draw(st.sampled_from([1, -1])), data.draw(st.integers(-4, 8)), data.draw(st.integers(0, 9))
    e = AffineExpr(((("x", a),)), c)
    got, bad = fp.index_prog(e, b, ndev)
    ref, rbad = fp._index_prog_terms(e, b, ndev)
    assert got.unit and not bad.any() and not rbad.any()
    ref = ref.normal()
    assert np.array_equal(got.start, ref.start) and np.array_equal(got.step, ref.step)
    assert np.array_equal(got.n, ref.n)
    # the clipped footprint of a nonempty device is {c + a x : lo <= x < hi} ∩ [0, size)
    clipped = got.clip(size)
    for p in range(ndev):
        if ln[p] <= 0:
            continue
        pts = {c + a * x for x in range(int(lo[p]), int(lo[p] + ln[p]))} & set(range(size))
        n = int(clipped.n[p])
        assert set(range(int(clipped.start[p]), int(clipped.start[p]) + n)) == pts


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_clip_of_intervals_equals_the_intersection(data):
    """``Prog.clip`` returns an interval inside ``[0, size)`` unchanged; the arrays equal those
    of the general intersection with ``[0, size)`` whether or not that shortcut applies."""
    from polyparallel.poly import _footprint as fp

    ndev = data.draw(st.integers(1, 6))
    lo = np.array(data.draw(st.lists(st.integers(-3, 9), min_size=ndev, max_size=ndev)), dtype=np.int64)
    ln = np.array(data.draw(st.lists(st.integers(0, 6), min_size=ndev, max_size=ndev)), dtype=np.int64)
    size = data.draw(st.integers(0, 12))
    p = fp.Prog.interval(lo, lo + ln)
    got = p.clip(size)
    ref = p.intersect(fp.Prog.interval(np.zeros(ndev, dtype=np.int64), np.full(ndev, size, dtype=np.int64)))[0]
    for f in ("start", "step", "n"):
        assert np.array_equal(getattr(got, f), getattr(ref, f)), f
    assert got.unit and ref.unit


def test_column_classes_of_row_blocks_equal_those_of_the_stacked_rows(monkeypatch):
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 3, (n, 4))[:, rng.integers(0, 4, 40)] for n in (2, 5, 1)]
    stacked = np.concatenate(blocks, axis=0)
    for _ in range(2):  # the hash, then a hash that collides everywhere (the exact grouping)
        rep, cls = _reshard_table._column_classes(blocks)
        rep2, cls2 = _reshard_table._column_classes(stacked)
        assert np.array_equal(rep, rep2) and np.array_equal(cls, cls2)
        assert np.array_equal(stacked[:, rep][:, cls], stacked)
        assert len(rep) == len({tuple(c) for c in stacked.T})
        monkeypatch.setattr(_reshard_table, "_MIX", np.zeros(4096, dtype=np.int64))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_axis_keys_are_equal_exactly_when_the_sets_are(data):
    """``axis_key`` digests short fields as they are and long constant ones as their value: two
    progressions get one key exactly when their arrays are equal, on both sides of that length."""
    from polyparallel.poly import _footprint as fp

    n = data.draw(st.sampled_from([1, 5, fp._SHORT, fp._SHORT + 1, 300]))
    vals = st.sampled_from(["zero", "one", "random"])

    def field(kind: str) -> np.ndarray:
        if kind == "random":
            return np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64)
        return np.full(n, 0 if kind == "zero" else 1, dtype=np.int64)

    a = fp.Prog(*(field(data.draw(vals)) for _ in range(3)))
    b = fp.Prog(*(field(data.draw(vals)) for _ in range(3)))
    same = all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("start", "step", "n"))
    assert (fp.axis_key(a) == fp.axis_key(b)) == same
    copy = fp.Prog(a.start.copy(), a.step[::-1][::-1], np.asarray(a.n, dtype=np.int32))  # strided, other dtype
    assert fp.axis_key(copy) == fp.axis_key(a)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_interval_overlap_fast_path_equals_the_intersection_and_enumeration(data):
    """``_axis_common`` of two intervals (the shortcut that skips building the intersection)
    equals ``Prog.intersect``'s count and a set enumeration, empty intervals included."""
    from polyparallel.poly import _footprint as fp

    ndev = data.draw(st.integers(1, 6))

    def interval() -> fp.Prog:
        lo = np.array(data.draw(st.lists(st.integers(-3, 9), min_size=ndev, max_size=ndev)), dtype=np.int64)
        ln = np.array(data.draw(st.lists(st.integers(-2, 6), min_size=ndev, max_size=ndev)), dtype=np.int64)
        return fp.Prog.interval(lo, lo + ln)

    a, b = interval(), interval()
    got, bad = fp._axis_common(a, b)
    assert not bad.any()
    assert np.array_equal(got, a.intersect(b)[0].n)
    for p in range(ndev):
        sa = set(range(int(a.start[p]), int(a.start[p] + a.n[p])))
        sb = set(range(int(b.start[p]), int(b.start[p] + b.n[p])))
        assert got[p] == len(sa & sb)


def test_legal_placements_equal_every_assignment_checked_whole(gpt):
    """``legal_placements`` checks each (dim, mesh axes) split once; the same list as checking every
    assignment of mesh axes to dims as a whole placement, padded or refused, on even, 3:1 and
    non-dividing meshes (a 1:10 axis leaves a block empty but is legal: n >= k)."""
    import itertools

    from polyparallel.poly import IllegalPlacement, Placement
    from polyparallel.poly._placement import _check_placement  # unmemoised: _legal records what it finds legal

    for text in ["dp=2,tp=2", "a=3,b=2", "a=2[3:1],b=4", "a=2[1:10],b=3,c=2"]:
        mesh = DeviceMesh.parse(text)
        for op in gpt.ops:
            if op.nest is None:
                continue
            for uneven in ("pad", "refuse"):
                CACHE.clear()
                got = poly.legal_placements(gpt, op, mesh, uneven=uneven)
                choices = [None, *[d.name for d in op.nest.dims if d.extent > 1]]
                ref = []
                for assign in itertools.product(choices, repeat=len(mesh.axes)):
                    splits: dict[str, list[str]] = {}
                    for ax, d in zip(mesh.names, assign):
                        if d is not None and mesh.axis(ax).size > 1:
                            splits.setdefault(d, []).append(ax)
                    p = Placement(tuple((d, tuple(a)) for d, a in splits.items()))
                    try:
                        _check_placement(op.nest, p, mesh, op.name, uneven)
                    except IllegalPlacement:
                        continue
                    ref.append(p)
                assert got == list(dict.fromkeys(ref)), (text, op.name, uneven)


def test_repeated_comm_of_op_lookups_are_the_cached_prices(gpt):
    """The per-signature fast path of ``comm_of_op`` returns the batch's prices (to the ops of every
    layer), counts hits, follows a new (equal) mesh object and forgets everything on ``clear_cache``."""
    op = next(o for o in gpt.ops if o.name == "linear_2")
    mesh = DeviceMesh.parse("a=2,b=3")
    CACHE.clear()
    legal = poly.legal_placements(gpt, op, mesh)
    ref = _op_comm._comm_of_ops(gpt, op, legal, mesh)
    first = [poly.comm_of_op(gpt, op, p, mesh) for p in legal]
    hits = CACHE.stats()["op_comm"]["hits"]
    again = [poly.comm_of_op(gpt, op, p, mesh) for p in legal]
    assert all(a is b for a, b in zip(first, again)) and first == [ref[p] for p in legal]
    assert CACHE.stats()["op_comm"]["hits"] == hits + len(legal)
    other = DeviceMesh.parse("a=2,b=3")
    assert [poly.comm_of_op(gpt, op, p, other) for p in legal] == first
    twin = next(o for o in gpt.ops if o.name == "linear_6")  # the same signature in the next layer
    assert gpt.signature(twin) == gpt.signature(op)
    hits = CACHE.stats()["op_comm"]["hits"]
    assert [poly.comm_of_op(gpt, twin, p, other) for p in legal] == first
    assert CACHE.stats()["op_comm"]["hits"] == hits + len(legal)
    CACHE.clear()
    assert not _op_comm._OP_COMM and poly.comm_of_op(gpt, op, legal[-1], mesh) == ref[legal[-1]]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_grid_count_in_an_interval_equals_enumeration(data):
    """``Grid.count_in`` (both ends of the interval in one pass) equals ``below(b) - below(a)`` and a
    set enumeration of the grid's rows, empty rows, intervals and partial rows included."""
    from polyparallel.poly import _footprint as fp

    ndev = data.draw(st.integers(1, 5))

    def ints(lo: int, hi: int) -> np.ndarray:
        return np.array(data.draw(st.lists(st.integers(lo, hi), min_size=ndev, max_size=ndev)), dtype=np.int64)

    n = ints(0, 4)
    g = fp.Grid(ints(-3, 10), n, n + ints(1, 4), ints(0, 4))
    a = ints(-4, 30)
    iv = fp.Prog.interval(a, a + ints(-2, 25))
    got = g.count_in(iv)
    ref = np.where(iv.n > 0, g.below(iv.start + iv.n) - g.below(iv.start), 0)
    assert np.array_equal(got, ref)
    for p in range(ndev):
        pts = {int(g.start[p] + g.c[p] * h + i) for h in range(int(g.H[p])) for i in range(int(g.n[p]))}
        assert got[p] == len(pts & set(range(int(iv.start[p]), int(iv.start[p] + iv.n[p]))))


def test_batched_flops_equal_every_device_counted(gpt, monkeypatch):
    """An op's flops per placement (the most any device computes) from one virtual device per
    coordinate of the constrained dims' axes, other dims at their longest block, equal those
    counted on every device (a placement alone), on 1:3 and 1:10 meshes and causal attention;
    taking a block other than the longest (the first) is caught."""
    meshes = [DeviceMesh.parse("a=2[1:3],b=3"), DeviceMesh.parse("a=2[1:10],b=2")]
    ops = [o for o in gpt.ops if o.name in ("scaled_dot_product_attention", "linear_2", "layer_norm", "linear_1")]

    def mismatches() -> int:
        bad = 0
        for mesh in meshes:
            for op in ops:
                legal = poly.legal_placements(gpt, op, mesh)
                CACHE.clear()
                batch = _op_comm._comm_of_ops(gpt, op, legal, mesh)
                bad += sum(batch[p].flops != _op_comm._comm_of_ops(gpt, op, [p], mesh)[p].flops for p in legal)
        return bad

    assert mismatches() == 0
    monkeypatch.setattr(_op_comm, "_longest_block",
                        lambda mesh, n, axes: tuple(int(x[0]) for x in mesh.bounds(n, axes)))
    assert mismatches() > 0


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_missing_counts_of_unions_of_products_against_enumeration(data):
    """Needs that are unions of overlapping boxes (several signed inclusion-exclusion terms, so
    several rows per pair in ``_missing_pairs``) against block layouts: the max and the sum over
    devices of what each lacks equal a numpy enumeration of the sets."""
    from polyparallel.poly import _footprint as fp

    mesh = DeviceMesh.parse(data.draw(st.sampled_from(["a=2,b=3", "a=2[3:1],b=2", "a=4"])))
    shape = (5, 6)
    n_dev = mesh.size

    def box() -> tuple:
        axes = []
        for ext in shape:
            lo = np.array(data.draw(st.lists(st.integers(0, ext - 1), min_size=n_dev, max_size=n_dev)), dtype=np.int64)
            ln = np.array(data.draw(st.lists(st.integers(1, ext), min_size=n_dev, max_size=n_dev)), dtype=np.int64)
            axes.append(fp.Prog.interval(lo, np.minimum(lo + ln, ext)))
        return tuple(axes)

    def mask(pieces: list, p: int) -> np.ndarray:
        m = np.zeros(shape, dtype=bool)
        for pc in pieces:
            m[tuple(slice(int(a.start[p]), int(a.start[p] + a.n[p])) for a in pc)] = True
        return m

    needs, sets = [], []
    for j in range(3):
        pieces = [box() for _ in range(data.draw(st.integers(1, 3)))]
        region = fp.Region(shape, pieces, np.zeros(n_dev, dtype=bool))
        needs.append(_distribution.Distribution(shape, mesh, region, ((), ()), (False, False), (), ("test", j),
                                        lambda p: None))
        sets.append(pieces)
    lays = list({str(x): x for x in (draw_layout(data, mesh, shape, False) for _ in range(3))}.values())
    others = [layout_distribution(x, mesh) for x in lays]
    pn = np.repeat(np.arange(len(needs)), len(others))
    po = np.tile(np.arange(len(others)), len(needs))
    CACHE.clear()
    mx, sm = _reshard_table._missing_pairs(needs, others, pn, po, mesh)
    for k in range(len(pn)):
        lay = lays[po[k]]
        lacked = [int((mask(sets[pn[k]], p) & ~layout_touched(lay, mesh, p)).sum()) for p in range(n_dev)]
        assert (mx[k], sm[k]) == (max(lacked), sum(lacked)), (k, str(lay))
