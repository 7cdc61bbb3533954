r"""What placements cost the step model: Megatron's placements as per-op strings, the work split and
tensor-parallel collectives (:class:`~polyparallel.cost_models.parallel_config.OpPlan`) of any placements,
and the optimizer term the per-stage solver adds per op (:func:`param_cost_of`).

Shared by the ranking candidates (:mod:`.derived`) and the placement of the chosen plan (:mod:`.place_plan`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models.megatron_rule import op_plans as rule_op_plans
from polyparallel.cost_models.memory import OPTIMIZER_STATE_BYTES
from polyparallel.cost_models.parallel_config import OpPlan
from polyparallel.ir import FLOAT_DTYPES, TRAINING_DTYPE_BYTES, Graph, Hint, Op, TensorKind
from polyparallel.planning.executability import executor
from polyparallel.planning.stage_solver import _wire_bytes, in_edges, param_split, work_split
from polyparallel.poly import comm_of_op, edge_costs

__all__ = ["batch_dim", "param_cost_of", "placed_op_plans", "rule_placements"]

_KIND = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter", "all-gather": "all_gather",
         "all-to-all": "all_to_all"}


def _has_param(g: Graph, op: Op) -> bool:
    return any(g.tensors[t].kind is TensorKind.PARAM for t in op.inputs)


def batch_dim(op: Op, dp: int) -> str | None:
    if op.nest is None:
        return None
    return next((d.name for d in op.nest.dims if d.hint is Hint.BATCH and d.extent % max(1, dp) == 0), None)


def rule_placements(g: Graph, cfg: ParallelConfig) -> list[str]:
    """Per op, the placement Megatron's rule implies: batch dims on dp, the rule's split on tp."""

    plans = rule_op_plans(g, replace(cfg, op_plans=None))
    out = []
    for op, plan in zip(g.ops, plans):
        if op.nest is None:
            out.append("")
            continue
        parts = []
        batch = batch_dim(op, cfg.dp)
        if cfg.dp > 1 and batch:
            parts.append(f"{batch}:dp")
        if cfg.tp > 1 and plan.split % cfg.tp == 0:
            heads = executor("torch").heads_dims(g, op)
            dim = heads[0] if heads else _tp_dim(op, _has_param(g, op), plan)
            if dim:
                parts.append(f"{dim}:tp")
        out.append(",".join(parts))
    return out


def _tp_dim(op: Any, has_param: bool, plan: Any) -> str | None:
    """The loop dim the Megatron rule splits over tp. Canonicalisation may have split a dim
    into factors (``k`` -> ``k_0, k_1``); the outermost factor (e.g. the heads) is taken."""
    names = [d.name for d in op.nest.dims]

    def first(prefix: str) -> str | None:
        return next((n for n in names if n == prefix or (n.startswith(prefix + "_") and n[len(prefix) + 1:].isdigit())),
                    None)

    if has_param and plan.tp_fwd and first("k"):
        return first("k")  # row-parallel: partial sums reduced in the forward pass
    if has_param and first("n") and not plan.tp_fwd:
        return first("n")  # column-parallel
    if has_param and first("v"):
        return first("v")  # vocabulary-parallel embedding
    for pref in ("h", "o", "c", "n", "e"):
        if first(pref):
            return first(pref)
    return None


def _events(rs: Any, width: float, p: int) -> list[tuple[str, float]]:
    """A poly reshard as the step model's ``(kind, bytes)`` events over the tp group (priced as
    :class:`polyparallel.planning.stage_solver._Pricer` prices them)."""
    out = []
    for st in rs.steps if rs is not None else ():
        out.append(_event(st.kind, st.payload * width, st.elements * width, p))
    return [e for e in out if e[1] > 0]


def _event(kind: str, payload: float, received: float, p: int) -> tuple[str, float]:
    if kind in _KIND:
        return (_KIND[kind], payload)
    if kind == "halo":
        return ("halo", received)  # a neighbour exchange of the exact bytes a device receives
    if kind == "p2p":
        # an irregular exchange: an all-to-all whose per-rank receive (p-1)/p·n is the exact count
        return ("all_to_all", received * p / max(1, p - 1))
    raise ValueError(f"unknown collective kind {kind!r} from the polyhedral model")


def placed_op_plans(g: Graph, placed: dict[str, Any], mesh: Any, dtype: str, edge_rule: Any) -> dict[str, OpPlan]:
    """Each placed op's work split and tensor-parallel events (forward, backward).

    A tensor read by several ops moves once per distinct move: a Partial output that two readers need
    whole is all-reduced once (forward), and the gradients that several column-parallel readers leave
    Partial are summed locally and all-reduced once (backward), as Megatron and the torch backend run
    them (the placement objective, pairwise over edges, charges each reader)."""
    w = TRAINING_DTYPE_BYTES.get(dtype, 4)
    p = mesh.size
    out = {}
    distinct: dict[OpPlan, OpPlan] = {}
    seen: set[tuple] = set()

    def once(t: str, way: str, events: list[tuple[str, float]]) -> list[tuple[str, float]]:
        key = (t, way, tuple(events))
        if not events or key in seen:
            return []
        seen.add(key)
        return events

    for name, pl in placed.items():
        op = g.op(name)
        oc = comm_of_op(g, op, pl, mesh)
        split = work_split(op, oc, pl, mesh)
        fwd = [_event(c.kind, c.payload * w, c.elements * w, p) for c in oc.forward]
        bwd = [_event(c.kind, c.payload * w, c.elements * w, p) for c in (*oc.backward, *oc.grad)]
        for t, u, pos in in_edges(g, op):
            if u.name not in placed or (edge_rule is not None and
                                        edge_rule(g, u, placed[u.name], op, pl, pos) == "free"):
                continue
            ec = edge_costs(g, t, op, f"in{pos}", mesh, [placed[u.name]], [pl])
            wt = _wire_bytes(g, t, dtype)
            fwd += once(t, "forward", _events(ec.cost(0, 0), wt, p))
            if g.tensors[t].dtype in FLOAT_DTYPES and (edge_rule is None or
                                                 edge_rule(g, u, placed[u.name], op, pl, pos) != "forward"):
                bwd += once(t, "backward", _events(ec.backward_cost(0, 0), wt, p))
        plan = OpPlan(split=split, tp_fwd=tuple(e for e in fwd if e[1] > 0),
                      tp_bwd=tuple(e for e in bwd if e[1] > 0), param_split=param_split(g, op, pl, mesh))
        out[name] = distinct.setdefault(plan, plan)  # one object per distinct plan (repeated blocks)
    return out


def param_cost_of(g: Graph, cfg: ParallelConfig, device: Any, mesh: Any) -> Any:
    r"""The solver's ``param_cost``: the optimizer step over the op's local parameter shard, per micro-batch,

    .. math::  \frac{N_o / s_o}{z} \cdot \frac{3 w + 2 (w_m + w_s)}{0.8\, B_{mem}} \Big/ m

    (the step model's optimizer term without its per-stage kernel floor: ``N_o`` the elements of the
    parameters the op is the first to use, ``s_o`` how many ways the placement shards them, ``z`` the
    ZeRO shard (the ``dp·sp`` group from ZeRO-1 on), ``w`` / ``w_m`` / ``w_s`` bytes per element of the
    weights, the fp32 master copy and the optimizer state, ``m`` micro-batches per step). Replicating
    a weight over ``tp`` is then not free for the solver either."""
    gb = TRAINING_DTYPE_BYTES[cfg.dtype]
    master = 4 if gb < 4 else 0
    state = OPTIMIZER_STATE_BYTES[cfg.optimizer]
    shard = cfg.dp * cfg.seq if cfg.zero_stage >= 1 else 1
    per_elem = (3 * gb + 2 * (master + state)) / shard / (0.8 * device.memory_bandwidth) / cfg.microbatches
    owned: dict[str, float] = {}
    seen: set[str] = set()
    for op in g.ops:
        n = 0.0
        for t in op.inputs:
            if g.tensors[t].kind is TensorKind.PARAM and t not in seen:
                seen.add(t)
                n += g.tensors[t].numel
        owned[op.name] = n

    def cost(op: Op, p: Any) -> float:
        n = owned.get(op.name, 0.0)
        return n / param_split(g, op, p, mesh) * per_elem if n else 0.0

    return cost
