"""`polyparallel collab`: a whole federation from explicit arguments; job files; one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess
from polyparallel.cli import main


def _run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_collab_command_runs_and_writes_what_the_api_computes(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for c in ("x1", "x2"):
        arrays[c] = (rng.normal(size=(40, 5)).astype(np.float32), rng.integers(0, 3, 40))
        np.savez(data / f"{c}.npz", x=arrays[c][0], y=arrays[c][1])
    argv = ["collab", "--centers", "x1,x2", "--in-shape", "5", "--classes", "3", "--hidden", "6", "--rounds", "2",
            "--local-steps", "3", "--fusion", "trimmed_mean", "--fusion-opt", "beta=0.0", "--compression", "fp16",
            "--data", str(data), "--out", str(tmp_path / "out")]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert "rounds" in out and "x1,x2" in out
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert [r["accepted"] for r in res["rounds"]] == [["x1", "x2"], ["x1", "x2"]]
    cfg = CollabConfig(centers=(CenterSpec("x1"), CenterSpec("x2")), model=ModelSpec("mlp", (5,), 3, hidden=6),
                       rounds=2, local_steps=3, fusion="trimmed_mean", fusion_options={"beta": 0.0},
                       compression="fp16")
    ref = run_inprocess(cfg, arrays)
    with np.load(tmp_path / "out" / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    assert (tmp_path / "out" / "timing.jsonl").read_text().count("fusion_end") == 2


def test_a_root_set_makes_fltrust_the_fusion_and_the_audit_reaches_result_json(tmp_path, capsys):
    rng = np.random.default_rng(1)
    arrays = {c: (rng.normal(size=(40, 5)).astype(np.float32), rng.integers(0, 3, 40)) for c in ("x1", "x2", "r")}
    for c, (x, y) in arrays.items():
        np.savez(tmp_path / f"{c}.npz", x=x, y=y)
    argv = ["collab", "--centers", "x1,x2", "--in-shape", "5", "--classes", "3", "--hidden", "6", "--rounds", "2",
            "--local-steps", "3", "--data", str(tmp_path), "--root-data", str(tmp_path / "r.npz"),
            "--out", str(tmp_path / "out")]
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    cfg = CollabConfig(centers=(CenterSpec("x1"), CenterSpec("x2")), model=ModelSpec("mlp", (5,), 3, hidden=6),
                       rounds=2, local_steps=3, fusion="fltrust")
    ref = run_inprocess(cfg, {c: arrays[c] for c in ("x1", "x2")}, root_data=arrays["r"])
    with np.load(tmp_path / "out" / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    for got, want in zip(res["rounds"], ref.rounds):
        for c in ("x1", "x2"):
            assert {k: got["metrics"][c][k] for k in ("trust", "cos_root", "cos_fused", "update_norm")} == {
                k: want.metrics[c][k] for k in ("trust", "cos_root", "cos_fused", "update_norm")}
    assert res["flagged"] == ref.flagged()


def test_job_file_round_trip(tmp_path, capsys):
    job = tmp_path / "job.json"
    code, out, _ = _run(["collab", "--centers", "p,q", "--frameworks", "torch,mindspore", "--model", "cnn",
                         "--in-shape", "1,8,8", "--fusion", "fedprox", "--fusion-opt", "mu=0.1", "--momentum", "0.9",
                         "--lr-schedule", "cosine", "--logit-adjust", "1", "--save-config", str(job)], capsys)
    assert code == 0 and "wrote" in out
    cfg = CollabConfig.from_json(job.read_text())
    assert cfg.centers[1] == CenterSpec("q", framework="mindspore") and cfg.make_fusion().proximal_mu == 0.1
    assert (cfg.momentum, cfg.lr_schedule, cfg.logit_adjust) == (0.9, "cosine", 1.0)


def test_devices_per_center_reach_the_job(tmp_path, capsys):
    job = tmp_path / "job.json"
    code, _, err = _run(["collab", "--centers", "p,q", "--devices", "2,1", "--save-config", str(job)], capsys)
    assert code == 0, err
    assert [c.devices for c in CollabConfig.from_json(job.read_text()).centers] == [2, 1]
    code, _, err = _run(["collab", "--centers", "p,q", "--devices", "2"], capsys)
    assert code == 2 and "--devices has 1 entries for 2 centers" in err


@pytest.mark.parametrize("argv,msg", [
    (["collab", "--fusion", "fedfoo"], "unknown fusion strategy 'fedfoo'"),
    (["collab", "--in-shape", "1,x"], "--in-shape '1,x'"),
    (["collab", "--centers", "a,b", "--frameworks", "torch"], "--frameworks has 1 entries for 2 centers"),
    (["collab", "--fusion-opt", "mu"], "--fusion-opt 'mu'"),
    (["collab", "--centers", "a", "--data", "/nonexistent"], "no data for center 'a'"),
    (["collab", "--engine", "ray"], "--engine 'ray'"),
    (["collab", "--logit-adjust", "-1"], "logit_adjust must be a finite number >= 0"),
    (["collab", "--lr-schedule", "step"], "unknown lr_schedule 'step'"),
    (["collab", "--fusion", "fltrust"], "--fusion fltrust: give --root-data FILE.npz"),
    (["collab", "--min-cosine", "2"], "min_cosine must be in [-1, 1)"),
    (["collab", "--root-data", "/nonexistent.npz"], "--root-data: expected /nonexistent.npz"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert msg in err and "Traceback" not in err


def _two_center_strategy(path, device: str = ""):
    """A collaborative strategy of two centers u and v: median fusion, H = 2, 3 rounds; priced for
    centers of one ``device`` (a GPU type) when given, as the search writes its cluster."""
    from polyparallel.strategy import CenterPlan, Collaborative, Mesh, MeshAxis, ModelInfo, Strategy

    cluster = {"device_types": {device: {"kind": "gpu"}},
               "centers": [{"name": n, "nodes": [{"device_type": device, "devices": [i]}]} for i, n in enumerate("uv")]}
    st = Strategy(model=ModelInfo(name="m", fingerprint="f"), mode="collaborative", cluster=cluster if device else {},
                  mesh=Mesh(axes=[MeshAxis(name="center", size=2, level="inter_center")], devices=[0, 1]),
                  collaborative=Collaborative(centers=[CenterPlan(name="u", devices=[0], share=0.5),
                                                       CenterPlan(name="v", devices=[1], share=0.5)],
                                              fusion="median", local_steps=2, rounds=3, round_time_s=0.25))
    st.to_json(path)


def test_collab_from_a_strategy_file(tmp_path, capsys):
    _two_center_strategy(tmp_path / "s.json")
    code, _, err = _run(["collab", "--strategy", str(tmp_path / "s.json"), "--in-shape", "4", "--classes", "2",
                           "--synthetic", "32", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "o" / "result.json").read_text())
    assert [r["accepted"] for r in res["rounds"]] == [["u", "v"]] * 3


def test_flags_beside_a_strategy_win_and_say_so(tmp_path, capsys):
    """--rounds 2 beside a strategy of 3 rounds used to run the strategy's rounds without a word."""
    _two_center_strategy(tmp_path / "s.json")
    job = tmp_path / "job.json"
    code, out, err = _run(["collab", "--strategy", str(tmp_path / "s.json"), "--in-shape", "4", "--classes", "2",
                           "--rounds", "2", "-H", "5", "--save-config", str(job)], capsys)
    assert code == 0, err
    assert "--rounds 2 replaces the strategy's 3" in out and "--local-steps 5 replaces the strategy's 2" in out
    cfg = CollabConfig.from_json(job.read_text())
    assert (cfg.rounds, cfg.local_steps, cfg.fusion) == (2, 5, "median")


def test_a_strategy_priced_for_accelerators_says_so_before_round_one(tmp_path, capsys):
    """collab runs every center on this machine's CPUs: a strategy whose H was priced for GPUs says
    so first (100 s of silence in a round on CPU was the symptom), and what sets fewer steps."""
    _two_center_strategy(tmp_path / "s.json", device="a100-80gb-sxm")
    args = ["collab", "--strategy", str(tmp_path / "s.json"), "--in-shape", "4", "--classes", "2",
            "--save-config", str(tmp_path / "job.json")]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert ("note: this strategy was priced for centers of a100-80gb-sxm, where a round of 2 local steps takes "
            "0.25 s; here every center trains on this machine's CPUs, so a round takes longer (--local-steps") in out
    code, out, err = _run([*args, "-H", "1"], capsys)
    assert code == 0 and "priced for centers of a100-80gb-sxm" in out and "(--local-steps" not in out
    _two_center_strategy(tmp_path / "cpu.json")
    code, out, err = _run([*args[:2], str(tmp_path / "cpu.json"), *args[3:]], capsys)
    assert code == 0 and "priced for" not in out


def test_serve_of_an_fltrust_job_needs_the_root_set_before_starting_anything(tmp_path, capsys):
    job = tmp_path / "job.json"
    code, _, err = _run(["collab", "--centers", "a,b", "--fusion", "fltrust", "--save-config", str(job)], capsys)
    assert code == 0, err
    code, _, err = _run(["serve", "--config", str(job), "--workdir", str(tmp_path / "wd")], capsys)
    assert code == 2 and "needs the server's root set: give --root-data FILE.npz" in err
    code, _, err = _run(["serve", "--config", str(job), "--root-data", str(tmp_path / "none.npz")], capsys)
    assert code == 2 and "--root-data: expected" in err
    assert not (tmp_path / "wd").exists()


def test_flagged_centers_are_named_one_line_each():
    from polyparallel._cli_collab import _flagged_lines
    from polyparallel.backends.collab import CollabResult, RoundRecord

    def rec(r, rejected, metrics):
        return RoundRecord(r, tuple(metrics), rejected, (), True, {}, 0, 0.0, metrics)

    res = CollabResult({}, (rec(1, {"c0": ("update norm 9 > 4 x 1",)}, {"c1": {"cos_fused": 0.9}}),
                            rec(2, {}, {"c0": {"trust": 0.0, "cos_root": -0.5}, "c1": {"cos_fused": -0.2}})), ())
    assert _flagged_lines(res) == [
        "flagged: c0 in 2 of 2 rounds (1,2): no trust (cosine to the server's root update -0.500)",
        "flagged: c1 in 1 of 2 rounds (2): pulled against the fused step (cosine -0.200)"]
