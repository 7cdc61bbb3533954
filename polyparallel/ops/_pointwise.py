"""Elementwise ops with numpy broadcasting, reductions, and tensor creation."""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled, broadcast_index, broadcast_shapes, generic_dims, norm_axis

# FLOPs per output element, by operator name (lower case, torch or ONNX spelling).
# Transcendentals count as a handful of FLOPs, as is customary in roofline tables.
FLOPS_PER_ELEMENT: dict[str, float] = {
    "gelu": 8, "tanh": 4, "sigmoid": 4, "silu": 5, "swish": 5, "mish": 8, "erf": 4, "exp": 2, "log": 2,
    "softplus": 4, "elu": 3, "selu": 3, "celu": 3, "hardswish": 4, "hardsigmoid": 3, "rsqrt": 2, "sqrt": 2,
    "pow": 2, "reciprocal": 1, "div": 1, "sin": 4, "cos": 4, "dropout": 2, "where": 1, "clamp": 2,
    "clip": 2, "leakyrelu": 2, "prelu": 2, "gelu_tanh": 10, "gelu_new": 10,
    "cast": 0, "to": 0, "copy": 0, "identity": 0, "clone": 0, "contiguous": 0, "detach": 0, "alias": 0,
    "_to_copy": 0, "lift_fresh_copy": 0, "type_as": 0, "float": 0, "half": 0, "bfloat16": 0, "long": 0,
    "int": 0, "bool": 0, "type": 0, "_to_dtype": 0,
}


# the dropout ops of the front ends (ATen, ONNX): the identity at p = 0 or in eval mode, otherwise a
# random mask whose backward keeps the mask
DROPOUT_TARGETS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})

# ops that pass their input's values on unchanged: copies (the identity on one input; ``*_as`` take
# the other operand's shape only) and casts (a cast to the same dtype is a copy)
COPY_TARGETS = frozenset({"identity", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "lift_fresh",
                          "copy", "view_as", "reshape_as", "expand_as"})
CAST_TARGETS = frozenset({"_to_copy", "to", "cast", "type_as", "_to_dtype", "type", "float", "half", "bfloat16",
                          "double"})


def flops_per_element(name: str) -> float:
    return FLOPS_PER_ELEMENT.get(name.lower(), 1.0)


def elementwise(out: Sequence[int] | None, inputs: Sequence[Sequence[int] | None], *, flops: float = 1.0,
                n_outputs: int = 1) -> LoopNest:
    """``out[i..] = f(in0[bcast(i..)], in1[...])``. ``None`` inputs are scalars (not operands)."""
    shapes = [s for s in inputs if s is not None]
    shape = tuple(out) if out is not None else broadcast_shapes(*shapes)
    dims = generic_dims(shape)
    if dims:
        dims[0] = Dim(dims[0].name, dims[0].extent, Role.PARALLEL, Hint.BATCH)
    reads = tuple(Access(f"in{i}", broadcast_index(s, dims)) for i, s in enumerate(inputs) if s is not None)
    idx = tuple(E(d.name) for d in dims)
    st = Statement("map", tuple(d.name for d in dims), reads=reads,
                   writes=tuple(Access(f"out{i}", idx) for i in range(n_outputs)), flops_per_point=flops)
    return LoopNest(tuple(dims), (st,))


def reduce(x: Sequence[int], axes: Sequence[int] | None, *, keepdim: bool = False, flops: float = 1.0,
           n_outputs: int = 1) -> LoopNest:
    """``sum``/``mean``/``max``/... over ``axes`` (all axes when ``None`` or empty)."""
    r = len(x)
    red = {norm_axis(a, r) for a in axes} if axes else set(range(r))
    dims = [Dim(f"d{i}", max(1, e), Role.REDUCTION if i in red else Role.PARALLEL) for i, e in enumerate(x)]
    xi = tuple(E(d.name) for d in dims)
    oi = tuple(0 * E(d.name) if i in red else E(d.name) for i, d in enumerate(dims) if keepdim or i not in red)
    st = Statement("reduce", tuple(d.name for d in dims), reads=(Access("in0", xi),),
                   writes=tuple(Access(f"out{i}", oi) for i in range(n_outputs)), flops_per_point=flops)
    return LoopNest(tuple(dims), (st,))


def create(out: Sequence[int]) -> LoopNest:
    """A tensor made from nothing (arange, zeros, full): writes its output, reads nothing."""
    dims = generic_dims(out)
    st = Statement("fill", tuple(d.name for d in dims), reads=(),
                   writes=(Access("out0", tuple(E(d.name) for d in dims)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


def scan(x: Sequence[int], axis: int, *, flops: float = 1.0) -> LoopNest:
    """Inclusive prefix scan (``cumsum``): ``y[.., s, ..] += x[.., t, ..]`` for ``t <= s``."""
    r = len(x)
    if r == 0:
        raise NotModelled("scan of a scalar")
    axis = norm_axis(axis, r)
    dims = generic_dims(x)
    dims.append(Dim("t", x[axis], Role.REDUCTION))
    names = [d.name for d in dims[:-1]]
    xi = tuple(E("t") if i == axis else E(n) for i, n in enumerate(names))
    st = Statement("scan", (*names, "t"), reads=(Access("in0", xi),),
                   writes=(Access("out0", tuple(E(n) for n in names)),), flops_per_point=flops,
                   constraints=(E(names[axis]) - E("t"),))
    return LoopNest(tuple(dims), (st,))
