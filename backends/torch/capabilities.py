r"""What the torch backend executes exactly: one set of predicates for the search and the executor.

The search (``constraints.placements="torch"``, the default) enumerates only plans these predicates
accept, and :func:`~polyparallel.backends.torch.plan_for` refuses, before any process starts, the
plans they reject, with the same sentences. Ops are classified by their :class:`~polyparallel.ir.OpKind`
and ATen target, never by their names.

**Plan level** (:func:`plan_problems`): the mesh degrees, micro-batching, memory knobs and precision
of a plan, against the model's captured graph:

* training in fp32, bf16 or fp16 (:mod:`._precision`: autocast or FSDP2 mixed precision, fp32
  master weights, a gradient scaler for fp16);
* activation recomputation (:mod:`._recompute`), also inside pipeline stages; ``full`` needs the
  model's numbered layers (``layers.<i>``, ``h.<i>``, ``blocks.<i>``), the blocks it checkpoints;
* micro-batches with pipeline stages, or without them as gradient accumulation (``_worker``);
* tensor parallelism inside pipeline stages (:mod:`._stage_tp`, checked by ``plan_for`` on the exported
  graph), and sequence parallelism (Ulysses) there (:mod:`._stage_sp`: the plan-level checks of
  ``sp_problems`` except the tensors built from positions, which the pass offsets or folds, the rest
  checked by ``plan_for`` on the exported graph), but not both together;
* sequence parallelism (Ulysses) only where it is exact (:func:`._sequence_parallel.sp_problems`:
  attention over one sequence length through ``scaled_dot_product_attention``, no position tables);
* data or sequence parallelism together with tensor parallelism only with FSDP2 (``zero_stage >= 1``):
  DDP over DTensor parameters is not executed;
* expert parallelism (``ep > 1``, :mod:`._expert_parallel`) over all the data-parallel ranks
  (``ep = dp``) with DDP (``zero_stage = 0``), no tensor, sequence or pipeline parallelism, on a model
  whose expert matmuls were captured (HF ``*Experts`` modules); other ``ep`` plans are for planning only;
* a model normalising with batch statistics (BatchNorm in training mode) neither in pipeline stages
  nor with micro-batches: each micro-batch would be normalised with its own statistics, which
  single-process training of the whole batch does not do (data parallelism is exact: the
  statistics are reduced across the replicas).

**Op level** (:func:`expressible`, :func:`edge_rule`, :func:`chain_problems`): which per-op
placements over the ``tp`` axis run, and how neighbouring placements chain. A ``Linear``
(``aten.linear`` with a parameter; ``aten.addmm`` with one, HF's ``Conv1D``, GPT-2's projections) is
column-parallel (``n``), row-parallel (``k`` or its leading factor ``k_i``) or replicated; an
embedding vocabulary-parallel (``v``) or replicated; attention split over its heads (``h...``) or
replicated; cross entropy class-parallel (``c``) or replicated; pointwise ops (elementwise, views,
concat, split) may stay split along a non-batch, non-sequence dim; a product of two activations
(``q @ k.T`` and ``p @ v`` of attention written out, as GPT-2's and Megatron's code before fused kernels)
and a softmax may be split along a dim they do not reduce that indexes every operand
(:func:`local_dims`: the heads); every other op (convolutions, norms, ...) is replicated over
``tp``. Over ``dp`` only an op's batch dim is split (:func:`dp_split_ok`).

Imports of the backend's execution modules and of the polyhedral model stay inside the functions that
use them: ``import polyparallel`` loads this module (the executor registry), and those load torch or
islpy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from polyparallel.backends.torch.op_roles import chunked_evenly, first_activation, local_dims, op_role
from polyparallel.cost_models.compute import batch_statistics_ops
from polyparallel.cost_models.memo import PRICES
from polyparallel.cost_models.spatial import splits_image_rows
from polyparallel.ir import Graph, Hint, Op, OpKind
from polyparallel.plan import Plan
from polyparallel.planning.executability import NotExecutable

__all__ = [
    "EXECUTED_DTYPES",
    "EXECUTED_RECOMPUTE",
    "EXECUTED_SCHEDULES",
    "TorchSchedule",
    "Unsupported",
    "batch_statistics",
    "chain_problems",
    "chunked_evenly",
    "dp_split_ok",
    "edge_rule",
    "expressible",
    "local_dims",
    "op_role",
    "plan_problems",
]


class Unsupported(NotExecutable):
    """The strategy asks for something this backend cannot execute exactly; the message says what
    (a ValueError, and the :class:`~polyparallel.planning.executability.NotExecutable` the planner catches)."""


@dataclass(frozen=True)
class TorchSchedule:
    """How the torch backend runs one pipeline schedule of :data:`~polyparallel.plan.PIPELINE_SCHEDULES`:
    the class of ``torch.distributed.pipelining`` that runs it (imported when a pipelined run starts;
    a chunked schedule's class takes the rank's list of stages) and ``problem(p, m)``, why that class
    cannot run ``m`` micro-batches over ``p`` stages (None when it can), beyond what the schedule's task order
    itself needs (``cost_models.pipeline.order_problem``, checked where a plan is priced and before a launch)."""

    cls: str
    problem: Callable[[int, int], str | None] = lambda p, m: None


def _one_f_one_b_problem(p: int, m: int) -> str | None:
    if m >= p:
        return None
    return (f"1f1b with {m} micro-batch(es) for {p} stages: torch's 1F1B schedule needs at least as many "
            "micro-batches as stages; use schedule 'gpipe' (the same order when every stage holds one micro-batch) or "
            f"microbatches >= {p}")


#: the pipeline schedules the torch backend runs, by name
EXECUTED_SCHEDULES: Mapping[str, TorchSchedule] = MappingProxyType({
    "gpipe": TorchSchedule("ScheduleGPipe"),
    "1f1b": TorchSchedule("Schedule1F1B", _one_f_one_b_problem),
    "interleaved": TorchSchedule("ScheduleInterleaved1F1B"),
    "looped_bfs": TorchSchedule("ScheduleLoopedBFS"),
})
EXECUTED_RECOMPUTE = ("none", "selective", "op", "full")  # activation recomputation the executor runs (._recompute)
EXECUTED_DTYPES = ("fp32", "bf16", "fp16")  # training precisions it runs (._precision)



def batch_statistics(graph: Graph) -> list[str]:
    """The ops that normalise with statistics of the batch they see (BatchNorm in training mode)."""
    return [op.name for op in batch_statistics_ops(graph)]


def _per_graph(graph: Graph, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """``compute()``, once per graph (and graph version) and ``key``: the search asks
    :func:`plan_problems` of thousands of plans of one graph, and the model-level verdicts (which
    ops Ulysses cannot split, BatchNorm, image rows) depend only on the graph and a degree or two."""
    memo = PRICES.of(graph)
    tag = ("capabilities", *key)
    if tag not in memo:
        memo[tag] = compute()
    return memo[tag]


def plan_problems(graph: Graph | None, s: Plan) -> list[str]:
    """Why the torch backend cannot execute the plan ``s`` (a cost-model ``ParallelConfig`` or a
    Strategy's ``.plan``) on the model captured as ``graph`` exactly; empty when it can.

    ``graph`` None (the model could not be captured) judges the plan alone and refuses what needs
    the graph (sequence parallelism)."""
    if not isinstance(s, Plan):  # a Strategy (or any record with the plan's fields)
        s = Plan.from_record(s)
    schedule = s.schedule
    why: list[str] = []
    if s.dtype not in EXECUTED_DTYPES:
        why.append(f"dtype {s.dtype!r}: the torch backend trains in {', '.join(EXECUTED_DTYPES)}; search with "
                   "constraints={'dtype': 'bf16'} (or 'fp32', 'fp16')")
    if s.sequence_parallel:
        why.append("sequence_parallel (Megatron's: norms, dropouts and residuals split along the sequence inside "
                   "tensor parallelism) is priced, not executed: the torch backend keeps them whole on every tp rank; "
                   "search without it (--sequence-parallel, constraints={'sequence_parallel': True}) for a plan "
                   "polyparallel train runs")
    if s.recompute not in EXECUTED_RECOMPUTE:
        why.append(f"recompute={s.recompute!r}: the torch backend recomputes {', '.join(EXECUTED_RECOMPUTE)}; search "
                   "with constraints={'recompute': 'none'}")
    elif s.recompute != "none":  # with or without pipeline stages (._recompute.recompute_chunk)
        why.extend(_recompute_problems(graph, s.recompute))
    if s.pp > 1 and s.sp > 1:  # Ulysses as a pass over the stages' exported graph (._stage_sp)
        sp_why = ["the model could not be captured to check it"] if graph is None else \
            _stage_sp_problems(graph, s.sp, heads_parts=s.tp * s.sp)
        if sp_why:
            why.append(f"sp={s.sp} inside pipeline stages (Ulysses) is not exact for this model: "
                       + "; ".join(sp_why[:3]))
    if s.pp > 1 and schedule not in EXECUTED_SCHEDULES:
        why.append(f"pipeline schedule {schedule!r}: the torch backend runs {', '.join(EXECUTED_SCHEDULES)}")
    elif s.pp > 1 and (sched_why := EXECUTED_SCHEDULES[schedule].problem(s.pp, s.microbatches)):
        why.append(sched_why)
    if s.cp > 1 and s.pp > 1:  # ring attention as a pass over the stages' exported graph (._stage_sp)
        cp_why = ["the model could not be captured to check it"] if graph is None else \
            _stage_sp_problems(graph, 1, s.cp, heads_parts=s.tp)
        if cp_why:
            why.append(f"cp={s.cp} inside pipeline stages (ring attention) is not exact for this model: "
                       + "; ".join(cp_why[:3]))
    elif s.cp > 1:
        cp_why = ["the model could not be captured to check it"] if graph is None else \
            [] if sequence_via_graph(graph, s) else list(_sp_problems(graph, 1, s.tp, s.cp))
        if cp_why:
            why.append(f"cp={s.cp} (context parallelism, ring attention) is not exact for this model: "
                       + "; ".join(cp_why[:3]))
    if s.dp * s.seq > 1 and s.tp > 1 and s.zero_stage == 0:
        why.append(f"dp·{s.seq_axis}={s.dp * s.seq} with tp={s.tp} and zero_stage=0: DDP over DTensor "
                   "parameters is not "
                   "executed; 2-D plans run with FSDP2 (zero_stage>=1)")
    if s.sp > 1 and s.pp == 1:
        sp_why = ["the model could not be captured to check it"] if graph is None else \
            [] if sequence_via_graph(graph, s) else list(_sp_problems(graph, s.sp, s.tp * s.sp))
        # the search prices sp there as image rows split
        if graph is not None and _per_graph(graph, ("image_rows",), lambda: splits_image_rows(graph)):
            why.append(f"sp={s.sp} splits image rows (spatial parallelism, halo exchanges): the search prices it, "
                       "the torch backend does not execute it; pin sp=1 (--sp 1, constraints={'sp': 1}) or "
                       "search with --placements torch")
        elif sp_why:
            why.append(f"sp={s.sp} (Ulysses sequence parallelism) is not exact for this model: "
                       + "; ".join(sp_why[:3]))
    ep = s.ep
    if ep > 1 and (ep != s.dp or s.tp > 1 or s.seq > 1 or s.pp > 1):
        why.append(f"ep={ep} with dp={s.dp} tp={s.tp} sp={s.sp} cp={s.cp} pp={s.pp}: expert parallelism is executed "
                   "only over all the data-parallel ranks (ep = dp, with DDP or FSDP2) and no tensor, sequence or "
                   "pipeline parallelism; pin ep=1 or ep=dp, or keep this strategy for planning only")
    elif ep > 1 and (graph is None or not any(d.hint is Hint.EXPERT for op in graph.ops if op.nest is not None
                                              for d in op.nest.dims)):
        why.append(f"ep={ep}: the model's graph has no expert matmul (grouped_mm of an HF experts module) to "
                   "split over the experts")
    if graph is not None and (s.pp > 1 or s.microbatches > 1):
        bn = batch_statistics(graph)
        if bn:
            why.append(f"{len(bn)} op(s) normalise with batch statistics ({bn[0]}, BatchNorm in training mode): "
                       f"with {s.microbatches} micro-batches{' in pipeline stages' if s.pp > 1 else ''} each "
                       "micro-batch would be normalised alone, unlike single-process training of the batch")
    return why


def _recompute_problems(graph: Graph | None, recompute: str) -> list[str]:
    from polyparallel.backends.torch._recompute import recompute_problems

    if graph is None:
        return recompute_problems(graph, recompute)
    return list(_per_graph(graph, ("recompute", recompute), lambda: tuple(recompute_problems(graph, recompute))))


def sequence_via_graph(graph: Graph, s: Plan) -> bool:
    """Whether a plan without pipeline stages splits the sequence (``sp`` or ``cp``) exactly only as
    the exported graph rewritten by :mod:`._stage_sp` (one stage): the model builds tensors from
    the sequence length (a causal mask, rotary positions from ``arange``) that the eager run cannot
    shard and the pass does. With tensor parallelism the stage takes the tensor-parallel pass first,
    as inside pipeline stages: the heads are split over ``tp`` (ring attention) or ``tp·sp`` (Ulysses)."""
    s = s if isinstance(s, Plan) else Plan.from_record(s)
    if s.pp > 1 or s.seq == 1:
        return False
    sp, cp = (1, s.cp) if s.cp > 1 else (s.sp, 1)
    heads = s.tp if cp > 1 else s.tp * sp
    return bool(_sp_problems(graph, sp, heads, cp)) and not _stage_sp_problems(graph, sp, cp, heads_parts=heads)


def _stage_sp_problems(graph: Graph, sp: int, cp: int = 1, heads_parts: int | None = None) -> list[str]:
    parts = heads_parts or (1 if cp > 1 else sp)
    return list(_per_graph(graph, ("stage_sp", sp, cp, parts),
                           lambda: tuple(_stage_sp_problems_of(graph, sp, cp, parts))))


def _stage_sp_problems_of(graph: Graph, sp: int, cp: int, heads_parts: int) -> list[str]:
    """:func:`._sequence_parallel.sp_problems` less what the pipeline's pass executes: an ``arange`` over
    the sequence length (position indices, rotary tables' positions, a causal mask's indices) or one
    the graph does not use (a mask's batch index) is offset or folded by :mod:`._stage_sp`, which
    checks the exported graph again when the stages are cut (e.g. that a mask is the causal one)."""
    lengths = {d.extent for op in graph.ops if OpKind(op.kind) is OpKind.ATTENTION and op.nest is not None
               for d in op.nest.dims if d.hint is Hint.SEQUENCE}
    handled = {op.name for op in graph.ops if OpKind(op.kind) is OpKind.CREATE and "arange" in op.target
               and op.outputs and (not graph.consumers(op.outputs[0])
                                   or tuple(graph.tensors[op.outputs[0]].shape) in {(n,) for n in lengths})}
    return [p for p in _sp_problems(graph, sp, heads_parts, cp)
            if not (p.startswith("op '") and p.split("'")[1] in handled and "builds a tensor from the sequence" in p)]


def _sp_problems(graph: Graph, sp: int, heads_parts: int, cp: int = 1) -> list[str]:
    from polyparallel.backends.torch._sequence_parallel import sp_problems

    return list(_per_graph(graph, ("sp", sp, heads_parts, cp), lambda: tuple(sp_problems(graph, sp, heads_parts, cp))))


# ---------------------------------------------------------------------------------------------
# op level


def dp_split_ok(op: Op, dim: str) -> bool:
    """Whether splitting ``op``'s loop dim ``dim`` over ``dp`` is what data parallelism does: the
    op's batch dim (for a loss over flattened ``(batch·seq, classes)`` logits, its row dim)."""
    if op.nest is None:
        return False
    d = next((x for x in op.nest.dims if x.name == dim), None)
    if d is None:
        return False
    if d.hint is Hint.BATCH:
        return True
    return OpKind(op.kind) is OpKind.LOSS and re.fullmatch(r"n(_0)?", dim) is not None


def expressible(g: Graph, tp: int) -> Any:
    """``expressible(op, placement)`` over a ``tp``-device mesh, for the per-stage solver (module
    docstring, op level)."""

    logits = _loss_inputs(g)

    def ok(op: Op, p: Any) -> bool:
        if not p.splits:
            return True
        if len(p.splits) > 1:
            return False
        d = p.splits[0][0]
        role = op_role(g, op)
        n = op.nest.extents[d]
        # the backend shards evenly (whole heads, Megatron pairs), except a vocabulary: the embedding
        # table, the output layer's classes and the loss over them are cut as torch.chunk cuts them
        vocab = (role == "embedding" or role == "loss" or (role == "linear" and op.outputs[0] in logits))
        if n % tp and not (vocab and chunked_evenly(n, tp)):
            return False
        if role == "loss":
            return d == "c"
        if role == "linear":
            return d == "n" or re.fullmatch(r"k(_\d+)?", d) is not None
        if role == "embedding":
            return re.fullmatch(r"v(_0)?", d) is not None
        if role == "attention":
            return d == "h" or re.fullmatch(r"h_\d+", d) is not None
        if role == "heads":
            return d in local_dims(op)
        if role == "pointwise":
            hint = next(x.hint for x in op.nest.dims if x.name == d)
            return hint not in (Hint.BATCH, Hint.SEQUENCE)
        return False

    return ok


def _loss_inputs(g: Graph) -> set[str]:
    """The tensors a cross-entropy loss reads, and what they are views of (the output layer's logits)."""
    producer = {t: op for op in g.ops for t in op.outputs}
    out: set[str] = set()
    todo = [t for op in g.ops if op_role(g, op) == "loss" for t in op.inputs]
    while todo:
        t = todo.pop()
        if t in out:
            continue
        out.add(t)
        prod = producer.get(t)
        if prod is not None and OpKind(prod.kind) is OpKind.VIEW:
            todo.extend(prod.inputs)
    return out


def _split(p: Any) -> bool:
    return bool(p.splits)


def edge_rule(g: Graph, u: Op, pu: Any, v: Op, pv: Any, pos: int) -> str | None:
    """How the torch backend runs the edge ``u -> v`` (``v``'s input ``pos``), for
    :func:`polyparallel.planning.stage_solver.solve_stage`'s ``edge_rule``.

    * ``"free"``: a column-parallel Linear feeding a head-split attention (or the products of an
      attention written out); the backend regroups the projection's rows so each rank's shard
      holds whole heads of ``q``, ``k``, ``v`` (``_tensor_parallel.head_split``): nothing moves
      although the block layouts differ.
    * ``"local"``: ``v`` computes on the local shards it is handed (a split pointwise op, attention
      or ``heads`` op, the contracted input of a row-parallel Linear, the logits of a class-parallel
      loss, the epilogue inputs of a column-parallel Linear): ``u`` must leave exactly those.
    * ``"forbid"``: such an input left whole (unless a ``heads`` op reads it whole on every rank,
      a causal mask broadcast over the heads), or shards of a split op other than a
      column-parallel Linear (which the backend gathers) read by a replicated op.
    * ``"forward"``: an input of the epilogue fused into a row-parallel Linear or a
      vocabulary-parallel embedding (GPT's residual add, the position embedding added to the token
      embedding): the backend adds it to the all-reduced, whole output, so its gradient is whole on
      every rank and moves nothing backward (the polyhedral model, which sees the epilogue inside
      the split op, would all-reduce it).
    """
    su, sv = _split(pu), _split(pv)
    ru, rv = op_role(g, u), op_role(g, v)
    if su and sv and ru == "linear" and pu.splits[0][0] == "n" and rv in ("attention", "heads"):
        return "free"
    if sv:
        first = pos == first_activation(g, v)
        d = pv.splits[0][0]
        if not first and ((rv == "linear" and d != "n") or rv == "embedding"):
            return "forward"
        if rv == "heads" and not su and not _reads_along(v, pos, d):
            return None  # read whole by every rank (a mask broadcast over the split dim)
        if rv in ("pointwise", "attention", "heads") or (rv == "linear" and (d != "n") == first) or (
                rv == "loss" and first):
            return "local" if su else "forbid"
    if su and not sv and ru in ("pointwise", "attention", "heads"):
        return "forbid"
    return None


def _reads_along(op: Op, pos: int, dim: str) -> bool:
    """Whether any statement of ``op`` indexes its input ``pos`` by loop dim ``dim``."""
    return op.nest is not None and any(dim in a.dims for st in op.nest.statements for a in st.reads
                                       if a.operand == f"in{pos}")


def chain_problems(g: Graph, placed: dict[str, Any], mesh: Any) -> list[str]:
    """Why a stage's placements (``op name -> Placement`` over ``tp``) do not chain as the torch
    backend runs them; empty when they do. The solver avoids every pair :func:`edge_rule` forbids;
    this also checks that a column-parallel Linear's consumers are all split or all replicated (it
    is gathered or not, for all of them)."""
    from polyparallel.planning.stage_solver import in_edges
    from polyparallel.poly import edge_costs

    why: list[str] = []
    for name, p in placed.items():
        op = g.op(name)
        for t, u, pos in in_edges(g, op):
            pu = placed.get(u.name)
            if pu is None:
                continue
            how = edge_rule(g, u, pu, op, p, pos)
            if how == "forbid":
                why.append(f"{op.name} ({p}) cannot read {t} from {u.name} ({pu})")
            elif how == "local":
                rs = edge_costs(g, t, op, f"in{pos}", mesh, [pu], [p]).cost(0, 0)
                if rs is not None and rs.steps:
                    why.append(f"{op.name} ({p}) needs {t} resharded from {u.name} ({pu}); the backend passes local "
                               "shards")
        if _split(p) and op_role(g, op) == "linear" and p.splits[0][0] == "n":
            cons = [c for t in op.outputs for c in g.consumers(t) if c.name in placed]
            split_cons = [c for c in cons if _split(placed[c.name])]
            if split_cons and len(split_cons) < len(cons):
                why.append(f"{name} ({p}) feeds both split and replicated ops")
    return why
