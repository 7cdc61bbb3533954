"""Online pruning over Flower (issue 35): the centers' scores travel in their replies, the plan in the
server's messages after the cut, and the pruned model, its masks and its release are the in-process
engine's, bit for bit."""

from __future__ import annotations

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
def test_pruning_over_flower_is_the_inprocess_pruning_bit_for_bit(tmp_path):
    """3 centers on digits, masks in rounds 1-2, the cut after round 2, one fine-tuning round; the
    centers evaluate each fused model on their held-out rows (``evaluate`` messages, which carry the
    plan after the cut as the ``train`` ones do)."""
    data, ev = _digits(rows=200)
    cfg: CollabConfig = _config(rounds=3, local_steps=6, holdout=0.2, round_timeout_s=120,
                                prune=PruneSpec(0.5, rounds=2, score="fisher", score_batches=2))
    res = run_flower(cfg, data, workdir=tmp_path / "flwr", timeout_s=240)
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
