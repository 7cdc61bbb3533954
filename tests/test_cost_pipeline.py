"""Pipeline schedules against their closed forms."""

from __future__ import annotations

import pytest

from polyparallel.cost_models.pipeline import PRICED, bubble_fraction, order_problem, schedule_order, simulate
from polyparallel.plan import PIPELINE_SCHEDULES, SCHEDULES


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 12])
def test_bubble_fraction_gpipe_1f1b(schedule, p, m):
    f, b = 1.0, 2.0
    r = simulate(schedule, [f] * p, [b] * p, microbatches=m)
    assert r.makespan == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 6, 3), (4, 8, 2), (4, 4, 4), (3, 9, 2)])
def test_bubble_fraction_interleaved(p, m, v):
    f, b = 1.0, 2.0
    r = simulate("interleaved", [f] * p, [b] * p, microbatches=m, chunks=v)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert r.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 3), (5, 2)])
def test_in_flight_microbatches(p, m):
    assert simulate("gpipe", [1.0] * p, [1.0] * p, m).in_flight == (m,) * p
    # 1F1B: stage s keeps min(p - s, m) micro-batches alive
    assert simulate("1f1b", [1.0] * p, [1.0] * p, m).in_flight == tuple(min(p - s, m) for s in range(p))


def test_interleaved_in_flight_matches_megatron():
    # stage 0 holds p*(v+1) - 1 chunks = p*(1 + (p-1)/(p*v)) micro-batches of its layers
    p, v, m = 4, 2, 8
    r = simulate("interleaved", [1.0] * p, [1.0] * p, m, v)
    assert r.in_flight[0] == p * (v + 1) - 1
    assert r.in_flight[0] / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_looped_bfs_against_its_closed_form(p, m, v):
    """Breadth-first: every stage runs chunk c's forwards for all micro-batches before chunk c + 1's,
    then the backwards in reverse. With ``m >= p`` a chunk's loop around the stages is back at
    stage 0 before that stage is done with the chunk, so the step is the interleaved schedule's
    ``(v·m + p − 1)(f + b)/v``; with fewer micro-batches each loop waits for the ring:
    ``(v·p + m − 1)(f + b)/v``. Every micro-batch of every chunk is alive before the first backward."""
    f, b = 1.0, 2.0
    r = simulate("looped_bfs", [f] * p, [b] * p, microbatches=m, chunks=v)
    assert r.makespan == pytest.approx((max(m, p) * v + min(m, p) - 1) * (f + b) / v)
    assert r.in_flight == (m * v,) * p
    if m % p == 0:  # where the interleaved schedule runs too, the same step time
        assert simulate("interleaved", [f] * p, [b] * p, microbatches=m, chunks=v).makespan == pytest.approx(r.makespan)


def test_every_schedule_of_the_plan_record_is_priced_and_executed():
    from polyparallel.backends.torch.capabilities import EXECUTED_SCHEDULES

    assert set(PRICED) == set(PIPELINE_SCHEDULES) == set(SCHEDULES)
    assert set(EXECUTED_SCHEDULES) == set(SCHEDULES)
    assert order_problem("interleaved", 2, 3, 2) and order_problem("looped_bfs", 2, 3, 2) is None


def test_unequal_stages_and_p2p():
    # GPipe with backward proportional to forward: (m-1) * max + sum over stages
    f, b, m = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], 6
    r = simulate("gpipe", f, b, m)
    assert r.makespan == pytest.approx((m - 1) * 6 + (3 + 6 + 3))
    r1 = simulate("1f1b", f, b, m)
    assert r1.makespan >= m * 6
    assert r1.busy == (m * 3.0, m * 6.0, m * 3.0)
    # each p2p hop delays the fill and the drain of GPipe once
    p, c = 4, 0.25
    base = simulate("gpipe", [1.0] * p, [2.0] * p, 8).makespan
    assert simulate("gpipe", [1.0] * p, [2.0] * p, 8, p2p=c).makespan == pytest.approx(base + 2 * (p - 1) * c)


def test_schedule_orders_are_complete_and_errors():
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("looped_bfs", 3)):
        orders = schedule_order(sched, 3, 6, v)
        for o in orders:
            assert sorted(o) == sorted({(k, j, c) for k in "FB" for j in range(6) for c in range(v)})
    with pytest.raises(ValueError, match="multiple of stages"):
        schedule_order("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_order("zigzag", 2, 2)


def _stage_times(rng, p):
    return [rng.uniform(0.1, 3.0) for _ in range(p)], [rng.uniform(0.1, 6.0) for _ in range(p)], \
        [rng.choice([0.0, rng.uniform(0.0, 0.5)]) for _ in range(p)]


def test_makespan_bound_is_a_lower_bound_tight_for_equal_stages():
    """The bound the search prunes with never exceeds the simulated makespan (unequal stages, hops,
    every schedule), and equals the closed form for equal stages."""
    import random

    from polyparallel.cost_models.pipeline import makespan_bound, peak_in_flight

    rng = random.Random(7)
    for _ in range(300):
        p = rng.randint(1, 6)
        schedule = rng.choice(SCHEDULES)
        v = rng.choice([2, 3]) if PIPELINE_SCHEDULES[schedule].chunked else 1
        m = rng.randint(1, 10)
        if order_problem(schedule, p, m, v):  # the interleaved schedule: a multiple of the stages
            m = p * rng.randint(1, 4)
        f, b, hop = _stage_times(rng, p)
        r = simulate(schedule, f, b, microbatches=m, chunks=v, p2p=hop)
        assert makespan_bound(f, b, m, v, hop) <= r.makespan * (1 + 1e-12)
        assert peak_in_flight(schedule, p, m, v) == r.in_flight  # memory needs no simulation
    for p, m, v in [(4, 8, 1), (3, 6, 2), (1, 5, 1)]:
        schedule = "interleaved" if v > 1 else "1f1b"
        assert makespan_bound([1.0] * p, [2.0] * p, m, v) == pytest.approx(
            simulate(schedule, [1.0] * p, [2.0] * p, microbatches=m, chunks=v).makespan, rel=1e-12)
