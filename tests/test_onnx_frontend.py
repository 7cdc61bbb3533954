"""ONNX frontend: shapes, parameters and FLOPs against closed forms and onnxruntime.

Reference values come from outside the frontend: closed-form FLOP counts written out
here, parameter counts summed from the initializers, output shapes and values from
onnxruntime, and view/pool loop nests executed point by point against its results.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import polyparallel as pp
from polyparallel.frontends import CaptureError, OpaqueOpWarning
from polyparallel.frontends.onnx import capture_onnx
from polyparallel.ir import ANY, AffineExpr, Graph, LoopNest, OpKind, Role, TensorKind

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(0)
F = TensorProto.FLOAT


def _init(name: str, shape: tuple[int, ...], dtype: type = np.float32) -> onnx.TensorProto:
    if np.issubdtype(dtype, np.floating):
        return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)
    return numpy_helper.from_array(np.asarray(shape, dtype=dtype), name)


def _model(nodes, inputs, outputs, inits=(), opset: int = 18) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name: str, shape, dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _capture(m, **kw) -> Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpaqueOpWarning)  # these models must be fully modelled
        return capture_onnx(m, **kw)


def _float_init_numel(m: onnx.ModelProto, skip=()) -> int:
    return sum(math.prod(t.dims) for t in m.graph.initializer
               if t.data_type == F and len(t.dims) >= 1 and t.name not in skip)


# ------------------------------------------------------------------------------------------
# models


def test_mlp_gemm_params_and_flops():
    B, I, H, O = 4, 16, 32, 10
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="/fc1/Gemm"),
             helper.make_node("Relu", ["h"], ["a"], name="/act/Relu"),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["y"], transB=1, name="/fc2/Gemm")]
    inits = [_init("w1", (H, I)), _init("b1", (H,)), _init("w2", (O, H)), _init("b2", (O,))]
    m = _model(nodes, [_vi("x", [B, I])], [_vi("y", [B, O])], inits)
    g = _capture(m)
    assert g.param_count() == H * I + H + O * H + O == _float_init_numel(m)
    assert {t.name for t in g.params} == {"w1", "b1", "w2", "b2"}
    # two linears (2 flops per multiply-add, one per bias add) and one relu
    assert g.flops() == 2 * B * I * H + B * H + B * H + 2 * B * H * O + B * O
    assert [op.kind for op in g.ops] == [OpKind.CONTRACTION, OpKind.ELEMENTWISE, OpKind.CONTRACTION]
    assert g.ops[0].module == "fc1" and g.inputs == ["x"] and g.outputs == ["y"]
    assert g.source == "onnx" and not g.opaque_ops()


def test_matmul_add_equals_gemm_flops():
    """The 3-D export of nn.Linear (MatMul with a [K, N] weight, then Add) costs what Gemm does."""
    B, S, K, N = 2, 5, 8, 6
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])]
    m = _model(nodes, [_vi("x", [B, S, K])], [_vi("y", [B, S, N])], [_init("w", (K, N)), _init("b", (N,))])
    g = _capture(m)
    assert g.flops() == 2 * B * S * K * N + B * S * N
    assert g.param_count() == K * N + N
    # one linear layer, as the torch frontend sees nn.Linear: the bias add is part of it
    (op,) = g.ops
    assert op.kind is OpKind.CONTRACTION and op.inputs == ("x", "w", "b") and op.outputs == ("y",)
    assert [st.name for st in op.nest.statements] == ["mac", "bias"]
    mac = g.ops[0].nest
    assert {d.name for d in mac.dims if d.role is Role.REDUCTION} == {"k"}


def test_matmul_add_not_fused_when_the_product_is_reused():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"]),
             helper.make_node("Relu", ["t"], ["r"])]
    m = _model(nodes, [_vi("x", [2, 4])], [_vi("y", [2, 3]), _vi("r", [2, 3])], [_init("w", (4, 3)), _init("b", (3,))])
    g = _capture(m)
    assert [op.target for op in g.ops] == ["MatMul", "Add", "Relu"] and g.flops() == 2 * 2 * 4 * 3 + 6 + 6


def test_torchscript_parameter_copies_count_as_parameters():
    """torch.onnx merges equal-valued parameters and re-creates them with Identity."""
    nodes = [helper.make_node("Identity", ["ln1.w"], ["ln2.w"]),
             helper.make_node("LayerNormalization", ["x", "ln1.w"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "ln2.w"], ["y"])]
    ones = numpy_helper.from_array(np.ones(8, np.float32), "ln1.w")
    g = _capture(_model(nodes, [_vi("x", [2, 8])], [_vi("y", [2, 8])], [ones]))
    assert g.param_count() == 16 and {t.name for t in g.params} == {"ln1.w", "ln2.w"}
    assert [op.target for op in g.ops] == ["LayerNormalization"] * 2


def test_conv_net_against_onnxruntime_shapes():
    B, C, Hh, W, O = 2, 3, 11, 9, 8
    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 2, 0, 1], strides=[2, 1], name="/conv/Conv"),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "mean", "var"], ["n"], name="/bn/BN"),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        helper.make_node("GlobalAveragePool", ["p"], ["gp"]),
        helper.make_node("Flatten", ["gp"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1),
    ]
    inits = [_init("cw", (O, C, 3, 3)), _init("cb", (O,)), _init("s", (O,)), _init("bb", (O,)),
             _init("mean", (O,)), numpy_helper.from_array(np.abs(RNG.standard_normal(O)).astype(np.float32), "var"),
             _init("fw", (5, O)), _init("fb", (5,))]
    m = _model(nodes, [_vi("x", [B, C, Hh, W])], [_vi("y", [B, 5])], inits)
    x = RNG.standard_normal((B, C, Hh, W)).astype(np.float32)
    g = _capture(m)
    # every intermediate shape agrees with what onnxruntime computes
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    for t in ("c", "p", "gp"):
        probe.graph.output.append(helper.make_value_info(t, onnx.TypeProto()))
    y, c, p, gp = _ort(probe, {"x": x})
    assert g.shape("c") == c.shape and g.shape("p") == p.shape and g.shape("gp") == gp.shape
    assert g.shape("y") == y.shape
    Ho, Wo = c.shape[2:]
    Po, Qo = p.shape[2:]
    expect = (2 * B * O * Ho * Wo * C * 9 + B * O * Ho * Wo  # conv + bias
              + 4 * B * O * Ho * Wo  # eval batch norm: normalise, scale, shift
              + B * O * Ho * Wo  # relu
              + B * O * Po * Qo * 4  # 2x2 max pool
              + B * O * Po * Qo  # global average
              + 2 * B * O * 5 + B * 5)  # classifier
    assert g.flops() == expect
    kinds = {t.name: t.kind for t in g.tensors.values()}
    assert kinds["mean"] is TensorKind.BUFFER and kinds["var"] is TensorKind.BUFFER
    assert g.param_count() == _float_init_numel(m, skip=("mean", "var"))


def test_conv_auto_pad_groups_dilation():
    B, C, O, G = 1, 4, 6, 2
    for auto in ("SAME_UPPER", "SAME_LOWER", "VALID"):
        dil = [1, 2] if auto == "VALID" else [1, 1]  # onnxruntime refuses dilated SAME padding
        node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto, strides=[2, 3], dilations=dil, group=G)
        m = _model([node], [_vi("x", [B, C, 9, 10])], [_vi("y", None)], [_init("w", (O, C // G, 3, 2))])
        x = RNG.standard_normal((B, C, 9, 10)).astype(np.float32)
        (ref,) = _ort(m, {"x": x})
        g = _capture(m)
        assert g.shape("y") == ref.shape
        assert g.flops() == 2 * math.prod(ref.shape) * (C // G) * 3 * 2


def _attention_block(B: int, S: int, D: int, H: int) -> onnx.ModelProto:
    dh = D // H
    c64 = lambda name, v: numpy_helper.from_array(np.asarray(v, dtype=np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln_w", "ln_b"], ["ln"], axis=-1, name="/ln/LN"),
        helper.make_node("MatMul", ["ln", "w_qkv"], ["qkv"], name="/attn/qkv/MatMul"),
        helper.make_node("Split", ["qkv", "split3"], ["q0", "k0", "v0"], axis=2),
        *[helper.make_node("Reshape", [f"{t}0", "heads"], [f"{t}1"]) for t in "qkv"],
        helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="/attn/scores"),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        # the target shape is computed from the input's shape, as exporters do
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "zero"], ["b_dim"], axis=0),
        helper.make_node("Unsqueeze", ["b_dim", "ax0"], ["b1"]),
        helper.make_node("Concat", ["b1", "rest"], ["merged_shape"], axis=0),
        helper.make_node("Reshape", ["ctx_t", "merged_shape"], ["merged"]),
        helper.make_node("MatMul", ["merged", "w_o"], ["proj"], name="/attn/o/MatMul"),
        helper.make_node("Add", ["proj", "x"], ["y"]),
    ]
    inits = [_init("ln_w", (D,)), _init("ln_b", (D,)), _init("w_qkv", (D, 3 * D)), _init("w_o", (D, D)),
             c64("split3", [D, D, D]), c64("heads", [0, 0, H, dh]), c64("zero", 0), c64("ax0", [0]),
             c64("rest", [S, D]), numpy_helper.from_array(np.array(dh ** -0.5, np.float32), "scale")]
    return _model(nodes, [_vi("x", ["batch", S, D])], [_vi("y", ["batch", S, D])], inits)


def test_attention_block_closed_form():
    B, S, D, H = 2, 7, 16, 4
    m = _attention_block(B, S, D, H)
    g = _capture(m, dim_values={"batch": B})
    assert g.shape("y") == (B, S, D)
    expect = (7 * B * S * D  # layer norm: statistics (3) and normalise-scale-shift (4)
              + 2 * B * S * D * 3 * D  # qkv projection
              + 2 * B * H * S * S * (D // H)  # scores
              + B * H * S * S  # scaling
              + 5 * B * H * S * S  # softmax: statistics (3) and normalisation (2)
              + 2 * B * H * S * S * (D // H)  # probs @ v
              + 2 * B * S * D * D  # output projection
              + B * S * D)  # residual
    assert g.flops() == expect
    assert g.param_count() == 2 * D + 3 * D * D + D * D
    kinds = {t.name: t.kind for t in g.tensors.values()}
    assert kinds["scale"] is TensorKind.CONST and kinds["heads"] is TensorKind.CONST
    # the shape plumbing was evaluated at capture time, not kept as ops
    assert {"Shape", "Gather", "Unsqueeze"}.isdisjoint(op.target for op in g.ops)
    assert any("constant-folded" in w for w in g.warnings)
    assert g.producer("merged").kind is OpKind.VIEW
    # against onnxruntime, with the same bound batch size
    x = RNG.standard_normal((B, S, D)).astype(np.float32)
    assert _ort(m, {"x": x})[0].shape == g.shape("y")


def test_softmax_axis_semantics_by_opset():
    x = [2, 3, 4]
    for opset, axis, reduced in ((11, 1, {"d1", "d2"}), (13, 1, {"d1"}), (11, 2, {"d2"}), (13, -1, {"d2"})):
        m = _model([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], [_vi("x", x)], [_vi("y", x)],
                   opset=opset)
        op = _capture(m).ops[0]
        red = {d.name for d in op.nest.dims if d.role is Role.REDUCTION}
        assert red == reduced, (opset, axis)
        assert op.flops == 5 * 24


def test_reduce_axes_attribute_and_input():
    x = (3, 4, 5)
    old = _model([helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)], [_vi("x", x)],
                 [_vi("y", [3, 5])], opset=11)
    new = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], [_vi("x", x)],
                 [_vi("y", [3, 5])], [numpy_helper.from_array(np.array([1], np.int64), "axes")], opset=18)
    for m in (old, new):
        op = _capture(m).ops[0]
        assert op.kind is OpKind.REDUCE and op.flops == 60
        assert [d.role for d in op.nest.dims] == [Role.PARALLEL, Role.REDUCTION, Role.PARALLEL]


def test_losses_and_embedding():
    N, C, V, E = 6, 5, 11, 4
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], axis=0),
             helper.make_node("Gemm", ["e", "w"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
             helper.make_node("LogSoftmax", ["logits"], ["lp"], axis=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["lp", "labels"], ["nll"], reduction="sum")]
    m = _model(nodes, [_vi("ids", [N], TensorProto.INT64), _vi("labels", [N], TensorProto.INT64)],
               [_vi("loss", []), _vi("nll", [])], [_init("emb", (V, E)), _init("w", (C, E))])
    g = _capture(m)
    assert [op.kind for op in g.ops] == [OpKind.EMBEDDING, OpKind.CONTRACTION, OpKind.LOSS, OpKind.SOFTMAX,
                                         OpKind.LOSS]
    assert g.param_count() == V * E + C * E
    assert g.ops[0].flops == 0 and g.ops[1].flops == 2 * N * E * C


def test_unknown_op_is_opaque_and_warned():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("FancyOp", ["r"], ["f"], domain="com.example"),
             helper.make_node("Reshape", ["f", "sq"], ["m"]),
             helper.make_node("Det", ["m"], ["d"])]
    m = _model(nodes, [_vi("x", [2, 16])], [_vi("d", [2])],
               [numpy_helper.from_array(np.array([2, 4, 4], np.int64), "sq")])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    m.graph.value_info.append(_vi("f", [2, 16]))
    with pytest.warns(OpaqueOpWarning, match=r"2 op\(s\) kept opaque.*FancyOp"):
        g = capture_onnx(m)
    assert [op.target for op in g.ops] == ["Relu", "com.example.FancyOp", "Reshape", "Det"]
    fancy, det = g.ops[1], g.ops[3]
    assert fancy.is_opaque and fancy.flops == 32 and fancy.opaque_reason
    assert det.is_opaque and det.flops == 2 and det.kind is OpKind.OPAQUE
    assert g.flops() == 32 + 32 + 0 + 2


def test_topk_reads_the_whole_axis():
    m = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)], [_vi("x", [2, 10, 3])],
               [_vi("v", None), _vi("i", None)], [numpy_helper.from_array(np.array([4], np.int64), "k")])
    op = _capture(m).ops[0]
    assert op.kind is OpKind.REDUCE and op.flops == 2 * 3 * 4 * 10
    assert [d.name for d in op.nest.dims if d.role is Role.REDUCTION] == ["t"]


# ------------------------------------------------------------------------------------------
# loop nests executed point by point against onnxruntime


def _execute(nest: LoopNest, inputs: list[np.ndarray], out_shape: tuple[int, ...], *,
             combine: str = "copy") -> np.ndarray:
    """Run a single-statement data-movement (or max-pool) nest: out[w(p)] = in0[r(p)] for every point p."""
    (st,) = nest.statements
    ext = nest.extents
    out = np.full(out_shape, -np.inf if combine == "max" else 0, dtype=np.float64)
    read = st.reads[0]
    src = inputs[int(read.operand[2:])]
    for pt in itertools.product(*(range(ext[d]) for d in st.dims)):
        env = dict(zip(st.dims, pt))
        if any(c.eval(env) < 0 for c in st.constraints):
            continue
        ri = tuple(e.eval(env) for e in read.index)
        wi = tuple(e.eval(env) for e in st.writes[0].index)
        inside = all(0 <= i < s for i, s in zip(ri, src.shape))
        v = src[ri] if inside else (-np.inf if combine == "max" else 0.0)
        out[wi] = max(out[wi], v) if combine == "max" else v
    return out


@pytest.mark.parametrize("node,shape,inits", [
    (helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"]), (5, 6, 7),
     {"st": [4, 1], "en": [0, 100], "ax": [0, 2], "sp": [-2, 3]}),
    (helper.make_node("Slice", ["x", "st", "en"], ["y"]), (5, 6), {"st": [-3], "en": [-1]}),
    (helper.make_node("Pad", ["x", "pads"], ["y"]), (3, 4), {"pads": [1, -1, 2, 2]}),
    (helper.make_node("Tile", ["x", "reps"], ["y"]), (2, 3), {"reps": [3, 2]}),
    (helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1]), (2, 3, 4), {}),
    (helper.make_node("Reshape", ["x", "shape"], ["y"]), (2, 3, 4), {"shape": [0, -1, 2]}),
    (helper.make_node("Expand", ["x", "shape"], ["y"]), (3, 1), {"shape": [2, 3, 4]}),
    (helper.make_node("Gather", ["x", "i"], ["y"], axis=1), (3, 4, 2), {"i": 2}),
    (helper.make_node("Flatten", ["x"], ["y"], axis=2), (2, 3, 4, 5), {}),
    (helper.make_node("Unsqueeze", ["x", "ax"], ["y"]), (3, 4), {"ax": [0, 3]}),
    (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2), (1, 8, 2, 3), {}),
    (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD"), (2, 8, 3, 2), {}),
    (helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2), (1, 3, 4, 6), {}),
])
def test_view_nests_reproduce_onnxruntime(node, shape, inits):
    ints = [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in inits.items()]
    m = _model([node], [_vi("x", list(shape))], [_vi("y", None)], ints)
    x = RNG.standard_normal(shape).astype(np.float32)
    (ref,) = _ort(m, {"x": x})
    g = _capture(m)
    (op,) = g.ops
    assert op.kind is OpKind.VIEW and op.flops == 0
    np.testing.assert_allclose(_execute(op.nest, [x], g.shape("y")), ref, rtol=1e-6)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 1]},
    {"kernel_shape": [2, 2], "dilations": [2, 1]},
])
def test_max_pool_nest_reproduces_onnxruntime(attrs):
    m = _model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], [_vi("x", [1, 2, 7, 6])], [_vi("y", None)])
    x = RNG.standard_normal((1, 2, 7, 6)).astype(np.float32)
    (ref,) = _ort(m, {"x": x})
    g = _capture(m)
    assert g.shape("y") == ref.shape
    np.testing.assert_allclose(_execute(g.ops[0].nest, [x], ref.shape, combine="max"), ref, rtol=1e-6)


@pytest.mark.parametrize("attrs,scales", [
    ({}, [1, 1, 2, 2]),
    ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 3, 2]),
    ({"coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 1, 4]),
])
def test_resize_nearest_nest_reproduces_onnxruntime(attrs, scales):
    sc = numpy_helper.from_array(np.array(scales, np.float32), "scales")
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest", **attrs)
    m = _model([node], [_vi("x", [1, 2, 3, 4])], [_vi("y", None)], [sc])
    x = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)
    (ref,) = _ort(m, {"x": x})
    g = _capture(m)
    assert g.shape("y") == ref.shape and g.ops[0].kind is OpKind.VIEW
    np.testing.assert_allclose(_execute(g.ops[0].nest, [x], ref.shape), ref, rtol=1e-6)


def test_resize_linear_is_modelled_by_integer_factors_with_half_pixel_centres_only():
    sc = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")
    m = _model([node], [_vi("x", [1, 2, 3, 4])], [_vi("y", None)], [sc])
    g = capture_onnx(m)
    assert not g.ops[0].is_opaque and g.shape("y") == (1, 2, 6, 8)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear",
                            coordinate_transformation_mode="align_corners")
    m = _model([node], [_vi("x", [1, 2, 3, 4])], [_vi("y", None)], [sc])
    with pytest.warns(OpaqueOpWarning, match="Resize"):
        g = capture_onnx(m)
    assert g.ops[0].is_opaque and g.shape("y") == (1, 2, 6, 8)


def test_concat_and_split_cover_their_outputs():
    nodes = [helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
             helper.make_node("Split", ["c", "sizes"], ["p", "q", "r"], axis=1)]
    m = _model(nodes, [_vi("a", [2, 3]), _vi("b", [2, 5])], [_vi("p", None), _vi("q", None), _vi("r", None)],
               [numpy_helper.from_array(np.array([1, 4, 3], np.int64), "sizes")])
    g = _capture(m)
    assert [op.kind for op in g.ops] == [OpKind.CONCAT, OpKind.SPLIT]
    assert [g.shape(t) for t in "pqr"] == [(2, 1), (2, 4), (2, 3)]


def test_gather_with_index_tensor_reads_any_row():
    m = _model([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)],
               [_vi("x", [3, 4, 5]), _vi("i", [2, 6], TensorProto.INT64)], [_vi("y", None)])
    op = _capture(m).ops[0]
    assert op.kind is OpKind.GATHER
    (st,) = op.nest.statements
    assert st.reads[0].index[1] is ANY and all(isinstance(e, AffineExpr) for e in st.writes[0].index)


# ------------------------------------------------------------------------------------------
# dynamic dims and bad input


def test_dynamic_dim_needs_a_value():
    m = _attention_block(2, 7, 16, 4)
    with pytest.raises(CaptureError, match=r"graph input 'x' has a dynamic dim 'batch'.*dim_values"):
        capture_onnx(m)
    assert capture_onnx(m, dim_values={"batch": 3}).shape("y") == (3, 7, 16)
    assert capture_onnx(m, input_shapes={"x": [5, 7, 16]}).shape("y") == (5, 7, 16)


def test_search_and_evaluate_take_a_dynamic_dim_on_the_command_line(tmp_path, capsys):
    """The capture error tells the user to pass ``--dim batch=N``; search and evaluate take it (only
    graph did), and refuse it for a model that is not an ONNX file."""
    from polyparallel.cli import main

    def run(*argv: str) -> int:
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        return int(e.value.code or 0)

    path = tmp_path / "block.onnx"
    onnx.save(_attention_block(2, 7, 16, 4), str(path))
    assert run("search", str(path), "--dim", "batch=4", "--cluster", "local-cpu:2", "--json") == 0
    assert json.loads(capsys.readouterr().out)["global_batch"] == 8
    assert run("evaluate", str(path), "--dim", "batch=4", "--dp", "2", "--json") == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert run("search", "gpt-tiny", "--dim", "batch=4") == 2
    assert "--dim sets a dynamic dim of an .onnx model" in capsys.readouterr().err


def test_anonymous_dynamic_dim_named_by_input_and_axis():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [None, 4])], [_vi("y", [None, 4])])
    with pytest.raises(CaptureError, match=r"'x:0'"):
        capture_onnx(m)
    assert capture_onnx(m, dim_values={"x:0": 6}).shape("y") == (6, 4)


def test_input_without_shape():
    vi = helper.make_tensor_value_info("x", F, None)
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [vi], [_vi("y", None)])
    with pytest.raises(CaptureError, match=r"graph input 'x' has no shape.*input_shapes"):
        capture_onnx(m)


@pytest.fixture()
def mlp_file(tmp_path: Path) -> Path:
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    m = _model(nodes, [_vi("x", [2, 64])], [_vi("y", [2, 32])], [_init("w", (32, 64)), _init("b", (32,))])
    p = tmp_path / "mlp.onnx"
    onnx.save(m, p)
    return p


def test_path_and_pp_capture_dispatch(mlp_file: Path):
    g = pp.capture(str(mlp_file))
    assert g.name == "m" and g.param_count() == 32 * 64 + 32
    assert pp.capture(mlp_file).flops() == g.flops() == 2 * 2 * 64 * 32 + 2 * 32


def test_not_onnx_file(tmp_path: Path):
    p = tmp_path / "notes.onnx"
    p.write_text("this is a text file, not a model\n" * 20)
    with pytest.raises(CaptureError, match=r"notes\.onnx.*not (a readable|a complete) ONNX model"):
        capture_onnx(p)


def test_truncated_file(mlp_file: Path, tmp_path: Path):
    data = mlp_file.read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 40):
        p = tmp_path / f"cut{cut}.onnx"
        p.write_bytes(data[:cut])
        with pytest.raises(CaptureError, match=r"truncated"):
            capture_onnx(p)


def test_empty_and_missing_files(tmp_path: Path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(CaptureError, match="is empty"):
        capture_onnx(tmp_path / "empty.onnx")
    with pytest.raises(CaptureError, match="does not exist"):
        capture_onnx(tmp_path / "nope.onnx")


def test_external_weights_are_not_read(tmp_path: Path):
    """Only initializer shapes are needed: the side file of the weights may even be gone."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = _model(nodes, [_vi("x", [2, 300])], [_vi("y", [2, 400])], [_init("w", (300, 400))])
    onnx.save(m, tmp_path / "big.onnx", save_as_external_data=True, location="big.bin", size_threshold=1024)
    (tmp_path / "big.bin").unlink()
    g = capture_onnx(tmp_path / "big.onnx")
    assert g.param_count() == 300 * 400 and g.flops() == 2 * 2 * 300 * 400


def test_sequence_input_is_refused_clearly():
    seq = helper.make_tensor_sequence_value_info("s", F, [2])
    m = _model([helper.make_node("SequenceLength", ["s"], ["n"])], [seq], [_vi("n", [], TensorProto.INT64)])
    with pytest.raises(CaptureError, match=r"graph input 's' has type sequence; only tensor inputs"):
        capture_onnx(m)


# ------------------------------------------------------------------------------------------
# less common ops


def test_einsum_ellipsis_matches_explicit_letters():
    a, b = [2, 3, 4, 5], [2, 3, 5, 6]
    flops = []
    for eq in ("...ij,...jk->...ik", "abij,abjk->abik", "...ij,...jk"):
        m = _model([helper.make_node("Einsum", ["a", "b"], ["y"], equation=eq)], [_vi("a", a), _vi("b", b)],
                   [_vi("y", None)])
        g = _capture(m)
        assert g.shape("y") == (2, 3, 4, 6)
        flops.append(g.flops())
    assert flops == [2 * 2 * 3 * 4 * 5 * 6] * 3


def test_lrn_and_normalisations():
    x = [2, 6, 3, 3]
    n = math.prod(x)
    cases = [(helper.make_node("LRN", ["x"], ["y"], size=3), n * 3 * 2 + n * 5),
             (helper.make_node("LpNormalization", ["x"], ["y"], axis=1), n * 3),
             (helper.make_node("MeanVarianceNormalization", ["x"], ["y"]), n * 5),
             (helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"]), n * 7)]
    for node, flops in cases:
        m = _model([node], [_vi("x", x)], [_vi("y", x)], [_init("s", (6,)), _init("b", (6,))])
        op = _capture(m).ops[0]
        assert op.kind is OpKind.NORM and op.flops == flops, node.op_type


def test_scatter_and_gather_nd_write_data_dependent_rows():
    nodes = [helper.make_node("ScatterND", ["x", "i", "u"], ["y"]),
             helper.make_node("GatherND", ["y", "i"], ["z"])]
    m = _model(nodes, [_vi("x", [4, 5]), _vi("i", [3, 1], TensorProto.INT64), _vi("u", [3, 5])],
               [_vi("z", [3, 5])])
    g = _capture(m)
    scatter, gather = g.ops
    assert scatter.nest.statements[1].writes[0].index[0] is ANY
    assert gather.nest.statements[0].reads[0].index[0] is ANY and g.shape("z") == (3, 5)


def test_old_opset_dropout_mask_gets_a_shape():
    m = _model([helper.make_node("Dropout", ["x"], ["y", "mask"], ratio=0.5)], [_vi("x", [2, 3])],
               [_vi("y", None)], opset=9)
    g = _capture(m)
    assert g.shape("mask") == (2, 3) and g.tensors["mask"].dtype == "bool"
    assert g.ops[0].kind is OpKind.VIEW and g.flops() == 0  # inference: an identity


def test_split_to_sequence_then_sequence_at():
    """How torch.onnx (dynamo) exports ``tensor.split``: a sequence, then picks by constant position."""
    nodes = [helper.make_node("SplitToSequence", ["x", "sizes"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "one"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    inits = [numpy_helper.from_array(np.array([2, 3, 1], np.int64), "sizes"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    g = _capture(_model(nodes, [_vi("x", [4, 6])], [_vi("y", None)], inits))
    assert [op.kind for op in g.ops] == [OpKind.SPLIT, OpKind.VIEW, OpKind.ELEMENTWISE]
    assert g.shape("b") == (4, 3) and g.flops() == 12


def test_sequence_concatenated_along_a_new_axis_is_a_stack():
    """``ConcatFromSequence`` with ``new_axis=1`` (how a ``torch.stack`` of a sequence exports) has the
    loop nest of a stack: input ``k`` is slice ``k`` of the new axis (it was left opaque)."""
    from tests.nest_eval import run

    nodes = [helper.make_node("SequenceConstruct", ["a", "b"], ["seq"]),
             helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=1, new_axis=1)]
    g = _capture(_model(nodes, [_vi("a", [2, 3]), _vi("b", [2, 3])], [_vi("y", None)], opset=17))
    (stack,) = [op for op in g.ops if op.target == "ConcatFromSequence"]
    a, b = np.arange(6.0).reshape(2, 3), -np.arange(6.0).reshape(2, 3)
    assert g.shape("y") == (2, 2, 3) and stack.kind is OpKind.CONCAT and not stack.is_opaque
    np.testing.assert_array_equal(run(stack.nest, {"in0": a, "in1": b}, {"out0": (2, 2, 3)})["out0"],
                                  np.stack([a, b], 1))


def test_onnxruntime_contrib_ops_keep_shapes_flowing():
    """An ORT-optimised model: ONNX shape inference stops at com.microsoft ops; ORT's goes on."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    nodes = [helper.make_node("FastGelu", ["x", "b"], ["g"], domain="com.microsoft"),
             helper.make_node("SkipLayerNormalization", ["g", "x", "gamma", "beta"], ["s"], domain="com.microsoft"),
             helper.make_node("MatMul", ["s", "w"], ["y"])]
    inits = [_init("b", (8,)), _init("gamma", (8,)), _init("beta", (8,)), _init("w", (8, 4))]
    m = _model(nodes, [_vi("x", [2, 3, 8])], [_vi("y", None)], inits, opset=17)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.warns(OpaqueOpWarning, match="SkipLayerNormalization"):
        g = capture_onnx(m)
    assert g.shape("s") == (2, 3, 8) and g.shape("y") == (2, 3, 4)
    gelu, skip_ln, mm = g.ops
    assert gelu.kind is OpKind.ELEMENTWISE and gelu.flops == 48 * (10 + 1)  # tanh-GELU after the bias add
    assert skip_ln.is_opaque and mm.flops == 2 * 6 * 8 * 4


@pytest.mark.slow
def test_every_onnx_node_test_model_captures_or_fails_clearly():
    """All ~1900 ONNX backend node tests: a graph with every node's outputs, or a CaptureError."""
    from onnx.backend.test.case import node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases.collect_testcases(None)
        assert len(cases) > 1000
        captured = 0
        for case in cases:
            try:
                g = capture_onnx(case.model, name=case.name)
            except CaptureError as e:
                assert "<ModelProto>" in str(e)  # says where
                continue
            captured += 1
            seqs = {n.output[0] for n in case.model.graph.node if "Sequence" in n.op_type}
            for n in case.model.graph.node:
                for o in n.output:
                    assert not o or o in g.tensors or o in seqs, (case.name, n.op_type, o)
            for op in g.ops:
                assert op.nest is not None or op.kind is OpKind.OPAQUE
    assert captured > 0.9 * len(cases)


def test_control_flow_is_opaque_and_depends_on_what_its_body_reads():
    then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [_vi("t", [2, 3])])
    other = helper.make_graph([helper.make_node("Sub", ["x", "w"], ["e"])], "else", [], [_vi("e", [2, 3])])
    nodes = [helper.make_node("Relu", ["x0"], ["x"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["y", "y"], ["z"])]
    m = _model(nodes, [_vi("x0", [2, 3]), _vi("cond", [], TensorProto.BOOL)], [_vi("z", [2, 3])],
               [_init("w", (2, 3))])
    with pytest.warns(OpaqueOpWarning, match="If"):
        g = capture_onnx(m)
    cond = g.op("If")
    assert cond.is_opaque and set(cond.inputs) == {"cond", "x", "w"} and g.shape("y") == (2, 3)
    mul = g.ops[-1]
    assert mul.inputs == ("y", "y") and mul.flops == 6


def test_attention_op_3d_inputs_same_nest_as_4d():
    """Opset-23 Attention on [B, S, H*D] inputs costs what it costs on [B, H, S, D]."""
    B, S, T, Hq, Hk, D = 2, 5, 6, 4, 2, 8
    flat = _model([helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=Hq, kv_num_heads=Hk,
                                    is_causal=1)],
                  [_vi("q", [B, S, Hq * D]), _vi("k", [B, T, Hk * D]), _vi("v", [B, T, Hk * D])], [_vi("y", None)],
                  opset=23)
    heads = _model([helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)],
                   [_vi("q", [B, Hq, S, D]), _vi("k", [B, Hk, T, D]), _vi("v", [B, Hk, T, D])], [_vi("y", None)],
                   opset=23)
    g3, g4 = _capture(flat), _capture(heads)
    assert g3.ops[0].kind is g4.ops[0].kind is OpKind.ATTENTION
    assert g3.flops() == g4.flops() > 0
    feeds = {t: RNG.standard_normal(g3.shape(t)).astype(np.float32) for t in "qkv"}
    assert _ort(flat, feeds)[0].shape == g3.shape("y") == (B, S, Hq * D)
    q_read = g3.ops[0].nest.statements[0].reads[0]
    assert str(q_read) == "in0[b, s, d + 8*g + 16*h]"  # GQA: query head h*G + g, then d
