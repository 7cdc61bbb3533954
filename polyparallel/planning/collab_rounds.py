"""The collaborative plan's rounds: how many local steps between fusions, whether rounds overlap or
are buffered, and what a round costs (``cost_models/collab_simulator.py``), from each center's own
best synchronous plan (found by :func:`~.plan_search.search_sync` per center)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from polyparallel.cluster import Cluster
from polyparallel.cost_models import StepEstimate
from polyparallel.cost_models.collab_simulator import (
    BufferedSimResult,
    SimInputs,
    choose_local_steps,
    simulate_buffered,
    simulate_rounds,
    stragglers,
)
from polyparallel.plan import CENTER_FIELDS
from polyparallel.planning.assemble import model_info
from polyparallel.planning.constraints import Constraints, DoesNotFit
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.strategy import (
    MAX_STALENESS,
    CenterPlan,
    Collaborative,
    Estimate,
    Mesh,
    MeshAxis,
    Strategy,
    center_placements,
)

__all__ = ["collaborative_strategy"]


CenterBest = tuple[Any, StepEstimate, list[int], Strategy]  # a center, its plan's estimate, devices, Strategy


def collaborative_strategy(mdl: ModelGraphs, cl: Cluster, B: int, c: Constraints, per_center: list[CenterBest],
                           notes: list[str]) -> Strategy:
    """The collaborative Strategy of centers that each train with their own synchronous plan
    (``per_center``: the center, its plan's estimate, its devices, its Strategy as placed): ``H`` from
    the round simulator, overlapped or buffered rounds where the constraints allow and they help, priced
    so; what the choices were is appended to ``notes``."""
    rates = [e.throughput for _, e, _, _ in per_center]
    total_rate = sum(rates)
    # H from the round simulator (cost_models/collab_simulator.py): every center's own step time and WAN
    # link, the server's fusion and Flower's fixed cost per round; the slowest center sets the pace
    links = [ce.wan for ce, _, _, _ in per_center]
    inputs = SimInputs.make(
        [ce.name for ce, _, _, _ in per_center], [e.step_time for _, e, _, _ in per_center], 1,
        mdl.graph(mdl.b0).param_count(), down_Bps=[w.down_bandwidth if w else math.inf for w in links],
        up_Bps=[w.up_bandwidth if w else math.inf for w in links], latency_s=[w.latency if w else 0.0 for w in links])
    H, sim = choose_local_steps(inputs, c.comm_fraction, c.max_local_steps)
    round_time, comm = float(sim.round_s[0]), sim.critical_comm_share()
    fixed, fuse = float(sim.dur["framework"][0, 0]), float(sim.dur["fuse"][0, 0])
    fusion = float((sim.dur["distribute"][0] + sim.dur["upload"][0]).max())  # the slowest link's transfers
    local_s = round_time - fixed - fuse - fusion
    shares = [r / total_rate for r in rates]
    buffered = _buffered_rounds(inputs, H, c, round_time, notes)
    overlap = None if buffered else _overlapped_rounds(inputs, H, c, per_center, comm, notes)
    if overlap:  # priced at the steady overlapped round: what is exposed of the communication is 'fusion'
        sim = overlap[1]
        round_time, local_s = float(sim.round_s[-1]), float(sim.dur["compute"][-1].max())
        comm, fixed, fuse, fusion = 1 - local_s / round_time, 0.0, 0.0, round_time - local_s
    batches: float = B  # every round fuses every center's H steps on its share of B
    seconds: float = round_time
    if buffered:  # priced between fusions once every center has sent its first update
        K, _, bsim = buffered
        round_time = float(bsim.round_s[inputs.n:].mean())
        util = bsim.compute_s / bsim.published_s[-1]
        comm = 1 - float(np.sort(util)[-K:].mean())  # what the K centers a fusion waits for spend not training
        local_s, fixed, fuse, fusion = round_time * (1 - comm), 0.0, 0.0, round_time * comm
        # the samples that reach the model: each fused update carries H steps on its center's share of B
        index = {name: i for i, name in enumerate(inputs.names)}
        batches = sum(B * shares[index[name]] for f in bsim.fused for name, _ in f)
        seconds = float(bsim.published_s[-1])
    centers = [CenterPlan(name=ce.name, framework=ce.framework, devices=devs, share=round(r / total_rate, 6),
                          local_strategy={**e.config.record_fields(CENTER_FIELDS), "placements": c.placements,
                                          **center_placements(placed),
                                          "step_time_s": e.step_time, "samples_per_s": e.throughput})
               for (ce, e, devs, placed), r in zip(per_center, rates)]
    all_devs = [d for _, _, ds, _ in per_center for d in ds]
    est = Estimate(step_time_s=round_time / H, samples_per_s=batches * H / seconds,
                   model_flops_per_s_per_device=3 * mdl.graph(mdl.b0).flops() / mdl.b0 * batches * H / seconds
                   / len(all_devs), memory_bytes_max=max(max(r.total for r in e.memory)
                                                         for _, e, _, _ in per_center),
                   comm_fraction=comm, breakdown={"local_compute": local_s, "fusion": fusion, "framework": fixed,
                                                  "server_fusion": fuse})
    collab = Collaborative(centers=centers, fusion="fedavg", local_steps=H, rounds=1, compression="none",
                           round_time_s=round_time, comm_fraction=comm, overlap=overlap[0] if overlap else 0,
                           **({"buffer": buffered[0], "max_staleness": buffered[1]} if buffered else {}))
    g = mdl.graph(mdl.b0)
    strat = Strategy(model=model_info(mdl, g, mdl.b0, B), cluster=cl.to_dict() if hasattr(cl, "to_dict") else {},
                     mode="collaborative", global_batch=B, dp=1, tp=1, pp=1, sp=1,
                     mesh=Mesh(axes=[MeshAxis(name="center", size=len(all_devs), level="inter_center")],
                               devices=all_devs),
                     collaborative=collab, estimate=est)
    return strat


def _buffered_rounds(inputs: SimInputs, H: int, c: Constraints, sync_round: float,
                     notes: list[str]) -> tuple[int, int, BufferedSimResult] | None:
    """Buffered asynchronous rounds (``backends/collab/_buffered.py``) where the constraints allow them
    (``buffer=True``: ``K`` the centers that are not stragglers, :func:`stragglers`; a whole number: that
    ``K``) and ``K`` is fewer than the centers: ``K``, the staleness bound that admits every straggler's update
    (at least :data:`~polyparallel.strategy.MAX_STALENESS`) and the buffered rounds simulated for ``8·N`` fusions. None
    where every center keeps pace (synchronous rounds lose nothing to waiting)."""
    if c.buffer is False:
        return None
    x = replace(inputs, local_steps=H)
    slow = stragglers(x)
    k = x.n - len(slow) if c.buffer is True else int(c.buffer)
    if not 1 <= k <= x.n:
        raise DoesNotFit(f"buffer={c.buffer}: a fusion waits for K of the {x.n} centers' updates; give K in [1, {x.n}]")
    if k == x.n:
        if c.buffer is True:
            notes.append("buffered rounds allowed, not chosen: no center's round takes more than 1.5x the median "
                         "center's, so synchronous rounds wait for no straggler")
        return None
    # a straggler's update is as many versions old as the fusions the others make while it trains: the
    # staleness bound admits it (weighted down by its staleness), or the straggler's data would be left out.
    # Simulated without a bound; with the largest staleness it saw as the bound, it refuses nothing and runs the same
    sim = simulate_buffered(x, 8 * x.n, k)
    stale = max(MAX_STALENESS, *(t for f in sim.fused for _, t in f))
    cycle = x.cycle_s()
    late = ", ".join(f"{x.names[i]} ({cycle[i]:.3g} s)" for i in slow) or "none"
    fused = ", ".join(f"{name} {count}" for name, count in sim.updates().items())
    notes.append(f"buffered rounds (buffer={k} of {x.n}): a center's round alone takes a median {np.median(cycle):.3g} "
                 f"s, stragglers: {late}; synchronous rounds take {sync_round:.3g} s, fusing the first {k} updates in "
                 f"{float(sim.round_s[x.n:].mean()):.3g} s (simulated, {len(sim.fused)} fusions: updates fused per "
                 f"center {fused}; max_staleness {stale}, which admits every straggler's update). A center left out "
                 "of most fusions is under-represented in the model: under label "
                 "skew that costs accuracy (docs/collab.md, buffered rounds); constraints={'buffer': False} keeps "
                 "synchronous rounds")
    return k, stale, sim


def _overlapped_rounds(inputs: SimInputs, H: int, c: Constraints, per_center: list, sync_comm: float,
                       notes: list[str]) -> tuple[int, Any] | None:
    """Overlapped fusion (``backends/collab/_overlap.py``) where synchronous rounds cannot meet the
    communication budget within ``max_local_steps``: at the same ``H`` (the cap), the fewest steps
    ahead ``K`` whose steady overlapped round exposes at most the budget (all ``H`` where none does),
    and its simulated rounds. Fewest, because every step ahead is one round stale: on Fashion-MNIST
    under Dirichlet(0.3) skew one step of five cost 0.6 points against synchronous rounds, two 1.6,
    five 6 (``docs/collab.md``), more than a larger ``H`` would. None where synchronous rounds meet
    the budget, where overlap would not expose less, or where a center is not one torch process."""
    if sync_comm <= c.comm_fraction or not c.overlap:
        return None
    other = [ce.name for ce, _, devs, _ in per_center if ce.framework != "torch" or len(devs) != 1]
    if other:
        notes.append(f"communication is {sync_comm:.0%} of the round at the most local steps allowed, over the "
                     f"budget comm_fraction={c.comm_fraction:g}; overlapped fusion would hide part of it, but it runs "
                     f"single-process torch centers and centers {', '.join(other)} are not: synchronous rounds")
        return None

    def at(k: int) -> tuple[float, Any]:
        sim = simulate_rounds(replace(inputs, local_steps=H, overlap=k), 3)
        return 1 - float(sim.dur["compute"][-1].max() / sim.round_s[-1]), sim

    lo, hi = 1, H  # the exposed share falls with K: the first K that meets the budget lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid)[0] <= c.comm_fraction:
            hi = mid
        else:
            lo = mid + 1
    exposed, sim = at(hi)
    if exposed >= sync_comm:
        return None
    notes.append(f"overlapped fusion (overlap={hi} of H={H}): synchronous rounds expose {sync_comm:.0%} of the round "
                 f"to communication at the most local steps allowed, {hi} steps ahead {exposed:.0%} "
                 "(constraints overlap=False: synchronous rounds only)")
    return hi, sim
