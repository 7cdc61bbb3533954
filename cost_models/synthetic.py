"""Reference graphs built directly from the op builders: an MLP and a GPT/LLaMA-style decoder.

They let the cost models be validated on known architectures (published training runs,
hand-computed memory) without a frontend, and give the search realistic large graphs to
plan. Ops carry ``module = "layers.<i>"`` so pipeline stages and recomputation segments
follow layer boundaries, as a captured model's would.

Examples:
    >>> g = gpt_graph(layers=2, hidden=64, heads=4, seq=16, vocab=100, batch=2)
    >>> g.param_count() == 2 * (12 * 64 * 64 + 13 * 64) + 100 * 64 + 16 * 64 + 2 * 64
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from polyparallel import ops
from polyparallel.ir import Graph, LoopNest, Op, OpKind, TensorKind, TensorSpec

__all__ = ["gpt_graph", "mlp_graph"]


class _GraphMaker:
    def __init__(self, name: str, dtype: str = "float32") -> None:
        self.g = Graph(name=name, source="synthetic")
        self.dtype = dtype
        self.n = 0

    def tensor(self, name: str, shape: Sequence[int], kind: TensorKind = TensorKind.ACTIVATION,
               dtype: str | None = None) -> str:
        self.g.add_tensor(TensorSpec(name, tuple(shape), dtype or self.dtype, kind))
        if kind is TensorKind.INPUT:
            self.g.inputs.append(name)
        return name

    def param(self, name: str, shape: Sequence[int]) -> str:
        return self.tensor(name, shape, TensorKind.PARAM)

    def op(self, kind: OpKind, target: str, nest: LoopNest, inputs: Sequence[str], out_shape: Sequence[int],
           module: str, dtype: str | None = None, attrs: tuple[tuple[str, Any], ...] = ()) -> str:
        self.n += 1
        name = f"{target}_{self.n}"
        out = self.tensor(f"t{self.n}", out_shape, dtype=dtype)
        self.g.add_op(Op(name, kind, target, tuple(inputs), (out,), nest, module=module, attrs=attrs))
        return out

    def linear(self, x: str, w: str, b: str | None, module: str) -> str:
        xs, ws = self.g.shape(x), self.g.shape(w)
        nest = ops.linear(xs, ws, self.g.shape(b) if b else None)
        return self.op(OpKind.CONTRACTION, "linear", nest, [x, w] + ([b] if b else []), (*xs[:-1], ws[0]), module)

    def pointwise(self, target: str, inputs: Sequence[str], module: str) -> str:
        shapes = [self.g.shape(t) for t in inputs]
        out = ops.broadcast_shapes(*shapes)
        nest = ops.elementwise(out, shapes, flops=ops.flops_per_element(target))
        return self.op(OpKind.ELEMENTWISE, target, nest, inputs, out, module)

    def view(self, x: str, out: Sequence[int], module: str, perm: Sequence[int] | None = None) -> str:
        xs = self.g.shape(x)
        if perm is not None:
            return self.op(OpKind.VIEW, "permute", ops.permute(xs, perm), [x], [xs[i] for i in perm], module)
        return self.op(OpKind.VIEW, "reshape", ops.reshape(xs, out), [x], out, module)

    def norm(self, x: str, rms: bool, prefix: str, module: str) -> str:
        h = self.g.shape(x)[-1]
        w = self.param(f"{prefix}.weight", (h,))
        b = None if rms else self.param(f"{prefix}.bias", (h,))
        nest = ops.layer_norm(self.g.shape(x), (h,), weight=True, bias=not rms, rms=rms)
        return self.op(OpKind.NORM, "rms_norm" if rms else "layer_norm", nest, [x, w] + ([b] if b else []),
                       self.g.shape(x), module)


def mlp_graph(batch: int, widths: Sequence[int], classes: int | None = None, act: str = "relu",
              bias: bool = True) -> Graph:
    """``x[batch, widths[0]] -> linear -> act -> ... -> linear -> cross-entropy``.

    Hidden layers map ``widths[i] -> widths[i+1]``; the last layer maps to ``classes``
    (default ``widths[-1]``). Layer ``i``'s ops have module ``layers.<i>``.
    """
    if len(widths) < 1 or batch < 1:
        raise ValueError("mlp_graph needs batch >= 1 and at least one width")
    m = _GraphMaker("mlp")
    x = m.tensor("x", (batch, widths[0]), TensorKind.INPUT)
    y = m.tensor("y", (batch,), TensorKind.INPUT, dtype="int64")
    dims = [*widths, classes or widths[-1]]
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        mod = f"layers.{i}"
        w = m.param(f"layers.{i}.weight", (b, a))
        bb = m.param(f"layers.{i}.bias", (b,)) if bias else None
        x = m.linear(x, w, bb, mod)
        if i < len(dims) - 2:
            x = m.pointwise(act, [x], mod)
    loss = m.op(OpKind.LOSS, "cross_entropy", ops.cross_entropy(m.g.shape(x), (batch,)), [x, y], (), "loss")
    m.g.outputs.append(loss)
    return m.g


def gpt_graph(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int = 1, *,
              ffn: int | None = None, kv_heads: int | None = None, norm: str = "layer", mlp: str = "gelu",
              bias: bool = True, tied: bool = True, positions: bool = True, causal: bool = False,
              dropout: bool = False) -> Graph:
    """A decoder-only transformer (GPT-2/3 by default; ``norm="rms", mlp="swiglu", kv_heads=..,
    bias=False, tied=False, positions=False`` for LLaMA).

    ``causal=True`` counts only the unmasked half of attention (flash-style kernels skip it);
    ``False`` prices the full score matrix, as kernels that mask after computing do.
    ``dropout=True`` adds the hidden-state dropouts of GPT-2/3 training (after the embedding,
    the attention projection and the MLP), each an elementwise op, and the dropout of the attention
    probabilities (``attr["dropout"]`` on the attention op; priced when attention runs unfused).
    """
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    kvh = kv_heads or heads
    d = hidden // heads
    f = ffn or 4 * hidden
    rms = norm == "rms"
    m = _GraphMaker("gpt")
    ids = m.tensor("ids", (batch, seq), TensorKind.INPUT, dtype="int64")
    labels = m.tensor("labels", (batch * seq,), TensorKind.INPUT, dtype="int64")
    wte = m.param("wte", (vocab, hidden))
    x = m.op(OpKind.EMBEDDING, "embedding", ops.embedding((vocab, hidden), (batch, seq)), [wte, ids],
             (batch, seq, hidden), "embed")
    if positions:
        wpe = m.param("wpe", (seq, hidden))
        x = m.pointwise("add", [x, wpe], "embed")
    if dropout:
        x = m.pointwise("dropout", [x], "embed")
    for i in range(layers):
        mod, pre = f"layers.{i}", f"layers.{i}"
        h1 = m.norm(x, rms, f"{pre}.ln1", mod)

        def proj(inp: str, name: str, out_f: int, in_f: int, mod: str = mod, pre: str = pre) -> str:
            w = m.param(f"{pre}.{name}.weight", (out_f, in_f))
            b = m.param(f"{pre}.{name}.bias", (out_f,)) if bias else None
            return m.linear(inp, w, b, mod)

        q = proj(h1, "q", hidden, hidden)
        k = proj(h1, "k", kvh * d, hidden)
        v = proj(h1, "v", kvh * d, hidden)
        q4 = m.view(m.view(q, (batch, seq, heads, d), mod), (), mod, perm=(0, 2, 1, 3))
        k4 = m.view(m.view(k, (batch, seq, kvh, d), mod), (), mod, perm=(0, 2, 1, 3))
        v4 = m.view(m.view(v, (batch, seq, kvh, d), mod), (), mod, perm=(0, 2, 1, 3))
        att = m.op(OpKind.ATTENTION, "attention",
                   ops.attention(m.g.shape(q4), m.g.shape(k4), m.g.shape(v4), causal=causal),
                   [q4, k4, v4], (batch, heads, seq, d), mod,
                   # dropout on the attention probabilities: a kernel of its own when attention runs unfused
                   attrs=(("dropout", True),) if dropout else ())
        att = m.view(m.view(att, (), mod, perm=(0, 2, 1, 3)), (batch, seq, hidden), mod)
        o = proj(att, "o", hidden, hidden)
        if dropout:
            o = m.pointwise("dropout", [o], mod)
        x = m.pointwise("add", [x, o], mod)
        h2 = m.norm(x, rms, f"{pre}.ln2", mod)
        if mlp == "swiglu":
            gate = m.pointwise("silu", [proj(h2, "gate", f, hidden)], mod)
            up = proj(h2, "up", f, hidden)
            act = m.pointwise("mul", [gate, up], mod)
        else:
            act = m.pointwise(mlp, [proj(h2, "fc1", f, hidden)], mod)
        down = proj(act, "fc2", hidden, f)
        if dropout:
            down = m.pointwise("dropout", [down], mod)
        x = m.pointwise("add", [x, down], mod)
    x = m.norm(x, rms, "ln_f", "head")
    w_out = wte if tied else m.param("lm_head.weight", (vocab, hidden))
    logits = m.linear(x, w_out, None, "head")
    flat = m.view(logits, (batch * seq, vocab), "head")
    loss = m.op(OpKind.LOSS, "cross_entropy", ops.cross_entropy((batch * seq, vocab), (batch * seq,)),
                [flat, labels], (), "head")
    m.g.outputs.append(loss)
    return m.g
