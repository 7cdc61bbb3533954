"""Handlers of contractions and sliding windows: MatMul, Gemm, Einsum, Attention, Conv, pooling,
and the recurrent layers LSTM, GRU, RNN.

Each builds the same :mod:`polyparallel.ops` nest as the torch frontend (``nn.Linear``
exported as ``Gemm`` with ``transB=1`` is ``ops.linear``; an exported ``nn.LSTM`` is one ``LSTM``
node per layer, together the FLOPs and parameters of the torch op); convolution and pooling resolve
``auto_pad`` (SAME: ``out = ceil(in / stride)``) into low and high padding per spatial dim.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel import ops
from polyparallel.ir import Access, LoopNest, OpKind, Statement

from ._registry import Shape, Spec, _extra_writes, _handles, _Node, _write_of


@_handles("MatMul", "MatMulInteger")
def _matmul(n: _Node) -> Spec:
    a, b, c = n.shape(0), n.shape(1), (n.shape(2) if n.attr("bias_add") else None)  # c: a fused Add
    return OpKind.CONTRACTION, lambda: ops.matmul(a, b, bias=c)


@_handles("Gemm")
def _gemm(n: _Node) -> Spec:
    a, b, c = n.shape(0), n.shape(1), n.shape(2)
    ta, tb = bool(n.attr("transA", 0)), bool(n.attr("transB", 0))
    unit = n.attr("alpha", 1.0) == 1.0 and n.attr("beta", 1.0) == 1.0
    if tb and not ta and unit and len(b) == 2 and (c is None or tuple(c) == (b[0],)):
        # nn.Linear as exported: the same loop nest as the torch frontend's linear
        return OpKind.CONTRACTION, lambda: ops.linear(a, b, c)
    return OpKind.CONTRACTION, lambda: ops.matmul(a, b, bias=c, trans_a=ta, trans_b=tb)


@_handles("Einsum")
def _einsum(n: _Node) -> Spec:
    shapes = n.data_shapes
    eq = _expand_ellipsis(str(n.attr("equation")).replace(" ", ""), shapes)
    return OpKind.CONTRACTION, lambda: ops.einsum(eq, shapes)


def _expand_ellipsis(eq: str, shapes: Sequence[Shape]) -> str:
    """Spell ``...`` out with unused letters (numpy rules: right-aligned, broadcast)."""
    if "..." not in eq:
        return eq
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    ranks = [len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t]
    width = max(ranks, default=0)
    ell = "".join(free[:width])
    terms = [t.replace("...", ell[width - (len(s) - (len(t) - 3)):]) if "..." in t else t
             for t, s in zip(terms, shapes)]
    if arrow:
        rhs = rhs.replace("...", ell)
    else:  # implicit output: the ellipsis dims first, then the letters used once, sorted
        counts: dict[str, int] = {}
        for t in terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return ",".join(terms) + "->" + rhs


@_handles("Attention")
def _attention(n: _Node) -> Spec:
    q, k, v, m = n.shape(0), n.shape(1), n.shape(2), n.shape(3)
    if any(n.has(i) for i in (4, 5)) or len(n.outs) > 1:
        raise ops.NotModelled("Attention with a KV cache or extra outputs is not modelled")
    causal = bool(n.attr("is_causal", 0))
    if m is not None and len(m) > 4:
        raise ops.NotModelled(f"Attention mask of shape {list(m)}")
    if len(q) == 4:
        return OpKind.ATTENTION, lambda: ops.attention(q, k, v, m, causal=causal)
    hq, hk = n.attr("q_num_heads"), n.attr("kv_num_heads")
    if len(q) != 3 or not hq or not hk:
        raise ops.NotModelled(f"Attention with q{list(q)} and no head counts")
    hq, hk = int(hq), int(hk)

    def nest() -> LoopNest:
        # 3-D inputs [B, S, H*D]: the 4-D nest with [b, h, s, d] read as [b, s, h*D + d]
        q4, k4 = (q[0], hq, q[1], q[2] // hq), (k[0], hk, k[1], k[2] // hk)
        v4 = (v[0], hk, v[1], v[2] // hk)
        nt = ops.attention(q4, k4, v4, m, causal=causal)
        width = {"in0": q4[3], "in1": k4[3], "in2": v4[3], "out0": v4[3]}

        def fold(a: Access) -> Access:
            if a.operand not in width or len(a.index) != 4:
                return a
            b, h, t, d = a.index
            return Access(a.operand, (b, t, h * width[a.operand] + d))

        return LoopNest(nt.dims, tuple(
            Statement(st.name, st.dims, tuple(map(fold, st.reads)), tuple(map(fold, st.writes)),
                      st.flops_per_point, st.constraints) for st in nt.statements))

    return OpKind.ATTENTION, nest


def _spatial_pads(n: _Node, x: Shape, kernel: Sequence[int], strides: Sequence[int],
                  dil: Sequence[int]) -> tuple[list[int], list[int]]:
    """Low and high padding per spatial dim, resolving ``auto_pad`` (SAME: out = ceil(in / stride))."""
    k = len(kernel)
    auto = str(n.attr("auto_pad", "NOTSET"))
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = [], []
        for i in range(k):
            size = x[2 + i]
            total = max(0, (-(-size // strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
            small = total // 2
            lo.append(small if auto == "SAME_UPPER" else total - small)
            hi.append(total - lo[-1])
        return lo, hi
    if auto == "VALID":
        return [0] * k, [0] * k
    pads = list(n.attr("pads", ())) or [0] * (2 * k)
    return [int(p) for p in pads[:k]], [int(p) for p in pads[k:]]


@_handles("Conv", "ConvInteger")
def _conv(n: _Node) -> Spec:
    x, w = n.shape(0), n.shape(1)
    b = n.shape(2) if n.op_type == "Conv" else None
    k = len(x) - 2
    kernel = list(n.attr("kernel_shape", ())) or list(w[2:])
    strides = list(n.attr("strides", ())) or [1] * k
    dil = list(n.attr("dilations", ())) or [1] * k
    lo, hi = _spatial_pads(n, x, kernel, strides, dil)
    groups = int(n.attr("group", 1))
    return OpKind.CONV, lambda: ops.conv(x, w, b, stride=strides, padding=lo, dilation=dil, groups=groups,
                                         pads_hi=hi)


@_handles("ConvTranspose")
def _conv_transpose(n: _Node) -> Spec:
    x, w = n.shape(0), n.shape(1)
    b = n.shape(2)
    k = len(x) - 2
    strides = list(n.attr("strides", ())) or [1] * k
    dil = list(n.attr("dilations", ())) or [1] * k
    groups = int(n.attr("group", 1))

    def nest() -> LoopNest:
        # the inferred output (output_shape and auto_pad resolved by shape inference) fixes the crop;
        # the low padding is the pads attribute, or, where the output shape decides, the spec's split
        # of the total padding (SAME_UPPER: the smaller half low; otherwise the larger half low)
        out = n.out[2:]
        pads = list(n.attr("pads", ()))
        lo = [int(p) for p in pads[:k]] if pads else []
        if not lo:
            kernel = list(n.attr("kernel_shape", ())) or list(w[2:])
            opad = list(n.attr("output_padding", ())) or [0] * k
            total = [strides[i] * (x[2 + i] - 1) + opad[i] + (kernel[i] - 1) * dil[i] + 1 - out[i] for i in range(k)]
            upper = str(n.attr("auto_pad", "NOTSET")) == "SAME_UPPER"
            lo = [t // 2 if upper else t - t // 2 for t in total]
        return ops.conv_transpose(x, w, b, stride=strides, padding=lo, dilation=dil, groups=groups, out=out)

    return OpKind.CONV, nest


@_handles("MaxPool", "AveragePool", "LpPool")
def _pool(n: _Node) -> Spec:
    x = n.shape(0)
    kernel = [int(v) for v in n.attr("kernel_shape", ())]
    k = len(kernel)
    strides = list(n.attr("strides", ())) or [1] * k
    dil = list(n.attr("dilations", ())) or [1] * k

    def nest() -> LoopNest:
        lo, hi = _spatial_pads(n, x, kernel, strides, dil)
        if n.attr("ceil_mode", 0):
            # ceil mode drops a last window that would start in the padding; the inferred
            # output extent has that rule, so take it and pad the high side just enough
            out = n.out[len(x) - k:]
            for i in range(k):
                size = x[len(x) - k + i]
                ext = ops.out_extent(size, kernel[i], strides[i], lo[i], hi[i], dil[i], ceil=True)
                if ext != out[i]:
                    raise ops.NotModelled(f"ceil-mode pooling: ONNX shape inference gives extent {out[i]} "
                                          f"but windows starting in the padding are dropped, giving {ext}")
            hi = [(out[i] - 1) * strides[i] + dil[i] * (kernel[i] - 1) + 1 - x[len(x) - k + i] - lo[i]
                  for i in range(k)]
        nt = ops.pool(x, kernel, stride=strides, padding=lo, dilation=dil, pads_hi=hi)
        if len(n.outs) == 2:  # MaxPool's Indices
            nt = _extra_writes(nt, "pool", [Access("out1", _write_of(nt).index)])
        return nt

    return OpKind.POOL, nest


@_handles("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(n: _Node) -> Spec:
    x = n.shape(0)
    # the same nest as the torch frontend's adaptive pooling to 1 x 1
    return OpKind.POOL, lambda: ops.adaptive_pool(x, [1] * (len(x) - 2))


@_handles("LSTM", "GRU", "RNN")
def _recurrent(n: _Node) -> Spec:
    # inputs X, W, R, B, sequence_lens, initial_h, initial_c, P (LSTM's peepholes); outputs Y, Y_h, Y_c
    cell = {"LSTM": "lstm", "GRU": "gru"}.get(n.op_type)
    acts = [(a.decode() if isinstance(a, bytes) else str(a)).lower() for a in (n.attr("activations") or [])]
    if cell is None:
        cell = {"tanh": "rnn_tanh", "relu": "rnn_relu"}.get((acts or ["tanh"])[0])
    default = {"lstm": ["sigmoid", "tanh", "tanh"], "gru": ["sigmoid", "tanh"]}.get(cell, [(acts or ["tanh"])[0]])
    if cell is None or (acts and acts != default * (len(acts) // len(default))):
        raise ops.NotModelled(f"{n.op_type} with activations {acts}")
    if n.attr("clip") is not None or n.attr("input_forget", 0):
        raise ops.NotModelled(f"{n.op_type} with clip or input_forget")
    T = n.shape(0)[1 if n.attr("layout", 0) else 0]
    lens = n.const(4)
    if n.has(4) and lens is None:
        raise ops.NotModelled(f"{n.op_type} with sequence_lens known only at run time (the steps each sequence runs)")
    if lens is not None and (lens != T).any():
        raise ops.NotModelled(f"{n.op_type} with sequence_lens {lens.tolist()} shorter than the {T} steps")
    present = [i for i in range(len(n.ins)) if n.has(i)]
    operand = {name: (f"in{present.index(i)}" if n.has(i) else None)
               for i, name in enumerate(("x", "W", "R", "B", "lens", "initial_h", "initial_c", "P"))}
    outs = [o for o in n.proto.output]
    operand.update({name: (f"out{[o for o in outs if o].index(outs[i])}" if i < len(outs) and outs[i] else None)
                    for i, name in enumerate(("Y", "Y_h", "Y_c"))})
    direction = n.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    return OpKind.RECURRENT, lambda: ops.onnx_recurrent(cell, n.shape(0), n.shape(1), n.shape(2), has_bias=n.has(3),
                                                        operands=operand, direction=direction,
                                                        layout=int(n.attr("layout", 0)))
