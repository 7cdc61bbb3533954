"""Torch backend's launcher: no process outlives train(), live progress, the run directory,
keep-last-k checkpoints, first-batch checks and resuming under another strategy.

Runs launch 2 CPU worker processes (gloo) of a tiny model. A process counts as gone when
``/proc/PID`` is absent or a zombie (killed, waiting to be reaped by init: it runs nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import TrainError, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch._procs import alive, recorded_pids
from polyparallel.backends.torch._steps import batch_counts
from polyparallel.cli import main
from tests.test_torch_backend import EX, LR, SEED, _strategy

pytestmark = pytest.mark.slow
MARKS = "PP_TEST_MARKS"  # where a worker's data_fn leaves a file when it reaches a step


def _mark(step: int) -> None:
    where = os.environ.get(MARKS)
    if where and "RANK" in os.environ:
        (Path(where) / f"rank{os.environ['RANK']}-step{step}").touch()


def stuck_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In a worker, step 1 never comes: the run cannot finish."""
    _mark(step)
    if step >= 1 and "RANK" in os.environ:
        time.sleep(3600)
    return ex.mlp_data(step)


def slow_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In a worker, steps after 0 take 1.5 s longer; each rank prints which step it reads."""
    if "RANK" in os.environ:
        print(f"rank {os.environ['RANK']} reads step {step}", flush=True)
        if step >= 1:
            time.sleep(1.5)
    return ex.mlp_data(step)


def killed_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1 dies of SIGKILL at step 1: no Python runs to write its failure report."""
    if step == 1 and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return ex.mlp_data(step)


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def mlp_dp2() -> pp.Strategy:
    return _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1, zero_stage=0)


@pytest.mark.timeout(120)
def test_timeout_kills_every_worker(tmp_path: Path, mlp_dp2: pp.Strategy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MARKS, str(tmp_path))
    timeout = 40.0  # the launch alone takes 10-30 s on 2 busy cores: the workers must be running when it passes
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=rf"did not finish within 40 s.*{tmp_path / 'run' / 'launcher.log'}"):
        train(mlp_dp2, ex.tiny_mlp, stuck_data, steps=3, run_dir=tmp_path / "run", timeout_s=timeout)
    took = time.monotonic() - t0
    assert took <= timeout + 5, took
    pids = list(recorded_pids(tmp_path / "run"))
    assert len(pids) == 2  # both ranks started and recorded themselves
    assert {p.name for p in tmp_path.glob("rank*-step1")} == {"rank0-step1", "rank1-step1"}  # and were stuck in step 1
    assert _gone_within(pids, 5) == []


@pytest.mark.timeout(120)
def test_an_exception_in_train_kills_every_worker(tmp_path: Path, mlp_dp2: pp.Strategy,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C arrives as KeyboardInterrupt wherever train() is; here it is raised by the progress
    callback at step 0's record, while both workers are stuck in step 1."""
    monkeypatch.setenv(MARKS, str(tmp_path))

    def interrupt(rec: dict) -> None:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("rank*-step1"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(mlp_dp2, ex.tiny_mlp, stuck_data, steps=3, run_dir=tmp_path / "run", progress=interrupt)
    pids = list(recorded_pids(tmp_path / "run"))
    assert len(pids) == 2 and len(list(tmp_path.glob("rank*-step1"))) == 2
    assert _gone_within(pids, 5) == []


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_named(tmp_path: Path, mlp_dp2: pp.Strategy) -> None:
    """Its peer reports only the lost connection; the launcher names the rank that wrote no report."""
    with pytest.raises(TrainError, match=r"rank 1 died without a failure report .*rank 0 then lost its connection "
                                         r"at step 1") as e:
        train(mlp_dp2, ex.tiny_mlp, killed_data, steps=3, run_dir=tmp_path, timeout_s=100)
    assert (e.value.rank, e.value.step) == (1, 1) and str(tmp_path / "launcher.log") in str(e.value)
    assert [p.name for p in tmp_path.glob("failure-rank*.json")] == ["failure-rank0.json"]
    assert _gone_within(list(recorded_pids(tmp_path)), 5) == []


@pytest.mark.timeout(150)
def test_killing_the_caller_leaves_no_worker(tmp_path: Path, mlp_dp2: pp.Strategy) -> None:
    """train() in a process that gets SIGKILL (no Python code runs there): agent and workers die with it."""
    path = tmp_path / "s.json"
    mlp_dp2.to_json(path)
    script = textwrap.dedent(f"""
        from polyparallel.backends.torch import train
        train({str(path)!r}, {EX + ':tiny_mlp'!r}, 'tests.test_torch_launcher:stuck_data', steps=3,
              run_dir={str(tmp_path / 'run')!r}, timeout_s=300)
    """)
    env = {**os.environ, MARKS: str(tmp_path), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    caller = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=Path(__file__).parent.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 100
        while len(list(tmp_path.glob("rank*-step1"))) < 2 and caller.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert caller.poll() is None, caller.communicate()[0].decode()[-3000:]
        agent = _children(caller.pid)
        pids = list(recorded_pids(tmp_path / "run"))
        assert len(agent) == 1 and len(pids) == 2
        assert all(alive(p) for p in agent + pids)
        caller.kill()
        caller.wait()
        assert _gone_within(agent + pids, 5) == []
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
            caller.wait()


@pytest.mark.timeout(120)
def test_progress_arrives_while_the_run_goes_on(tmp_path: Path, mlp_dp2: pp.Strategy) -> None:
    seen: list[tuple[float, dict, str]] = []

    def progress(rec: dict) -> None:  # with what launcher.log holds by then
        seen.append((time.monotonic(), rec, (tmp_path / "launcher.log").read_text()))

    log = train(mlp_dp2, ex.tiny_mlp, slow_data, steps=4, lr=LR, seed=SEED, run_dir=tmp_path, progress=progress)
    end = time.monotonic()
    assert [r for _, r, _ in seen] == log and [r["step"] for r in log] == [0, 1, 2, 3]
    # steps 1-3 each wait 1.5 s in data_fn after step 0 was logged: step 0 must arrive >= 4.5 s before the end
    assert end - seen[0][0] >= 4.0, end - seen[0][0]
    assert all(r["samples"] == ex.BATCH and "tokens" not in r for r in log)  # float inputs: samples only
    # the workers' output is in launcher.log as they print it, not only when the run ends
    assert "rank 0 reads step 0" in seen[0][2] and "reads step 3" not in seen[0][2]  # step 3 starts >= 3 s later
    assert "rank 1 reads step 3" in (tmp_path / "launcher.log").read_text()
    assert {p.name for p in tmp_path.iterdir()} >= {"job.pkl", "launcher.log", "train.jsonl", "pids"}


def test_batch_counts() -> None:
    ids, _ = ex.gpt_data(0)
    assert batch_counts(ids) == {"samples": ex.BATCH, "tokens": ex.BATCH * 16}  # token ids: (batch, seq)
    assert batch_counts(ex.mlp_data(0)[0]) == {"samples": ex.BATCH}  # features


@pytest.mark.timeout(150)
def test_keeps_the_last_checkpoints_and_resumes(tmp_path: Path, mlp_dp2: pp.Strategy) -> None:
    run = tmp_path / "run"
    first = train(mlp_dp2, ex.tiny_mlp, ex.mlp_data, steps=5, lr=LR, seed=SEED, run_dir=run, checkpoint_every=1,
                  keep_checkpoints=2)
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-3", "step-4"]
    assert (ckpt / "LATEST").read_text() == "4"
    assert json.loads((ckpt / "step-4" / "strategy.json").read_text())["dp"] == 2
    # a rerun on the same run directory resumes (another seed: the weights must come from the checkpoint)
    seen: list[int] = []
    log = train(mlp_dp2, ex.tiny_mlp, ex.mlp_data, steps=7, lr=LR, seed=SEED + 1, run_dir=run,
                progress=lambda r: seen.append(r["step"]))
    assert seen == [5, 6] and log[:5] == first
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-5", "step-6"]
    ref = ex.single_process_losses(ex.tiny_mlp, ex.mlp_data, steps=7, lr=LR, seed=SEED)
    assert max(abs(r["loss"] - w) / w for r, w in zip(log, ref, strict=True)) <= 1e-4


def five_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ex.mlp_data(step)
    return x[:5], y[:5]


def features_only(step: int) -> torch.Tensor:
    return ex.mlp_data(step)[0]


def bool_labels(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ex.mlp_data(step)
    return x, y > 3


def list_inputs(step: int) -> tuple[list[float], torch.Tensor]:
    x, y = ex.mlp_data(step)
    return x.tolist(), y


@pytest.mark.parametrize(("data_fn", "message"), [
    (five_rows, r"data_fn\(0\)'s inputs has 5 rows \(shape \(5, 32\)\), but the strategy's global batch is 8: "
                r"return 8 rows per step, or search again"),
    (features_only, r"data_fn\(0\) returned a Tensor; return \(inputs, labels\)"),
    (bool_labels, r"labels are torch.bool; return integer class ids \(torch.long\) or float targets"),
    (list_inputs, r"data_fn\(0\)'s inputs is a list; return torch tensors"),
])
def test_wrong_first_batch_is_refused_before_launch(tmp_path: Path, mlp_dp2: pp.Strategy, data_fn,
                                                    message: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=message):
        train(mlp_dp2, ex.tiny_mlp, data_fn, steps=1, run_dir=tmp_path / "run")
    assert time.monotonic() - t0 < 10  # no launch: refused from data_fn(0) alone
    assert not (tmp_path / "run").exists()


def test_a_function_the_workers_cannot_load_is_refused_before_launch(tmp_path: Path, mlp_dp2: pp.Strategy) -> None:
    with pytest.raises(ValueError, match=r"model_fn/data_fn must be 'package.module:function' strings"):
        train(mlp_dp2, ex.tiny_mlp, lambda step: ex.mlp_data(step), steps=1, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_wrong_batch_in_one_line(tmp_path: Path, mlp_dp2: pp.Strategy,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    mlp_dp2.to_json(path)
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--model", f"{EX}:tiny_mlp", "--data", "tests.test_torch_launcher:five_rows",
              "--run-dir", str(tmp_path / "run"), "--timeout", "60"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "global batch is 8" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(240)
def test_resume_under_another_layout_reshards(tmp_path: Path) -> None:
    """2 Adam steps under DDP (dp=2), resumed under FSDP (zero_stage=3) to 4 steps: the losses are
    those of 4 uninterrupted single-process steps (the sharded Adam moments came from the DDP save).
    A pipeline strategy or another model is refused before launch."""
    lr = 1e-2
    ddp = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=0)
    fsdp = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=3)
    assert (ddp.zero_stage, fsdp.zero_stage) == (0, 3)
    ckpt = tmp_path / "ckpt"
    train(ddp, ex.tiny_gpt, ex.gpt_data, steps=2, optimizer="adam", lr=lr, seed=SEED, checkpoint_dir=ckpt)
    log = train(fsdp, ex.tiny_gpt, ex.gpt_data, steps=4, optimizer="adam", lr=lr, seed=SEED + 1, checkpoint_dir=ckpt)
    ref = ex.single_process_losses(ex.tiny_gpt, ex.gpt_data, steps=4, lr=lr, seed=SEED, optimizer="adam")
    err = max(abs(r["loss"] - w) / w for r, w in zip(log, ref, strict=True))
    print(f"DDP 2 steps -> FSDP 2 more: max relative loss difference {err:.2e}")
    assert err <= 1e-4
    # without the checkpoint's Adam moments the resumed steps differ: the comparison can fail
    fresh_adam = ex.single_process_losses(ex.tiny_gpt, ex.gpt_data, steps=2, lr=lr, seed=SEED + 1, optimizer="adam")
    assert abs(log[2]["loss"] - fresh_adam[0]) / fresh_adam[0] > 1e-3
    assert json.loads((ckpt / "step-3" / "strategy.json").read_text())["zero_stage"] == 3

    x, y = ex.gpt_data(0)
    pipe = pp.search(ex.tiny_gpt(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                     constraints={"pp": 2, "tp": 1, "dp": 1, "microbatches": 4, "recompute": "none"})
    before = (ckpt / "train.jsonl").read_text()
    with pytest.raises(ValueError, match=r"layout \[dp=2 tp=1 sp=1 pp=1 zero_stage=3\] and cannot be resharded to "
                                         r"\[dp=1 tp=1 sp=1 pp=2 .*Resume with the saved strategy"):
        train(pipe, ex.tiny_gpt, ex.gpt_data, steps=6, checkpoint_dir=ckpt)
    mlp = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1)  # same micro-batch: the fingerprints compare
    with pytest.raises(ValueError, match=r"is of model 'GPT' \(fingerprint \w+\), not of this strategy's 'MLP'"):
        train(mlp, ex.tiny_mlp, ex.mlp_data, steps=6, checkpoint_dir=ckpt)
    mlp_tp = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=1, tp=2, placements="rule")  # micro-batch 8, not 4: by tensors
    with pytest.raises(ValueError, match=r"is not of this model \(\d+ tensors differ: .*resume with the model that"):
        train(mlp_tp, ex.tiny_mlp, ex.mlp_data, steps=6, checkpoint_dir=ckpt)
    assert (ckpt / "train.jsonl").read_text() == before and (ckpt / "LATEST").read_text() == "3"  # nothing ran
