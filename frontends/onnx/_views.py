"""Handlers of views and data movement: reshape, transpose, expand, concat, split, slice, pad,
tile, depth/space rearrangement, nearest resize by integer factors, gathers and scatters.

Each output element reads one input element at an affine index (a data-dependent index,
``ANY``, for gathers and scatters): no arithmetic, so the nests cost memory traffic only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polyparallel import ops
from polyparallel.ir import ANY, Access, AffineExpr, Dim, E, LoopNest, OpKind, Statement

from ._registry import Shape, Spec, _handles, _Node


@_handles("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    return OpKind.VIEW, lambda: ops.reshape(x, out)


@_handles("Transpose")
def _transpose(n: _Node) -> Spec:
    x = n.shape(0)
    perm = n.attr("perm")
    perm = [int(p) for p in perm] if perm else list(range(len(x)))[::-1]
    return OpKind.VIEW, lambda: ops.permute(x, perm)


@_handles("Expand")
def _expand(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    return OpKind.VIEW, lambda: ops.expand(x, out)


@_handles("Concat")
def _concat(n: _Node) -> Spec:
    shapes = n.data_shapes
    axis = int(n.attr("axis", 0))
    nonempty = [s for s in shapes if math.prod(s) > 0]
    if len(nonempty) != len(shapes):
        raise ops.NotModelled("Concat with empty inputs is not modelled")
    return OpKind.CONCAT, lambda: ops.concat(shapes, axis)


@_handles("Split")
def _split(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", 0)) % max(len(x), 1)
    sizes = [s[axis] for s in n.outs]
    return OpKind.SPLIT, lambda: ops.split(x, sizes, axis)


@_handles("Slice")
def _slice(n: _Node) -> Spec:
    x = n.shape(0)
    if n.opset < 10:
        starts, ends = list(n.attr("starts", ())), list(n.attr("ends", ()))
        axes = list(n.attr("axes", ())) or list(range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = n.ints(1, "starts"), n.ints(2, "ends")
        axes = n.ints(3, "axes") if n.has(3) else list(range(len(starts)))
        steps = n.ints(4, "steps") if n.has(4) else [1] * len(starts)
    specs = []
    for a, s, e, st in zip(axes, starts, ends, steps):
        a %= len(x)
        size = x[a]
        # ONNX clamps starts/ends (INT_MAX means "to the end"); Python slices clamp the same way
        lo, hi, step = slice(int(s), int(e), int(st)).indices(size)
        specs.append((a, lo, hi, step))
    if len(specs) == 1:
        a, lo, hi, step = specs[0]
        return OpKind.VIEW, lambda: ops.slice_(x, a, lo, hi if hi >= 0 else None, step)
    return OpKind.VIEW, lambda: _slice_axes(x, specs)


def _slice_axes(x: Shape, specs: Sequence[tuple[int, int, int, int]]) -> LoopNest:
    """A slice along several axes at once: ``out[.., i, ..] = x[.., start + i * step, ..]``."""
    out = list(x)
    start = {a: (lo, step) for a, lo, _, step in specs}
    for a, lo, hi, step in specs:
        out[a] = len(range(lo, hi, step))
    if min(out, default=1) < 1:
        raise ops.NotModelled("empty slice")
    dims = [Dim(f"d{i}", e) for i, e in enumerate(out)]
    idx = tuple(E(d.name) * start[i][1] + start[i][0] if i in start else E(d.name) for i, d in enumerate(dims))
    st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", idx),),
                   writes=(Access("out0", tuple(E(d.name) for d in dims)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


@_handles("Pad")
def _pad(n: _Node) -> Spec:
    x = n.shape(0)
    mode = str(n.attr("mode", "constant"))
    if mode != "constant":
        raise ops.NotModelled(f"Pad mode {mode!r} reads mirrored or wrapped indices (not affine)")
    pads = list(n.attr("pads", ())) if n.opset < 11 else n.ints(1, "pads")
    axes = n.ints(3, "axes") if n.has(3) else list(range(len(x)))
    k = len(axes)
    pairs = [(0, 0)] * len(x)
    for j, a in enumerate(axes):
        pairs[a % len(x)] = (pads[j], pads[j + k])
    return OpKind.VIEW, lambda: ops.pad(x, pairs)


@_handles("Tile")
def _tile(n: _Node) -> Spec:
    x = n.shape(0)
    reps = n.ints(1, "repeats")

    def nest() -> LoopNest:
        # out[r * n + i] = x[i]: one repeat dim and one copy dim per axis keep it affine
        dims, xi, oi = [], [], []
        for a, (e, r) in enumerate(zip(x, reps)):
            dims += [Dim(f"r{a}", max(1, r)), Dim(f"d{a}", max(1, e))]
            xi.append(E(f"d{a}"))
            oi.append(E(f"r{a}") * e + E(f"d{a}"))
        st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", tuple(xi)),),
                       writes=(Access("out0", tuple(oi)),), flops_per_point=0)
        return LoopNest(tuple(dims), (st,))

    return OpKind.VIEW, nest


@_handles("DepthToSpace", "SpaceToDepth")
def _depth_space(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    bs = int(n.attr("blocksize"))
    crd = str(n.attr("mode", "DCR")) == "CRD"

    def nest() -> LoopNest:
        # depth d = (i*bs + j)*C + c (DCR) or c*bs*bs + i*bs + j (CRD) <-> space (h*bs + i, w*bs + j)
        if len(x) != 4:
            raise ops.NotModelled(f"{n.op_type} of a rank-{len(x)} input")
        to_space = n.op_type == "DepthToSpace"
        B, C, H, W = (x[0], out[1], x[2], x[3]) if to_space else (x[0], x[1], out[2], out[3])
        dims = (Dim("b", B), Dim("c", C), Dim("h", H), Dim("i", bs), Dim("w", W), Dim("j", bs))
        b, c, h, i, w, j = (E(d.name) for d in dims)
        depth = c * (bs * bs) + i * bs + j if crd else (i * bs + j) * C + c
        deep, space = (b, depth, h, w), (b, c, h * bs + i, w * bs + j)
        st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", deep if to_space else space),),
                       writes=(Access("out0", space if to_space else deep),), flops_per_point=0)
        return LoopNest(dims, (st,))

    return OpKind.VIEW, nest


@_handles("Resize", "Upsample")
def _resize(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    mode = str(n.attr("mode", "nearest"))
    old = n.op_type == "Upsample" or n.opset < 11  # before opset 11: asymmetric coordinates, floor
    coord = str(n.attr("coordinate_transformation_mode", "asymmetric" if old else "half_pixel"))
    rounding = str(n.attr("nearest_mode", "floor" if old else "round_prefer_floor"))
    if mode == "linear" and len(out) == len(x) and not any(o % i for o, i in zip(out, x)) and \
            coord in ("half_pixel", "pytorch_half_pixel") and all(o > 1 for o in out[2:]):
        factors = [o // i for o, i in zip(out, x)]
        if factors[:2] == [1, 1]:  # half-pixel centres: (bi/tri)linear by integer factors is affine
            return OpKind.ELEMENTWISE, lambda: ops.upsample_linear(x, factors[2:])
    if mode != "nearest" or len(out) != len(x) or any(o % i for o, i in zip(out, x)):
        raise ops.NotModelled(f"Resize mode={mode!r} from {list(x)} to {list(out)} (only nearest by integer "
                              "factors is affine)")
    scales = [o // i for o, i in zip(out, x)]
    # with an integer factor s, output y reads floor(y / s) under these coordinate rules:
    # asymmetric+floor directly; half-pixel maps y = h*s + r to h + (r + 1/2)/s - 1/2, which
    # lies strictly within (h - 1/2, h + 1/2) and so rounds to h either way
    exact = (coord == "asymmetric" and rounding == "floor") or (
        coord in ("half_pixel", "pytorch_half_pixel") and rounding in ("round_prefer_floor", "round_prefer_ceil"))
    if not exact and any(s > 1 for s in scales):
        raise ops.NotModelled(f"Resize nearest with coordinate mode {coord!r} and rounding {rounding!r}")
    lead = next((i for i, s in enumerate(scales) if s > 1), len(x))
    return OpKind.VIEW, lambda: ops.upsample_nearest(x, scales[lead:])


@_handles("Gather")
def _gather(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    axis = int(n.attr("axis", 0))
    iv = n.const(1)
    if iv is not None and iv.ndim == 0:
        return OpKind.VIEW, lambda: ops.select(x, axis, int(iv))
    if axis % max(len(x), 1) == 0 and len(x) == 2:
        return OpKind.EMBEDDING, lambda: ops.embedding(x, idx)
    return OpKind.GATHER, lambda: ops.gather(x, idx, axis)


@_handles("GatherElements")
def _gather_elements(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    axis = int(n.attr("axis", 0))
    return OpKind.GATHER, lambda: ops.take_along_axis(x, idx, axis)


@_handles("GatherND")
def _gather_nd(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    bd = int(n.attr("batch_dims", 0))

    def nest() -> LoopNest:
        k = idx[-1]
        out = (*idx[:-1], *x[bd + k:])
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(out)]
        names = [d.name for d in dims]
        lead = len(idx) - 1
        xi = (*[E(nm) for nm in names[:bd]], *[ANY] * k, *[E(nm) for nm in names[lead:]])
        ii = (*[E(nm) for nm in names[:lead]], AffineExpr((), 0))
        # the index tuple is read whole: one access per component
        reads = (Access("in0", xi), *[Access("in1", (*ii[:-1], AffineExpr((), c))) for c in range(k)])
        st = Statement("gather", tuple(names), reads=reads, writes=(Access("out0", tuple(E(nm) for nm in names)),),
                       flops_per_point=0)
        return LoopNest(tuple(dims), (st,))

    return OpKind.GATHER, nest


@_handles("ScatterElements", "ScatterND", "Scatter")
def _scatter(n: _Node) -> Spec:
    x, idx, upd = n.shape(0), n.shape(1), n.shape(2)
    red = str(n.attr("reduction", "none"))

    def nest() -> LoopNest:
        # out = data, then out[data-dependent index] (op)= updates
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(x)]
        xi = tuple(E(d.name) for d in dims)
        copy = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", xi),),
                         writes=(Access("out0", xi),), flops_per_point=0)
        udims = [Dim(f"u{i}", max(1, e)) for i, e in enumerate(upd)]
        ui = tuple(E(d.name) for d in udims)
        if n.op_type == "ScatterND":
            k = idx[-1]
            lead = len(idx) - 1
            wi = (*[ANY] * k, *ui[lead:])
            ii = (*ui[:lead], AffineExpr((), 0))
        else:
            axis = int(n.attr("axis", 0)) % len(x)
            wi = tuple(ANY if i == axis else e for i, e in enumerate(ui))
            ii = ui
        upd_st = Statement("scatter", tuple(d.name for d in udims), reads=(Access("in2", ui), Access("in1", ii)),
                           writes=(Access("out0", wi),), flops_per_point=0 if red == "none" else 1)
        return LoopNest((*dims, *udims), (copy, upd_st))

    return OpKind.GATHER, nest
