"""Contractions: linear, mm, bmm, matmul (numpy broadcasting), addmm, einsum."""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import Access, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled, broadcast_index, broadcast_shapes, lead_dims


def linear(x: Sequence[int], w: Sequence[int], bias: Sequence[int] | None = None) -> LoopNest:
    """``y[*, n] = sum_k x[*, k] * w[n, k] (+ b[n])`` with operands (x, w, bias)."""
    if len(w) != 2 or len(x) < 1 or x[-1] != w[1]:
        raise NotModelled(f"linear with x{list(x)} and weight{list(w)}")
    lead = lead_dims(x[:-1])
    n, k = Dim("n", w[0], Role.PARALLEL, Hint.FEATURE), Dim("k", w[1], Role.REDUCTION, Hint.FEATURE)
    li = tuple(E(d.name) for d in lead)
    sts = [Statement("mac", (*[d.name for d in lead], "n", "k"),
                     reads=(Access("in0", (*li, E("k"))), Access("in1", (E("n"), E("k")))),
                     writes=(Access("out0", (*li, E("n"))),), flops_per_point=2)]
    if bias is not None:
        sts.append(Statement("bias", (*[d.name for d in lead], "n"), reads=(Access("in2", (E("n"),)),),
                             writes=(Access("out0", (*li, E("n"))),), flops_per_point=1))
    return LoopNest((*lead, n, k), tuple(sts))


def matmul(a: Sequence[int], b: Sequence[int], *, bias: Sequence[int] | None = None,
           bias_first: bool = False, trans_a: bool = False, trans_b: bool = False) -> LoopNest:
    """numpy ``matmul`` semantics (1-D promotion, broadcast batch dims).

    Operands are (a, b) as in0/in1, or (bias, a, b) when ``bias_first`` (``addmm``), or
    (a, b, bias) otherwise (ONNX ``Gemm``). ``trans_*`` transpose the last two axes.
    """
    a, b = list(a), list(b)
    if trans_a and len(a) >= 2:
        a[-1], a[-2] = a[-2], a[-1]
    if trans_b and len(b) >= 2:
        b[-1], b[-2] = b[-2], b[-1]
    a_vec, b_vec = len(a) == 1, len(b) == 1
    a2 = [1, *a] if a_vec else a
    b2 = [*b, 1] if b_vec else b
    if a2[-1] != b2[-2]:
        raise NotModelled(f"matmul of {a} and {b}: inner extents differ")
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    bdims = [Dim(f"b{i}" if len(batch) > 1 else "b", e, Role.PARALLEL, Hint.BATCH if i == 0 else None)
             for i, e in enumerate(batch)]
    m = Dim("m", a2[-2], Role.PARALLEL)
    n = Dim("n", b2[-1], Role.PARALLEL, Hint.FEATURE)
    k = Dim("k", a2[-1], Role.REDUCTION, Hint.FEATURE)

    def batch_idx(shape_batch: Sequence[int]) -> tuple:
        off = len(bdims) - len(shape_batch)
        return tuple(E(bdims[off + j].name) if e != 1 or bdims[off + j].extent == 1 else 0 * E("m")
                     for j, e in enumerate(shape_batch))

    def mat_idx(rows, cols, vec_drop: int | None, trans: bool):
        idx = [rows, cols]
        if trans:
            idx.reverse()
        if vec_drop is not None:
            idx.pop(vec_drop)
        return tuple(idx)

    ia = (*batch_idx(a2[:-2]), *mat_idx(E("m"), E("k"), 0 if a_vec else None, trans_a))
    ib = (*batch_idx(b2[:-2]), *mat_idx(E("k"), E("n"), 1 if b_vec else None, trans_b))
    out_idx = [*[E(d.name) for d in bdims]]
    if not a_vec:
        out_idx.append(E("m"))
    if not b_vec:
        out_idx.append(E("n"))
    names_a, names_b = ("in1", "in2") if bias_first else ("in0", "in1")
    dims = (*bdims, m, n, k)
    sts = [Statement("mac", tuple(d.name for d in dims),
                     reads=(Access(names_a, ia), Access(names_b, ib)),
                     writes=(Access("out0", tuple(out_idx)),), flops_per_point=2)]
    if bias is not None:
        out_shape_dims = [*bdims] + ([] if a_vec else [m]) + ([] if b_vec else [n])
        bi = _bias_index(bias, out_shape_dims)
        sts.append(Statement("bias", tuple(d.name for d in (*bdims, m, n)),
                             reads=(Access("in0" if bias_first else "in2", bi),),
                             writes=(Access("out0", tuple(out_idx)),), flops_per_point=1))
    return LoopNest(dims, tuple(sts))


def _bias_index(bias: Sequence[int], out_dims: Sequence[Dim]) -> tuple:
    return broadcast_index(bias, out_dims)


def einsum(equation: str, shapes: Sequence[Sequence[int]]) -> LoopNest:
    """``torch.einsum`` / ONNX ``Einsum`` with explicit or implicit output, no ellipsis."""
    eq = equation.replace(" ", "")
    if "..." in eq:
        raise NotModelled("einsum with '...' is not modelled")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise NotModelled(f"einsum {equation!r} has {len(terms)} operands, got {len(shapes)}")
    if not _:
        counts: dict[str, int] = {}
        for t in terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = "".join(sorted(c for c, k in counts.items() if k == 1))
    extents: dict[str, int] = {}
    for t, s in zip(terms, shapes):
        if len(t) != len(s):
            raise NotModelled(f"einsum term {t!r} does not match shape {list(s)}")
        for c, e in zip(t, s):
            if extents.get(c, e) != e and 1 not in (e, extents[c]):
                raise NotModelled(f"einsum index {c!r} has extents {extents[c]} and {e}")
            extents[c] = max(extents.get(c, 1), e)
    letters = list(dict.fromkeys(rhs + "".join(terms)))
    dims = tuple(Dim(c, extents[c], Role.PARALLEL if c in rhs else Role.REDUCTION) for c in letters)
    reads = tuple(Access(f"in{i}", tuple(E(c) if s[j] != 1 or extents[c] == 1 else 0 * E(c)
                                          for j, c in enumerate(t)))
                  for i, (t, s) in enumerate(zip(terms, shapes)))
    fpp = max(1, 2 * (len(terms) - 1)) if len(terms) > 1 else 1
    st = Statement("mac", tuple(letters), reads=reads, writes=(Access("out0", tuple(E(c) for c in rhs)),),
                   flops_per_point=fpp)
    return LoopNest(dims, (st,))
