"""Symbolic footprint / receive volumes: one formula, evaluated at several shapes, equals the
concrete isl count and a brute-force numpy enumeration at each shape."""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel import ops
from polyparallel.ir import Graph, Op, OpKind, TensorSpec
from polyparallel.poly import (
    DeviceMesh,
    NotSymbolic,
    Placement,
    count,
    footprint_set,
    symbolic_receive,
    symbolic_volume,
)
from tests.test_poly_counts import brute_touched, device_boxes

MESHES = [DeviceMesh.of(dp=2, tp=2), DeviceMesh.of(tp=4), DeviceMesh.of(dp=2, weights={"dp": (3, 1)})]


def _shape_of(nest, operand):
    ext = nest.extents
    dims = None
    for _st, acc, _w in nest.accesses(operand):
        cur = [1 + e.const + sum(max(k, 0) * (ext[d] - 1) for d, k in e.terms) for e in acc.index]
        dims = cur if dims is None else [max(a, b) for a, b in zip(dims, cur)]
    return tuple(dims)


LINEAR_CASES = [("s:tp", "in0", None), ("b:dp,s:tp", "in0", None), ("n:tp", "in1", None), ("k:tp", "in0", None),
                ("s:tp", "out0", True), ("b:dp,n:tp", "out0", True), ("s:dp+tp", "in0", None)]


@pytest.mark.parametrize(("mesh", "placement", "operand", "writes"), [
    (m, *case) for m in MESHES for case in LINEAR_CASES
    if all(a in m.names for a in Placement.parse(case[0]).mesh_axes)], ids=str)
def test_linear_footprint_formula_equals_counts_at_every_shape(mesh, placement, operand, writes):
    pl = Placement.parse(placement)
    params = {"b": "B", "s": "S"}
    nest0 = ops.linear((4, 8, 6), (5, 6))
    formulas = [symbolic_volume(nest0, pl, mesh, operand, params=params, device=p, writes=writes)
                for p in range(mesh.size)]
    for B, S in [(4, 8), (5, 9), (8, 13), (4, 4)]:
        nest = ops.linear((B, S, 6), (5, 6))
        shape = _shape_of(nest, operand)
        for p, box in enumerate(device_boxes(nest, pl, mesh)):
            brute = int(brute_touched(nest, operand, shape, box, writes).sum())
            assert formulas[p].evaluate(B=B, S=S) == brute == count(footprint_set(nest, operand, shape, box,
                                                                                    writes=writes)), (B, S, p)


@pytest.mark.parametrize(("placement", "operand"), [("s:tp", "in0"), ("s:tp", "in1"), ("t:tp", "in1"),
                                                    ("s:dp,t:tp", "in1"), ("b:dp,s:tp", "in2")])
def test_causal_attention_footprint_formula(placement, operand):
    mesh = DeviceMesh.of(dp=2, tp=2)
    pl = Placement.parse(placement)
    params = {"b": "B", "s": "S", "t": "S"}
    nest0 = ops.attention((2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), causal=True)
    formulas = [symbolic_volume(nest0, pl, mesh, operand, params=params, device=p) for p in range(mesh.size)]
    for B, S in [(2, 8), (3, 7), (2, 12)]:
        nest = ops.attention((B, 2, S, 4), (B, 2, S, 4), (B, 2, S, 4), causal=True)
        shape = (B, 2, S, 4)
        for p, box in enumerate(device_boxes(nest, pl, mesh)):
            brute = int(brute_touched(nest, operand, shape, box).sum())
            assert formulas[p].evaluate(B=B, S=S) == brute, (B, S, p, str(formulas[p]))


@pytest.mark.parametrize("have", [((), ("tp",), ()), (("dp",), (), ()), ((), (), ("tp",)), ((), ("dp", "tp"), ())])
def test_receive_formula_equals_brute_force(have):
    mesh = DeviceMesh.of(dp=2, tp=2, weights={"dp": (3, 1)})
    pl = Placement.parse("b:dp,s:tp")
    params = {"b": "B", "s": "S"}
    nest0 = ops.linear((4, 8, 6), (5, 6))
    formulas = [symbolic_receive(nest0, pl, mesh, "in0", have, params=params, device=p) for p in range(mesh.size)]
    for B, S in [(4, 8), (6, 11), (9, 5)]:
        nest = ops.linear((B, S, 6), (5, 6))
        shape = (B, S, 6)
        for p, box in enumerate(device_boxes(nest, pl, mesh)):
            need = brute_touched(nest, "in0", shape, box, False)
            held = np.zeros(shape, dtype=bool)
            sl = []
            for n, axes in zip(shape, have):
                lo, hi = mesh.bounds(n, axes)
                sl.append(slice(int(lo[p]), int(hi[p])))
            held[tuple(sl)] = True
            assert formulas[p].evaluate(B=B, S=S) == int((need & ~held).sum()), (B, S, p, str(formulas[p]))


def test_formula_prints_in_the_parameters():
    v = symbolic_volume(ops.linear((4, 8, 6), (5, 6)), Placement.parse("s:tp"), DeviceMesh.of(tp=4), "in0",
                        params={"b": "B", "s": "S"}, device=3)
    text = str(v)
    assert "B" in text and "S" in text and "floor" in text
    with pytest.raises(ValueError, match="missing"):
        v.evaluate(B=2)


def test_non_box_footprints_and_opaque_ops_say_why():
    # a stride-2 1x1 convolution reads every other row: a progression, not a box
    conv = ops.conv((1, 1, 8, 8), (1, 1, 1, 1), stride=2)
    with pytest.raises(NotSymbolic, match="not a box"):
        symbolic_volume(conv, Placement(), DeviceMesh.of(tp=2), "in0", params={"b": "B"})
    g = Graph("g")
    g.add_tensor(TensorSpec("x", (4,)))
    g.add_tensor(TensorSpec("y", (4,)))
    op = g.add_op(Op("f", OpKind.OPAQUE, "f", ("x",), ("y",), None, opaque_reason="test"))
    with pytest.raises(NotSymbolic, match="opaque"):
        symbolic_volume(op, Placement(), DeviceMesh.of(tp=2), "in0")
