"""Search ⇒ train on models nobody here wrote (tests/zoo.py): every plan the search writes is a plan
the torch backend accepts, and trains with the losses single-process training gives.

The search runs on the user's module (real weights) and its strategy is handed to ``train`` with
the model as ``tests.zoo:FUNCTION``, as a user does; the reference is the same model trained in one
process on the whole global batch. ``benchmarks/zoo.py`` runs the same check for every model on
both clusters and prints the table.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import plan_for
from polyparallel.backends.torch._tensor_parallel import strategy_graph
from tests.zoo import BATCH, ZOO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytestmark = pytest.mark.slow


@functools.cache
def _search(name: str, n: int) -> pp.Strategy:
    model_fn, data_fn = ZOO[name]
    x, y = data_fn(0)
    torch.manual_seed(0)
    return pp.search(model_fn(), (x,), f"local-cpu:{n}", example_kwargs={"labels": y}, batch_size=BATCH)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_searched_plan_passes_the_executors_check(name: str, n: int) -> None:
    """The backend's own pre-launch check (fingerprint against a fresh capture, plan_for with the
    pipeline cut on torch.export's graph) accepts the searched strategy."""
    s = _search(name, n)
    model_fn, data_fn = ZOO[name]
    batch = data_fn(0)
    graph = strategy_graph(s, model_fn, batch, True)  # raises FingerprintMismatch for "another model"
    plan = plan_for(s, model_fn(), batch if s.pp > 1 else None, graph=graph)
    assert plan.dp * plan.tp * plan.pp * plan.sp == len(s.mesh.devices) <= n
    # fewer devices only where the plan on all of them splits no op, and then said
    assert len(s.mesh.devices) == n or any(x.startswith(f"uses {len(s.mesh.devices)} of the cluster's {n}")
                                           for x in s.search.notes)


def test_the_search_says_why_it_left_plans_out() -> None:
    """A UNet with BatchNorm and no attention: no pipeline (micro-batches would see their own
    statistics) and no Ulysses split (no attention); the strategy's notes say so."""
    s = _search("unet", 4)
    assert s.pp == 1 and s.sp == 1 and s.microbatches == 1
    notes = " ".join(s.search.notes)
    assert "batch statistics" in notes and "Ulysses" in notes


# the trained subset: every model on 2 processes, and on 4 the BatchNorm model (statistics over 4
# replicas); the other 4-process plans (dp2 x pp2, dp4) are the 2-process families doubled, trained by
# benchmarks/zoo.py and by the pipeline and data-parallel tests (CI time)
TRAINED = [(name, 2) for name in ZOO] + [("unet", 4)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("name", "n"), TRAINED)
def test_searched_plan_trains_like_one_process(name: str, n: int, tmp_path: Path) -> None:
    from zoo import run_one  # benchmarks/zoo.py

    rec = run_one(name, n, run_dir=tmp_path)
    print(rec.get("plan"), rec["status"], rec.get("max_rel"), rec.get("error", ""))
    assert rec["status"] == "exact", rec.get("error") or rec


def test_pinned_tensor_parallelism_on_a_cnn_splits_only_what_the_backend_runs() -> None:
    """tp=2 pinned on the UNet: the rule would split convolutions over tp, which the backend does
    not execute; with placements="torch" no conv is split and the backend's check accepts the plan."""
    model_fn, data_fn = ZOO["unet"]
    x, y = data_fn(0)
    s = pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"tp": 2})
    graph = strategy_graph(s, model_fn, (x, y), True)
    kinds = {op.name: str(op.kind) for op in graph.ops}
    split_convs = [op for p in s.placements if ":tp" in p.placement for op in p.ops if kinds.get(op) == "conv"]
    assert not split_convs
    assert {st.placed_by for st in s.stages} <= {"solver", "rule", "replicated"}
    plan_for(s, model_fn(), graph=graph)
    rule = pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                     constraints={"tp": 2, "placements": "rule"})
    assert any(kinds.get(op) == "conv" for p in rule.placements if ":tp" in p.placement for op in p.ops)


def test_pinned_plan_the_backend_cannot_run_is_written_for_planning_only() -> None:
    """sp=4, tp=2 and pp=2 pinned together on a model of 4 heads (Ulysses inside the stages would split
    them over tp·sp = 8 ranks): the search still prices the plan, says first that it is for planning
    only, and train's pre-launch check refuses it with the same reason."""
    from polyparallel.backends.torch import Unsupported
    from polyparallel.backends.torch import _examples as ex

    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:16", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"sp": 4, "pp": 2, "tp": 2})
    assert (s.sp, s.pp, s.tp) == (4, 2, 2)
    assert s.search.notes[0].startswith("no plan the torch backend executes exactly fits")
    assert "4 heads do not split over 8 ranks" in s.search.notes[0]
    with pytest.raises(Unsupported, match=r"sp=4 inside pipeline stages \(Ulysses\) is not exact for this model"):
        plan_for(s, ex.tiny_gpt(), (x, y))


def test_chosen_rule_placements_the_backend_refuses_are_written_for_planning_only() -> None:
    """Megatron's rule chosen by the user (placements="rule") on HF T5, whose attention adds a bias per
    head looked up in a table of relative positions, which the heads split cannot trace to the
    projections: the plan is kept as asked, its notes say first that the torch backend refuses it
    and why, and train's pre-launch check refuses it with the same reason."""
    from polyparallel.backends.torch import Unsupported
    from polyparallel.backends.torch._tensor_parallel import capture_for_strategy

    model_fn, data_fn = ZOO["t5"]
    x, y = data_fn(0)
    s = pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"tp": 2, "pp": 1, "placements": "rule"})
    assert s.tp == 2 and s.search.notes[0].startswith("planning only: the torch backend refuses this plan")
    with pytest.raises(Unsupported) as e:  # what train's pre-launch check finds, on the model's captured graph
        plan_for(s, model_fn(), (x, y), graph=capture_for_strategy(model_fn, (x, y)))
    assert str(e.value) in s.search.notes[0] and "comes from op 'embedding" in str(e.value)
