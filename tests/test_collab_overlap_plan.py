"""The collaborative search chooses and prices overlapped fusion (issue 39): a Strategy records
``collaborative.overlap``, the simulator and the collaborative backend read it."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(scope="module")
def plans():
    """Three one-GPU torch centers on 100 Mbit/s, 30 ms links: the free search (synchronous rounds meet
    20% at a large H), the search capped at a quarter of that H (they cannot), and the same capped
    search with overlapped fusion ruled out."""
    import polyparallel as pp
    from polyparallel.cluster import Cluster

    cl = Cluster.from_dict({"name": "w", "centers": [
        {"name": n, "nodes": [{"device": "v100-sxm2-32gb", "devices_per_node": 1}],
         "wan": {"bandwidth": "100 Mb/s", "latency": "30 ms"}} for n in ("x", "y", "z")]})
    free = pp.search("mlp", cluster=cl, constraints={"mode": "collaborative"})
    cap = free.collaborative.local_steps // 4
    capped = pp.search("mlp", cluster=cl, constraints={"mode": "collaborative", "max_local_steps": cap})
    sync = pp.search("mlp", cluster=cl, constraints={"mode": "collaborative", "max_local_steps": cap,
                                                     "overlap": False})
    return free, cap, capped, sync


def test_search_overlaps_rounds_where_synchronous_ones_cannot_meet_the_budget(plans):
    from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_rounds

    free, cap, capped, sync = plans
    assert free.collaborative.overlap == 0 and '"overlap"' not in free.to_json()  # synchronous: the file as before
    assert sync.collaborative.overlap == 0 and sync.collaborative.local_steps == cap
    assert sync.collaborative.comm_fraction > 0.2
    c = capped.collaborative
    assert c.local_steps == cap and 1 <= c.overlap <= cap  # the H label skew allows, the fewest steps ahead
    assert c.comm_fraction <= 0.2 + 1e-9 and any("overlapped fusion" in n for n in capped.search.notes)
    # priced as the simulator's steady overlapped round of the written plan (it reads overlap from it)
    x = inputs_from_strategy(capped)
    assert x.overlap == c.overlap
    res = simulate_rounds(x, 3)
    assert c.round_time_s == pytest.approx(float(res.round_s[-1]), rel=1e-9)
    exposed = 1 - res.dur["compute"][-1].max() / res.round_s[-1]
    assert c.comm_fraction == pytest.approx(float(exposed), rel=1e-9)
    # the fewest such steps ahead: one fewer exposes more than the budget
    fewer = simulate_rounds(dataclasses.replace(x, overlap=c.overlap - 1), 3)
    assert 1 - fewer.dur["compute"][-1].max() / fewer.round_s[-1] > 0.2


def test_a_strategy_with_overlap_runs_overlapped(plans, tmp_path):
    from polyparallel.backends.collab import ModelSpec, config_from_strategy
    from polyparallel.strategy import Strategy

    _, _, capped, _ = plans
    back = Strategy.from_json(capped.to_json())
    assert back.collaborative.overlap == capped.collaborative.overlap
    cfg = config_from_strategy(back, ModelSpec("mlp", (8,), 2))
    assert (cfg.overlap, cfg.local_steps) == (capped.collaborative.overlap, capped.collaborative.local_steps)
    assert config_from_strategy(back, ModelSpec("mlp", (8,), 2), overlap=0).overlap == 0


def test_collab_runs_a_strategys_overlap_unless_the_flag_says_otherwise(tmp_path, capsys):
    import json

    from polyparallel.backends.collab import CollabConfig
    from tests.test_collab_cli import _run, _two_center_strategy

    _two_center_strategy(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    doc["collaborative"]["overlap"] = 2
    (tmp_path / "s.json").write_text(json.dumps(doc))
    for flag, want in (([], 2), (["--overlap", "0"], 0)):
        job = tmp_path / f"job{want}.json"
        code, _, err = _run(["collab", "--strategy", str(tmp_path / "s.json"), "--in-shape", "4", "--classes", "2",
                             "--fusion", "fedavg", *flag, "--save-config", str(job)], capsys)
        assert code == 0, err
        assert CollabConfig.from_json(job.read_text()).overlap == want


def test_search_says_why_it_does_not_overlap_for_a_mindspore_center(plans):
    """The capped search with one MindSpore center: rounds over the budget, overlap not chosen, and a
    note naming the center that rules it out (overlapped fusion runs single-process torch centers)."""
    import polyparallel as pp
    from polyparallel.cluster import Cluster

    _, cap, _, sync = plans
    cl = Cluster.from_dict({"name": "w", "centers": [
        {"name": n, "framework": fw, "nodes": [{"device": "v100-sxm2-32gb", "devices_per_node": 1}],
         "wan": {"bandwidth": "100 Mb/s", "latency": "30 ms"}} for n, fw in (("x", "torch"), ("y", "mindspore"),
                                                                             ("z", "torch"))]})
    s = pp.search("mlp", cluster=cl, constraints={"mode": "collaborative", "max_local_steps": cap})
    assert s.collaborative.overlap == 0 and s.collaborative.comm_fraction > 0.2
    assert any("overlapped fusion would hide" in n and "centers y are not" in n for n in s.search.notes), \
        s.search.notes
    assert not any("overlapped fusion would hide" in n for n in sync.search.notes)  # overlap=False: no note
