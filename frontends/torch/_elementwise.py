"""Elementwise ops and tensor creation: the walker's fallbacks for ops no handler names.

An op ATen tags pointwise, or one in :data:`_POINTWISE_EXTRA` (activations, casts, copies,
dropout), is elementwise over its broadcast tensor operands (:func:`is_pointwise`,
:func:`_pointwise`); an op in :data:`_CREATE` (``zeros``, ``arange``, ``randn``...) writes its
output from nothing (:func:`_create`).
"""

from __future__ import annotations

from typing import Any

import torch

from polyparallel import ops
from polyparallel.ir import LoopNest, OpKind

from ._registry import Call, Spec, TRef, _flat_args

_POINTWISE_EXTRA = {
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "to", "_to_copy", "type_as", "clone",
    "contiguous", "alias", "detach", "lift_fresh_copy", "masked_fill", "where", "tril", "triu", "gelu", "silu",
    "relu", "hardtanh", "softplus", "mish", "hardswish", "elu", "leaky_relu", "celu", "selu", "threshold",
    "clamp", "clamp_min", "clamp_max", "copy", "_to_dtype", "type", "float", "half", "bfloat16", "int", "long",
    "bool", "abs", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "erf", "sin", "cos",
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "maximum", "minimum", "eq", "ne", "lt", "le",
    "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not",
    "__and__", "__or__", "__invert__", "reciprocal", "square", "lerp", "addcmul", "addcdiv", "sign", "rsub",
    "fill", "zero", "masked_fill_", "isnan", "isinf", "nan_to_num", "glu", "clip", "floor", "ceil", "round",
    "fmod", "remainder", "sgn", "trunc", "log1p", "expm1", "exp2", "log2", "sigmoid_backward",
}


def is_pointwise(name: str, target: Any) -> bool:
    if name in _POINTWISE_EXTRA:
        return True
    tags = getattr(target, "tags", ()) or ()
    return torch.Tag.pointwise in tags


def _pointwise(c: Call) -> Spec:
    tensors = [v for v in _flat_args(c.args) if isinstance(v, TRef)]
    tensors = list(dict.fromkeys(tensors))
    flops = ops.flops_per_element(c.name)
    if "dropout" in c.name and (c.get("train", "training", default=True) is False or c.get("p", default=1) == 0):
        flops = 0.0  # dropout in eval mode (or p=0) is the identity
    n_out = len(c.outputs)
    out_shapes = [c.shapes[o] for o in c.outputs]

    def nest() -> LoopNest:
        if len(set(out_shapes)) > 1:
            # e.g. native_dropout returns (out, mask) of one shape; anything else is unusual
            raise ops.NotModelled(f"elementwise op with outputs of shapes {out_shapes}")
        return ops.elementwise(out_shapes[0], [c.shape(t) for t in tensors], flops=flops, n_outputs=n_out)

    return OpKind.ELEMENTWISE, tensors, nest


_CREATE = {"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full", "new_empty",
           "zeros_like", "ones_like", "full_like", "empty_like", "rand", "randn", "randint", "rand_like",
           "randn_like", "scalar_tensor", "tensor", "eye", "linspace", "empty_strided", "new_tensor",
           "_tensor_constant", "empty_permuted"}


def _create(c: Call) -> Spec:
    return OpKind.CREATE, [], lambda: ops.create(c.out_shape())
