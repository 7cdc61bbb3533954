"""Buffered asynchronous rounds over Flower's lean data channel (issue 39), and the emulated slower
site (``CenterSpec.slowdown``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest


def _job(**kw):
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec

    rng = np.random.default_rng(4)
    names = ["a", "b", "c"]
    cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=ModelSpec("mlp", (16,), 4, hidden=8),
                       rounds=3, local_steps=3, batch_size=8, lr=0.1, momentum=0.5, fusion="fedavg",
                       round_timeout_s=120, **kw)
    return cfg, {n: (rng.normal(size=(40, 16)).astype(np.float32), rng.integers(0, 4, 40)) for n in names}


def test_slowdown_is_checked_and_left_out_of_the_job_at_one():
    from polyparallel.backends.collab import CenterSpec, CollabConfig
    from polyparallel.backends.collab._buffered import SlowTrainer
    from polyparallel.backends.collab._trainers import make_trainer

    with pytest.raises(ValueError, match="slowdown must be a finite number >= 1"):
        CenterSpec("a", slowdown=0.5)
    cfg, data = _job()
    assert "slowdown" not in cfg.to_json()
    slow = dataclasses.replace(cfg, centers=(*cfg.centers[:2], CenterSpec("c", slowdown=3.0)))
    assert CollabConfig.from_json(slow.to_json()) == slow
    assert isinstance(make_trainer(slow, "c", *data["c"]), SlowTrainer)
    assert not isinstance(make_trainer(slow, "a", *data["a"]), SlowTrainer)


def test_buffered_rounds_over_flower_messages_are_refused(tmp_path):
    from polyparallel.backends.collab._flower import run_flower

    cfg, data = _job(buffer=2)
    with pytest.raises(ValueError, match="data_channel='socket'"):
        run_flower(cfg, data, workdir=tmp_path)
    with pytest.raises(ValueError, match="holdout=0"):
        run_flower(dataclasses.replace(cfg, holdout=0.25), data, workdir=tmp_path, data_channel="socket")


@pytest.mark.slow
def test_buffered_rounds_over_the_data_channel(tmp_path):
    """A buffer of every center over the channel is the synchronous run bit for bit (every fusion takes
    one update of each center, all trained from the newest version); a buffer of 2 fuses as updates come,
    each fused update recorded with the version it was trained from and weighted by its staleness."""
    from polyparallel.backends.collab import run_inprocess
    from polyparallel.backends.collab._flower import run_flower

    cfg, data = _job(buffer=3)
    res = run_flower(cfg, data, workdir=tmp_path / "k3", data_channel="socket", timeout_s=240)
    ref = run_inprocess(dataclasses.replace(cfg, buffer=0), data)
    for k in ref.params:
        np.testing.assert_array_equal(res.params[k], ref.params[k])
    res2 = run_flower(dataclasses.replace(cfg, buffer=2, rounds=6), data, workdir=tmp_path / "k2",
                      data_channel="socket", timeout_s=240)
    assert len(res2.rounds) == 6 and all(len(r.accepted) == 2 for r in res2.rounds)
    fused = [m for r in res2.rounds for m in r.metrics.values()]
    assert all(m["staleness_weight"] == pytest.approx((1 + m["staleness"]) ** -0.5) for m in fused)
    assert all(m["trained_on"] + m["staleness"] == r.round for r in res2.rounds for m in r.metrics.values())
