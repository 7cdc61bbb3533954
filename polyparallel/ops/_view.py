"""Views and data movement: reshape, permute, expand, slice, select, pad, cat, split, upsampling.

A view moves no data and costs no FLOPs; its loop nest is an index remap from the
output to the input, which canonicalisation can fold into the consumer's accesses.
Reshape iterates over the common refinement of the two shapes (each axis of either
shape is a product of refinement axes), so splits and merges of axes stay affine; a
reshape with no such refinement (e.g. ``[6, 4] -> [4, 6]``) is not affine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from polyparallel.ir import Access, AffineExpr, Dim, E, LoopNest, Role, Statement

from ._common import NotModelled, broadcast_index, generic_dims, norm_axis


def _remap(out: Sequence[int], in_index: Sequence, *, dims: list[Dim] | None = None,
           out_index: Sequence | None = None) -> LoopNest:
    dims = dims if dims is not None else generic_dims(out)
    oi = tuple(out_index) if out_index is not None else tuple(E(d.name) for d in dims)
    st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", tuple(in_index)),),
                   writes=(Access("out0", oi),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


def permute(x: Sequence[int], perm: Sequence[int]) -> LoopNest:
    r = len(x)
    perm = [norm_axis(p, r) for p in perm]
    if sorted(perm) != list(range(r)):
        raise NotModelled(f"permutation {perm} of rank {r}")
    out = [x[p] for p in perm]
    dims = generic_dims(out)
    idx: list = [None] * r
    for i, p in enumerate(perm):
        idx[p] = E(dims[i].name)
    return _remap(out, idx, dims=dims)


def transpose(x: Sequence[int], a: int, b: int) -> LoopNest:
    perm = list(range(len(x)))
    if perm:
        a, b = norm_axis(a, len(x)), norm_axis(b, len(x))
        perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


def reshape(x: Sequence[int], out: Sequence[int]) -> LoopNest:
    if math.prod(x) != math.prod(out):
        raise NotModelled(f"reshape {list(x)} -> {list(out)} changes the element count")

    def suffix_products(shape: Sequence[int]) -> list[int]:
        acc, res = 1, []
        for e in reversed(shape):
            acc *= e
            res.append(acc)
        return res

    cuts = sorted(set(suffix_products(x)) | set(suffix_products(out)) | {1})
    for lo, hi in itertools.pairwise(cuts):
        if hi % lo:
            raise NotModelled(f"reshape {list(x)} -> {list(out)} is not a split/merge of axes (not affine)")
    # refinement axes, outermost first: axis j spans suffix products cuts[j]..cuts[j+1]
    ref = [(cuts[j], cuts[j + 1] // cuts[j]) for j in range(len(cuts) - 1)][::-1]
    dims = [Dim(f"v{i}", e) for i, (_, e) in enumerate(ref)]

    def index_of(shape: Sequence[int]) -> tuple[AffineExpr, ...]:
        idx, inner = [], 1
        for e in reversed(shape):
            expr = AffineExpr((), 0)
            for d, (lo, ext) in zip(dims, ref):
                if inner <= lo and lo * ext <= inner * e:
                    expr = expr + E(d.name) * (lo // inner)
            idx.append(expr)
            inner *= e
        return tuple(reversed(idx))

    return _remap(out, index_of(x), dims=dims, out_index=index_of(out))


def expand(x: Sequence[int], out: Sequence[int]) -> LoopNest:
    dims = generic_dims(out)
    return _remap(out, broadcast_index(x, dims), dims=dims)


def slice_(x: Sequence[int], axis: int, start: int, end: int | None, step: int = 1) -> LoopNest:
    r = len(x)
    axis = norm_axis(axis, r)
    n = x[axis]
    s, e, _ = slice(start, end, step).indices(n)
    length = max(0, len(range(s, e, step)))
    if length == 0:
        raise NotModelled("empty slice")
    out = list(x)
    out[axis] = length
    dims = generic_dims(out)
    idx = [E(d.name) for d in dims]
    idx[axis] = E(dims[axis].name) * step + s
    return _remap(out, idx, dims=dims)


def select(x: Sequence[int], axis: int, index: int) -> LoopNest:
    r = len(x)
    axis = norm_axis(axis, r)
    index %= x[axis]
    out = [e for i, e in enumerate(x) if i != axis]
    dims = generic_dims(out)
    idx = [E(d.name) for d in dims]
    idx.insert(axis, AffineExpr((), index))
    return _remap(out, idx, dims=dims)


def pad(x: Sequence[int], pads: Sequence[tuple[int, int]]) -> LoopNest:
    """Constant padding; ``pads[i] = (before, after)`` for axis i. Reads outside are zeros."""
    if len(pads) != len(x):
        raise NotModelled(f"pad widths {list(pads)} for rank {len(x)}")
    out = [e + a + b for e, (a, b) in zip(x, pads)]
    if min(out) < 1:
        raise NotModelled("padding leaves an empty tensor")
    dims = generic_dims(out)
    return _remap(out, [E(d.name) - a for d, (a, _) in zip(dims, pads)], dims=dims)


def upsample_nearest(x: Sequence[int], scales: Sequence[int]) -> LoopNest:
    """Nearest upsampling by integer factors of the trailing axes: ``y[.., h*s + r, ..] = x[.., h, ..]``.

    Each upsampled axis is iterated as (source index ``h``, replica ``r < s``), so the
    access stays affine and every output element is written exactly once.
    """
    lead = len(x) - len(scales)
    if lead < 0 or any(int(s) < 1 for s in scales):
        raise NotModelled(f"nearest upsampling of input{list(x)} by {list(scales)}")
    dims = generic_dims(x[:lead])
    xi = [E(d.name) for d in dims]
    yi = list(xi)
    for i, (e, s) in enumerate(zip(x[lead:], scales)):
        h, r = Dim(f"h{i}", e), Dim(f"r{i}", int(s))
        dims += [h, r]
        xi.append(E(h.name))
        yi.append(E(h.name) * int(s) + E(r.name))
    st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", tuple(xi)),),
                   writes=(Access("out0", tuple(yi)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


def upsample_linear(x: Sequence[int], scales: Sequence[int]) -> LoopNest:
    """(Bi/tri)linear upsampling by integer factors of the trailing axes, half-pixel centres (torch's
    ``align_corners=False``, ONNX ``half_pixel``): output ``h*s + r`` samples ``h + (r + 1/2)/s - 1/2``,
    between ``h - 1`` and ``h`` for the phases ``r < (s - 1)/2`` and between ``h`` and ``h + 1`` for the
    others. Each axis is iterated as (source ``h``, phase ``r`` of one half, tap ``t < 2``): a statement
    per combination of halves reads ``x[.., h + t - 1 (or + t), ..]`` and sums the taps (the ``t`` dims
    are reductions), 2 FLOPs per tap, so a device splitting ``h`` reads one row of each neighbour.
    Reads past the border are the clamped edge (no data beyond the tensor)."""
    lead = len(x) - len(scales)
    if lead < 0 or any(int(s) < 1 for s in scales):
        raise NotModelled(f"linear upsampling of input{list(x)} by {list(scales)}")
    base = generic_dims(x[:lead])
    halves = [((0, -(-(int(s) - 1) // 2), -1), (-(-(int(s) - 1) // 2), int(s), 0)) for s in scales]
    dims = list(base)
    for i, e in enumerate(x[lead:]):
        dims += [Dim(f"h{i}", e), Dim(f"t{i}", 2, Role.REDUCTION)]
    sts = []
    for combo in itertools.product(*halves):
        names = [d.name for d in base]
        xi = [E(d.name) for d in base]
        yi = list(xi)
        for i, ((lo, hi, shift), s) in enumerate(zip(combo, scales)):
            if hi <= lo:
                break
            r = f"r{i}{'a' if shift else 'b'}"
            if all(d.name != r for d in dims):
                dims.append(Dim(r, hi - lo))
            names += [f"h{i}", r, f"t{i}"]
            xi.append(E(f"h{i}") + E(f"t{i}") + shift)
            yi.append(E(f"h{i}") * int(s) + E(r) + lo)
        else:
            sts.append(Statement(f"lerp{len(sts)}", tuple(names), reads=(Access("in0", tuple(xi)),),
                                 writes=(Access("out0", tuple(yi)),), flops_per_point=2))
    return LoopNest(tuple(dims), tuple(sts))


def concat(shapes: Sequence[Sequence[int]], axis: int) -> LoopNest:
    r = len(shapes[0])
    axis = norm_axis(axis, r)
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    base = generic_dims(out)
    dims = [d for i, d in enumerate(base) if i != axis]
    sts, off = [], 0
    for k, s in enumerate(shapes):
        c = Dim(f"c{k}", s[axis])
        dims.append(c)
        names = tuple(d.name if i != axis else c.name for i, d in enumerate(base))
        ii = tuple(E(n) for n in names)
        oi = tuple(E(n) + (off if i == axis else 0) for i, n in enumerate(names))
        sts.append(Statement(f"part{k}", names, reads=(Access(f"in{k}", ii),), writes=(Access("out0", oi),),
                             flops_per_point=0))
        off += s[axis]
    return LoopNest(tuple(dims), tuple(sts))


def stack(shapes: Sequence[Sequence[int]], axis: int) -> LoopNest:
    """``stack`` of equal shapes along a new dim ``axis`` of the output: input ``k`` is the output's
    slice ``k`` of that dim (GPT-J's rotary ``stack((-x2, x1), dim=-1)``)."""
    r = len(shapes[0])
    if any(tuple(s) != tuple(shapes[0]) for s in shapes):
        raise NotModelled(f"stack of unequal shapes {[list(s) for s in shapes]}")
    axis = norm_axis(axis, r + 1)
    base = generic_dims(shapes[0])
    names = tuple(d.name for d in base)
    sts = []
    for k in range(len(shapes)):
        oi = (*(E(n) for n in names[:axis]), AffineExpr(const=k), *(E(n) for n in names[axis:]))
        sts.append(Statement(f"part{k}", names, reads=(Access(f"in{k}", tuple(E(n) for n in names)),),
                             writes=(Access("out0", oi),), flops_per_point=0))
    return LoopNest(tuple(base), tuple(sts))


def split(x: Sequence[int], sizes: Sequence[int], axis: int) -> LoopNest:
    r = len(x)
    axis = norm_axis(axis, r)
    if sum(sizes) != x[axis]:
        raise NotModelled(f"split sizes {list(sizes)} do not add up to {x[axis]}")
    base = generic_dims(x)
    dims = [d for i, d in enumerate(base) if i != axis]
    sts, off = [], 0
    for k, n in enumerate(sizes):
        c = Dim(f"c{k}", max(1, n))
        dims.append(c)
        names = tuple(d.name if i != axis else c.name for i, d in enumerate(base))
        ii = tuple(E(nm) + (off if i == axis else 0) for i, nm in enumerate(names))
        sts.append(Statement(f"part{k}", names, reads=(Access("in0", ii),),
                             writes=(Access(f"out{k}", tuple(E(nm) for nm in names)),), flops_per_point=0))
        off += n
    return LoopNest(tuple(dims), tuple(sts))
