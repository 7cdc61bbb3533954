"""Online pruning over Flower (issue 35): the centers' scores travel in their replies, the plan in the
server's messages after the cut, and the pruned model, its masks and its release are the in-process
engine's, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch_pruning")
pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")

from polyparallel.backends.collab import CollabConfig, run_inprocess
from polyparallel.backends.collab._flower import LoopbackFederation, run_flower
from polyparallel.backends.collab._pruning import PruneSpec
from polyparallel.backends.collab._release import write_release
from tests.test_collab_pruning import _config, _digits


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("channel", ["flower", "socket"])
def test_pruning_over_flower_is_the_inprocess_pruning_bit_for_bit(tmp_path, channel):
    """3 centers on digits, masks in rounds 1-2, the cut after round 2, one fine-tuning round; the
    centers evaluate each fused model on their held-out rows (``evaluate`` messages or frames, which
    carry the plan after the cut as the ``train`` ones do), over Flower's messages and over the lean
    data channel."""
    data, ev = _digits(rows=200)
    cfg: CollabConfig = _config(rounds=3, local_steps=6, holdout=0.2, round_timeout_s=120,
                                prune=PruneSpec(0.5, rounds=2, score="fisher", score_batches=2))
    res = run_flower(cfg, data, workdir=tmp_path / "flwr", timeout_s=240, data_channel=channel)
    ref = run_inprocess(cfg, data)
    assert [r.accepted for r in res.rounds] == [("a", "b", "c")] * 3
    assert {k: v.shape for k, v in res.params.items()} == {k: v.shape for k, v in ref.params.items()}
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    assert res.pruning["plan"] == ref.pruning["plan"] and res.pruning["masks"] == ref.pruning["masks"]
    for k, v in ref.pruning["cut_params"].items():
        np.testing.assert_array_equal(res.pruning["cut_params"][k], v)
    # the scores travelled: round 1 and 2 replies are larger than the update alone, round 3's (pruned) smaller
    up = [r.bytes_up["a"] for r in res.rounds]
    assert up == [r.bytes_up["a"] for r in ref.rounds] and up[2] < up[0] and up[0] == up[1]
    # every center evaluated the cut model (its own held-out rows) as in-process
    assert [r.eval for r in res.rounds] == [r.eval for r in ref.rounds] and np.isfinite(res.rounds[2].eval["loss"])
    # the release is written the same from either run
    a = write_release(tmp_path / "rel-flower", cfg, res.params, res.pruning, ev)
    b = write_release(tmp_path / "rel-inprocess", cfg, ref.params, ref.pruning, ev)
    assert a["params_after"] <= 0.5 * a["params_before"]
    for k in ("params_before", "params_after", "flops_before", "flops_after", "accuracy_before",
              "accuracy_at_cut", "accuracy_after"):
        assert a[k] == b[k], k
    assert LoopbackFederation(tmp_path / "flwr", {}).stray_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_a_deployed_pruning_job_resumes_after_a_server_kill_and_is_the_inprocess_job(tmp_path, monkeypatch):
    """`polyparallel serve` of a pruning job file (the input row's shape in it, as `collab --save-config`
    writes it) with three `polyparallel center`s: masks in rounds 1-2, the cut after round 2; the server
    is SIGKILLed once the cut is checkpointed and started again. Rounds 1..5 are recorded once each,
    every center trains the cut model, and the model, plan and masks are the in-process job's bit for bit."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    from polyparallel.backends.collab._flower import free_port, read_outputs
    from polyparallel.backends.collab._pruning import with_input_of
    from tests.test_collab_faults import _cli, _pids_with_home, _rounds, _until

    data, ev = _digits(rows=100)
    cfg = with_input_of(_config(rounds=5, local_steps=2, round_timeout_s=120,
                                prune=PruneSpec(0.5, rounds=2, score="taylor", score_batches=1, target="channels",
                                                allocation="uniform")), ev[0][:1])
    (tmp_path / "job.json").write_text(cfg.to_json())
    for c, (x, y) in data.items():
        np.savez(tmp_path / f"{c}.npz", x=x, y=y)
    np.savez(tmp_path / "ev.npz", x=ev[0], y=ev[1])
    root = str(Path(__file__).resolve().parent.parent)  # the centers import the model from tests/
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")])))
    port = free_port()
    serve_args = ["serve", "--config", "job.json", "--port", str(port), "--host", "127.0.0.1", "--out", "out",
                  "--workdir", "srv", "--eval-data", "ev.npz", "--release", "rel"]
    procs = []
    try:
        procs.append(serve := _cli(serve_args, tmp_path, tmp_path / "serve.log"))
        _until(lambda: "waiting for 3 centers" in (tmp_path / "serve.log").read_text(), 60, "the SuperLink")
        for c in data:
            procs.append(_cli(["center", "--name", c, "--superlink", f"127.0.0.1:{port}", "--data", f"{c}.npz",
                               "--workdir", f"w-{c}"], tmp_path, tmp_path / f"{c}.log"))
        out = tmp_path / "out"
        _until(lambda: len(_rounds(out)) >= 2, 120, "the cut after round 2")
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        killed_after = len(_rounds(out))
        assert 2 <= killed_after < 5, killed_after
        procs.append(serve := _cli(serve_args, tmp_path, tmp_path / "serve.log"))
        try:  # the centers' SuperNodes give up on the killed SuperLink after 10 s and are started again
            code = serve.wait(300)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, "\n".join(f"--- {f}\n" + (tmp_path / f).read_text()[-1500:]
                                     for f in ("serve.log", "a.log", "b.log", "c.log"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    log = (tmp_path / "serve.log").read_text()
    assert "resumed from" in log and f"resuming: {killed_after} rounds recorded" in log, log[-3000:]
    # the restarted serve does not show its predecessor's rounds again
    assert [ln.startswith("round 1/5 ") for ln in log.splitlines()].count(True) == 1
    res, ref = read_outputs(out), run_inprocess(cfg, data)
    assert [r.round for r in res.rounds] == [1, 2, 3, 4, 5] and all(r.fused for r in res.rounds)
    assert [r.accepted for r in res.rounds] == [("a", "b", "c")] * 5
    assert res.pruning["plan"] == ref.pruning["plan"] and res.pruning["masks"] == ref.pruning["masks"]
    assert {k: v.shape for k, v in res.params.items()} == {k: v.shape for k, v in ref.params.items()}
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    # the release: the smaller model measured on the server's evaluation rows, as `collab --release` writes it
    rel = json.loads((tmp_path / "rel" / "release.json").read_text())
    assert rel["params_after"] < rel["params_before"] and rel["accuracy_after"] == res.rounds[-1].eval["accuracy"]
    assert (tmp_path / "rel" / "model.onnx").exists() and (tmp_path / "rel" / "model.pt2").exists()
    for home in ("srv", "w-a", "w-b", "w-c"):
        assert _until(lambda h=home: not _pids_with_home(tmp_path / h / "flwr-home"), 10, f"{home} processes")
