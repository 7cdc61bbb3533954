"""Embedding lookups, gathers and losses.

An embedding ``y[b, s, e] = W[ids[b, s], e]`` is modelled as a reduction over the
vocabulary dim ``v`` of a one-hot selection (``y += [ids == v] * W[v, e]``, zero FLOPs),
so splitting the vocabulary (vocab-parallel embedding) correctly needs the output
all-reduced, and splitting ``e`` needs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import ANY, Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled, broadcast_index, broadcast_shapes, generic_dims, lead_dims, norm_axis


def embedding(weight: Sequence[int], ids: Sequence[int]) -> LoopNest:
    """Operands (weight [V, E], ids [*])."""
    if len(weight) != 2:
        raise NotModelled(f"embedding table of shape {list(weight)}")
    lead = lead_dims(ids)
    li = tuple(E(d.name) for d in lead)
    dims = (*lead, Dim("v", weight[0], Role.REDUCTION, Hint.VOCAB), Dim("e", weight[1], Role.PARALLEL, Hint.FEATURE))
    st = Statement("lookup", tuple(d.name for d in dims),
                   reads=(Access("in0", (E("v"), E("e"))), Access("in1", li)),
                   writes=(Access("out0", (*li, E("e"))),), flops_per_point=0)
    return LoopNest(dims, (st,))


def gather(data: Sequence[int], indices: Sequence[int], axis: int) -> LoopNest:
    """``take(data, indices, axis)`` (ONNX Gather, ``index_select``); operands (data, indices)."""
    axis = norm_axis(axis, len(data))
    if axis == 0 and len(data) == 2:
        return embedding(data, indices)
    out_shape = (*data[:axis], *indices, *data[axis + 1:])
    dims = generic_dims(out_shape)
    names = [d.name for d in dims]
    di = [E(n) for n in names[:axis]] + [ANY] + [E(n) for n in names[axis + len(indices):]]
    ii = tuple(E(n) for n in names[axis: axis + len(indices)])
    st = Statement("gather", tuple(names), reads=(Access("in0", tuple(di)), Access("in1", ii)),
                   writes=(Access("out0", tuple(E(n) for n in names)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


def cross_entropy(logits: Sequence[int], target: Sequence[int], *, reduction: str = "mean",
                  soft_target: bool = False) -> LoopNest:
    """Softmax cross-entropy; logits ``[N, C, *extra]``, target ``[N, *extra]`` (class ids).

    Statements: log-sum-exp statistics over classes, the pick of the target logit (a
    masked reduction over classes: vocab-parallel loss needs only per-row scalars
    reduced), and the reduction over rows.
    """
    if len(logits) < 1:
        raise NotModelled("cross entropy of a scalar")
    if len(logits) == 1:
        logits = (1, *logits)
        target = (1,)
    N, C, extra = logits[0], logits[1], tuple(logits[2:])
    if not soft_target and tuple(target) not in ((N, *extra), (N,), ()):
        raise NotModelled(f"cross entropy with logits{list(logits)} and target{list(target)}")
    xs = [Dim(f"x{i}", e, Role.PARALLEL, Hint.SEQUENCE) for i, e in enumerate(extra)]
    red = Role.REDUCTION if reduction in ("mean", "sum") else Role.PARALLEL
    dims = (Dim("n", N, red, Hint.BATCH), Dim("c", C, Role.REDUCTION, Hint.VOCAB), *xs)
    rows = (E("n"), *[E(d.name) for d in xs])
    li = (E("n"), E("c"), *[E(d.name) for d in xs])
    row_names = ("n", *[d.name for d in xs])
    ti = li if soft_target else rows
    lse = Statement("logsumexp", (*row_names, "c"), reads=(Access("in0", li),), writes=(Access("lse", rows),),
                    flops_per_point=3)
    pick = Statement("pick", (*row_names, "c"), reads=(Access("in0", li), Access("in1", ti)),
                     writes=(Access("picked", rows),), flops_per_point=2 if soft_target else 0)
    out = (Access("out0", ()),) if red is Role.REDUCTION else (Access("out0", rows),)
    total = Statement("reduce", row_names, reads=(Access("lse", rows), Access("picked", rows)), writes=out,
                      flops_per_point=2)
    return LoopNest(dims, (lse, pick, total))


def nll_loss(logp: Sequence[int], target: Sequence[int], *, reduction: str = "mean") -> LoopNest:
    """Negative log-likelihood of log-probabilities ``[N, C, *extra]``: a pick and a sum."""
    if len(logp) < 2:
        logp = (1, *logp)
    N, C, extra = logp[0], logp[1], tuple(logp[2:])
    xs = [Dim(f"x{i}", e, Role.PARALLEL, Hint.SEQUENCE) for i, e in enumerate(extra)]
    red = Role.REDUCTION if reduction in ("mean", "sum") else Role.PARALLEL
    dims = (Dim("n", N, red, Hint.BATCH), Dim("c", C, Role.REDUCTION, Hint.VOCAB), *xs)
    rows = (E("n"), *[E(d.name) for d in xs])
    row_names = ("n", *[d.name for d in xs])
    pick = Statement("pick", (*row_names, "c"),
                     reads=(Access("in0", (E("n"), E("c"), *[E(d.name) for d in xs])), Access("in1", rows)),
                     writes=(Access("picked", rows),), flops_per_point=0)
    out = (Access("out0", ()),) if red is Role.REDUCTION else (Access("out0", rows),)
    total = Statement("reduce", row_names, reads=(Access("picked", rows),), writes=out, flops_per_point=1)
    return LoopNest(dims, (pick, total))


def take_along_axis(data: Sequence[int], index: Sequence[int], axis: int) -> LoopNest:
    """``torch.gather`` / ONNX ``GatherElements``: ``y[i..] = x[i.. with index[i..] on axis]``."""
    axis = norm_axis(axis, len(data))
    if len(index) != len(data) or any(i > d for k, (i, d) in enumerate(zip(index, data)) if k != axis):
        raise NotModelled(f"gather of index{list(index)} from data{list(data)} along {axis}")
    dims = generic_dims(index)
    names = [d.name for d in dims]
    di = tuple(ANY if k == axis else E(n) for k, n in enumerate(names))
    st = Statement("gather", tuple(names), reads=(Access("in0", di), Access("in1", tuple(E(n) for n in names))),
                   writes=(Access("out0", tuple(E(n) for n in names)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


def advanced_index(data: Sequence[int], indices: Sequence[Sequence[int] | None]) -> LoopNest:
    """``x[i0, i1, ...]`` with index tensors on the leading axes (numpy advanced indexing).

    ``indices[k]`` is the shape of the index tensor for axis k, or ``None`` for ``:``;
    the indexed axes must be leading and consecutive (the common case).
    """
    k = len(indices)
    if any(s is None for s in indices) or k > len(data) or k == 0:
        raise NotModelled("advanced indexing on non-leading or non-consecutive axes")
    bshape = broadcast_shapes(*indices)
    rest = tuple(data[k:])
    dims = generic_dims((*bshape, *rest))
    bd = dims[: len(bshape)]
    names = [d.name for d in dims]
    di = (*[ANY] * k, *[E(n) for n in names[len(bshape):]])
    reads = [Access("in0", di)] + [Access(f"in{j + 1}", broadcast_index(s, bd)) for j, s in enumerate(indices)]
    st = Statement("gather", tuple(names), reads=tuple(reads),
                   writes=(Access("out0", tuple(E(n) for n in names)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))
