"""Expert parallelism's terms: the MoE layers' all-to-alls and the experts' gradient reduction.

The volumes come from the polyhedral model (:func:`expert_all_to_all_elements`); the
groups from the stage layout (:mod:`.stage_layout`): each group of ``ep`` consecutive members of a
data-parallel group splits the experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polyparallel import ops
from polyparallel.cluster import Cluster
from polyparallel.ir import Graph, Hint, Op, OpKind, TensorKind, TensorSpec, element_bytes

from .comm import collective_time
from .layers import chunks
from .memo import PRICES
from .parallel_config import ParallelConfig
from .stage_layout import StageTerms

__all__ = ["ExpertParallel", "expert_all_to_all_elements", "expert_parallel", "moe_layers"]


@dataclass(frozen=True)
class ExpertParallel:
    """Per stage: the expert weights it holds before the ``ep`` split, the seconds of its MoE
    layers' all-to-alls per micro-batch (forward and backward alike), and the experts' gradient
    reduction over the ranks holding the same experts (events, seconds per step)."""

    expert_params: tuple[float, ...]
    a2a: tuple[float, ...]
    grad_events: tuple[tuple[tuple[str, float], ...], ...]
    grad_t: tuple[float, ...]


def moe_layers(graph: Graph) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The MoE layers as ``(first, last)`` expert-matmul op indices (one layer per module: the
    first's input is dispatched, the last's output combined), and the expert weight tensors
    (parameters reaching an expert matmul's weight operand through views and casts)."""
    cache = PRICES.of(graph)
    hit = cache.get(("moe",))
    if hit is not None:
        return hit
    by_module: dict[str, list[int]] = {}
    weights: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        if op.nest is None or not any(d.hint is Hint.EXPERT for d in op.nest.dims) or len(op.inputs) < 2:
            continue
        by_module.setdefault(op.module or op.name, []).append(i)
        t = op.inputs[1]
        while graph.tensors[t].kind is not TensorKind.PARAM:
            prod = graph.producer(t)
            if prod is None or OpKind(prod.kind) not in (OpKind.VIEW, OpKind.ELEMENTWISE) or not prod.inputs:
                break
            t = prod.inputs[0]
        if graph.tensors[t].kind is TensorKind.PARAM:
            weights[t] = i
    out = ([(ix[0], ix[-1]) for ix in by_module.values()], weights)
    cache[("moe",)] = out
    return out


def expert_all_to_all_elements(rows: int, hidden_in: int, hidden_out: int, experts: int, ep: int) -> tuple[int, int]:
    """Elements one device receives in a MoE layer's dispatch and in its combine over ``ep`` ranks
    holding ``rows`` routed rows each, from the polyhedral model: the expert matmul of the
    ``ep`` ranks' rows side by side (:func:`polyparallel.ops.grouped_mm` with ``sources = ep``)
    placed ``e:ep``; the dispatch is the footprint of its input minus the rank's own rows, the
    combine its output block back to the rows' ranks. Rows that do not divide over the experts
    are padded up (a bound)."""
    # islpy: loaded when a loop nest is read, not with polyparallel (cost_models/__init__)
    from polyparallel.poly import DeviceMesh, Placement, TensorLayout, operand_need, output_layout, reshard

    rows = -(-rows // experts) * experts
    n = ep * rows
    g = Graph("moe_layer")
    for name, shape, kind in (("x", (n, hidden_in), TensorKind.ACTIVATION),
                              ("w", (experts, hidden_in, hidden_out), TensorKind.PARAM),
                              ("y", (n, hidden_out), TensorKind.ACTIVATION)):
        g.add_tensor(TensorSpec(name, shape, kind=kind))
    op = g.add_op(Op("experts", OpKind.CONTRACTION, "grouped_mm", ("x", "w"), ("y",),
                     ops.grouped_mm((n, hidden_in), (experts, hidden_in, hidden_out), sources=ep)))
    mesh, placed = DeviceMesh.of(ep=ep), Placement.parse("e:ep")
    dispatch = reshard(TensorLayout.sharded((n, hidden_in), ep=0), operand_need(g, op, placed, mesh, "in0"), mesh)
    combine = reshard(output_layout(g, op, placed, mesh), TensorLayout.sharded((n, hidden_out), ep=0), mesh)
    return dispatch.elements, combine.elements


def expert_parallel(graph: Graph, cluster: Cluster, cfg: ParallelConfig, terms: StageTerms, ccache: dict,
                    gb: int, param_uses: Sequence[tuple[int, str, float, int]]) -> ExpertParallel:
    """Expert parallelism's terms per stage (``cfg.ep`` ranks of each data-parallel group, consecutive).

    Forward, per micro-batch and MoE layer: the dispatch of the routed rows to the experts'
    ranks and the combine of the experts' outputs back, each an all-to-all over the ``ep``
    group of the bytes :func:`expert_all_to_all_elements` counts (a rank's rows: its
    ``T = tokens·top_k`` rows divided over ``sp``, and over ``tp`` under Megatron sequence
    parallelism); the backward moves the gradients of both the same way. The balanced routing of
    the loop nest makes every expert's work ``1/E`` of the rows, so the compute per rank is
    unchanged. Gradients of the expert weights (``1/ep`` of the stage's per rank) are reduced
    over the ``dp·sp/ep`` ranks holding the same experts (every ``ep``-th member of the data-parallel
    group): all-reduce under ZeRO-0, reduce-scatter + all-gather under ZeRO-1/2.
    """
    p, ep, v = cfg.pp, cfg.ep, cfg.virtual
    layers, weights = moe_layers(graph)
    chunk_of_op = chunks(graph, p * v, cfg.partition)
    expert = [0.0] * p
    counted: set[tuple[int, str]] = set()
    for i, t, numel, _ in param_uses:
        s = chunk_of_op[i] % p
        if t in weights and (s, t) not in counted:
            counted.add((s, t))
            expert[s] += numel
    rows_div = cfg.seq * (cfg.tp if cfg.sequence_parallel else 1)
    conc_of = PRICES.of(cluster)["group_concurrency"]
    nodes = [d.node for d in cluster.devices]

    def subgroups_time(grp: tuple[int, ...], gid: int, subs: list[tuple[int, ...]],
                       events: Sequence[tuple[str, float]]) -> float:
        # the subgroups of every data-parallel group run at once: those with a member on a node
        # share its ports with each other and with the other tensor-parallel ranks' groups
        on_node: dict[int, int] = {}
        for sub in subs:
            for nd in {nodes[d] for d in sub}:
                on_node[nd] = on_node.get(nd, 0) + 1
        worst = 0.0
        for sub in subs:
            conc = conc_of[gid] * max(on_node[nodes[d]] for d in sub)
            tot = 0.0
            for kind, nbytes in events:
                key = ("ep", kind, nbytes, tuple(sorted(nodes[d] for d in sub)), conc)
                if key not in ccache:
                    ccache[key] = collective_time(cluster, kind, nbytes, sub, concurrent=conc).seconds
                tot += ccache[key]
            worst = max(worst, tot)
        return worst

    a2a, grad_events, grad_t = [0.0] * p, [], []
    for s in range(p):
        events = []
        for first, last in layers:
            if chunk_of_op[first] % p != s:
                continue
            x, w = (graph.tensors[t] for t in graph.ops[first].inputs[:2])
            y = graph.tensors[graph.ops[last].outputs[0]]
            key = ("moe_a2a", ep, x.shape, w.shape, y.shape, rows_div)
            if key not in PRICES.of(graph):
                PRICES.of(graph)[key] = expert_all_to_all_elements(
                    max(1, x.shape[0] // rows_div), x.shape[1], y.shape[1], w.shape[0], ep)
            d_el, c_el = PRICES.of(graph)[key]
            for el, spec in ((d_el, x), (c_el, y)):
                events.append(("all_to_all", el * element_bytes(spec.dtype, cfg.dtype) * ep / (ep - 1)))
        groups = terms.dp_groups[s]
        a2a[s] = max(subgroups_time(grp, gid, [grp[i:i + ep] for i in range(0, len(grp), ep)], events)
                     for grp, gid in groups) if events else 0.0
        held = expert[s] / ep
        ev: tuple[tuple[str, float], ...] = ()
        if len(groups[0][0]) > ep and held:
            rb = max(gb, 4)
            ev = ((("all_reduce", held * rb),) if cfg.zero_stage == 0 else
                  (("reduce_scatter", held * rb),) * (cfg.microbatches if cfg.zero_stage == 2 else 1)
                  + (("all_gather", held * gb),))
        grad_events.append(ev)
        grad_t.append(max(subgroups_time(grp, gid, [grp[j::ep] for j in range(ep)], ev) for grp, gid in groups)
                      if ev else 0.0)
    return ExpertParallel(tuple(expert), tuple(a2a), tuple(grad_events), tuple(grad_t))
