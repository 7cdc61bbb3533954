"""Centered clipping's consensus filter (``min_cos``, ``ref``) and the per-layer norm check (``layer_bound``).

The fused numbers are checked against a plain, loop-by-loop centered clipping written here from the
paper's update rule; the layer ratios against hand-computed norms; one in-process run checks that a
sign flipper is left out by the filter and named in the audit's summary.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from benchmarks.collab_attacks import tampers
from polyparallel.backends.collab import CenterReply, CenterUpdate, CollabConfig, FederationServer, run_inprocess
from polyparallel.backends.collab._fusion import CenteredClip
from polyparallel.backends.collab._validation import bound_metrics, layer_screen
from polyparallel.backends.collab._wire import encode_update
from tests.collab_fixtures import mlp_config, random_data

X = {"w": np.zeros(3), "bn.running_mean": np.zeros(1)}


def _upd(c: str, w, rm, n: int = 10) -> CenterUpdate:
    return CenterUpdate(c, {"w": np.array(w, float), "bn.running_mean": np.array([rm], float)}, n)


def _plain_clip(rows: list[np.ndarray], weights: list[float], tau: float = 1.0, iters: int = 3) -> np.ndarray:
    """Centered clipping, one update at a time: v0 the coordinate-wise median, τ = tau × the median
    distance to v0, then v ← v + Σ p_i (δ_i − v) min(1, τ / ‖δ_i − v‖)."""
    p = [w / sum(weights) for w in weights]
    v = np.array([sorted(col)[len(col) // 2] if len(col) % 2 else np.mean(sorted(col)[len(col) // 2 - 1:
                  len(col) // 2 + 1]) for col in zip(*rows)])
    dist = sorted(float(np.sqrt(sum((a - b) ** 2 for a, b in zip(r, v)))) for r in rows)
    m = len(dist)
    radius = tau * (dist[m // 2] if m % 2 else (dist[m // 2 - 1] + dist[m // 2]) / 2)
    for _ in range(iters):
        step = np.zeros_like(v)
        for pi, r in zip(p, rows):
            z = r - v
            n = float(np.sqrt(np.sum(z * z)))
            step += pi * z * (min(1.0, radius / n) if n > 0 else 1.0)
        v = v + step
    return v


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


UPS = [_upd("a", [1.0, 0.2, 0.0], 1.0, 10), _upd("b", [0.8, 0.0, 0.3], 2.0, 30), _upd("c", [-3.0, -0.1, 0.0], 9.0)]
ROWS = [np.array([*u.params["w"], *u.params["bn.running_mean"]]) for u in UPS]


def test_centered_clip_without_the_filter_is_plain_centered_clipping():
    f = CenteredClip(min_cos=-1)
    got = f.fuse(X, UPS)
    want = _plain_clip(ROWS, [10, 30, 10])
    np.testing.assert_allclose(np.r_[got["w"], got["bn.running_mean"]], want, rtol=1e-12, atol=1e-15)
    assert f.scores == {} and f.options() == {"tau": 1.0, "iters": 3} and f.state() == {}
    assert CenteredClip().options() == {"tau": 1.0, "iters": 3, "min_cos": 0.0, "ref": 1}  # the default filters


def test_the_filter_needs_three_updates():
    two = CenteredClip().fuse(X, UPS[1:])
    want = _plain_clip(ROWS[1:], [30, 10])
    np.testing.assert_allclose(np.r_[two["w"], two["bn.running_mean"]], want, rtol=1e-12, atol=1e-15)


def test_the_filter_leaves_out_an_update_against_the_consensus_and_fuses_the_rest_again():
    f = CenteredClip(min_cos=0.0, ref=0)
    got = f.fuse(X, UPS)
    v = _plain_clip(ROWS, [10, 30, 10])
    cos = {u.center: _cos(u.params["w"], v[:3]) for u in UPS}  # over the trained tensor only
    assert cos["c"] < 0 < min(cos["a"], cos["b"])
    assert {c: s["cos_consensus"] for c, s in f.scores.items()} == pytest.approx(cos, rel=1e-12)
    assert {c: s["trust"] for c, s in f.scores.items()} == {"a": 1.0, "b": 1.0, "c": 0.0}
    want = _plain_clip(ROWS[:2], [10, 30])  # the fusion of a and b alone, statistics included
    np.testing.assert_allclose(np.r_[got["w"], got["bn.running_mean"]], want, rtol=1e-12, atol=1e-15)


def test_ref_1_judges_by_the_last_fused_step_and_ref_2_by_both_and_the_step_is_checkpointed():
    first = [_upd("a", [1.0, 0.0, 0.0], 0.0), _upd("b", [1.0, 0.1, 0.0], 0.0), _upd("c", [0.9, 0.0, 0.1], 0.0)]
    # round 2: everyone moved to +y; d also agrees with this round's result, but not with the last step
    second = [_upd("a", [0.0, 1.0, 0.0], 0.0), _upd("b", [0.1, 1.0, 0.0], 0.0), _upd("c", [-0.6, 1.0, 0.0], 0.0)]
    f1, f2, f0 = CenteredClip(min_cos=0.0, ref=1), CenteredClip(min_cos=0.0, ref=2), CenteredClip(min_cos=0.0, ref=0)
    for f in (f1, f2, f0):
        f.fuse(X, first)
    last = _plain_clip([np.r_[u.params["w"], u.params["bn.running_mean"]] for u in first], [10, 10, 10])
    np.testing.assert_allclose(f1.state()["last"], last, rtol=1e-12)
    restored = CenteredClip(min_cos=0.0, ref=1)
    restored.load_state(f1.state())
    for f in (f1, f2, f0, restored):
        f.fuse(X, second)
    now = _plain_clip([np.r_[u.params["w"], u.params["bn.running_mean"]] for u in second], [10, 10, 10])
    c_last, c_now = _cos(second[2].params["w"], last[:3]), _cos(second[2].params["w"], now[:3])
    assert c_last < 0 < c_now
    assert f1.scores["c"] == {"cos_consensus": pytest.approx(c_last, rel=1e-12), "trust": 0.0}
    assert f2.scores["c"]["cos_consensus"] == pytest.approx(min(c_last, c_now), rel=1e-12)
    assert f0.scores["c"] == {"cos_consensus": pytest.approx(c_now, rel=1e-12), "trust": 1.0}
    assert restored.scores == f1.scores
    with pytest.raises(ValueError, match="min_cos"):
        CenteredClip(min_cos=1.0)
    with pytest.raises(ValueError, match="ref is 0"):
        CenteredClip(ref=3)


def test_layer_ratios_against_hand_computed_norms():
    deltas = {"a": {"w": np.array([3.0, 4.0]), "b": np.array([0.1])},   # ‖w‖ 5
              "b": {"w": np.array([0.0, 1.0]), "b": np.array([0.4])},   # ‖w‖ 1
              "c": {"w": np.array([0.0, 2.0]), "b": np.array([0.2])}}   # ‖w‖ 2
    # upper medians: w of [5, 1, 2] -> 2, b of [0.1, 0.4, 0.2] -> 0.2
    ratios, refused = layer_screen(deltas, ["w", "b"], 0.0)
    assert ratios == pytest.approx({"a": 2.5, "b": 2.0, "c": 1.0}) and refused == {}
    ratios, refused = layer_screen(deltas, ["w", "b"], 2.2)
    assert set(refused) == {"a"} and "tensor 'w'" in refused["a"] and "layer_bound" in refused["a"]
    assert layer_screen({"a": deltas["a"]}, ["w"], 2.0) == ({}, {})


def test_the_server_records_layer_ratios_refuses_a_boosted_layer_and_the_job_file_keeps_the_bound():
    cfg = mlp_config(("a", "b", "c"), fusion="fedavg", min_centers=2, rounds=1, layer_bound=3.0)
    x0 = {"fc1.weight": np.ones((2, 3), np.float32), "fc1.bias": np.zeros(2, np.float32)}
    server = FederationServer(cfg, x0)
    r, x = server.begin_round()
    rng = np.random.default_rng(0)
    deltas = {c: {k: (0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in x.items()} for c in "abc"}
    deltas["c"]["fc1.bias"] = np.full(2, 0.05, np.float32)  # one tensor boosted, the whole norm still ordinary
    reps = [CenterReply(c, p, {"num_samples": 40.0, **bound_metrics(server.nonce(r), r, server.model_digest(r), p)})
            for c, p in ((c, encode_update(d)) for c, d in deltas.items())]
    rec = server.finish_round(r, reps)
    assert rec.accepted == ("a", "b") and "layer_bound" in rec.rejected["c"][0]
    norms = {c: {k: float(np.linalg.norm(d[k].astype(np.float64))) for k in x} for c, d in deltas.items()}
    ref = {k: sorted(n[k] for n in norms.values())[1] for k in x}
    for c in "ab":
        assert rec.metrics[c]["layer_ratio"] == pytest.approx(max(norms[c][k] / ref[k] for k in x), rel=1e-6)
    assert json.loads(cfg.to_json())["layer_bound"] == 3.0 and CollabConfig.from_json(cfg.to_json()) == cfg
    assert "layer_bound" not in json.loads(mlp_config(("a",)).to_json())  # off: the JSON of before
    with pytest.raises(ValueError, match="layer_bound must be 0"):
        mlp_config(("a",), layer_bound=0.5)


def test_a_sign_flipper_is_left_out_by_the_default_filter_and_named_in_the_summary():
    names = ("c0", "c1", "c2")
    cfg = mlp_config(names, min_centers=2, rounds=3)  # the default fusion: centered clipping, filtered
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    try:
        res = run_inprocess(cfg, random_data(names, seed=5, grow=0), tamper=tampers("sign_flip", "none"))
    finally:
        logging.getLogger("polyparallel.collab").setLevel(logging.NOTSET)
    assert res.fused_rounds == 3
    assert [r.metrics["c0"]["trust"] for r in res.rounds] == [0.0, 0.0, 0.0]
    assert all(r.metrics[c]["trust"] == 1.0 and r.metrics[c]["cos_consensus"] >= 0 for r in res.rounds
               for c in ("c1", "c2"))
    assert res.flagged()["c0"]["rounds"] == [1, 2, 3]
    assert "left its update out" in res.flagged()["c0"]["why"][0] and "c1" not in res.flagged()
