"""Handlers of reductions: ``Reduce*``, ``ArgMax``/``ArgMin``, cumulative sums (a scan),
``TopK`` (``k`` passes of a maximum) and the losses.

Reduced axes given as a run-time tensor are read off the input and output shapes.
"""

from __future__ import annotations

import itertools

from polyparallel import ops
from polyparallel.ir import Access, Dim, E, LoopNest, OpKind, Role, Statement

from ._registry import Shape, Spec, _handles, _identity, _Node

_REDUCE_FLOPS = {"ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2, "ReduceLogSumExp": 3, "ReduceLogSum": 1}


@_handles("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin")
def _reduce(n: _Node) -> Spec:
    x = n.shape(0)
    keep = bool(n.attr("keepdims", 1))
    if n.op_type in ("ArgMax", "ArgMin"):
        axes: list[int] | None = [int(n.attr("axis", 0))]
    elif n.has(1):
        v = n.const(1)
        axes = [int(a) for a in v.reshape(-1)] if v is not None else _axes_from_shapes(x, n.out, keep)
    else:
        a = n.attr("axes")
        axes = [int(v) for v in a] if a is not None else None
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return OpKind.VIEW, lambda: _identity(x)
        axes = None
    flops = _REDUCE_FLOPS.get(n.op_type, 1)
    return OpKind.REDUCE, lambda: ops.reduce(x, axes, keepdim=keep, flops=flops)


def _axes_from_shapes(x: Shape, out: Shape, keep: bool) -> list[int]:
    """Reduced axes read off the shapes when ``axes`` is a run-time tensor (extent-1 axes are moot)."""
    if keep:
        return [i for i, (a, b) in enumerate(zip(x, out)) if a != b]
    for axes in itertools.combinations(range(len(x)), len(x) - len(out)):
        if tuple(e for i, e in enumerate(x) if i not in axes) == tuple(out):
            return list(axes)
    raise ops.NotModelled(f"cannot tell the reduced axes of {list(x)} -> {list(out)}")


@_handles("CumSum", "CumProd")
def _cumsum(n: _Node) -> Spec:
    x = n.shape(0)
    axis = n.ints(1, "axis")[0]
    excl, rev = bool(n.attr("exclusive", 0)), bool(n.attr("reverse", 0))

    def nest() -> LoopNest:
        nt = ops.scan(x, axis)
        if not (excl or rev):
            return nt
        st = nt.statements[0]
        s_name = nt.dims[axis % len(x)].name
        c = (E("t") - E(s_name)) if rev else (E(s_name) - E("t"))
        return LoopNest(nt.dims, (Statement(st.name, st.dims, st.reads, st.writes, st.flops_per_point,
                                            (c - 1 if excl else c,)),))

    return OpKind.REDUCE, nest


@_handles("TopK")
def _topk(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", -1)) % max(len(x), 1)
    k = n.out[axis]

    def nest() -> LoopNest:
        # selection by k passes of max over the axis: k * n comparisons per row
        dims = [Dim(f"d{a}", e) for a, e in enumerate(x) if a != axis]
        names = [d.name for d in dims]
        dims += [Dim("j", max(1, k)), Dim("t", x[axis], Role.REDUCTION)]
        xi = [E(nm) for nm in names]
        oi = list(xi)
        xi.insert(axis, E("t"))
        oi.insert(axis, E("j"))
        st = Statement("select", tuple(d.name for d in dims), reads=(Access("in0", tuple(xi)),),
                       writes=tuple(Access(f"out{i}", tuple(oi)) for i in range(len(n.outs))), flops_per_point=1)
        return LoopNest(tuple(dims), (st,))

    return OpKind.REDUCE, nest


@_handles("SoftmaxCrossEntropyLoss")
def _sce(n: _Node) -> Spec:
    x, t = n.shape(0), n.shape(1)
    red = str(n.attr("reduction", "mean"))
    if len(n.outs) > 1:
        raise ops.NotModelled("SoftmaxCrossEntropyLoss with the log_prob output is not modelled")
    return OpKind.LOSS, lambda: ops.cross_entropy(x, t, reduction=red)


@_handles("NegativeLogLikelihoodLoss")
def _nll(n: _Node) -> Spec:
    x, t = n.shape(0), n.shape(1)
    red = str(n.attr("reduction", "mean"))
    return OpKind.LOSS, lambda: ops.nll_loss(x, t, reduction=red)
