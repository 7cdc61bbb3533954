"""Handlers of views and data movement: reshape, permute, transpose, expand, slice, select,
pad, concat, split, unbind, upsampling by integer factors, and the gathers (an embedding lookup,
``index_select``, advanced indexing, ``gather``).

Each output element reads input elements at affine indices (a data-dependent index for the
gathers); only linear upsampling does arithmetic, the interpolation.
"""

from __future__ import annotations

import math

from polyparallel import ops
from polyparallel.ir import Access, LoopNest, OpKind, Statement

from ._registry import Call, Spec, TRef, _ints, handles


@handles("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
         "reshape_as", "_reshape_alias", "ravel")
def _reshape(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.VIEW, [x], lambda: ops.reshape(c.shape(x), c.out_shape())


@handles("permute")
def _permute(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.VIEW, [x], lambda: ops.permute(c.shape(x), _ints(c.get("dims")))


@handles("transpose", "swapaxes", "t", "numpy_T")
def _transpose(c: Call) -> Spec:
    x = c.tensor("self", "input")
    d0, d1 = c.get("dim0", default=0), c.get("dim1", default=1)
    return OpKind.VIEW, [x], lambda: ops.transpose(c.shape(x), int(d0), int(d1))


@handles("expand", "expand_as", "broadcast_to")
def _expand(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.VIEW, [x], lambda: ops.expand(c.shape(x), c.out_shape())


@handles("slice", "narrow")
def _slice(c: Call) -> Spec:
    x = c.tensor("self", "input")

    def nest() -> LoopNest:
        dim = int(c.get("dim", default=0))
        if c.name == "narrow":
            s = int(c.get("start"))
            return ops.slice_(c.shape(x), dim, s, s + int(c.get("length")))
        end = c.get("end")
        n = c.shape(x)[dim]
        end = n if end is None or end > n else int(end)
        return ops.slice_(c.shape(x), dim, int(c.get("start", default=0) or 0), end, int(c.get("step", default=1)))

    return OpKind.VIEW, [x], nest


@handles("select")
def _select(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.VIEW, [x], lambda: ops.select(c.shape(x), int(c.get("dim")), int(c.get("index")))


@handles("constant_pad_nd", "pad")
def _pad(c: Call) -> Spec:
    x = c.tensor("self", "input")

    def nest() -> LoopNest:
        if c.get("mode", default="constant") != "constant":
            raise ops.NotModelled(f"{c.get('mode')} padding")
        p = _ints(c.get("pad"))
        shape = c.shape(x)
        pairs = [(0, 0)] * len(shape)
        for i in range(len(p) // 2):
            pairs[len(shape) - 1 - i] = (p[2 * i], p[2 * i + 1])
        return ops.pad(shape, pairs)

    return OpKind.VIEW, [x], nest


@handles("cat", "concat", "concatenate")
def _cat(c: Call) -> Spec:
    ts = [t for t in c.get("tensors", default=[]) if isinstance(t, TRef) and math.prod(c.shape(t)) > 0]
    dim = int(c.get("dim", default=0))
    return OpKind.CONCAT, ts, lambda: ops.concat([c.shape(t) for t in ts], dim)


@handles("stack")
def _stack(c: Call) -> Spec:
    ts = [t for t in c.get("tensors", default=[]) if isinstance(t, TRef)]
    dim = int(c.get("dim", default=0))
    return OpKind.CONCAT, ts, lambda: ops.stack([c.shape(t) for t in ts], dim)


@handles("split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split")
def _split(c: Call) -> Spec:
    x = c.tensor("self", "input")
    dim = int(c.get("dim", default=0))
    sizes = [c.shapes[o][dim % max(1, len(c.shape(x)))] for o in c.outputs]
    return OpKind.SPLIT, [x], lambda: ops.split(c.shape(x), sizes, dim)


@handles("unbind")
def _unbind(c: Call) -> Spec:
    x = c.tensor("self", "input")
    dim = int(c.get("dim", default=0))

    return OpKind.SPLIT, [x], lambda: _unbind_nest(c.shape(x), dim)


def _unbind_nest(shape: tuple[int, ...], dim: int) -> LoopNest:
    # unbind == split into size-1 pieces, then squeeze: the split's accesses with the axis removed
    sp = ops.split(shape, [1] * shape[dim], dim)
    sts = []
    for st in sp.statements:
        (w,) = st.writes
        idx = tuple(e for i, e in enumerate(w.index) if i != dim % len(shape))
        sts.append(Statement(st.name, st.dims, st.reads, (Access(w.operand, idx),), 0))
    return LoopNest(sp.dims, tuple(sts))


@handles("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact2d")
def _upsample(c: Call) -> Spec:
    x = c.tensor("input", "self")

    def nest() -> LoopNest:
        src, dst = c.shape(x), c.out_shape()
        if len(src) != len(dst) or any(d % s for s, d in zip(src, dst)):
            raise ops.NotModelled(f"nearest upsampling {list(src)} -> {list(dst)} by a non-integer factor")
        return ops.upsample_nearest(src, [d // s for s, d in zip(src, dst)])

    return OpKind.VIEW, [x], nest


@handles("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")
def _upsample_linear(c: Call) -> Spec:
    x = c.tensor("input", "self")

    def nest() -> LoopNest:
        src, dst = c.shape(x), c.out_shape()
        if c.get("align_corners", default=False):
            raise ops.NotModelled("linear upsampling with align_corners=True (source positions not affine)")
        if len(src) != len(dst) or any(d % s for s, d in zip(src, dst)):
            raise ops.NotModelled(f"linear upsampling {list(src)} -> {list(dst)} by a non-integer factor")
        return ops.upsample_linear(src, [d // s for s, d in zip(src[2:], dst[2:])])

    return OpKind.ELEMENTWISE, [x], nest


@handles("embedding")
def _embedding(c: Call) -> Spec:
    w, ids = c.tensor("weight"), c.tensor("indices", "input")
    return OpKind.EMBEDDING, [w, ids], lambda: ops.embedding(c.shape(w), c.shape(ids))


@handles("index_select")
def _index_select(c: Call) -> Spec:
    x, idx = c.tensor("self", "input"), c.tensor("index")
    return OpKind.GATHER, [x, idx], lambda: ops.gather(c.shape(x), c.shape(idx), int(c.get("dim")))


@handles("index")
def _index(c: Call) -> Spec:
    x = c.tensor("self", "input")
    idx = c.get("indices", default=[])
    real = [(i, t) for i, t in enumerate(idx) if t is not None]

    def nest() -> LoopNest:
        if len(real) == 1 and isinstance(real[0][1], TRef):
            axis, t = real[0]
            return ops.gather(c.shape(x), c.shape(t), axis)
        if [i for i, _ in real] != list(range(len(real))):
            raise ops.NotModelled("advanced indexing on non-leading or non-consecutive axes")
        return ops.advanced_index(c.shape(x), [c.shape(t) for _, t in real])

    return OpKind.GATHER, [x] + [t for _, t in real if isinstance(t, TRef)], nest


@handles("gather")
def _gather(c: Call) -> Spec:
    x, idx = c.tensor("self", "input"), c.tensor("index")
    return OpKind.GATHER, [x, idx], lambda: ops.take_along_axis(c.shape(x), c.shape(idx), int(c.get("dim")))
