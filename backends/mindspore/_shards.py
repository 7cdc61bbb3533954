"""Per-operator MindSpore shard strategies from a Strategy's per-op placements.

A placement splits loop dims of an op over mesh axes (``"b:dp,n:tp"``). MindSpore's semi-automatic
parallelism takes, for every primitive, one tuple per input: how many blocks each tensor dim is cut
into (``MatMul.shard(((4, 1), (2, 1)))``). The tuple of an operand follows from the op's access
``operand[e_0, ..., e_{r-1}]``: tensor dim ``i`` is cut into ``∏ |axes(d)|`` blocks for the split loop
dims ``d`` of ``e_i``, provided the blocks are contiguous — ``e_i`` reads one split dim, and that dim
is the outermost term (``e_i = c·d + rest`` with ``0 <= rest < c``). An interleaved split (the inner
term of ``64·h + d`` split) or two split dims in one index has no MindSpore tuple: the op is reported.

The torch op becomes the primitive(s) MindSpore's layer of the same family runs (:data:`PRIMITIVES`):
``nn.Dense`` flattens its input to 2-D and calls ``MatMul(transpose_b=True)`` then ``BiasAdd``, so the
input's leading dims merge — contiguous blocks only when at most the outermost non-trivial leading
dim is split; ``nn.LayerNorm``'s ``LayerNorm``, ``nn.Embedding``'s ``Gather``, attention as
``BatchMatMul`` · ``Softmax`` · ``BatchMatMul`` in ``[batch, heads, seq, dim]`` order, the loss as
``SoftmaxCrossEntropyWithLogits`` over ``[rows, classes]``; elementwise statements an op absorbed
(the residual ``add.map`` after a linear) as their own primitive. MindSpore's own per-primitive rules
are checked here too (:data:`UNSPLIT_LAST`): ``Softmax``/``LayerNorm``/the loss reduce their last
dims inside one device, so a placement that splits them is reported with the fallback tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from polyparallel.ir import Access, AffineExpr, Graph, Op

__all__ = ["PRIMITIVES", "UNSPLIT_LAST", "PrimitiveShard", "op_shards", "operand_tuple"]

Strat = tuple[int, ...]

#: torch target -> MindSpore layer and the attribute names of its primitives (what ``apply`` shards)
PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "aten.linear.default": ("nn.Dense", ("matmul", "bias_add")),
    "aten.layer_norm.default": ("nn.LayerNorm", ("layer_norm",)),
    "aten.embedding.default": ("nn.Embedding", ("gather",)),
    "aten.scaled_dot_product_attention.default": ("BatchMatMul + Softmax + BatchMatMul", ()),
    "aten.cross_entropy_loss.default": ("SoftmaxCrossEntropyWithLogits", ()),
}

#: primitive -> how many trailing dims of its first input MindSpore computes inside one device
UNSPLIT_LAST = {"Softmax": 1, "SoftmaxCrossEntropyWithLogits": 1, "LayerNorm": 1}

#: the elementwise statement names a fused op carries -> MindSpore primitive
ELEMENTWISE = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "RealDiv", "gelu": "GeLU", "relu": "ReLU",
               "silu": "SiLU", "tanh": "Tanh", "sigmoid": "Sigmoid", "dropout": "Dropout"}


@dataclass(frozen=True)
class PrimitiveShard:
    """One MindSpore primitive with its ``in_strategy``; ``cell_attr`` names it inside MindSpore's layer."""

    primitive: str
    in_strategy: tuple[Strat, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    cell_attr: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "attrs": self.attrs, "in_strategy": [list(s) for s in self.in_strategy],
                "cell_attr": self.cell_attr}


def _factor(expr: AffineExpr, splits: dict[str, int], extents: dict[str, int]) -> int | str:
    """Blocks of one tensor dim indexed by ``expr``; a string says why no MindSpore tuple exists."""
    split = [d for d in expr.dims if splits.get(d, 1) > 1]
    if not split:
        return 1
    if len(split) > 1:
        return f"dims {split} are both split inside one tensor index {expr}"
    d = split[0]
    c = abs(expr.coef(d))
    rest = sum(abs(expr.coef(o)) * (extents[o] - 1) for o in expr.dims if o != d)
    if rest >= c:
        return f"dim {d} is the inner term of index {expr}: its blocks interleave, not one contiguous block each"
    return splits[d]


def operand_tuple(access: Access, splits: dict[str, int], extents: dict[str, int]) -> tuple[Strat | None, str]:
    """The MindSpore tuple of one operand read or written through ``access``: ``(tuple, "")`` or
    ``(None, why)``."""
    out = []
    for e in access.index:
        f = _factor(e, splits, extents) if isinstance(e, AffineExpr) else 1
        if isinstance(f, str):
            return None, f"{access.operand}: {f}"
        out.append(f)
    return tuple(out), ""


def _flatten_leading(t: Strat, shape: tuple[int, ...]) -> tuple[Strat | None, str]:
    """``t`` of a tensor whose leading dims ``nn.Dense`` merges into one: the merged dim's block count,
    when the merged blocks are contiguous (only the outermost dim of extent > 1 is split)."""
    lead, last = t[:-1], t[-1]
    live = [i for i, n in enumerate(shape[:-1]) if n > 1]
    cut = [i for i in live if lead[i] > 1]
    if cut and cut != live[:1]:
        return None, (f"nn.Dense merges the leading dims {shape[:-1]} into one: the split {lead} does not cut the "
                      "merged dim into contiguous blocks (only the outermost may be split)")
    return (math.prod(lead), last), ""


def _accesses(op: Op) -> dict[str, Access]:
    """Operand -> its first access (reads, then writes) in the op's statements."""
    seen: dict[str, Access] = {}
    assert op.nest is not None
    for st in op.nest.statements:
        for a in (*st.reads, *st.writes):
            seen.setdefault(a.operand, a)
    return seen


def _unsplit_last(p: PrimitiveShard) -> tuple[PrimitiveShard, str]:
    """MindSpore's rule that ``p`` keeps its last dims whole: the tuple with them set to 1, and why."""
    k = UNSPLIT_LAST.get(p.primitive, 0)
    if not k or all(f == 1 for s in p.in_strategy for f in s[len(s) - k:] if len(s) >= k):
        return p, ""
    fixed = tuple(s[:len(s) - k] + (1,) * min(k, len(s)) for s in p.in_strategy)
    return (PrimitiveShard(p.primitive, fixed, p.attrs, p.cell_attr),
            f"{p.primitive} computes its last dim inside one device in MindSpore: the split of it "
            f"{[list(s) for s in p.in_strategy]} is dropped ({[list(s) for s in fixed]}); MindSpore reshards "
            "its input there")


def op_shards(graph: Graph, op: Op, splits: dict[str, int]) -> tuple[list[PrimitiveShard], list[str]]:
    """The MindSpore primitives of ``op`` under the loop-dim block counts ``splits`` and what could not
    be expressed (one line each)."""
    if op.nest is None:
        return [], [f"{op.name}: opaque op ({op.opaque_reason}); MindSpore's default strategy applies"]
    ext = {d.name: d.extent for d in op.nest.dims}
    acc = _accesses(op)
    notes: list[str] = []
    for d in op.nest.dims:  # the batch dims are the replica's share here: the global dim is dp times it
        if splits.get(d.name, 1) > 1 and d.hint != "batch" and d.extent % splits[d.name]:
            notes.append(f"{op.name}: dim {d.name} ({d.extent}) is cut into {splits[d.name]} uneven blocks; MindSpore "
                         f"cuts a tensor dim into equal blocks only, so the split is dropped (pad {d.name} to a "
                         f"multiple of {splits[d.name]} to keep it)")
            splits = {k: v for k, v in splits.items() if k != d.name}

    def tup(operand: str) -> Strat | None:
        t, why = operand_tuple(acc[operand], splits, ext)
        if why:
            notes.append(f"{op.name}: {why}")
        return t

    def shape(operand: str) -> tuple[int, ...]:
        name = op.operand_name(operand)
        return tuple(graph.tensors[name].shape) if name else ()

    prims: list[PrimitiveShard] = []
    first = op.nest.statements[0].name
    if op.target == "aten.linear.default":
        # MatMul's rows are the output's leading dims (the input may be a view the capture fused, the
        # attention's [b, h, s, e] read as [b, s, h·e]); its reduction dim is the weight's second
        y, w = tup("out0"), tup("in1")
        if y is not None and w is not None:
            x2, why = _flatten_leading((*y[:-1], w[1]), shape("out0")) if len(y) > 2 else ((y[0], w[1]), "")
            if why:
                notes.append(f"{op.name}: {why}")
            else:
                assert x2 is not None
                prims.append(PrimitiveShard("MatMul", (x2, w), {"transpose_b": True}, "matmul"))
                if "in2" in acc:
                    prims.append(PrimitiveShard("BiasAdd", ((x2[0], w[0]), (w[0],)), {}, "bias_add"))
    elif op.target == "aten.layer_norm.default":
        x = tup("in0")
        if x is not None:
            prims.append(PrimitiveShard("LayerNorm", (x, (x[-1],), (x[-1],)),
                                        {"begin_norm_axis": -1, "begin_params_axis": -1}, "layer_norm"))
    elif op.target == "aten.embedding.default":
        table, ids = tup("in0"), tup("in1")
        if table is not None and ids is not None:
            prims.append(PrimitiveShard("Gather", (table, ids), {}, "gather"))  # axis 0 is a call argument
    elif op.kind == "attention":
        f = {d: splits.get(d, 1) for d in ext}
        q = (f["b"], f["h"], f["s"], f["d"])
        k = (f["b"], f["h"], f["t"], f["d"])
        v = (f["b"], f["h"], f["t"], f["e"])
        p = (f["b"], f["h"], f["s"], f["t"])
        prims += [PrimitiveShard("BatchMatMul", (q, k), {"transpose_b": True}),
                  PrimitiveShard("Softmax", (p,), {"axis": -1}), PrimitiveShard("BatchMatMul", (p, v))]
        for st in op.nest.statements:
            for a in st.reads:
                if a.operand.startswith("in"):
                    tup(a.operand)  # the operands' own layouts must be contiguous blocks too
    elif op.kind == "loss":
        logits = tup("in0")
        if logits is not None:
            rows = math.prod(logits[:-1])
            x2, why = _flatten_leading(logits, shape("in0")) if len(logits) > 2 else (logits, "")
            if why:
                notes.append(f"{op.name}: {why}")
            else:
                assert x2 is not None
                prims.append(PrimitiveShard("SoftmaxCrossEntropyWithLogits", ((rows, x2[-1]), (rows, x2[-1]))))
    elif op.kind in ("create", "view"):
        return [], []
    else:
        notes.append(f"{op.name}: no MindSpore primitive table for {op.target} ({op.kind}); MindSpore's default "
                     "strategy (batch over the devices) applies")
    # elementwise statements the op absorbed (fuse_elementwise): their own primitive, on the op's output
    for st in op.nest.statements[1:]:
        base = st.name.partition(".")[0]
        if st.name.endswith(".map") and base in ELEMENTWISE and st.name != first:
            ts = [operand_tuple(a, splits, ext) for a in st.reads]
            if all(t is not None for t, _ in ts):
                prims.append(PrimitiveShard(ELEMENTWISE[base], tuple(t for t, _ in ts if t is not None)))
            else:
                notes += [f"{op.name}: {why}" for _, why in ts if why]
    out = []
    for p in prims:
        p2, why = _unsplit_last(p)
        if why:
            notes.append(f"{op.name}: {why}")
        out.append(p2)
    return out, notes
