"""Handlers of contractions and sliding windows: linear, matmul and its forms with a bias,
grouped (per-expert) matmuls, einsum, the recurrent layers and cells, convolution (transposed
too), pooling, and scaled dot-product attention.
"""

from __future__ import annotations

from polyparallel import ops
from polyparallel.ir import LoopNest, OpKind

from ._registry import Call, Spec, TRef, _ints, handles


@handles("linear")
def _linear(c: Call) -> Spec:
    x, w, b = c.tensor("input", "self"), c.tensor("weight"), c.tensor("bias")
    ins = [x, w] + ([b] if b else [])
    return OpKind.CONTRACTION, ins, lambda: ops.linear(c.shape(x), c.shape(w), c.shape(b))


@handles("mm", "bmm", "matmul")
def _matmul(c: Call) -> Spec:
    a, b = c.tensor("self", "input"), c.tensor("mat2", "other")
    return OpKind.CONTRACTION, [a, b], lambda: ops.matmul(c.shape(a), c.shape(b))


@handles("addmm", "baddbmm", "addbmm")
def _addmm(c: Call) -> Spec:
    bias, a, b = c.tensor("self", "input"), c.tensor("mat1", "batch1"), c.tensor("mat2", "batch2")
    if c.get("beta", default=1) == 0:
        return OpKind.CONTRACTION, [a, b], lambda: ops.matmul(c.shape(a), c.shape(b))
    return OpKind.CONTRACTION, [bias, a, b], lambda: ops.matmul(c.shape(a), c.shape(b), bias=c.shape(bias),
                                                                bias_first=True)


@handles("grouped_mm", "_grouped_mm", "grouped_mm_fallback")
def _grouped_mm(c: Call) -> Spec:
    # torch._grouped_mm(mat_a, mat_b, offs) and HF's fallback (input, weight, offs): routed rows x
    # (T, K) sorted by expert, weights (E, K, N); a 2-D mat_b (a grouped weight gradient) stays opaque
    x, w, offs = c.tensor("mat_a", "input", "self"), c.tensor("mat_b", "weight"), c.tensor("offs")
    ins = [x, w] + ([offs] if offs else [])
    return OpKind.CONTRACTION, ins, lambda: ops.grouped_mm(c.shape(x), c.shape(w), c.shape(offs))


@handles("einsum")
def _einsum(c: Call) -> Spec:
    ts = [t for t in c.get("tensors", "operands", default=[]) if isinstance(t, TRef)]
    eq = c.get("equation")
    return OpKind.CONTRACTION, ts, lambda: ops.einsum(eq, [c.shape(t) for t in ts])


@handles("lstm", "gru", "rnn_tanh", "rnn_relu")
def _recurrent(c: Call) -> Spec:
    # aten.lstm(input, hx: [h0, c0], params, ...) and gru/rnn_*(input, hx, params, ...); the
    # packed-sequence overloads (batch_sizes for an input) are left opaque by the builder's checks
    x = c.tensor("input", "data")
    hx = c.get("hx")
    hx = [v if isinstance(v, TRef) else None for v in (hx if isinstance(hx, list | tuple) else [hx])]
    params = [t for t in c.get("params", default=[]) if isinstance(t, TRef)]
    ins = [x, *[h for h in hx if h is not None], *params]

    def nest() -> LoopNest:
        if c.tensor("batch_sizes") is not None or None in hx:
            raise ops.NotModelled(f"{c.name} over a packed sequence (batch_sizes) or without an initial state")
        return ops.torch_recurrent(c.name, c.shape(x), [c.shape(h) for h in hx], [c.shape(p) for p in params],
                                   has_biases=bool(c.get("has_biases", default=True)),
                                   num_layers=int(c.get("num_layers", default=1)),
                                   bidirectional=bool(c.get("bidirectional", default=False)),
                                   batch_first=bool(c.get("batch_first", default=False)))

    return OpKind.RECURRENT, ins, nest


@handles("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
def _recurrent_cell(c: Call) -> Spec:
    # one step of nn.LSTMCell / GRUCell / RNNCell: (input, hx ([h, c] for an LSTM), w_ih, w_hh, b_ih, b_hh)
    x, hx = c.tensor("input"), c.get("hx")
    hx = [v for v in (hx if isinstance(hx, list | tuple) else [hx]) if isinstance(v, TRef)]
    ws = [c.tensor(n) for n in ("w_ih", "w_hh", "b_ih", "b_hh")]
    ins = [x, *hx, *[w for w in ws if w is not None]]

    def nest() -> LoopNest:
        if None in ws[:2] or (ws[2] is None) != (ws[3] is None):
            raise ops.NotModelled(f"{c.name} with a missing weight or a single bias")
        return ops.torch_recurrent_cell(c.name, c.shape(x), c.shape(ws[0]), c.shape(ws[1]), n_states=len(hx),
                                        has_biases=ws[2] is not None)

    return OpKind.RECURRENT, ins, nest


@handles("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d")
def _conv(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    ins = [x, w] + ([b] if b else [])

    def nest() -> LoopNest:
        if c.get("transposed", default=False) or c.name.startswith("conv_transpose"):
            return ops.conv_transpose(c.shape(x), c.shape(w), c.shape(b), stride=_ints(c.get("stride"), [1]),
                                      padding=_ints(c.get("padding"), [0]),
                                      output_padding=_ints(c.get("output_padding"), [0]),
                                      dilation=_ints(c.get("dilation"), [1]), groups=int(c.get("groups", default=1)))
        pad = c.get("padding", default=0)
        if isinstance(pad, str):
            if pad == "valid":
                pad = 0
            else:
                raise ops.NotModelled(f"padding={pad!r} convolution")
        return ops.conv(c.shape(x), c.shape(w), c.shape(b), stride=_ints(c.get("stride"), [1]),
                        padding=_ints(pad, [0]), dilation=_ints(c.get("dilation"), [1]),
                        groups=int(c.get("groups", default=1)))

    return OpKind.CONV, ins, nest


@handles("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d",
         "avg_pool3d")
def _pool(c: Call) -> Spec:
    x = c.tensor("self", "input")

    def nest() -> LoopNest:
        k = _ints(c.get("kernel_size"))
        return ops.pool(c.shape(x), k, stride=_ints(c.get("stride"), k) or k, padding=_ints(c.get("padding"), [0]),
                        dilation=_ints(c.get("dilation"), [1]), ceil_mode=bool(c.get("ceil_mode", default=False)))

    return OpKind.POOL, [x], nest


@handles("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
         "_adaptive_avg_pool2d")
def _adaptive_pool(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.POOL, [x], lambda: ops.adaptive_pool(c.shape(x), _ints(c.get("output_size")))


@handles("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")
def _sdpa(c: Call) -> Spec:
    q, k, v = c.tensor("query"), c.tensor("key"), c.tensor("value")
    m = c.tensor("attn_mask", "attn_bias")
    ins = [q, k, v] + ([m] if m else [])
    causal = bool(c.get("is_causal", default=False))
    return OpKind.ATTENTION, ins, lambda: ops.attention(c.shape(q), c.shape(k), c.shape(v), c.shape(m),
                                                        causal=causal)
