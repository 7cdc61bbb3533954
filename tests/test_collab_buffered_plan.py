"""The collaborative search chooses and prices buffered asynchronous rounds (issue 39) when the
constraints allow them: a Strategy records ``collaborative.buffer``, the simulator and the
collaborative backend read it."""

from __future__ import annotations

import json

import numpy as np
import pytest

# a device type of its own for the straggler: a tenth of an H100's rates and a slow kernel launch
SLOW = {"kind": "gpu", "vendor": "test", "peak": {"bf16": "2 TFLOP/s", "fp32": "1 TFLOP/s"}, "memory": "16 GB",
        "memory_bandwidth": "50 GB/s", "launch_overhead": "200 us"}


def _cluster(devices: list[str]) -> dict:
    return {"name": "w", "device_types": {"slow-gpu": SLOW}, "centers": [
        {"name": n, "nodes": [{"device": d, "devices_per_node": 1}],
         "wan": {"bandwidth": "100 Mb/s", "latency": "30 ms"}} for n, d in zip("xyz", devices, strict=True)]}


@pytest.fixture(scope="module")
def plans():
    """Three one-GPU torch centers, z on the slow device type: synchronous rounds (the default), the
    search allowed to buffer, and the same on three equal centers."""
    import polyparallel as pp
    from polyparallel.cluster import Cluster

    het = Cluster.from_dict(_cluster(["h100-sxm", "h100-sxm", "slow-gpu"]))
    same = Cluster.from_dict(_cluster(["h100-sxm"] * 3))
    search = lambda cl, **k: pp.search("mlp", cluster=cl, constraints={"mode": "collaborative", **k})  # noqa: E731
    return search(het), search(het, buffer=True), search(same, buffer=True), search(same, buffer=2)


def test_search_buffers_rounds_that_wait_for_a_straggler(plans):
    from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_buffered, stragglers

    sync, buffered, _, _ = plans
    assert sync.collaborative.buffer == 0 and '"buffer"' not in sync.to_json()  # the default: synchronous rounds
    x = inputs_from_strategy(buffered)
    cycle = x.cycle_s()  # one round alone: download, H steps, upload
    assert cycle[2] > 1.5 * np.median(cycle) and stragglers(x) == [2]
    c = buffered.collaborative
    assert c.buffer == 2 and c.local_steps == sync.collaborative.local_steps
    # the staleness bound admits every update of the straggler: none is refused, z's are 3 or 4 versions old
    unbounded = simulate_buffered(x, 8 * x.n, 2)
    assert c.max_staleness == max(4, *(t for f in unbounded.fused for _, t in f))
    # priced as the simulator's buffered rounds of the written plan, between fusions once every center has sent
    res = simulate_buffered(x, 8 * x.n, 2, c.max_staleness)
    assert res.refused == 0 and res.updates()["z"] >= 4
    assert c.round_time_s == pytest.approx(float(res.round_s[x.n:].mean()), rel=1e-9)
    assert c.round_time_s < sync.collaborative.round_time_s / 2  # the fast centers no longer wait for z
    # the samples that reach the model: every fused update carries its center's share of the batch
    shares = {p.name: p.share for p in c.centers}
    fused = sum(shares[name] for f in res.fused for name, _ in f) * buffered.global_batch * c.local_steps
    assert buffered.estimate.samples_per_s == pytest.approx(fused / res.published_s[-1], rel=1e-5)
    assert any("buffered rounds (buffer=2 of 3)" in n and "stragglers: z" in n for n in buffered.search.notes)


def test_equal_centers_keep_synchronous_rounds_unless_k_is_pinned(plans):
    from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_buffered

    _, _, same, pinned = plans
    assert same.collaborative.buffer == 0
    assert any("buffered rounds allowed, not chosen" in n for n in same.search.notes)
    assert pinned.collaborative.buffer == 2
    x = inputs_from_strategy(pinned)
    assert pinned.collaborative.round_time_s == pytest.approx(
        float(simulate_buffered(x, 8 * x.n, 2, pinned.collaborative.max_staleness).round_s[x.n:].mean()), rel=1e-9)


def test_a_buffered_strategy_runs_and_simulates_buffered(plans, tmp_path, capsys):
    from polyparallel.backends.collab import ModelSpec, config_from_strategy
    from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_buffered
    from polyparallel.strategy import Strategy
    from tests.test_collab_cli import _run

    _, buffered, _, _ = plans
    path = tmp_path / "s.json"
    buffered.to_json(path)
    back = Strategy.from_json(path)
    stale = buffered.collaborative.max_staleness
    assert (back.collaborative.buffer, back.collaborative.max_staleness) == (2, stale)
    cfg = config_from_strategy(back, ModelSpec("mlp", (8,), 2))
    assert (cfg.buffer, cfg.max_staleness) == (2, stale)
    code, out, err = _run(["simulate", str(path), "--rounds", "6", "--json"], capsys)
    assert code == 0, err
    want = simulate_buffered(inputs_from_strategy(back), 6, 2, stale).summary()
    assert json.loads(out) == json.loads(json.dumps(want))
    code, out, err = _run(["simulate", str(path), "--rounds", "3", "--buffer", "0"], capsys)
    assert code == 0 and "buffered" not in out  # --buffer 0: the synchronous rounds of the same plan


def test_bad_buffer_values_are_one_line():
    import polyparallel as pp
    from polyparallel.cluster import Cluster
    from polyparallel.planning import Constraints, DoesNotFit

    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="give True"):
            Constraints(buffer=bad)
    with pytest.raises(DoesNotFit, match=r"give K in \[1, 3\]"):
        pp.search("mlp", cluster=Cluster.from_dict(_cluster(["h100-sxm"] * 3)),
                  constraints={"mode": "collaborative", "buffer": 5})


def test_search_cli_takes_buffer_auto(tmp_path, capsys):
    from polyparallel.strategy import Strategy
    from tests.test_collab_cli import _run

    spec = tmp_path / "w.json"
    spec.write_text(json.dumps(_cluster(["h100-sxm", "h100-sxm", "slow-gpu"])))
    code, out, err = _run(["search", "mlp", "-c", str(spec), "--mode", "collaborative", "--buffer", "auto",
                           "-o", str(tmp_path / "s.json")], capsys)
    assert code == 0, err
    assert Strategy.from_json(tmp_path / "s.json").collaborative.buffer == 2 and "buffered rounds" in out
    for bad in ("two", "0"):
        code, out, err = _run(["search", "mlp", "-c", str(spec), "--buffer", bad], capsys)
        assert code == 2 and f"--buffer {bad}: give auto, off or a number" in err and len(err.strip().splitlines()) == 1


def test_collab_runs_a_strategys_buffer_unless_the_flag_says_otherwise(tmp_path, capsys):
    from polyparallel.backends.collab import CollabConfig
    from tests.test_collab_cli import _run, _two_center_strategy

    _two_center_strategy(tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    doc["collaborative"].update(buffer=1, max_staleness=2)
    (tmp_path / "s.json").write_text(json.dumps(doc))
    # --buffer 0: synchronous rounds, whose job file leaves max_staleness out (read back as the default, 4)
    for flag, want in (([], (1, 2)), (["--buffer", "0"], (0, 4)), (["--max-staleness", "7"], (1, 7))):
        job = tmp_path / "job.json"
        code, _, err = _run(["collab", "--strategy", str(tmp_path / "s.json"), "--in-shape", "4", "--classes", "2",
                             "--fusion", "fedavg", *flag, "--save-config", str(job)], capsys)
        assert code == 0, err
        cfg = CollabConfig.from_json(job.read_text())
        assert (cfg.buffer, cfg.max_staleness) == want
