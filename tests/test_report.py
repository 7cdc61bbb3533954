"""``polyparallel report``: real strategies (the search on built-in models) and a real collaborative
run become one self-contained page with the expected elements and numbers, which headless Chromium
renders without console errors (the screenshots are kept under pytest's tmp dir; their paths are
printed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

import polyparallel as pp
from polyparallel.cli import main
from polyparallel.report import pipeline_tasks, read_run, render


@pytest.fixture(scope="module")
def sync_strategy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sync") / "s.json"
    pp.search("gpt-tiny", cluster="local-cpu:4", constraints={"pp": 2}).to_json(path)
    return path


@pytest.fixture(scope="module")
def collab_strategy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("collab") / "c.json"
    pp.search("mlp", cluster="aisynergy-5", constraints={"mode": "collaborative"}).to_json(path)
    return path


@pytest.fixture(scope="module")
def collab_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real in-process federation, written as `polyparallel collab --out` writes it."""
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, collaborate

    out = tmp_path_factory.mktemp("collab-run")
    cfg = CollabConfig(centers=(CenterSpec("a"), CenterSpec("b")), model=ModelSpec("mlp", (8,), 3, hidden=8),
                       rounds=3, local_steps=5, holdout=0.2)
    rng = np.random.default_rng(0)
    data = {n: (rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)) for n in "ab"}
    result = collaborate(cfg, data, timing_path=out / "timing.jsonl")
    (out / "result.json").write_text(json.dumps(result.to_dict()))
    return out


def _cli(args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0


def _chromium(html: Path, shot: Path) -> str:
    """Screenshot ``html``; returns Chromium's log (console messages land there)."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)")
    proc = subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
                           f"--screenshot={shot}", "--window-size=1400,2000", html.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
    print(f"screenshot: {shot}")
    return proc.stderr


def _no_console_errors(log: str) -> None:
    bad = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not bad, bad


def test_the_console_check_sees_errors(tmp_path: Path) -> None:
    """The browser check is not hollow: a page whose script fails is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><script>console.error("boom"); no_such_fn();</script>'
                   + "<p>" + "padding " * 3000 + "</p></body></html>")
    with pytest.raises(AssertionError, match="boom"):
        _no_console_errors(_chromium(bad, tmp_path / "bad.png"))


def _self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "the page loads something from the network"
    assert "<script" not in page


def test_synchronous_report(sync_strategy: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    _cli(["report", str(sync_strategy), "--out", str(out)])
    page = out.read_text()
    _self_contained(page)
    s = pp.Strategy.from_json(sync_strategy)
    for ident in ("cluster", "mesh-axes", "memory", "breakdown", "stage-compute", "pipeline"):
        assert f'id="{ident}"' in page, ident
    assert page.count('class="device"') == 4
    # every device carries its stage's color and its mesh coordinates
    for st in s.stages:
        for d in st.devices:
            assert f'data-device="{d}"' in page
    assert "pp0 dp0" in page and "pp1 dp1" in page
    # the simulated timeline: every forward and backward of every micro-batch, and the simulator's makespan
    tasks, sim = pipeline_tasks(s)
    chunks = sim.chunks
    assert len(tasks) == 2 * s.pp * s.microbatches * chunks
    assert page.count('class="task"') == len(tasks)
    assert max(z for _, _, z, _, _ in tasks) == pytest.approx(sim.makespan)
    assert [sum(z - a for r, a, z, _, _ in tasks if r == st) for st in range(s.pp)] == pytest.approx(list(sim.busy))
    # the strategy's numbers
    assert f"dp={s.dp} tp={s.tp} pp={s.pp}" in page
    assert f"{s.estimate.step_time_s * 1e3:.2f} ms" in page
    for st in s.stages:
        assert f"{st.compute_s * 1e3:.2f} ms" in page
    for label in s.estimate.memory_by_device:
        assert label in page
    _no_console_errors(_chromium(out, tmp_path / "report-sync.png"))


def test_collaborative_report_with_run(collab_strategy: Path, collab_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    _cli(["report", str(collab_strategy), "--run", str(collab_run), "--out", str(out)])
    page = out.read_text()
    _self_contained(page)
    s = pp.Strategy.from_json(collab_strategy)
    for ident in ("cluster", "breakdown", "center-steps", "round-plan", "run-center-loss", "run-eval", "run-phases"):
        assert f'id="{ident}"' in page, ident
    assert page.count('class="device"') == s.cluster["totals"]["devices"]  # the whole cluster is drawn
    for c in s.collaborative.centers:
        assert c.name in page
    assert f"H={s.collaborative.local_steps}" in page
    r = s.collaborative.round_time_s  # written as the page writes seconds: ms below 1 s
    assert (f"{r * 1e3:.2f} ms" if r < 1 else f"{r:.3f} s") in page
    # one upload and one download per center with a WAN link; the slowest ends the round
    assert page.count('data-kind="upload"') == len(s.collaborative.centers)
    rounds = read_run(collab_run).rounds
    assert 'data-series="a"' in page and 'data-series="eval accuracy"' in page
    assert f"{rounds[-1]['eval']['accuracy']:.4g}" in page
    _no_console_errors(_chromium(out, tmp_path / "report-collab.png"))


def test_torch_run_records(sync_strategy: Path, tmp_path: Path) -> None:
    """train.jsonl as the torch backend's ``log_step`` writes it (loss and step time per step)."""
    run = tmp_path / "run"
    run.mkdir()
    losses = [2.5, 2.1, 1.7, 1.6]
    (run / "train.jsonl").write_text("".join(json.dumps({"step": i, "loss": v, "loss_weighting": "tokens",
                                                         "step_time_s": 0.02 + 0.001 * i, "device": "cpu",
                                                         "backend": "gloo"}) + "\n" for i, v in enumerate(losses)))
    page = render(pp.Strategy.from_json(sync_strategy), read_run(run))
    assert 'id="run-loss"' in page and 'id="run-step-time"' in page
    assert "4 step records" in page and "1.6" in page


@pytest.mark.parametrize("schedule, microbatches", [("gpipe", 4), ("1f1b", 3), ("1f1b", 8), ("interleaved:2", 4),
                                                     ("interleaved:3", 6)])
def test_timeline_matches_the_cost_models_simulation(sync_strategy: Path, schedule: str, microbatches: int) -> None:
    s = pp.Strategy.from_json(sync_strategy).model_copy(update={"schedule": schedule, "microbatches": microbatches})
    tasks, sim = pipeline_tasks(s)
    assert len(tasks) == 2 * s.pp * microbatches * sim.chunks
    assert max(z for _, _, z, _, _ in tasks) == pytest.approx(sim.makespan)
    for r in range(s.pp):  # a stage runs one task at a time
        spans = sorted((a, z) for q, a, z, _, _ in tasks if q == r)
        assert all(z <= a2 + 1e-12 for (_, z), (a2, _) in pairwise(spans))


def test_collab_run_as_serve_writes_it(collab_strategy: Path, collab_run: Path, tmp_path: Path) -> None:
    """`serve --out` / the Flower engine write rounds.jsonl and timing.jsonl instead of result.json."""
    result = json.loads((collab_run / "result.json").read_text())
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in result["rounds"]))
    (tmp_path / "timing.jsonl").write_text((collab_run / "timing.jsonl").read_text())
    run = read_run(tmp_path)
    assert run.kind == "collab" and len(run.rounds) == 3 and run.timing
    page = render(pp.Strategy.from_json(collab_strategy), run)
    assert 'id="run-phases"' in page and page.count("<tr><td>") >= 3


@pytest.mark.parametrize("case, words", [
    ("not-json", ["not JSON", "polyparallel search"]),
    ("not-strategy", ["schema_version", "polyparallel search"]),
    ("empty-run", ["no run records", "--run-dir"]),
    ("missing-run", ["does not exist", "--out of `polyparallel collab`"]),
    ("no-steps", ["no step records", "train"]),
    ("other-run", ["trained another strategy", "global_batch 999 there, "]),
])
def test_bad_input_exits_2(case: str, words: list[str], sync_strategy: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    strategy, run = sync_strategy, None
    if case == "not-json":
        strategy = tmp_path / "x.json"
        strategy.write_text("hello")
    elif case == "not-strategy":
        strategy = tmp_path / "x.json"
        strategy.write_text('{"name": "gpt"}')
    elif case == "empty-run":
        run = tmp_path
    elif case == "missing-run":
        run = tmp_path / "nowhere"
    elif case == "other-run":  # a run of another plan: the strategy.json train writes beside its log
        run = tmp_path
        (run / "train.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0, "step_time_s": 0.1}) + "\n")
        other = json.loads(sync_strategy.read_text())
        other["global_batch"] = 999
        (run / "strategy.json").write_text(json.dumps(other))
    else:
        run = tmp_path
        (run / "train.jsonl").write_text("")
    args = ["report", str(strategy), "--out", str(tmp_path / "r.html")] + (["--run", str(run)] if run else [])
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "r.html").exists()


def test_the_update_checks_and_flagged_centers_are_shown(collab_run: Path) -> None:
    """The audit the server records (update norm, cosines, FLTrust's trust, refusals) as the page's table;
    a refused center and result.json's flagged list, as a federation with an attacker writes them."""
    from polyparallel.report import Run, collab_run_section

    run = read_run(collab_run)
    page = collab_run_section(run)
    assert 'id="run-audit"' in page and 'id="run-flagged"' not in page  # honest centers: nobody flagged
    for rec in run.rounds:
        for c, m in rec["metrics"].items():
            assert f"<td>{rec['round']}</td><td>{c}</td><td>{m['update_norm']:.4g}</td>" in page
    attacked = [{"round": 1, "metrics": {"a": {"update_norm": 2.5, "cos_root": 0.31, "trust": 0.31}},
                 "rejected": {"m": ["update norm 9e3 exceeds the bound 25"]}},
                {"round": 2, "metrics": {"a": {"update_norm": 2.0, "cos_root": 0.2, "trust": 0.2},
                                         "m": {"update_norm": 1.9, "cos_root": -0.7, "trust": 0.0}}}]
    flagged = {"m": {"rounds": [1, 2], "why": ["refused: update norm 9e3 exceeds the bound 25",
                                               "no trust (cosine to the server's root update -0.700)"]}}
    page = collab_run_section(Run(collab_run, "collab", rounds=attacked, flagged=flagged))
    assert "<td>1</td><td>m</td><td></td><td></td><td></td><td>refused: update norm 9e3 exceeds the bound 25</td>" \
        in page
    assert "<td>2</td><td>m</td><td>1.9</td><td>-0.7</td><td>0</td><td>accepted</td>" in page
    assert "<td>m</td><td>1, 2</td><td>no trust (cosine to the server&#x27;s root update -0.700)</td>" in page
