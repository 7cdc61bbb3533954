"""The :class:`~polyparallel.strategy.Strategy` of a chosen plan: what the search writes.

Given the plan the search chose (a cost-model estimate and its micro-batch), :func:`strategy_of`
places its ops (:mod:`.place_plan`), re-prices it with those placements, and records the mesh in
device order (tensor-parallel fastest, then sequence, data, pipeline), each stage's op ranges and
layers as the cost model cut them, the per-op placements grouped by placement, and the estimate.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, StepEstimate, estimate_step
from polyparallel.cost_models.layers import LAYER, chunk_of_ops
from polyparallel.ir import Graph
from polyparallel.plan import MESH_AXES, Axis
from polyparallel.planning.derived import replaced_plans
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.planning.place_plan import place
from polyparallel.strategy import (
    Estimate,
    Mesh,
    MeshAxis,
    ModelInfo,
    OpPlacement,
    SearchRecord,
    Stage,
    Strategy,
    fingerprint,
)

__all__ = ["axis_level", "group_placements", "layer_ids", "model_info", "stage_chunks", "strategy_of"]


def model_info(mdl: ModelGraphs, g: Graph, b: int, B: int) -> ModelInfo:
    """``g`` is the graph of one micro-batch of ``b`` samples; a step trains ``B`` samples."""
    return ModelInfo(name=mdl.name, fingerprint=fingerprint(g), params=g.param_count(),
                     flops_per_step=3.0 * g.flops() / b * B, source=g.source)


def strategy_of(mdl: ModelGraphs, cl: Cluster, est: StepEstimate, b: int, B: int, devs: list[int],
                 record: SearchRecord, placements: str = "torch", cap: float | None = None) -> Strategy:
    was = mdl.graph(b)
    g = mdl.exact(b)
    if g is not was:  # captured just now: price the plan on the graph the strategy names (same price)
        est = estimate_step(g, cl, replace(est.config, op_plans=replaced_plans(g, cl, est.config, placements)))
    chunks = stage_chunks(g, est.config)
    stage_ops = [[g.ops[i] for a, z in chunks[s] for i in range(a, z + 1)] for s in range(est.config.pp)]
    placed = place(g, cl, est, stage_ops, placements, cap)
    est = placed.est
    cfg = est.config
    axes = []
    for axis in MESH_AXES:  # outermost first, as the ranks are numbered
        if (size := cfg.degree(axis)) > 1 or axis is Axis.DP:
            axes.append(MeshAxis(name=axis.value, size=size, level=axis_level(cl, cfg, axis.value, devs)))
    order = [devs[cfg.rank(s, d, q, t)] for s in range(cfg.pp) for d in range(cfg.dp) for q in range(cfg.seq)
             for t in range(cfg.tp)]
    stages = []
    for s, st in enumerate(est.stages):
        names = [name for a, z in chunks[s] for name in (g.ops[a].name, g.ops[z].name)]
        layers = sorted({i for a, z in chunks[s] for i in layer_ids(g, a, z)})
        stage_devs = [devs[cfg.rank(s, d, q, t)] for d in range(cfg.dp) for q in range(cfg.seq) for t in range(cfg.tp)]
        sp_ = placed.stages[s]
        stages.append(Stage(index=s, ops=names, layers=layers, devices=stage_devs, device_type=est.memory[s].device,
                            compute_s=round(st.part("compute"), 9), placed_by=sp_.source, placement_note=sp_.note,
                            objective_s=sp_.objective_s, rule_objective_s=sp_.rule_objective_s))
    mem_max = max(r.total for r in est.memory)
    bd = est.breakdown()
    comm = sum(v for k, v in bd.items() if k in ("tensor_parallel", "sequence_parallel", "expert_parallel", "p2p",
                                                        "data_parallel"))
    estimate = Estimate(step_time_s=est.step_time, samples_per_s=B / est.step_time,
                        model_flops_per_s_per_device=est.model_flops_per_device,
                        memory_bytes_max=mem_max, comm_fraction=comm / est.step_time if est.step_time else 0.0,
                        breakdown={k: float(v) for k, v in bd.items()},
                        memory_by_device={r.label: float(r.total) for r in est.memory})
    return Strategy(model=model_info(mdl, g, b, B), cluster=cl.to_dict() if hasattr(cl, "to_dict") else {},
                    mode="synchronous", global_batch=B, **cfg.record_fields(), mesh=Mesh(axes=axes, devices=order),
                    stages=stages,
                    placements=group_placements(g, placed.placements),
                    estimate=estimate, search=record.model_copy(update={"solver": record.solver + placement_solver(
                        placed.stages)}))


def placement_solver(stages: list[Any]) -> str:
    """What placed the ops, for ``search.solver``: ``+placements:solver(blocks)`` or ``+placements:rule``."""
    used = sorted({st.solver for st in stages if st.source == "solver"})
    if not used:
        return "+placements:rule"
    rule = sum(st.source == "rule" for st in stages)
    return f"+placements:solver({','.join(used)})" + (f",rule({rule} stages)" if rule else "")


def stage_chunks(g: Graph, cfg: ParallelConfig) -> list[list[tuple[int, int]]]:
    """(first, last) op index of each chunk of each stage, as the cost model cuts them."""
    chunk = chunk_of_ops(g, cfg)
    out: list[list[tuple[int, int]]] = [[] for _ in range(cfg.pp)]
    for k in range(max(chunk) + 1 if chunk else 0):
        idx = [i for i, c in enumerate(chunk) if c == k]
        if idx:
            out[k % cfg.pp].append((idx[0], idx[-1]))
    return out


def layer_ids(g: Graph, a: int, z: int) -> set[int]:
    """Indices of the numbered layers (``h.3``, ``layers.7``) among ops ``a..z``, matched by the
    cost model's own layer pattern so the stages list the layers it cut at."""
    ids = set()
    for op in g.ops[a: z + 1]:
        m = LAYER.match(op.module or "")
        if m:
            ids.add(int(m.group(1).rsplit(".", 1)[1]))
    return ids


def axis_level(cl: Cluster, cfg: ParallelConfig, axis: str, devs: list[int]) -> str:
    def members(t: int, q: int, d: int, s: int) -> int:
        return devs[cfg.rank(s, d, q, t)]

    size = cfg.degree(axis)
    if size == 1:
        return "intra_node"
    group = []
    for x in range(size):
        idx = {"tp": (x, 0, 0, 0), "sp": (0, x, 0, 0), "cp": (0, x, 0, 0), "dp": (0, 0, x, 0), "pp": (0, 0, 0, x)}[axis]
        group.append(members(*idx))
    levels = {cl.level(group[0], d) for d in group[1:]}
    for lvl in ("inter_center", "inter_node", "intra_node"):
        if lvl in levels:
            return lvl
    return "intra_node"


def group_placements(g: Graph, per_op: list[str]) -> list[OpPlacement]:
    """One OpPlacement per distinct placement string, listing its ops (and their modules) in op order."""
    groups: dict[str, list[str]] = {}
    modules: dict[str, list[str]] = {}
    for op, pl in zip(g.ops, per_op):
        groups.setdefault(pl, []).append(op.name)
        modules.setdefault(pl, []).append(op.module)
    return [OpPlacement(ops=names, placement=pl, modules=modules[pl]) for pl, names in groups.items()]
