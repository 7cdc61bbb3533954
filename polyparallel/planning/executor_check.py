"""The chosen plan against the executor's own pre-launch check on the user's module: what the
plan-level predicates cannot see without the model (where the pipeline cuts fall in torch.export's
graph, module types behind tensor-parallel ops) is checked here, and a refused plan is replaced by
the next fastest (:func:`executor_checked`), or kept with a "planning only" note where the user
chose its placements (:func:`checked_as_placed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import StepEstimate
from polyparallel.planning.assemble import strategy_of
from polyparallel.planning.branch_bound import Best, Candidate, why_axes
from polyparallel.planning.constraints import Constraints, DoesNotFit
from polyparallel.planning.executability import NotExecutable, executor
from polyparallel.planning.model_graphs import ModelGraphs, rebatch
from polyparallel.strategy import Estimate, SearchRecord, Strategy

__all__ = ["center_checked", "checked_as_placed", "executor_checked", "train_batch", "written_estimate"]


def written_estimate(s: Strategy) -> Estimate:
    """The estimate of a strategy the search wrote (it always writes one)."""
    assert s.estimate is not None, "a searched strategy carries its estimate"
    return s.estimate


def executor_checked(strat: Strategy, mdl: ModelGraphs, cl: Cluster, best: Best, B: int, devs: list[int],
                record: SearchRecord, c: Constraints, say: Callable[[str], None]) -> Strategy:
    """The fastest plan the torch backend's own pre-launch check (:func:`~polyparallel.backends.torch.plan_for`)
    accepts on the user's module: what the plan-level predicates cannot see without the model
    (where the pipeline cuts fall in torch.export's graph, module types behind tensor-parallel ops)
    is checked here, and a refused plan is replaced by the next fastest until one is accepted (every
    refusal removes a candidate, so the walk ends; :class:`DoesNotFit` when none is left). Plans of a
    model that does not follow ``train``'s ``forward(inputs, labels)`` form are not checked."""
    check = executor("torch").check
    batch = train_batch(mdl, B)
    if batch is None:
        return strat
    refused: list[str] = []
    # a refused plan that runs with Megatron's placements instead, at the rule's price: taken
    # unless a plan the walk reaches later is faster
    fallback: tuple[Strategy, StepEstimate, int, Candidate] | None = None
    while True:
        try:
            check(strat, mdl.model, batch, mdl.exact(best.b))
            if _replicated_tp(strat, best, c):
                # the plan was ranked at the placements the polyhedral model derives, but the torch
                # backend runs none of them on this model: each tp rank would do the whole stage's
                # work. That is the model's ops, not this mesh's, so every tp > 1 plan is dropped
                assert best.chosen is not None  # the candidate behind strat
                say(f"the torch backend runs {best.chosen.bound.config} only replicated over tp; searching "
                    "without tensor parallelism")
                replicated_note = (f"left out tensor parallelism: the torch backend splits none of this model's "
                                   f"ops over tp as priced ({best.chosen.bound.config} would be written with every "
                                   f"op replicated, {written_estimate(strat).step_time_s:.3g} s per step)")
                best.fitting = [f for f in best.fitting if f.bound.config.tp == 1]
                best.est, best.b, best.chosen = None, 0, None
                best.solve()
                if best.est is None:
                    break  # no plan without tp: keep the replicated one, which says so
                strat = strategy_of(mdl, cl, best.est, best.b, B, devs, record, c.placements, c.memory_cap)
                notes = [*(n for n in strat.search.notes if not n.startswith("why ")), *why_axes(best, c),
                         replicated_note]
                strat = strat.model_copy(update={"search": strat.search.model_copy(update={"notes": notes})})
                continue
            if fallback is not None and written_estimate(fallback[0]).step_time_s < written_estimate(strat).step_time_s:
                strat, (best.est, best.b, best.chosen) = fallback[0], fallback[1:]
            break
        except NotExecutable as e:
            assert best.chosen is not None and best.est is not None  # the refused plan's
            ruled = _rule_placed(strat, mdl, cl, best, B, devs, record, c, batch)
            if ruled is None:
                refused.append(f"{best.chosen.bound.config}: {e}")
            elif fallback is None or written_estimate(ruled).step_time_s < written_estimate(fallback[0]).step_time_s:
                fallback = (ruled, best.est, best.b, best.chosen)
            say(f"the torch backend refuses {best.chosen.bound.config}; trying the next plan")
            best.fitting.remove(best.chosen)
            best.est, best.b, best.chosen = None, 0, None
            best.solve()
            if best.est is None or (fallback is not None
                                    and best.est.step_time >= written_estimate(fallback[0]).step_time_s):
                if fallback is None:
                    raise DoesNotFit("no plan the torch backend executes fits: " + "; ".join(refused[-3:])) from e
                strat, (best.est, best.b, best.chosen) = fallback[0], fallback[1:]
                break
            strat = strategy_of(mdl, cl, best.est, best.b, B, devs, record, c.placements, c.memory_cap)
    if refused:  # the axes' reasons were the refused plan's: give the chosen one's
        notes = [*(n for n in strat.search.notes if not n.startswith("why ")), *why_axes(best, c),
                 f"left out {len(refused)} faster plan(s) the torch backend refuses for this "
                 "model: " + " | ".join(r[:300] for r in refused)]
        strat = strat.model_copy(update={"search": strat.search.model_copy(update={"notes": notes})})
    return strat


def _replicated_tp(strat: Strategy, best: Best, c: Constraints) -> bool:
    """Whether the written plan replicates whole stages over an unpinned ``tp > 1`` while plans
    without tensor parallelism are left to choose from."""
    if strat.tp == 1 or c.tp is not None or not any(st.placed_by == "replicated" for st in strat.stages):
        return False
    return any(f.bound.config.tp == 1 for f in best.fitting)


def _rule_placed(strat: Strategy, mdl: ModelGraphs, cl: Cluster, best: Best, B: int, devs: list[int],
                 record: SearchRecord, c: Constraints, batch: Any) -> Strategy | None:
    """The refused plan ``strat`` with Megatron's rule placements where the solver placed a stage,
    when the torch backend accepts that (the solver does not see every rule of the backend: a tied
    embedding and output layer must shard alike); None otherwise. Its price is the rule's.
    ``batch``: the global batch the backend's check cuts a pipeline on (:func:`train_batch`)."""
    if c.placements != "torch" or strat.tp == 1 or all(st.placed_by != "solver" for st in strat.stages):
        return None
    assert best.est is not None  # the refused plan's estimate
    ruled = strategy_of(mdl, cl, best.est, best.b, B, devs, record, "rule", c.memory_cap)
    try:
        executor("torch").check(ruled, mdl.model, batch, mdl.exact(best.b))
    except NotExecutable:
        return None
    return ruled


def center_checked(mdl: ModelGraphs, cl: Cluster, best: Best, B: int, devs: list[int],
                   c: Constraints) -> tuple[Strategy | None, list[str]]:
    """Walk ``best`` (a collaborative center's search) to the fastest plan the center runs: the torch
    backend's check for a run that calls the model's own forward on each rank's shards
    (``Executor.own_forward_check``: what a center's local steps do), with the example's call.
    Returns that plan's synchronous Strategy, placed as ``c.placements`` says (its per-op placements
    are what the center runs: :func:`polyparallel.strategy.center_placements`), and the refused
    plans' reasons; ``(None, reasons)`` with ``best.est`` None when every plan is refused. A model
    that is not a torch module is not checked (no center runs it)."""
    import torch

    check = executor("torch").own_forward_check
    checked = isinstance(mdl.model, torch.nn.Module)
    refused: list[str] = []
    while best.est is not None:
        assert best.chosen is not None  # the candidate behind best.est
        strat = strategy_of(mdl, cl, best.est, best.b, B, devs, SearchRecord(), c.placements, c.memory_cap)
        if not checked:
            return strat, refused
        try:
            check(strat, mdl.model, tuple(mdl.args), dict(mdl.kwargs), mdl.exact(best.b))
            return strat, refused
        except NotExecutable as e:
            refused.append(f"{best.chosen.bound.config}: {e}")
            best.fitting.remove(best.chosen)
            best.est, best.b, best.chosen = None, 0, None
            best.solve()
    return None, refused


def checked_as_placed(strat: Strategy, mdl: ModelGraphs, best: Best, B: int, placements: str) -> Strategy:
    """Placements the user chose (``rule``, ``any``), or a recipe ``evaluate`` prices, are kept even
    where the torch backend refuses them; the backend's pre-launch check, given one global batch as
    train gives it (so a forward that fails on a rank's shards is tried as the exported graph, as
    train does), then says so first in the notes (train refuses it the same way)."""
    batch = train_batch(mdl, B)
    if batch is None:
        return strat
    try:
        executor("torch").check(strat, mdl.model, batch, mdl.exact(best.b))
        return strat
    except NotExecutable as e:
        hint = (" (placements='torch' places tensor parallelism as it runs)" if placements != "torch" and strat.tp > 1
                else "")
        note = (f"planning only: the torch backend refuses this plan with placements={placements!r} ({e}); "
                f"polyparallel search writes only plans train runs{hint}")
    return strat.model_copy(update={"search": strat.search.model_copy(update={"notes": [note, *strat.search.notes]})})


def train_batch(mdl: ModelGraphs, B: int) -> tuple[Any, Any] | None:
    """One global batch ``(inputs, labels)`` of zeros shaped like the example, for ``train``'s
    ``forward(inputs, labels)`` form, on the model's device; None for another form."""
    import torch

    if not isinstance(mdl.model, torch.nn.Module):
        return None
    pair = (*mdl.args, mdl.kwargs["labels"]) if set(mdl.kwargs) == {"labels"} else (
        mdl.args if not mdl.kwargs else ())
    if len(pair) != 2 or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in pair):
        return None
    device = next((p.device for p in mdl.model.parameters()), pair[0].device)
    return tuple(rebatch(t, mdl.b0, B).to(device) for t in pair)
