"""Convolutions (1-3 spatial dims, stride, padding, dilation, groups), transposed convolutions and pooling."""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled

_SPATIAL = {1: ("l",), 2: ("h", "w"), 3: ("t", "h", "w")}
_KERNEL = {1: ("kl",), 2: ("r", "q"), 3: ("kt", "r", "q")}


def _tuple(v: int | Sequence[int], n: int, what: str) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(x) for x in v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise NotModelled(f"{what} {list(v)} does not match {n} spatial dims")
    return v


def out_extent(size: int, k: int, stride: int, pad_lo: int, pad_hi: int, dil: int, ceil: bool = False) -> int:
    """Output extent of a window ``k`` (dilation ``dil``) sliding by ``stride`` over ``size`` padded
    ``pad_lo`` / ``pad_hi``. ``ceil`` (pooling's ``ceil_mode``) keeps a last partial window, except
    one that would start in the high padding (torch's and ONNX's rule)."""
    span = size + pad_lo + pad_hi - dil * (k - 1) - 1
    if not ceil:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= size + pad_lo:
        out -= 1
    return out


def _conv_dims(B: int, groups: int, O: int, C: int, spatial: Sequence[int], kernel: Sequence[int]) -> list[Dim]:
    """``b, [g,] o, <spatial>, c, <kernel>``: the dims of a (transposed) convolution's multiply-add."""
    n = len(spatial)
    dims = [Dim("b", B, Role.PARALLEL, Hint.BATCH)]
    if groups > 1:
        dims.append(Dim("g", groups, Role.PARALLEL, Hint.CHANNEL))
    dims.append(Dim("o", O // groups, Role.PARALLEL, Hint.CHANNEL))
    dims += [Dim(s, e, Role.PARALLEL, Hint.SPATIAL) for s, e in zip(_SPATIAL[n], spatial)]
    dims.append(Dim("c", C // groups, Role.REDUCTION, Hint.CHANNEL))
    dims += [Dim(k, e, Role.REDUCTION, Hint.KERNEL) for k, e in zip(_KERNEL[n], kernel)]
    return dims


def conv(x: Sequence[int], w: Sequence[int], bias: Sequence[int] | None = None, *,
         stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
         dilation: int | Sequence[int] = 1, groups: int = 1,
         pads_hi: Sequence[int] | None = None) -> LoopNest:
    """``y[b, o, h, w] += x[b, c, h*st + r*dil - pad, ...] * k[o, c, r, ...]`` (operands x, w, bias).

    ``padding`` is the low-side padding per spatial dim; ``pads_hi`` the high side when
    it differs (ONNX). Out-of-range reads are zero padding: they move no data.
    """
    n = len(x) - 2
    if n not in _SPATIAL or len(w) != len(x):
        raise NotModelled(f"conv with input{list(x)} and weight{list(w)}")
    st, pad, dil = _tuple(stride, n, "stride"), _tuple(padding, n, "padding"), _tuple(dilation, n, "dilation")
    phi = tuple(pads_hi) if pads_hi is not None else pad
    B, C, O = x[0], x[1], w[0]
    if C % groups or O % groups or w[1] != C // groups:
        raise NotModelled(f"conv groups={groups} with {C} in and {O} out channels, weight{list(w)}")
    outs = [out_extent(x[2 + i], w[2 + i], st[i], pad[i], phi[i], dil[i]) for i in range(n)]
    if min(outs) < 1:
        raise NotModelled(f"conv output would be empty: {outs}")
    sp, kn = _SPATIAL[n], _KERNEL[n]
    dims = _conv_dims(B, groups, O, C, outs, w[2:])
    gch = (lambda per, d: E("g") * per + E(d)) if groups > 1 else (lambda per, d: E(d))
    xi = (E("b"), gch(C // groups, "c"),
          *[E(sp[i]) * st[i] + E(kn[i]) * dil[i] - pad[i] for i in range(n)])
    wi = (gch(O // groups, "o"), E("c"), *[E(k) for k in kn])
    yi = (E("b"), gch(O // groups, "o"), *[E(s) for s in sp])
    names = tuple(d.name for d in dims)
    sts = [Statement("mac", names, reads=(Access("in0", xi), Access("in1", wi)),
                     writes=(Access("out0", yi),), flops_per_point=2)]
    if bias is not None:
        pd = tuple(d.name for d in dims if d.role is Role.PARALLEL)
        sts.append(Statement("bias", pd, reads=(Access("in2", (gch(O // groups, "o"),)),),
                             writes=(Access("out0", yi),), flops_per_point=1))
    return LoopNest(tuple(dims), tuple(sts))


def conv_transpose(x: Sequence[int], w: Sequence[int], bias: Sequence[int] | None = None, *,
                   stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                   output_padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
                   out: Sequence[int] | None = None) -> LoopNest:
    """Transposed convolution as the scatter of every input pixel through the kernel (operands x, w, bias):
    ``y[b, o, h*st + r*dil - pad, ...] += x[b, c, h, ...] * k[c, o, r, ...]``, ``k`` of shape
    ``[C, O / groups, kernel...]`` (torch and ONNX), ``h`` running over the *input* rows.

    Its points are exactly the multiply-adds a transposed convolution does, ``2 B C (O/g) prod(in)
    prod(kernel)`` FLOPs without padding; taps that would land in the cropped border (``padding``,
    an ``output_shape`` smaller than the full one) are cut by constraints. Where the
    kernel is no wider than the stride (UNet's 2x2 stride-2 upsampling) the write is injective and the
    input rows split like any parallel dim (each device writes its own output rows); wider kernels
    overlap neighbouring rows' outputs, so the placement rules refuse splitting them. ``out``: the
    output's spatial extents when given (ONNX ``output_shape``), else
    ``(in - 1) st - 2 pad + dil (k - 1) + output_padding + 1``.
    """
    n = len(x) - 2
    if n not in _SPATIAL or len(w) != len(x):
        raise NotModelled(f"conv_transpose with input{list(x)} and weight{list(w)}")
    st, pad, dil = _tuple(stride, n, "stride"), _tuple(padding, n, "padding"), _tuple(dilation, n, "dilation")
    opad = _tuple(output_padding, n, "output_padding")
    B, C = x[0], x[1]
    if w[0] != C or C % groups:
        raise NotModelled(f"conv_transpose groups={groups} with {C} in channels, weight{list(w)}")
    O = w[1] * groups
    outs = list(out) if out is not None else \
        [(x[2 + i] - 1) * st[i] - 2 * pad[i] + dil[i] * (w[2 + i] - 1) + opad[i] + 1 for i in range(n)]
    if len(outs) != n or min(outs) < 1:
        raise NotModelled(f"conv_transpose output would be {outs}")
    sp, kn = _SPATIAL[n], _KERNEL[n]
    dims = _conv_dims(B, groups, O, C, x[2:], w[2:])  # the spatial dims run over the input pixels
    gch = (lambda per, d: E("g") * per + E(d)) if groups > 1 else (lambda per, d: E(d))
    xi = (E("b"), gch(C // groups, "c"), *[E(s) for s in sp])
    wi = (gch(C // groups, "c"), E("o"), *[E(k) for k in kn])
    rows = [E(sp[i]) * st[i] + E(kn[i]) * dil[i] - pad[i] for i in range(n)]
    yi = (E("b"), gch(O // groups, "o"), *rows)
    # taps landing in the cropped border are not computed (cuDNN runs the convolution's data gradient,
    # which produces only the kept outputs): constraints keep the writes inside the output
    crop = []
    for i in range(n):
        if pad[i] > 0:
            crop.append(rows[i])
        if (x[2 + i] - 1) * st[i] + (w[2 + i] - 1) * dil[i] - pad[i] > outs[i] - 1:
            crop.append(rows[i] * -1 + (outs[i] - 1))
    sts = [Statement("mac", tuple(d.name for d in dims), reads=(Access("in0", xi), Access("in1", wi)),
                     writes=(Access("out0", yi),), flops_per_point=2, constraints=tuple(crop))]
    # the bias runs over the output pixels (dims of their own); without one, output rows no tap reaches
    # (output_padding) are still written, as zeros
    short = any((x[2 + i] - 1) * st[i] + (w[2 + i] - 1) * dil[i] - pad[i] < outs[i] - 1 for i in range(n))
    if bias is not None or short:
        on = tuple(f"y{s}" for s in sp)
        dims += [Dim(nm, e, Role.PARALLEL, Hint.SPATIAL) for nm, e in zip(on, outs)]
        lead = ("b", "g", "o") if groups > 1 else ("b", "o")
        reads = (Access("in2", (gch(O // groups, "o"),)),) if bias is not None else ()
        sts.append(Statement("bias" if bias is not None else "fill", (*lead, *on), reads=reads,
                             writes=(Access("out0", (E("b"), gch(O // groups, "o"), *[E(d) for d in on])),),
                             flops_per_point=1 if bias is not None else 0))
    return LoopNest(tuple(dims), tuple(sts))


def pool(x: Sequence[int], kernel: int | Sequence[int], *, stride: int | Sequence[int] | None = None,
         padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, ceil_mode: bool = False,
         pads_hi: Sequence[int] | None = None) -> LoopNest:
    """Max/average pooling ``y[b, c, h, w] = red_{r,q} x[b, c, h*st + r*dil - pad, ...]``.

    A leading batch dim is optional (``[C, H, W]`` inputs work too).
    """
    n = len(kernel) if not isinstance(kernel, int) else len(x) - 2
    lead = len(x) - n
    if n not in _SPATIAL or lead < 1:
        raise NotModelled(f"pooling over input{list(x)} with kernel {kernel}")
    k = _tuple(kernel, n, "kernel")
    st = _tuple(stride if stride not in (None, [], ()) else k, n, "stride")
    pad, dil = _tuple(padding, n, "padding"), _tuple(dilation, n, "dilation")
    phi = tuple(pads_hi) if pads_hi is not None else pad
    outs = [out_extent(x[lead + i], k[i], st[i], pad[i], phi[i], dil[i], ceil_mode) for i in range(n)]
    if min(outs) < 1:
        raise NotModelled(f"pooling output would be empty: {outs}")
    sp, kn = _SPATIAL[n], _KERNEL[n]
    lead_names = ("b", "c")[-lead:] if lead <= 2 else tuple(f"a{i}" for i in range(lead))
    dims = [Dim(nm, e, Role.PARALLEL, Hint.BATCH if nm == "b" else Hint.CHANNEL)
            for nm, e in zip(lead_names, x[:lead])]
    dims += [Dim(s, e, Role.PARALLEL, Hint.SPATIAL) for s, e in zip(sp, outs)]
    dims += [Dim(kk, e, Role.REDUCTION, Hint.KERNEL) for kk, e in zip(kn, k)]
    xi = (*[E(nm) for nm in lead_names], *[E(sp[i]) * st[i] + E(kn[i]) * dil[i] - pad[i] for i in range(n)])
    yi = (*[E(nm) for nm in lead_names], *[E(s) for s in sp])
    stmt = Statement("pool", tuple(d.name for d in dims), reads=(Access("in0", xi),),
                     writes=(Access("out0", yi),), flops_per_point=1)
    return LoopNest(tuple(dims), (stmt,))


def adaptive_pool(x: Sequence[int], out_size: Sequence[int]) -> LoopNest:
    """Adaptive pooling where each output size divides the input (the common 1x1 case)."""
    n = len(out_size)
    lead = len(x) - n
    ks = []
    for i, o in enumerate(out_size):
        s = x[lead + i]
        if o <= 0 or s % o:
            raise NotModelled(f"adaptive pooling {s}->{o} has uneven windows (not affine)")
        ks.append(s // o)
    return pool(x, ks, stride=ks)


