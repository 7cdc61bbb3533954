"""Backward activation-gradient communication: closed forms of the duals of known forward schemes."""

from __future__ import annotations

import pytest

from polyparallel.poly import (
    DeviceMesh,
    Placement,
    TensorLayout,
    backward_reshard_edge,
    clear_cache,
    comm_of_op,
    edge_costs,
    grad_partial_axes,
    reshard_edge,
)
from tests.layouts import layout_touched
from tests.test_poly_comm import B, H, S, mlp_block

EDGES = [("xn", "fc1"), ("h", "gelu"), ("a", "fc2"), ("y", "res"), ("x", "res"), ("x", "ln")]


def _route(g, o, plan, mesh, backward):
    out = {}
    for t, c in EDGES:
        prod = g.producer(t)
        pp_ = Placement.parse(plan[prod.name]) if prod is not None else Placement()
        fn = backward_reshard_edge if backward else reshard_edge
        out[(t, c)] = fn(g, t, pp_, o[c], Placement.parse(plan[c]), mesh)
    return out


def test_megatron_mlp_one_all_reduce_forward_and_one_backward_of_equal_volume():
    g, o = mlp_block()
    mesh = DeviceMesh.of(tp=4)
    plan = {"ln": "R", "fc1": "n:tp", "gelu": "d2:tp", "fc2": "k:tp", "res": "R"}
    fwd = _route(g, o, plan, mesh, backward=False)
    bwd = _route(g, o, plan, mesh, backward=True)
    f_ar = [(e, r) for e, rs in fwd.items() for r in rs if r.kind != "none"]
    b_ar = [(e, r) for e, rs in bwd.items() for r in rs if r.kind != "none"]
    # forward: the row-parallel output y is all-reduced before the residual add
    assert [(e, r.kind) for e, r in f_ar] == [(("y", "res"), "all-reduce")]
    # backward: the column-parallel fc1 leaves dx Partial over tp, all-reduced before ln's backward
    assert [(e, r.kind) for e, r in b_ar] == [(("xn", "fc1"), "all-reduce")]
    assert b_ar[0][1].steps[0].payload == f_ar[0][1].steps[0].payload == B * S * H
    assert b_ar[0][1].elements == f_ar[0][1].elements == 2 * 3 * (B * S * H // 4)
    # graph inputs take no gradient; the rest of the block moves nothing in either direction
    assert bwd[("x", "res")] == [] and bwd[("x", "ln")] == []
    assert grad_partial_axes(o["fc1"].nest, Placement.parse("n:tp"), "in0", mesh) == ("tp",)
    assert grad_partial_axes(o["fc2"].nest, Placement.parse("k:tp"), "in0", mesh) == ()


def test_sequence_parallel_backward_swaps_all_gather_and_reduce_scatter():
    g, o = mlp_block()
    mesh = DeviceMesh.of(tp=4)
    plan = {"ln": "s:tp", "fc1": "n:tp", "gelu": "d2:tp", "fc2": "k:tp", "res": "d1:tp"}
    fwd = _route(g, o, plan, mesh, backward=False)
    bwd = _route(g, o, plan, mesh, backward=True)
    assert fwd[("xn", "fc1")][0].kind == "all-gather" and bwd[("xn", "fc1")][0].kind == "reduce-scatter"
    assert fwd[("y", "res")][0].kind == "reduce-scatter" and bwd[("y", "res")][0].kind == "all-gather"
    # each device receives the same (n-1)/n of the activation in the dual collective
    for e in [("xn", "fc1"), ("y", "res")]:
        assert fwd[e][0].elements == bwd[e][0].elements == 3 * (B * S * H // 4)


def test_data_parallel_moves_no_activation_gradient():
    g, o = mlp_block()
    mesh = DeviceMesh.of(dp=2)
    plan = {"ln": "b:dp", "fc1": "b:dp", "gelu": "d0:dp", "fc2": "b:dp", "res": "d0:dp"}
    bwd = _route(g, o, plan, mesh, backward=True)
    assert all(r.kind == "none" for rs in bwd.values() for r in rs)


def test_layer_norm_feature_split_reduces_gradient_statistics_too():
    g, o = mlp_block()
    c = comm_of_op(g, o["ln"], Placement.parse("f:tp"), DeviceMesh.of(tp=2))
    assert [(x.operand, x.payload) for x in c.backward] == [("stats", B * S)]
    assert c.backward_bytes == c.forward_bytes > 0
    assert not comm_of_op(g, o["ln"], Placement.parse("s:tp"), DeviceMesh.of(tp=2)).backward


@pytest.mark.parametrize("mesh", [DeviceMesh.of(tp=2), DeviceMesh.of(dp=2, tp=2)], ids=str)
def test_edge_costs_backward_table_agrees_with_the_edge_function(mesh):
    g, o = mlp_block()
    clear_cache()
    for t, c in [("xn", "fc1"), ("y", "res"), ("h", "gelu")]:
        ec = edge_costs(g, t, o[c], f"in{o[c].inputs.index(t)}", mesh)
        for i, pp_ in enumerate(ec.producer_placements):
            for j, cp in enumerate(ec.consumer_placements):
                want = backward_reshard_edge(g, t, pp_, o[c], cp, mesh)[0]
                got = ec.backward_cost(i, j)
                assert (got.kind, got.elements, got.direct_elements) == (want.kind, want.elements,
                                                                           want.direct_elements)
    ec = edge_costs(g, "x", o["ln"], "in0", mesh)
    assert ec.backward_cost(0, 0) is None  # a graph input takes no gradient


@pytest.mark.parametrize("placement", ["R", "n:tp", "b:dp,n:tp", "s:tp", "n:dp+tp"])
def test_gradient_needed_is_the_written_block_restricted_to_what_the_reader_reads(placement):
    import numpy as np

    from polyparallel import ops
    from polyparallel.ir import Graph, Op, OpKind, TensorKind, TensorSpec
    from polyparallel.poly import grad_needed

    g = Graph("slice")
    for name, shape, kind in [("x", (2, 4, 6), "input"), ("w", (12, 6), "param"), ("qkv", (2, 4, 12), "activation"),
                              ("k", (2, 4, 5), "activation")]:
        g.add_tensor(TensorSpec(name, shape, kind=TensorKind(kind)))
    lin = g.add_op(Op("lin", OpKind.CONTRACTION, "linear", ("x", "w"), ("qkv",), ops.linear((2, 4, 6), (12, 6))))
    sl = g.add_op(Op("sl", OpKind.VIEW, "slice", ("qkv",), ("k",), ops.slice_((2, 4, 12), 2, 5, 10)))
    mesh = DeviceMesh.of(dp=2, tp=3)
    pl = Placement.parse(placement)
    got = grad_needed(g, lin, pl, mesh, reader=(sl, "in0")).counts()
    dims = {"b": 2, "s": 4, "n": 12}
    for p in range(mesh.size):
        block = np.zeros((2, 4, 12), dtype=bool)
        idx = []
        for d in ("b", "s", "n"):
            lo, hi = mesh.bounds(dims[d], pl.axes_of(d))
            idx.append(slice(int(lo[p]), int(hi[p])))
        block[tuple(idx)] = True
        block[:, :, :5] = False
        block[:, :, 10:] = False
        assert got[p] == int(block.sum())


@pytest.mark.parametrize("placement", ["R", "n:tp", "n:dp+tp", "b:dp,n:tp", "s:tp,n:dp"])
def test_gradient_needed_through_a_head_interleaved_read_matches_brute_force(placement):
    """The reader takes the second half of every head (rotate_half on a fused heads x head-dim
    axis): the producer's block of that axis cut by a grid of rows, counted in closed form."""
    import numpy as np

    from polyparallel import ops
    from polyparallel.ir import Access, Dim, E, Graph, LoopNest, Op, OpKind, Statement, TensorKind, TensorSpec
    from polyparallel.poly import grad_needed

    b, s, heads, dh = 2, 3, 4, 6
    n = heads * dh
    g = Graph("half")
    for name, shape, kind in [("x", (b, s, 5), "input"), ("w", (n, 5), "param"), ("y", (b, s, n), "activation"),
                              ("z", (b, heads, s, dh // 2), "activation")]:
        g.add_tensor(TensorSpec(name, shape, kind=TensorKind(kind)))
    lin = g.add_op(Op("lin", OpKind.CONTRACTION, "linear", ("x", "w"), ("y",), ops.linear((b, s, 5), (n, 5))))
    nest = LoopNest(dims=(Dim("b", b), Dim("h", heads), Dim("s", s), Dim("d", dh // 2)),
                    statements=(Statement("half", ("b", "h", "s", "d"),
                                          reads=(Access("in0", (E("b"), E("s"), E("h") * dh + E("d") + dh // 2)),),
                                          writes=(Access("out0", (E("b"), E("h"), E("s"), E("d"))),)),))
    rd = g.add_op(Op("half", OpKind.VIEW, "half", ("y",), ("z",), nest))
    mesh = DeviceMesh.of(dp=2, tp=3)
    pl = Placement.parse(placement)
    d = grad_needed(g, lin, pl, mesh, reader=(rd, "in0"))
    got = d.counts()
    assert not d.region.fallback.any()  # closed form, no isl
    read = np.zeros((b, s, n), dtype=bool)
    for h in range(heads):
        read[:, :, h * dh + dh // 2:(h + 1) * dh] = True
    # device p's block of the linear's output y[b, s, n] under the placement
    out = TensorLayout((b, s, n), tuple(tuple(pl.axes_of(dname)) for dname in ("b", "s", "n")), ())
    blocks = [layout_touched(out, mesh, p) for p in range(mesh.size)]
    for p in range(mesh.size):
        assert got[p] == int((blocks[p] & read).sum()), p
    # the gradient's way back from a head-split reader: exact per-device lack, no isl needed
    from polyparallel.poly import backward_reshard_edge

    rp = Placement.parse("h:tp")
    r = backward_reshard_edge(g, "y", pl, rd, rp, mesh)[0]
    lacks = []
    for p in range(mesh.size):
        held = np.zeros((b, s, n), dtype=bool)
        lo, hi = mesh.bounds(heads, ("tp",))
        for h in range(int(lo[p]), int(hi[p])):
            held[:, :, h * dh + dh // 2:(h + 1) * dh] = True
        lacks.append(int((blocks[p] & read & ~held).sum()))
    assert r.direct_elements == max(lacks)
