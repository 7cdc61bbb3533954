"""Graph transforms between capture and planning: canonicalise and fuse.

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

What a graph's layers are — repeated blocks, the layer chain, balanced contiguous cuts —
describes a graph rather than rewriting it: :mod:`polyparallel.layers` (its names are
importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from polyparallel.ir import ANY, Access, AffineExpr, Dim, E, Graph, LoopNest, Op, OpKind, Statement, TensorKind
from polyparallel.layers import Block, Layer, Segment, balance, find_repeated_blocks, layer_chain, partition
from polyparallel.ops import CAST_TARGETS, COPY_TARGETS, DROPOUT_TARGETS

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
    elif name in CAST_TARGETS and len(op.inputs) == 1:
        return "cast to the same dtype"
    elif name in COPY_TARGETS and (len(op.inputs) == 1 or name.endswith("_as")):
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
