"""Scaled dot-product attention as three statements (scores, softmax statistics, output).

``q[b, h, s, d]``, ``k[b, hk, t, d]``, ``v[b, hk, t, e]``; grouped-query attention
(``h = hk * g``) splits the head dim into (kv-head, group) so every access stays affine.
A causal mask is the constraint ``s - t >= 0`` (a sliding window adds ``t > s - window``), so its
FLOPs, and the keys and values each block of queries reads, are counted exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled, broadcast_index


def attention(q: Sequence[int], k: Sequence[int], v: Sequence[int], mask: Sequence[int] | None = None, *,
              causal: bool = False, window: int | None = None) -> LoopNest:
    """Operands (q, k, v[, mask]); ranks 3 (no head dim) or 4.

    ``window``: a sliding-window mask (Mistral, Longformer's local attention): query ``s`` sees the
    keys ``s - window < t <= s`` (causal implied), the constraint ``window - 1 - s + t >= 0``.
    """
    if window is not None and window < 1:
        raise NotModelled(f"attention window {window} must be >= 1")
    if not (len(q) == len(k) == len(v)) or len(q) not in (3, 4):
        raise NotModelled(f"attention with q{list(q)} k{list(k)} v{list(v)}")
    if len(q) == 3:
        q, k, v = (q[0], 1, *q[1:]), (k[0], 1, *k[1:]), (v[0], 1, *v[1:])
        squeeze = True
    else:
        squeeze = False
    B, H, S, D = q
    Hk, T = k[1], k[2]
    Ev = v[3]
    if k[3] != D or v[2] != T or v[1] != Hk or H % Hk or k[0] not in (B, 1):
        raise NotModelled(f"attention with q{list(q)} k{list(k)} v{list(v)}")
    G = H // Hk
    dims = [Dim("b", B, Role.PARALLEL, Hint.BATCH), Dim("h", Hk, Role.PARALLEL, Hint.HEAD)]
    if G > 1:
        dims.append(Dim("g", G, Role.PARALLEL, Hint.HEAD))
    dims += [Dim("s", S, Role.PARALLEL, Hint.SEQUENCE), Dim("t", T, Role.REDUCTION, Hint.SEQUENCE),
             Dim("d", D, Role.REDUCTION, Hint.FEATURE), Dim("e", Ev, Role.PARALLEL, Hint.FEATURE)]
    hq = E("h") * G + E("g") if G > 1 else E("h")
    heads = ("h", "g") if G > 1 else ("h",)

    def head_idx(full: bool):
        if squeeze:
            return ()
        return (hq,) if full else (E("h"),)

    bq = (E("b"),)
    qi = (*bq, *head_idx(True), E("s"), E("d"))
    ki = (*bq, *head_idx(False), E("t"), E("d"))
    vi = (*bq, *head_idx(False), E("t"), E("e"))
    oi = (*bq, *head_idx(True), E("s"), E("e"))
    sc = (E("b"), *[E(h) for h in heads], E("s"), E("t"))
    stat = (E("b"), *[E(h) for h in heads], E("s"))
    cons = (E("s") - E("t"),) if causal or window is not None else ()
    if window is not None:
        cons += (E("t") - E("s") + (window - 1),)
    base = ("b", *heads, "s", "t")
    sts = [Statement("scores", (*base, "d"), reads=(Access("in0", qi), Access("in1", ki)),
                     writes=(Access("scores", sc),), flops_per_point=2, constraints=cons)]
    sm_reads = [Access("scores", sc)]
    if mask is not None:
        mdims = [dims[0], *([Dim("hh", H)] if not squeeze else []), Dim("s", S), Dim("t", T)]
        midx = broadcast_index(mask, mdims)
        midx = tuple(hq if str(x) == "hh" else x for x in midx)
        sm_reads.append(Access("in3", midx))
    sts.append(Statement("softmax", base, reads=tuple(sm_reads), writes=(Access("stats", stat),),
                         flops_per_point=4 if mask is not None else 3, constraints=cons))
    sts.append(Statement("pv", (*base, "e"), reads=(Access("scores", sc), Access("stats", stat), Access("in2", vi)),
                         writes=(Access("out0", oi),), flops_per_point=2, constraints=cons))
    return LoopNest(tuple(dims), tuple(sts))
