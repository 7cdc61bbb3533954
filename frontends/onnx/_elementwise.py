"""Handlers of elementwise ops (broadcast operands, FLOPs per element), dropout, identity,
quantisation, one-hot and the ops that create a tensor from its shape.

onnxruntime's contrib GELUs (``com.microsoft``) have the same semantics as the standard
ops and are handled here (:data:`_CONTRIB`).
"""

from __future__ import annotations

import math

import numpy as np

from polyparallel import ops
from polyparallel.ir import Access, Dim, E, LoopNest, OpKind, Statement

from ._registry import Spec, _handles, _identity, _Node

_ELEMENTWISE = (
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "BitwiseAnd",
    "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div",
    "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish",
    "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul",
    "Neg", "Not", "Or", "PRelu", "Pow", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign",
    "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Trilu",
    "Where", "Xor", "Swish", "BiasGelu", "FastGelu", "QuickGelu",
)
# onnxruntime contrib ops (ORT-optimised models) with the same semantics as a handler above
_CONTRIB = {"BiasGelu", "FastGelu", "QuickGelu", "Gelu"}


@_handles(*_ELEMENTWISE)
def _elementwise(n: _Node) -> Spec:
    shapes = n.data_shapes
    if n.op_type in ("Trilu", "CastLike"):  # k / the "like" tensor are not elementwise operands
        shapes = shapes[:1]
    name = n.op_type.lower()
    if n.op_type == "Gelu" and n.attr("approximate", "none") == "tanh":
        name = "gelu_tanh"
    # contrib GELUs: FastGelu is the tanh form; BiasGelu/FastGelu add an optional bias first
    name = {"fastgelu": "gelu_tanh", "biasgelu": "gelu", "quickgelu": "sigmoid"}.get(name, name)
    flops = ops.flops_per_element(name) + (1 if n.op_type in ("BiasGelu", "FastGelu") and len(shapes) > 1 else 0)
    if n.op_type == "QuickGelu":
        flops += 2  # x * sigmoid(alpha * x)
    if n.op_type in ("Sum", "Mean", "Max", "Min"):
        flops = max(1, len(shapes) - 1) + (1 if n.op_type == "Mean" else 0)
    out = n.out
    return OpKind.ELEMENTWISE, lambda: ops.elementwise(out, shapes, flops=flops)


@_handles("Dropout")
def _dropout(n: _Node) -> Spec:
    x = n.shape(0)
    train = n.const(2)
    if train is not None and bool(np.asarray(train).reshape(-1)[0]):
        return OpKind.ELEMENTWISE, lambda: ops.elementwise(x, [x], flops=ops.flops_per_element("dropout"),
                                                           n_outputs=len(n.outs))
    # inference: an identity (mask, if asked for, is all ones)
    return OpKind.VIEW, lambda: _identity(x, len(n.outs))


@_handles("Identity")
def _identity_op(n: _Node) -> Spec:
    x = n.shape(0)
    return OpKind.VIEW, lambda: _identity(x)


@_handles("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
def _quant(n: _Node) -> Spec:
    x = n.shape(0)
    scalars = all(s == () or math.prod(s) == 1 for s in n.data_shapes[1:])
    if not scalars or n.op_type == "DynamicQuantizeLinear":
        raise ops.NotModelled(f"{n.op_type} with per-axis or dynamic scales")
    return OpKind.ELEMENTWISE, lambda: ops.elementwise(n.out, [x, *[()] * len(n.data_shapes[1:])], flops=2)


@_handles("OneHot")
def _one_hot(n: _Node) -> Spec:
    out = n.out
    axis = int(n.attr("axis", -1)) % len(out)

    def nest() -> LoopNest:
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(out)]
        oi = tuple(E(d.name) for d in dims)
        ii = tuple(e for i, e in enumerate(oi) if i != axis)
        st = Statement("compare", tuple(d.name for d in dims), reads=(Access("in0", ii),),
                       writes=(Access("out0", oi),), flops_per_point=1)
        return LoopNest(tuple(dims), (st,))

    return OpKind.ELEMENTWISE, nest


@_handles("ConstantOfShape", "Range", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
          "RandomUniformLike", "Shape", "Size")
def _create(n: _Node) -> Spec:
    out = n.out
    return OpKind.CREATE, lambda: ops.create(out)
