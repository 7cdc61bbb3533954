"""Task groups and multi-model fusion (``polyparallel tasks``): the task file's schema errors, the plan
(groups, each center's plan, the simulator's time, recomputed here from the cluster), and end-to-end runs
on scikit-learn's digits with a residual CNN and an MLP whose saved models are evaluated again here
(onnxruntime, torch.export) and whose ensemble and parameter average are recomputed from the members."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from polyparallel.backends.collab._tasks import TaskFileError, load_tasks, tasks_from_dict
from tests.tasks_models import digits, write_digits_tasks

GOOD = {
    "algorithms": {"cnn": {"model": "tests.tasks_models:resnet"}, "mlp": {"model": "tests.tasks_models:mlp"}},
    "datasets": {"a": {"path": "a.npz", "center": "beijing"}, "b": {"path": "b.npz", "center": "shanghai"}},
    "eval": "eval.npz",
}


def _with(**kw: object) -> dict:
    d = json.loads(json.dumps(GOOD))
    for k, v in kw.items():
        node, *path = k.split("__")
        target = d
        for p in [node, *path][:-1]:
            target = target.setdefault(p, {})
        target[[node, *path][-1]] = v
    return d


BAD = [  # (task file, the key the one-line error must name, a word of the fix)
    ({k: v for k, v in GOOD.items() if k != "eval"}, "eval:", "add it"),
    (_with(fusionn="auto"), "fusionn:", "unknown key"),
    (_with(fusion="mean"), "fusion:", "auto, average, ensemble, distill"),
    (_with(algorithms__cnn__model="resnet"), "algorithms.cnn.model:", "package.module:function"),
    (_with(algorithms__cnn__framework="mindspore"), "algorithms.cnn.framework:", "framework: torch"),
    (_with(algorithms__cnn__loss="hinge"), "algorithms.cnn.loss:", "cross_entropy"),
    (_with(datasets__a__path="a.csv"), "datasets.a.path:", "FILE.npz"),
    (_with(training__lr=-1), "training.lr:", "greater than 0"),
    (_with(groups={"g": {"algorithm": "cnn", "datasets": ["a", "zz"]}}), "groups.g.datasets:", "some of a, b"),
    (_with(groups={"g": {"algorithm": "svm", "datasets": ["a"]}}), "groups.g.algorithm:", "one of cnn, mlp"),
    (_with(fusion="average"), "fusion:", "auto, ensemble or distill"),
    (_with(cluster="aisynergy-5", datasets__b__center="paris"), "datasets.b.center:", "beijing"),
    (_with(target="svm"), "target:", "one of cnn, mlp"),
    (_with(algorithms=[1, 2]), "algorithms:", "mapping"),
]


@pytest.mark.parametrize("raw,key,fix", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_schema_errors_are_one_line_naming_the_key(raw: dict, key: str, fix: str) -> None:
    with pytest.raises(TaskFileError) as e:
        tasks_from_dict(raw, ".", "tasks.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"tasks.yaml: {key}"), msg
    assert fix in msg, msg


def test_cli_schema_error_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from polyparallel.cli import main

    bad = tmp_path / "tasks.yaml"
    bad.write_text(yaml.safe_dump(_with(training__rounds=0)))
    with pytest.raises(SystemExit) as e:
        main(["tasks", "plan", str(bad)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "training.rounds:" in err, err
    bad.write_text("algorithms: [\n")
    with pytest.raises(SystemExit) as e:
        main(["tasks", "plan", str(bad)])
    assert e.value.code == 2 and "not valid YAML" in capsys.readouterr().err


def test_groups_default_to_every_algorithm_on_every_dataset(tmp_path: Path) -> None:
    ts = tasks_from_dict(GOOD, tmp_path)
    assert [(g.name, g.datasets, g.centers) for g in ts.groups] == [
        ("cnn", ("a", "b"), ("beijing", "shanghai")), ("mlp", ("a", "b"), ("beijing", "shanghai"))]
    assert ts.path("a.npz") == str(tmp_path / "a.npz")


def test_plan_without_cluster_lists_groups_and_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from polyparallel.cli import main

    path = write_digits_tasks(tmp_path, centers=4)
    with pytest.raises(SystemExit) as e:
        main(["tasks", "plan", str(path), "--json"])
    assert e.value.code in (0, None)
    plans = json.loads(capsys.readouterr().out)
    assert [(p["group"], p["datasets"]) for p in plans] == [("cnn", ["d0", "d1"]), ("dense", ["d2", "d3"])]
    for p in plans:  # 250 rows per center, 10% held out at the center
        assert set(p["rows"].values()) == {225} and p["predicted_s"] is None


@pytest.mark.slow
def test_plan_with_cluster_prices_each_center_and_simulates_the_group(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Each center's plan uses its devices; the group's time is the simulator's for those step times and the
    centers' WAN links as the cluster spec declares them (recomputed here)."""
    from polyparallel.cli import main
    from polyparallel.cluster import Cluster
    from polyparallel.cost_models.collab_simulator import SimInputs, simulate_rounds

    names = ["beijing", "shanghai", "chengdu"]
    path = write_digits_tasks(tmp_path, centers=3, names=names, cluster="aisynergy-5", groups={
        "cnn": {"algorithm": "resnet", "datasets": ["d0", "d1"]},
        "dense": {"algorithm": "mlp", "datasets": ["d2"], "rounds": 4}})
    with pytest.raises(SystemExit):
        main(["tasks", "plan", str(path), "--json"])
    plans = json.loads(capsys.readouterr().out)
    cl = Cluster.preset("aisynergy-5")
    ts = load_tasks(path)
    for p, g in zip(plans, ts.groups):
        assert [c["center"] for c in p["centers"]] == list(g.centers)
        centers = [next(c for c in cl.centers if c.name == pc["center"]) for pc in p["centers"]]
        for pc, c in zip(p["centers"], centers):
            assert 1 <= pc["devices"] <= len(cl.devices_of(c.index))
            assert pc["dp"] * pc["tp"] == pc["devices"] and pc["step_time_s"] > 0
        from polyparallel.backends.collab._models import build_torch_model

        params = sum(t.numel() for t in build_torch_model(g.model).parameters())
        sim = simulate_rounds(SimInputs.make(
            [c.name for c in centers], [pc["step_time_s"] for pc in p["centers"]], g.local_steps, params,
            down_Bps=[c.wan.down_bandwidth for c in centers], up_Bps=[c.wan.up_bandwidth for c in centers],
            latency_s=[c.wan.latency for c in centers]), g.rounds)
        assert p["predicted_s"] == pytest.approx(sim.total_s, rel=1e-9)
    assert plans[1]["rounds"] == 4 and len(plans[1]["centers"]) == 1


def test_em_weights_maximise_the_held_out_likelihood() -> None:
    """Against a grid search of the two-member mixture's log-likelihood, computed here with numpy."""
    import torch

    from polyparallel.backends.collab._tasks_fusion import em_weights

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    with torch.no_grad():
        a.weight[:, 0] = torch.tensor([-2.0, 0.0, 2.0])
    held = {"c0": (x[:100], y[:100]), "c1": (x[100:], y[100:])}
    w = em_weights([a, b], held, iters=2000)

    def probs(m: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            p = torch.softmax(m(torch.from_numpy(x)), -1).double().numpy()
        return p[np.arange(len(y)), y]

    pa, pb = probs(a), probs(b)
    grid = np.linspace(0, 1, 10001)
    ll = [np.log(g * pa + (1 - g) * pb).sum() for g in grid]
    assert w.sum() == pytest.approx(1.0) and w[0] == pytest.approx(grid[int(np.argmax(ll))], abs=2e-3)


def _members(run: Path, res: dict) -> dict[str, np.ndarray]:
    """Each member's eval-set probabilities, rebuilt here from members/NAME.npz and its model reference."""
    import torch

    from polyparallel.references import resolve

    out = {}
    x = np.load(run.parent / "eval.npz")["x"]
    for name, m in res["members"].items():
        torch.manual_seed(0)
        model = resolve(m["model"], "model")()
        sd = {k: torch.from_numpy(v) for k, v in np.load(run / "members" / f"{name}.npz").items()}
        model.load_state_dict(sd, strict=False)
        model.eval()
        with torch.no_grad():
            out[name] = torch.softmax(model(torch.from_numpy(x)), -1).double().numpy()
    return out


def _run(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    from polyparallel.cli import main

    with pytest.raises(SystemExit) as e:
        main(["tasks", "run", str(path), "--out", str(out)])
    text = capsys.readouterr()
    assert e.value.code in (0, None), text.err[-2000:]
    return json.loads((out / "result.json").read_text()), text.out


@pytest.mark.slow
def test_run_two_architectures_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A residual CNN on two centers, an MLP on two others; distilled on the public set (or ensembled):
    the saved fused model evaluated again with onnxruntime and torch.export, the ensemble recomputed from
    the members, and `tasks infer` on the evaluation rows."""
    import onnxruntime as ort
    import torch

    from polyparallel.cli import main

    path = write_digits_tasks(tmp_path / "t", centers=4, fusion="auto")
    run = tmp_path / "t" / "run"
    res, out = _run(path, run, capsys)
    for g, r in (("cnn", 3), ("dense", 3)):
        assert f"{g}: round {r}/3" in out
    ev = np.load(tmp_path / "t" / "eval.npz")
    x, y = ev["x"], ev["y"]
    probs = _members(run, res)
    for name, p in probs.items():
        assert res["members"][name]["accuracy"] == pytest.approx(float((p.argmax(1) == y).mean()))
    w = res["ensemble"]["weights"]
    ens = sum(w[n] * p for n, p in probs.items())
    assert res["ensemble"]["accuracy"] == pytest.approx(float((ens.argmax(1) == y).mean()))
    uni = sum(probs.values())
    assert res["ensemble"]["uniform_accuracy"] == pytest.approx(float((uni.argmax(1) == y).mean()))
    assert sum(w.values()) == pytest.approx(1.0)
    assert res["average"] == {}  # the architectures differ
    fused = res["fused"]
    assert fused["method"] in ("distill", "ensemble") and set(fused["candidates"]) == {"ensemble", "distill"}
    sess = ort.InferenceSession(str(run / "fused.onnx"), providers=["CPUExecutionProvider"])
    onnx_acc = float((sess.run(None, {sess.get_inputs()[0].name: x})[0].argmax(1) == y).mean())
    prog = torch.export.load(str(run / "fused.pt2")).module()
    with torch.no_grad():
        pt2_acc = float((prog(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert fused["accuracy"] == pytest.approx(onnx_acc) == pytest.approx(pt2_acc)
    best = max(m["accuracy"] for m in res["members"].values())
    assert fused["accuracy"] > 0.7 and best > 0.7
    with pytest.raises(SystemExit):
        main(["tasks", "infer", str(run), str(tmp_path / "t" / "eval.npz"), "--runtime", "onnx"])
    assert f"accuracy {onnx_acc:.4f}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["tasks", "infer", str(run), str(tmp_path / "t" / "eval.npz"), "--use", "ensemble"])
    assert f"accuracy {res['ensemble']['accuracy']:.4f}" in capsys.readouterr().out
    # the weighted ensemble as one exported module (what fusion: ensemble writes), under onnxruntime
    from polyparallel.backends.collab._models import ModelSpec
    from polyparallel.backends.collab._tasks_fusion import ensemble_module, export, member_module

    mods = [member_module(ModelSpec(m["model"]), dict(np.load(run / "members" / f"{n}.npz")))
            for n, m in res["members"].items()]
    (tmp_path / "ens").mkdir()
    check = export(ensemble_module(mods, [w[n] for n in res["members"]]), x, tmp_path / "ens", "fused")
    sess = ort.InferenceSession(str(tmp_path / "ens" / "fused.onnx"), providers=["CPUExecutionProvider"])
    logp = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(np.exp(logp), ens, atol=1e-5)
    assert check["argmax_agreement"] == 1.0


@pytest.mark.slow
def test_same_architecture_averages_with_the_backend_fusion(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Two groups of the MLP: fusion average is the row-weighted mean of the members' parameters (numpy)."""
    import onnxruntime as ort

    path = write_digits_tasks(tmp_path / "t", centers=4, fusion="average", groups={
        "g1": {"algorithm": "mlp", "datasets": ["d0", "d1", "d2"]}, "g2": {"algorithm": "mlp", "datasets": ["d3"]}})
    run = tmp_path / "t" / "run"
    res, _ = _run(path, run, capsys)
    assert res["fused"]["method"] == "average" and list(res["average"]) == ["tests.tasks_models:mlp"]
    n1, n2 = res["members"]["g1"]["samples"], res["members"]["g2"]["samples"]
    assert (n1, n2) == (675, 225)
    p1, p2 = (dict(np.load(run / "members" / f"{g}.npz")) for g in ("g1", "g2"))
    mean = {k: (n1 * p1[k].astype(np.float64) + n2 * p2[k]) / (n1 + n2) for k in p1}
    ev = np.load(tmp_path / "t" / "eval.npz")
    h = np.maximum(ev["x"].reshape(len(ev["x"]), -1) @ mean["1.weight"].T + mean["1.bias"], 0)
    acc = float(((h @ mean["3.weight"].T + mean["3.bias"]).argmax(1) == ev["y"]).mean())
    assert res["fused"]["accuracy"] == pytest.approx(acc) == pytest.approx(res["average"]["tests.tasks_models:mlp"]
                                                                             ["accuracy"])
    sess = ort.InferenceSession(str(run / "fused.onnx"), providers=["CPUExecutionProvider"])
    assert float((sess.run(None, {sess.get_inputs()[0].name: ev["x"]})[0].argmax(1) == ev["y"]).mean()) == \
        pytest.approx(acc)


@pytest.mark.slow
def test_distill_without_public_set_uses_synthetic_inputs(tmp_path: Path) -> None:
    """No public rows: the student learns from inputs synthesised from the members (Python API)."""
    from polyparallel.backends.collab._tasks import load_datasets, load_npz, run_groups
    from polyparallel.backends.collab._tasks_fusion import fuse_members

    path = write_digits_tasks(tmp_path, centers=4, fusion="distill", public=None,
                              distill={"steps": 150, "check_every": 50, "synthetic": 256, "synthesis_steps": 20})
    ts = load_tasks(path)
    data = load_datasets(ts)
    ev = load_npz(str(tmp_path / "eval.npz"), "eval")
    members = run_groups(ts, data, ev)
    lines: list[str] = []
    outcome = fuse_members(ts, members, data.train, data.held, None, say=lines.append)
    d = outcome.candidates["distill"]
    assert outcome.chosen is d and d.info["transfer"] == "synthetic" and d.info["transfer_rows"] == 256
    assert any("synthetic inputs" in s for s in lines)
    # the student is the best member's architecture, started from that member: never below it on held-out rows
    assert d.val_accuracy >= max(outcome.member_val.values()) - 1e-12
    x, _ = digits()
    assert d.module(__import__("torch").from_numpy(x[:5])).shape == (5, 10)


@pytest.mark.slow
def test_groups_over_flower_train_what_the_inprocess_engine_trains(tmp_path: Path) -> None:
    """Each group over a SuperLink and one SuperNode per center (loopback, FLWR_HOME in the group's folder)
    gives the in-process members bit for bit, and no process outlives it."""
    from polyparallel.backends.collab._flower import LoopbackFederation
    from polyparallel.backends.collab._tasks import load_datasets, load_npz, run_groups

    path = write_digits_tasks(tmp_path, centers=4, training={"rounds": 2, "local_steps": 4, "batch_size": 16})
    ts = load_tasks(path)
    data = load_datasets(ts)
    ev = load_npz(str(tmp_path / "eval.npz"), "eval")
    here = run_groups(ts, data, ev)
    seen: list[str] = []
    there = run_groups(ts, data, ev, engine="flower", workdir=tmp_path / "flower", timeout_s=240,
                       on_round=lambda g, r: seen.append(f"{g.name}:{r.round}"))
    assert seen == ["cnn:1", "cnn:2", "dense:1", "dense:2"]
    for a, b in zip(here, there):
        assert a.name == b.name and a.samples == b.samples
        for k in a.params:
            np.testing.assert_array_equal(a.params[k], b.params[k])
        assert not LoopbackFederation(tmp_path / "flower" / a.name, {}).stray_pids()


def test_datasets_from_a_source_hold_out_the_same_rows_in_every_group(tmp_path: Path) -> None:
    """A MODULE:FUNCTION dataset is called with its center's name; its held-out rows are the same seeded
    share whichever groups train on it, and never in a group's training rows."""
    from polyparallel.backends.collab._tasks import load_datasets
    from tests.tasks_models import center_digits

    raw = {"algorithms": {"m": {"model": "tests.tasks_models:mlp"}, "r": {"model": "tests.tasks_models:resnet"}},
           "datasets": {"a": {"path": "tests.tasks_models:center_digits", "center": "c0"},
                        "b": {"path": "tests.tasks_models:center_digits", "center": "c3"}},
           "groups": {"g1": {"algorithm": "m", "datasets": ["a", "b"]}, "g2": {"algorithm": "r", "datasets": ["b"]}},
           "eval": "eval.npz", "holdout": 0.2}
    ts = tasks_from_dict(raw, tmp_path)
    data = load_datasets(ts)
    for name, center in (("a", "c0"), ("b", "c3")):
        x, y = center_digits(center)
        tr, ho = data.train[name], data.held[name]
        assert len(ho[1]) == round(0.2 * len(y)) and len(tr[1]) + len(ho[1]) == len(y)
        rows = {r.tobytes() for r in x}
        assert {r.tobytes() for r in tr[0]} | {r.tobytes() for r in ho[0]} == rows
    g1, g2 = (data.center_train(ts, g) for g in ts.groups)
    np.testing.assert_array_equal(g1["c3"][0], g2["c3"][0])
    held_b = {r.tobytes() for r in data.held["b"][0]}
    assert not held_b & {r.tobytes() for r in g1["c3"][0]}
