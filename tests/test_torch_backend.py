"""Torch backend: multi-process training under a Strategy equals single-process training.

Each config launches 2 CPU worker processes (gloo) with torch.distributed.run and compares the
per-step loss with a plain single-process loop on the same seed and global batch (SGD, fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import TrainError, Unsupported, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.cli import main

EX = "polyparallel.backends.torch._examples"
STEPS, LR, SEED = 3, 0.1, 0
pytestmark = pytest.mark.slow


def _strategy(model: torch.nn.Module, data, **constraints) -> pp.Strategy:
    x, y = data(0)
    return pp.search(model, (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                     constraints={"pp": 1, "microbatches": 1, "recompute": "none", **constraints})


def _single(model_fn, data_fn) -> list[float]:
    """The reference: one process, whole global batch, same seed and optimiser."""
    return ex.single_process_losses(model_fn, data_fn, steps=STEPS, lr=LR, seed=SEED)


def _max_rel(log: list[dict[str, float]], ref: list[float]) -> float:
    assert [r["step"] for r in log] == list(range(STEPS))
    return max(abs(r["loss"] - want) / abs(want) for r, want in zip(log, ref))


@pytest.mark.timeout(60)
def test_data_parallel_gpt_matches_single_process(tmp_path: Path) -> None:
    s = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=0)
    assert (s.dp, s.tp, s.zero_stage) == (2, 1, 0)
    log = train(s, f"{EX}:tiny_gpt", f"{EX}:gpt_data", steps=STEPS, lr=LR, seed=SEED, log_dir=tmp_path,
                profile_comm=True)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"max relative loss difference {err:.2e}; comm per step {[r['comm_s'] for r in log]}")
    assert err <= 1e-4
    assert (tmp_path / "train.jsonl").read_text().count("\n") == STEPS
    assert all(r["step_time_s"] > 0 for r in log)
    # DDP's gradient bucket all-reduces, timed by torch's profiler
    assert all(r["comm_s"] > 0 and r["comm_ops"].get("gloo:all_reduce", 0) >= 1 for r in log)


@pytest.mark.timeout(60)
def test_fsdp_gpt_matches_single_process() -> None:
    s = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=3)
    assert (s.dp, s.tp, s.zero_stage) == (2, 1, 3)
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)  # callables, pickled by reference
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"max relative loss difference {err:.2e}")
    assert err <= 1e-4


@pytest.mark.timeout(60)
def test_tensor_parallel_mlp_matches_single_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Megatron's placements: the solver replicates this tiny MLP (its all-reduces cost more than the split saves)
    s = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=1, tp=2, placements="rule")
    kinds = {p.placement for p in s.placements}
    assert {"n:tp", "k:tp"} <= kinds  # column- and row-parallel linears: a real TP plan
    path = tmp_path / "s.json"
    s.to_json(path)
    with pytest.raises(SystemExit) as e:  # through the CLI
        main(["train", str(path), "--model", f"{EX}:tiny_mlp", "--data", f"{EX}:mlp_data", "--steps", str(STEPS),
              "--lr", str(LR), "--log-dir", str(tmp_path / "log")])
    assert e.value.code in (0, None)
    printed = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    ref = _single(ex.tiny_mlp, ex.mlp_data)
    assert len(printed) == STEPS
    err = max(abs(a - b) / b for a, b in zip(printed, ref))
    print(f"max relative loss difference {err:.2e} (printed with 6 decimals)")
    assert err <= 1e-4


@pytest.mark.timeout(75)
def test_dp_x_tp_fsdp_mlp_matches_single_process() -> None:
    """2-D: FSDP2 over dp=2 of a tensor-parallel (tp=2) MLP, 4 processes on a 2-D DeviceMesh."""
    x, y = ex.mlp_data(0)
    s = pp.search(ex.tiny_mlp(), (x,), "local-cpu:4", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"dp": 2, "tp": 2, "zero_stage": 1, "pp": 1, "microbatches": 1, "recompute": "none",
                               "placements": "rule"})
    assert {"b:dp,n:tp", "b:dp,k:tp"} <= {p.placement for p in s.placements}
    log = train(s, ex.tiny_mlp, ex.mlp_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_mlp, ex.mlp_data))
    print(f"max relative loss difference {err:.2e}")
    assert err <= 1e-4


def failing_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if step == 2 and os.environ.get("RANK") == "1":
        raise RuntimeError("disk gone")
    return ex.mlp_data(step)


@pytest.mark.timeout(60)
def test_dead_worker_is_named() -> None:
    s = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1)
    with pytest.raises(TrainError, match=r"rank 1 failed at step 2: RuntimeError: disk gone") as e:
        train(s, ex.tiny_mlp, failing_data, steps=STEPS, timeout_s=50)
    assert (e.value.rank, e.value.step) == (1, 2)


def nan_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ex.mlp_data(step)
    if step == 1:
        x[0, 0] = float("nan")  # one poisoned value in the global batch
    return x, y


@pytest.mark.timeout(90)
def test_a_non_finite_loss_stops_the_run_on_every_rank(tmp_path: Path) -> None:
    """NaN in the data at step 1: the step is logged, then every rank stops with the step and the
    likely causes (it used to train on, loss nan every step, exit 0); stop_on_nonfinite=False trains on."""
    s = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1)
    with pytest.raises(TrainError, match=r"failed at step 1: NonFiniteLoss: the loss of step 1 is nan"):
        train(s, ex.tiny_mlp, nan_data, steps=STEPS, run_dir=tmp_path / "stop")
    logged = [line for line in (tmp_path / "stop" / "train.jsonl").read_text().splitlines() if line]
    assert len(logged) == 2
    log = train(s, ex.tiny_mlp, nan_data, steps=STEPS, run_dir=tmp_path / "on", stop_on_nonfinite=False)
    assert [r["step"] for r in log] == list(range(STEPS)) and all(r["loss"] != r["loss"] for r in log[1:])
    with pytest.raises(ValueError, match=r"lr=nan: the learning rate must be a positive finite number"):
        train(s, ex.tiny_mlp, ex.mlp_data, steps=STEPS, lr=float("nan"))


@pytest.mark.timeout(75)
def test_resume_after_a_dead_worker_loses_no_step(tmp_path: Path) -> None:
    """FSDP run killed at step 2 (rank 1), resumed from the step-1 checkpoint: same trajectory."""
    s = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1, zero_stage=3)
    with pytest.raises(TrainError, match="rank 1 failed at step 2"):
        train(s, ex.tiny_mlp, failing_data, steps=STEPS, lr=LR, seed=SEED, checkpoint_dir=tmp_path)
    assert (tmp_path / "LATEST").read_text() == "1"
    log = train(s, ex.tiny_mlp, ex.mlp_data, steps=STEPS, lr=LR, seed=SEED + 1, checkpoint_dir=tmp_path)
    # a different seed proves the weights came from the checkpoint, not from a fresh init
    err = _max_rel(log, _single(ex.tiny_mlp, ex.mlp_data))
    print(f"max relative loss difference after resume {err:.2e}")
    assert err <= 1e-4


def test_refuses_what_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=1, tp=2)  # executed: tests/test_torch_tp.py
    mlp = _strategy(ex.tiny_mlp(), ex.mlp_data, dp=2, tp=1)
    with pytest.raises(Unsupported, match=r"1F1B schedule needs at least as many micro-batches as stages"):
        train(mlp.model_copy(update={"pp": 2, "microbatches": 1, "schedule": "1f1b"}), ex.tiny_mlp, ex.mlp_data,
              steps=1)
    with pytest.raises(Unsupported, match=r"pp=2: pipeline parallelism"):
        train(mlp.model_copy(update={"pp": 2, "schedule": "gpipe"}), ex.tiny_mlp, ex.mlp_data, steps=1)
    with pytest.raises(Unsupported, match=r"sp=2"):
        train(mlp.model_copy(update={"sp": 2}), ex.tiny_mlp, ex.mlp_data, steps=1)
    path = tmp_path / "s.json"
    gpt.to_json(path)
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--model", f"{EX}:tiny_mlp", "--data", f"{EX}:gpt_data", "--steps", "1",
              "--log-dir", str(tmp_path / "log")])
    assert e.value.code == 2
    # another model, which cannot take the strategy's data: refused, naming the strategy's model
    err = capsys.readouterr().err
    assert "forward fails on a micro-batch" in err and f"the strategy was made for ({gpt.model.name})" in err
    assert not (tmp_path / "log").exists()  # refused before anything ran
