"""A center's synchronous plan as data: which degrees it sets, and the plans no center runs.

Kept apart from the trainer (:mod:`._dp_center`) so that the job's configuration (``CenterSpec``)
checks a plan when it is written, without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyparallel.plan import CENTER_FIELDS
from polyparallel.planning.executability import CENTER_LIMITS  # what a center runs: the planner searches under it

__all__ = ["CENTER_LIMITS", "PLAN_KEYS", "normalize_plan", "plan_from_local_strategy", "scaled_plan"]

#: what a center's plan may set: the plan's center fields (mesh degrees, ZeRO stage, recomputation,
#: precision), the placement mode the planner prices tensor parallelism with (``rule``: Megatron;
#: ``torch``: its solver) and the per-op placements the collaborative search priced
#: (``op_placements``, :func:`polyparallel.strategy.center_placements`)
PLAN_KEYS = (*CENTER_FIELDS, "placements", "op_placements")


def normalize_plan(plan: Mapping[str, Any] | None, devices: int, center: str = "") -> dict[str, Any]:
    """Check a center's plan against its device count and what a center executes; the full plan.

    ``dp`` defaults to ``devices / (tp·pp·sp)``; ``zero_stage`` to 0, or 3 (FSDP2) when ``dp`` and
    ``tp`` are both > 1, the one data-parallel form the backend runs over tensor-parallel parameters;
    ``placements`` to None: Megatron's where the backend runs them, else the planner's own; a plan
    the collaborative search wrote carries the per-op placements it priced (``op_placements``), which
    the center runs.
    Raises ValueError naming the fix for plans no center runs, whatever its model.
    """
    who = f"center {center!r}" if center else "center"
    plan = dict(plan or {})
    unknown = sorted(set(plan) - set(PLAN_KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown plan keys {unknown}; a center's plan sets {', '.join(PLAN_KEYS)}")
    tp, pp, sp = (int(plan.get(k, 1)) for k in ("tp", "pp", "sp"))
    if min(tp, pp, sp) < 1 or devices % (tp * pp * sp):
        raise ValueError(f"{who}: tp={tp}, pp={pp}, sp={sp} do not divide its {devices} devices")
    dp = int(plan.get("dp", devices // (tp * pp * sp)))
    if dp * tp * pp * sp != devices:
        raise ValueError(f"{who}: plan dp={dp} tp={tp} pp={pp} sp={sp} uses {dp * tp * pp * sp} devices but the center "
                         f"has {devices}; make dp·tp·pp·sp equal its devices")
    why = []
    if pp > 1:
        why.append(f"pp={pp}: pipeline stages inside a collaborative center are not executed (a center's round is "
                   "local SGD on its whole model); use pp=1 with dp/tp/zero_stage over its devices")
    if sp > 1:
        why.append(f"sp={sp}: sequence parallelism inside a collaborative center is not executed; use sp=1")
    if int(plan.get("microbatches", 1)) != 1:
        why.append(f"microbatches={plan['microbatches']}: gradient accumulation inside a collaborative center is not "
                   "executed (each local step is one forward of the global batch); use microbatches=1")
    if plan.get("dtype", "fp32") != "fp32":
        why.append(f"dtype={plan['dtype']!r}: a collaborative center trains in fp32 (the exchanged model is fp32); "
                   "use dtype='fp32'")
    if why:
        raise ValueError(f"{who} cannot run its plan: " + "; ".join(why))
    zero = int(plan.get("zero_stage", 3 if dp > 1 and tp > 1 else 0))
    return {"dp": dp, "tp": tp, "pp": 1, "sp": 1, "microbatches": 1, "zero_stage": zero,
            "recompute": plan.get("recompute", "none"), "dtype": "fp32", "placements": plan.get("placements"),
            "op_placements": _op_placements(plan.get("op_placements"), who) if tp > 1 else None}


def _op_placements(record: Any, who: str) -> tuple[tuple[tuple[str, ...], str, tuple[str, ...]], ...] | None:
    """The per-op placements of a plan (``[ops, placement, modules]`` per group) as hashable tuples."""
    if record is None:
        return None
    try:
        return tuple((tuple(map(str, ops)), str(pl), tuple(map(str, mods))) for ops, pl, mods in record)
    except (TypeError, ValueError):
        raise ValueError(f"{who}: op_placements must be [ops, placement, modules] groups, as the collaborative "
                         "search writes them; search the strategy again or leave op_placements out") from None


def plan_from_local_strategy(local: Mapping[str, Any]) -> dict[str, Any]:
    """The plan keys of a collaborative Strategy's per-center ``local_strategy`` (its estimates dropped)."""
    return {k: local[k] for k in PLAN_KEYS if k in local}


def scaled_plan(plan: Mapping[str, Any], devices: int, max_devices: int,
                center: str = "") -> tuple[int, dict[str, Any]]:
    """``(devices, plan)`` of a center run on at most ``max_devices`` of its ``devices``: the data-parallel
    degree shrinks (a center's round is then the same computation on fewer ranks); tensor, pipeline and
    sequence degrees are kept. ValueError when they alone need more than ``max_devices``."""
    if devices <= max_devices:
        return devices, dict(plan)
    model_parallel = 1
    for k in ("tp", "pp", "sp"):
        model_parallel *= int(plan.get(k, 1))
    if model_parallel > max_devices:
        raise ValueError(f"center {center!r}: its plan's tp·pp·sp = {model_parallel} needs more than {max_devices} "
                         "devices; scale to at least that many")
    dp = max(1, max_devices // model_parallel)
    out = {**plan, "dp": dp}
    if dp == 1 and int(out.get("zero_stage", 0)):
        out["zero_stage"] = 0  # nothing left to shard over
    return dp * model_parallel, out
