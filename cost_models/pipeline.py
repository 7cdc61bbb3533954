"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, looped BFS) simulated task by task.

``p`` stages, ``m`` micro-batches, ``v`` model chunks per stage (a chunked schedule; ``v = 1``
otherwise). Stage ``s`` runs forward ``F(j, c)`` and backward ``B(j, c)`` of micro-batch ``j``
on its chunk ``c`` (global chunk ``c·p + s``) in a fixed per-stage order:

* **GPipe**: ``F(0..m−1)`` then ``B(m−1..0)``; every micro-batch's activations stay alive
  until its backward, so ``m`` are in flight.
* **1F1B** (PipeDream-flush): ``w_s = min(p − s − 1, m)`` warm-up forwards, then alternate
  one forward / one backward, then drain; at most ``p − s`` micro-batches are in flight.
* **interleaved 1F1B** (Megatron, Narayanan et al. 2021): forwards visit chunks in groups
  of ``p`` micro-batches (``chunk = ⌊k/p⌋ mod v``), warm-up
  ``w_s = (p − s − 1)·2 + (v − 1)·p`` tasks; needs ``m`` a multiple of ``p``.
* **looped BFS** (breadth-first, Lamy-Poirier 2023): ``F(0..m−1)`` on chunk 0, then on chunk 1, ...,
  then the backwards chunk by chunk in reverse, micro-batches in reverse; all ``v·m``
  chunk-activations are in flight. Equal stages: ``(v·m + p − 1)(f + b)/v`` for ``m ≥ p`` (the
  interleaved schedule's), ``(v·p + m − 1)(f + b)/v`` below (each chunk's loop waits for the ring).

A task starts when its stage is free and its input has arrived: ``F(j, g)`` needs
``F(j, g−1)`` plus the point-to-point time of the boundary, ``B(j, g)`` needs
``B(j, g+1)`` (or ``F(j, last)`` for the last chunk). The simulation returns the makespan,
each stage's busy and bubble time, and the peak number of chunk-activations alive per stage
(``F`` done, ``B`` not yet), which sets activation memory.

For equal stages (``f``, ``b`` per micro-batch, no p2p cost) this reproduces the closed
forms: makespan ``(m + p − 1)(f + b)`` and bubble fraction ``(p − 1)/(m + p − 1)`` for
GPipe and 1F1B, and ``(p − 1)/(v·m + p − 1)`` for interleaved. With unequal stage times
(heterogeneous devices, unbalanced layers) the slowest stage sets the steady state and the
makespan is at least ``m·max_s(f_s + b_s)``; the simulation gives the exact value.

Examples:
    >>> r = simulate("1f1b", [1.0] * 4, [2.0] * 4, microbatches=8)
    >>> r.makespan, round(r.bubble_fraction, 4), r.in_flight
    (33.0, 0.2727, (4, 3, 2, 1))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from polyparallel.plan import SCHEDULES, chunks_per_stage

__all__ = ["PRICED", "SCHEDULES", "PipelineResult", "SchedulePrice", "bubble_fraction", "makespan_bound",
           "order_problem", "peak_in_flight", "schedule_order", "simulate"]


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of one simulated step of the pipeline."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    makespan: float
    busy: tuple[float, ...]
    in_flight: tuple[int, ...]  # peak chunk-activations alive per stage

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stage that idles least (the closed forms' quantity for equal stages)."""
        return min(self.bubble) / self.makespan if self.makespan else 0.0


def bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Closed form for equal stages: ``(p − 1)/(v·m + p − 1)`` (``v = 1`` unless the schedule is chunked)."""
    v = chunks_per_stage(schedule, chunks)
    return (stages - 1) / (v * microbatches + stages - 1)


Order = list[list[tuple[str, int, int]]]  # per stage: ("F"|"B", micro-batch, local chunk) in the order run


@dataclass(frozen=True)
class SchedulePrice:
    """What the cost model knows of one schedule of :data:`~polyparallel.plan.PIPELINE_SCHEDULES`.

    ``order(p, m, v)``: each stage's task order; ``in_flight(p, m, v)``: the peak chunk-activations
    alive per stage under that order (a closed form; a test checks it against the simulation);
    ``problem(p, m, v)``: why the order cannot be built, or None.
    """

    order: Callable[[int, int, int], Order]
    in_flight: Callable[[int, int, int], tuple[int, ...]]
    problem: Callable[[int, int, int], str | None] = lambda p, m, v: None


def _gpipe(p: int, m: int, v: int) -> Order:
    return [[("F", j, 0) for j in range(m)] + [("B", j, 0) for j in reversed(range(m))] for _ in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> Order:
    orders = []
    for s in range(p):
        w = min(p - s - 1, m)
        o = [("F", j, 0) for j in range(w)]
        nf, nb = w, 0
        while nb < m:
            if nf < m:
                o.append(("F", nf, 0))
                nf += 1
            o.append(("B", nb, 0))
            nb += 1
        orders.append(o)
    return orders


def _interleaved(p: int, m: int, v: int) -> Order:
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return "F", (k // (p * v)) * p + k % p, (k // p) % v

    def bwd(k: int) -> tuple[str, int, int]:
        return "B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

    orders = []
    for s in range(p):
        w = min((p - s - 1) * 2 + (v - 1) * p, total)
        o = [fwd(k) for k in range(w)]
        nf, nb = w, 0
        while nb < total:
            if nf < total:
                o.append(fwd(nf))
                nf += 1
            o.append(bwd(nb))
            nb += 1
        orders.append(o)
    return orders


def _looped_bfs(p: int, m: int, v: int) -> Order:
    forwards = [("F", j, c) for c in range(v) for j in range(m)]
    backwards = [("B", j, c) for c in reversed(range(v)) for j in reversed(range(m))]
    return [forwards + backwards for _ in range(p)]


def _interleaved_problem(p: int, m: int, v: int) -> str | None:
    return f"the interleaved schedule needs microbatches ({m}) to be a multiple of stages ({p})" if m % p else None


#: each schedule's price, by its name in :data:`~polyparallel.plan.PIPELINE_SCHEDULES` (a test checks both list
#: the same schedules)
PRICED: dict[str, SchedulePrice] = {
    "gpipe": SchedulePrice(_gpipe, lambda p, m, v: (m,) * p),
    "1f1b": SchedulePrice(_one_f_one_b, lambda p, m, v: tuple(min(p - s, m) for s in range(p))),
    "interleaved": SchedulePrice(
        _interleaved, lambda p, m, v: tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p)),
        _interleaved_problem),
    "looped_bfs": SchedulePrice(_looped_bfs, lambda p, m, v: (m * v,) * p),
}


def order_problem(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> str | None:
    """Why ``schedule`` has no task order for these stages, micro-batches and chunks per stage; None
    when it has one."""
    if schedule not in PRICED:
        return f"unknown pipeline schedule {schedule!r}; one of {', '.join(PRICED)}"
    if stages < 1 or microbatches < 1 or chunks < 1:
        return f"pipeline needs stages, microbatches, chunks >= 1 (got {stages}, {microbatches}, {chunks})"
    return PRICED[schedule].problem(stages, microbatches, chunks)


def schedule_order(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> Order:
    """Per-stage task order: lists of ``("F"|"B", microbatch, local chunk)``."""
    return _build_order(schedule, stages, microbatches, chunks)


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if (why := order_problem(schedule, p, m, v)) is not None:
        raise ValueError(why)


# Orders are built where they are read, not kept: a simulation walks its order once, and the
# simulations are memoised (a search simulates a few plans and enumerates ~10^3 schedules).
def _build_order(schedule: str, stages: int, microbatches: int, chunks: int) -> Order:
    _check(schedule, stages, microbatches, chunks)
    return PRICED[schedule].order(stages, microbatches, chunks)


def peak_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Peak chunk-activations alive per stage (``F`` done, ``B`` not yet).

    It depends only on each stage's task order, not on task durations, so memory can be
    priced without simulating: ``m`` for GPipe; for 1F1B and interleaved 1F1B the ``w_s`` warm-up
    forwards are alive when the first steady forward adds one, after which every forward is
    followed by a backward: ``min(w_s + 1, v·m)``, i.e. ``min(p − s, m)`` for 1F1B and
    ``min(2(p − s − 1) + (v − 1)p + 1, v·m)`` interleaved (:func:`schedule_order`'s orders).
    """
    return _in_flight(schedule, stages, microbatches, chunks_per_stage(schedule, chunks))


@lru_cache(maxsize=4096)
def _in_flight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    _check(schedule, p, m, v)
    return PRICED[schedule].in_flight(p, m, v)


def makespan_bound(forward: Sequence[float], backward: Sequence[float], microbatches: int, chunks: int = 1,
                   p2p: Sequence[float] | float = 0.0) -> float:
    r"""A lower bound on the simulated makespan of any of the schedules, in ``O(p)``.

    Stage ``s`` starts with the forward of micro-batch 0 on its first chunk, which waits for
    that forward on the stages before it, and ends with the backward of the last micro-batch
    on its first chunk, which the stages before it must still run; in between it is busy
    ``m·(f_s + b_s)``. With ``c_s`` the hop from stage ``s`` to ``s + 1``:

    .. math::  T \ge \max_s \Big[\sum_{s' < s} \Big(rac{f_{s'} + b_{s'}}{v} + 2 c_{s'}\Big) + m (f_s + b_s)\Big]

    For ``p`` equal stages without hops this is ``(m + (p − 1)/v)(f + b)``, the closed form,
    so the bound is tight where stages are balanced.
    """
    p = len(forward)
    comm = _hops(p2p, p)
    acc, best = 0.0, 0.0
    for s in range(p):
        best = max(best, acc + microbatches * (forward[s] + backward[s]))
        acc += (forward[s] + backward[s]) / chunks + 2 * comm[s]
    return best


def _hops(p2p: Sequence[float] | float, p: int) -> list[float]:
    comm = [float(p2p)] * p if isinstance(p2p, int | float) else [float(x) for x in p2p]
    if len(comm) < p:
        comm += [comm[-1] if comm else 0.0] * (p - len(comm))
    return comm


def simulate(schedule: str, forward: Sequence[float], backward: Sequence[float], microbatches: int,
             chunks: int = 1, p2p: Sequence[float] | float = 0.0) -> PipelineResult:
    """Simulate one step.

    Args:
        forward / backward: seconds per micro-batch of each stage (all its chunks together;
            a chunk takes ``1/v`` of it).
        p2p: seconds to send a boundary activation (or its gradient) from stage ``s`` to its
            neighbour, per stage boundary (``p`` values, the last wraps to stage 0 for the
            interleaved schedule) or one number for all.
    """
    p = len(forward)
    if len(backward) != p:
        raise ValueError("forward and backward need one time per stage")
    v = chunks_per_stage(schedule, chunks)
    comm = _hops(p2p, p)
    return _simulate(schedule, tuple(float(x) for x in forward), tuple(float(x) for x in backward), microbatches,
                     v, tuple(comm))


@lru_cache(maxsize=4096)
def _simulate(schedule: str, forward: tuple[float, ...], backward: tuple[float, ...], microbatches: int, v: int,
              comm: tuple[float, ...]) -> PipelineResult:
    # a search prices many plans with the same stage times (ZeRO stages 0-2 differ only after
    # the pipeline), so a simulation is kept by its inputs
    p = len(forward)
    order = _build_order(schedule, p, microbatches, v)
    f = [x / v for x in forward]
    b = [x / v for x in backward]
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (F|B, microbatch, global chunk) -> finish time
    free = [0.0] * p
    pos = [0] * p
    alive = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(order[s]):
                kind, j, c = order[s][pos[s]]
                g = c * p + s
                if kind == "F":
                    dep = ("F", j, g - 1) if g > 0 else None
                    hop = comm[(g - 1) % p] if g > 0 else 0.0
                else:
                    dep = ("B", j, g + 1) if g < last else ("F", j, g)
                    hop = comm[g % p] if g < last else 0.0
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + hop if dep is not None else 0.0
                dur = f[s] if kind == "F" else b[s]
                start = max(free[s], ready)
                free[s] = start + dur
                busy[s] += dur
                done[(kind, j, g)] = free[s]
                alive[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], alive[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, m={microbatches}, v={v})")
    return PipelineResult(schedule, p, microbatches, v, max(free), tuple(busy), tuple(peak))
