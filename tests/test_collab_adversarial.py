"""Poisoned updates: one malicious center of 3 and of 5 cannot ruin the fused model.

The federation of ``benchmarks/collab_attacks.py`` (scikit-learn digits, IID over the centers, an MLP,
8 rounds, a round fuses with one center refused) under the default fusion (centered clipping) and the
server's default validation. For every attack the final accuracy stays within 1 point of the run
without the attacker (its center left out), the honest centers are never refused, and the malicious
replies are refused exactly when the validation should refuse them (finite poison of abnormal size,
lies about the sample count, replays) and accepted otherwise (sign flipping, flipped labels: ordinary
size, the fusion bounds their pull or, by its consensus filter, leaves them out; flipped labels may meet
the norm bound in a round or two once left out). Then the server-side pieces one by one, and one attack over Flower.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.collab_attacks import run_case
from polyparallel.backends.collab import (
    CenteredClip,
    CenterReply,
    CenterUpdate,
    FedAvg,
    FederationServer,
    MultiKrum,
    run_inprocess,
)
from polyparallel.backends.collab._fusion import FUSIONS
from polyparallel.backends.collab._validation import bound_metrics, check_values
from polyparallel.backends.collab._wire import decode_update, encode_update
from tests.collab_fixtures import mlp_config, random_data

ROUNDS = 8
#: attack -> (refused in rounds, words of the reason); None: accepted every round (the fusion copes)
EXPECTED = {
    "huge": (range(1, ROUNDS + 1), "max_abs_update"),
    "scaled": (range(1, ROUNDS + 1), "update norm"),
    "int8_scale": (range(1, ROUNDS + 1), "has scale 3e+38"),
    "samples_declared": (range(1, ROUNDS + 1), "claims 1000000000 samples, enrolled with"),
    "replay": (range(2, ROUNDS + 1), "replayed"),
    # round, digest and binding forged under this round's nonce: the bytes were seen for the round-1 model
    "replay_forged": (range(2, ROUNDS + 1), "byte-identical"),
    "samples": None,
    "sign_flip": None,
    "label_flip": None,
}


@functools.cache
def _run(attack: str, n: int) -> dict:
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    try:
        return run_case(attack, "centered_clip", n)
    finally:
        logging.getLogger("polyparallel.collab").setLevel(logging.NOTSET)


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("attack", sorted(EXPECTED))
def test_one_malicious_center_does_not_ruin_the_model(attack, n):
    got, without = _run(attack, n), _run("absent", n)
    assert got["ok"] and got["fused_rounds"] == ROUNDS
    assert got["honest_rejected"] == 0, got
    assert got["accuracy"] >= without["accuracy"] - 1.0, (got, without, _run("none", n))
    exp = EXPECTED[attack]
    if attack == "label_flip":  # an update of ordinary size; left out by the default's consensus filter, the
        # trajectory then lets the norm bound refuse it in a round or two
        assert got["bad_accepted"] + got["bad_rejected"] == ROUNDS and got["bad_rejected"] <= 2, got
        assert all("update norm" in r for r in got["reasons"]), got["reasons"]
    elif exp is None:
        assert (got["bad_accepted"], got["bad_rejected"]) == (ROUNDS, 0), got
    else:
        rounds, words = exp
        assert (got["bad_accepted"], got["bad_rejected"]) == (ROUNDS - len(rounds), len(rounds)), got
        assert any(words in r for r in got["reasons"]), got["reasons"]


@pytest.mark.parametrize("fusion", sorted(FUSIONS))
def test_a_forged_replay_is_refused_whatever_the_fusion(fusion):
    """The round-1 update re-sent with this round's metrics bound under this round's nonce (what the
    malicious center itself can compute): refused from round 2 on under every fusion, honest centers never."""
    got = run_case("replay_forged", fusion, 3, rounds=3)
    assert (got["bad_accepted"], got["bad_rejected"], got["honest_rejected"]) == (1, 2, 0), got
    assert any("byte-identical" in r for r in got["reasons"]), got["reasons"]


def test_an_old_update_under_this_rounds_metrics_is_refused_by_its_binding():
    """A reply whose payload was swapped for another (its metrics, binding included, left as the center
    computed them) fails the binding check; one bound under another nonce fails it too."""
    cfg = mlp_config(NAMES, fusion="fedavg", min_centers=2, rounds=1)
    server = FederationServer(cfg, _initial(cfg))
    r, x = server.begin_round()
    reps = _replies(server, r, {c: _honest(x, i) for i, c in enumerate(NAMES)})
    reps[1] = CenterReply("b", encode_update(_honest(x, 99)), reps[1].metrics)  # another update, old metrics
    other = bound_metrics(server.nonce(r) ^ 1, r, server.model_digest(r), reps[2].payload)
    reps[2] = CenterReply("c", reps[2].payload, {"num_samples": 40.0, **other})
    unbound = CenterReply("a", reps[0].payload, {"num_samples": 40.0, "round": r,
                                                 "model_digest": server.model_digest(r)})
    rec = server.finish_round(r, [unbound, *reps[1:]])
    assert rec.accepted == () and not rec.fused
    assert "binding does not match" in rec.rejected["b"][0] and "binding does not match" in rec.rejected["c"][0]
    assert "carries no binding" in rec.rejected["a"][0]


def test_replayed_bytes_are_refused_across_a_restart_and_identical_bytes_for_the_same_model_are_not(tmp_path):
    cfg = mlp_config(NAMES, fusion="fedavg", min_centers=2, rounds=4)
    first = FederationServer(cfg, _initial(cfg), checkpoint_dir=tmp_path)
    r, x = first.begin_round()
    deltas = {c: _honest(x, i) for i, c in enumerate(NAMES)}
    old = encode_update(deltas["c"])
    rec = first.finish_round(r, _replies(first, r, deltas))
    assert rec.fused and rec.accepted == NAMES
    again = FederationServer(cfg, _initial(cfg), checkpoint_dir=tmp_path)
    assert again.resume() and again.guard.seen == first.guard.seen and len(again.guard.seen) == 3
    r, x = again.begin_round()
    reps = _replies(again, r, {c: _honest(x, 10 + i) for i, c in enumerate(NAMES[:2])})
    zero = {k: np.zeros_like(v) for k, v in x.items()}
    rec = again.finish_round(r, [*reps, _bound(again, r, "c", old)])
    assert rec.accepted == ("a", "b") and "byte-identical to the one c sent in round 1" in rec.rejected["c"][0]
    # an all-zero update is the same bytes for every model, and no replay; so is c's update copied by b
    r, x = again.begin_round()
    rec = again.finish_round(r, [_bound(again, r, "a", encode_update(zero)), _bound(again, r, "c", encode_update(zero)),
                                 _bound(again, r, "b", old)])
    assert rec.accepted == ("a", "c") and "byte-identical to the one c sent in round 1" in rec.rejected["b"][0]
    # the same bytes again for the same model (a round that did not fuse, re-run): not a replay
    r, x = again.begin_round()
    mine = encode_update(_honest(x, 7))
    assert not again.finish_round(r, [_bound(again, r, "a", mine)]).fused  # 1 valid < min_centers 2
    r, _ = again.begin_round()
    rec = again.finish_round(r, [_bound(again, r, "a", mine), *_replies(again, r, {"b": _honest(x, 8)})])
    assert rec.fused and rec.accepted == ("a", "b")


def test_the_attacker_free_runs_learn():
    for n in (3, 5):
        assert _run("none", n)["accuracy"] > 90 and _run("absent", n)["accuracy"] > 90


# ---------------------------------------------------------------------------------------- the pieces
NAMES = ("a", "b", "c")


def _replies(server: FederationServer, r: int, deltas: dict[str, dict[str, np.ndarray]], method: str = "none",
             samples: dict[str, float] | None = None) -> list[CenterReply]:
    return [_bound(server, r, c, encode_update(d, method), (samples or {}).get(c, 40.0)) for c, d in deltas.items()]


def _bound(server: FederationServer, r: int, center: str, payload: dict[str, np.ndarray],
           samples: float = 40.0) -> CenterReply:
    """A reply bound to round ``r``'s nonce, as a center computes it."""
    return CenterReply(center, payload, {"num_samples": samples,
                                         **bound_metrics(server.nonce(r), r, server.model_digest(r), payload)})


def _honest(params, seed: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}


def test_an_int8_scale_of_3e38_is_refused_before_decoding():
    delta = {"w": np.ones((2, 3), np.float32)}
    payload = encode_update(delta, "int8")
    payload["s/w"] = np.full(2, 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(decode_update(payload, "int8")["w"]).all()  # what decoding it would have given
    problems = check_values(payload, "int8", 1e4)
    assert problems and "scale 3e+38" in problems[0]
    payload["s/w"] = np.array([0.0, 1.0], np.float32)
    assert "not > 0" in check_values(payload, "int8", 1e4)[0]


def test_a_ruined_fusion_is_not_taken_and_the_honest_are_not_refused_after_it(caplog):
    """With the norm bound off, FedAvg of a finite 1e20 update would ruin the model; the fused-model
    check keeps the old one, and the next round judges the honest centers against that sound model."""
    cfg = mlp_config(NAMES, fusion="fedavg", norm_bound=0, max_abs_update=1e30, rounds=2)
    server = FederationServer(cfg, {k: np.asarray(v) for k, v in _initial(cfg).items()})
    r, x0 = server.begin_round()
    x0 = {k: v.copy() for k, v in x0.items()}
    deltas = {c: _honest(x0, i) for i, c in enumerate(NAMES)}
    deltas["c"] = {k: np.full_like(v, 1e20) for k, v in x0.items()}
    with caplog.at_level(logging.WARNING, "polyparallel.collab"):
        rec = server.finish_round(r, _replies(server, r, deltas))
    assert not rec.fused and rec.accepted == NAMES
    assert "the fused model was refused" in caplog.text and "fused step" in caplog.text
    for k in x0:
        np.testing.assert_array_equal(server.params[k], x0[k])
    assert any(e["event"] == "fusion_refused" and "fused step" in e["reason"] for e in server.timing.events)
    r, _ = server.begin_round()
    rec = server.finish_round(r, _replies(server, r, {c: _honest(x0, 10 + i) for i, c in enumerate(NAMES)}))
    assert rec.fused and rec.accepted == NAMES and not rec.rejected


def test_a_huge_scaffold_control_variate_is_refused():
    """One huge c_i would enter the server's c and so every center's gradient correction."""
    from polyparallel.backends.collab._wire import encode_controls

    cfg = mlp_config(NAMES, fusion="scaffold", min_centers=2, rounds=1, compression="int8")
    server = FederationServer(cfg, _initial(cfg))
    r, x = server.begin_round()
    reps = []
    for i, c in enumerate(NAMES):
        grad = {k: np.full_like(v, 1e6 if c == "c" else 0.1) for k, v in server.control().items()}
        reps.append(_bound(server, r, c, {**encode_update(_honest(x, i), "int8"), **encode_controls(grad, "int8")}))
    rec = server.finish_round(r, reps)
    assert rec.fused and rec.accepted == ("a", "b") and "'c/s/" in rec.rejected["c"][0]


def test_two_centers_the_history_bounds_an_inflated_norm():
    """Of two centers, the upper median of a round is the attacker's own norm: the accepted norms of
    earlier rounds bound it instead (a majority of one does not set the reference)."""
    cfg = mlp_config(("a", "b"), fusion="fedavg", min_centers=1, rounds=3)
    server = FederationServer(cfg, _initial(cfg))
    for r_expected, scale_b in ((1, 1.0), (2, 1.0), (3, 50.0)):
        r, x = server.begin_round()
        assert r == r_expected
        deltas = {"a": _honest(x, r), "b": {k: scale_b * v for k, v in _honest(x, 100 + r).items()}}
        rec = server.finish_round(r, _replies(server, r, deltas))
    assert rec.accepted == ("a",) and "update norm" in rec.rejected["b"][0]
    assert any(e["event"] == "rejected" and e["who"] == "b" and "update norm" in e["reason"]
               for e in server.timing.events)


def test_sample_counts_are_pinned_by_the_server():
    cfg = mlp_config(NAMES, fusion="fedavg", rounds=2)
    server = FederationServer(cfg, _initial(cfg))
    r, x = server.begin_round()
    rec = server.finish_round(r, _replies(server, r, {c: _honest(x, i) for i, c in enumerate(NAMES)},
                                          samples={"a": 40, "b": 60, "c": 1e9}))
    assert rec.metrics["c"]["num_samples"] == 120  # capped at 2 × the median claim, and said so
    assert [e["who"] for e in server.timing.events if e["event"] == "samples_capped"] == ["c"]
    r, x = server.begin_round()
    rec = server.finish_round(r, _replies(server, r, {c: _honest(x, 5 + i) for i, c in enumerate(NAMES)},
                                          samples={"a": 1e9, "b": 60, "c": 1e9}))
    assert [rec.metrics[c]["num_samples"] for c in NAMES] == [40, 60, 120]  # later claims change nothing


def test_pinned_counts_and_norm_history_survive_a_server_restart(tmp_path):
    cfg = mlp_config(NAMES, fusion="fedavg", rounds=3)
    first = FederationServer(cfg, _initial(cfg), checkpoint_dir=tmp_path)
    for _ in range(2):
        r, x = first.begin_round()
        first.finish_round(r, _replies(first, r, {c: _honest(x, r + i) for i, c in enumerate(NAMES)},
                                       samples={"c": 1e9}))
    again = FederationServer(cfg, _initial(cfg), checkpoint_dir=tmp_path)
    assert again.resume() and again.round == 2
    assert again.guard.pinned == first.guard.pinned == {"a": 40, "b": 40, "c": 80}
    assert again.guard.norms == first.guard.norms and again.guard.steps == first.guard.steps


def test_a_reply_for_another_round_or_model_is_refused():
    cfg = mlp_config(NAMES, fusion="fedavg", min_centers=2, rounds=1)
    server = FederationServer(cfg, _initial(cfg))
    r, x = server.begin_round()
    reps = _replies(server, r, {c: _honest(x, i) for i, c in enumerate(NAMES)})
    reps[1] = CenterReply("b", reps[1].payload, {"num_samples": 40.0, "round": 0})
    reps[2] = CenterReply("c", reps[2].payload, {"num_samples": 40.0, "model_digest": 12345.0})
    rec = server.finish_round(r, reps)
    assert rec.accepted == ("a",) and not rec.fused
    assert "round 0" in rec.rejected["b"][0] and "another global model" in rec.rejected["c"][0]


def test_a_run_in_which_no_round_fused_does_not_report_success():
    names = ("a", "b")
    res = run_inprocess(mlp_config(names, max_abs_update=1e-9), random_data(names, seed=0, grow=0))
    assert not res.ok and res.fused_rounds == 0
    assert "no round fused" in res.problem and "max_abs_update" in res.problem
    assert json.loads(json.dumps(res.to_dict()))["ok"] is False


def test_cli_validation_options_reach_the_job_and_a_run_with_no_fused_round_fails(tmp_path, capsys, caplog):
    from polyparallel.cli import main

    def run(argv):
        with pytest.raises(SystemExit) as e:
            main(argv)
        cap = capsys.readouterr()
        return e.value.code or 0, cap.out + cap.err

    job = tmp_path / "job.json"
    base = ["collab", "--centers", "a,b", "--rounds", "1", "--local-steps", "1", "--synthetic", "32"]
    code, _ = run([*base, "--no-norm-bound", "--step-bound", "20", "--max-abs-update", "100", "--samples", "32,32",
                   "--save-config", str(job)])
    d = json.loads(job.read_text())
    assert code == 0 and (d["norm_bound"], d["step_bound"], d["max_abs_update"]) == (0, 20, 100)
    assert d["fusion"] == "centered_clip" and [c["samples"] for c in d["centers"]] == [32, 32]
    with caplog.at_level(logging.WARNING, "polyparallel.collab"):
        code, out = run([*base, "--max-abs-update", "1e-9"])  # every update refused
    assert code != 0 and "no round fused" in out and "max_abs_update" in out
    assert "round 1: rejected the update of a" in caplog.text  # the log line the user sees on stderr


def test_robust_fusions_against_an_outlier():
    g = {"w": np.zeros(4, np.float32)}
    honest = [np.array([1.0, 1.0, 0.0, 0.0]) + 0.1 * i for i in range(4)]
    ups = [CenterUpdate(f"h{i}", {"w": h.astype(np.float32)}, 10) for i, h in enumerate(honest)]
    flip = CenterUpdate("bad", {"w": np.array([-5.0, -5.0, 0.0, 0.0], np.float32)}, 10)
    # agreeing updates: centered clipping is FedAvg; Krum drops the one farthest from the rest
    np.testing.assert_allclose(CenteredClip(tau=2).fuse(g, ups)["w"], FedAvg().fuse(g, ups)["w"], rtol=1e-6)
    assert "bad" not in [([*ups, flip])[i].center for i in MultiKrum(f=1).select(g, [*ups, flip])]
    np.testing.assert_allclose(MultiKrum(f=1).fuse(g, [*ups, flip])["w"], FedAvg().fuse(g, ups)["w"], rtol=1e-6)
    # the outlier's pull is at most tau × the median distance: the result stays near the honest mean
    mean = FedAvg().fuse(g, ups)["w"]
    out = CenteredClip().fuse(g, [*ups, flip])["w"]
    assert np.linalg.norm(out - mean) < 0.5 < np.linalg.norm(FedAvg().fuse(g, [*ups, flip])["w"] - mean)


def _initial(cfg):
    from polyparallel.backends.collab import initial_params

    return initial_params(cfg)


# ---------------------------------------------------------------------------------------- over Flower
def plain_mlp():
    """An MLP without normalisation: inputs × 100 give an update ~100 × larger (the Flower test's attack)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_scaled_update_is_refused_over_flower_with_an_audit_line(tmp_path, monkeypatch):
    """Center c trains on inputs ×100 (poisoned data: a scaled update); the ServerApp refuses it every
    round, the others fuse, and the refusal is a line of the server's log."""
    pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")
    from polyparallel.backends.collab import ModelSpec
    from polyparallel.backends.collab._flower import LoopbackFederation, run_flower

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    names = ("a", "b", "c")
    data = random_data(names, 48, seed=3, grow=4)
    data["c"] = (data["c"][0] * 100.0, data["c"][1])
    cfg = replace(mlp_config(names, min_centers=2), model=ModelSpec(f"{__name__}:plain_mlp"))
    res = run_flower(cfg, data, workdir=tmp_path, timeout_s=240)
    assert res.ok and [r.accepted for r in res.rounds] == [("a", "b"), ("a", "b")]
    assert all("update norm" in r.rejected["c"][0] for r in res.rounds)
    assert any(e["event"] == "rejected" and e["who"] == "c" for e in res.timing)
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "rejected the update of c: update norm" in logs
    assert LoopbackFederation(tmp_path, {}).stray_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fusion", ["flame", "foolsgold"])
def test_direction_fusions_fuse_over_flower_what_they_fuse_in_process(tmp_path, monkeypatch, fusion):
    """FLAME (seeded noise, clustering each round) and FoolsGold (each center's update history, kept
    across rounds by the server) with a relabelling center: the ServerApp fuses bit for bit what
    the in-process engine fuses, and gives the centers the same trust every round."""
    pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")
    from polyparallel.backends.collab._flower import LoopbackFederation, run_flower

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    names = ("a", "b", "c", "d")
    data = random_data(names, 48, seed=5, grow=0)
    data["d"] = (data["d"][0], (2 - data["d"][1]) % 3)  # relabelled: its update pulls the other way
    cfg = mlp_config(names, fusion=fusion, rounds=3, min_centers=3)
    res = run_flower(cfg, data, workdir=tmp_path, timeout_s=300)
    ref = run_inprocess(cfg, data)
    assert res.ok and [r.accepted for r in res.rounds] == [r.accepted for r in ref.rounds]
    for k in ref.params:
        np.testing.assert_array_equal(res.params[k], ref.params[k])
    trust = [{c: m.get("trust") for c, m in r.metrics.items()} for r in res.rounds]
    assert trust == [{c: m.get("trust") for c, m in r.metrics.items()} for r in ref.rounds]
    assert LoopbackFederation(tmp_path, {}).stray_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forged_replay_is_refused_over_flower_under_fedavg(tmp_path, monkeypatch):
    """Center c's ClientApp (tests/collab_replay_app.py) re-sends its round-1 update in rounds 2 and 3
    with each round's index, model digest and binding forged under that round's nonce: the ServerApp
    refuses it as a replay even under FedAvg, the honest centers fuse, and the model is the one the
    in-process engine fuses from the two honest updates alone in those rounds."""
    pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")
    from polyparallel.backends.collab._flower import LoopbackFederation, read_outputs, write_center_data

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    names = ("a", "b", "c")
    data = random_data(names, 48, seed=3, grow=4)
    cfg = mlp_config(names, fusion="fedavg", min_centers=2, rounds=3)
    out = tmp_path / "out"
    with LoopbackFederation(tmp_path, write_center_data(tmp_path, data)) as fed:
        fed.submit(cfg, out, client_app="tests.collab_replay_app:client_app")
        fed.wait(out, 240)
    res = read_outputs(out)
    assert [r.accepted for r in res.rounds] == [names, ("a", "b"), ("a", "b")]
    assert all("byte-identical to the one c sent in round 1" in r.rejected["c"][0] for r in res.rounds[1:])
    ref = run_inprocess(cfg, data, absent={2: ("c",), 3: ("c",)})
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    assert LoopbackFederation(tmp_path, {}).stray_pids() == []
