r"""Per-op placements derived from the polyhedral model for *ranking* plans, cheaply.

The search ranks every plan with the step model, which needs each op's work split and
tensor-parallel collectives (:class:`~polyparallel.cost_models.parallel_config.OpPlan`). They come
from placements, and a plan is offered with each of its **placement candidates**
(:func:`variants`):

* ``derived``: the exact solver's placements (:func:`polyparallel.planning.stage_solver.solve_stage`
  over the whole graph: repeated blocks solved once per block signature and chained, the rest by
  variable elimination or MILP) on the plan's ``tp`` mesh, restricted as the final placement is
  (``torch``: what the torch backend executes; ``any``: every legal placement), with Megatron's
  placement of each op among the solver's candidates;
* ``rule``: Megatron's layout (:mod:`polyparallel.cost_models.megatron_rule`), one candidate among
  the others, not the ranking rule.

The branch and bound keeps whichever prices faster for each plan, so a plan is ranked by the best
of its placements under the same step model that prices its memory and pipeline.

**What is cached.** Placements depend on the op shapes and the ``tp`` degree, not on ``dp``,
``pp``, ``m``, the schedule or the memory knobs: they are solved once per (``tp``, target, device
group of the first ``tp`` devices, dtype) on the anchor graph (the example micro-batch) and mapped
by op name onto the graph of every other micro-batch size, whose OpPlans (collective bytes scale with
the batch) are then priced from the same placements (:func:`polyparallel.planning.placement_prices.placed_op_plans`,
milliseconds per op signature). A graph whose ops do not carry the anchor's placements (a capture at
batch 1 names extent-1 dims differently) is solved on its own. Two approximations, both made good
when the chosen plan is written (:func:`polyparallel.planning.place_plan.place` re-solves it stage
by stage): the whole graph is solved as one stage (a pipeline cut drops the edges across it), and
the optimizer term of the objective (``param_cost``) is taken at ``dp = m = 1`` without ZeRO (the
most a replicated weight can cost).

Sequence-parallel plans (``sp > 1``) are ranked with Megatron + Ulysses only: the torch backend runs
Ulysses for every op whatever the placements say (:mod:`polyparallel.planning.place_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models.megatron_rule import op_plans as rule_op_plans
from polyparallel.cost_models.memo import PRICES
from polyparallel.cost_models.parallel_config import OpPlan
from polyparallel.ir import Graph
from polyparallel.planning.executability import executor
from polyparallel.planning.placement_prices import param_cost_of, placed_op_plans, rule_placements
from polyparallel.planning.stage_solver import solve_stage
from polyparallel.poly import DeviceMesh, Placement, legal_placements

__all__ = ["PlacedPlans", "variants"]


class PlacedPlans(tuple):
    """A plan's ``op_plans`` together with the placements they price.

    ``source``: ``derived`` (the solver) or ``rule`` (Megatron); ``placements``: per op, the
    tensor-parallel part of its placement (``""`` replicated); ``note``: why the derived candidate
    fell back, if it did. The hash is computed once: a :class:`ParallelConfig` holding these is
    hashed on every memo lookup of the step model.
    """

    source: str
    placements: tuple[str, ...]
    note: str
    _hash: int

    def __new__(cls, plans: Any, placements: Any, source: str, note: str = "") -> PlacedPlans:
        self = super().__new__(cls, plans)
        self.source, self.placements, self.note = source, tuple(placements), note
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> Any:
        return (PlacedPlans, (tuple(self), self.placements, self.source, self.note))


def _tp_rule(g: Graph, cfg: ParallelConfig) -> list[str]:
    """Per op, the tensor-parallel part of Megatron's placement."""
    tp_part: dict[str, str] = {}  # the ops of a model share a handful of placements
    out = []
    for s in rule_placements(g, replace(cfg, dp=1)):
        t = tp_part.get(s)
        if t is None:
            pl = Placement.parse(s)
            t = tp_part[s] = str(Placement(tuple((d, tuple(a for a in axes if a == "tp")) for d, axes in pl.splits
                                                 if "tp" in axes)))
        out.append(t)
    return out


def rule_plans(g: Graph, cfg: ParallelConfig) -> PlacedPlans:
    """Megatron's candidate (memoised per graph, ``tp``, ``sp``, dtype)."""
    key = ("derived:rule", *cfg.split_key, cfg.dtype)
    memo = PRICES.of(g)
    hit = memo.get(key)
    if hit is None:
        base = replace(cfg, op_plans=None)
        hit = memo[key] = PlacedPlans(rule_op_plans(g, base), _tp_rule(g, base), "rule")
    return hit


def _solve(g: Graph, cl: Cluster, cfg: ParallelConfig, mode: str) -> tuple[dict[str, Any], str]:
    """The whole graph's tensor-parallel placements by the exact solver, checked as ``place`` checks
    a stage; ``({}, why)`` when the solved placements are not executed (then only the rule ranks)."""
    torch = executor("torch")
    mesh = DeviceMesh.of(tp=cfg.tp)
    rule = _tp_rule(g, cfg)
    index = {op.name: i for i, op in enumerate(g.ops)}

    def tp_part(op: Any) -> Any:
        pl = Placement.parse(rule[index[op.name]])
        return pl if pl in legal_placements(g, op, mesh) else None

    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    group = list(devs[: cfg.tp])
    ref = replace(cfg, dp=1, pp=1, sp=1, microbatches=1, zero_stage=0, op_plans=None)
    plan = solve_stage(g, mesh, cl, dtype=cfg.dtype, devices=group, k=6,
                       expressible=torch.expressible(g, cfg.tp) if mode == "torch" else None, include=tp_part,
                       edge_rule=torch.edge_rule if mode == "torch" else None,
                       param_cost=param_cost_of(g, ref, cl.device(group[0]).type, mesh))
    placed = {name: Placement.parse(p) for name, p in plan.placements.items()}
    why = torch.chain_problems(g, placed, mesh) if mode == "torch" else []
    if why:
        return {}, "the solver's placements are not executed by the torch backend: " + why[0]
    return placed, ""


def _placed_on(g: Graph, placed: dict[str, Any], mesh: Any) -> dict[str, Any] | None:
    """The anchor's placements on another micro-batch's graph, or None where an op lacks them."""
    out = {}
    for op in g.ops:
        pl = placed.get(op.name)
        if pl is None:
            return None
        dims = {d.name for d in op.nest.dims} if op.nest is not None else set()
        if any(d not in dims for d, _ in pl.splits):
            return None
        out[op.name] = pl if pl.splits else Placement()
    return out


def derived_plans(g: Graph, anchor: Graph, cl: Cluster, cfg: ParallelConfig, mode: str) -> PlacedPlans | None:
    """The solver's candidate for ``g`` (a micro-batch's graph; ``anchor``: the example's), or None
    when it has none (its placements are not executed, or equal Megatron's)."""
    devs = cfg.devices if cfg.devices is not None else tuple(range(cfg.world))
    key = ("derived", mode, cfg.tp, cfg.dtype, tuple(devs[: cfg.tp]), id(cl))
    memo = PRICES.of(g)
    if key in memo:
        return memo[key][1]
    amemo = PRICES.of(anchor)
    akey = (*key, "placements")
    if akey not in amemo:
        amemo[akey] = (cl, *_solve(anchor, cl, cfg, mode))
    _, placed, _why = amemo[akey]
    mesh = DeviceMesh.of(tp=cfg.tp)
    out = None
    if placed:
        on_g = _placed_on(g, placed, mesh) if g is not anchor else placed
        if on_g is None:  # names differ (batch-1 capture): solve this graph itself
            on_g, _why = _solve(g, cl, cfg, mode)
        if on_g:
            plans = placed_op_plans(g, on_g, mesh, cfg.dtype, executor("torch").edge_rule if mode == "torch" else None)
            tp_pl = tuple(str(on_g[op.name]) if on_g[op.name].splits else "" for op in g.ops)
            rule = rule_plans(g, cfg)
            if tp_pl != rule.placements:
                out = PlacedPlans((plans[op.name] for op in g.ops), tp_pl, "derived")
    memo[key] = (cl, out)  # the cluster is held so its id is not reused
    return out


def _affine(lo: PlacedPlans, hi: PlacedPlans, t: float) -> PlacedPlans | None:
    """``lo + t (hi - lo)`` event by event (None where the two differ in anything but bytes)."""
    out = []
    for a, c in zip(lo, hi):
        if a.split != c.split or a.param_split != c.param_split:
            return None
        evs = []
        for xa, xc in ((a.tp_fwd, c.tp_fwd), (a.tp_bwd, c.tp_bwd), (a.sp_fwd, c.sp_fwd), (a.sp_bwd, c.sp_bwd)):
            if len(xa) != len(xc) or any(ka != kc for (ka, _), (kc, _) in zip(xa, xc)):
                return None
            evs.append(tuple((k, ba + t * (bc - ba)) for (k, ba), (_, bc) in zip(xa, xc)))
        tp_fwd, tp_bwd, sp_fwd, sp_bwd = evs
        out.append(OpPlan(a.split, tp_fwd, tp_bwd, sp_fwd, sp_bwd, param_split=a.param_split))
    return PlacedPlans(out, lo.placements, lo.source)


def variants(g: Graph, anchor: Graph, cl: Cluster, cfg: ParallelConfig, mode: str,
             affine: Callable[[Graph], tuple[Graph, Graph, float] | None] | None = None) -> list[PlacedPlans | None]:
    """The placement candidates a plan is ranked with (module docstring); ``[None]`` where nothing is
    split (``tp = sp = 1``: every op whole, as the step model prices a config without placements).

    ``affine(g)``: for a graph re-batched from two anchor captures, ``(lo, hi, t)`` with ``g`` the
    anchors' graph at ``lo + t (hi - lo)``; its derived OpPlans are then the anchors' interpolated
    (collective bytes are affine in the batch as the graph's integers are), instead of priced op
    by op again. A pair whose events differ in more than bytes is priced on ``g`` itself."""
    if cfg.tp == 1 and cfg.seq == 1:
        return [None]
    rule = rule_plans(g, cfg)
    if mode == "rule" or cfg.tp == 1 or cfg.seq > 1:
        return [rule]
    solved = None
    ab = affine(g) if affine is not None else None
    if ab is not None:
        memo = PRICES.of(g)
        key = ("derived:affine", mode, cfg.tp, cfg.dtype, tuple((cfg.devices or range(cfg.world))[: cfg.tp]), id(cl))
        if key not in memo:
            lo, hi = (derived_plans(x, anchor, cl, cfg, mode) for x in ab[:2])
            if lo is None and hi is None:
                memo[key] = (cl, None)  # the solver's placements equal Megatron's, or are not executed
            else:  # False: price on g itself
                memo[key] = (cl, (lo is not None and hi is not None and lo.placements == hi.placements and
                             len(lo) == len(g.ops) and _affine(lo, hi, ab[2])) or False)
        solved = memo[key][1]
    if solved is False or ab is None:
        solved = derived_plans(g, anchor, cl, cfg, mode)
    return [rule] if solved is None else [solved, rule]


def replaced_plans(g: Graph, cl: Cluster, cfg: ParallelConfig, mode: str) -> tuple[OpPlan, ...] | None:
    """The same placement candidate as ``cfg.op_plans`` (priced on another graph), on ``g``."""
    plans = cfg.op_plans
    if not isinstance(plans, PlacedPlans):
        return plans
    if plans.source == "rule":
        return rule_plans(g, cfg)
    return derived_plans(g, g, cl, cfg, mode) or rule_plans(g, cfg)


def plan_note(plans: Any) -> str:
    """What placed a ranked plan's ops, for notes and ``explain``."""
    if isinstance(plans, PlacedPlans):
        return "derived (exact solver)" if plans.source == "derived" else "Megatron rule"
    return "none (no tensor or sequence split)"

