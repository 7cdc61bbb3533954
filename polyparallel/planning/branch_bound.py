"""The search's ranking of the plans it enumerates: branch and bound on the cost model's exact
memory and step-time lower bounds (:class:`Best`), and what the ranking says of the plan it chose
(:func:`why_axes`: per mesh axis, what the fastest plan without it costs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, StepEstimate, estimate_step
from polyparallel.cost_models.step import StepBound, step_lower_bound, step_memory
from polyparallel.ir import Graph
from polyparallel.planning.constraints import Constraints
from polyparallel.planning.derived import plan_note
from polyparallel.planning.place_plan import fits_memory

__all__ = ["AXES", "Best", "Candidate", "brief", "least_memory", "replicates_over_tp", "shortfall", "why_axes"]

AXES = ("dp", "tp", "pp", "sp", "cp")


@dataclass
class Candidate:
    index: int  # enumeration order: ties in step time go to the earliest, as a plain scan would
    b: int
    graph: Graph
    bound: StepBound
    short: float = 0.0  # bytes by which it misses memory on its worst device (plans that do not fit)

    @property
    def peak(self) -> float:
        return max(r.total for r in self.bound.memory)


@dataclass
class Best:
    """Branch and bound over the enumerated plans.

    Enumeration (:meth:`offer`) prices every plan's memory exactly and, when it fits, its step
    time from below (:func:`~polyparallel.cost_models.step.step_lower_bound`, no pipeline
    simulation; a plan that does not fit is never ranked, so its time is not priced); the
    control flow of the enumeration depends only on whether plans fit, so the candidate set is
    the same as pricing each in full. :meth:`solve` then prices the fitting plans in full in
    increasing order of their bounds and stops at the first bound above the best step time
    found: a skipped plan cannot be faster, so the optimum is unchanged.
    """

    cl: Cluster | None = None
    cap: float | None = None
    est: StepEstimate | None = None
    b: int = 0
    candidates: int = 0
    priced: int = 0  # plans priced in full (pipeline simulated)
    closest: StepEstimate | None = None  # the plan that misses memory by the least
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why a mesh shape gave no plan to offer
    fitting: list[Candidate] = field(default_factory=list)
    # why the executor would refuse a plan (empty: it runs it); a refused plan that fits stays out
    # of ``fitting`` but counts as fitting for the enumeration's control flow
    refuse: Callable[[ParallelConfig], list[str]] | None = None
    refused: dict[str, int] = field(default_factory=dict)  # reason -> distinct plans it kept out
    chosen: Candidate | None = None  # the candidate behind ``est``
    _closest: Candidate | None = None
    _full: dict[int, StepEstimate] = field(default_factory=dict)
    short_without: dict[str, Candidate] = field(default_factory=dict)  # axis -> closest misfit with it at 1

    def offer(self, graph: Graph, cfg: ParallelConfig, b: int) -> bool:
        """Enumerate one plan: ``True`` when it fits (``ValueError`` when the cost model refuses it)."""
        assert self.cl is not None
        # 0 bounds the step time of a plan that does not fit: it is never ranked
        bound = StepBound(cfg, 0.0, step_memory(graph, self.cl, cfg))
        fits = fits_memory(bound, self.cap)
        if fits:
            bound = step_lower_bound(graph, self.cl, cfg)
        cand = Candidate(self.candidates, b, graph, bound)
        self.candidates += 1
        if not fits:
            cand.short = shortfall(bound, self.cap)
            if self._closest is None or cand.short < self._closest.short:
                self._closest = cand
            for axis in AXES:  # per axis: the plan without it that misses memory by the least (explain)
                held = self.short_without.get(axis)
                if getattr(cfg, axis) == 1 and (held is None or cand.short < held.short):
                    self.short_without[axis] = cand
            return False
        if self.refuse is None or not self.refuse(cfg):
            self.fitting.append(cand)
        return True

    def full(self, cand: Candidate) -> StepEstimate:
        est = self._full.get(cand.index)
        if est is None:
            assert self.cl is not None
            est = self._full[cand.index] = estimate_step(cand.graph, self.cl, cand.bound.config)
            self.priced += 1
        return est

    def solve(self, prune: bool = True) -> None:
        """Price the fitting plans; ``prune=False`` prices every one (the exhaustive yardstick)."""
        best: Candidate | None = None
        for cand in sorted(self.fitting, key=lambda x: (x.bound.lower_bound, x.index)):
            if prune and self.est is not None and cand.bound.lower_bound > self.est.step_time * (1 + 1e-9):
                break  # sorted by bound: no later plan can be faster
            est = self.full(cand)
            faster = self.est is None or est.step_time < self.est.step_time * (1 - 1e-12)
            tie = self.est is not None and best is not None and est.step_time <= self.est.step_time * (1 + 1e-12) \
                and cand.index < best.index
            if faster or tie:
                self.est, self.b, best = est, cand.b, cand
        self.chosen = best
        if self._closest is not None:
            self.closest = self.full(self._closest)


def shortfall(est: StepEstimate | StepBound, cap: float | None) -> float:
    return max(r.total - min(r.capacity, cap or math.inf) for r in est.memory)


def replicates_over_tp(est: StepEstimate | None) -> bool:
    """Whether ``est``'s plan has tp > 1 and splits no op over it: each tp rank computes, and holds,
    what one process would."""
    if est is None or est.config.tp == 1 or not est.config.op_plans:
        return False
    return not any(p.split > 1 or p.param_split > 1 for p in est.config.op_plans)


_SPLITS = {"dp": "splits the batch: each replica trains on its share and the gradients are reduced",
           "tp": "splits each op's loop dims over devices inside a node (placements: {placed})",
           "pp": "splits the layers into stages that pass activations point to point",
           "sp": "splits the sequence (Ulysses: all-to-all around attention)",
           "cp": "splits the sequence (ring attention: K/V blocks passed around the shards, overlapped with the "
                 "attention's compute)"}


def why_axes(best: Best, c: Constraints) -> list[str]:
    """Per mesh axis of the chosen plan: what it splits and what the fastest plan without it costs
    (priced in full, in bound order as :meth:`Best.solve`), or why no plan without it fits.
    Lines start with ``why <axis>=``; ``explain`` shows them as a table."""
    assert best.est is not None
    chosen = best.est
    out = []
    for axis in AXES:
        size = getattr(chosen.config, axis)
        if size == 1:
            continue
        # every op replicated over tp: the tp ranks repeat one process's work
        repeats = f"each of the {size} tp ranks computes what one process would" \
            if axis == "tp" and replicates_over_tp(chosen) else ""
        if getattr(c, axis) is not None:  # pinned: the user's choice, not the search's
            if repeats:
                out.append(f"tp={size} as pinned splits no op: {repeats}, because every placement that splits an op "
                           "priced slower (or the backend runs none here; see what was left out); constraints without "
                           "tp leave the devices to dp or pp")
            continue
        head = f"why {axis}={size}: " + _SPLITS[axis].format(placed=plan_note(chosen.config.op_plans)) + "; "
        if repeats:
            head = (f"why tp={size}: it splits no op: every op is replicated over tp, so {repeats}; every plan that "
                    f"divides the work over these devices priced slower (the model may be too small to gain from "
                    f"them): fewer devices give the same step; ")
        alt: StepEstimate | None = None
        for cand in sorted((x for x in best.fitting if getattr(x.bound.config, axis) == 1),
                           key=lambda x: (x.bound.lower_bound, x.index)):
            if alt is not None and cand.bound.lower_bound > alt.step_time * (1 + 1e-9):
                break
            est = best.full(cand)
            if alt is None or est.step_time < alt.step_time:
                alt = est
        short = best.short_without.get(axis)
        if alt is not None:
            a, b = alt.breakdown(), chosen.breakdown()
            part = max(a, key=lambda k: a[k] - b.get(k, 0.0))
            ratio = alt.step_time / chosen.step_time
            out.append(head + f"the fastest plan without {axis} ({brief(alt.config)}) is {ratio:.2f}× slower "
                       f"({alt.step_time:.4g} s vs {chosen.step_time:.4g} s per step; most of the difference in "
                       f"{part}: {a[part]:.4g} s vs {b.get(part, 0.0):.4g} s)")
        elif short is not None:
            worst = max(short.bound.memory, key=lambda r: r.total - min(r.capacity, best.cap or math.inf))
            out.append(head + f"no plan without {axis} fits: the closest ({brief(short.bound.config)}) needs "
                       f"{worst.total / 1e9:.1f} GB > {min(worst.capacity, best.cap or math.inf) / 1e9:.1f} GB "
                       f"on {worst.label}")
        else:
            out.append(head + f"no plan without {axis} was a candidate (the backend or the cluster rules them out)")
    return out


def brief(cfg: ParallelConfig) -> str:
    return (f"{cfg.degrees_label()} m={cfg.microbatches} {cfg.schedule_label} ZeRO-{cfg.zero_stage} "
            f"recompute {cfg.recompute}")


def least_memory(best: Best) -> None:
    """Among plans within 10% of the fastest step time, the one with the least peak memory.

    The enumeration already holds every fitting plan's exact memory and a lower bound on its
    step time: plans are visited least memory first, those bounded above the limit skipped
    unpriced, and the first whose full price is within the limit is taken.
    """
    assert best.est is not None
    limit = best.est.step_time * 1.1
    peak = max(r.total for r in best.est.memory)
    for cand in sorted(best.fitting, key=lambda x: (x.peak, x.index)):
        if cand.peak >= peak:
            break
        if cand.bound.lower_bound > limit * (1 + 1e-9):
            continue
        est = best.full(cand)
        if est.step_time <= limit:
            best.est, best.b = est, cand.b
            return
