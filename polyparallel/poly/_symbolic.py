"""Footprint and receive volumes as formulas in symbolic shape parameters (plain islpy).

The concrete model (:mod:`._distribution`) counts elements for one shape. Here the extents of
chosen loop dims are isl *parameters* (``B``, ``S``, ``H``...) and the same questions are
answered once for every shape:

* device ``p``'s share of dim ``d`` split over mesh axes ``(a_1..a_k)`` is the nested
  block ``[lo, hi)`` of :mod:`._mesh` with ``lo``/``hi`` *quasi-affine* in the
  parameters: ``lo' = lo + floor((hi - lo) W_c / W)`` with the device's (constant)
  coordinate ``c``; isl keeps such floors exactly;
* the footprint ``F(p) = (U_A A(D(p))) ∩ [0, N)`` is a parametric set. When it is a box
  (every footprint of a block-distributed, unconstrained or difference-constrained
  affine access that isl proves to be one), its volume is

      |F(p)| = prod_j (max_j - min_j + 1),

  each factor a piecewise quasi-affine function of the parameters (isl ``dim_max`` /
  ``dim_min``, defined where ``F(p)`` is not empty; 0 elsewhere);
* the receive volume against a held block layout ``H(p)`` is ``|N(p)| - |N(p) ∩ H(p)|``,
  the difference of two box volumes (an intersection of boxes is a box).

Plain isl has no parametric ``card`` (that is barvinok, GPL): a footprint that is not a
box (a dilated window with gaps, a causal triangle read through ``s - t``) is refused with
:class:`NotSymbolic` and the reason, as is an opaque op.

Assumption: the nest's structure (accesses, constraint constants) does not depend on the
parametrised extents; that holds for contractions, elementwise ops, norms, softmax and
attention, whose builders only put extents into the loop bounds. A tensor axis whose
every access is a plain parametrised dim has the parametric extent; other axes keep
their concrete extent.

Examples:
    >>> from polyparallel import ops
    >>> from polyparallel.poly import DeviceMesh, Placement
    >>> nest = ops.linear((2, 8, 16), (64, 16))       # x[b, s, k] @ w[n, k]
    >>> v = symbolic_volume(nest, Placement.parse("s:tp"), DeviceMesh.of(tp=4), "in0",
    ...                     params={"b": "B", "s": "S"}, device=1)
    >>> v.evaluate(B=2, S=8), v.evaluate(B=3, S=10)  # rows [2, 4) and [2, 5) of S
    (64, 144)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import islpy as isl

from polyparallel.ir import ANY, LoopNest, Op

from ._isl import _expr, _tuple_name, _v
from ._mesh import DeviceMesh
from ._placement import Placement, check_placement

__all__ = ["NotSymbolic", "SymbolicVolume", "symbolic_receive", "symbolic_volume"]

_CTX = isl.DEFAULT_CONTEXT


class NotSymbolic(ValueError):
    """The volume has no formula in plain isl here; the message says why."""


@dataclass(frozen=True)
class SymbolicVolume:
    """``sum_t coef_t * prod_j extent_{t,j}(params)``: exact volume for every parameter value.

    ``extents`` are isl piecewise quasi-affine functions of ``params``; a factor is 0
    where it is undefined (the box is empty there).
    """

    params: tuple[str, ...]
    terms: tuple[tuple[int, tuple[isl.PwAff, ...]], ...]

    def evaluate(self, **values: int) -> int:
        missing = [p for p in self.params if p not in values]
        if missing:
            raise ValueError(f"evaluate needs a value for every parameter {list(self.params)}; missing {missing}")
        total = 0
        for coef, factors in self.terms:
            prod = 1
            for pa in factors:
                prod *= _eval(pa, self.params, values)
                if prod == 0:
                    break
            total += coef * prod
        return total

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for coef, factors in self.terms:
            body = " * ".join(f"({_show(pa)})" for pa in factors) or "1"
            parts.append(("- " if coef < 0 else "+ ") + (f"{abs(coef)} * " if abs(coef) != 1 else "") + body)
        text = " ".join(parts)
        return text[2:] if text.startswith("+ ") else text


def _eval(pa: isl.PwAff, names: Sequence[str], values: Mapping[str, int]) -> int:
    space = pa.domain().get_space()
    pt = isl.Point.zero(space)
    for i in range(space.dim(isl.dim_type.param)):
        name = space.get_dim_name(isl.dim_type.param, i)
        pt = pt.set_coordinate_val(isl.dim_type.param, i, isl.Val.int_from_si(_CTX, int(values[name])))
    if not isl.Set.from_point(pt).is_subset(pa.domain()):
        return 0  # the footprint is empty for these values
    return max(int(pa.eval(pt).to_python()), 0)


def _show(pa: isl.PwAff) -> str:
    pieces = []
    pa.foreach_piece(lambda s, a: pieces.append((s, a)))
    out = []
    for dom, aff in pieces:
        expr = str(aff).split("->", 1)[-1].strip().strip("{}").strip()
        expr = expr[2:-2] if expr.startswith("[(") and expr.endswith(")]") else expr
        out.append(expr if len(pieces) == 1 else f"{expr} if {str(dom).split('->', 1)[-1].strip()}")
    return "; ".join(out)


def _default_params(nest: LoopNest) -> dict[str, str]:
    names = {"batch": "B", "sequence": "S"}
    out: dict[str, str] = {}
    for d in nest.dims:
        p = names.get(str(d.hint)) if d.hint is not None else None
        if p is not None and p not in out.values():
            out[d.name] = p
    return out


def _block_text(extent: str, axes: Sequence[str], mesh: DeviceMesh, coords: Mapping[str, int]) -> tuple[str, str]:
    lo, hi = "0", extent
    for a in axes:
        ax = mesh.axis(a)
        if ax.size == 1:
            continue
        cum = [int(x) for x in ax.cumulative()]
        c, w = coords[a], cum[-1]
        span = f"(({hi}) - ({lo}))"
        lo, hi = f"({lo}) + floor(({cum[c]} * {span}) / {w})", f"({lo}) + floor(({cum[c + 1]} * {span}) / {w})"
    return lo, hi


def _prepare(op: Op | LoopNest, placement: Placement, mesh: DeviceMesh, params: Mapping[str, str] | None,
             device: int) -> tuple[LoopNest, dict[str, str], dict[str, int]]:
    nest = op.nest if isinstance(op, Op) else op
    if nest is None:
        raise NotSymbolic(f"{getattr(op, 'name', 'op')} is opaque (no affine loop nest): no footprint formula")
    check_placement(nest, placement, mesh)
    params = dict(_default_params(nest) if params is None else params)
    for d, p in params.items():
        nest.dim(d)
        if not p.isidentifier():
            raise ValueError(f"parameter name {p!r} for dim {d!r} must be an identifier (e.g. 'B', 'S')")
    if not 0 <= device < mesh.size:
        raise ValueError(f"device {device} is not in the mesh {mesh} ({mesh.size} devices)")
    coords = {a: int(mesh.coords[device, i]) for i, a in enumerate(mesh.names)}
    return nest, params, coords


def _param_prefix(params: Mapping[str, str]) -> str:
    return f"[{', '.join(sorted(set(params.values())))}] -> " if params else ""


def _footprint(nest: LoopNest, placement: Placement, mesh: DeviceMesh, operand: str, shape: Sequence[int],
               params: Mapping[str, str], coords: Mapping[str, int], writes: bool | None) -> tuple[isl.Set, list[str]]:
    pre = _param_prefix(params)
    extent = {d.name: params.get(d.name, str(d.extent)) for d in nest.dims}
    tensor_ext = _tensor_extents(nest, operand, shape, params)
    idx = [f"i{j}" for j in range(len(shape))]
    box = " and ".join(f"0 <= {i} < {n}" for i, n in zip(idx, tensor_ext)) or "true"
    pos = " and ".join(f"{p} >= 1" for p in sorted(set(params.values()))) or "true"
    out = isl.Set(f"{pre}{{ T[{', '.join(idx)}] : 1 = 0 }}", context=_CTX)
    for st, acc, is_write in nest.accesses(operand):
        if writes is not None and is_write != writes:
            continue
        cons = [pos]
        for d in st.dims:
            lo, hi = _block_text(extent[d], placement.axes_of(d), mesh, coords)
            cons.append(f"{_v(d)} >= {lo} and {_v(d)} < {hi}")
        cons += [f"{_expr(c)} >= 0" for c in st.constraints]
        eqs = [f"{i} = {_expr(e)}" for i, e in zip(idx, acc.index) if e is not ANY]
        src = f"{_tuple_name(st)}[{', '.join(_v(d) for d in st.dims)}]"
        dom = isl.Set(f"{pre}{{ {src} : {' and '.join(cons)} }}", context=_CTX)
        amap = isl.Map(f"{pre}{{ {src} -> T[{', '.join(idx)}] : {' and '.join(eqs) or 'true'} }}", context=_CTX)
        out = out.union(dom.apply(amap).intersect(isl.Set(f"{pre}{{ T[{', '.join(idx)}] : {box} }}", context=_CTX)))
    return out.coalesce(), tensor_ext


def _tensor_extents(nest: LoopNest, operand: str, shape: Sequence[int], params: Mapping[str, str]) -> list[str]:
    """Parametric extent of a tensor axis when every access indexes it by one parametrised dim alone."""
    out = []
    for j, n in enumerate(shape):
        dims = set()
        plain = True
        for _st, acc, _w in nest.accesses(operand):
            e = acc.index[j]
            if e is ANY or e.const != 0 or len(e.terms) != 1 or e.terms[0][1] != 1:
                plain = False
                break
            dims.add(e.terms[0][0])
        d = next(iter(dims)) if plain and len(dims) == 1 else None
        out.append(params[d] if d in params and nest.dim(d).extent == n else str(n))
    return out


def _box_volume(s: isl.Set, what: str) -> tuple[isl.PwAff, ...]:
    if s.is_empty():
        return (isl.PwAff.zero_on_domain(isl.LocalSpace.from_space(s.params().get_space())),)
    if not s.is_box():
        raise NotSymbolic(f"{what} is not a box ({s}); plain isl counts only boxes parametrically "
                          "(barvinok's card is GPL): use the concrete counts of polyparallel.poly instead")
    n = s.dim(isl.dim_type.set)
    one = None
    factors = []
    for j in range(n):
        hi, lo = s.dim_max(j), s.dim_min(j)
        if one is None:
            one = isl.PwAff.val_on_domain(hi.domain(), isl.Val.one(_CTX))
        factors.append(hi.sub(lo).add(one.intersect_domain(hi.domain())).coalesce())
    return tuple(factors)


def _operand_shape(op: Op | LoopNest, nest: LoopNest, operand: str, shape: Sequence[int] | None) -> tuple[int, ...]:
    if shape is not None:
        return tuple(shape)
    ext = nest.extents
    dims = None
    for _st, acc, _w in nest.accesses(operand):
        cur = []
        for e in acc.index:
            if e is ANY:
                raise ValueError(f"operand {operand!r} has a data-dependent index: pass its shape=")
            cur.append(1 + e.const + sum(max(k, 0) * (ext[d] - 1) for d, k in e.terms))
        dims = cur if dims is None else [max(a, b) for a, b in zip(dims, cur)]
    if dims is None:
        raise ValueError(f"the nest has no operand {operand!r}; operands are {list(nest.operands())}")
    return tuple(dims)


def symbolic_volume(op: Op | LoopNest, placement: Placement, mesh: DeviceMesh, operand: str, *,
                    params: Mapping[str, str] | None = None, device: int = 0, writes: bool | None = None,
                    shape: Sequence[int] | None = None) -> SymbolicVolume:
    """Footprint volume of ``device`` on ``operand`` as a formula in shape parameters.

    Args:
        params: loop dim -> parameter name (default: batch dims -> ``B``, sequence -> ``S``).
        writes: only write (True) or read (False) accesses; both when None.
        shape: the operand's concrete shape (default: the largest index the accesses reach).
    Raises:
        NotSymbolic: the footprint is not a box, or the op is opaque.
    """
    nest, params, coords = _prepare(op, placement, mesh, params, device)
    shp = _operand_shape(op, nest, operand, shape)
    fp, _ = _footprint(nest, placement, mesh, operand, shp, params, coords, writes)
    return SymbolicVolume(tuple(sorted(set(params.values()))),
                          ((1, _box_volume(fp, f"footprint of {operand} on device {device}")),))


def symbolic_receive(op: Op | LoopNest, placement: Placement, mesh: DeviceMesh, operand: str,
                     have: Sequence[Sequence[str]], *, params: Mapping[str, str] | None = None,
                     device: int = 0, shape: Sequence[int] | None = None) -> SymbolicVolume:
    """Elements ``device`` must receive to read ``operand`` when it holds the block layout ``have``
    (tensor axis ``j`` split over mesh axes ``have[j]``): ``|N(p)| - |N(p) ∩ H(p)|``."""
    nest, params, coords = _prepare(op, placement, mesh, params, device)
    shp = _operand_shape(op, nest, operand, shape)
    if len(have) != len(shp):
        raise ValueError(f"have gives {len(have)} shard entries for a tensor of rank {len(shp)}")
    need, ext = _footprint(nest, placement, mesh, operand, shp, params, coords, False)
    idx = [f"i{j}" for j in range(len(shp))]
    cons = []
    for j, axes in enumerate(have):
        lo, hi = _block_text(ext[j], tuple(axes), mesh, coords)
        cons.append(f"{idx[j]} >= {lo} and {idx[j]} < {hi}")
    held = isl.Set(f"{_param_prefix(params)}{{ T[{', '.join(idx)}] : {' and '.join(cons) or 'true'} }}",
                   context=_CTX)
    both = need.intersect(held).coalesce()
    what = f"need of {operand} on device {device}"
    return SymbolicVolume(tuple(sorted(set(params.values()))),
                          ((1, _box_volume(need, what)), (-1, _box_volume(both, what + " ∩ held block"))))
