"""Graph transforms between capture and planning: canonicalise, fuse, find repeated blocks, balance.

Every transform takes a :class:`~polyparallel.ir.Graph` and returns a new one (or a
description of it); the input is never mutated. What a transform did is appended to
the graph's history (:func:`history`), a tuple of :class:`TransformRecord` s.

**Canonicalisation** (:func:`canonicalize`) drops no-ops and folds views (and the
outputs of splits, which are slices) into the accesses of their consumers. A view is a
copy statement ``out[W(v)] = in[R(v)]`` over view dims ``v``; a consumer reads the
view's output through ``A: D_c -> out``. Where ``W`` is the identity on the view dims
(permute, split-reshape, expand, slice, select, pad, split outputs) the consumer's new
access is ``R ∘ A``: substitute ``v_i := A_i`` in ``R``.
A merge-reshape writes one output axis as a mixed-radix sum ``W_i = Σ_j c_j v_j``; when
the consumer reads that axis by a single dim ``d`` of the same extent, ``d`` is split
into factors ``d = Σ_j c_j d_j`` (a bijection of boxes, so points and FLOPs are
unchanged) and ``v_j := d_j``.

Out-of-bounds reads are zero padding, so a fold is exact iff for every point ``p`` of
the consumer's statement ``R(A(p)) ∈ box(in) ⇒ A(p) ∈ box(out)``. It is checked axis by
axis: an axis that ``A`` keeps in bounds (interval arithmetic over the box of the
statement's dims) needs nothing; an axis ``i`` that may leave ``[0, n_i)`` must be
*guarded*: some input axis ``k`` reads ``R_k = v_i + c`` with ``c <= 0`` and
``n_i + c >= m_k`` (``m_k`` the input extent), so ``A_i`` out of range forces ``R_k`` out of
range. Permute and pad are guarded; slice and expand are not, and such views stay.

**Fusion** (:func:`fuse_elementwise`) appends an elementwise consumer's statement to
its producer's loop nest, writing through the producer's output access (renamed to a
temporary), so the cost model sees one memory pass and the summed FLOPs.

**Repeated blocks** (:func:`find_repeated_blocks`): with ``a`` the sequence of op
signatures, a tandem repeat of period ``p`` is a run of ``r`` consecutive positions
``i`` with ``a[i] = a[i + p]``; it covers ``⌊(r + p) / p⌋`` copies. The repeat with the
largest coverage (copies × p; ties: the smaller period) is taken. Its phase (any shift
within the run's slack) is chosen, in order, to agree with module-path layer
boundaries when present, to minimise the activations crossing instance boundaries
(layers meet at narrow cuts: the residual stream), then leftmost; and the search
recurses on what lies left and right of it. One numpy pass per period: O(n²)
elementary comparisons, vectorised.

**Balance** (:func:`balance`, :func:`partition`): split costs ``x_1..x_n >= 0`` into
``K`` contiguous non-empty parts minimising the largest part sum (exact DP; proof in
:func:`partition`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from polyparallel.ir import ANY, Access, AffineExpr, Dim, E, Graph, LoopNest, Op, OpKind, Statement, TensorKind
from polyparallel.ops import DROPOUT_TARGETS

__all__ = [
    "Block",
    "Layer",
    "Segment",
    "TransformRecord",
    "balance",
    "canonicalize",
    "find_repeated_blocks",
    "fuse_elementwise",
    "history",
    "layer_chain",
    "partition",
]

Index = AffineExpr | type(ANY)


# -- bookkeeping -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformRecord:
    """What one transform did to a graph.

    Args:
        transform: ``canonicalize`` or ``fuse_elementwise``.
        dropped: names of no-op ops removed (consumers rewired to their input).
        folded: names of view ops folded into all their consumers and removed.
        kept: ``(view op, reason)`` for views left in place (fully or for some consumers).
        fused: ``(fused op, absorbed op names)`` for each fusion.
        split_dims: how many consumer dims were split to absorb a merge-reshape.
    """

    transform: str
    dropped: tuple[str, ...] = ()
    folded: tuple[str, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    split_dims: int = 0

    def __str__(self) -> str:
        parts = [f"{self.transform}:"]
        if self.transform == "canonicalize":
            parts.append(f"dropped {len(self.dropped)} no-op(s), folded {len(self.folded)} view(s), "
                         f"kept {len(self.kept)} view(s), split {self.split_dims} dim(s)")
        else:
            parts.append(f"{len(self.fused)} fused op(s) absorbing "
                         f"{sum(len(a) for _, a in self.fused)} elementwise op(s)")
        return " ".join(parts)


def history(graph: Graph) -> tuple[TransformRecord, ...]:
    """The transforms applied to ``graph`` so far, oldest first."""
    return graph.__dict__.get("_transform_history", ())


def _derive(graph: Graph, ops: list[Op], outputs: Sequence[str], record: TransformRecord) -> Graph:
    """A new graph with ``ops``; keeps every non-activation tensor (parameters are never lost)."""
    used: set[str] = set(graph.inputs) | set(outputs)
    for op in ops:
        used.update(op.inputs)
        used.update(op.outputs)
    tensors = {n: t for n, t in graph.tensors.items() if n in used or t.kind is not TensorKind.ACTIVATION}
    g = Graph(name=graph.name, tensors=tensors, ops=ops, inputs=list(graph.inputs), outputs=list(outputs),
              source=graph.source, warnings=list(graph.warnings))
    g.__dict__["_transform_history"] = (*history(graph), record)
    g.validate()
    return g


def _short(target: str) -> str:
    """``aten.clone.default`` -> ``clone``; ``Identity`` -> ``identity``; ``relu_`` -> ``relu``."""
    parts = target.split(".")
    name = parts[parts.index("aten") + 1] if "aten" in parts[:-1] else parts[-1]
    if name in ("default", "Tensor", "Scalar") and len(parts) > 1:
        name = parts[-2]
    name = name.lower()
    return name.rstrip("_") or name


# -- canonicalisation: no-ops ------------------------------------------------------------------------

_COPY_TARGETS = frozenset({"identity", "clone", "contiguous", "alias", "detach", "lift_fresh_copy",
                           "lift_fresh", "copy", "view_as", "reshape_as", "expand_as"})
_CAST_TARGETS = frozenset({"_to_copy", "to", "cast", "type_as", "_to_dtype", "type", "float", "half",
                           "bfloat16", "double"})


def _is_identity_copy(op: Op) -> bool:
    """One zero-FLOP statement writing ``out0[i] = in0[i]`` (same index both sides)."""
    if op.nest is None or len(op.nest.statements) != 1:
        return False
    st = op.nest.statements[0]
    return (st.flops_per_point == 0 and len(st.reads) == 1 and len(st.writes) == 1
            and st.reads[0].operand == "in0" and st.writes[0].operand == "out0"
            and st.reads[0].index == st.writes[0].index and not st.constraints)


def _noop_reason(graph: Graph, op: Op) -> str | None:
    """Why ``op`` computes nothing (its single output equals its first input), or None."""
    if not op.outputs:
        return "has no outputs"
    if len(op.outputs) != 1 or not op.inputs:
        return None
    x, y = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
    if x.shape != y.shape or x.dtype != y.dtype:
        return None
    name = _short(op.target)
    attrs = op.attr
    if name in DROPOUT_TARGETS:
        p = attrs.get("p", attrs.get("ratio"))
        train = attrs.get("train", attrs.get("training", attrs.get("training_mode")))
        if p is not None and float(p) == 0.0:
            return "dropout with p=0"
        if train is not None and not train:
            return "dropout in eval mode"
    elif name in _CAST_TARGETS and len(op.inputs) == 1:
        return "cast to the same dtype"
    elif name in _COPY_TARGETS and (len(op.inputs) == 1 or name.endswith("_as")):
        return f"{name} is a copy"
    if op.kind is OpKind.VIEW and _is_identity_copy(op):
        return "view to the same shape"
    return None


def _drop_noops(graph: Graph) -> tuple[list[Op], list[str], list[str]]:
    alias: dict[str, str] = {}
    ops: list[Op] = []
    dropped: list[str] = []
    for op in graph.ops:
        inputs = tuple(alias.get(t, t) for t in op.inputs)
        op = replace(op, inputs=inputs) if inputs != op.inputs else op
        if _noop_reason(graph, op) is not None:
            if op.outputs:
                alias[op.outputs[0]] = op.inputs[0]
            dropped.append(op.name)
            continue
        ops.append(op)
    outputs = [alias.get(t, t) for t in graph.outputs]
    return ops, outputs, dropped


# -- canonicalisation: folding views -----------------------------------------------------------------


def _bounds(expr: AffineExpr, extents: Mapping[str, int]) -> tuple[int, int]:
    lo = hi = expr.const
    for d, c in expr.terms:
        span = c * (extents[d] - 1)
        lo, hi = (lo + span, hi) if c < 0 else (lo, hi + span)
    return lo, hi


def _mixed_radix(w: Index, extents: Mapping[str, int], size: int) -> tuple[tuple[str, int], ...] | None:
    """``W_i = Σ c_j v_j`` with ``c_last = 1``, ``c_j = c_{j+1}·ext(v_{j+1})``, ``Π ext = size``."""
    if w is ANY or w.const != 0:
        return None
    if not w.terms:
        return () if size == 1 else None  # a unit axis (unsqueeze)
    terms = sorted(w.terms, key=lambda t: -t[1])
    stride = 1
    for v, c in reversed(terms):
        if c != stride:
            return None
        stride *= extents[v]
    return tuple(terms) if stride == size else None


def _radix_match(a: Index, terms: Sequence[tuple[str, int]], vext: Mapping[str, int],
                 cext: Mapping[str, int]) -> list[str] | None:
    """The consumer dims of ``a`` when it is the same mixed-radix sum as ``W_i = terms``.

    This happens when an earlier fold already split the consumer's dim the same way
    (e.g. the kv-head x group axis of grouped-query attention read by two operands).
    """
    if a is ANY or a.const != 0 or len(a.terms) != len(terms):
        return None
    mine = sorted(a.terms, key=lambda t: -t[1])
    if all(c == k and cext[d] == vext[v] for (d, c), (v, k) in zip(mine, terms)):
        return [d for d, _ in mine]
    return None


class _NoFold(Exception):
    """A view cannot be folded exactly into a consumer; the message says why."""


@dataclass
class _ViewMap:
    """One output of a view (or split) op: a copy statement ``out_j[W(v)] = in_i[R(v)]``."""

    read: tuple[Index, ...]
    axes: tuple[tuple[tuple[str, int], ...], ...]  # per output axis: the mixed-radix terms of W_i
    extents: dict[str, int]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    src: str  # the graph tensor read
    out: str  # the graph tensor written

    @staticmethod
    def of(graph: Graph, op: Op, j: int) -> _ViewMap:
        nest = op.nest
        writers = [st for st in nest.statements if any(w.operand == f"out{j}" for w in st.writes)] if nest else []
        if len(writers) != 1:
            raise _NoFold("output not written by a single copy statement")
        st = writers[0]
        # extra inputs (an ONNX Reshape's shape tensor) are fine as long as the nest ignores them
        src = op.operand_name(st.reads[0].operand) if len(st.reads) == 1 else None
        if (src is None or not st.reads[0].operand.startswith("in") or len(st.writes) != 1
                or st.constraints or st.flops_per_point != 0):
            raise _NoFold("output not written by a single copy statement")
        ext = {d: nest.dim(d).extent for d in st.dims}
        out_shape = graph.shape(op.outputs[j])
        axes, used = [], []
        for w, n in zip(st.writes[0].index, out_shape):
            terms = _mixed_radix(w, ext, n)
            if terms is None:
                raise _NoFold(f"output index {w} is not a mixed-radix sum of view dims")
            axes.append(terms)
            used += [v for v, _ in terms]
        if sorted(used) != sorted(st.dims):
            raise _NoFold("view dims are not written exactly once")
        return _ViewMap(st.reads[0].index, tuple(axes), ext, graph.shape(src), out_shape, src, op.outputs[j])

    def compose(self, acc: Access, extents: Mapping[str, int], split: Mapping[str, tuple[str, ...]],
                sub: Mapping[str, AffineExpr]) -> Access:
        """``R ∘ A`` for a consumer access ``A`` (given on the consumer's original dims)."""
        sigma: dict[str, Index] = {}
        oob: list[int] = []
        for i, (a, terms) in enumerate(zip(acc.index, self.axes)):
            if len(terms) <= 1:
                if terms:
                    sigma[terms[0][0]] = a if a is ANY else a.rename(sub)
                if a is not ANY:
                    lo, hi = _bounds(a, extents)
                    if lo < 0 or hi >= self.out_shape[i]:
                        oob.append(i)
            elif (same := _radix_match(a, terms, self.extents, extents)) is not None:
                for (v, _), dj in zip(terms, same):
                    sigma[v] = E(dj).rename(sub)
            else:
                d = a.terms[0][0]
                for (v, _), dj in zip(terms, split[d]):
                    sigma[v] = E(dj)
        for i in oob:
            v = self.axes[i][0][0] if self.axes[i] else None
            guarded = v is not None and any(r is not ANY and r.terms == ((v, 1),) and r.const <= 0
                          and self.out_shape[i] + r.const >= m for r, m in zip(self.read, self.in_shape))
            if not guarded:
                raise _NoFold(f"consumer access {acc} may read outside axis {i} (zero padding) "
                              "where the view's input has data")
        index: list[Index] = []
        for k, r in enumerate(self.read):
            if r is ANY:
                index.append(ANY)
                continue
            if any(sigma[v] is ANY for v in r.dims):
                v = r.dims[0]
                i = next(i for i, t in enumerate(self.axes) if t and t[0][0] == v)
                if r.terms != ((v, 1),) or r.const != 0 or self.in_shape[k] != self.out_shape[i]:
                    raise _NoFold(f"data-dependent index on axis {i} would widen to a larger input axis")
                index.append(ANY)
                continue
            index.append(r.rename({v: sigma[v] for v in r.dims}))
        return Access(acc.operand, tuple(index))


def _fold_view(vm: _ViewMap, cons: Op, counter: list[int]) -> Op:
    """The consumer reading the view's input directly; raises _NoFold when not exact."""
    if cons.nest is None:
        raise _NoFold(f"consumer {cons.name} is opaque")
    operands = {f"in{i}" for i, t in enumerate(cons.inputs) if t == vm.out}
    nest = cons.nest
    factors: dict[str, tuple[int, ...]] = {}
    for st in nest.statements:
        for acc in st.writes:
            if acc.operand in operands:
                raise _NoFold(f"consumer {cons.name} writes its input")
        for acc in st.reads:
            if acc.operand not in operands:
                continue
            if len(acc.index) != len(vm.axes):
                raise _NoFold(f"consumer {cons.name} reads {acc} with the wrong rank")
            for a, terms in zip(acc.index, vm.axes):
                if len(terms) <= 1 or _radix_match(a, terms, vm.extents, nest.extents) is not None:
                    continue
                size = math.prod(vm.extents[v] for v, _ in terms)
                if (a is ANY or a.const != 0 or len(a.terms) != 1 or a.terms[0][1] != 1
                        or nest.dim(a.terms[0][0]).extent != size):
                    raise _NoFold(f"merged axis read as {a} by {cons.name}, not by one dim of extent {size}")
                f = tuple(vm.extents[v] for v, _ in terms)
                if factors.setdefault(a.terms[0][0], f) != f:
                    raise _NoFold(f"dim {a.terms[0][0]} of {cons.name} would be split two ways")
    names = {d.name for d in nest.dims}
    split: dict[str, tuple[str, ...]] = {}
    for d, f in factors.items():
        new = []
        for j in range(len(f)):
            nm = f"{d}_{j}"
            while nm in names:
                nm += "_"
            names.add(nm)
            new.append(nm)
        split[d] = tuple(new)
    sub: dict[str, AffineExpr] = {}
    for d, f in factors.items():
        expr, stride = AffineExpr(), 1
        for nm, e in reversed(list(zip(split[d], f))):
            expr, stride = expr + E(nm) * stride, stride * e
        sub[d] = expr

    def ren(acc: Access) -> Access:
        return Access(acc.operand, tuple(x if x is ANY else x.rename(sub) for x in acc.index))

    sts = []
    for st in nest.statements:
        ext = {d: nest.dim(d).extent for d in st.dims}
        reads = tuple(vm.compose(a, ext, split, sub) if a.operand in operands else ren(a) for a in st.reads)
        dims = tuple(x for d in st.dims for x in split.get(d, (d,)))
        sts.append(replace(st, dims=dims, reads=reads, writes=tuple(ren(a) for a in st.writes),
                           constraints=tuple(c.rename(sub) for c in st.constraints)))
    dims = tuple(Dim(nm, e, d.role, d.hint) if d.name in split else d
                 for d in nest.dims for nm, e in zip(split.get(d.name, (d.name,)), factors.get(d.name, (d.extent,))))
    counter[0] += len(split)
    inputs = tuple(vm.src if t == vm.out else t for t in cons.inputs)
    return replace(cons, inputs=inputs, nest=LoopNest(dims, tuple(sts)))


def canonicalize(graph: Graph) -> Graph:
    """A canonical copy of ``graph``: no-ops dropped, views folded into consumers where exact.

    Dropped (consumers rewired to the op's input): ops without outputs (``_assert_*``),
    identity / clone / contiguous / alias / detach copies, dropout with ``p = 0`` or in
    eval mode (when the op's attributes say so), casts to the same dtype, and views to
    the same shape whose copy is the identity. Each output of a view or split op is
    then folded into every consumer for which the composition is exact (module
    docstring); the op is removed once no consumer reads any of its outputs and none is
    a graph output. FLOPs of the remaining ops
    and parameter tensors are unchanged.

    Examples:
        A transpose feeding a matmul disappears into the matmul's access:

        >>> from polyparallel import ops
        >>> from polyparallel.frontends import GraphBuilder
        >>> b = GraphBuilder("t", "doc")
        >>> x = b.tensor("x", (8, 4), kind=TensorKind.INPUT); b.graph.inputs.append(x)
        >>> w = b.tensor("w", (8, 6), kind=TensorKind.PARAM)
        >>> xt, y = b.tensor("xt", (4, 8)), b.tensor("y", (4, 6))
        >>> _ = b.op("t", OpKind.VIEW, "aten.t", [x], [xt], lambda: ops.transpose((8, 4), 0, 1))
        >>> _ = b.op("mm", OpKind.CONTRACTION, "aten.mm", [xt, w], [y], lambda: ops.matmul((4, 8), (8, 6)))
        >>> b.graph.outputs.append(y)
        >>> g = canonicalize(b.finish())
        >>> [op.name for op in g.ops], str(g.ops[0].nest.statements[0].reads[0])
        (['mm'], 'in0[k, m]')
        >>> print(history(g)[-1])
        canonicalize: dropped 0 no-op(s), folded 1 view(s), kept 0 view(s), split 0 dim(s)
    """
    ops, outputs, dropped = _drop_noops(graph)
    by_name = {op.name: op for op in ops}
    order = {op.name: i for i, op in enumerate(ops)}
    consumers: dict[str, list[str]] = {}
    for op in ops:
        for t in dict.fromkeys(op.inputs):
            consumers.setdefault(t, []).append(op.name)
    folded: list[str] = []
    kept: list[tuple[str, str]] = []
    counter = [0]
    for name in list(by_name):
        view = by_name[name]
        if view.kind not in (OpKind.VIEW, OpKind.SPLIT):
            continue
        why, live = "", False
        for j, out in enumerate(view.outputs):
            try:
                vm = _ViewMap.of(graph, view, j)
            except _NoFold as e:
                why, live = why or str(e), True
                continue
            remaining = []
            for cname in consumers.get(out, []):
                try:
                    new = _fold_view(vm, by_name[cname], counter)
                except _NoFold as e:
                    remaining.append(cname)
                    why = why or str(e)
                    continue
                by_name[cname] = new
                if cname not in consumers.setdefault(vm.src, []):
                    consumers[vm.src].append(cname)
            consumers[out] = remaining
            if out in outputs:
                why = why or "its output is a graph output"
            live = live or bool(remaining) or out in outputs
        if live:
            kept.append((name, why))
        else:
            folded.append(name)
            del by_name[name]
            for t in view.inputs:
                consumers[t] = [c for c in consumers.get(t, []) if c != name]
    new_ops = sorted(by_name.values(), key=lambda o: order[o.name])
    rec = TransformRecord("canonicalize", dropped=tuple(dropped), folded=tuple(folded), kept=tuple(kept),
                          split_dims=counter[0])
    return _derive(graph, new_ops, outputs, rec)


# -- fusion ------------------------------------------------------------------------------------------

_FUSE_INTO = frozenset({OpKind.CONTRACTION, OpKind.CONV, OpKind.POOL, OpKind.NORM, OpKind.SOFTMAX,
                        OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.ELEMENTWISE, OpKind.REDUCE,
                        OpKind.GATHER})


def _match(a: Sequence[Index], b: Sequence[Index], ea: Mapping[str, int],
           eb: Mapping[str, int]) -> dict[str, str] | None:
    """A bijective renaming of ``a``'s dims onto ``b``'s making the indices equal, else None.

    Terms pair up by (coefficient, extent); ties are refused rather than guessed.
    """
    if len(a) != len(b):
        return None
    mu: dict[str, str] = {}
    for x, y in zip(a, b):
        if x is ANY or y is ANY or x.const != y.const or len(x.terms) != len(y.terms):
            return None
        kx = sorted((c, ea[d], d) for d, c in x.terms)
        ky = sorted((c, eb[d], d) for d, c in y.terms)
        if len({k[:2] for k in kx}) != len(kx):
            return None
        for (cx, ex, dx), (cy, ey, dy) in zip(kx, ky):
            if (cx, ex) != (cy, ey) or mu.setdefault(dx, dy) != dy:
                return None
    return mu if len(set(mu.values())) == len(mu) else None


def _fuse_pair(graph: Graph, p: Op, c: Op) -> Op | None:
    """``c`` (elementwise) appended to producer ``p``'s nest, or None when not a clean fusion."""
    t = p.outputs[0]
    if p.nest is None or c.nest is None or len(c.nest.statements) != 1 or len(c.outputs) != 1:
        return None
    writes = [a.index for _, a, w in p.nest.accesses("out0") if w]
    if not writes or any(w != writes[0] for w in writes):
        return None
    st = c.nest.statements[0]
    if len(st.writes) != 1 or st.constraints or ANY in st.writes[0].index:
        return None
    tpos = {f"in{i}" for i, x in enumerate(c.inputs) if x == t}
    treads = {a.index for a in st.reads if a.operand in tpos}
    if len(treads) != 1:
        return None
    ext_c = {d: c.nest.dim(d).extent for d in st.dims}
    ext_p = {d: p.nest.dim(d).extent for d in p.nest.extents}
    mu = _match(next(iter(treads)), writes[0], ext_c, ext_p)
    written = {d for x in writes[0] for d in x.dims}
    if mu is None or set(mu) != set(st.dims) or set(mu.values()) != written:
        return None
    temps = set(p.nest.operands())
    k = 0
    while f"fused{k}" in temps:
        k += 1
    temp = f"fused{k}"
    sub = {cd: E(pd) for cd, pd in mu.items()}
    new_pos: dict[str, str] = {}
    extra: list[str] = []
    for i, x in enumerate(c.inputs):
        if x == t:
            new_pos[f"in{i}"] = temp
        else:
            new_pos[f"in{i}"] = f"in{len(p.inputs) + len(extra)}"
            extra.append(x)

    def ren(a: Access, operand: str) -> Access:
        return Access(operand, tuple(x if x is ANY else x.rename(sub) for x in a.index))

    pst = [replace(s, reads=tuple(Access(temp, a.index) if a.operand == "out0" else a for a in s.reads),
                   writes=tuple(Access(temp, a.index) if a.operand == "out0" else a for a in s.writes))
           for s in p.nest.statements]
    cst = Statement(f"{_short(c.target)}.{st.name}", tuple(mu[d] for d in st.dims),
                    reads=tuple(ren(a, new_pos[a.operand]) for a in st.reads),
                    writes=(ren(st.writes[0], "out0"),), flops_per_point=st.flops_per_point)
    attrs = dict(p.attrs)
    attrs["fused"] = (*attrs.get("fused", ()), c.target)
    return replace(p, inputs=(*p.inputs, *extra), outputs=c.outputs, nest=LoopNest(p.nest.dims, (*pst, cst)),
                   attrs=tuple(sorted(attrs.items())))


def fuse_elementwise(graph: Graph) -> Graph:
    """Fuse chains of elementwise ops into their producer, for costing.

    An elementwise op ``c`` is absorbed by the producer ``p`` of one of its inputs ``t``
    when ``t`` has no other reader and is not a graph output, ``p`` writes ``t`` through one
    index ``W`` (all its writes agree, e.g. ``out0[b, s, n]`` of a linear) and ``c``
    reads ``t`` at an index that a bijective renaming
    ``μ`` of ``c``'s dims onto ``W``'s dims turns into ``W`` (so ``c``'s domain is ``p``'s
    written points, one each). The fused op keeps ``p``'s dims
    and statements (``t`` becomes the temporary ``fusedK``) plus ``c``'s statement mapped
    onto ``p``'s dims, so FLOPs add up and ``t`` never reaches memory. The fused op sits
    at ``c``'s position (``c``'s other inputs may be produced after ``p``); its attribute
    ``fused`` lists the absorbed targets (part of the signature, so identical layers
    stay identical) and :func:`history` the absorbed op names.
    """
    ops: list[Op | None] = list(graph.ops)
    producer = {t: i for i, op in enumerate(ops) for t in op.outputs}
    readers: dict[str, int] = {}
    for op in ops:
        for t in set(op.inputs):
            readers[t] = readers.get(t, 0) + 1
    absorbed: dict[int, tuple[str, ...]] = {}
    outs = set(graph.outputs)
    for ci, c in enumerate(list(ops)):
        if c is None or c.kind is not OpKind.ELEMENTWISE or c.nest is None:
            continue
        for t in dict.fromkeys(c.inputs):
            pi = producer.get(t)
            p = ops[pi] if pi is not None else None
            if p is None or p.kind not in _FUSE_INTO or len(p.outputs) != 1 or readers[t] != 1 or t in outs:
                continue
            fused = _fuse_pair(graph, p, c)
            if fused is None:
                continue
            ops[pi], ops[ci] = None, fused
            absorbed[ci] = (*absorbed.pop(pi, ()), c.name)
            for x in fused.outputs:
                producer[x] = ci
            break
    new_ops = [op for op in ops if op is not None]
    rec = TransformRecord("fuse_elementwise",
                          fused=tuple((ops[i].name, a) for i, a in sorted(absorbed.items())))
    return _derive(graph, new_ops, graph.outputs, rec)


# -- repeated blocks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """``count`` consecutive copies of the same op sequence (identical signatures).

    Instance ``m`` spans ops ``start + m*length`` to ``start + (m+1)*length`` (exclusive)
    of the graph's op list; ``key`` is a hash of the signature sequence, equal for blocks
    with identical contents, so later stages price one instance per key.
    """

    start: int
    length: int
    count: int
    key: str

    @property
    def stop(self) -> int:
        return self.start + self.length * self.count

    @property
    def instances(self) -> tuple[range, ...]:
        return tuple(range(self.start + m * self.length, self.start + (m + 1) * self.length)
                     for m in range(self.count))

    @property
    def representative(self) -> range:
        return self.instances[0]

    def ops(self, graph: Graph, instance: int = 0) -> list[Op]:
        return [graph.ops[i] for i in self.instances[instance]]

    def __str__(self) -> str:
        return f"Block(ops {self.start}..{self.stop}: {self.count} x {self.length} ops, key {self.key[:8]})"


_LAYER_RE = re.compile(r"^(.*?\.\d+)(\.|$)")


def _layer_of(module: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``: the first numbered component."""
    m = _LAYER_RE.match(module)
    return m.group(1) if m else module


def _module_layers(graph: Graph) -> list[str]:
    """Layer prefix per op; ops without a module path inherit the previous op's."""
    out, last = [], ""
    for op in graph.ops:
        last = _layer_of(op.module) if op.module else last
        out.append(last)
    return out


def _cut_widths(graph: Graph, *, nbytes: bool = False) -> np.ndarray:
    """``width[b]``: activations (their count, or bytes) produced before op ``b`` and read at or after it."""
    width = np.zeros(len(graph.ops) + 2, dtype=np.int64)
    made = {t: i for i, op in enumerate(graph.ops) for t in op.outputs}
    last: dict[str, int] = {}
    for j, op in enumerate(graph.ops):
        for t in op.inputs:
            if t in made:
                last[t] = j
    for t, j in last.items():
        w = graph.tensors[t].nbytes if nbytes else 1
        width[made[t] + 1] += w
        width[j + 1] -= w
    return np.cumsum(width)


def _seq_key(sigs: Sequence[str]) -> str:
    return hashlib.blake2b("\n".join(sigs).encode(), digest_size=12).hexdigest()


def _best_repeat(a: np.ndarray, lo: int, hi: int, min_length: int,
                 min_count: int) -> tuple[int, int, int, int] | None:
    """(start, period, run, coverage) of the largest-coverage tandem repeat inside ``a[lo:hi]``."""
    best: tuple[int, int, int, int] | None = None
    n = hi - lo
    for p in range(max(1, min_length), n // min_count + 1):
        eq = a[lo:hi - p] == a[lo + p:hi]
        edges = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            continue
        runs = ends - starts
        cover = ((runs + p) // p) * p
        cover[(runs + p) // p < min_count] = 0
        j = int(np.argmax(cover))
        if cover[j] and (best is None or cover[j] > best[3]):
            best = (lo + int(starts[j]), p, int(runs[j]), int(cover[j]))
    return best


_ANCHORS = frozenset({OpKind.CONTRACTION, OpKind.CONV, OpKind.ATTENTION, OpKind.NORM, OpKind.EMBEDDING,
                      OpKind.POOL, OpKind.SOFTMAX, OpKind.LOSS, OpKind.OPAQUE})


def find_repeated_blocks(graph: Graph, *, min_length: int = 2, min_count: int = 2,
                         anchors: Iterable[OpKind] = _ANCHORS) -> list[Block]:
    """Maximal runs of identical consecutive op sequences (e.g. the N decoder layers of a GPT).

    Signature-sequence repetition (module docstring) finds the blocks without module
    paths; where ops carry them (``transformer.h.3.attn``), the phase of a repeat is the
    one whose instance boundaries coincide with changes of the numbered layer prefix.
    Blocks shorter than ``min_length`` ops or with fewer than ``min_count`` copies are not
    reported, nor blocks without an op of a kind in ``anchors`` (repeats of shape
    plumbing, e.g. the mask-building ops of a GPT prologue, are not layers). Returned
    sorted by start; blocks never overlap.

    Examples:
        Four identical linear-relu layers (the first reads the graph input, which
        makes its signature differ, so a negation comes first):

        >>> from polyparallel import ops
        >>> from polyparallel.frontends import GraphBuilder
        >>> b = GraphBuilder("mlp", "doc")
        >>> x = b.tensor("x", (2, 8), kind=TensorKind.INPUT); b.graph.inputs.append(x)
        >>> ew = lambda: ops.elementwise((2, 8), [(2, 8)])
        >>> _ = b.op("neg", OpKind.ELEMENTWISE, "aten.neg", [x], [b.tensor("x1", (2, 8))], ew)
        >>> x = "x1"
        >>> for i in range(4):
        ...     w = b.tensor(f"w{i}", (8, 8), kind=TensorKind.PARAM)
        ...     h, y = b.tensor(f"h{i}", (2, 8)), b.tensor(f"y{i}", (2, 8))
        ...     _ = b.op("fc", OpKind.CONTRACTION, "aten.linear", [x, w], [h], lambda: ops.linear((2, 8), (8, 8)))
        ...     _ = b.op("relu", OpKind.ELEMENTWISE, "aten.relu", [h], [y], ew)
        ...     x = y
        >>> b.graph.outputs.append(x)
        >>> [(blk.start, blk.length, blk.count) for blk in find_repeated_blocks(b.finish())]
        [(1, 2, 4)]
    """
    sigs = [graph.signature(op) for op in graph.ops]
    codes: dict[str, int] = {}
    a = np.array([codes.setdefault(s, len(codes)) for s in sigs], dtype=np.int64)
    anchors = frozenset(anchors)
    layers = _module_layers(graph)
    width = _cut_widths(graph)
    has_modules = any(op.module for op in graph.ops)
    blocks: list[Block] = []
    todo = [(0, len(a))]
    while todo:
        lo, hi = todo.pop()
        found = _best_repeat(a, lo, hi, min_length, min_count) if hi - lo >= min_length * min_count else None
        if found is None:
            continue
        s0, p, run, cover = found
        count = cover // p
        slack = run + p - cover

        def score(o: int, s0: int = s0, p: int = p, count: int = count) -> tuple[int, int, int]:
            bounds = [b for b in (s0 + o + m * p for m in range(count + 1)) if 0 < b < len(a)]
            agree = sum(1 for b in bounds if layers[b - 1] != layers[b]) if has_modules else 0
            return agree, -sum(int(width[b]) for b in bounds), -o

        o = max(range(slack + 1), key=score)
        start = s0 + o
        if any(graph.ops[i].kind in anchors for i in range(start, start + p)):
            blocks.append(Block(start, p, count, _seq_key(sigs[start:start + p])))
        todo += [(lo, start), (start + cover, hi)]
    return sorted(blocks, key=lambda b: b.start)


# -- balancing ---------------------------------------------------------------------------------------


def partition(costs: Sequence[float], k: int) -> tuple[tuple[int, ...], float]:
    """Split ``costs`` into ``k`` contiguous non-empty parts minimising the largest part sum.

    Returns the ``k + 1`` boundaries ``0 = c_0 < c_1 < ... < c_k = n`` and the optimum.

    Exact dynamic programme. With prefix sums ``S_i`` and ``F_j(i)`` the optimum for the
    first ``i`` items in ``j`` parts,

        ``F_1(i) = S_i``,  ``F_j(i) = min_{j-1 <= t <= i-1} max(F_{j-1}(t), S_i - S_t)``.

    Optimality of the recursion: the last part of an optimal ``j``-partition of the
    first ``i`` items is some ``(t, i]``; the remaining items are ``j - 1`` parts whose
    largest sum is at least ``F_{j-1}(t)``, and any optimal ``(j-1)``-partition of them
    can be substituted, so the minimum over ``t`` is attained.

    Speed: costs are >= 0, so ``F_{j-1}`` is non-decreasing in ``t >= j - 1``: from an
    optimal partition of ``t + 1`` items drop the last item, or, if it is alone in its
    part, split some other part of two or more items in two — neither raises the largest
    part sum. And ``S_i - S_t`` is
    non-increasing. ``max`` of the two is therefore minimised where they cross: at the
    first ``t*`` with ``F_{j-1}(t*) + S_{t*} >= S_i`` — found by binary search because
    ``F_{j-1}(t) + S_t`` is non-decreasing — or at ``t* - 1``; clipping ``t*`` to the
    feasible range keeps this true (the function is monotone on either side). Every
    ``i`` is solved at once with ``numpy.searchsorted``: O(k · n log n).

    Examples:
        >>> partition([1, 2, 3, 4, 5], 2)
        ((0, 3, 5), 9.0)
    """
    x = np.asarray(costs, dtype=np.float64)
    n = len(x)
    if k < 1 or k > n:
        raise ValueError(f"cannot split {n} item(s) into {k} non-empty part(s); use 1 <= parts <= {n}")
    if not np.all(np.isfinite(x)) or (n and x.min() < 0):
        raise ValueError("costs must be finite and non-negative")
    S = np.concatenate(([0.0], np.cumsum(x)))
    F = S.copy()  # F_1(i) = S_i
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    i = np.arange(n + 1)
    for j in range(2, k + 1):
        h = F + S  # non-decreasing in t on the feasible range t >= j - 1
        h[: j - 1] = -np.inf  # infeasible t: keep h sorted; they are clipped away below
        t = np.searchsorted(h, S, side="left")
        lo, hi = j - 1, np.maximum(i - 1, j - 1)
        best_val = np.full(n + 1, np.inf)
        best_t = np.zeros(n + 1, dtype=np.int64)
        for cand in (np.clip(t, lo, hi), np.clip(t - 1, lo, hi)):
            val = np.maximum(F[cand], S - S[cand])
            better = val < best_val
            best_val = np.where(better, val, best_val)
            best_t = np.where(better, cand, best_t)
        best_val[:j] = np.inf  # fewer items than parts
        F, arg[j] = best_val, best_t
    cuts = [n]
    for j in range(k, 1, -1):
        cuts.append(int(arg[j][cuts[-1]]))
    cuts.append(0)
    return tuple(reversed(cuts)), float(F[n])


@dataclass(frozen=True)
class Segment:
    """Ops ``start..stop`` (exclusive) of the graph's op list, and their total cost.

    ``out_bytes``: bytes of the activations made before ``stop`` and read at or after it
    — what a pipeline stage ending here sends forward (and receives as gradients).
    """

    start: int
    stop: int
    cost: float
    out_bytes: int = 0

    def ops(self, graph: Graph) -> list[Op]:
        return graph.ops[self.start:self.stop]


def _block_cuts(n: int, blocks: Iterable[Block]) -> list[int]:
    """Cut positions that do not split a block instance: 0..n minus the insides of instances."""
    inside = set()
    for b in blocks:
        for r in b.instances:
            inside.update(range(r.start + 1, r.stop))
    return [i for i in range(n + 1) if i not in inside]


def _costs(graph: Graph, cost: Callable[[Op], float]) -> np.ndarray:
    out = np.empty(len(graph.ops))
    for i, op in enumerate(graph.ops):
        c = float(cost(op))
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of op {op.name!r} is {c}; costs must be finite and >= 0")
        out[i] = c
    return out


def balance(graph: Graph, num_segments: int, cost: Callable[[Op], float], *,
            blocks: Sequence[Block] | None = None, tolerance: float = 0.05) -> list[Segment]:
    """Split the op chain into ``num_segments`` contiguous segments of near-equal cost.

    Two exact min-max partitions (:func:`partition`) are computed: over single ops, with
    optimum ``B_op``, and over *atoms* — whole block instances and the single ops outside
    blocks — with optimum ``B_blk >= B_op``. Cuts at block boundaries are preferred: the
    atom partition is returned when ``B_blk <= (1 + tolerance)·B_op``, else the op one.
    Either way the result is optimal for its granularity; ``tolerance=0`` returns an
    op-level optimum, preferring block cuts only on ties.

    Args:
        graph: ops in topological order.
        num_segments: pipeline stages, ``1 <= num_segments <= len(graph.ops)``.
        cost: cost of one op (seconds, FLOPs...), finite and >= 0.
        blocks: repeated blocks (default :func:`find_repeated_blocks`).
        tolerance: how much worse than the op-level optimum block cuts may be.
    """
    n = len(graph.ops)
    if not 1 <= num_segments <= n:
        raise ValueError(f"cannot balance {n} op(s) of {graph.name!r} into {num_segments} segment(s); "
                         f"use between 1 and {n}")
    x = _costs(graph, cost)
    S = np.concatenate(([0.0], np.cumsum(x)))
    cuts, best = partition(x, num_segments)
    if blocks is None:
        blocks = find_repeated_blocks(graph)
    atoms = _block_cuts(n, blocks)
    if blocks and len(atoms) - 1 >= num_segments:
        acuts, abest = partition(np.diff(S[atoms]), num_segments)
        if abest <= best * (1 + tolerance):
            cuts = tuple(atoms[c] for c in acuts)
    cut = _cut_widths(graph, nbytes=True)
    return [Segment(a, b, float(S[b] - S[a]), int(cut[b])) for a, b in itertools.pairwise(cuts)]


@dataclass(frozen=True)
class Layer:
    """One link of the layer chain: ops ``start..stop`` (exclusive).

    ``key`` hashes the link's signature sequence: links with equal keys compute the same
    thing on the same shapes (the instances of a repeated block), so a planner prices one
    per key. ``block``/``instance`` locate a block instance in the blocks list used.
    ``out_bytes``: bytes of the activations crossing the boundary after the link (as in
    :class:`Segment`), the point-to-point volume if a pipeline cut is placed there.
    """

    start: int
    stop: int
    key: str
    cost: float
    out_bytes: int = 0
    block: int | None = None
    instance: int | None = None

    def ops(self, graph: Graph) -> list[Op]:
        return graph.ops[self.start:self.stop]


def layer_chain(graph: Graph, cost: Callable[[Op], float] | None = None, *,
                blocks: Sequence[Block] | None = None, target_layers: int = 16) -> list[Layer]:
    """The op chain as a sequence of layers for pipeline and per-layer search.

    Each instance of a repeated block is one layer; the ops between blocks (embedding,
    head) form layers too, split by :func:`partition` into pieces of about one block
    instance's cost (the median), or of ``total / target_layers`` when the graph has no
    repeated blocks, so no link dwarfs the others. ``cost`` defaults to FLOPs plus bytes
    moved (bytes keep zero-FLOP ops from being free).
    """
    n = len(graph.ops)
    if n == 0:
        return []
    cost = cost or (lambda op: float(op.flops + graph.op_bytes(op)))
    x = _costs(graph, cost)
    S = np.concatenate(([0.0], np.cumsum(x)))
    sigs = [graph.signature(op) for op in graph.ops]
    if blocks is None:
        blocks = find_repeated_blocks(graph)
    inst = sorted(((r.start, r.stop, bi, m) for bi, b in enumerate(blocks) for m, r in enumerate(b.instances)))
    unit = (float(np.median([S[b] - S[a] for a, b, _, _ in inst])) if inst
            else float(S[n]) / max(1, min(target_layers, n)))
    cut = _cut_widths(graph, nbytes=True)
    out: list[Layer] = []

    def gap(a: int, b: int) -> None:
        if a >= b:
            return
        pieces = 1 if unit <= 0 else min(b - a, max(1, round(float(S[b] - S[a]) / unit)))
        cuts, _ = partition(x[a:b], pieces)
        for u, v in itertools.pairwise(cuts):
            out.append(Layer(a + u, a + v, _seq_key(sigs[a + u:a + v]), float(S[a + v] - S[a + u]),
                             int(cut[a + v])))

    pos = 0
    for a, b, bi, m in inst:
        gap(pos, a)
        out.append(Layer(a, b, blocks[bi].key, float(S[b] - S[a]), int(cut[b]), bi, m))
        pos = b
    gap(pos, n)
    return out
