"""How the torch backend splits each op over ``tp``: the op's role, and how ``torch.chunk`` cuts a dim.

Read by the op-level predicates of :mod:`.capabilities` and by the executor's tensor-parallel
plans (:mod:`._tensor_parallel`), which :mod:`.capabilities` imports in turn (kept apart so the two
do not import each other).
"""

from __future__ import annotations

from polyparallel.cost_models.megatron_rule import vocabulary_lookups
from polyparallel.ir import Graph, Hint, Op, OpKind, TensorKind, target_base

__all__ = ["chunked_evenly", "first_activation", "local_dims", "op_role"]

_POINTWISE = (OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.CONCAT, OpKind.SPLIT)
_PRODUCTS = ("matmul", "bmm", "einsum")  # products of activations a rank computes on its shards


def _has_param(g: Graph, op: Op) -> bool:
    return any(g.tensors[t].kind is TensorKind.PARAM for t in op.inputs)


def first_activation(g: Graph, op: Op) -> int:
    """The position of ``op``'s first input that is not a parameter: a Linear's contracted input
    (``x`` of ``linear(x, w, b)``, and of ``addmm(b, x, w)``, HF ``Conv1D``'s op); the inputs after it
    belong to epilogues fused into the op."""
    return next((i for i, t in enumerate(op.inputs) if g.tensors[t].kind is not TensorKind.PARAM), 0)


def op_role(g: Graph, op: Op) -> str:
    """How the backend can split ``op`` over ``tp``: ``loss`` (class-parallel cross entropy),
    ``linear`` (an ``nn.Linear``, or HF's ``Conv1D`` computing ``addmm(b, x, w)``: column/row-parallel),
    ``embedding`` (a vocabulary: row-parallel),
    ``attention`` (head-parallel), ``pointwise`` (follows its input's split), ``heads`` (a product
    of two activations or a softmax, computed on local shards along one of :func:`local_dims`) or
    ``other`` (replicated)."""
    kind = OpKind(op.kind)
    if kind is OpKind.LOSS and "cross_entropy" in op.target:
        return "loss"
    if kind is OpKind.CONTRACTION and _has_param(g, op) and (_target_is(op, "linear") or _target_is(op, "addmm")):
        return "linear"
    if kind is OpKind.EMBEDDING and op.name in vocabulary_lookups(g):  # a position table stays whole
        return "embedding"
    if kind is OpKind.ATTENTION:
        return "attention"
    if kind in _POINTWISE and not _has_param(g, op):
        return "pointwise"
    if (kind is OpKind.CONTRACTION and not _has_param(g, op) and target_base(op.target) in _PRODUCTS) or (
            kind is OpKind.SOFTMAX and not _has_param(g, op)):
        return "heads"
    return "other"


def local_dims(op: Op) -> tuple[str, ...]:
    """The dims a ``heads`` op (:func:`op_role`) computes correctly on local shards along: not the
    batch or the sequence (data and sequence parallelism split those), reduced by none of its
    statements (a contraction's ``k``, a softmax's row), and indexing every tensor its first
    statement reads (a batched product's batch dims: for ``q @ k.T`` over ``[B, h, S, d]``, the
    heads ``h``; a whole tensor broadcast along the others, as a causal mask, is read whole)."""
    if op.nest is None:
        return ()
    reduced = {d for st in op.nest.statements for d in st.reduction_dims()}
    first = op.nest.statements[0]
    reads = [a for a in first.reads if a.operand.startswith("in")]
    inputs = {a.operand for a in reads}
    return tuple(d.name for d in op.nest.dims
                 if d.hint not in (Hint.BATCH, Hint.SEQUENCE) and d.name not in reduced and reads
                 and all(any(d.name in a.dims for a in reads if a.operand == i) for i in inputs))


def _target_is(op: Op, base: str) -> bool:
    return target_base(op.target) == base


def chunked_evenly(n: int, tp: int) -> bool:
    """Whether ``torch.chunk`` cuts ``n`` rows into ``tp`` non-empty blocks (``ceil(n/tp)`` each, the
    last fewer), as an uneven vocabulary split needs: 50257 over 4 yes, 5 over 4 no (2, 2, 1)."""
    return n >= tp and -(-n // tp) * (tp - 1) < n
