"""Exact footprint and receive counts against brute-force enumeration in numpy.

The reference enumerates every iteration of every statement on every device (its block
of the domain, constraints applied), evaluates the accesses, drops out-of-bounds
(zero-padding) elements and marks the touched elements of the tensor; it shares no
code with the polyhedral model except the IR and the block bounds of the mesh.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyparallel import ops
from polyparallel.ir import ANY, LoopNest
from polyparallel.poly import DeviceMesh, Placement, TensorLayout, count, footprint_set, legal_placements
from polyparallel.poly._distribution import Distribution, layout_distribution
from polyparallel.poly._footprint import dim_bounds, operand_region

from .layouts import layout_touched

SETTINGS = settings(max_examples=int(os.environ.get("POLY_EXAMPLES", "20")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def brute_touched(nest: LoopNest, operand: str, shape: tuple[int, ...], box: dict[str, tuple[int, int]],
                  writes: bool | None = None) -> np.ndarray:
    touched = np.zeros(shape, dtype=bool)
    for stmt, acc, is_write in nest.accesses(operand):
        if writes is not None and is_write != writes:
            continue
        ranges = [np.arange(*box[d]) for d in stmt.dims]
        grids = np.meshgrid(*ranges, indexing="ij")
        env = {d: g.reshape(-1) for d, g in zip(stmt.dims, grids)}
        npts = len(next(iter(env.values()))) if env else 1
        keep = np.ones(npts, dtype=bool)
        for c in stmt.constraints:
            keep &= (sum(k * env[d] for d, k in c.terms) + c.const) >= 0
        cols = []
        for e in acc.index:
            if e is ANY:
                cols.append(None)
            else:
                cols.append((sum(k * env[d] for d, k in e.terms) + e.const) * np.ones(npts, dtype=np.int64))
        rows = np.stack([c if c is not None else np.zeros(npts, dtype=np.int64) for c in cols], axis=1)[keep]
        for j, c in enumerate(cols):  # a data-dependent index touches the whole axis
            if c is None:
                rows = np.repeat(rows, shape[j], axis=0)
                rows[:, j] = np.tile(np.arange(shape[j]), len(rows) // shape[j])
        inside = np.all((rows >= 0) & (rows < np.array(shape)), axis=1)
        rows = rows[inside]
        if len(rows):
            touched[tuple(rows.T)] = True
    return touched


def device_boxes(nest: LoopNest, placement: Placement, mesh: DeviceMesh) -> list[dict[str, tuple[int, int]]]:
    out = []
    for p in range(mesh.size):
        box = {}
        for d in nest.dims:
            lo, hi = mesh.bounds(d.extent, placement.axes_of(d.name))
            box[d.name] = (int(lo[p]), int(hi[p]))
        out.append(box)
    return out


_NEED_KEYS = itertools.count()


def make_need(nest: LoopNest, operand: str, shape: tuple[int, ...], placement: Placement,
              mesh: DeviceMesh) -> Distribution:
    bounds = dim_bounds(nest, placement, mesh)
    region = operand_region(nest, operand, shape, bounds, writes=False, ndev=mesh.size)

    def isl_of(p: int):
        b = {d: (int(lo[p]), int(hi[p])) for d, (lo, hi) in bounds.items()}
        return footprint_set(nest, operand, shape, b, writes=False).set_tuple_name("T")

    # a unique cache key: id(region) can be reused by a later object once this one is freed,
    # and the poly cache would then hand a stale result to an unrelated example
    return Distribution(shape, mesh, region, tuple(() for _ in shape), tuple(False for _ in shape), (),
                        ("test", next(_NEED_KEYS)), isl_of, (np.stack([np.arange(mesh.size)] * 2),))


def draw_placement(data, nest: LoopNest, mesh: DeviceMesh) -> Placement:
    """A legal placement that splits something whenever the op allows it."""
    placements = legal_placements(None, nest, mesh)
    split = [p for p in placements if p.splits] or placements
    return split[data.draw(st.integers(0, len(split) - 1))]


meshes = st.sampled_from([
    DeviceMesh.of(a=2), DeviceMesh.of(a=3), DeviceMesh.of(a=4), DeviceMesh.of(a=2, b=2), DeviceMesh.of(a=3, b=2),
    DeviceMesh.of(a=2, weights={"a": (3, 1)}), DeviceMesh.of(a=2, b=2, weights={"a": (3, 1)}),
    DeviceMesh.of(a=2, b=3, weights={"b": (1, 2, 1)}),
])


KINDS = ["matmul", "bmm", "conv", "pool", "softmax", "attention", "elementwise", "layer_norm", "embedding",
         "gather", "reshape"]


@st.composite
def op_cases(draw, kind: str):
    small = st.integers(1, 5)
    if kind == "matmul":
        m, k, n = draw(small), draw(small), draw(small)
        return ops.matmul((m, k), (n, k), trans_b=True), [(m, k), (n, k)]
    if kind == "bmm":
        b, m, k, n = draw(small), draw(small), draw(small), draw(small)
        return ops.matmul((b, m, k), (b, k, n)), [(b, m, k), (b, k, n)]
    if kind in ("conv", "pool"):
        b, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        h, w = draw(st.integers(3, 9)), draw(st.integers(3, 7))
        kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        stride, dil = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        pad = draw(st.integers(0, 1))
        if kind == "pool":
            pad = min(pad, kh // 2, kw // 2)
        if (h + 2 * pad - dil * (kh - 1) - 1) < 0 or (w + 2 * pad - dil * (kw - 1) - 1) < 0:
            kh = kw = 1
            pad = 0 if kind == "pool" else pad
        if kind == "pool":
            return ops.pool((b, c, h, w), (kh, kw), stride=stride, padding=pad, dilation=dil), [(b, c, h, w)]
        o = draw(st.integers(1, 3))
        return (ops.conv((b, c, h, w), (o, c, kh, kw), stride=stride, padding=pad, dilation=dil),
                [(b, c, h, w), (o, c, kh, kw)])
    if kind == "softmax":
        shape = (draw(small), draw(small), draw(st.integers(2, 6)))
        return ops.softmax(shape, draw(st.integers(-3, 2))), [shape]
    if kind == "layer_norm":
        shape = (draw(small), draw(small), draw(st.integers(2, 6)))
        return ops.layer_norm(shape, shape[-1:]), [shape, shape[-1:], shape[-1:]]
    if kind == "attention":
        b, hk, g, s, t, d = draw(small), draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(small), \
            draw(small), draw(st.integers(1, 3))
        causal = draw(st.booleans()) and s == t
        q, kk, v = (b, hk * g, s, d), (b, hk, t, d), (b, hk, t, d)
        return ops.attention(q, kk, v, causal=causal), [q, kk, v]
    if kind == "embedding":
        vocab, e, b, s = draw(small), draw(small), draw(small), draw(small)
        return ops.embedding((vocab, e), (b, s)), [(vocab, e), (b, s)]
    if kind == "gather":
        data, idx = (draw(small), draw(small), draw(small)), (draw(small),)
        return ops.gather(data, idx, 1), [data, idx]
    if kind == "reshape":  # flattened heads: reads in0[b, D*h + d]
        b, h, d = draw(small), draw(st.integers(1, 4)), draw(st.integers(1, 6))
        if draw(st.booleans()):
            return ops.reshape((b, h * d), (b, h, d)), [(b, h * d)]
        return ops.reshape((b, h, d), (b, h * d)), [(b, h, d)]
    out = (draw(small), draw(small), draw(small))
    a = tuple(x if draw(st.booleans()) else 1 for x in out)
    b2 = out[-draw(st.integers(1, 3)):]
    b2 = tuple(x if draw(st.booleans()) else 1 for x in b2)
    return ops.elementwise(out, [a, b2]), [a, b2]


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(mesh=meshes, data=st.data())
def test_footprints_and_receives_match_brute_force(kind, mesh, data):
    nest, in_shapes = data.draw(op_cases(kind))
    placement = draw_placement(data, nest, mesh)
    boxes = device_boxes(nest, placement, mesh)
    bounds = dim_bounds(nest, placement, mesh)
    for i, shape in enumerate(in_shapes):
        operand = f"in{i}"
        if operand not in nest.operands():
            continue
        region = operand_region(nest, operand, shape, bounds, writes=False, ndev=mesh.size)
        need = make_need(nest, operand, shape, placement, mesh)
        got = need.counts()
        # a random producer layout of this tensor
        shards = [[] for _ in shape]
        for a in mesh.names:
            j = data.draw(st.integers(-1, len(shape) - 1))
            if j >= 0:
                shards[j].append(a)
        have = TensorLayout(shape, tuple(tuple(s) for s in shards))
        missing = need.missing(layout_distribution(have, mesh))
        for p, box in enumerate(boxes):
            ref = brute_touched(nest, operand, shape, box, writes=False)
            assert got[p] == ref.sum(), (operand, p, placement, region.fallback[p])
            assert count(footprint_set(nest, operand, shape, box, writes=False)) == ref.sum()
            ref_miss = (ref & ~layout_touched(have, mesh, p)).sum()
            assert missing[p] == ref_miss, (operand, p, placement, str(have))


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(mesh=meshes, data=st.data())
def test_output_footprints_match_brute_force(kind, mesh, data):
    nest, _ = data.draw(op_cases(kind))
    placement = draw_placement(data, nest, mesh)
    bounds = dim_bounds(nest, placement, mesh)
    full = {d.name: (0, d.extent) for d in nest.dims}
    shape = tuple(int(x) for x in np.argwhere(brute_touched(nest, "out0", _out_shape(nest), full, True))
                  .max(axis=0) + 1) if _out_shape(nest) else ()
    region = operand_region(nest, "out0", shape, bounds, writes=True, ndev=mesh.size)
    counts, bad = region.counts()
    for p, box in enumerate(device_boxes(nest, placement, mesh)):
        assert bad[p] or counts[p] == brute_touched(nest, "out0", shape, box, True).sum()


def _out_shape(nest: LoopNest) -> tuple[int, ...]:
    for _st, acc, w in nest.accesses("out0"):
        if w:
            return tuple(1 + sum(max(k, 0) * (nest.dim(d).extent - 1) for d, k in e.terms) + e.const
                         for e in acc.index)
    return ()


def test_uneven_three_to_one_matmul_matches_brute_force():
    mesh = DeviceMesh.of(fast=2, weights={"fast": (3, 1)})
    nest = ops.matmul((8, 4), (4, 6))
    place = Placement.parse("m:fast")
    bounds = dim_bounds(nest, place, mesh)
    assert (bounds["m"][1] - bounds["m"][0]).tolist() == [6, 2]
    need = make_need(nest, "in0", (8, 4), place, mesh)
    have = layout_distribution(TensorLayout((8, 4), ((), ("fast",))), mesh)  # columns split 3:1
    miss = need.missing(have)
    for p, box in enumerate(device_boxes(nest, place, mesh)):
        ref = brute_touched(nest, "in0", (8, 4), box, writes=False)
        assert miss[p] == (ref & ~layout_touched(have.layout, mesh, p)).sum()
    assert miss.tolist() == [6 * 1, 2 * 3]


prog_params = st.tuples(st.integers(-6, 6), st.integers(1, 4), st.integers(0, 6))


@settings(max_examples=200, deadline=None)
@given(a=prog_params, b=prog_params)
def test_progression_intersection_matches_sets(a, b):
    from polyparallel.poly._footprint import Prog

    def prog(t):
        return Prog(np.array([t[0]]), np.array([t[1]]), np.array([t[2]]))

    got, bad = prog(a).intersect(prog(b))
    ref = {a[0] + a[1] * i for i in range(a[2])} & {b[0] + b[1] * i for i in range(b[2])}
    if bad[0]:
        assert a[1] > 1 and b[1] > 1 and a[1] != b[1] and a[2] > 1 and b[2] > 1
        return
    assert {int(got.start[0] + got.step[0] * i) for i in range(int(got.n[0]))} == ref


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_per_device_points_of_constrained_statements(data, mesh):
    """Causal attention and prefix scans: the closed form of the per-device FLOPs against enumeration."""
    from polyparallel.poly._op_comm import _points

    if data.draw(st.booleans()):
        s = data.draw(st.integers(2, 7))
        nest = ops.attention((2, 2, s, 3), (2, 2, s, 3), (2, 2, s, 3), causal=True)
    else:
        nest = ops.scan((data.draw(st.integers(1, 3)), data.draw(st.integers(2, 7))), data.draw(st.integers(0, 1)))
    placement = draw_placement(data, nest, mesh)
    bounds = dim_bounds(nest, placement, mesh)
    for stmt in nest.statements:
        got = _points(nest, stmt, bounds, mesh.size)
        for p, box in enumerate(device_boxes(nest, placement, mesh)):
            grids = np.meshgrid(*[np.arange(*box[d]) for d in stmt.dims], indexing="ij")
            env = dict(zip(stmt.dims, grids))
            keep = np.ones(grids[0].shape, dtype=bool)
            for c in stmt.constraints:
                keep &= (sum(k * env[d] for d, k in c.terms) + c.const) >= 0
            assert got[p] == keep.sum(), (stmt.name, p, placement)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30), st.integers(0, 30), st.integers(1, 9), st.integers(0, 9), st.integers(0, 9),
       st.integers(0, 5), st.integers(0, 5))
def test_grid_intersections_match_sets(s1, s2, c, n1, n2, h1, h2):
    """Two grids of equal row period (head-interleaved footprints) meet in closed form."""
    from polyparallel.poly._footprint import Grid, _axis_common

    n1, n2 = min(n1, c), min(n2, c)
    a = Grid(np.array([s1]), np.array([n1]), np.array([c]), np.array([h1]))
    b = Grid(np.array([s2]), np.array([n2]), np.array([c]), np.array([h2]))
    got, bad = _axis_common(a, b)
    sa = {s1 + c * h + i for h in range(h1) for i in range(n1)}
    sb = {s2 + c * h + i for h in range(h2) for i in range(n2)}
    assert not bad.any() and int(got[0]) == len(sa & sb)
