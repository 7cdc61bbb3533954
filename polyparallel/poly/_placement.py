"""Placements of an op's loop dims on a device mesh, and which of them are legal.

A :class:`Placement` maps some loop dims of an op to ordered tuples of mesh axes (a
block distribution, see :mod:`._mesh`); mesh axes it does not use replicate the op's
work. Its string form is compact: ``"b:dp,n:tp"``, ``"s:dp+tp"`` (two axes on one dim,
outermost first), ``"R"`` (replicated).

What splitting a dim ``d`` means follows from the statements of the nest (a statement
*reduces* ``d`` when ``d`` is in its dims but in none of its write indices):

* **parallel**: no statement reduces ``d``; devices write disjoint parts of the outputs.
* **normalised**: statements reduce ``d`` only into op-internal temporaries (layer norm
  and softmax statistics), and ``d`` indexes an output: only the temporaries need an
  all-reduce inside the op; the output stays split along ``d``.
* **reduction**: some statement reduces ``d`` into an output: each device holds partial
  sums of its output block; the output is *Partial* on those mesh axes and a later
  reshard (all-reduce or reduce-scatter) finishes the sum.

Legality rule (explicit):

1. each mesh axis at most once per op; only dims of the op; extent-1 dims never split;
2. a dim of extent ``N`` split into ``k`` blocks needs ``N >= k`` (no idle device);
3. ``N % k != 0`` on an even mesh axis is legal with **padding** (the default,
   ``uneven="pad"``): blocks are balanced, and the padding a collective or a kernel
   needs to make them equal, ``k * max_block - N`` per split dim, is reported by
   :func:`padding_of`; with ``uneven="refuse"`` such splits are refused. Weighted
   (speed-proportional) axes are uneven by design and never count as padding;
4. a split dim whose write accesses are not injective (different iterations write the
   same element, e.g. a scatter through a data-dependent index) is refused;
5. an opaque op (no loop nest) is replicate-only: nothing is known of its indexing;
6. a dim that indexes a temporary of the op differently where one statement writes it and
   another reads it (a recurrence ``h[t] <- h[t - 1]``, hidden units a recurrent matmul reads
   whole) is refused: a device would read, inside the op, what another device computes, and
   only the tensors between ops are resharded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

from polyparallel.ir import ANY, Graph, LoopNest, Op

from ._cache import CACHE, MISSING, signature_of
from ._isl import write_is_injective
from ._mesh import DeviceMesh

__all__ = [
    "IllegalPlacement",
    "Placement",
    "carried_dims",
    "check_placement",
    "dim_split_kind",
    "legal_placements",
    "padding_of",
]


class IllegalPlacement(ValueError):
    """A placement that an op cannot run under; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Block distribution of loop dims over mesh axes: ``((dim, (axis, ...)), ...)``, sorted by dim.

    Examples:
        >>> p = Placement.parse("n:tp,b:dp")
        >>> str(p), p.axes_of("n"), p.dim_of("dp")
        ('b:dp,n:tp', ('tp',), 'b')
        >>> Placement.of(s=("dp", "tp")) == Placement.parse("s:dp+tp")
        True
    """

    splits: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        norm = tuple(sorted((d, tuple(a)) for d, a in self.splits if a))
        object.__setattr__(self, "splits", norm)
        used = [a for _, axes in norm for a in axes]
        if len(set(used)) != len(used):
            raise IllegalPlacement(f"placement {self}: a mesh axis is used more than once "
                                   f"({sorted(a for a in used if used.count(a) > 1)}); each mesh axis "
                                   "may split at most one dim of an op")
        dims = [d for d, _ in norm]
        if len(set(dims)) != len(dims):
            raise IllegalPlacement(f"placement lists dim(s) twice: {dims}")

    @classmethod
    def of(cls, **splits: str | Iterable[str]) -> Placement:
        return cls(tuple((d, (a,) if isinstance(a, str) else tuple(a)) for d, a in splits.items()))

    @classmethod
    def parse(cls, text: str) -> Placement:
        text = text.strip()
        if text in ("", "R"):
            return cls()
        out = []
        for part in text.split(","):
            dim, sep, axes = part.partition(":")
            if not sep or not dim.strip() or not axes.strip():
                raise ValueError(f"placement {text!r}: expected DIM:AXIS[+AXIS...] items separated by ',', "
                                 f"got {part!r}")
            out.append((dim.strip(), tuple(a.strip() for a in axes.split("+"))))
        return cls(tuple(out))

    def refine(self, axis: str, factors: Iterable[str]) -> Placement:
        """This placement on a mesh whose ``axis`` is factorised (``DeviceMesh.factor``): the dim
        split over ``axis`` is split over all its factors, outermost first (the same blocks).

        Examples:
            >>> str(Placement.parse("b:dp,n:tp").refine("tp", ("tp_kv", "tp_q")))
            'b:dp,n:tp_kv+tp_q'
        """
        fs = tuple(factors)
        return Placement(tuple((d, tuple(x for a in axes for x in (fs if a == axis else (a,))))
                               for d, axes in self.splits))

    @property
    def mapping(self) -> dict[str, tuple[str, ...]]:
        return dict(self.splits)

    def axes_of(self, dim: str) -> tuple[str, ...]:
        for d, a in self.splits:
            if d == dim:
                return a
        return ()

    def dim_of(self, axis: str) -> str | None:
        for d, a in self.splits:
            if axis in a:
                return d
        return None

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.splits)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return tuple(a for _, axes in self.splits for a in axes)

    def __hash__(self) -> int:
        # equal placements have equal splits (``__eq__`` compares them): their hash, without the field tuple
        return hash(self.splits)

    def __str__(self) -> str:
        return ",".join(f"{d}:{'+'.join(a)}" for d, a in self.splits) or "R"

    def __repr__(self) -> str:
        return f"Placement({str(self)!r})"


def dim_split_kind(nest: LoopNest, dim: str) -> str:
    """``"parallel"``, ``"normalised"`` or ``"reduction"`` (see the module docstring)."""
    key = (id(nest), dim)
    hit = _KIND_MEMO.get(key)
    if hit is not None and hit[0] is nest:
        return hit[1]
    if len(_KIND_MEMO) > 100_000:
        _KIND_MEMO.clear()
    kind = _dim_split_kind(nest, dim)
    _KIND_MEMO[key] = (nest, kind)  # holding the nest keeps its id from being reused
    return kind


_KIND_MEMO: dict[tuple[int, str], tuple[LoopNest, str]] = {}


def _dim_split_kind(nest: LoopNest, dim: str) -> str:
    reduces_out = reduces_tmp = False
    for st in nest.statements:
        if dim in st.dims and dim in st.reduction_dims():
            if any(_is_output(w.operand) for w in st.writes):
                reduces_out = True
            else:
                reduces_tmp = True
    if reduces_out:
        return "reduction"
    return "normalised" if reduces_tmp else "parallel"


def _is_output(operand: str) -> bool:
    return operand.startswith("out") and operand[3:].isdigit()


@lru_cache(maxsize=4096)
def _non_injective_dims(nest: LoopNest) -> frozenset[str]:
    """Written dims along which iterations of different blocks can write the same element.

    A write that isl proves injective (on the written dims) is safe for every split; in a
    non-injective write (a scatter through ``ANY``, an index ``s + t``) a dim is still
    safe when some index is that dim alone, since blocks of it then write disjoint slices.
    """
    bad: set[str] = set()
    for si, st in enumerate(nest.statements):
        red = set(st.reduction_dims())
        for wi, w in enumerate(st.writes):
            if write_is_injective(nest, si, wi):
                continue
            alone = {e.terms[0][0] for e in w.index if e is not ANY and len(e.terms) == 1}
            bad.update(d for d in st.dims if d not in red and d not in alone)
    return frozenset(bad)


def carried_dims(nest: LoopNest) -> frozenset[str]:
    """Dims of rule 6: those in an index of a temporary that differs between a write and a read
    (attention scores, norm statistics are written and read at the same index: none)."""
    return _by_nest(_CARRIED_MEMO, nest, _carried_dims)


def _carried_dims(nest: LoopNest) -> frozenset[str]:
    out: set[str] = set()
    for tmp in nest.operands():
        if (tmp[:2] == "in" and tmp[2:].isdigit()) or _is_output(tmp):
            continue
        acc = list(nest.accesses(tmp))
        for _, w, w_is in acc:
            for _, r, r_is in acc:
                if w_is and not r_is:
                    for a, b in zip(w.index, r.index):
                        if a != b or a is ANY:
                            out.update(a.dims, b.dims)
    return frozenset(out)


def _non_injective_of(nest: LoopNest) -> frozenset[str]:
    return _by_nest(_INJECTIVE_MEMO, nest, _non_injective_dims)


_CARRIED_MEMO: dict[int, tuple[LoopNest, frozenset[str]]] = {}
_INJECTIVE_MEMO: dict[int, tuple[LoopNest, frozenset[str]]] = {}


def _by_nest(memo: dict[int, tuple[LoopNest, frozenset[str]]], nest: LoopNest,
             fn: Callable[[LoopNest], frozenset[str]]) -> frozenset[str]:
    """``fn(nest)`` memoised by the nest object: hashing a whole nest (an lru key) cost tens of
    microseconds, paid on every legality check of every placement."""
    hit = memo.get(id(nest))
    if hit is not None and hit[0] is nest:
        return hit[1]
    if len(memo) > 100_000:
        memo.clear()
    out = fn(nest)
    memo[id(nest)] = (nest, out)  # holding the nest keeps its id from being reused
    return out


def check_placement(nest: LoopNest | None, placement: Placement, mesh: DeviceMesh, *, op: str = "op",
                    uneven: str = "pad") -> None:
    """Raise :class:`IllegalPlacement` with the reason when ``placement`` is not legal."""
    if uneven not in ("pad", "refuse"):
        raise ValueError(f"uneven must be 'pad' or 'refuse', not {uneven!r}")
    key = (id(nest), placement, mesh, uneven)
    if nest is not None and _LEGAL_MEMO.get(key) is nest:
        return  # checked legal before (every batch re-checks its placements, once per operand)
    _check_placement(nest, placement, mesh, op, uneven)
    if nest is not None:
        if len(_LEGAL_MEMO) > 200_000:
            _LEGAL_MEMO.clear()
        _LEGAL_MEMO[key] = nest  # holding the nest keeps its id from being reused


_LEGAL_MEMO: dict[tuple, LoopNest] = {}  # legal (id(nest), placement, mesh, uneven) -> the nest


def _check_placement(nest: LoopNest | None, placement: Placement, mesh: DeviceMesh, op: str, uneven: str) -> None:
    for a in placement.mesh_axes:
        if a not in mesh.names:
            raise IllegalPlacement(f"{op}: placement {placement} uses mesh axis {a!r}, but the mesh {mesh} "
                                   f"has axes {list(mesh.names)}")
    if nest is None:
        if placement.splits:
            raise IllegalPlacement(f"{op} is opaque (no affine loop nest), so it can only be replicated; "
                                   f"placement {placement} splits {list(placement.dims)}")
        return
    bad_write = _non_injective_of(nest)
    carried = carried_dims(nest)
    for d, axes in placement.splits:
        if d not in nest.extents:
            raise IllegalPlacement(f"{op}: placement {placement} splits {d!r}, but the op's dims are "
                                   f"{list(nest.extents)}")
        n, k = nest.extents[d], mesh.group_size(axes)
        if k == 1:
            continue
        if n < k:
            raise IllegalPlacement(f"{op}: dim {d!r} has extent {n} but is split {k} ways over {list(axes)}; "
                                   "some devices would get no work (split fewer ways)")
        if d in bad_write:
            raise IllegalPlacement(f"{op}: dim {d!r} indexes a write that is not injective along it, so "
                                   "devices would write the same elements; keep it unsplit")
        if d in carried:
            raise IllegalPlacement(f"{op}: dim {d!r} indexes a temporary differently where it is written and "
                                   "where it is read (a recurrence over it, or a whole hidden state read): "
                                   "devices would read inside the op what others compute; keep it unsplit")
        if uneven == "refuse" and n % k and all(mesh.axis(a).even for a in axes):
            raise IllegalPlacement(f"{op}: dim {d!r} of extent {n} is not divisible by {k} "
                                   f"(uneven='refuse'); use uneven='pad' to accept padding")


def padding_of(nest: LoopNest | None, placement: Placement, mesh: DeviceMesh) -> dict[str, int]:
    """Padded elements along each unevenly split dim: ``k * max_block - N`` (even axes only)."""
    if nest is None:
        return {}
    # a function of the split dims' extents, the placement and the mesh: memoised per (nest, placement, mesh)
    key = (id(nest), placement, mesh)
    hit = _PAD_MEMO.get(key)
    if hit is None or hit[0] is not nest:
        if len(_PAD_MEMO) > 200_000:
            _PAD_MEMO.clear()
        hit = _PAD_MEMO[key] = (nest, _padding_of(nest, placement, mesh))  # the nest keeps its id unique
    return dict(hit[1])


_PAD_MEMO: dict[tuple, tuple[LoopNest, dict[str, int]]] = {}


def _padding_of(nest: LoopNest, placement: Placement, mesh: DeviceMesh) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, axes in placement.splits:
        if not all(mesh.axis(a).even for a in axes):
            continue
        n = nest.extents[d]
        lo, hi = mesh.bounds(n, axes)
        k = mesh.group_size(axes)
        pad = k * int((hi - lo).max()) - n
        if pad:
            out[d] = pad
    return out


def legal_placements(graph: Graph | None, op: Op | LoopNest | None, mesh: DeviceMesh, *, uneven: str = "pad",
                     max_split_dims: int | None = None) -> list[Placement]:
    """Every legal placement of ``op`` on ``mesh``, replicated first.

    Each mesh axis goes to one dim or to none; several axes on one dim keep the mesh
    order (outermost first), which fixes the device order without loss of generality.
    ``max_split_dims`` bounds how many dims may be split at once.
    """
    nest = op.nest if isinstance(op, Op) else op
    if nest is None:
        return [Placement()]
    sig = signature_of(graph, op) if graph is not None and isinstance(op, Op) else nest
    key = (sig, mesh, uneven, max_split_dims)
    hit = CACHE.hit("legal", key)
    if hit is not MISSING:
        return list(hit)
    return list(CACHE.get("legal", key, lambda: _legal(nest, mesh, uneven, max_split_dims)))


def _legal(nest: LoopNest, mesh: DeviceMesh, uneven: str, max_split_dims: int | None) -> tuple[Placement, ...]:
    choices = [None, *[d.name for d in nest.dims if d.extent > 1]]
    out: list[Placement] = []
    # every rule of the module docstring is a condition on one (dim, mesh axes) split (a mesh axis is used
    # once by construction): a placement is legal when each of its splits is, checked once per split
    split_ok: dict[tuple[str, tuple[str, ...]], bool] = {}
    for assign in itertools.product(choices, repeat=len(mesh.axes)):
        splits: dict[str, list[str]] = {}
        for ax, d in zip(mesh.names, assign):
            if d is not None and mesh.axis(ax).size > 1:
                splits.setdefault(d, []).append(ax)
        if max_split_dims is not None and len(splits) > max_split_dims:
            continue
        items = tuple((d, tuple(a)) for d, a in splits.items())
        ok = True
        for item in items:
            good = split_ok.get(item)
            if good is None:
                try:
                    _check_placement(nest, Placement((item,)), mesh, "op", uneven)
                    good = True
                except IllegalPlacement:
                    good = False
                split_ok[item] = good
            if not good:
                ok = False
                break
        if not ok:
            continue
        p = Placement(items)
        if len(_LEGAL_MEMO) > 200_000:
            _LEGAL_MEMO.clear()
        _LEGAL_MEMO[(id(nest), p, mesh, uneven)] = nest  # what check_placement records for a legal one
        out.append(p)
    return tuple(dict.fromkeys(out))

