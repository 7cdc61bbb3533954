"""isl sets and maps of the IR's loop nests, and exact point counts in plain islpy.

For statement ``S`` of an op, the iteration domain on device ``p`` is the box of ``p``'s
blocks cut by the statement's affine constraints::

    D_S(p) = { S[i] : lo_d(p) <= i_d < hi_d(p)  for every dim d,   c(i) >= 0 for every constraint c }

and each access is the map ``A: S[i] -> T[f(i)]`` (a data-dependent index ``ANY``
leaves that tensor axis free). The footprint of ``p`` on tensor ``T`` of shape ``N`` is
``F_T(p) = (U_A A(D_S(p))) ∩ [0, N)``: accesses outside the tensor read zero padding and
move no data.

Licence: polyparallel is MIT, so it uses plain ``islpy`` (MIT) and never
``islpy-barvinok`` (GPL; the two install the same module, so an environment has one).
Plain isl has no parametric ``card``; counts here are exact for concrete shapes:
a set is made disjoint; each basic set splits into groups of dims that no constraint
links (directly or through an existential div); a group that is a box counts as the
product of its extents, any other group (a stride, a causal triangle) by isl's
point-scanning ``count_val`` on that group alone, and the basic set's count is the
product over groups. Scanning cost is then that of the few linked dims (``s, t`` of
a causal mask), not of the whole domain.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache

import islpy as isl

from polyparallel.ir import ANY, Access, AffineExpr, LoopNest, Statement

__all__ = ["ISL_TIME", "access_map", "count", "domain_set", "footprint_set", "tensor_box", "write_is_injective"]

#: Seconds spent inside isl since import (the benchmark reports its share).
ISL_TIME = {"seconds": 0.0, "calls": 0}

_CTX = isl.DEFAULT_CONTEXT


class _timed:
    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        ISL_TIME["seconds"] += time.perf_counter() - self.t
        ISL_TIME["calls"] += 1


def _v(dim: str) -> str:
    # prefixed so that dim names never collide with isl keywords (min, max, mod, ...)
    return f"x_{dim}"


def _expr(e: AffineExpr) -> str:
    text = " ".join(f"{'-' if c < 0 else '+'} {abs(c)}*{_v(d)}" for d, c in e.terms)
    text += f" {'-' if e.const < 0 else '+'} {abs(e.const)}"
    return "0 " + text


def _tuple_name(st: Statement) -> str:
    return "S_" + "".join(ch if ch.isalnum() else "_" for ch in st.name)


def _domain_text(nest: LoopNest, st: Statement, bounds: Mapping[str, tuple[int, int]] | None) -> str:
    cons = []
    for d in st.dims:
        lo, hi = bounds[d] if bounds and d in bounds else (0, nest.dim(d).extent)
        cons.append(f"{lo} <= {_v(d)} < {hi}")
    cons += [f"{_expr(c)} >= 0" for c in st.constraints]
    return f"[{', '.join(_v(d) for d in st.dims)}] : {' and '.join(cons) or 'true'}"


def domain_set(nest: LoopNest, st: Statement, bounds: Mapping[str, tuple[int, int]] | None = None) -> isl.Set:
    """``D_S`` (or device ``p``'s share of it when ``bounds`` gives ``[lo, hi)`` per split dim)."""
    with _timed():
        text = _domain_text(nest, st, bounds)
        return isl.Set(f"{{ {_tuple_name(st)}{text} }}", context=_CTX)


def tensor_box(name: str, shape: Sequence[int]) -> isl.Set:
    with _timed():
        idx = [f"i{j}" for j in range(len(shape))]
        cons = " and ".join(f"0 <= {i} < {n}" for i, n in zip(idx, shape)) or "true"
        return isl.Set(f"{{ {name}[{', '.join(idx)}] : {cons} }}", context=_CTX)


def access_map(st: Statement, acc: Access) -> isl.Map:
    """``A: S[i] -> T[f(i)]``; ``ANY`` indices are unconstrained (clipped by the tensor box later)."""
    with _timed():
        idx = [f"i{j}" for j in range(len(acc.index))]
        cons = [f"{i} = {_expr(e)}" for i, e in zip(idx, acc.index) if e is not ANY]
        src = f"{_tuple_name(st)}[{', '.join(_v(d) for d in st.dims)}]"
        return isl.Map(f"{{ {src} -> {acc.operand}[{', '.join(idx)}] : {' and '.join(cons) or 'true'} }}",
                       context=_CTX)


def footprint_set(nest: LoopNest, operand: str, shape: Sequence[int],
                  bounds: Mapping[str, tuple[int, int]] | None = None, *, writes: bool | None = None) -> isl.Set:
    """``F_T(p)``: elements of ``operand`` that the iterations inside ``bounds`` touch.

    ``writes`` restricts to write accesses (True) or read accesses (False).
    """
    box = tensor_box(operand, shape)
    out = box.subtract(box)  # the empty set in the right space
    for st, acc, is_write in nest.accesses(operand):
        if writes is not None and is_write != writes:
            continue
        img = domain_set(nest, st, bounds).apply(access_map(st, acc))
        with _timed():
            out = out.union(img.intersect(box))
    with _timed():
        return out.coalesce()


def count(s: isl.Set) -> int:
    """Exact number of integer points of a bounded, parameter-free set."""
    with _timed():
        total = 0
        for bs in s.make_disjoint().get_basic_sets():
            total += _count_basic(bs)
        return total


def _count_basic(bs: isl.BasicSet) -> int:
    """Points of a basic set: the product over groups of dims that no constraint links."""
    if bs.is_empty():
        return 0
    n = bs.dim(isl.dim_type.set)
    if n == 0:
        return 1
    whole = isl.Set.from_basic_set(bs)
    if whole.is_box():
        return math.prod(_extent(whole, i) for i in range(n))
    total = 1
    for group in _independent_groups(bs, n):
        others = [i for i in range(n) if i not in group]
        part = bs
        for i in reversed(others):  # highest index first so that positions stay valid
            part = part.project_out(isl.dim_type.set, i, 1)
        total *= _count_group(isl.Set.from_basic_set(part))
        if total == 0:
            return 0
    return total


def _independent_groups(bs: isl.BasicSet, n: int) -> list[list[int]]:
    """Groups of set dims linked by a constraint, directly or through an existential div."""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(ids: list[int]) -> None:
        for a in ids[1:]:
            parent[find(a)] = find(ids[0])

    ndiv = bs.dim(isl.dim_type.div)
    div_dims = []
    for j in range(ndiv):
        div = bs.get_div(j)
        div_dims.append([i for i in range(n) if div.involves_dims(isl.dim_type.in_, i, 1)])
    for c in bs.get_constraints():
        ids = [i for i in range(n) if c.involves_dims(isl.dim_type.set, i, 1)]
        for j in range(ndiv):
            if c.involves_dims(isl.dim_type.div, j, 1):
                ids += div_dims[j]
                if not div_dims[j]:
                    ids += []
        if len(ids) > 1:
            union(ids)
    if ndiv and any(not d for d in div_dims):
        # a div of unknown definition may link anything: count the set as one group
        return [list(range(n))]
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _count_group(s: isl.Set) -> int:
    k = s.dim(isl.dim_type.set)
    if k == 0:
        return 0 if s.is_empty() else 1
    if s.is_box():
        return math.prod(_extent(s, i) for i in range(k))
    return int(s.count_val().to_python())


def _extent(s: isl.Set, i: int) -> int:
    lo = s.dim_min_val(i).to_python()
    hi = s.dim_max_val(i).to_python()
    return int(hi - lo + 1)


@lru_cache(maxsize=4096)
def write_is_injective(nest: LoopNest, st_index: int, w_index: int) -> bool:
    """Whether write access ``w`` of statement ``st`` maps distinct written iterations to distinct elements.

    Reduction dims (not in the write) are projected out first: accumulating over them is
    the statement's meaning, not a collision.
    """
    st = nest.statements[st_index]
    w = st.writes[w_index]
    if any(e is ANY for e in w.index):
        return False
    written = tuple(d for d in st.dims if d not in st.reduction_dims())
    sub = Statement(st.name, written, reads=(), writes=(w,))
    dom = domain_set(nest, sub)
    with _timed():
        m = access_map(sub, w).intersect_domain(dom)
        return bool(m.is_injective())
