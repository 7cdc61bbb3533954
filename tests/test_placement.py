"""Per-op placement MILP: its optimum equals brute-force enumeration; Megatron's MLP split emerges."""

from __future__ import annotations

import itertools

import pytest

from polyparallel import ops
from polyparallel.cluster import Cluster
from polyparallel.ir import Graph, Op, OpKind, TensorKind, TensorSpec
from polyparallel.planning.stage_solver import price_placements, solve_placements
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


def residual_mlp(layers: int, b: int, s: int, h: int, f: int) -> Graph:
    """neg, then ``layers`` x (fc1, gelu, fc2, add residual): repeated blocks with a skip edge each."""
    g = Graph("resmlp")
    g.add_tensor(TensorSpec("x", (b, s, h), kind=TensorKind.INPUT))
    g.add_tensor(TensorSpec("x0", (b, s, h), kind=TensorKind.ACTIVATION))
    ew = ops.elementwise((b, s, h), [(b, s, h)])
    g.add_op(Op("neg", OpKind.ELEMENTWISE, "neg", ("x",), ("x0",), ew))
    cur = "x0"
    for i in range(layers):
        for name, shape, kind in [(f"w1_{i}", (f, h), TensorKind.PARAM), (f"h_{i}", (b, s, f), TensorKind.ACTIVATION),
                                  (f"a_{i}", (b, s, f), TensorKind.ACTIVATION), (f"w2_{i}", (h, f), TensorKind.PARAM),
                                  (f"y_{i}", (b, s, h), TensorKind.ACTIVATION),
                                  (f"r_{i}", (b, s, h), TensorKind.ACTIVATION)]:
            g.add_tensor(TensorSpec(name, shape, kind=kind))
        g.add_op(Op(f"fc1_{i}", OpKind.CONTRACTION, "linear", (cur, f"w1_{i}"), (f"h_{i}",),
                    ops.linear((b, s, h), (f, h))))
        g.add_op(Op(f"gelu_{i}", OpKind.ELEMENTWISE, "gelu", (f"h_{i}",), (f"a_{i}",),
                    ops.elementwise((b, s, f), [(b, s, f)], flops=8)))
        g.add_op(Op(f"fc2_{i}", OpKind.CONTRACTION, "linear", (f"a_{i}", f"w2_{i}"), (f"y_{i}",),
                    ops.linear((b, s, f), (h, f))))
        g.add_op(Op(f"add_{i}", OpKind.ELEMENTWISE, "add", (f"y_{i}", cur), (f"r_{i}",),
                    ops.elementwise((b, s, h), [(b, s, h), (b, s, h)])))
        cur = f"r_{i}"
    g.outputs.append(cur)
    return g


@pytest.mark.parametrize(("mesh", "dims", "k"), [(DeviceMesh.of(tp=2), (2, 8, 64, 256), 2),
                                                 (DeviceMesh.of(dp=2, tp=2), (4, 16, 256, 1024), 2)])
def test_block_dp_equals_elimination_milp_and_brute_force(mesh, dims, k):
    from polyparallel.planning.stage_solver import solve_stage

    g = residual_mlp(3, *dims)
    cl = Cluster.preset("dgx-a100x1")
    tab = price_placements(g, mesh, cl, k=k)
    best = min(tab.objective(dict(zip(tab.ops, c)))
               for c in itertools.product(*[range(len(tab.candidates[o])) for o in tab.ops]))
    plans = [solve_stage(g, mesh, cl, k=k), solve_placements(g, mesh, cl, k=k, solver="elimination"),
             solve_placements(g, mesh, cl, k=k, solver="milp")]
    assert [p.solver for p in plans] == ["blocks", "elimination", "milp"]
    for plan in plans:
        assert plan.objective_s == pytest.approx(best, rel=1e-9)
        choice = {o: [str(c) for c in tab.candidates[o]].index(plan.placements[o]) for o in tab.ops}
        assert tab.objective(choice) == pytest.approx(plan.objective_s, rel=1e-12)  # the plan is what it costs
        parts = plan.compute_s + plan.own_comm_s + plan.forward_reshard_s + plan.backward_reshard_s
        assert parts == pytest.approx(plan.objective_s, rel=1e-9)


def test_block_dp_matches_milp_with_more_candidates():
    from polyparallel.planning.stage_solver import solve_stage

    g = residual_mlp(4, 2, 8, 128, 512)
    mesh, cl = DeviceMesh.of(dp=2, tp=2), Cluster.preset("dgx-a100x1")
    a = solve_stage(g, mesh, cl, k=5)
    b = solve_placements(g, mesh, cl, k=5, solver="milp")
    assert a.solver == "blocks" and b.status == "optimal"
    assert a.objective_s == pytest.approx(b.objective_s, rel=1e-9)


def test_megatron_column_row_emerges_in_every_layer_and_blocks_are_solved_once():
    from polyparallel.planning import stage_solver as placement
    from polyparallel.planning.stage_solver import solve_stage

    cl = Cluster.preset("dgx-a100x1")
    mesh = DeviceMesh.of(tp=8)
    placement._BLOCK_CACHE.clear()
    plan = solve_stage(residual_mlp(3, 1, 8, 4096, 16384), mesh, cl, k=None)
    for i in range(3):
        assert (plan.placements[f"fc1_{i}"], plan.placements[f"fc2_{i}"]) == ("n:tp", "k:tp")
    # three block tables: the first instance (fed by the prologue), the middle ones, and the last
    # (whose output nothing in the stage reads, so its state out is empty)
    assert len(placement._BLOCK_CACHE) == 3
    four = solve_stage(residual_mlp(4, 1, 8, 4096, 16384), mesh, cl, k=None)
    deep = solve_stage(residual_mlp(12, 1, 8, 4096, 16384), mesh, cl, k=None)
    assert len(placement._BLOCK_CACHE) == 3  # 4 and 12 layers: the same three tables, looked up
    # every middle layer adds the same optimal cost
    assert deep.objective_s - plan.objective_s == pytest.approx(9 * (four.objective_s - plan.objective_s), rel=1e-9)


def test_collectives_are_priced_by_the_cost_model():
    from polyparallel.cost_models.comm import collective_time
    from polyparallel.planning.stage_solver import solve_stage

    b, s, h, f = 1, 8, 4096, 16384
    cl = Cluster.preset("dgx-a100x1")
    plan = solve_stage(mlp_graph(b, s, h, f), DeviceMesh.of(tp=8), cl, k=None)
    assert (plan.placements["fc1"], plan.placements["fc2"]) == ("n:tp", "k:tp")
    # column -> row: no edge moves anything, forward or backward, inside the MLP; the row-parallel
    # output stays Partial (the graph output), and the column-parallel fc1 all-reduces dx backward
    # only when x has a producer (here it is a graph input): nothing on the edges at all
    assert plan.forward_reshard_s == 0.0 and plan.backward_reshard_s == 0.0
    g = residual_mlp(1, b, s, h, f)
    plan = solve_stage(g, DeviceMesh.of(tp=8), cl, k=None)
    ar = collective_time(cl, "all_reduce", b * s * h * 4, list(range(8))).seconds
    # one all-reduce of the activation forward (fc2 -> add) and one of its gradient backward (fc1 -> neg)
    assert plan.forward_reshard_s == pytest.approx(ar, rel=1e-12)
    assert plan.backward_reshard_s == pytest.approx(ar, rel=1e-12)


def test_a_stage_that_cuts_a_run_of_layers_uses_its_whole_instances():
    from polyparallel.planning.stage_solver import solve_stage

    g = residual_mlp(4, 2, 8, 128, 512)
    mesh, cl = DeviceMesh.of(dp=2, tp=2), Cluster.preset("dgx-a100x1")
    stage = g.ops[3:13]  # from the middle of layer 0 to the end of layer 2: layers 1 and 2 are whole
    plan = solve_stage(g, mesh, cl, ops=stage, k=4)
    ref = solve_placements(g, mesh, cl, ops=stage, k=4, solver="milp")
    assert plan.solver == "blocks" and set(plan.placements) == {op.name for op in stage}
    assert plan.objective_s == pytest.approx(ref.objective_s, rel=1e-9)
