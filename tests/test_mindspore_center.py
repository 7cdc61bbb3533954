"""A MindSpore center with several devices: data parallelism over msrun ranks (MCCL on CPU).

The ranks are real msrun processes; each test starts one center (msrun + MindSpore's import +
the rendezvous: ~15 s on 2 cores) and stops it, with its ranks, before it ends.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab import CenterSpec, CollabConfig, initial_params, run_inprocess
from polyparallel.backends.collab._dp_center import DataParallelTrainer
from polyparallel.backends.collab._foreign import ForeignTrainer
from polyparallel.backends.collab._models import ModelSpec, build_torch_model, torch_state
from polyparallel.backends.collab._trainers import make_trainer

pytest.importorskip("mindspore")

SPEC = ModelSpec("mlp", (64,), 10, hidden=16)  # Linear, LayerNorm, Linear


def _digits(n: int = 192) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:n] / 16).astype(np.float32), d.target[:n].astype(np.int64)


def _rel(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


def test_plans_mindspore_cannot_run_on_cpu_are_refused_before_msrun_starts():
    x, y = _digits(32)
    for plan, what in (({"tp": 2}, "tp=2"), ({"dp": 2, "zero_stage": 1}, "zero_stage=1")):
        cfg = CollabConfig(centers=(CenterSpec("m", framework="mindspore", devices=2, plan=plan),), model=SPEC)
        with pytest.raises(ValueError, match=f"cannot run {what}.*Invalid communication backend: CPU"):
            make_trainer(cfg, "m", x, y)
    cnn = ModelSpec("cnn", (1, 8, 8), 4, hidden=4)
    cfg = CollabConfig(centers=(CenterSpec("m", framework="mindspore", devices=2),), model=cnn)
    with pytest.raises(ValueError, match="cross-rank BatchNorm is not implemented"):
        make_trainer(cfg, "m", np.zeros((32, 1, 8, 8), np.float32), np.zeros(32, np.int64))
    cfg = CollabConfig(centers=(CenterSpec("m", framework="mindspore", devices=3),), model=SPEC, batch_size=16)
    with pytest.raises(ValueError, match="does not split evenly over 3 MindSpore ranks"):
        make_trainer(cfg, "m", x, y)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_center_equals_one_mindspore_process_and_a_torch_dp2_center():
    x, y = _digits()
    g = torch_state(build_torch_model(SPEC, 0))
    kw = dict(batch_size=32, lr=0.1, momentum=0.9, seed=0)
    one, m1 = ForeignTrainer(SPEC, x, y, framework="mindspore", **kw).train(g, steps=4, round_idx=1,
                                                                               proximal_mu=0.01)
    cfg = CollabConfig(centers=(CenterSpec("m", framework="mindspore", devices=2),), model=SPEC, **kw)
    ms_dp = make_trainer(cfg, "m", x, y)
    try:
        two, m2 = ms_dp.train(g, steps=4, round_idx=1, proximal_mu=0.01)
        again, _ = ms_dp.train(two, steps=4, round_idx=2)  # the ranks serve a second round
    finally:
        ms_dp.close()
    assert ms_dp._proc.poll() is not None  # msrun and its ranks are gone
    with DataParallelTrainer(SPEC, x, y, devices=2, **kw) as torch_dp:
        tdp, mt = torch_dp.train(g, steps=4, round_idx=1, proximal_mu=0.01)
    assert _rel(two, one) <= 1e-5 and abs(m2["train_loss"] - m1["train_loss"]) < 1e-6
    assert _rel(tdp, two) <= 1e-4 and abs(mt["train_loss"] - m2["train_loss"]) < 1e-5  # across frameworks
    assert max(float(np.abs(two[k] - g[k]).max()) for k in g) > 1e3 * _rel(two, one) * max(
        float(np.abs(g[k]).max()) for k in g)
    assert _rel(again, two) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_federation_with_a_mindspore_dp2_center_equals_its_one_process_federation():
    x, y = _digits(256)
    data = {"t": (x[:128], y[:128]), "m": (x[128:], y[128:])}

    def cfg(devices: int) -> CollabConfig:
        return CollabConfig(centers=(CenterSpec("t"), CenterSpec("m", framework="mindspore", devices=devices)),
                            model=SPEC, rounds=2, local_steps=3, batch_size=32, lr=0.1, fusion="fedavg")

    ref = run_inprocess(cfg(1), data)
    got = run_inprocess(cfg(2), data)
    assert [r.accepted for r in got.rounds] == [("t", "m"), ("t", "m")]
    assert _rel(got.params, ref.params) <= 1e-5
    assert _rel(got.params, initial_params(cfg(1))) > 1e-2


def test_scaled_plan_shrinks_dp_and_keeps_model_parallel_degrees():
    from polyparallel.backends.collab._center_plan import scaled_plan

    assert scaled_plan({"dp": 32}, 32, 2) == (2, {"dp": 2})
    assert scaled_plan({"dp": 4, "tp": 2, "zero_stage": 3}, 8, 4) == (4, {"dp": 2, "tp": 2, "zero_stage": 3})
    assert scaled_plan({"dp": 8, "zero_stage": 1}, 8, 1) == (1, {"dp": 1, "zero_stage": 0})
    assert scaled_plan({"dp": 2}, 2, 4) == (2, {"dp": 2})
    with pytest.raises(ValueError, match="tp·pp·sp = 4 needs more than 2"):
        scaled_plan({"tp": 4, "dp": 2}, 8, 2, "x")


def test_collab_strategy_with_a_32_device_mindspore_center_scales_to_this_machine(tmp_path):
    """The five-center preset's plan for ResNet-50 gives Shenzhen (MindSpore) 32 devices, dp=32; scaled
    to 2 devices per center the job is data parallelism over 2 ranks everywhere (the run itself:
    docs/mindspore.md)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from polyparallel.strategy import CenterPlan, Collaborative, Mesh, MeshAxis, ModelInfo, Strategy

    centers = [CenterPlan(name="bj", framework="torch", devices=list(range(16)), share=0.3,
                          local_strategy={"dp": 16}),
               CenterPlan(name="sz", framework="mindspore", devices=list(range(16, 48)), share=0.7,
                          local_strategy={"dp": 32, "tp": 1, "pp": 1, "sp": 1, "microbatches": 1, "zero_stage": 0,
                                          "placements": "torch", "step_time_s": 0.05})]
    s = Strategy(model=ModelInfo(name="m", fingerprint="0" * 24), mode="collaborative",
                 mesh=Mesh(axes=[MeshAxis(name="center", size=2, level="inter_center")], devices=[0, 16]),
                 collaborative=Collaborative(centers=centers, local_steps=5))
    path = tmp_path / "five.json"
    s.to_json(path)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "polyparallel", "collab", "--strategy", str(path), "--scale-devices",
                        "2", "--save-config", str(tmp_path / "job.json")], capture_output=True, text=True, cwd=root,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "center sz (mindspore): 32 devices -> 2 (dp=2)" in r.stdout
    job = json.loads((tmp_path / "job.json").read_text())
    assert [(c["name"], c["framework"], c["devices"], dict(c["plan"])["dp"]) for c in job["centers"]] == [
        ("bj", "torch", 2, 2), ("sz", "mindspore", 2, 2)]
