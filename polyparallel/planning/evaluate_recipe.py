"""Pricing a hand-made recipe (:func:`evaluate`): the degrees a user or a published run chose, the rest
chosen as :func:`~polyparallel.planning.plan_search.search` would, priced by the same cost model and
checked against what the torch backend runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from polyparallel.cluster import Cluster
from polyparallel.cost_models import StepEstimate
from polyparallel.cost_models.parallel_config import execution_options
from polyparallel.planning.assemble import strategy_of
from polyparallel.planning.collector import young_collected
from polyparallel.planning.constraints import Constraints
from polyparallel.planning.executability import executor
from polyparallel.planning.executor_check import checked_as_placed
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.planning.model_inputs import model_and_inputs
from polyparallel.planning.place_plan import MODES
from polyparallel.planning.plan_search import check_batch_size, check_cluster, search_sync
from polyparallel.strategy import SearchRecord, Strategy

__all__ = ["evaluate"]


def evaluate(model: Any, example_inputs: Any = None, cluster: Cluster | str | Path = "local-cpu:2", *,
             example_kwargs: dict[str, Any] | None = None, dp: int | None = None, tp: int = 1, pp: int = 1,
             sp: int = 1, cp: int = 1, microbatches: int | None = None, schedule: str | None = None,
             zero_stage: int | None = None, recompute: str | None = None, batch_size: int | None = None,
             dtype: str | None = None, placements: str = "rule", ep: int = 1, profile: bool = False,
             chunks: int | None = None, sequence_parallel: bool = False, partition: str | None = None,
             execution: dict[str, Any] | None = None, compile: str = "none") -> Strategy:
    """Price a hand-made recipe with the same cost model; what is not given is chosen as the search would.

    ``chunks``, ``sequence_parallel``, ``partition``, ``compile`` and ``execution`` (how the framework
    that ran the recipe runs it: fused kernels, gradient overlap, pipeline p2p, ...) are
    :class:`Constraints`'.
    A recipe measured under Megatron-LM of 2021, say, is priced with
    ``execution={"fused_elementwise": True, "grad_overlap": 0}`` (hand-fused 16-bit kernels, gradients
    all-reduced after the last backward); unset, each is what the torch backend does.

    A recipe's tensor parallelism is Megatron's (``placements="rule"``, what the usual recipes
    mean by ``tp``); ``placements="torch"`` or ``"any"`` places its ops with the per-stage solver
    as the search does (:class:`Constraints`).

    ``profile``: as :func:`search`'s.

    Returns a Strategy whose ``estimate`` holds the price (even when the recipe does not fit:
    then ``estimate.memory_bytes_max`` exceeds the capacity and ``search.notes`` says why).
    """
    Constraints(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, ep=ep)  # raises on degrees no plan has
    check_batch_size(batch_size)
    check_cluster(cluster)
    model, example_inputs, example_kwargs, _ = model_and_inputs(model, example_inputs, example_kwargs)
    cl = cluster if isinstance(cluster, Cluster) else Cluster.resolve(str(cluster))
    mdl = ModelGraphs(model, example_inputs, example_kwargs)
    if profile:
        cl = executor("torch").profile(cl, mdl, lambda _: None)
    devs = list(range(cl.num_devices))
    seq = sp * cp
    if dp is None:
        dp = len(devs) // (tp * pp * seq)
        if dp < 1:
            raise ValueError(f"tp*pp*sp*cp = {tp * pp * seq} exceeds the {len(devs)} devices of {cl.name}")
    world = dp * tp * pp * seq
    if world > len(devs):
        raise ValueError(f"dp*tp*pp*sp*cp = {world} but {cl.name} has {len(devs)} devices")
    devs = devs[:world]
    B = batch_size or mdl.b0 * dp
    if B % dp:
        raise ValueError(f"the global batch {B} is not divisible by dp={dp}")
    if (dp * seq) % ep:
        raise ValueError(f"ep={ep} must divide dp*sp*cp = {dp * seq}: expert parallelism splits the experts over "
                         "data/sequence-parallel ranks")
    c = Constraints(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, ep=ep, microbatches=microbatches, schedule=schedule,
                    zero_stage=zero_stage, recompute=recompute, dtype=dtype, allow_wan=True, cross_node_tp=True,
                    devices=world, chunks=chunks, sequence_parallel=sequence_parallel, partition=partition,
                    compile=compile,
                    execution=execution_options(execution))  # checked, as sorted pairs
    if placements not in MODES:
        raise ValueError(f"placements must be one of {', '.join(MODES)}, not {placements!r}")
    t0 = time.perf_counter()
    best = search_sync(mdl, cl, B, c, devs, False, "throughput", lambda _: None, rank_by=placements)
    record = SearchRecord(capture_s=round(mdl.capture_s, 3), search_s=round(time.perf_counter() - t0, 3),
                          candidates=best.candidates, solver="evaluate")
    if best.est is None:
        if best.closest is None:
            # the cost model's own refusals ("dp2 tp2 ...: why") first, then the search's notes
            notes = sorted(best.notes, key=lambda n: not n.startswith("dp"))
            why = best.skipped[:3] + notes[:3] or [f"{best.candidates} plan(s) enumerated, none priced"]
            raise ValueError(f"the recipe dp={dp} tp={tp} pp={pp} sp={sp} cp={cp} cannot be priced on {cl.name}: "
                             + "; ".join(why))
        est = best.closest
        s = strategy_of(mdl, cl, est, _batch_of(mdl, est), B, devs, record, placements)
        return s.model_copy(update={"search": record.model_copy(update={"notes": [
            r.why() for r in est.memory if not r.fits]})})
    strat = strategy_of(mdl, cl, best.est, best.b, B, devs, record, placements)
    # a recipe the torch backend would refuse at launch says so now, as a pinned search's does
    with young_collected():
        return checked_as_placed(strat, mdl, best, B, placements)


def _batch_of(mdl: ModelGraphs, est: StepEstimate) -> int:
    for b in mdl.priced:
        if est.samples_per_step == b * est.config.dp * est.config.microbatches:
            return b
    return mdl.b0
