"""Normalisations as two statements: statistics (a reduction) and the normalisation.

Splitting a normalised dim therefore needs only the statistics reduced across devices
(the temporary ``stats``), not the activations; the polyhedral model reads that off.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled, lead_dims


def layer_norm(x: Sequence[int], normalized: Sequence[int], *, weight: bool = True, bias: bool = True,
               rms: bool = False) -> LoopNest:
    """Layer norm (or RMS norm) over the last ``len(normalized)`` axes; operands (x, w, b)."""
    k = len(normalized)
    if k == 0 or tuple(x[-k:]) != tuple(normalized):
        raise NotModelled(f"norm over {list(normalized)} of input{list(x)}")
    lead = lead_dims(x[:-k])
    nd = [Dim(f"f{i}" if k > 1 else "f", e, Role.REDUCTION, Hint.FEATURE) for i, e in enumerate(normalized)]
    li, ni = [E(d.name) for d in lead], [E(d.name) for d in nd]
    all_names = tuple(d.name for d in (*lead, *nd))
    stats = Statement("stats", all_names, reads=(Access("in0", (*li, *ni)),),
                      writes=(Access("stats", tuple(li)),), flops_per_point=2 if rms else 3)
    reads = [Access("in0", (*li, *ni)), Access("stats", tuple(li))]
    fpp = 2
    if weight:
        reads.append(Access("in1", tuple(ni)))
        fpp += 1
    if bias:
        reads.append(Access("in2" if weight else "in1", tuple(ni)))
        fpp += 1
    norm = Statement("normalize", all_names, reads=tuple(reads), writes=(Access("out0", (*li, *ni)),),
                     flops_per_point=fpp)
    return LoopNest((*lead, *nd), (stats, norm))


def batch_norm(x: Sequence[int], *, affine: bool = True, training: bool = True) -> LoopNest:
    """Batch norm over (batch, spatial) per channel; operands (x, weight, bias).

    In training the statistics are a reduction over batch and spatial dims (splitting the
    batch needs them all-reduced: sync-BN); in eval the running statistics are read.
    """
    if len(x) < 2:
        raise NotModelled(f"batch norm of input{list(x)}")
    sp = ("l",) if len(x) == 3 else ("h", "w") if len(x) == 4 else tuple(f"x{i}" for i in range(len(x) - 2))
    dims = [Dim("b", x[0], Role.REDUCTION if training else Role.PARALLEL, Hint.BATCH),
            Dim("c", x[1], Role.PARALLEL, Hint.CHANNEL)]
    dims += [Dim(s, e, Role.REDUCTION if training else Role.PARALLEL, Hint.SPATIAL) for s, e in zip(sp, x[2:])]
    idx = tuple(E(d.name) for d in dims)
    names = tuple(d.name for d in dims)
    reads = [Access("in0", idx), Access("stats", (E("c"),))]
    if affine:
        reads += [Access("in1", (E("c"),)), Access("in2", (E("c"),))]
    norm = Statement("normalize", names, reads=tuple(reads), writes=(Access("out0", idx),),
                     flops_per_point=4 if affine else 2)
    if not training:
        return LoopNest(tuple(dims), (norm,))
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", (E("c"),)),),
                      flops_per_point=3)
    return LoopNest(tuple(dims), (stats, norm))


def group_norm(x: Sequence[int], groups: int, *, affine: bool = True) -> LoopNest:
    """Group norm: statistics per (batch, group) over the group's channels and spatial dims."""
    if len(x) < 2 or x[1] % groups:
        raise NotModelled(f"group norm with {groups} groups of input{list(x)}")
    cg = x[1] // groups
    sp = tuple(f"x{i}" for i in range(len(x) - 2))
    dims = [Dim("b", x[0], Role.PARALLEL, Hint.BATCH), Dim("g", groups, Role.PARALLEL, Hint.CHANNEL),
            Dim("c", cg, Role.REDUCTION, Hint.CHANNEL)]
    dims += [Dim(s, e, Role.REDUCTION, Hint.SPATIAL) for s, e in zip(sp, x[2:])]
    ch = E("g") * cg + E("c")
    xi = (E("b"), ch, *[E(s) for s in sp])
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", xi),), writes=(Access("stats", (E("b"), E("g"))),),
                      flops_per_point=3)
    reads = [Access("in0", xi), Access("stats", (E("b"), E("g")))]
    if affine:
        reads += [Access("in1", (ch,)), Access("in2", (ch,))]
    norm = Statement("normalize", names, reads=tuple(reads), writes=(Access("out0", xi),),
                     flops_per_point=4 if affine else 2)
    return LoopNest(tuple(dims), (stats, norm))


def softmax(x: Sequence[int], axis: int, *, log: bool = False) -> LoopNest:
    """(Log-)softmax along ``axis``: max/sum statistics, then the normalisation."""
    r = len(x)
    if r == 0:
        raise NotModelled("softmax of a scalar")
    axis %= r
    dims = [Dim(f"d{i}", e, Role.REDUCTION if i == axis else Role.PARALLEL,
                Hint.BATCH if i == 0 and axis != 0 else None) for i, e in enumerate(x)]
    idx = tuple(E(d.name) for d in dims)
    sidx = tuple(E(d.name) for i, d in enumerate(dims) if i != axis)
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", sidx),),
                      flops_per_point=3)
    norm = Statement("normalize", names, reads=(Access("in0", idx), Access("stats", sidx)),
                     writes=(Access("out0", idx),), flops_per_point=2 if not log else 1)
    return LoopNest(tuple(dims), (stats, norm))
