"""Roofline compute model against hand-computed times."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster, DeviceType
from polyparallel.cost_models.compute import COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, op_cost
from polyparallel.cost_models.synthetic import mlp_graph
from polyparallel.ir import OpKind

A100 = Cluster.preset("dgx-a100").device(0).type


def test_large_linear_is_compute_bound():
    g = mlp_graph(batch=8192, widths=(8192, 8192), bias=False)
    lin = g.ops[0]
    c = op_cost(g, lin, A100, "bf16")
    flops = 2 * 8192**3
    assert c.flops == flops and c.bound == "compute"
    assert c.forward == pytest.approx(flops / (312e12 * COMPUTE_EFFICIENCY[OpKind.CONTRACTION]))
    assert c.backward == pytest.approx(2 * c.forward)
    half = op_cost(g, lin, A100, "bf16", split=2)
    assert half.forward == pytest.approx(c.forward / 2)


def test_elementwise_is_memory_bound_and_tiny_ops_hit_the_floor():
    g = mlp_graph(batch=4096, widths=(4096, 4096, 4096))
    relu = next(op for op in g.ops if op.kind is OpKind.ELEMENTWISE)
    c = op_cost(g, relu, A100, "bf16")
    nbytes = 2 * 4096 * 4096 * 2  # read + write at bf16
    assert c.bound == "memory" and c.bytes == nbytes
    assert c.forward == pytest.approx(nbytes / (2039e9 * MEMORY_EFFICIENCY))
    tiny = mlp_graph(batch=2, widths=(4, 4))
    t = op_cost(tiny, tiny.ops[0], A100, "bf16")
    assert t.bound == "launch" and t.forward == A100.launch_overhead


def test_calibrated_curve_reproduces_measurements():
    curve = ((2 * 64**3, 2 * 64**3 / 10e9), (2 * 512**3, 2 * 512**3 / 40e9))
    cpu = DeviceType("cpu", "cpu", (("fp32", 40e9),), 8e9, 1e12, 0.0, matmul_curve=curve)
    for n, rate in ((64, 10e9), (512, 40e9)):
        g = mlp_graph(batch=n, widths=(n, n), bias=False)
        assert op_cost(g, g.ops[0], cpu).forward == pytest.approx(2 * n**3 / rate)
    g = mlp_graph(batch=181, widths=(181, 181), bias=False)  # between: log-log interpolation
    rate = g.ops[0].flops / op_cost(g, g.ops[0], cpu).forward
    assert 10e9 < rate < 40e9


def test_unfused_attention_is_priced_per_statement():
    from polyparallel import ops
    from polyparallel.ir import Graph, Op, TensorKind, TensorSpec

    b, h, s, d = 8, 16, 2048, 64
    g = Graph("att")
    for n in ("q", "k", "v"):
        g.add_tensor(TensorSpec(n, (b, h, s, d), "float32", TensorKind.INPUT))
    g.add_tensor(TensorSpec("o", (b, h, s, d)))
    op = g.add_op(Op("att", OpKind.ATTENTION, "sdpa", ("q", "k", "v"), ("o",),
                     ops.attention((b, h, s, d), (b, h, s, d), (b, h, s, d))))
    S, R, T = b * h * s * s, b * h * s, b * h * s * d  # scores, softmax rows, one of q/k/v/o
    bw, mm, vec = 2039e9 * 0.8, 312e12 * 0.8, 19.5e12 * 0.5

    def k(flops, nbytes, rate):
        return max(flops / rate, nbytes / bw, 5e-6)

    want = (k(2 * S * d, 2 * (2 * T + S), mm)  # scores = q k^T, written out
            + k(3 * S, 2 * (S + R), vec)  # softmax statistics, scores read back
            + k(2 * S * d, 2 * (S + R + 2 * T), mm))  # probabilities x v
    assert op_cost(g, op, A100, "bf16").forward == pytest.approx(want)
    fused = op_cost(g, op, A100, "bf16", fused=True)
    assert fused.forward == pytest.approx(max(op.flops / (312e12 * 0.5), 2 * 4 * T / bw))
    assert fused.forward < want


def test_constrained_point_counts_match_brute_force():
    """Domains with affine constraints (causal masks) are counted in closed form over one dim;
    checked against enumerating every point."""
    import itertools
    import random

    from polyparallel.ir import AffineExpr, _domain_points

    rng = random.Random(3)
    for _ in range(400):
        names = ["a", "b", "c"][: rng.randint(1, 3)]
        ext = {d: rng.randint(1, 6) for d in names}
        cons = []
        for _ in range(rng.randint(1, 3)):
            terms = tuple((d, k) for d in names if (k := rng.randint(-3, 3)) and rng.random() < 0.7)
            cons.append(AffineExpr(terms, rng.randint(-5, 5)))
        dims = (*((d, ext[d]) for d in names), ("free", 3))
        brute = 3 * sum(all(sum(k * dict(zip(names, pt))[d] for d, k in c.terms) + c.const >= 0 for c in cons)
                        for pt in itertools.product(*(range(ext[d]) for d in names)))
        assert _domain_points(dims, tuple(cons)) == brute
    s = AffineExpr((("s", 1), ("t", -1)), 0)
    assert _domain_points((("s", 8192), ("t", 8192)), (s,)) == 8192 * 8193 // 2  # a causal mask, instantly
