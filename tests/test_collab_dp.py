"""Data parallelism inside a center: DDP over 2 gloo processes vs the same center in one process.

The reference is the single-process :class:`TorchTrainer` with the same global batch: same batches,
same SGD, so the local models must agree to float32 rounding (rel ≤ 1e-5) while the update itself is
many orders of magnitude larger than that tolerance (checked, so a wrong shard or an unsynchronised
BatchNorm would fail). Each test starts its worker processes once (spawn + torch import, a few seconds).
"""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab import (
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    initial_params,
    make_trainer,
    run_inprocess,
)
from polyparallel.backends.collab._dp_center import DataParallelTrainer


def _rel(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


def _update_size(new: dict, old: dict) -> float:
    return max(float(np.abs(new[k] - old[k]).max()) for k in old)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_process_center_equals_one_process_cnn_with_batchnorm_fedprox_and_momentum():
    """Two rounds on the same long-lived workers; BatchNorm statistics come from the global batch."""
    spec = ModelSpec("cnn", (1, 8, 8), 3, hidden=4)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 1, 8, 8)).astype(np.float32), rng.choice(3, 64, p=[0.6, 0.3, 0.1])
    p0 = initial_params(CollabConfig(centers=(CenterSpec("a"),), model=spec))
    # label-skewed data with the logit-adjusted loss: each rank must use the whole center's label prior
    kw = dict(batch_size=16, lr=0.1, momentum=0.9, seed=0, center_index=1, lr_schedule="cosine", rounds=4,
              logit_adjust=1.0)
    one = TorchTrainer(spec, x, y, **kw)
    with DataParallelTrainer(spec, x, y, devices=2, **kw) as dp:
        ref, got = p0, p0
        for r in (1, 2):
            ref, m_ref = one.train(ref, steps=5, round_idx=r, proximal_mu=0.01)
            got, m_dp = dp.train(got, steps=5, round_idx=r, proximal_mu=0.01)
            assert _rel(got, ref) <= 1e-5, f"round {r}"
            assert m_dp["train_loss"] == pytest.approx(m_ref["train_loss"], rel=1e-5)
    assert _update_size(ref, p0) > 1e-2  # the tolerance is 1000x below what training changed
    assert _update_size(ref, p0) > 1e3 * _rel(got, ref)
    for k in ("bn1.running_mean", "bn1.running_var", "bn2.running_var"):
        assert not np.allclose(ref[k], p0[k])  # statistics were updated, and agree (checked above)


def test_data_parallel_center_refuses_bad_settings_before_starting_workers():
    spec = ModelSpec("mlp", (4,), 2, hidden=4)
    x, y = np.zeros((40, 4), np.float32), np.zeros(40, np.int64)
    with pytest.raises(ValueError, match="does not split evenly over 3 devices"):
        DataParallelTrainer(spec, x, y, batch_size=16, devices=3)
    with pytest.raises(ValueError, match="devices >= 2"):
        DataParallelTrainer(spec, x, y, batch_size=16, devices=1)
    cfg = CollabConfig(centers=(CenterSpec("m", framework="paddle", devices=2),), model=spec)
    with pytest.raises(ValueError, match="PaddlePaddle centers train in one process"):
        make_trainer(cfg, "m", x, y)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inprocess_federation_with_a_two_device_center_matches_the_one_process_federation():
    spec = ModelSpec("mlp", (6,), 3, hidden=8)
    rng = np.random.default_rng(1)
    data = {c: (rng.normal(size=(48, 6)).astype(np.float32), rng.integers(0, 3, 48)) for c in "ab"}

    def cfg(devices: int) -> CollabConfig:
        return CollabConfig(centers=(CenterSpec("a", devices=devices), CenterSpec("b")), model=spec, rounds=2,
                            local_steps=4, batch_size=16, lr=0.1, fusion="diloco")

    ref = run_inprocess(cfg(1), data)
    got = run_inprocess(cfg(2), data)
    assert [r.accepted for r in got.rounds] == [("a", "b"), ("a", "b")]
    assert _rel(got.params, ref.params) <= 1e-5
    assert _update_size(ref.params, initial_params(cfg(1))) > 1e3 * _rel(got.params, ref.params)
