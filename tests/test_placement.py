"""Per-op placement MILP: its optimum equals brute-force enumeration; Megatron's MLP split emerges."""

from __future__ import annotations

import itertools

import pytest

from polyparallel import ops
from polyparallel.cluster import Cluster
from polyparallel.ir import Graph, Op, OpKind, TensorKind, TensorSpec
from polyparallel.placement import price_placements, solve_placements
from polyparallel.poly import DeviceMesh


def mlp_graph(b: int, s: int, h: int, f: int) -> Graph:
    g = Graph("mlp")
    for name, shape, kind in [("x", (b, s, h), TensorKind.INPUT), ("w1", (f, h), TensorKind.PARAM),
                              ("h1", (b, s, f), TensorKind.ACTIVATION), ("a1", (b, s, f), TensorKind.ACTIVATION),
                              ("w2", (h, f), TensorKind.PARAM), ("y", (b, s, h), TensorKind.ACTIVATION)]:
        g.add_tensor(TensorSpec(name, shape, kind=kind))
    g.add_op(Op("fc1", OpKind.CONTRACTION, "linear", ("x", "w1"), ("h1",), ops.linear((b, s, h), (f, h))))
    g.add_op(Op("gelu", OpKind.ELEMENTWISE, "gelu", ("h1",), ("a1",), ops.elementwise((b, s, f), [(b, s, f)], flops=8)))
    g.add_op(Op("fc2", OpKind.CONTRACTION, "linear", ("a1", "w2"), ("y",), ops.linear((b, s, f), (h, f))))
    return g


@pytest.mark.parametrize(("mesh", "dims"), [(DeviceMesh.of(tp=2), (4, 8, 64, 256)),
                                            (DeviceMesh.of(dp=2, tp=2), (4, 16, 128, 512))])
def test_milp_optimum_equals_brute_force(mesh, dims):
    g = mlp_graph(*dims)
    cl = Cluster.preset("dgx-a100x1")
    tab = price_placements(g, mesh, cl, k=5)
    best = min(tab.objective(dict(zip(tab.ops, c)))
               for c in itertools.product(*[range(len(tab.candidates[o])) for o in tab.ops]))
    plan = solve_placements(g, mesh, cl, k=5)
    assert plan.status == "optimal"
    assert plan.objective_s == pytest.approx(best, rel=1e-9)


def test_megatron_column_then_row_split_emerges_for_big_weights():
    # tiny batch, huge weights: replicating weights over tp would all-reduce 2 x 64M gradients,
    # while column-then-row parallel moves one small activation all-reduce
    g = mlp_graph(1, 8, 4096, 16384)
    plan = solve_placements(g, DeviceMesh.of(tp=8), Cluster.preset("dgx-a100x1"), k=None)
    assert plan.placements["fc1"] == "n:tp"
    assert plan.placements["fc2"] == "k:tp"
    assert plan.placements["gelu"] != "R"  # the split flows through the elementwise op
