"""Handlers of normalisations and softmax: statistics reduced over some axes, then a per-element normalisation.

Batch, instance, group, layer and RMS normalisation, softmax (over the trailing axes
together before opset 13), local response normalisation over a channel window, and
Lp / mean-variance normalisation and Hardmax.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel import ops
from polyparallel.ir import Access, AffineExpr, Dim, E, LoopNest, OpKind, Role, Statement

from ._registry import Shape, Spec, _extra_writes, _handles, _Node


@_handles("BatchNormalization")
def _batch_norm(n: _Node) -> Spec:
    x = n.shape(0)
    training = bool(n.attr("training_mode", 0))
    if len(n.outs) > 1:
        raise ops.NotModelled("BatchNormalization with running-statistics outputs is not modelled")
    return OpKind.NORM, lambda: ops.batch_norm(x, affine=True, training=training)


@_handles("InstanceNormalization")
def _instance_norm(n: _Node) -> Spec:
    x = n.shape(0)
    return OpKind.NORM, lambda: ops.group_norm(x, x[1], affine=True)


@_handles("GroupNormalization")
def _group_norm(n: _Node) -> Spec:
    x, s = n.shape(0), n.shape(1)
    groups = int(n.attr("num_groups"))
    if s is not None and tuple(s) != (x[1],):
        raise ops.NotModelled(f"GroupNormalization with per-group scale {list(s)} (opset 18 form)")
    return OpKind.NORM, lambda: ops.group_norm(x, groups, affine=True)


@_handles("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
def _layer_norm(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", -1)) % len(x)
    normalized = tuple(x[axis:])
    rms = n.op_type != "LayerNormalization"
    scale, bias = n.shape(1), (n.shape(2) if not rms else None)
    for what, s in (("scale", scale), ("bias", bias)):
        if s is not None and tuple(s) != normalized:
            raise ops.NotModelled(f"{n.op_type} with a broadcast {what} {list(s)} over {list(normalized)}")

    def nest() -> LoopNest:
        nt = ops.layer_norm(x, normalized, weight=scale is not None, bias=bias is not None, rms=rms)
        stats = next(w.index for s in nt.statements if s.name == "stats" for w in s.writes)
        keep = tuple(stats) + (AffineExpr((), 0),) * len(normalized)
        return _extra_writes(nt, "stats", [Access(f"out{i}", keep) for i in range(1, len(n.outs))])

    return OpKind.NORM, nest


@_handles("Softmax", "LogSoftmax")
def _softmax(n: _Node) -> Spec:
    x = n.shape(0)
    log = n.op_type == "LogSoftmax"
    r = max(len(x), 1)
    if n.opset >= 13:
        axis = int(n.attr("axis", -1)) % r
        return OpKind.SOFTMAX, lambda: ops.softmax(x, axis, log=log)
    # before opset 13 the input is coerced to 2-D: normalise over all axes from `axis` on
    axis = int(n.attr("axis", 1)) % r
    inner = [i for i in range(axis, len(x)) if x[i] != 1]
    if len(inner) <= 1:
        return OpKind.SOFTMAX, lambda: ops.softmax(x, inner[0] if inner else len(x) - 1, log=log)
    return OpKind.SOFTMAX, lambda: _softmax_trailing(x, axis, log)


def _softmax_trailing(x: Shape, axis: int, log: bool) -> LoopNest:
    """Softmax over axes ``axis..`` together (ONNX < 13): the statistics reduce all of them."""
    dims = [Dim(f"d{i}", e, Role.REDUCTION if i >= axis else Role.PARALLEL) for i, e in enumerate(x)]
    idx = tuple(E(d.name) for d in dims)
    sidx = tuple(E(d.name) for d in dims[:axis])
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", sidx),),
                      flops_per_point=3)
    norm = Statement("normalize", names, reads=(Access("in0", idx), Access("stats", sidx)),
                     writes=(Access("out0", idx),), flops_per_point=1 if log else 2)
    return LoopNest(tuple(dims), (stats, norm))


@_handles("LRN")
def _lrn(n: _Node) -> Spec:
    x = n.shape(0)
    size = int(n.attr("size"))

    def nest() -> LoopNest:
        # y = x / (bias + alpha / size * sum_{j < size} x[c + j - lo]^2) ** beta over a channel window
        lo = (size - 1) // 2
        dims = [Dim(f"d{i}", e) for i, e in enumerate(x)] + [Dim("j", size, Role.REDUCTION)]
        idx = tuple(E(f"d{i}") for i in range(len(x)))
        win = tuple(E("j") + E("d1") - lo if i == 1 else e for i, e in enumerate(idx))
        names = tuple(d.name for d in dims)
        stats = Statement("stats", names, reads=(Access("in0", win),), writes=(Access("stats", idx),),
                          flops_per_point=2)
        norm = Statement("normalize", names[:-1], reads=(Access("in0", idx), Access("stats", idx)),
                         writes=(Access("out0", idx),), flops_per_point=5)
        return LoopNest(tuple(dims), (stats, norm))

    return OpKind.NORM, nest


def _normalise_over(x: Shape, axes: Sequence[int], stats_flops: float, norm_flops: float) -> LoopNest:
    """Statistics reduced over ``axes``, then a per-element normalisation (the norm/softmax shape)."""
    red = {a % len(x) for a in axes}
    dims = [Dim(f"d{i}", max(1, e), Role.REDUCTION if i in red else Role.PARALLEL) for i, e in enumerate(x)]
    idx = tuple(E(d.name) for d in dims)
    sidx = tuple(E(d.name) for i, d in enumerate(dims) if i not in red)
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", sidx),),
                      flops_per_point=stats_flops)
    norm = Statement("normalize", names, reads=(Access("in0", idx), Access("stats", sidx)),
                     writes=(Access("out0", idx),), flops_per_point=norm_flops)
    return LoopNest(tuple(dims), (stats, norm))


@_handles("LpNormalization", "MeanVarianceNormalization", "Hardmax")
def _axis_norm(n: _Node) -> Spec:
    x = n.shape(0)
    if n.op_type == "MeanVarianceNormalization":
        axes = [int(a) for a in n.attr("axes", (0, 2, 3))]
        return OpKind.NORM, lambda: _normalise_over(x, axes, 3, 2)
    if n.op_type == "LpNormalization":
        axis = int(n.attr("axis", -1))
        return OpKind.NORM, lambda: _normalise_over(x, [axis], 2, 1)
    axis = int(n.attr("axis", -1 if n.opset >= 13 else 1)) % max(len(x), 1)
    axes = [axis] if n.opset >= 13 else list(range(axis, len(x)))
    return OpKind.SOFTMAX, lambda: _normalise_over(x, axes, 1, 1)  # arg-max, then a one-hot compare
