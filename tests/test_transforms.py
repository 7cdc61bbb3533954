"""Transforms: canonicalisation and fusion checked by executing loop nests, blocks and balance by brute force.

The reference interpreter below runs a graph by iterating every statement's domain
with numpy: it reads operands through the statement's affine accesses (out-of-bounds
reads are zero padding), applies the op's function, and writes through the write
accesses. Canonicalisation and fusion rewrite the accesses, never the data, so the
graph outputs must stay the same to rounding.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from polyparallel import ops
from polyparallel.frontends import GraphBuilder
from polyparallel.ir import ANY, Graph, OpKind, TensorKind
from polyparallel.layers import Block, balance, find_repeated_blocks, layer_chain, partition
from polyparallel.layers import _best_repeat as best_repeat
from polyparallel.transforms import canonicalize, fuse_elementwise, history

# -- reference interpreter ----------------------------------------------------------------------------

_MAP = {
    "add": lambda *x: sum(x),
    "sub": lambda a, b: a - b,
    "mul": lambda *x: math.prod(x),
    "relu": lambda a: np.maximum(a, 0),
    "neg": lambda a: -a,
    "tanh": np.tanh,
    "gelu": lambda a: 0.5 * a * (1 + np.tanh(0.8 * a)),
    "dropout": lambda a: a,
    "clone": lambda a: a,
    "contiguous": lambda a: a,
    "_to_copy": lambda a: a,
}
_ACCUMULATE = {"mac", "bias", "reduce", "pool"}


def _short(target: str) -> str:
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" else parts[-1]


def _index(acc, env, n):
    return [np.full(n, x.const, dtype=np.int64) + sum((c * env[d] for d, c in x.terms), np.zeros(n, np.int64))
            for x in acc.index]


# Ops that are the identity on values whatever their loop nest says (kept independent of
# the list canonicalize uses to drop them).
_IDENTITY = {"dropout", "alias", "clone", "contiguous", "detach", "identity", "lift_fresh_copy"}


def _generic(reads: list[np.ndarray], n: int) -> np.ndarray:
    """A fixed nonlinear mix of the values a domain point reads (order matters; never saturates)."""
    if not reads:
        return np.ones(n)
    return np.sin(sum(1.7 * (k + 1) * r for k, r in enumerate(reads)) + 0.3)


def run(graph: Graph, feeds: dict[str, np.ndarray], *, generic: bool = False) -> list[np.ndarray]:
    """Execute the graph's loop nests; returns the graph outputs in order.

    With ``generic``, every statement computes :func:`_generic` of what it reads (a
    zero-FLOP statement with one read copies it) and accumulates into its writes; data-
    dependent (ANY) axes read their maximum. That is not the ops' arithmetic, but it depends
    on exactly which elements every domain point reads and writes, which is all that
    canonicalisation and fusion may not change — so it checks any captured model.
    """
    vals = dict(feeds)
    for op in graph.ops:
        if not op.outputs:  # an assertion: no effect on values
            continue
        if generic and (op.nest is None or (_short(op.target).rstrip("_") in _IDENTITY and len(op.outputs) == 1
                                             and graph.shape(op.inputs[0]) == graph.shape(op.outputs[0]))):
            total = sum(float(vals[t].sum()) for t in op.inputs)
            for t in op.outputs:
                vals[t] = (vals[op.inputs[0]].copy() if op.nest is not None
                           else np.full(graph.shape(t), np.tanh(1e-3 * total)))
            continue
        assert op.nest is not None, f"interpreter cannot run opaque op {op.name}"
        arrays = {f"in{i}": vals[t] for i, t in enumerate(op.inputs)}
        arrays.update({f"out{i}": np.zeros(graph.shape(t)) for i, t in enumerate(op.outputs)})
        for st in op.nest.statements:  # temporaries: sized by the largest index any access uses
            ext = {d: op.nest.dim(d).extent - 1 for d in st.dims}
            for acc in st.reads + st.writes:
                if acc.operand in arrays and acc.operand.startswith(("in", "out")):
                    continue
                hi = [sum(max(c * ext[d], 0) for d, c in x.terms) for x in acc.index]
                old = arrays.get(acc.operand)
                shape = [x.const + h + 1 for x, h in zip(acc.index, hi)]
                if old is not None:
                    shape = [max(a, b) for a, b in zip(shape, old.shape)]
                arrays[acc.operand] = np.zeros(shape)
        for st in op.nest.statements:
            ext = [op.nest.dim(d).extent for d in st.dims]
            grid = np.meshgrid(*[np.arange(e) for e in ext], indexing="ij")
            env = {d: g.ravel() for d, g in zip(st.dims, grid)}
            n = math.prod(ext)
            keep = np.ones(n, bool)
            for c in st.constraints:
                keep &= c.const + sum((k * env[d] for d, k in c.terms), np.zeros(n, np.int64)) >= 0
            env = {d: v[keep] for d, v in env.items()}
            n = int(keep.sum())
            reads = []
            for acc in st.reads:
                arr = arrays[acc.operand]
                anys = tuple(i for i, x in enumerate(acc.index) if x is ANY)
                assert generic or not anys, "the reference interpreter has no data-dependent indices"
                if anys:  # "any element along the axis": the max is blind to duplicates and order
                    arr = arr.max(axis=anys)
                    acc = type(acc)(acc.operand, tuple(x for x in acc.index if x is not ANY))
                idx = _index(acc, env, n)
                ok = np.ones(n, bool)
                for i, e in zip(idx, arr.shape):
                    ok &= (i >= 0) & (i < e)
                v = np.zeros(n)
                v[ok] = arr[tuple(i[ok] for i in idx)]
                reads.append(v)
            fn, _, base = st.name.rpartition(".")
            if generic:
                val = reads[0] if st.flops_per_point == 0 and len(reads) == 1 else _generic(reads, n)
                # a mean, not a sum, over the reduction dims keeps values O(1) and sin sensitive
                val = val / math.prod(op.nest.dim(d).extent for d in st.reduction_dims())
            elif base == "copy" or base.startswith("part"):
                val = reads[0]
            elif base == "map":
                val = _MAP[fn or _short(op.target)](*reads)
            elif base in ("mac", "bias", "reduce", "pool"):
                val = math.prod(reads)
            else:
                raise AssertionError(f"no reference semantics for statement {st.name} of {op.target}")
            for acc in st.writes:
                idx = tuple(_index(acc, env, n))
                if not idx:  # a scalar output: every point adds into it
                    arrays[acc.operand][()] += val.sum()
                elif generic or base in _ACCUMULATE:
                    arr = arrays[acc.operand]
                    flat = np.ravel_multi_index(idx, arr.shape)
                    arr += np.bincount(flat, val, minlength=arr.size).reshape(arr.shape)
                else:
                    arrays[acc.operand][idx] = val
        for i, t in enumerate(op.outputs):
            vals[t] = arrays[f"out{i}"]
    return [vals[t] for t in graph.outputs]


class Net:
    """A few lines per test graph on top of GraphBuilder."""

    def __init__(self, name: str = "t") -> None:
        self.b = GraphBuilder(name, "test")
        self.n = 0

    def input(self, shape, name=None) -> str:
        t = self.b.tensor(name or f"x{len(self.b.graph.inputs)}", shape, kind=TensorKind.INPUT)
        self.b.graph.inputs.append(t)
        return t

    def param(self, shape, name) -> str:
        return self.b.tensor(name, shape, kind=TensorKind.PARAM)

    def op(self, kind, target, inputs, shape, nest, dtype="float32", module="", **attrs) -> str:
        self.n += 1
        out = self.b.tensor(f"v{self.n}", shape, dtype=dtype)
        self.b.op(target.split(".")[-1], kind, target, inputs, [out], (lambda: nest) if nest else None,
                  attrs=attrs, module=module)
        return out

    def shape(self, t):
        return self.b.graph.shape(t)

    # view and compute helpers: shapes are inferred from the builders
    def view(self, target, x, nest) -> str:
        return self.op(OpKind.VIEW, f"aten.{target}", [x], self._out(nest), nest)

    @staticmethod
    def _out(nest) -> tuple[int, ...]:
        w = nest.statements[0].writes[0]
        return tuple(max(x.eval({d: nest.dim(d).extent - 1 for d in x.dims}) + 1, 1) for x in w.index)

    def permute(self, x, perm):
        return self.view("permute", x, ops.permute(self.shape(x), perm))

    def reshape(self, x, shape):
        return self.view("reshape", x, ops.reshape(self.shape(x), shape))

    def ew(self, target, *xs, dtype="float32", **attrs):
        shapes = [self.shape(x) for x in xs]
        out = ops.broadcast_shapes(*shapes)
        nest = ops.elementwise(out, shapes, flops=ops.flops_per_element(target))
        return self.op(OpKind.ELEMENTWISE, f"aten.{target}", list(xs), out, nest, dtype=dtype, **attrs)

    def linear(self, x, w, bias=None, module=""):
        xs, ws = self.shape(x), self.shape(w)
        nest = ops.linear(xs, ws, self.shape(bias) if bias else None)
        return self.op(OpKind.CONTRACTION, "aten.linear", [x, w] + ([bias] if bias else []),
                       (*xs[:-1], ws[0]), nest, module=module)

    def matmul(self, a, b):
        from polyparallel.ops._contraction import matmul
        sa, sb = self.shape(a), self.shape(b)
        out = (*ops.broadcast_shapes(sa[:-2], sb[:-2]), sa[-2], sb[-1])
        return self.op(OpKind.CONTRACTION, "aten.matmul", [a, b], out, matmul(sa, sb))

    def conv1d(self, x, w, padding):
        xs, ws = self.shape(x), self.shape(w)
        out = (xs[0], ws[0], ops.out_extent(xs[2], ws[2], 1, padding, padding, 1))
        return self.op(OpKind.CONV, "aten.conv1d", [x, w], out, ops.conv(xs, ws, padding=padding))

    def done(self, *outputs) -> Graph:
        self.b.graph.outputs.extend(outputs)
        return self.b.finish()


def feeds_for(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(t.shape) for n, t in g.tensors.items() if t.kind is not TensorKind.ACTIVATION}


def check_canonical(g: Graph) -> Graph:
    """canonicalize(g) keeps outputs, FLOPs of kept ops, parameters; never mutates g."""
    before = g.to_json()
    c = canonicalize(g)
    assert g.to_json() == before, "canonicalize mutated its input"
    c.validate()
    rec = history(c)[-1]
    dropped = set(rec.dropped)
    assert c.param_count() == g.param_count()

    def compute(graph: Graph, skip: set[str] | frozenset[str] = frozenset()) -> int:
        return sum(op.flops for op in graph.ops if op.kind is not OpKind.VIEW and op.name not in skip)

    assert compute(c) == compute(g, dropped)
    f = feeds_for(g)
    for x, y in zip(run(g, f), run(c, f), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-12)
    return c


def views(g: Graph) -> list[str]:
    return [op.name for op in g.ops if op.kind is OpKind.VIEW]


# -- canonicalize --------------------------------------------------------------------------------------


def test_permute_folds_into_linear():
    n = Net()
    x, w = n.input((2, 4, 3)), n.param((5, 4), "w")
    y = n.linear(n.permute(x, (0, 2, 1)), w)
    c = check_canonical(n.done(y))
    assert views(c) == [] and history(c)[-1].folded == ("permute",)
    assert c.ops[0].inputs[0] == x


def test_split_reshape_permute_chain_into_attention_scores():
    n = Net()
    q, k = n.input((2, 4, 6)), n.input((2, 4, 6))
    heads = lambda t: n.permute(n.reshape(t, (2, 4, 2, 3)), (0, 2, 1, 3))  # noqa: E731
    kt = n.permute(heads(k), (0, 1, 3, 2))
    s = n.matmul(heads(q), kt)
    c = check_canonical(n.done(s))
    assert views(c) == []
    assert c.ops[0].inputs == (q, k)


def test_merge_reshape_splits_the_consumer_dim():
    n = Net()
    a, w = n.input((2, 2, 4, 3)), n.param((5, 6), "w")
    merged = n.reshape(n.permute(a, (0, 2, 1, 3)), (2, 4, 6))
    y = n.linear(merged, w)
    c = check_canonical(n.done(y))
    assert views(c) == [] and history(c)[-1].split_dims == 1
    lin = c.ops[0]
    assert lin.nest.flops() == 2 * 2 * 4 * 5 * 6
    assert {d.name: d.extent for d in lin.nest.dims if d.name.startswith("k")} == {"k_0": 2, "k_1": 3}


def test_second_merge_reshape_reuses_the_split_of_the_first():
    # both operands are merged [2, 3, 4] -> [6, 4]: the first fold splits the row dim, the
    # second sees 3*d0_0 + d0_1 and must match it rather than give up (GQA's k and v)
    n = Net()
    a, b = n.input((2, 3, 4)), n.input((2, 3, 4))
    y = n.ew("mul", n.reshape(a, (6, 4)), n.reshape(b, (6, 4)))
    c = check_canonical(n.done(y))
    assert views(c) == [] and history(c)[-1].split_dims == 1


def test_split_outputs_fold_into_their_readers():
    n = Net()
    x, w = n.input((2, 3, 4)), n.param((12, 4), "w")
    qkv = n.linear(x, w)
    parts = [n.b.tensor(f"part{i}", (2, 3, 4)) for i in range(3)]
    n.b.op("split", OpKind.SPLIT, "aten.split", [qkv], parts, lambda: ops.split((2, 3, 12), [4, 4, 4], -1))
    y = n.ew("mul", n.ew("add", parts[0], parts[1]), parts[2])
    c = check_canonical(n.done(y))
    assert [op.kind for op in c.ops] == [OpKind.CONTRACTION, OpKind.ELEMENTWISE, OpKind.ELEMENTWISE]
    assert history(c)[-1].folded == ("split",)
    reads = {str(a) for a in c.ops[1].nest.statements[0].reads}
    assert reads == {"in0[d0, d1, d2]", "in1[d0, d1, d2 + 4]"}


@pytest.mark.filterwarnings("ignore::polyparallel.frontends.OpaqueOpWarning")
def test_split_with_an_unfoldable_reader_stays():
    n = Net()
    x = n.input((2, 6))
    parts = [n.b.tensor(f"part{i}", (2, 3)) for i in range(2)]
    n.b.op("split", OpKind.SPLIT, "aten.split", [x], parts, lambda: ops.split((2, 6), [3, 3], -1))
    a = n.ew("relu", parts[0])
    b = n.op(OpKind.OPAQUE, "aten.weird", [parts[1]], (2, 3), None)
    c = canonicalize(n.done(a, b))
    assert [op.name for op in c.ops if op.kind is OpKind.SPLIT] == ["split"]
    assert c.op("relu").inputs == (x,)


def test_data_dependent_reads_fold_only_onto_full_axes():
    # a gather reads "any row" of its table: through a permute that is any row of the
    # source; through an unsqueeze the unit axis is skipped; through a slice it would
    # widen to rows the gather never reads, so the slice stays
    n = Net()
    table, ids = n.input((4, 6)), n.input((3,))

    def gather(t: str) -> str:
        return n.op(OpKind.GATHER, "aten.index_select", [t, ids], (3, n.shape(t)[1]), _gather(n.shape(t)))

    a = gather(n.permute(n.permute(table, (1, 0)), (1, 0)))
    u = n.reshape(table, (1, 4, 6))
    b = n.op(OpKind.GATHER, "aten.index_select", [u, ids], (1, 3, 6), ops.gather((1, 4, 6), (3,), 1))
    s = n.view("slice", table, ops.slice_((4, 6), 0, 1, 4))
    d = gather(s)
    c = canonicalize(n.done(a, b, d))
    assert [op.name for op in c.ops if op.kind is OpKind.VIEW] == ["slice"]
    reads = [str(st.reads[0]) for op in c.ops if op.kind is OpKind.GATHER for st in op.nest.statements]
    assert reads[:2] == ["in0[ANY, d1]", "in0[ANY, d2]"]


def _gather(shape):
    """``out[i, j] = table[ids[i], j]`` with the row as a data-dependent (ANY) index."""
    from polyparallel.ir import Access, Dim, E, LoopNest, Statement

    dims = (Dim("d0", 3), Dim("d1", shape[1]))
    st = Statement("gather", ("d0", "d1"), reads=(Access("in0", (ANY, E("d1"))), Access("in1", (E("d0"),))),
                   writes=(Access("out0", (E("d0"), E("d1"))),), flops_per_point=0)
    return LoopNest(dims, (st,))


def test_onnx_style_reshape_with_a_shape_input_folds():
    n = Net()
    x, w = n.input((2, 3, 4)), n.param((5, 4), "w")
    shape = n.b.tensor("shape", (2,), dtype="int64", kind=TensorKind.CONST)
    flat = n.op(OpKind.VIEW, "Reshape", [x, shape], (6, 4), ops.reshape((2, 3, 4), (6, 4)))
    c = check_canonical(n.done(n.linear(flat, w)))
    assert views(c) == [] and c.ops[0].inputs == (x, w)
    assert "shape" in c.tensors  # constants are kept even when no op reads them any more


def test_expand_select_and_unsqueeze_fold():
    n = Net()
    x, bias = n.input((3, 4, 5)), n.input((1, 5))
    row = n.view("select", x, ops.select((3, 4, 5), 1, 2))  # [3, 5]
    y = n.ew("add", row, n.view("expand", bias, ops.expand((1, 5), (3, 5))))
    z = n.ew("mul", n.reshape(y, (3, 1, 5)), n.input((3, 4, 5)))
    c = check_canonical(n.done(z))
    assert views(c) == []


def test_slice_folds_when_reads_stay_in_bounds():
    n = Net()
    x = n.input((2, 7))
    s = n.view("slice", x, ops.slice_((2, 7), 1, 1, 6, 2))  # columns 1, 3, 5
    c = check_canonical(n.done(n.ew("relu", s)))
    assert views(c) == []


def test_slice_under_conv_padding_is_kept():
    # conv pads the sliced tensor with zeros; reading the unsliced input there would read data
    n = Net()
    x, w = n.input((1, 2, 8)), n.param((3, 2, 3), "w")
    s = n.view("slice", x, ops.slice_((1, 2, 8), 2, 2, 6))
    c = check_canonical(n.done(n.conv1d(s, w, padding=1)))
    assert views(c) == ["slice"]
    assert "zero padding" in history(c)[-1].kept[0][1]


def test_pad_folds_into_padded_conv():
    n = Net()
    x, w = n.input((1, 2, 5)), n.param((3, 2, 3), "w")
    p = n.view("pad", x, ops.pad((1, 2, 5), [(0, 0), (0, 0), (2, 1)]))
    c = check_canonical(n.done(n.conv1d(n.permute(n.permute(p, (0, 2, 1)), (0, 2, 1)), w, padding=1)))
    assert views(c) == []
    assert c.ops[0].inputs[0] == x


@pytest.mark.filterwarnings("ignore::polyparallel.frontends.OpaqueOpWarning")
def test_noops_dropped_and_consumers_rewired():
    n = Net()
    x = n.input((3, 4))
    a = n.ew("clone", x)
    b = n.ew("dropout", a, p=0.0, train=True)
    live = n.ew("dropout", b, p=0.5, train=True)  # a real dropout stays
    d = n.ew("_to_copy", live, dtype="float32")
    e = n.reshape(d, (3, 4))
    n.b.op("assert", OpKind.OPAQUE, "aten._assert_tensor_metadata.default", [e], [], None)
    ratio = n.b.tensor("ratio", (), kind=TensorKind.CONST)
    e = n.op(OpKind.VIEW, "Dropout", [e, ratio], (3, 4), ops.expand((3, 4), (3, 4)))  # ONNX, inference
    y = n.ew("relu", e)
    cast = n.ew("_to_copy", y, dtype="float16")  # a real cast stays
    g = n.done(y, cast)
    c = canonicalize(g)
    rec = history(c)[-1]
    assert set(rec.dropped) == {"clone", "dropout", "_to_copy", "reshape", "assert", "Dropout"}
    assert [op.target for op in c.ops] == ["aten.dropout", "aten.relu", "aten._to_copy"]
    assert c.ops[0].inputs == (x,) and c.ops[1].inputs == c.ops[0].outputs
    f = feeds_for(g)
    for u, v in zip(run(g, f), run(c, f)):
        np.testing.assert_allclose(u, v)


@pytest.mark.filterwarnings("ignore::polyparallel.frontends.OpaqueOpWarning")
def test_view_feeding_graph_output_or_opaque_consumer_stays():
    n = Net()
    x, w = n.input((2, 4, 3)), n.param((5, 4), "w")
    t = n.permute(x, (0, 2, 1))
    y = n.linear(t, w)
    z = n.op(OpKind.OPAQUE, "aten.weird", [t], (2, 3, 4), None)
    g = n.done(y, z)
    c = canonicalize(g)
    assert views(c) == ["permute"]
    lin = next(op for op in c.ops if op.kind is OpKind.CONTRACTION)
    assert lin.inputs[0] == x  # the foldable consumer reads the source anyway


def _random_view_chain(rng, n: Net, x: str) -> str:
    for _ in range(int(rng.integers(2, 6))):
        s = n.shape(x)
        kind = rng.choice(["permute", "split", "merge", "slice", "pad", "expand"])
        if kind == "permute":
            x = n.permute(x, tuple(rng.permutation(len(s))))
        elif kind == "split":
            ax = [i for i, e in enumerate(s) if e % 2 == 0]
            if ax:
                i = int(rng.choice(ax))
                x = n.reshape(x, (*s[:i], 2, s[i] // 2, *s[i + 1:]))
        elif kind == "merge" and len(s) > 2:
            i = int(rng.integers(0, len(s) - 1))
            x = n.reshape(x, (*s[:i], s[i] * s[i + 1], *s[i + 2:]))
        elif kind == "slice":
            i = int(rng.integers(0, len(s)))
            if s[i] > 2:
                x = n.view("slice", x, ops.slice_(s, i, 1, s[i], int(rng.integers(1, 3))))
        elif kind == "pad":
            i = int(rng.integers(0, len(s)))
            pads = [(0, 0)] * len(s)
            pads[i] = (int(rng.integers(0, 3)), int(rng.integers(0, 2)))
            x = n.view("pad", x, ops.pad(s, pads))
        elif kind == "expand":
            x = n.reshape(x, (1, *s))
            x = n.view("expand", x, ops.expand((1, *s), (2, *s)))
    return x


@pytest.mark.parametrize("seed", range(12))
def test_random_view_chains_keep_values(seed):
    rng = np.random.default_rng(seed)
    n = Net()
    x = n.input((4, 6, 2))
    v = _random_view_chain(rng, n, x)
    s = n.shape(v)
    w = n.param((3, s[-1]), "w")
    y = n.linear(v, w)
    if len(s) >= 3:  # a padded conv over the last axis exercises zero-padding exactness
        lead = math.prod(s[:-2])
        r = n.reshape(v, (lead, s[-2], s[-1])) if len(s) > 3 else v
        k = n.param((2, s[-2], 3), "k")
        c = n.conv1d(r, k, padding=1)
        g = n.done(y, c)
    else:
        g = n.done(y)
    check_canonical(g)


# -- fusion --------------------------------------------------------------------------------------------


def _mlp(n: Net, x: str, i: int) -> str:
    w1, b1 = n.param((8, 4), f"w1_{i}"), n.param((8,), f"b1_{i}")
    w2 = n.param((4, 8), f"w2_{i}")
    h = n.ew("gelu", n.ew("add", n.linear(x, w1), b1))
    return n.ew("add", n.linear(h, w2), x)  # residual


def test_fusion_absorbs_bias_gelu_and_residual():
    n = Net()
    x = n.input((2, 3, 4))
    g = n.done(_mlp(n, x, 0))
    f = fuse_elementwise(g)
    assert [op.kind for op in f.ops] == [OpKind.CONTRACTION, OpKind.CONTRACTION]
    assert f.flops() == g.flops()
    assert dict(history(f)[-1].fused) == {"linear": ("add", "gelu"), "linear_1": ("add_1",)}
    assert f.ops[0].attr["fused"] == ("aten.add", "aten.gelu")
    assert f.bytes_moved() < g.bytes_moved()
    fe = feeds_for(g)
    np.testing.assert_allclose(run(f, fe)[0], run(g, fe)[0], rtol=1e-12)


def test_fusion_respects_other_readers_and_late_operands():
    n = Net()
    x = n.input((3, 4))
    w = n.param((4, 4), "w")
    y = n.linear(x, w)
    a = n.ew("relu", y)
    b = n.ew("neg", y)  # y has two readers: neither may absorb the linear's output
    late = n.linear(x, w)  # produced after the first linear...
    z = n.ew("add", n.ew("add", a, b), late)  # ...and read by an op fusable into relu's chain
    g = n.done(z)
    f = fuse_elementwise(g)
    f.validate()
    assert any(op.name == "linear" and "fused" not in op.attr for op in f.ops)
    fe = feeds_for(g)
    np.testing.assert_allclose(run(f, fe)[0], run(g, fe)[0], rtol=1e-12)
    assert f.flops() == g.flops()


def test_fusion_after_canonicalize_through_reshaped_output():
    # linear on a flattened [B*S, K] input, reshaped back: the bias add reads [S*b + s, n]
    n = Net()
    x, w = n.input((2, 3, 4)), n.param((5, 4), "w")
    y = n.reshape(n.linear(n.reshape(x, (6, 4)), w), (2, 3, 5))
    z = n.ew("relu", n.ew("add", y, n.param((5,), "bias")))
    g = n.done(z)
    c = check_canonical(g)
    f = fuse_elementwise(c)
    assert len(f.ops) == 1 and f.flops() == c.flops()
    fe = feeds_for(g)
    np.testing.assert_allclose(run(f, fe)[0], run(g, fe)[0], rtol=1e-12)


def test_fusion_of_a_consumer_whose_dims_were_split():
    # relu reads the linear's [2, 3, 5] output merged to [6, 5]: canonicalize splits relu's
    # row dim in two, so relu writes out0[3*d0_0 + d0_1, d1]; fusion must keep that write
    n = Net()
    x, w = n.input((2, 3, 4)), n.param((5, 4), "w")
    y = n.ew("relu", n.reshape(n.linear(x, w), (6, 5)))
    g = n.done(y)
    c = check_canonical(g)
    assert history(c)[-1].split_dims == 1
    f = fuse_elementwise(c)
    assert len(f.ops) == 1 and f.shape(f.outputs[0]) == (6, 5)
    fe = feeds_for(g)
    np.testing.assert_allclose(run(f, fe)[0], run(g, fe)[0], rtol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_random_elementwise_dags_fuse_exactly(seed):
    rng = np.random.default_rng(seed)
    n = Net()
    x = n.input((2, 3, 4))
    live = [n.linear(x, n.param((4, 4), "w0"))]
    for i in range(8):
        kind = rng.choice(["unary", "binary", "bias", "linear"])
        a = live[int(rng.integers(len(live)))]
        if kind == "unary":
            live.append(n.ew(str(rng.choice(["relu", "neg", "tanh", "gelu"])), a))
        elif kind == "binary":
            live.append(n.ew(str(rng.choice(["add", "mul", "sub"])), a, live[int(rng.integers(len(live)))]))
        elif kind == "bias":
            live.append(n.ew("add", a, n.param((4,), f"b{i}")))
        else:
            live.append(n.linear(a, n.param((4, 4), f"w{i + 1}")))
    g = n.done(live[-1], live[int(rng.integers(len(live) - 1))])
    f = fuse_elementwise(g)
    f.validate()
    assert f.flops() == g.flops() and f.param_count() == g.param_count()
    absorbed = sum(len(a) for _, a in history(f)[-1].fused)
    assert len(f.ops) == len(g.ops) - absorbed
    fe = feeds_for(g)
    for u, v in zip(run(g, fe), run(f, fe), strict=True):
        np.testing.assert_allclose(v, u, rtol=1e-12)


# -- repeated blocks -----------------------------------------------------------------------------------


def tiny_transformer(layers: int, *, modules: bool = True, odd: int | None = None, B=2, S=4, D=8, H=2) -> Graph:
    """Embedding, ``layers`` pre-norm decoder layers, final norm and head (ops only, no numerics)."""
    n = Net("tiny")
    ids = n.input((B, S), "ids")
    wte = n.param((16, D), "wte")
    x = n.op(OpKind.EMBEDDING, "aten.embedding", [wte, ids], (B, S, D), ops.embedding((16, D), (B, S)),
             module="wte" if modules else "")
    for i in range(layers):
        m = (lambda s, i=i: f"h.{i}.{s}") if modules else (lambda s: "")
        ln = lambda t, nm, m=m, i=i: n.op(OpKind.NORM, "aten.layer_norm",  # noqa: E731
                                          [t, n.param((D,), f"{nm}w{i}"), n.param((D,), f"{nm}b{i}")],
                                          (B, S, D), ops.layer_norm((B, S, D), (D,)), module=m(nm))
        h = ln(x, "ln1")
        qkv = n.linear(h, n.param((3 * D, D), f"qkv{i}"), n.param((3 * D,), f"qkvb{i}"), module=m("attn.qkv"))
        parts = []
        for j in range(3):
            s = n.view("slice", qkv, ops.slice_((B, S, 3 * D), 2, j * D, (j + 1) * D))
            parts.append(n.permute(n.reshape(s, (B, S, H, D // H)), (0, 2, 1, 3)))
        att = n.op(OpKind.ATTENTION, "aten.scaled_dot_product_attention", parts, (B, H, S, D // H),
                   ops.attention(*(n.shape(p) for p in parts), causal=True), module=m("attn"))
        o = n.reshape(n.permute(att, (0, 2, 1, 3)), (B, S, D))
        x = n.ew("add", x, n.linear(o, n.param((D, D), f"proj{i}"), module=m("attn.proj")))
        hidden = 4 * D if i != odd else 2 * D
        f1 = n.linear(ln(x, "ln2"), n.param((hidden, D), f"fc{i}"), module=m("mlp.fc"))
        x = n.ew("add", x, n.linear(n.ew("gelu", f1), n.param((D, hidden), f"out{i}"), module=m("mlp.proj")))
    y = n.op(OpKind.NORM, "aten.layer_norm", [x, n.param((D,), "lnfw"), n.param((D,), "lnfb")], (B, S, D),
             ops.layer_norm((B, S, D), (D,)), module="ln_f" if modules else "")
    return n.done(n.linear(y, wte, module="head" if modules else ""))


@pytest.mark.parametrize("modules", [True, False])
def test_blocks_of_identical_layers(modules):
    g = tiny_transformer(4, modules=modules)
    per_layer = (len(g.ops) - 3) // 4
    assert find_repeated_blocks(g) == [Block(1, per_layer, 4, find_repeated_blocks(g)[0].key)]
    b = find_repeated_blocks(g)[0]
    if modules:
        assert {op.module.split(".")[1] for op in b.ops(g, 2) if op.module} == {"2"}
    sigs = [[g.signature(op) for op in b.ops(g, m)] for m in range(4)]
    assert all(s == sigs[0] for s in sigs)
    # the final norm has the same signature as a layer's first norm: the phase is still right
    assert g.signature(g.ops[b.stop]) == g.signature(g.ops[b.start])


def test_blocks_survive_canonicalize_and_fusion():
    g = tiny_transformer(3)
    for h in (canonicalize(g), fuse_elementwise(canonicalize(g))):
        (b,) = find_repeated_blocks(h)
        assert b.count == 3 and b.start == 1 and b.stop == len(h.ops) - 2


def test_one_different_layer_breaks_the_run():
    g = tiny_transformer(6, odd=2)
    blocks = find_repeated_blocks(g)
    L = (len(g.ops) - 3) // 6
    assert [(b.start, b.length, b.count) for b in blocks] == [(1, L, 2), (1 + 3 * L, L, 3)]
    assert blocks[0].key == blocks[1].key


def brute_best_coverage(a: list[int], min_len: int, min_count: int) -> int:
    best = 0
    n = len(a)
    for start in range(n):
        for p in range(min_len, n + 1):
            k = 1
            while start + (k + 1) * p <= n and a[start + k * p:start + (k + 1) * p] == a[start:start + p]:
                k += 1
            if k >= min_count:
                best = max(best, k * p)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_tandem_repeat_search_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 30))
    a = list(rng.integers(0, int(rng.integers(2, 4)), n))
    if seed % 2:  # plant a repeat
        blk = list(rng.integers(0, 3, int(rng.integers(2, 5))))
        a = a[: n // 3] + blk * int(rng.integers(2, 5)) + a[n // 3:]
    found = best_repeat(np.array(a), 0, len(a), 2, 2)
    want = brute_best_coverage(a, 2, 2)
    assert (found[3] if found else 0) == want
    if found:
        s, p, _, cover = found
        assert all(a[s + i] == a[s + i % p] for i in range(cover))


# -- balance -------------------------------------------------------------------------------------------


def brute_partition(x, k):
    n = len(x)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(x[u:v]) for u, v in itertools.pairwise(b)))
    return best


@pytest.mark.parametrize("ties", ["backtrack", "first_fit"])
@pytest.mark.parametrize("seed", range(60))
def test_partition_is_optimal(seed, ties):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    k = int(rng.integers(1, n + 1))
    x = [int(v) for v in rng.integers(0, 20, n)] if seed % 3 else [int(v) for v in rng.integers(0, 2, n)]
    cuts, best = partition(x, k, ties=ties)
    assert best == brute_partition(x, k)
    assert len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == n
    assert all(u < v for u, v in itertools.pairwise(cuts))
    assert max(sum(x[u:v]) for u, v in itertools.pairwise(cuts)) == best


def first_fit_reference(x, k):
    """The cut pipeline chunks take, in exact integer arithmetic from the brute-force optimum: every
    part as full as the optimum allows, then the part of most items (the later on ties) halved."""
    n, limit = len(x), brute_partition(x, k)
    starts, acc = [0], 0
    for i, w in enumerate(x):
        if i and acc + w > limit:
            starts.append(i)
            acc = 0
        acc += w
    while len(starts) < k:
        bounds = [*starts, n]
        size, j = max((bounds[j + 1] - bounds[j], j) for j in range(len(starts)))
        starts.insert(j + 1, bounds[j] + size // 2)
    return (*starts, n), limit


@pytest.mark.parametrize("seed", range(40))
def test_first_fit_fills_parts_left_to_right_then_halves_the_longest(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 12))
    k = int(rng.integers(1, n + 1))
    x = [int(v) for v in rng.integers(1, 6 if seed % 2 else 10**12, n)]
    assert partition(x, k, ties="first_fit") == first_fit_reference(x, k)


def test_equal_whole_costs_tie_exactly_past_float_precision():
    # seven equal layers whose prefix sums pass 2**53 (as LLaMA-8B's forward FLOPs do at a large
    # micro-batch): in float64 their differences round and the first-fit cut would move
    x = [3, *[3 * 10**15 + 1] * 7, 7]
    assert partition(x, 6, ties="first_fit") == first_fit_reference(x, 6)
    assert partition(x, 6, ties="first_fit")[0] == (0, 2, 4, 6, 7, 8, 9)


def test_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty part"):
        partition([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        partition([1, -2], 1)
    with pytest.raises(ValueError, match="ties"):
        partition([1, 2], 1, ties="last")


def test_balance_prefers_block_boundaries():
    g = tiny_transformer(4)
    (b,) = find_repeated_blocks(g)
    cost = lambda op: float(op.flops)  # noqa: E731
    segs = balance(g, 4, cost)
    assert segs[0].start == 0 and segs[-1].stop == len(g.ops)
    assert all(s.stop == t.start for s, t in itertools.pairwise(segs))
    bounds = {r.start for r in b.instances} | {b.stop}
    assert all(s.stop in bounds or s.stop == len(g.ops) or s.stop <= b.start for s in segs)
    x = [cost(op) for op in g.ops]
    op_opt = partition(x, 4)[1]
    assert max(s.cost for s in segs) <= 1.05 * op_opt
    exact = balance(g, 4, cost, tolerance=0.0)
    assert max(s.cost for s in exact) == pytest.approx(op_opt)
    with pytest.raises(ValueError, match="segment"):
        balance(g, len(g.ops) + 1, cost)


def test_balance_at_block_boundaries_is_optimal_among_them():
    g = tiny_transformer(3, S=3)
    (b,) = find_repeated_blocks(g)
    rng = np.random.default_rng(1)
    costs = {op.name: float(rng.integers(0, 50)) for op in g.ops}
    cost = lambda op: costs[op.name]  # noqa: E731
    segs = balance(g, 3, cost, tolerance=10.0)  # block cuts always acceptable here
    allowed = [0, *[r.stop for r in b.instances], len(g.ops) - 1, len(g.ops)]
    allowed = sorted(set(allowed) | set(range(0, b.start + 1)) | set(range(b.stop, len(g.ops) + 1)))
    x = [cost(op) for op in g.ops]
    best = min(max(sum(x[u:v]) for u, v in itertools.pairwise((0, *c, len(g.ops))))
               for c in itertools.combinations(allowed[1:-1], 2))
    assert max(s.cost for s in segs) == best
    assert all(s.stop in allowed for s in segs)


def test_layer_chain_covers_the_graph_with_one_key_per_layer():
    g = fuse_elementwise(canonicalize(tiny_transformer(5)))
    chain = layer_chain(g)
    assert chain[0].start == 0 and chain[-1].stop == len(g.ops)
    assert all(a.stop == b.start for a, b in itertools.pairwise(chain))
    body = [L for L in chain if L.block is not None]
    assert len(body) == 5 and len({L.key for L in body}) == 1
    assert [L.instance for L in body] == list(range(5))


def test_boundary_bytes_are_the_residual_stream():
    B, S, D = 2, 4, 8
    g = tiny_transformer(3, B=B, S=S, D=D)
    chain = layer_chain(g)
    body = [L for L in chain if L.block is not None]
    assert [L.out_bytes for L in body[:-1]] == [B * S * D * 4] * 2  # only x crosses between layers
    # against brute force at every cut of the op list
    made = {t: i for i, op in enumerate(g.ops) for t in op.outputs}
    for L in chain:
        b = L.stop
        live = {t for j, op in enumerate(g.ops) if j >= b for t in op.inputs if made.get(t, b) < b}
        assert L.out_bytes == sum(g.tensors[t].nbytes for t in live)
    segs = balance(g, 3, lambda op: float(op.flops))
    assert segs[0].out_bytes == B * S * D * 4 and segs[-1].out_bytes == 0


def test_layer_chain_without_blocks_is_balanced():
    n = Net()
    x = n.input((4, 8))
    for i in range(12):
        x = n.ew("relu", n.linear(x, n.param((8, 8), f"w{i}")))
    g = n.done(x)
    chain = layer_chain(g, lambda op: float(op.flops), blocks=[], target_layers=4)
    assert len(chain) == 4 and {L.cost for L in chain} == {chain[0].cost}


def _torch_plumbing():
    import torch
    from torch import nn

    class Plumbing(nn.Module):
        """Pads, slices, transposes, splits and merges heads around a conv and linears."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(6, 4, 3, padding=1)
            self.lin = nn.Linear(4, 8)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            y = self.conv(torch.nn.functional.pad(x, (2, 1)))[:, :, 1:]  # [2, 4, 12]
            z = self.lin(y.transpose(1, 2))  # [2, 12, 8]
            h = z.reshape(2, 12, 2, 4).permute(0, 2, 1, 3)  # heads
            m = (h * h.sum(-1, keepdim=True)).permute(0, 2, 1, 3).reshape(2, 12, 8)
            return self.out(torch.relu(m)).unsqueeze(1).expand(2, 3, 12, 3)

    return Plumbing(), (torch.randn(2, 6, 10),), {}


def _hf(kind: str):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
        return tf.GPT2LMHeadModel(cfg).eval(), (ids,), {}
    if kind == "llama":  # grouped-query attention, rotary embeddings, loss on shifted labels
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, use_cache=False)
        return tf.LlamaForCausalLM(cfg).eval(), (ids,), {"labels": ids}
    cfg = tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        vocab_size=64, max_position_embeddings=16)
    return tf.BertForMaskedLM(cfg).eval(), (ids,), {}


def _small_cnn():
    torch = pytest.importorskip("torch")
    from polyparallel.models import SmallCNN

    torch.manual_seed(0)
    return SmallCNN().eval(), (torch.randn(1, 1, 28, 28),), {}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model", ["plumbing", "cnn", "gpt2", "llama", "bert"])
def test_captured_models_keep_their_dataflow(model):
    """canonicalize and fuse change no element any domain point reads, on real captures."""
    import polyparallel as pp

    built = {"plumbing": _torch_plumbing, "cnn": _small_cnn}.get(model, lambda: _hf(model))()
    g = pp.capture(*built)
    c = canonicalize(g)
    f = fuse_elementwise(c)
    rec = history(c)[-1]
    assert rec.folded and c.param_count() == g.param_count()
    assert c.flops() == sum(op.flops for op in g.ops if op.name not in rec.dropped) == f.flops()
    feeds = feeds_for(g)
    ref = run(g, feeds, generic=True)
    assert all(np.std(r) > 1e-3 for r in ref if r.size > 1)  # outputs depend on the inputs
    for h in (c, f):
        for x, y in zip(ref, run(h, feeds, generic=True), strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-12)


# -- end to end on a captured model --------------------------------------------------------------------


@pytest.mark.slow
def test_gpt2_capture_has_three_blocks():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import polyparallel as pp

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = pp.capture(model, (torch.randint(0, 64, (2, 8)),))
    for h in (g, canonicalize(g), fuse_elementwise(canonicalize(g))):
        h.validate()
        (b,) = find_repeated_blocks(h)
        assert b.count == 3
        assert {op.module.split(".")[2] for op in b.ops(h, 1) if op.module.startswith("transformer.h.")} == {"1"}
    c = canonicalize(g)
    rec = history(c)[-1]
    again = history(canonicalize(c))[-1]
    assert (again.dropped, again.folded, again.split_dims) == ((), (), 0)  # idempotent
    assert c.param_count() == g.param_count()
    assert c.flops() == sum(op.flops for op in g.ops if op.name not in rec.dropped)
    assert not [op for op in c.ops if op.kind in (OpKind.VIEW, OpKind.SPLIT) and op.module.startswith("transformer.h.")]
    assert len(layer_chain(fuse_elementwise(c))) >= 5


@pytest.mark.parametrize("name", ["polyparallel.transforms", "polyparallel.layers"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(name))
    assert res.attempted >= 3 and res.failed == 0
