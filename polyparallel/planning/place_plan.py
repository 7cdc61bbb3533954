r"""Per-op placements of a chosen plan: the exact per-stage solver, or Megatron's rule.

The outer search (:mod:`polyparallel.planning.plan_search`) prices plans with the step model's Megatron rule
(:func:`polyparallel.cost_models.step._propagate`): it is cheap and exact enough to rank mesh
shapes. Once a plan is chosen, each pipeline stage's ops are placed by
:func:`polyparallel.planning.stage_solver.solve_stage` on the stage's tensor-parallel mesh (``tp`` devices;
data parallelism is the batch split of every op, as in the step model, whose graph is one
replica's micro-batch):

.. math::  \min_x \sum_o c_{o,x_o} + \sum_{e=(u\to v)} r_{e,x_u,x_v},\qquad
           x_o \in \mathcal{C}_o = \{p \text{ legal},\ \text{expressible}(o, p)\}_{K} \cup \{\text{rule}(o)\}

(:mod:`polyparallel.planning.stage_solver`; ``c`` also holds the optimizer step over the op's local parameter
shard per micro-batch, :func:`param_cost_of`, so replicating a weight is not free). The rule's
placement is always a candidate, so the solver's objective is never above the rule's under the
same prices. The plan is then re-priced by the step
model with the solver's per-op work splits and collectives
(:class:`~polyparallel.cost_models.step.OpPlan`), so the strategy's estimate is the price of the
placements it lists; the solver's placements are kept when that price is not above the rule's
and they fit in memory (the solver has no memory term), else the rule's are.

**Targets** (``Constraints.placements``):

* ``"torch"`` (default): candidates are what the torch backend executes
  (:mod:`polyparallel.backends.torch.capabilities`, op level: which op splits over ``tp`` how, and
  how neighbouring layouts chain). A stage whose solved placements do not chain keeps the rule's
  placements where the backend runs those, and is replicated over ``tp`` otherwise (a convolution
  the rule would split, say); the strategy says why (``Stage.placed_by``, ``placement_note``).
* ``"any"``: every legal placement (planning only: the torch backend may refuse the strategy).
* ``"rule"``: Megatron's rule.

Sequence-parallel plans (``sp > 1``) keep the rule: the torch backend runs Ulysses for every op
whatever the placements say, and the step model prices it so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import StepEstimate, estimate_step
from polyparallel.cost_models.megatron_rule import op_plans as rule_op_plans
from polyparallel.cost_models.step import StepBound
from polyparallel.ir import Graph, Op
from polyparallel.planning.derived import PlacedPlans, rule_plans
from polyparallel.planning.executability import executor
from polyparallel.planning.placement_prices import batch_dim, param_cost_of, placed_op_plans, rule_placements
from polyparallel.planning.stage_solver import FORBIDDEN, price_placements, solve_stage
from polyparallel.poly import DeviceMesh, Placement, legal_placements

__all__ = ["MODES", "Placed", "StagePlacement", "param_cost_of", "place", "rule_placements"]

MODES = ("torch", "any", "rule")



def _not_run(whose: str, ops: list[Op], placed: dict[str, Any], expressible: Any) -> list[str]:
    """Why the torch backend does not execute ``placed`` on ``ops`` op by op (``whose``: the rule's
    or the solver's); empty when it does. The rule's placement is always among an op's candidates
    (so the solver never prices above the rule), also where the backend cannot run it (a
    convolution's image rows, HF GPT-2's Conv1D columns), and the solver may choose it."""
    bad = [f"{o.name} ({placed[o.name]})" for o in ops if o.name in placed and not expressible(o, placed[o.name])]
    return [f"the {whose} placement of {bad[0]} is not executed"] if bad else []


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage's placements came from and their objective (seconds per micro-batch:
    forward + backward compute and tensor-parallel communication, under the placement cost)."""

    source: str  # "solver" or "rule"
    note: str = ""
    objective_s: float = 0.0  # the solver's optimum (kept or not)
    rule_objective_s: float = 0.0  # the rule's, same prices
    solver: str = ""  # which solver ran (blocks / elimination / milp)
    solve_s: float = 0.0


@dataclass(frozen=True)
class Placed:
    est: StepEstimate
    placements: list[str]  # per graph op, dp part included
    stages: list[StagePlacement]


def fits_memory(est: StepEstimate | StepBound, cap: float | None) -> bool:
    """Whether a plan's memory (priced in full or bounded) fits every device, and under ``cap``
    bytes per device when one is given."""
    return est.fits and (cap is None or all(r.total <= cap for r in est.memory))


def place(g: Graph, cl: Cluster, est: StepEstimate, stage_ops: list[list[Op]], mode: str = "torch",
          cap: float | None = None, k: int = 6) -> Placed:
    """The per-op placements of the plan ``est`` and its estimate re-priced with them.

    ``stage_ops``: each pipeline stage's ops (as the step model cuts them). See the module
    docstring for ``mode``; ``cap`` is a per-device memory cap the plan must respect. A plan the
    search ranked with the solver's whole-graph placements (:mod:`.derived`) is re-solved stage by
    stage against Megatron's price as any plan is, and keeps its ranked placements where those
    price faster than what that gives.
    """
    ranked = est.config.op_plans
    if not (isinstance(ranked, PlacedPlans) and ranked.source == "derived"):
        return _place_stages(g, cl, est, stage_ops, mode, cap, k)
    rule_est = estimate_step(g, cl, replace(est.config, op_plans=rule_plans(g, est.config)))
    out = _place_stages(g, cl, rule_est, stage_ops, mode, cap, k)
    if out.est.step_time <= est.step_time * (1 + 1e-12) or not fits_memory(est, cap):
        return out
    note = ("the exact solver's placements over the whole graph, with which the plan was ranked: "
            f"{est.step_time:.6g} s per step vs {out.est.step_time:.6g} s solved stage by stage "
            f"({out.stages[0].source}{': ' + out.stages[0].note if out.stages[0].note else ''})")
    return Placed(est, _with_dp(g, ranked.placements, est.config.dp),
                  [StagePlacement("solver", note, 0.0, st.rule_objective_s, "whole-graph", 0.0) for st in out.stages])


def _with_dp(g: Graph, tp_placements: Any, dp: int) -> list[str]:
    """Per op, its tensor-parallel placement with its batch dim on ``dp``."""
    out = []
    for op, s in zip(g.ops, tp_placements):
        splits = dict(Placement.parse(s).splits)
        batch = batch_dim(op, dp)
        if dp > 1 and batch:
            splits[batch] = ("dp", *splits.get(batch, ()))
        out.append(str(Placement(tuple(splits.items()))) if splits else "")
    return out


def _place_stages(g: Graph, cl: Cluster, est: StepEstimate, stage_ops: list[list[Op]], mode: str,
                  cap: float | None, k: int) -> Placed:
    if mode not in MODES:
        raise ValueError(f"placements must be one of {', '.join(MODES)}, not {mode!r}")
    cfg = est.config
    rule = rule_placements(g, cfg)
    if mode == "rule" or cfg.tp == 1 or cfg.seq > 1:
        reason = ("asked for" if mode == "rule" else "no tensor-parallel axis to place" if cfg.tp == 1 else
                  "sp > 1: Ulysses is run for every op, as the step model prices it")
        return Placed(est, rule, [StagePlacement("rule", reason) for _ in stage_ops])
    mesh = DeviceMesh.of(tp=cfg.tp)
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    index = {op.name: i for i, op in enumerate(g.ops)}

    def tp_part(op: Op) -> Any:
        pl = Placement.parse(rule[index[op.name]])
        pl = Placement(tuple((d, tuple(a for a in axes if a == "tp")) for d, axes in pl.splits))
        return pl if pl in legal_placements(g, op, mesh) else None

    torch = executor("torch")
    expressible = torch.expressible(g, cfg.tp) if mode == "torch" else None
    rule_of_edge = torch.edge_rule if mode == "torch" else None
    chosen: dict[str, Any] = {}
    def rule_runs(ops: list[Op]) -> list[str]:
        """Why the backend cannot run the rule's placements of these ops (empty: it can)."""
        placed = {o.name: tp_part(o) or Placement() for o in ops}
        assert expressible is not None  # asked only of the torch target's stages
        return _not_run("rule's", ops, placed, expressible) or torch.chain_problems(g, placed, mesh)

    stages = []
    for s, ops in enumerate(stage_ops):
        group = [devs[cfg.rank(s, 0, 0, t)] for t in range(cfg.tp)]
        pc = param_cost_of(g, cfg, cl.device(group[0]).type, mesh)
        plan = solve_stage(g, mesh, cl, dtype=cfg.dtype, devices=group, ops=ops, k=k, expressible=expressible,
                           include=tp_part, edge_rule=rule_of_edge, param_cost=pc)
        tab = price_placements(g, mesh, cl, dtype=cfg.dtype, devices=group, ops=ops, k=k, expressible=expressible,
                               include=tp_part, edge_rule=rule_of_edge, param_cost=pc)
        rule_choice = {o.name: tab.candidates[o.name].index(tp_part(o) or Placement()) for o in ops}
        rule_obj = tab.objective(rule_choice)
        if rule_obj >= FORBIDDEN:  # a pair the edge model forbids: not a price (the step estimate prices the plan)
            rule_obj = 0.0
        placed = {name: Placement.parse(pl) for name, pl in plan.placements.items()}
        why = ((_not_run("solver's", ops, placed, expressible) + torch.chain_problems(g, placed, mesh))
               if mode == "torch" else [])
        rule_why = rule_runs(ops) if why else []
        if why and rule_why:
            # neither runs: every op of the stage replicated over tp (the stage computes redundantly,
            # and is priced so below)
            chosen.update({o.name: Placement() for o in ops})
            stages.append(StagePlacement("replicated", f"solver placements not executable by the torch backend "
                                         f"({why[0]}) and {rule_why[0]}: the stage's ops are replicated over tp",
                                         plan.objective_s, rule_obj, plan.solver, plan.solve_s))
        elif why:
            chosen.update({o.name: tp_part(o) or Placement() for o in ops})
            stages.append(StagePlacement("rule", "solver placements not executable by the torch backend: " + why[0],
                                         plan.objective_s, rule_obj, plan.solver, plan.solve_s))
        else:
            chosen.update(placed)
            stages.append(StagePlacement("solver", "", plan.objective_s, rule_obj, plan.solver, plan.solve_s))
    if all(st.source == "rule" for st in stages):
        return Placed(est, rule, stages)

    solver_stage = {o.name for st, ops in zip(stages, stage_ops) if st.source != "rule" for o in ops}
    solved = placed_op_plans(g, {n: p for n, p in chosen.items() if n in solver_stage}, mesh, cfg.dtype, rule_of_edge)
    rules = rule_op_plans(g, replace(cfg, op_plans=None))
    op_plans = tuple(solved.get(op.name) or r for op, r in zip(g.ops, rules))
    est2 = estimate_step(g, cl, replace(cfg, op_plans=op_plans))
    rule_ok = mode != "torch" or not any(st.source == "replicated" for st in stages)
    if rule_ok and (not fits_memory(est2, cap) or est2.step_time > est.step_time * (1 + 1e-12)):
        reason = ("the solver's placements do not fit in memory" if not fits_memory(est2, cap) else
                  f"the step model prices the solver's placements slower ({est2.step_time:.6g} s vs "
                  f"{est.step_time:.6g} s per step)")
        return Placed(est, rule, [StagePlacement("rule", reason, st.objective_s, st.rule_objective_s, st.solver,
                                                 st.solve_s) for st in stages])
    out = []
    for op, r in zip(g.ops, rule):
        if op.name not in solver_stage:
            out.append(r)
            continue
        splits = dict(chosen[op.name].splits)
        batch = batch_dim(op, cfg.dp)
        if cfg.dp > 1 and batch:
            splits[batch] = ("dp", *splits.get(batch, ()))
        out.append(str(Placement(tuple(splits.items()))) if splits else "")
    return Placed(est2, out, stages)
