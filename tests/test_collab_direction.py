"""Defences that look at an update's direction: FLTrust against the server's root set, and the audit of
per-round, per-center check values (``cos_fused``, ``cos_root``, ``trust``) and the flagged centers.

The fused numbers are checked against a hand computation of the published formulas; the end-to-end
run checks that a sign-flipping center gets no trust under FLTrust and is named in the summary.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from benchmarks.collab_attacks import run_bn_case, tampers
from polyparallel.backends.collab import CenterReply, CenterUpdate, FederationServer, run_inprocess
from polyparallel.backends.collab._fusion import FLTrust, make_fusion
from polyparallel.backends.collab._validation import bound_metrics
from polyparallel.backends.collab._wire import encode_update
from tests.collab_fixtures import mlp_config, random_data

X = {"w": np.zeros(3), "bn.running_mean": np.zeros(2)}


def _upd(c: str, w, rm, n: int = 10) -> CenterUpdate:
    return CenterUpdate(c, {"w": np.array(w, float), "bn.running_mean": np.array(rm, float)}, n)


def test_fltrust_rescales_to_the_root_norm_and_weighs_by_positive_cosine():
    f = FLTrust()
    f.reference = {"w": np.array([2.0, 0.0, 0.0]), "bn.running_mean": np.array([9.0, 9.0])}  # stats: not compared
    new = f.fuse(X, [_upd("a", [4, 0, 0], [1, 1], 10), _upd("b", [1, 1, 0], [3, 3], 30), _upd("c", [-5, 0, 0], [7, 7])])
    # a: cos 1, rescaled to ‖g0‖ = 2 -> [2, 0, 0]; b: cos 1/√2, rescaled -> √2 [1, 1, 0]; c: cos -1, trust 0
    t = 1 / np.sqrt(2)
    want_w = (1.0 * np.array([2, 0, 0]) + t * np.sqrt(2) * np.array([1, 1, 0])) / (1 + t)
    np.testing.assert_allclose(new["w"], want_w, rtol=1e-12)
    # running statistics: trust × sample weight (10 and 30 of 50) mean of the centers' values; c counts 0
    wa, wb = 1.0 * 10 / 50, t * 30 / 50
    np.testing.assert_allclose(new["bn.running_mean"], (wa * 1 + wb * 3) / (wa + wb) * np.ones(2), rtol=1e-12)
    assert f.scores["c"] == {"cos_root": -1.0, "trust": 0.0}
    assert f.scores["b"]["trust"] == pytest.approx(t, rel=1e-12)


def test_fltrust_keeps_the_model_when_nobody_agrees_and_needs_a_root_set():
    f = FLTrust()
    f.reference = {"w": np.array([1.0, 0.0, 0.0]), "bn.running_mean": np.zeros(2)}
    new = f.fuse(X, [_upd("a", [-1, 0, 0], [5, 5]), _upd("b", [0, 2, 0], [5, 5])])
    assert all(np.array_equal(new[k], X[k]) for k in X)
    with pytest.raises(ValueError, match="needs the server's update on its root set"):
        FLTrust().fuse(X, [_upd("a", [1, 0, 0], [0, 0])])
    cfg = mlp_config(("a", "b"), fusion="fltrust")
    with pytest.raises(ValueError, match="needs a root set"):
        FederationServer(cfg, {"fc1.weight": np.zeros((2, 2), np.float32)})
    assert make_fusion("fltrust").needs_root and not make_fusion("fedavg").needs_root


def test_the_audit_records_the_cosine_of_each_update_to_the_fused_step():
    cfg = mlp_config(("a", "b", "c"), fusion="fedavg", min_centers=2, rounds=1)
    x0 = {"fc1.weight": np.ones((2, 3), np.float32), "fc1.bias": np.zeros(2, np.float32)}
    server = FederationServer(cfg, x0)
    r, x = server.begin_round()
    rng = np.random.default_rng(0)
    deltas = {c: {k: (0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in x.items()} for c in "ab"}
    deltas["c"] = {k: -0.5 * v for k, v in deltas["a"].items()}  # points against a, and so against the step
    reps = []
    for c, d in deltas.items():
        p = encode_update(d)
        reps.append(CenterReply(c, p, {"num_samples": 40.0, **bound_metrics(server.nonce(r), r,
                                                                             server.model_digest(r), p)}))
    rec = server.finish_round(r, reps)
    flat = {c: np.concatenate([d[k].astype(np.float64).ravel() for k in x]) for c, d in deltas.items()}
    step = sum(flat.values()) / 3  # equal counts: FedAvg's step
    for c, v in flat.items():
        want = v @ step / (np.linalg.norm(v) * np.linalg.norm(step))
        assert rec.metrics[c]["cos_fused"] == pytest.approx(want, abs=1e-6)
    assert rec.metrics["c"]["cos_fused"] < 0 < rec.metrics["a"]["cos_fused"]


def test_a_sign_flipper_gets_no_trust_under_fltrust_and_is_named_in_the_summary():
    names = ("c0", "c1", "c2")
    data = random_data(names, seed=5, grow=0)
    root = random_data(("root",), seed=6, grow=0)["root"]  # the server's own rows, no center's
    cfg = mlp_config(names, fusion="fltrust", min_centers=2, rounds=3)
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    try:
        res = run_inprocess(cfg, data, root_data=root, tamper=tampers("sign_flip", "none"))
    finally:
        logging.getLogger("polyparallel.collab").setLevel(logging.NOTSET)
    assert res.fused_rounds == 3
    for r in res.rounds:
        assert r.metrics["c0"]["trust"] == 0.0 and r.metrics["c0"]["cos_root"] < 0
        assert all(r.metrics[c]["trust"] > 0 for c in ("c1", "c2"))
    summary = json.loads(json.dumps(res.to_dict()))["flagged"]
    assert summary["c0"]["rounds"] == [1, 2, 3] and "no trust" in summary["c0"]["why"][0]
    assert "c1" not in summary and "c2" not in summary


def test_the_benchmark_backdoor_is_measured_on_triggered_rows_of_other_classes():
    """The attack-success number is the share of triggered non-target test rows put in the target
    class; an honest federation's is small, and the poisoned center's rows carry the trigger."""
    got = run_bn_case("none", "fedavg", 3, 0, rounds=2)
    assert 0.0 <= got["attack_success"] < 30.0 and got["accuracy"] > 50.0


def test_the_benchmark_records_every_center_without_changing_the_run():
    """``run_bn_case(record=...)`` (the CrowdGuard probe's input) wraps every center: the run is the same
    to the digit, and the recorded updates are the ones fused: under FedAvg the round-2 model is the
    round-1 model plus their sample-weighted mean, by hand."""
    rec: dict = {}
    plain = run_bn_case("backdoor", "fedavg", 3, 0, rounds=2)
    got = run_bn_case("backdoor", "fedavg", 3, 0, rounds=2, record=rec)
    assert sorted(rec) == ["c0", "c1", "c2"]
    assert (got["accuracy"], got["attack_success"], got["audit"]) == (
        plain["accuracy"], plain["attack_success"], plain["audit"])
    n = {c: t.num_samples for c, t in rec.items()}
    g1, g2 = rec["c1"].models[1], rec["c2"].models[2]
    for k in g1:
        want = g1[k] + sum(n[c] * rec[c].updates[1][k] for c in rec) / sum(n.values())
        np.testing.assert_allclose(g2[k], want, rtol=1e-5, atol=1e-6)


def test_the_direction_check_compares_each_update_to_the_median_of_the_others():
    from polyparallel.backends.collab._validation import direction_screen

    rng = np.random.default_rng(3)
    base = rng.normal(size=6)
    deltas = {c: {"w": base + 0.3 * rng.normal(size=6), "bn.running_mean": rng.normal(size=2)} for c in "abc"}
    deltas["d"] = {"w": -base, "bn.running_mean": np.zeros(2)}
    cos, refused = direction_screen(deltas, ["w"], 0.0)
    for c in deltas:  # by hand: the median of the other three, running statistics left out
        ref = np.median(np.stack([deltas[o]["w"] for o in deltas if o != c]), axis=0)
        assert cos[c] == pytest.approx(deltas[c]["w"] @ ref / np.linalg.norm(deltas[c]["w"]) / np.linalg.norm(ref))
    assert set(refused) == {"d"} and "cosine" in refused["d"] and "min_cosine" in refused["d"]
    assert direction_screen(deltas, ["w"], -1.0)[1] == {}  # off
    assert direction_screen({c: deltas[c] for c in "ad"}, ["w"], 0.0) == ({}, {})  # 2 updates: nothing to compare


def test_a_sign_flipper_is_refused_by_the_direction_check_and_the_check_is_in_the_audit():
    names = ("c0", "c1", "c2", "c3")
    data = random_data(names, seed=5, grow=0)
    cfg = mlp_config(names, fusion="centered_clip", min_centers=3, rounds=3, min_cosine=0.0)
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    try:
        res = run_inprocess(cfg, data, tamper=tampers("sign_flip", "none"))
    finally:
        logging.getLogger("polyparallel.collab").setLevel(logging.NOTSET)
    for r in res.rounds:
        assert r.fused and r.accepted == names[1:] and "points away from the others" in r.rejected["c0"][0]
        assert all(r.metrics[c]["cos_others"] > 0 for c in names[1:])
    assert res.flagged()["c0"]["rounds"] == [1, 2, 3]
    with pytest.raises(ValueError, match="min_cosine must be in"):
        mlp_config(names, min_cosine=1.0)


def test_per_layer_fltrust_takes_the_least_agreeing_layer():
    x = {"a.weight": np.zeros(2), "b.weight": np.zeros(2)}
    ref = {"a.weight": np.array([3.0, 0.0]), "b.weight": np.array([0.0, 1.0])}
    # cosine over everything (3·2 − 1·0.5)/(√10.25·√10) > 0, but layer b points away: no trust per layer
    bad = CenterUpdate("bad", {"a.weight": np.array([2.0, 0.0]), "b.weight": np.array([0.0, -0.5])}, 10)
    good = CenterUpdate("good", {"a.weight": np.array([1.0, 1.0]), "b.weight": np.array([0.0, 2.0])}, 10)
    whole, layered = FLTrust(), FLTrust(per_layer=1)
    for f in (whole, layered):
        f.reference = ref
        f.fuse(x, [bad, good])
    assert whole.scores["bad"]["trust"] == pytest.approx(5.5 / (np.sqrt(4.25) * np.sqrt(10)))
    assert layered.scores["bad"]["trust"] == 0.0
    # good: layer a cos 3/(√2·3) = 1/√2, layer b cos 1, overall (3 + 2)/(√6·√10) = 0.645: the least
    assert layered.scores["good"]["trust"] == pytest.approx(min(5 / np.sqrt(60), 1 / np.sqrt(2)))
    new = layered.fuse(x, [bad, good])  # only good counts, rescaled to ‖g0‖ = √10
    scale = np.sqrt(10) / np.sqrt(6)
    np.testing.assert_allclose(np.concatenate([new["a.weight"], new["b.weight"]]), scale * np.array([1, 1, 0, 2.0]))
    with pytest.raises(ValueError, match="per_layer is 0 or 1"):
        FLTrust(per_layer=2)


def test_with_a_root_set_a_sign_flipper_costs_the_batchnorm_federation_nothing():
    """The benchmark's label-skewed BatchNorm federation, one seed: FLTrust gives the flipper no trust
    in any round and stays within 1 point of the run without it (centered clipping fell to ~66%)."""
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    try:
        got, without = run_bn_case("sign_flip", "fltrust", 3, 0), run_bn_case("absent", "fltrust", 3, 0)
    finally:
        logging.getLogger("polyparallel.collab").setLevel(logging.NOTSET)
    assert all(r["c0"]["trust"] == 0.0 for r in got["audit"])
    assert got["accuracy"] >= without["accuracy"] - 1.0, (got["accuracy"], without["accuracy"])
