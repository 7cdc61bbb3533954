"""Two runs started at once each train their own job and log only their own steps.

Seen in CI (two pytest-xdist workers): the CLI chose its run directory's name ``<stamp>`` without
creating it, a test's ``train()`` in the same second created that very directory, and both runs
used it: each wrote its ``job.pkl``, both launches ran the one written last, and the test got
steps 0-4 of the CLI's job twice in its ``train.jsonl``. Now a new run directory is created when
its name is chosen, and a run directory is held by one ``train()`` at a time.

Runs launch 2 CPU worker processes (gloo) of the launcher tests' tiny MLP; the losses are checked
against one process training the same batches (``single_process_losses``).
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import polyparallel as pp
import polyparallel.backends.torch as backend
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch import _launch, train
from polyparallel.backends.torch._launch import RunDirInUse, new_run_dir
from polyparallel.cli import main

LR, SEED = 0.1, 0
GO_ON = "PP_TEST_GO_ON"  # a file: the held-back run's workers wait for it after step 0


@pytest.fixture(scope="module")
def mlp_dp2() -> pp.Strategy:
    x, y = ex.mlp_data(0)
    return pp.evaluate(ex.tiny_mlp(), (x, y), "local-cpu:2", batch_size=ex.BATCH, dp=2, microbatches=1,
                       recompute="none")


def held_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In a worker, steps after 0 wait (up to 120 s) until the file named by ``$PP_TEST_GO_ON`` exists."""
    if step >= 1 and "RANK" in os.environ:
        deadline = time.monotonic() + 120
        while not Path(os.environ[GO_ON]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return ex.mlp_data(step)


def _close(log: list[dict], steps: int, lr: float) -> bool:
    ref = ex.single_process_losses(ex.tiny_mlp, ex.mlp_data, steps=steps, lr=lr, seed=SEED)
    return [r["step"] for r in log] == list(range(steps)) and \
        all(abs(r["loss"] - w) <= 1e-5 * abs(w) for r, w in zip(log, ref, strict=True))


@pytest.mark.timeout(180)
def test_a_run_started_while_another_runs_trains_only_its_own_job(tmp_path: Path, mlp_dp2: pp.Strategy,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A is held after its step 0; meanwhile a second train() in A's directory is refused
    before it writes anything, and run C in a directory of its own launches, trains and ends.
    Then A goes on: A and C each logged exactly their steps, with their own losses."""
    monkeypatch.setenv(GO_ON, str(tmp_path / "go-on"))
    a_dir, c_dir = tmp_path / "a", tmp_path / "c"
    during: dict[str, object] = {}

    def at_a_step(rec: dict) -> None:
        if rec["step"] != 0:
            return
        try:
            train(mlp_dp2, ex.tiny_mlp, ex.mlp_data, steps=2, lr=0.05, seed=SEED, run_dir=a_dir, timeout_s=120)
            during["b"] = "ran"
        except RunDirInUse as e:
            during["b"] = str(e)
        during["c"] = train(mlp_dp2, ex.tiny_mlp, ex.mlp_data, steps=2, lr=0.05, seed=SEED, run_dir=c_dir,
                            timeout_s=120)
        (tmp_path / "go-on").touch()

    log_a = train(mlp_dp2, ex.tiny_mlp, held_data, steps=3, lr=LR, seed=SEED, run_dir=a_dir, progress=at_a_step,
                  timeout_s=150)
    assert "is in use by another train()" in str(during["b"])
    assert pickle.loads((a_dir / "job.pkl").read_bytes())["steps"] == 3  # B wrote nothing there
    assert _close(during["c"], 2, 0.05), during["c"]
    assert _close(log_a, 3, LR), log_a


def test_the_cli_creates_its_run_directory_before_another_run_of_the_same_second_can(
        tmp_path: Path, mlp_dp2: pp.Strategy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another job's ``new_run_dir()`` in the same second, between the CLI's choice of a run
    directory and train(), gets another directory; the CLI's, empty after a refused run, is removed."""
    monkeypatch.setenv("POLYPARALLEL_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(_launch.time, "strftime", lambda fmt, *t: "20260101-000000")
    seen: dict[str, Path] = {}
    real = backend.train

    def another_job_starts_first(*args: object, run_dir: Path, **kw: object) -> list[dict]:
        seen["cli"], seen["other"] = Path(run_dir), new_run_dir()
        return real(*args, run_dir=run_dir, **kw)

    monkeypatch.setattr(backend, "train", another_job_starts_first)
    path = tmp_path / "s.json"
    mlp_dp2.to_json(path)
    with pytest.raises(SystemExit) as e:  # refused before launch: 5 rows, global batch 8
        main(["train", str(path), "--model", "polyparallel.backends.torch._examples:tiny_mlp",
              "--data", "tests.test_torch_launcher:five_rows", "--timeout", "60"])
    assert e.value.code == 2
    assert seen["other"] != seen["cli"] and seen["other"].is_dir()
    assert not seen["cli"].exists()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [seen["other"].name]
