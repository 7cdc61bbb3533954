"""PyTorch frontend: ``nn.Module`` -> Graph IR.

Capture goes through ``torch.export.export(strict=False)`` first. Its pre-dispatch ATen
graph keeps the composite ops we model as a whole (``linear``, ``layer_norm``,
``scaled_dot_product_attention``, ``cross_entropy_loss``) and works on Hugging Face
models where ``torch.fx.symbolic_trace`` fails. If export fails, ``torch.fx.symbolic_trace``
with shape propagation is tried; leaf modules and functional calls are then mapped onto
the same handlers. The model may live on the ``meta`` device: shapes come from fake
tensors, so a 175B-parameter model is captured without allocating its weights.

Each ATen op is mapped by its base name (``aten.addmm.default`` -> ``addmm``) to a
handler that reads the op's arguments *by schema name* and calls a loop-nest builder
from :mod:`polyparallel.ops`; unknown ops become opaque ops (see
:class:`~polyparallel.frontends.GraphBuilder`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from polyparallel import ops
from polyparallel.ir import Graph, LoopNest, OpKind, TensorKind

from .._builder import CaptureError, GraphBuilder
from .._fold import export_folded, input_kinds

__all__ = ["capture_torch", "quiet_fake_tensors"]


# ----------------------------------------------------------------------------------------
# normalised calls


@dataclass
class Call:
    """An op call with its arguments by name; tensors are replaced by graph tensor names."""

    name: str  # base op name, e.g. "addmm", "conv2d", "relu"
    target: str  # full source name for messages, e.g. "aten.addmm.default"
    args: dict[str, Any]
    outputs: list[str]
    module: str
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape

    def get(self, *names: str, default: Any = None) -> Any:
        for n in names:
            if n in self.args and self.args[n] is not None:
                return self.args[n]
        return default

    def tensor(self, *names: str) -> str | None:
        v = self.get(*names)
        return v if isinstance(v, TRef) else None

    def shape(self, t: str | None) -> tuple[int, ...] | None:
        return None if t is None else self.shapes[t]

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return self.shapes[self.outputs[i]]


class TRef(str):
    """A graph tensor name appearing as an argument."""


Spec = tuple[OpKind, list[str], Callable[[], LoopNest] | None]
Handler = Callable[[Call], Spec]
HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn

    return deco


def _ints(v: Any, default: Sequence[int] = ()) -> list[int]:
    if v is None:
        return list(default)
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


# ----------------------------------------------------------------------------------------
# contractions


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


# ----------------------------------------------------------------------------------------
# convolution and pooling


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


# ----------------------------------------------------------------------------------------
# normalisation, softmax, attention


@handles("layer_norm", "native_layer_norm", "rms_norm")
def _layer_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    ins = [x] + [t for t in (w, b) if t]
    rms = c.name == "rms_norm"
    return OpKind.NORM, ins, lambda: ops.layer_norm(c.shape(x), _ints(c.get("normalized_shape")),
                                                    weight=w is not None, bias=b is not None, rms=rms)


@handles("batch_norm", "native_batch_norm", "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "instance_norm")
def _batch_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    rm, rv = c.tensor("running_mean"), c.tensor("running_var")
    training = bool(c.get("training", "use_input_stats", default=c.name != "_native_batch_norm_legit_no_training"))
    affine = w is not None and b is not None
    ins = [x] + ([w, b] if affine else []) + [t for t in (rm, rv) if t]
    return OpKind.NORM, ins, lambda: ops.batch_norm(c.shape(x), affine=affine, training=training)


@handles("group_norm", "native_group_norm")
def _group_norm(c: Call) -> Spec:
    x, w, b = c.tensor("input"), c.tensor("weight"), c.tensor("bias")
    affine = w is not None and b is not None
    ins = [x] + ([w, b] if affine else [])
    return OpKind.NORM, ins, lambda: ops.group_norm(c.shape(x), int(c.get("num_groups", "group")), affine=affine)


@handles("softmax", "_softmax", "log_softmax", "_log_softmax", "special_softmax")
def _softmax(c: Call) -> Spec:
    x = c.tensor("self", "input")
    log = "log" in c.name
    return OpKind.SOFTMAX, [x], lambda: ops.softmax(c.shape(x), int(c.get("dim")), log=log)


@handles("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")
def _sdpa(c: Call) -> Spec:
    q, k, v = c.tensor("query"), c.tensor("key"), c.tensor("value")
    m = c.tensor("attn_mask", "attn_bias")
    ins = [q, k, v] + ([m] if m else [])
    causal = bool(c.get("is_causal", default=False))
    return OpKind.ATTENTION, ins, lambda: ops.attention(c.shape(q), c.shape(k), c.shape(v), c.shape(m),
                                                        causal=causal)


# ----------------------------------------------------------------------------------------
# embedding, gathers, losses


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


_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


@handles("cross_entropy_loss", "cross_entropy")
def _cross_entropy(c: Call) -> Spec:
    x, t = c.tensor("self", "input"), c.tensor("target")
    red = c.get("reduction", default=1)
    red = _REDUCTION.get(red, red) if isinstance(red, int) else red
    soft = t is not None and c.shape(t) == c.shape(x) and len(c.shape(x)) > 1
    return OpKind.LOSS, [x, t], lambda: ops.cross_entropy(c.shape(x), c.shape(t), reduction=red, soft_target=soft)


@handles("nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd")
def _nll(c: Call) -> Spec:
    x, t = c.tensor("self", "input"), c.tensor("target")
    red = c.get("reduction", default=1)
    red = _REDUCTION.get(red, red) if isinstance(red, int) else red
    return OpKind.LOSS, [x, t], lambda: ops.nll_loss(c.shape(x), c.shape(t), reduction=red)


# ----------------------------------------------------------------------------------------
# views and data movement


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
    from polyparallel.ir import Access, Statement

    sp = ops.split(shape, [1] * shape[dim], dim)
    sts = []
    for st in sp.statements:
        (w,) = st.writes
        idx = tuple(e for i, e in enumerate(w.index) if i != dim % len(shape))
        sts.append(Statement(st.name, st.dims, st.reads, (Access(w.operand, idx),), 0))
    return LoopNest(sp.dims, tuple(sts))


# ----------------------------------------------------------------------------------------
# elementwise, reductions, creation

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


_REDUCE_FLOPS = {"var": 3, "std": 4, "norm": 2, "logsumexp": 3, "var_mean": 3, "std_mean": 4}


@handles("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm", "logsumexp", "any", "all",
         "argmax", "argmin", "var_mean", "std_mean", "count_nonzero", "linalg_vector_norm")
def _reduce(c: Call) -> Spec:
    x = c.tensor("self", "input")
    axes = c.get("dim", "axis")
    keep = bool(c.get("keepdim", default=False))

    def nest() -> LoopNest:
        if c.name in ("max", "min") and axes is None:
            # elementwise max(a, b) has two tensor args; the reduction form has one
            other = c.tensor("other")
            if other:
                return ops.elementwise(c.out_shape(), [c.shape(x), c.shape(other)])
        return ops.reduce(c.shape(x), _ints(axes) if axes is not None else None, keepdim=keep,
                          flops=_REDUCE_FLOPS.get(c.name, 1), n_outputs=len(c.outputs))

    ins = [x] + ([c.tensor("other")] if c.tensor("other") else [])
    return OpKind.REDUCE, ins, nest


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


@handles("cumsum", "cumprod", "cummax", "logcumsumexp")
def _scan(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.REDUCE, [x], lambda: ops.scan(c.shape(x), int(c.get("dim")))


_CREATE = {"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full", "new_empty",
           "zeros_like", "ones_like", "full_like", "empty_like", "rand", "randn", "randint", "rand_like",
           "randn_like", "scalar_tensor", "tensor", "eye", "linspace", "empty_strided", "new_tensor",
           "_tensor_constant", "empty_permuted"}


def _create(c: Call) -> Spec:
    return OpKind.CREATE, [], lambda: ops.create(c.out_shape())


def _flat_args(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for k in v for x in _flat_args(v[k])]
    if isinstance(v, list | tuple):
        return [x for e in v for x in _flat_args(e)]
    return [v]


# ----------------------------------------------------------------------------------------
# graph walking

_SKIP_PREFIXES = ("_assert", "sym_", "_set_grad_enabled", "_enter_", "_exit_", "_record_function")
_ALIAS_NO_OUTPUT = {"getitem"}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _tensor_meta(val: Any) -> tuple[tuple[int, ...], str] | None:
    if isinstance(val, _FakeVal):
        return tuple(int(s) for s in val.shape), _dtype_name(val.dtype)
    if isinstance(val, torch.Tensor):
        try:
            shape = tuple(int(s) for s in val.shape)
        except (TypeError, RuntimeError) as e:  # symbolic shapes
            raise CaptureError(f"tensor with a symbolic shape {tuple(val.shape)}: pass concrete example "
                               "inputs (dynamic shapes are not needed for planning)") from e
        return shape, _dtype_name(val.dtype)
    return None


def _base_name(target: Any) -> tuple[str, str]:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.removesuffix("_") if target.overloadpacket.__name__ not in (
            "__and__", "__or__") else target.overloadpacket.__name__, str(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__.removesuffix("_"), str(target)
    name = getattr(target, "__name__", str(target))
    return name.removesuffix("_") if not name.startswith("__") else name, f"{getattr(target, '__module__', '')}.{name}"


def _named_args(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Bind positional args to names with the op's schema (ATen) or signature (Python)."""
    schema = getattr(target, "_schema", None)
    out: dict[str, Any] = {}
    if schema is not None:
        for a, v in zip(schema.arguments, args):
            out[a.name] = v
        out.update(kwargs)
        return out
    try:
        sig = inspect.signature(target)
        if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
            # a dispatch wrapper such as F.max_pool2d: bind with the ATen schema of the same name
            aten = _aten_for(_base_name(target)[0])
            if aten is not None and hasattr(aten, "default"):
                return _named_args(aten.default, args, kwargs)
        bound = sig.bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        out = {f"arg{i}": v for i, v in enumerate(args)}
        if args:
            out["self"] = args[0]
        if len(args) > 1:
            out["other"] = args[1]
        out.update(kwargs)
        return out


class _Walker:
    """Walks an FX graph (from torch.export or symbolic_trace) into a GraphBuilder."""

    def __init__(self, gb: GraphBuilder) -> None:
        self.gb = gb
        self.env: dict[torch.fx.Node, Any] = {}  # fx node -> TRef | list[TRef|None] | python value

    def tensor_for(self, node: torch.fx.Node, val: Any, kind: TensorKind, origin: str | None = None) -> Any:
        meta = _tensor_meta(val)
        if meta is not None:
            name = self.gb.unique(node.name, "tensor")
            self.gb.tensor(name, meta[0], meta[1], kind, origin)
            return TRef(name)
        if isinstance(val, list | tuple):
            outs = []
            for i, v in enumerate(val):
                m = _tensor_meta(v)
                if m is None:
                    outs.append(v if not isinstance(v, torch.Tensor) else None)
                    continue
                name = self.gb.unique(f"{node.name}_{i}", "tensor")
                self.gb.tensor(name, m[0], m[1], kind, origin)
                outs.append(TRef(name))
            return outs
        return val

    def resolve(self, v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return self.env.get(v)
        if isinstance(v, list | tuple):
            items = [self.resolve(x) for x in v]
            return tuple(items) if type(v) is tuple else items
        if isinstance(v, dict):
            return {k: self.resolve(x) for k, x in v.items()}
        return v

    def call(self, node: torch.fx.Node, name: str, target_str: str, target: Any, args: dict[str, Any],
             module: str) -> None:
        val = node.meta.get("val", node.meta.get("tensor_meta_val"))
        if name in _ALIAS_NO_OUTPUT or target is operator.getitem:
            src = args.get("a", args.get("arg0"))
            idx = args.get("b", args.get("arg1"))
            if isinstance(src, list | tuple) and isinstance(idx, int):
                self.env[node] = src[idx]
                return
            if isinstance(src, TRef):
                # tensor indexing through Python's getitem (fx path): opaque gather
                args = {"self": src, "index": idx}
                name, target_str = "getitem", "operator.getitem"
            else:
                self.env[node] = None
                return
        if val is None or name.startswith(_SKIP_PREFIXES):
            self.env[node] = None
            return
        out = self.tensor_for(node, val, TensorKind.ACTIVATION)
        outputs = [out] if isinstance(out, TRef) else [o for o in out if isinstance(o, TRef)] \
            if isinstance(out, list) else []
        self.env[node] = out
        if not outputs:
            return
        c = Call(name, target_str, args, outputs, module, _ShapeView(self.gb.graph))
        if name in HANDLERS:
            kind, ins, nest_fn = HANDLERS[name](c)
        elif name in _CREATE or name.startswith("_tensor_constant"):
            kind, ins, nest_fn = _create(c)
        elif is_pointwise(name, target):
            kind, ins, nest_fn = _pointwise(c)
        else:
            ins = list(dict.fromkeys(v for v in _flat_args(args) if isinstance(v, TRef)))
            kind, nest_fn = OpKind.OPAQUE, None
        ins = [t for t in ins if t is not None]
        self.gb.op(name, kind, target_str, ins, outputs, nest_fn,
                   attrs=_attrs(args), module=module, source_node=node.name)


class _ShapeView(dict):
    """Lazy name -> shape mapping over the graph's tensors."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self._g = graph

    def __getitem__(self, k: str) -> tuple[int, ...]:
        return self._g.tensors[k].shape

    def __contains__(self, k: object) -> bool:
        return k in self._g.tensors


def _attrs(args: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in args.items():
        if isinstance(v, TRef) or v is None:
            continue
        if isinstance(v, list | tuple):
            if any(isinstance(x, TRef) for x in _flat_args(v)):
                continue
            v = tuple(x if isinstance(x, int | float | bool | str) or x is None else str(x) for x in v)
        elif not isinstance(v, int | float | bool | str):
            v = str(v)
        out[k] = v
    return out


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export prefixes paths like "L__self__.h.0"; keep the user-facing dotted path
    return str(path).removeprefix("L['self'].").removeprefix("L__self__.")


# ----------------------------------------------------------------------------------------
# capture entry points


def _to_meta_if_needed(model: torch.nn.Module, value: Any) -> Any:
    devs = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if devs != {"meta"}:
        return value
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and t.device.type != "meta" else t, value)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Tracing without recording each node's Python stack: a quarter of export's time, and the
    frontend never reads ``node.meta["stack_trace"]``."""
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """torch's fake-tensor dispatch logs each op that fails on meta tensors with its traceback at
    ERROR level (``torch._subclasses.fake_tensor``) before raising: the raised error, which the
    capture reports in one line, says the same; the log lines are held back."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(before)


def _export_program(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    with _no_stack_traces(), quiet_fake_tensors():
        return torch.export.export(model, args, kwargs=kwargs, strict=False)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> Graph:
    folded = export_folded(model, lambda m: _export_program(m, args, kwargs))
    if folded is not None:
        return _walk_export(model, folded.graph.nodes, folded.inputs, folded.graph_module, name)
    ep = _export_program(model, args, kwargs)
    return _walk_export(model, ep.graph.nodes, input_kinds(ep), ep.graph_module, name)


def _walk_export(model: torch.nn.Module, nodes: Any, inputs: dict[str, tuple[str, str | None]],
                 graph_module: torch.fx.GraphModule, name: str) -> Graph:
    """The Graph IR of an exported node sequence; ``inputs`` as :func:`._fold.input_kinds` gives them."""
    gb = GraphBuilder(name, "torch.export")
    w = _Walker(gb)
    kind_map = {"PARAMETER": TensorKind.PARAM, "BUFFER": TensorKind.BUFFER, "CONSTANT_TENSOR": TensorKind.CONST,
                "USER_INPUT": TensorKind.INPUT, "CUSTOM_OBJ": TensorKind.CONST, "TOKEN": TensorKind.CONST}
    graph = gb.graph
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    by_identity: dict[int, TRef] = {}  # tied weights (lm_head = wte) are one tensor
    for node in nodes:
        if node.op == "placeholder":
            spec = inputs.get(node.name)
            kind = kind_map.get(spec[0], TensorKind.INPUT) if spec else TensorKind.INPUT
            origin = spec[1] if spec is not None and spec[1] else None
            obj = state.get(origin) if origin else None
            if obj is not None and id(obj) in by_identity:
                w.env[node] = by_identity[id(obj)]
                continue
            ref = w.tensor_for(node, node.meta.get("val"), kind, origin)
            if obj is not None and isinstance(ref, TRef):
                by_identity[id(obj)] = ref
            w.env[node] = ref
            if kind is TensorKind.INPUT and isinstance(ref, TRef):
                graph.inputs.append(ref)
        elif node.op == "call_function":
            bname, tstr = _base_name(node.target)
            args = _named_args(node.target, w.resolve(node.args), w.resolve(dict(node.kwargs)))
            if node.target is operator.getitem:
                args = {"a": w.resolve(node.args[0]), "b": node.args[1]}
            w.call(node, bname, tstr, node.target, args, _module_path(node))
        elif node.op == "output":
            for v in _flat_args(w.resolve(node.args[0])):
                if isinstance(v, TRef):
                    graph.outputs.append(v)
        elif node.op == "get_attr":
            w.env[node] = w.tensor_for(node, getattr(graph_module, node.target, None), TensorKind.CONST,
                                       str(node.target))
    # parameters the export lifted but no op uses still count (they are trained)
    return gb.finish()


# nn.Module leaf types the fx fallback maps onto handlers: type name -> (handler name, arg builder)
def _leaf_args(mod: torch.nn.Module, x: Any) -> tuple[str, dict[str, Any]] | None:
    nn = torch.nn
    if isinstance(mod, nn.Linear):
        return "linear", {"input": x, "weight": mod.weight, "bias": mod.bias}
    if isinstance(mod, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        return "conv_transpose2d", {"input": x, "weight": mod.weight, "bias": mod.bias, "stride": mod.stride,
                                    "padding": mod.padding, "output_padding": mod.output_padding,
                                    "dilation": mod.dilation, "groups": mod.groups}
    if isinstance(mod, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return "conv2d", {"input": x, "weight": mod.weight, "bias": mod.bias, "stride": mod.stride,
                          "padding": mod.padding, "dilation": mod.dilation, "groups": mod.groups}
    if isinstance(mod, nn.LayerNorm):
        return "layer_norm", {"input": x, "normalized_shape": mod.normalized_shape, "weight": mod.weight,
                              "bias": mod.bias}
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return "batch_norm", {"input": x, "weight": mod.weight, "bias": mod.bias, "training": mod.training,
                              "running_mean": mod.running_mean, "running_var": mod.running_var}
    if isinstance(mod, nn.GroupNorm):
        return "group_norm", {"input": x, "num_groups": mod.num_groups, "weight": mod.weight, "bias": mod.bias}
    if isinstance(mod, nn.Embedding):
        return "embedding", {"weight": mod.weight, "indices": x}
    if isinstance(mod, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d | nn.AvgPool1d | nn.AvgPool2d | nn.AvgPool3d):
        return ("max_pool2d" if "Max" in type(mod).__name__ else "avg_pool2d"), {
            "self": x, "kernel_size": mod.kernel_size, "stride": mod.stride, "padding": mod.padding,
            "dilation": getattr(mod, "dilation", 1), "ceil_mode": mod.ceil_mode}
    if isinstance(mod, nn.AdaptiveAvgPool1d | nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d):
        return "adaptive_avg_pool2d", {"self": x, "output_size": mod.output_size}
    if isinstance(mod, nn.Softmax | nn.LogSoftmax):
        return ("log_softmax" if "Log" in type(mod).__name__ else "softmax"), {"self": x, "dim": mod.dim}
    if isinstance(mod, nn.Flatten):
        return "flatten", {"self": x}
    if isinstance(mod, nn.Dropout | nn.Identity | nn.ReLU | nn.GELU | nn.SiLU | nn.Tanh | nn.Sigmoid
                  | nn.LeakyReLU | nn.ELU | nn.Hardswish | nn.Mish | nn.Softplus | nn.ReLU6):
        return type(mod).__name__.lower().replace("relu6", "hardtanh"), {"self": x}
    return None


def _fx(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> Graph:
    from torch.fx.passes.shape_prop import ShapeProp

    # forward parameters the caller did not give are fixed to their defaults, so that
    # `if labels is None:` branches are traced the way the example call takes them
    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    concrete = {n: p.default for n, p in sig.parameters.items()
                if n not in bound.arguments and p.default is not inspect.Parameter.empty}
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    with contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints each failure's traceback, then raises it
        ShapeProp(gm).propagate(*[bound.arguments[n] for n in sig.parameters if n in bound.arguments])
    gb = GraphBuilder(name, "torch.fx")
    w = _Walker(gb)
    graph = gb.graph
    seen_params: dict[int, TRef] = {}

    def param_ref(t: torch.Tensor | None, path: str) -> TRef | None:
        if t is None:
            return None
        if id(t) not in seen_params:
            kind = TensorKind.PARAM if isinstance(t, torch.nn.Parameter) and t.requires_grad else TensorKind.BUFFER
            n = gb.unique("p_" + path.replace(".", "_"), "tensor")
            gb.tensor(n, tuple(t.shape), _dtype_name(t.dtype), kind, path)
            seen_params[id(t)] = TRef(n)
        return seen_params[id(t)]

    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        param_ref(p, pname)
    for node in gm.graph.nodes:
        tm = node.meta.get("tensor_meta")
        if tm is not None:
            node.meta["val"] = _FakeVal(tm)
        if node.op == "placeholder":
            ref = w.tensor_for(node, node.meta.get("val"), TensorKind.INPUT)
            w.env[node] = ref
            if isinstance(ref, TRef):
                graph.inputs.append(ref)
        elif node.op == "get_attr":
            t = _get_attr(gm, str(node.target))
            w.env[node] = param_ref(t, str(node.target)) if isinstance(t, torch.Tensor) else t
        elif node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            x = w.resolve(node.args[0]) if node.args else None
            leaf = _leaf_args(mod, x)
            if leaf is None:
                bname, args = type(mod).__name__, {"input": w.resolve(list(node.args))}
            else:
                bname, args = leaf
                for k, v in list(args.items()):
                    if isinstance(v, torch.Tensor):
                        args[k] = param_ref(v, f"{node.target}.{k}")
            w.call(node, bname, f"{type(mod).__module__}.{type(mod).__name__}", None, args, str(node.target))
        elif node.op == "call_function":
            bname, tstr = _base_name(node.target)
            args = _named_args(node.target, w.resolve(node.args), w.resolve(dict(node.kwargs)))
            if node.target is operator.getitem:
                args = {"a": w.resolve(node.args[0]), "b": node.args[1]}
            w.call(node, bname, tstr, _aten_for(bname), args, "")
        elif node.op == "call_method":
            target = getattr(torch.Tensor, str(node.target), None)
            rargs = w.resolve(node.args)
            args = _method_args(str(node.target), rargs, w.resolve(dict(node.kwargs)))
            if str(node.target) in ("size", "dim", "numel", "stride"):
                w.env[node] = _py_value(rargs, str(node.target), graph)
                continue
            w.call(node, str(node.target).removesuffix("_"), f"Tensor.{node.target}", target, args, "")
        elif node.op == "output":
            for v in _flat_args(w.resolve(node.args[0])):
                if isinstance(v, TRef):
                    graph.outputs.append(v)
    return gb.finish()


def _aten_for(name: str) -> Any:
    return getattr(torch.ops.aten, name, None)


def _method_args(method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name a Tensor method's arguments with the first ATen overload that takes that many."""
    aten = getattr(torch.ops.aten, method, None)
    if aten is not None:
        for ov in aten.overloads():
            overload = getattr(aten, ov)
            if len(args) <= len(overload._schema.arguments):
                return _named_args(overload, args, kwargs)
    out = {"self": args[0] if args else None}
    out.update({f"arg{i}": v for i, v in enumerate(args[1:], 1)})
    out.update(kwargs)
    return out


def _py_value(args: tuple, method: str, graph: Graph) -> Any:
    t = args[0]
    if not isinstance(t, TRef):
        return None
    shape = graph.tensors[t].shape
    if method == "size":
        return shape[args[1]] if len(args) > 1 else torch.Size(shape)
    if method == "dim":
        return len(shape)
    if method == "numel":
        return math.prod(shape)
    return None


def _get_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _FakeVal:
    """Adapts fx ShapeProp's TensorMetadata to the tensor-meta reader."""

    def __init__(self, tm: Any) -> None:
        self.shape, self.dtype = tuple(tm.shape), tm.dtype


@contextlib.contextmanager
def _grouped_experts(model: torch.nn.Module) -> Iterator[None]:
    """HF MoE models set to the per-expert loop (``experts_implementation="eager"``), whose Python loop over
    the experts hit is data-dependent control flow that export cannot trace, are captured through their
    ``grouped_mm`` implementation (the same function, one grouped matmul per projection), then restored."""
    switched = []
    for m in model.modules():
        if getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager" and \
                hasattr(m, "set_experts_implementation"):
            try:
                m.set_experts_implementation("grouped_mm")
            except ValueError:  # a model without experts (T5, ViT: transformers refuses the setting)
                continue
            switched.append(m)
    try:
        yield
    finally:
        for m in switched:
            m.set_experts_implementation("eager")


def capture_torch(model: torch.nn.Module, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None,
                  *, method: str = "auto", name: str | None = None) -> Graph:
    """Capture an ``nn.Module`` into the Graph IR.

    Args:
        model: the module; parameters may be on the ``meta`` device.
        example_inputs: a tensor or tuple of positional example inputs.
        example_kwargs: keyword example inputs (e.g. ``labels=...`` for a HF model).
        method: ``"export"``, ``"fx"`` or ``"auto"`` (export, then fx on failure).
        name: graph name (default: the module's class name).

    Raises:
        CaptureError: neither method could capture the model; the message names the
            failing construct and what to try.
    """
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    example_inputs = _to_meta_if_needed(model, example_inputs)
    kwargs = _to_meta_if_needed(model, kwargs)
    name = name or type(model).__name__
    if method not in ("auto", "export", "fx"):
        raise ValueError(f"method must be 'auto', 'export' or 'fx', not {method!r}")
    errors: list[str] = []
    if method in ("auto", "export"):
        try:
            with _grouped_experts(model):
                return _export(model, example_inputs, kwargs, name)
        except Exception as e:  # torch raises many exception types from export
            errors.append(f"torch.export.export(strict=False) failed: {_first_lines(e)}")
            if method == "export":
                raise CaptureError(f"could not capture {name}: {errors[0]}\n  try method='fx' (torch.fx."
                                   "symbolic_trace), or make the failing construct traceable") from e
    try:
        return _fx(model, example_inputs, kwargs, name)
    except CaptureError:
        raise
    except Exception as e:
        # ShapeProp wraps the op's own error in one naming the fx node: the op's error says what is wrong
        cause = e.__cause__ if str(e).startswith("ShapeProp error") and e.__cause__ is not None else e
        errors.append(f"torch.fx.symbolic_trace failed: {_first_lines(cause)}")
        raise CaptureError(
            f"could not capture {name}:\n  " + "\n  ".join(errors) +
            "\n  fixes: give example inputs of the right shapes/dtypes; avoid data-dependent Python control flow "
            "(use torch.cond or torch.where); or export the model to ONNX and capture the .onnx file") from e


def _first_lines(e: BaseException, n: int = 3) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return " / ".join(line.strip() for line in text[:n] if line.strip())
