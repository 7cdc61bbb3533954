"""Closed forms of the polyhedral model: the collectives of known parallel schemes and their sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyparallel import ops
from polyparallel.ir import Graph, LoopNest, Op, OpKind, TensorKind, TensorSpec
from polyparallel.poly import (
    CACHE,
    DeviceMesh,
    IllegalPlacement,
    Placement,
    TensorLayout,
    check_placement,
    comm_of_op,
    dim_split_kind,
    layout_distribution,
    legal_placements,
    operand_need,
    output_layout,
    padding_of,
    reshard,
    reshard_edge,
)

from .layouts import draw_layout, most_lacked

B, S, H, F = 2, 8, 16, 64  # batch, sequence, hidden, ffn


class Builder:
    def __init__(self, name: str) -> None:
        self.g = Graph(name)

    def tensor(self, name: str, shape: tuple[int, ...], kind: str = "activation") -> str:
        self.g.add_tensor(TensorSpec(name, shape, kind=TensorKind(kind)))
        return name

    def op(self, name: str, kind: OpKind, nest: LoopNest | None, ins: tuple[str, ...], out: str,
           shape: tuple[int, ...]) -> Op:
        self.tensor(out, shape)
        return self.g.add_op(Op(name, kind, name, ins, (out,), nest, opaque_reason=None if nest else "test"))


def mlp_block() -> tuple[Graph, dict[str, Op]]:
    b = Builder("mlp")
    x = b.tensor("x", (B, S, H), "input")
    lw, lb = b.tensor("ln.w", (H,), "param"), b.tensor("ln.b", (H,), "param")
    w1, b1 = b.tensor("fc1.w", (F, H), "param"), b.tensor("fc1.b", (F,), "param")
    w2, b2 = b.tensor("fc2.w", (H, F), "param"), b.tensor("fc2.b", (H,), "param")
    o = {}
    o["ln"] = b.op("ln", OpKind.NORM, ops.layer_norm((B, S, H), (H,)), (x, lw, lb), "xn", (B, S, H))
    o["fc1"] = b.op("fc1", OpKind.CONTRACTION, ops.linear((B, S, H), (F, H), (F,)), ("xn", w1, b1), "h",
                    (B, S, F))
    o["gelu"] = b.op("gelu", OpKind.ELEMENTWISE, ops.elementwise((B, S, F), [(B, S, F)], flops=8), ("h",), "a",
                     (B, S, F))
    o["fc2"] = b.op("fc2", OpKind.CONTRACTION, ops.linear((B, S, F), (H, F), (H,)), ("a", w2, b2), "y",
                    (B, S, H))
    o["res"] = b.op("res", OpKind.ELEMENTWISE, ops.elementwise((B, S, H), [(B, S, H), (B, S, H)]), ("y", x),
                    "z", (B, S, H))
    return b.g, o


def test_data_parallel_gradient_all_reduce_equals_parameter_count():
    g, o = mlp_block()
    mesh = DeviceMesh.of(dp=2)
    batch_dim = {"ln": "b", "fc1": "b", "gelu": "d0", "fc2": "b", "res": "d0"}
    total = 0
    for name, op in o.items():
        c = comm_of_op(g, op, Placement.of(**{batch_dim[name]: "dp"}), mesh)
        assert all(col.kind == "all-reduce" and col.axes == ("dp",) for col in c.grad)
        assert not c.forward and not c.partial_outputs
        total += sum(col.payload for col in c.grad)
    assert total == g.param_count() == 2 * H + F * H + F + H * F + H
    # ring all-reduce: every device receives 2 (n - 1) / n of each gradient
    c = comm_of_op(g, o["fc1"], Placement.parse("b:dp"), mesh)
    assert sum(col.elements for col in c.grad) == 2 * 1 * (F * H // 2) + 2 * 1 * (F // 2)


def test_megatron_column_then_row_mlp_needs_one_all_reduce():
    g, o = mlp_block()
    mesh = DeviceMesh.of(tp=4)
    col, act, row = Placement.parse("n:tp"), Placement.parse("d2:tp"), Placement.parse("k:tp")
    between = [
        reshard(output_layout(g, o["fc1"], col, mesh), operand_need(g, o["gelu"], act, mesh, "in0"), mesh),
        reshard(output_layout(g, o["gelu"], act, mesh), operand_need(g, o["fc2"], row, mesh, "in0"), mesh),
    ]
    assert [r.kind for r in between] == ["none", "none"]
    assert [r.direct_elements for r in between] == [0, 0]
    fc2 = comm_of_op(g, o["fc2"], row, mesh)
    assert fc2.partial_outputs == (("out0", ("tp",)),) and not fc2.forward
    assert dict(fc2.split_kinds) == {"k": "reduction"}
    out = output_layout(g, o["fc2"], row, mesh)
    assert out.layout == TensorLayout((B, S, H), ((), (), ()), ("tp",))
    r = reshard(out, operand_need(g, o["res"], Placement(), mesh, "in0"), mesh)
    assert r.kind == "all-reduce"
    assert r.steps[0].payload == B * S * H
    assert r.elements == 2 * 3 * (B * S * H // 4)
    # the weights are split, not replicated: no gradient all-reduce in pure tensor parallelism
    assert not comm_of_op(g, o["fc1"], col, mesh).grad


def test_sequence_parallel_reduce_scatter_then_all_gather():
    g, o = mlp_block()
    mesh = DeviceMesh.of(tp=4)
    # row-parallel fc2 leaves partial sums; a sequence-parallel consumer takes them reduce-scattered
    seq = Placement.parse("d1:tp")
    rs = reshard(output_layout(g, o["fc2"], Placement.parse("k:tp"), mesh),
                 operand_need(g, o["res"], seq, mesh, "in0"), mesh)
    assert rs.kind == "reduce-scatter"
    assert rs.steps[0].tensor_axis == 1 and rs.steps[0].elements == 3 * (B * S * H // 4)
    # a sequence-split layer norm feeds a column-parallel fc1: all-gather along the sequence
    ag = reshard(output_layout(g, o["ln"], Placement.parse("s:tp"), mesh),
                 operand_need(g, o["fc1"], Placement.parse("n:tp"), mesh, "in0"), mesh)
    assert ag.kind == "all-gather" and ag.steps[0].tensor_axis == 1
    assert ag.elements == ag.direct_elements == B * S * H * 3 // 4


def test_attention_head_split_needs_nothing_and_key_split_needs_statistics():
    b = Builder("attn")
    nh, d = 4, 8
    q, k, v = (b.tensor(n, (B, nh, S, d)) for n in ("q", "k", "v"))
    att = b.op("attn", OpKind.ATTENTION, ops.attention((B, nh, S, d), (B, nh, S, d), (B, nh, S, d), causal=True),
               (q, k, v), "o", (B, nh, S, d))
    mesh = DeviceMesh.of(tp=4)
    heads = Placement.parse("h:tp")
    c = comm_of_op(b.g, att, heads, mesh)
    assert not c.forward and not c.partial_outputs
    assert str(output_layout(b.g, att, heads, mesh)) == "S(1)@tp"
    for i in range(3):
        r = reshard(TensorLayout.sharded((B, nh, S, d), tp=1), operand_need(b.g, att, heads, mesh, f"in{i}"), mesh)
        assert r.kind == "none"
    # splitting the key sequence: softmax statistics all-reduced inside, output left partial
    keys = Placement.parse("t:tp")
    c = comm_of_op(b.g, att, keys, mesh)
    assert dim_split_kind(att.nest, "t") == "reduction"
    assert [(x.operand, x.payload) for x in c.forward] == [("stats", B * nh * S)]
    assert c.partial_outputs == (("out0", ("tp",)),)
    # causal: the FLOPs of a query block count only the keys at or before it
    qblock = comm_of_op(b.g, att, Placement.parse("s:tp"), mesh)
    full = att.nest.flops()
    assert qblock.flops < full / 4 * 2 and qblock.flops > full / 4


def test_layer_norm_feature_split_reduces_statistics_only():
    g, o = mlp_block()
    mesh = DeviceMesh.of(tp=4)
    c = comm_of_op(g, o["ln"], Placement.parse("f:tp"), mesh)
    assert dim_split_kind(o["ln"].nest, "f") == "normalised"
    assert [(x.operand, x.payload) for x in c.forward] == [("stats", B * S)]
    assert not c.partial_outputs
    assert str(output_layout(g, o["ln"], Placement.parse("f:tp"), mesh)) == "S(2)@tp"


def test_vocab_parallel_embedding_leaves_partial_output():
    b = Builder("emb")
    w = b.tensor("wte", (32, H), "param")
    ids = b.tensor("ids", (B, S), "input")
    emb = b.op("emb", OpKind.EMBEDDING, ops.embedding((32, H), (B, S)), (w, ids), "e", (B, S, H))
    mesh = DeviceMesh.of(tp=4)
    c = comm_of_op(b.g, emb, Placement.parse("v:tp"), mesh)
    assert c.partial_outputs == (("out0", ("tp",)),)
    assert operand_need(b.g, emb, Placement.parse("v:tp"), mesh, "in0").counts().tolist() == [8 * H] * 4


def test_conv_halo_of_an_inner_device_is_two_rows():
    n, c, h, w = 2, 3, 16, 10
    b = Builder("conv")
    x = b.tensor("x", (n, c, h, w), "input")
    k = b.tensor("k", (4, c, 3, 3), "param")
    conv = b.op("conv", OpKind.CONV, ops.conv((n, c, h, w), (4, c, 3, 3), padding=1), (x, k), "y", (n, 4, h, w))
    mesh = DeviceMesh.of(sp=4)
    need = operand_need(b.g, conv, Placement.parse("h:sp"), mesh, "in0")
    r = reshard(TensorLayout.sharded((n, c, h, w), sp=2), need, mesh)
    assert r.kind == "halo" and r.steps[0].axes == ("sp",)
    per_device = need.missing(layout_distribution(TensorLayout.sharded((n, c, h, w), sp=2), mesh))
    assert per_device.tolist() == [n * c * w, 2 * n * c * w, 2 * n * c * w, n * c * w]
    assert r.elements == 2 * n * c * w


def test_uneven_three_to_one_all_gather():
    mesh = DeviceMesh.of(dp=2, weights={"dp": (3, 1)})
    r = reshard(TensorLayout.sharded((8, 4), dp=0), TensorLayout.replicated((8, 4)), mesh)
    assert r.kind == "all-gather"
    assert r.steps[0].total == 2 * 4 + 6 * 4 and r.elements == 6 * 4


def test_all_to_all_when_the_split_moves_axis():
    mesh = DeviceMesh.of(tp=4)
    r = reshard(TensorLayout.sharded((8, 16), tp=0), TensorLayout.sharded((8, 16), tp=1), mesh)
    assert r.kind == "all-to-all"
    # each device keeps the 2x4 corner it already has of its new 8x4 column block
    assert r.elements == r.direct_elements == 8 * 4 - 2 * 4


def test_multi_step_route_reduce_scatter_then_all_gather():
    mesh = DeviceMesh.of(dp=2, tp=2)
    have = TensorLayout((8, 8), (("dp",), ()), ("tp",))
    need = TensorLayout((8, 8), ((), ("tp",)))
    r = reshard(have, need, mesh)
    assert r.kind == "reduce-scatter+all-gather"
    assert [s.axes for s in r.steps] == [("tp",), ("dp",)]
    assert r.steps[0].elements == 1 * (4 * 4) and r.steps[1].elements == 4 * 4


def test_illegal_placements_are_refused_with_reasons():
    mesh = DeviceMesh.of(dp=4, tp=2)
    nest = ops.linear((3, 8), (16, 8))
    with pytest.raises(IllegalPlacement, match="extent 3 but is split 4 ways"):
        check_placement(nest, Placement.parse("b:dp"), mesh)
    with pytest.raises(IllegalPlacement, match="used more than once"):
        Placement.parse("n:tp,k:tp")
    with pytest.raises(IllegalPlacement, match="opaque"):
        check_placement(None, Placement.parse("b:dp"), mesh)
    with pytest.raises(IllegalPlacement, match="has axes"):
        check_placement(nest, Placement.parse("n:pp"), mesh)
    scatter = ops.gather((6, 4), (5,), 0)  # embedding-style: fine
    assert legal_placements(None, scatter, mesh)
    odd = ops.linear((6, 8), (16, 8))
    with pytest.raises(IllegalPlacement, match="not divisible"):
        check_placement(odd, Placement.parse("b:dp"), mesh, uneven="refuse")
    assert padding_of(odd, Placement.parse("b:dp"), mesh) == {"b": 4 * 2 - 6}
    assert legal_placements(None, None, mesh) == [Placement()]


def test_reshard_edge_and_cache_hits_on_repeated_layers():
    g, o = mlp_block()
    mesh = DeviceMesh.of(dp=2, tp=2)
    CACHE.clear()
    r1 = reshard_edge(g, "h", Placement.parse("n:tp,b:dp"), o["gelu"], Placement.parse("d2:tp,d0:dp"), mesh)
    assert [r.kind for r in r1] == ["none"]
    misses = CACHE.stats()["all"]["misses"]
    reshard_edge(g, "h", Placement.parse("n:tp,b:dp"), o["gelu"], Placement.parse("d2:tp,d0:dp"), mesh)
    assert CACHE.stats()["all"]["misses"] == misses and CACHE.stats()["all"]["hits"] > 0


def test_strings_round_trip():
    assert str(Placement.parse("s:dp+tp,b:pp")) == "b:pp,s:dp+tp"
    assert str(DeviceMesh.parse("dp=2[3:1],tp=4")) == "dp=2[3:1],tp=4"
    assert TensorLayout.sharded((4, 4), partial=("pp",), tp=1).dtensor(DeviceMesh.of(tp=2, pp=2)) == ("S(1)", "P")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_closed_form_layout_reshards_equal_per_device_counts(data):
    """The closed form for equal blocks against the exact per-device path, and the direct volume
    against a numpy enumeration of which elements each device lacks."""
    from polyparallel.poly import _reshard

    mesh = data.draw(st.sampled_from([DeviceMesh.of(a=2), DeviceMesh.of(a=2, b=2), DeviceMesh.of(a=2, b=3),
                                      DeviceMesh.of(a=4, b=2)]))
    shape = tuple(data.draw(st.sampled_from([2, 3, 4, 6, 8])) for _ in range(data.draw(st.integers(1, 3))))

    have, need = draw_layout(data, mesh, shape, True), draw_layout(data, mesh, shape, False)
    CACHE.clear()
    fast = reshard(have, need, mesh)
    CACHE.clear()
    original = _reshard._even_blocks
    _reshard._even_blocks = lambda shape, shards, mesh: None
    try:
        slow = reshard(have, need, mesh)
    finally:
        _reshard._even_blocks = original
        CACHE.clear()
    assert fast.steps == slow.steps and fast.direct_elements == slow.direct_elements
    assert fast.elements >= fast.direct_elements  # a route never beats the exact lower bound
    assert fast.direct_elements == most_lacked(have, need, mesh)


def test_reordered_mesh_axes_are_a_permutation_not_a_free_slice():
    mesh = DeviceMesh.of(dp=2, tp=2)
    r = reshard(TensorLayout.sharded((8,), tp=0), TensorLayout.sharded((8,), dp=0), mesh)
    # device (d, t) holds half t and needs half d: the two off-diagonal devices need all 4 elements
    assert r.direct_elements == 4
    assert r.elements >= r.direct_elements
