r"""Sequence parallelism of the torch backend: which models split their sequence exactly, and the
attention that crosses the split.

**Sequence parallelism** ``sp`` is what the cost model prices (DeepSpeed-Ulysses, see
``cost_models/step.py``): each ``sp`` rank holds a contiguous ``1/sp`` of every sequence, every op
runs on its shard, and each attention call is wrapped in two all-to-alls over the ``sp`` group —
``q, k, v`` from sequence-sharded ``[B, h, S/sp, d]`` to head-sharded ``[B, h/sp, S, d]``, the
output back (:class:`UlyssesAttention`, one differentiable ``all_to_all_single`` each way, on gloo
as on NCCL). Positions indexed by ``arange(S/sp)`` are offset by the
shard's first position. Gradients are averaged over the ``dp·sp`` ranks, the loss is the mean of
the ``sp`` shards' mean losses (equal token counts). Models whose graph mixes positions outside
SDPA attention, or builds other tables from the sequence length (rotary tables, explicit masks),
are refused.

Context parallelism (``cp``, ring attention: :mod:`._context_parallel`) splits the sequence on the
same mesh dim with other shards (chunks ``r`` and ``2cp-1-r`` of ``2cp``) and no head-count limit:
:func:`sp_problems`, :func:`offset_positions`, :func:`shard_tables` and :func:`sequence_shard` take
it as a parameter (:func:`shard_along`: which rows a shard holds), so the two share what makes a
model's sequence splittable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.overrides import TorchFunctionMode

from polyparallel.backends.torch._context_parallel import context_shard, shard_positions
from polyparallel.ir import Graph, Hint, Op, OpKind, TensorKind

__all__ = ["SequenceTable", "UlyssesAttention", "offset_positions", "position_embeddings", "sequence_shard",
           "sequence_tables", "shard_along", "shard_tables", "sp_problems"]

# ---------------------------------------------------------------------------------------------
# sequence parallelism (Ulysses)


def position_embeddings(graph: Graph) -> list[str]:
    """Module paths of embeddings indexed by an ``arange`` (positions), whose indices a sequence
    shard must offset."""
    out = []
    for op in graph.ops:
        if OpKind(op.kind) is OpKind.EMBEDDING and len(op.inputs) > 1:
            prod = graph.producer(op.inputs[1])
            if prod is not None and OpKind(prod.kind) is OpKind.CREATE and "arange" in prod.target:
                out.append(op.module)
    return out


def _sequence_lengths(graph: Graph) -> set[int]:
    """The sequence lengths the attention ops see (their query and key extents)."""
    return {d.extent for op in graph.ops if OpKind(op.kind) is OpKind.ATTENTION and op.nest is not None
            for d in op.nest.dims if d.hint is Hint.SEQUENCE}


def _sequence_dims(graph: Graph) -> dict[str, set[int]]:
    """Which dims of each activation hold sequence positions: dim 1 of every input, then forward
    through the ops' accesses (a loop dim indexing a sequence dim of an input is a sequence loop
    dim; an output dim indexed by one holds positions)."""
    seq: dict[str, set[int]] = {t: {1} for t in graph.inputs if len(graph.tensors[t].shape) >= 2}
    for op in graph.ops:
        loops = _sequence_loops(op, seq)
        if not loops:
            continue
        assert op.nest is not None
        for st in op.nest.statements:
            for a in st.writes:
                t = op.operand_name(a.operand)
                if t is not None:
                    seq.setdefault(t, set()).update(k for k, e in enumerate(a.index) if loops.intersection(e.dims))
    return seq


def _sequence_loops(op: Op, seq: dict[str, set[int]]) -> set[str]:
    """The loop dims of ``op`` that index a sequence dim (``seq``, :func:`_sequence_dims`) of what it reads."""
    return {d for st in (op.nest.statements if op.nest is not None else ()) for a in st.reads
            for k in seq.get(op.operand_name(a.operand) or "", ()) if k < len(a.index) for d in a.index[k].dims}


@dataclass(frozen=True)
class SequenceTable:
    """A stored table read by sequence position (rotary ``cos``/``sin``): on sequence shard ``r`` of
    ``sp`` it holds rows ``[r·S/sp, (r+1)·S/sp)`` of its dim ``dim``, so a shard reading the table
    from position 0 (``cos[:S_local]``, or the whole table broadcast) reads its own positions."""

    path: str  # the buffer's path in the model
    dim: int
    length: int  # S, the whole sequence


def sequence_tables(graph: Graph) -> tuple[list[SequenceTable], list[str]]:
    """The buffers read by sequence position that a sequence shard can hold its slice of, and why
    the others cannot be: a table must be read with one of its dims indexed exactly by a sequence
    loop dim (``cos[s, d]``, ``s`` running over the positions from 0) and no other."""
    lengths = _sequence_lengths(graph)
    length = next(iter(lengths)) if len(lengths) == 1 else None
    seq = _sequence_dims(graph)
    tables: dict[str, SequenceTable] = {}
    problems: list[str] = []
    for op in graph.ops:
        if op.nest is None or OpKind(op.kind) is OpKind.ATTENTION:
            continue
        seq_loops = _sequence_loops(op, seq)
        # pointwise nests carry no hints: a dim as long as the sequence counts as one too (a false
        # alarm refuses, it never runs something else)
        suspect = seq_loops | {d.name for d in op.nest.dims if d.hint is Hint.SEQUENCE or d.extent in lengths}
        for st in op.nest.statements:
            for a in st.reads:
                t = op.operand_name(a.operand)
                if t is None or not a.operand.startswith("in") or \
                        graph.tensors[t].kind not in (TensorKind.BUFFER, TensorKind.CONST) or not suspect & a.dims:
                    continue
                spec = graph.tensors[t]
                at = [k for k, e in enumerate(a.index) if suspect.intersection(e.dims)]
                e = a.index[at[0]] if len(at) == 1 else None
                exact = e is not None and len(e.dims) == 1 and next(iter(e.dims)) in seq_loops and \
                    str(e) == next(iter(e.dims))
                table = SequenceTable(str(spec.origin or ""), at[0], length) if exact and length and \
                    spec.kind is TensorKind.BUFFER and spec.origin and spec.shape[at[0]] >= length else None
                if table is None or tables.get(t, table) != table:
                    problems.append(f"op {op.name!r} reads {spec.kind} {t!r} by sequence position as {a}, not as "
                                    "a table of positions along one dim: every shard would read the first positions")
                else:
                    tables[t] = table
    return list(tables.values()), problems


def sp_problems(graph: Graph, sp: int, heads_parts: int, cp: int = 1) -> list[str]:
    """Why running ``graph`` with its sequence split over ``sp`` ranks (Ulysses), or over ``cp``
    ranks by ring attention (``sp = 1``), would compute something else than the unsplit model; empty
    when it is exact. The tables read by sequence position are sharded with the sequence
    (:func:`sequence_tables`). ``heads_parts``: what the attention's heads are split over (``tp·sp``;
    ring attention keeps a rank's heads whole: ``tp``)."""
    problems: list[str] = []
    # ring attention cuts the sequence into 2·cp chunks (load-balanced causal sharding)
    div, label = (2 * cp, f"2·cp = {2 * cp}") if cp > 1 else (sp, f"sp={sp}")
    # the sequence length is the attention's query extent; every input is split along its dim 1
    lengths = _sequence_lengths(graph)
    if len(lengths) != 1:
        problems.append("the model has no attention over one sequence length: no sequence dim to split"
                        if not lengths else f"attention ops see several sequence lengths {sorted(lengths)}")
    for t in graph.inputs:
        shape = graph.tensors[t].shape
        if len(lengths) == 1 and (len(shape) < 2 or shape[1] not in lengths):
            problems.append(f"input {t!r} of shape {shape} has no sequence dim 1 of length {min(lengths)}")
        elif len(shape) >= 2 and shape[1] % div:
            problems.append(f"input {t!r} has sequence length {shape[1]}, not divisible by {label}")
    pos = set(position_embeddings(graph))
    for op in graph.ops:
        kind = OpKind(op.kind)
        if kind is OpKind.ATTENTION:
            if "scaled_dot_product_attention" not in op.target:
                problems.append(f"attention op {op.name!r} ({op.target}) is not torch's scaled_dot_product_attention, "
                                "the call " + ("ring attention replaces" if cp > 1 else
                                               "the sequence-parallel all-to-alls wrap"))
            elif op.nest is not None:
                heads = next((d.extent for d in op.nest.dims if d.hint is Hint.HEAD), None)
                if heads is None or heads % heads_parts:
                    problems.append(f"attention op {op.name!r}: {heads} heads do not split over {heads_parts} ranks "
                                    f"({'tp' if cp > 1 else 'tp·sp'})")
        elif kind is OpKind.CREATE:
            users = graph.consumers(op.outputs[0]) if op.outputs else []
            if not users or any(OpKind(u.kind) is not OpKind.EMBEDDING or u.module not in pos for u in users):
                problems.append(f"op {op.name!r} ({op.target}) builds a tensor from the sequence length that is not "
                                "only a position-embedding index (rotary tables, masks): its values would be per shard")
        elif kind is not OpKind.LOSS and op.nest is not None:
            mixed = [d.name for d in op.nest.dims if d.hint is Hint.SEQUENCE
                     and any(d.name in st.reduction_dims() for st in op.nest.statements)]
            if mixed:
                problems.append(f"op {op.name!r} ({op.target}) reduces over sequence dim {mixed[0]!r} outside "
                                "attention: a sequence shard would see only its part")
    found, why = sequence_tables(graph)
    problems.extend(why)
    for t in found:
        if t.length % div:
            problems.append(f"buffer {t.path!r} is read by sequence position over {t.length} positions, not "
                            f"divisible by {label}")
    return problems


def shard_along(t: torch.Tensor, dim: int, shards: int, rank: int, ring: bool) -> torch.Tensor:
    """Sequence shard ``rank`` of ``shards`` of ``t`` along ``dim``: a contiguous block (Ulysses), or
    with ``ring`` the load-balanced positions of context parallelism (:func:`._context_parallel.context_shard`)."""
    if ring:
        return context_shard(t, shards, rank, dim)
    n = t.shape[dim] // shards
    return t.narrow(dim, rank * n, n)


def offset_positions(module: nn.Module, shards: int, rank: int, ring: bool) -> Any:
    """Pre-hook on a position embedding: ``arange(S/shards)`` becomes this shard's positions,
    ``rank·S/shards + arange`` (Ulysses), or with ``ring`` context parallelism's
    (:func:`._context_parallel.shard_positions`)."""

    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        idx = args[0]
        n = idx.shape[-1]
        if ring:
            return (shard_positions(n * shards, shards, rank, idx.device)[idx], *args[1:])
        return (idx + rank * n, *args[1:])

    return module.register_forward_pre_hook(hook, prepend=True)


class UlyssesAttention(TorchFunctionMode):
    """Inside this mode every ``F.scaled_dot_product_attention`` on sequence shards runs on whole
    sequences of ``1/sp`` of the heads.

    With ``p = sp``, rank ``r`` holds ``x[:, :, rS/p:(r+1)S/p]`` of ``[B, h, S, d]``. It cuts its
    heads into ``p`` blocks and sends block ``j`` to rank ``j`` (one ``all_to_all_single``, autograd
    through it): rank ``r`` receives head block ``r`` of every sequence block, in sequence order. The
    output goes back by the inverse exchange. Each exchange moves ``(p-1)/p`` of the local tensor,
    the all-to-all volume the cost model prices.
    """

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh
        self.p = mesh.size()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, self.mesh))

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, h, s, d = x.shape
        y = self._exchange(x.reshape(B, self.p, h // self.p, s, d).transpose(0, 1))  # [p(seq block), B, h/p, s, d]
        return y.permute(1, 2, 0, 3, 4).reshape(B, h // self.p, self.p * s, d)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        B, hp, S, d = x.shape
        y = self._exchange(x.reshape(B, hp, self.p, S // self.p, d).permute(2, 0, 1, 3, 4))  # [p(head block), ...]
        return y.transpose(0, 1).reshape(B, self.p * hp, S // self.p, d)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if kwargs.get("attn_mask") is not None or (len(args) > 3 and args[3] is not None):
            raise ValueError("sequence-parallel attention with an explicit attn_mask is not executed; "
                             "use is_causal=True or sp=1")
        if any(t.dim() != 4 for t in args[:3]):
            raise ValueError("sequence-parallel attention expects q, k, v of shape [batch, heads, seq, head_dim]")
        q, k, v = (self.seq_to_heads(t) for t in args[:3])
        return self.heads_to_seq(func(q, k, v, *args[3:], **kwargs))



def shard_tables(model: nn.Module, tables: Any, shards: int, rank: int, ring: bool) -> None:
    """Replace each table ``(buffer path, dim, sequence length)`` by the rows sequence shard
    ``rank`` of ``shards`` reads (:class:`SequenceTable`, :func:`shard_along`)."""
    for path, dim, length in tables:
        owner, _, name = path.rpartition(".")
        module = model.get_submodule(owner)
        rows = shard_along(getattr(module, name).narrow(dim, 0, length), dim, shards, rank, ring)
        setattr(module, name, rows.clone())


def sequence_shard(t: torch.Tensor, plan: Any, mesh: Any) -> torch.Tensor:
    """This sequence shard's part of dim 1 (the sequence) of an input or label batch: a contiguous
    block of ``1/sp`` (Ulysses), or the load-balanced chunks of context parallelism
    (:func:`._context_parallel.context_shard`). The mesh's ``"sp"`` dim is the sequence split."""
    if plan.seq == 1:
        return t
    if t.dim() < 2 or t.shape[1] % plan.seq_chunks:
        raise ValueError(f"splitting the sequence over {plan.seq_axis}={plan.seq} needs inputs and labels of shape "
                         f"(batch, seq, ...) with seq divisible by {plan.seq_chunks}; got {tuple(t.shape)}")
    return shard_along(t, 1, plan.seq, mesh["sp"].get_local_rank(), plan.cp > 1)
