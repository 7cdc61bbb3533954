"""Handlers of reductions: ``sum``, ``mean``, ``max`` and the others over some axes (variance,
standard deviation and norms with their FLOPs per element), cumulative scans, and the losses.
"""

from __future__ import annotations

from polyparallel import ops
from polyparallel.ir import LoopNest, OpKind

from ._registry import Call, Spec, _ints, handles

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


@handles("cumsum", "cumprod", "cummax", "logcumsumexp")
def _scan(c: Call) -> Spec:
    x = c.tensor("self", "input")
    return OpKind.REDUCE, [x], lambda: ops.scan(c.shape(x), int(c.get("dim")))


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
