"""Megatron-LM's tensor parallelism (and DeepSpeed-Ulysses' sequence parallelism), propagated over the
IR without per-op placements: the price of a plan whose ops the per-stage solver has not placed,
and the placement the solver always has as a candidate.

Each tensor is *full* or *split* over the ``tp`` group. A contraction/conv with a parameter reading
a full input is column-parallel (output split, backward all-reduce of its input gradient, once per
input tensor); reading a split input it is row-parallel (output full, forward all-reduce of the
output). A Linear is column-parallel only where Megatron pairs it (:func:`paired_columns`: its
output reaches, through pointwise ops only, a row-parallel partner, attention or the loss); one
whose output also feeds a norm or the residual stream (ELECTRA's embedding projection, an input
projection before the blocks) stays whole, as Megatron keeps such layers. A vocabulary embedding is
row-parallel (forward all-reduce). Any other op on a split input stays split (heads, activation
functions); a loss on split logits needs three per-row scalars all-reduced. Only a vocabulary is
split (:func:`vocabulary_lookups`): a position table stays whole, as Megatron keeps its position
embeddings. Split ops do ``1/tp`` of the work. With Megatron sequence parallelism each all-reduce
becomes reduce-scatter + all-gather (same volume) and the remaining ops run on ``1/tp`` of the
sequence. Under Ulysses ``sp`` every op does ``1/sp`` of the work and each attention op all-to-alls
its inputs and output, forward and backward; on images ``sp`` splits rows instead (:mod:`.spatial`:
halos, gathers and statistics from the polyhedral model).

Under context parallelism ``cp`` (ring attention, load-balanced causal sharding: shard ``r`` holds
sequence chunks ``r`` and ``2cp-1-r`` of ``2cp``) every op also does ``1/cp`` of the work, and each
attention op passes its local ``K, V`` block to the next shard ``cp - 1`` times in the forward
pass; the backward pass passes ``K, V`` on ``cp - 1`` times and the ``dK, dV`` accumulators ``cp``
times (home again after a full turn): ``2cp - 1`` point-to-point transfers of the same size. The
K/V transfers run while the attention computes the block in hand, the accumulators' after it; what
the step model charges is the part the compute does not hide (``step.py``).
"""

from __future__ import annotations

import math
from typing import Any

from polyparallel.ir import Graph, Hint, Op, OpKind, TensorKind, element_bytes, target_base
from polyparallel.ops import CAST_TARGETS, COPY_TARGETS

from .comm import collective_time
from .memo import PRICES
from .parallel_config import OpPlan, ParallelConfig
from .spatial import spatial_plan

__all__ = ["op_plans", "op_roles", "paired_columns", "ring_dominated", "tensor_bytes", "vocabulary_lookups"]


def tensor_bytes(graph: Graph, name: str, dtype: str) -> float:
    t = graph.tensors[name]
    w = element_bytes(t.dtype, dtype)
    return t.numel * w


def op_plans(graph: Graph, cfg: ParallelConfig) -> list[OpPlan]:
    """Per op: its work split and its tensor/sequence-parallel collectives (read-only, memoised)."""
    key = ("plans", *cfg.split_key, cfg.dtype, cfg.op_plans)
    cache = PRICES.of(graph)
    plans = cache.get(key)
    if plans is None:
        if cfg.op_plans is None:
            plans = _propagate(graph, cfg)
        elif len(cfg.op_plans) != len(graph.ops):
            raise ValueError(f"ParallelConfig.op_plans has {len(cfg.op_plans)} entries but graph {graph.name!r} has "
                             f"{len(graph.ops)} ops; give one OpPlan per op, in op order")
        else:
            plans = list(cfg.op_plans)
        cache[key] = plans
    return plans


def _propagate(graph: Graph, cfg: ParallelConfig) -> list[OpPlan]:
    tp, sp, cp = cfg.tp, cfg.sp, cfg.cp
    if cp > 1 and not any(OpKind(op.kind) is OpKind.ATTENTION for op in graph.ops):
        raise ValueError(f"cp={cp}: context parallelism splits a token sequence around attention, and the model has "
                         "no attention op; pin cp=1 (sp splits image rows)")
    if tp == 1 and sp == 1 and cp == 1:
        return [OpPlan()] * len(graph.ops)
    # the blocks of a deep model repeat their ops' plans: one object per distinct plan (a search
    # keeps the plans of every configuration it prices)
    distinct: dict[OpPlan, OpPlan] = {}
    split_state: dict[str, bool] = {}
    grad_ar_done: set[str] = set()
    plans: list[OpPlan] = []
    ar = ("reduce_scatter", "all_gather") if cfg.sequence_parallel else ("all_reduce",)
    vocab = vocabulary_lookups(graph)
    paired = paired_columns(graph) if tp > 1 else frozenset()
    for op, (kind, acts, has_param) in zip(graph.ops, op_roles(graph)):
        split, param_split = 1.0, 1.0
        tp_fwd: list[tuple[str, float]] = []
        tp_bwd: list[tuple[str, float]] = []
        sp_fwd: list[tuple[str, float]] = []
        sp_bwd: list[tuple[str, float]] = []
        any_split = any(split_state.get(t, False) for t in acts)
        out_split = False
        if tp > 1:
            if kind is OpKind.CONTRACTION and has_param and not (acts and split_state.get(acts[0], False)) \
                    and op.name not in paired:
                pass  # no Megatron partner: the Linear stays whole
            elif kind in (OpKind.CONTRACTION, OpKind.CONV) and has_param:
                split = param_split = tp
                # the contracted input comes first; inputs after it belong to pointwise epilogues fused
                # into the op (LLaMA's silu(gate(h)) * up(h) reads up's column-split output): they follow
                # the output's layout and do not make the contraction row-parallel
                if acts and split_state.get(acts[0], False):  # row-parallel: partial sums reduced forward
                    for t in op.outputs:
                        tp_fwd += [(c, tensor_bytes(graph, t, cfg.dtype)) for c in ar]
                else:  # column-parallel: the input gradient is reduced in the backward pass
                    out_split = True
                    for t in acts[:1]:  # graph inputs need no gradient
                        if t not in grad_ar_done and graph.tensors[t].kind is not TensorKind.INPUT:
                            grad_ar_done.add(t)
                            tp_bwd += [(c, tensor_bytes(graph, t, cfg.dtype)) for c in ar]
            elif kind is OpKind.EMBEDDING and has_param and op.name in vocab:
                split = param_split = tp
                for t in op.outputs:
                    tp_fwd += [(c, tensor_bytes(graph, t, cfg.dtype)) for c in ar]
            elif any_split and kind is OpKind.LOSS:
                split = tp
                rows = graph.tensors[acts[0]].numel / max(1, graph.tensors[acts[0]].shape[-1])
                tp_fwd.append(("all_reduce", 3 * rows * 4))
            elif any_split and kind not in (OpKind.OPAQUE, OpKind.RECURRENT):
                split = tp
                out_split = True
            elif any_split:  # an op we cannot split: gather its inputs
                for t in acts:
                    if split_state.get(t, False):
                        tp_fwd.append(("all_gather", tensor_bytes(graph, t, cfg.dtype)))
            elif cfg.sequence_parallel:
                split = tp  # norms, dropout, residuals on 1/tp of the sequence
        for t in op.outputs:
            split_state[t] = out_split
        image = spatial_plan(graph, op, sp, cfg.dtype) if sp > 1 else None
        if image is not None:  # sp splits image rows: halos and gathers from the polyhedral model
            split *= image[0]
            sp_fwd, sp_bwd = list(image[1]), list(image[2])
        elif sp > 1:
            _sequence_splits(op, sp)
            split *= sp
            if kind is OpKind.ATTENTION:
                for t in list(acts) + list(op.outputs):
                    b = tensor_bytes(graph, t, cfg.dtype) / (sp * (tp if any_split else 1))
                    sp_fwd.append(("all_to_all", b))
                    sp_bwd.append(("all_to_all", b))
        elif cp > 1:
            _sequence_splits(op, cp)
            split *= cp
            if kind is OpKind.ATTENTION:
                kv = sum(tensor_bytes(graph, t, cfg.dtype) for t in acts[1:3]) / (cp * (tp if any_split else 1))
                sp_fwd += [("shift", kv)] * (cp - 1)
                sp_bwd += [("shift", kv)] * (2 * cp - 1)
        plan = OpPlan(split, tuple(tp_fwd), tuple(tp_bwd), tuple(sp_fwd), tuple(sp_bwd), param_split)
        plans.append(distinct.setdefault(plan, plan))
    return plans


# ops a column-parallel output is handed to sharded, as Megatron's partners take it (a softmax is not:
# one over the split features needs all of them, as an MoE router's does; the softmax of attention
# written out is reached through the product q @ k.T, a contraction without a parameter)
_PARTNERS = (OpKind.ATTENTION, OpKind.LOSS)
_ALONG = (OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.SPLIT, OpKind.CONCAT)  # pointwise: the split passes through


def _reduced(op: Op) -> int:
    """How many values each output of ``op`` reduces (the product of its reduction dims' extents; 0
    when it reduces none or has no loop nest)."""
    if op.nest is None:
        return 0
    dims = {d for st in op.nest.statements for d in st.reduction_dims()}
    return math.prod(op.nest.extents[d] for d in dims) if dims else 0


def paired_columns(graph: Graph) -> frozenset[str]:
    """The Linears (contractions with a parameter) Megatron's rule may split by columns: every use of
    the output reaches, through pointwise ops only, the contracted input of another Linear (its
    row-parallel partner), an attention op (or the product ``q @ k.T`` of one written out) or the
    loss; an epilogue fused into a Linear (LLaMA's ``silu(gate(h)) * up(h)``) and a reduction over
    fewer values than the Linear's features (QK-norm) pass the split on. A use that reaches a norm
    over all the features, a softmax, any other op or the graph's output does not take a sharded
    tensor, nor does a pointwise op combining it with a whole tensor of its size (a residual) that
    no Linear beside it computes (memoised per graph)."""
    cache = PRICES.of(graph)
    hit = cache.get(("paired columns",))
    if hit is not None:
        return hit
    roles = dict(zip((op.name for op in graph.ops), op_roles(graph)))
    linears = [op for op in graph.ops if roles[op.name][0] is OpKind.CONTRACTION and roles[op.name][2]]
    outputs_by_input: dict[tuple[str, ...], set[str]] = {}  # a Linear's first activation -> the outputs of its readers
    for op in linears:
        outputs_by_input.setdefault(roles[op.name][1][:1], set()).update(op.outputs)

    def split_alike(x: str, siblings: set[str]) -> bool:
        """Whether ``x`` comes, through pointwise ops, from the output of a Linear reading the same input
        as the candidate (LLaMA's ``up`` beside ``gate``), which would be split alike."""
        frontier, seen = [x], {x}
        while frontier:
            t = frontier.pop()
            if t in siblings:
                return True
            prod = graph.producer(t)
            if prod is None or roles[prod.name][0] not in _ALONG:
                continue
            frontier += [i for i in roles[prod.name][1] if i not in seen]
            seen.update(roles[prod.name][1])
        return False

    def pairs(op: Op) -> bool:
        width = graph.tensors[op.outputs[0]].shape[-1]
        siblings = outputs_by_input[roles[op.name][1][:1]]
        reached = set(op.outputs)  # the tensors the split reaches
        frontier = list(reached)
        while frontier:
            t = frontier.pop()
            if not graph.consumers(t):
                return False  # the graph's output
            for u in graph.consumers(t):
                kind, acts, has_param = roles[u.name]
                partner = kind is OpKind.CONTRACTION and has_param and acts and acts[0] == t  # row-parallel
                if partner or kind in _PARTNERS or (kind is OpKind.CONTRACTION and not has_param):
                    continue
                # a norm or reduction over fewer values than the Linear's features stays within a block
                # (QK-norm over each head's features); one over all of them (a LayerNorm) needs them all
                within = kind in (OpKind.REDUCE, OpKind.NORM) and 0 < _reduced(u) < width
                if kind not in _ALONG and kind is not OpKind.CONTRACTION and not within:  # (or a fused epilogue)
                    return False
                # combined with a whole tensor as large (a residual), not one broadcast (rotary tables, masks)
                if kind in _ALONG and any(x not in reached and graph.tensors[x].numel >= graph.tensors[t].numel
                                          and not split_alike(x, siblings) for x in acts):
                    return False
                frontier += [o for o in u.outputs if o not in reached]
                reached.update(u.outputs)
        return True

    hit = cache[("paired columns",)] = frozenset(op.name for op in linears if pairs(op))
    return hit


def ring_dominated(graph: Graph, cluster: Any, cfg: ParallelConfig, group: list[int]) -> bool:
    """Whether ring attention (``cfg.cp``) can never be faster than Ulysses at the same degree on the
    sequence group ``group``, so the search need not price it where Ulysses runs.

    The two split every op's work alike and hold the same activations; ring attention computes its
    attention as smaller kernels (never faster), and of its ``2cp - 1`` equal backward shifts per
    attention the ``cp`` of dK/dV are exposed whatever the compute (:mod:`.step`): ``2·S·h_kv·d``
    values in all, against Ulysses' all-to-alls of ``8(p-1)/p²·S·h·d``. Both are read off the plans'
    events (:func:`op_plans`) and priced on this group's links at the graph's micro-batch and a
    thousand times its bytes (latency- and bandwidth-bound); ring attention is dominated when its
    exposed part costs no less in both (grouped K/V heads, ``h_kv < h``, are what let it win)."""
    cp = cfg.cp
    if cp == 1:
        return False
    try:
        ring, ulysses = op_plans(graph, cfg), op_plans(graph, cfg.replace(sp=cp, cp=1, op_plans=None))
    except ValueError:  # Ulysses cannot split this model's sequence: nothing dominates ring attention
        return False

    def seconds(events: tuple[tuple[str, float], ...], scale: float) -> float:
        return sum(collective_time(cluster, kind, nbytes * scale, group).seconds for kind, nbytes in events)

    for scale in (1.0, 1e3):
        exposed = sum(seconds(p.sp_bwd, scale) for p in ring) * cp / (2 * cp - 1)
        if exposed < sum(seconds(p.sp_fwd + p.sp_bwd, scale) for p in ulysses):
            return False
    return True


def _sequence_splits(op: Op, sp: int) -> None:
    """Raise when ``op`` cannot run on ``1/sp`` of the sequence: every sequence dim of its nest carries a
    recurrence (:func:`polyparallel.poly.carried_dims`: an LSTM's time steps run one after another)."""
    if op.nest is None:
        return
    # islpy: loaded when a loop nest is read, not with polyparallel (cost_models/__init__)
    from polyparallel.poly import carried_dims

    seq = {d.name for d in op.nest.dims if d.hint is Hint.SEQUENCE}
    if seq and seq <= carried_dims(op.nest):
        raise ValueError(f"sp/cp={sp}: op {op.name!r} ({op.target}) carries a recurrence over its sequence dim(s) "
                         f"{sorted(seq)}, so its steps cannot be split over devices; pin sp=1 and cp=1")


def op_roles(graph: Graph) -> list[tuple[OpKind, tuple[str, ...], bool]]:
    """Per op: its kind, its non-parameter inputs, whether it reads a parameter."""
    cache = PRICES.of(graph)
    roles = cache.get(("roles",))
    if roles is None:
        roles = cache[("roles",)] = [
            (OpKind(op.kind), tuple(t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM),
             any(graph.tensors[t].kind is TensorKind.PARAM for t in op.inputs)) for op in graph.ops]
    return roles


# ops that move or select the values of their input without computing new ones: ids read through
# them are still the data's ids (HF's shift of the labels into decoder inputs, a mask filled in)
_VALUE_MOVES = COPY_TARGETS | CAST_TARGETS | {"masked_fill", "where", "slice_scatter", "select_scatter", "index_put",
                                              "scatter"}


def vocabulary_lookups(graph: Graph) -> frozenset[str]:
    """The embedding ops that look up a vocabulary, which tensor parallelism splits by rows.

    A lookup is a vocabulary's when its indices are the data's (a graph input, through views and
    ops that only move values: token ids), or when its table is one a vocabulary lookup or a
    contraction also reads (a decoder's tied token embedding, whose ids the model shifts in place,
    the output layer tied to the embedding). Any other table is indexed by ids the graph computes
    (positions from ``arange`` or a cumulative sum of the mask, an offset added to them, relative
    position buckets) and stays whole, as Megatron keeps its position embeddings: splitting it
    would all-reduce every lookup for rows no output layer shares (memoised per graph)."""
    cache = PRICES.of(graph)
    hit = cache.get(("vocabulary",))
    if hit is not None:
        return hit
    lookups: dict[str, set[str]] = {}  # embedding op -> its parameter tables
    read_by_contractions: set[str] = set()
    for op in graph.ops:
        params = {t for t in op.inputs if graph.tensors[t].kind is TensorKind.PARAM}
        if OpKind(op.kind) is OpKind.EMBEDDING and params:
            lookups[op.name] = params
        elif OpKind(op.kind) is OpKind.CONTRACTION:
            read_by_contractions |= params
    by_data = {name for name in lookups if _reads_data_ids(graph, graph.op(name))}
    tables = set().union(*(lookups[n] for n in by_data)) | read_by_contractions
    hit = cache[("vocabulary",)] = frozenset(n for n, ps in lookups.items() if n in by_data or ps & tables)
    return hit


def _reads_data_ids(graph: Graph, op: Op) -> bool:
    """Whether some index operand of ``op`` is a graph input, read through views and value moves."""
    stack = [t for t in op.inputs if graph.tensors[t].kind is not TensorKind.PARAM]
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if graph.tensors[t].kind is TensorKind.INPUT:
            return True
        producer = graph.producer(t)
        if producer is None:
            continue
        name = target_base(producer.target).rstrip("_")
        if name.endswith("_as"):  # expand_as(x, other), type_as(x, other): the values are x's alone
            stack.append(producer.inputs[0])
        elif OpKind(producer.kind) in (OpKind.VIEW, OpKind.GATHER, OpKind.CONCAT, OpKind.SPLIT) or name in _VALUE_MOVES:
            stack += producer.inputs
    return False
