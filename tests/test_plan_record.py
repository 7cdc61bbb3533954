"""The one plan record (:mod:`polyparallel.plan`) and the records derived from it.

The cost model's config and the backend's worker plan extend it, a Strategy serialises it and reads
it back, a center's plan is a subset of its fields, and the search's constraints check a pinned value
as the record does: each checked here against the other records, and the rank order by brute force.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import polyparallel as pp
from polyparallel.backends.collab._center_plan import PLAN_KEYS, normalize_plan
from polyparallel.backends.torch import ExecPlan
from polyparallel.cost_models import ParallelConfig
from polyparallel.plan import CENTER_FIELDS, MESH_AXES, PLAN_FIELDS, Axis, Plan, parse_schedule, value_problem
from polyparallel.planning import Constraints
from polyparallel.strategy import Strategy


def test_the_records_of_a_plan_are_the_plan_record() -> None:
    assert issubclass(ParallelConfig, Plan) and issubclass(ExecPlan, Plan)
    for record in (ParallelConfig, ExecPlan):  # the plan's fields are declared once, in Plan
        own = {f.name for f in dataclasses.fields(record)} - {f.name for f in dataclasses.fields(Plan)}
        assert not own & set(PLAN_FIELDS)
    assert set(PLAN_FIELDS) <= {f.name for f in dataclasses.fields(Constraints)}  # each can be pinned
    assert {a.value for a in Axis} <= set(PLAN_FIELDS) and set(MESH_AXES) <= set(Axis)
    strategy_fields = set(Strategy.model_fields)
    assert set(Plan().record_fields()) <= strategy_fields
    assert PLAN_KEYS[:len(CENTER_FIELDS)] == CENTER_FIELDS and set(CENTER_FIELDS) <= set(PLAN_FIELDS)


def test_rank_order_is_a_bijection_with_tensor_parallelism_innermost() -> None:
    for dp, tp, pp_, sp, cp in itertools.product((1, 2, 3), (1, 2), (1, 2, 3), (1, 2), (1, 3)):
        if sp > 1 and cp > 1:  # one of Ulysses and ring attention splits the sequence
            assert Plan(sp=sp, cp=cp).problems()
            continue
        plan = Plan(dp=dp, tp=tp, pp=pp_, sp=sp, cp=cp)
        coords = list(itertools.product(range(pp_), range(dp), range(sp * cp), range(tp)))
        ranks = [plan.rank(*c) for c in coords]
        assert sorted(ranks) == list(range(plan.world)) == list(range(dp * tp * pp_ * sp * cp))
        assert ranks == list(range(plan.world))  # row-major in MESH_AXES order: tp consecutive
        assert [plan.degree(a) for a in MESH_AXES] == [pp_, dp, cp, sp, tp]


def test_a_searched_strategy_reads_back_the_plan_it_was_written_from() -> None:
    s = pp.search("gpt-tiny", cluster="local-cpu:4", batch_size=8,
                  constraints={"pp": 2, "chunks": 2, "microbatches": 4})
    plan = s.plan
    assert (plan.schedule, plan.chunks, plan.pp, plan.microbatches) == ("interleaved", 2, 2, 4)
    assert plan.record_fields() == {k: getattr(s, k) for k in plan.record_fields()}
    assert Strategy.from_json(s.to_json()).plan == plan


@pytest.mark.parametrize(("label", "parsed"), [("1f1b", ("1f1b", 1)), ("interleaved:4", ("interleaved", 4)),
                                               ("gpipe", ("gpipe", 1))])
def test_schedule_labels(label: str, parsed: tuple[str, int]) -> None:
    assert parse_schedule(label) == parsed
    assert Plan(schedule=parsed[0], chunks=parsed[1]).schedule_label == label


def test_one_check_of_a_value_for_every_record() -> None:
    bad = {"dp": 0, "tp": True, "microbatches": 2.5, "zero_stage": 4, "schedule": "zigzag", "recompute": "half",
           "dtype": "int4", "chunks": -1}
    for name, value in bad.items():
        why = value_problem(name, value)
        assert why and why.startswith(f"{name}={value!r}")
        assert why in Plan().replace(**{name: value}).problems()[0]
        with pytest.raises(ValueError, match="ParallelConfig." + name):
            ParallelConfig(**{name: value}).validate()
        with pytest.raises(ValueError, match=f"bad constraint: {name}="):
            Constraints(**{name: value})
    assert value_problem("schedule", "interleaved:3") is None
    assert Plan(dp=3, ep=2).problems() and not Plan(dp=2, sp=2, ep=4).problems()
    assert "interleaved" in Plan(chunks=2).problems()[0]
    assert "tp > 1" in Plan(sequence_parallel=True).problems()[0]


def test_a_center_plan_is_the_record_s_center_fields() -> None:
    plan = normalize_plan({"tp": 2}, 4, "a")
    assert set(plan) == set(PLAN_KEYS)
    assert Plan.from_record(plan) == Plan(dp=2, tp=2, zero_stage=3)


def test_megatron_sequence_parallelism_is_recorded_and_refused_with_its_reason() -> None:
    """A plan knob the record gained: the strategy keeps it (an older file without it loads as off), and
    the torch backend, which does not split norms along the sequence, refuses it by name."""
    from polyparallel.backends.torch import Unsupported, plan_for
    from polyparallel.models import example_module

    s = pp.search("gpt-tiny", cluster="local-cpu:4", batch_size=8, constraints={"tp": 2, "sequence_parallel": True})
    assert s.sequence_parallel and s.plan.sequence_parallel and s.tp == 2
    assert "planning only" in s.search.notes[0] and "sequence_parallel" in s.search.notes[0]
    assert Strategy.from_json(s.to_json()).sequence_parallel
    older = s.to_dict()
    del older["sequence_parallel"]
    assert not Strategy.from_dict(older).sequence_parallel
    model = example_module("gpt-tiny")
    with pytest.raises(Unsupported, match="sequence_parallel"):
        plan_for(s, model)
    off = pp.evaluate("gpt-tiny", cluster="local-cpu:4", batch_size=8, tp=2)
    assert not off.sequence_parallel
