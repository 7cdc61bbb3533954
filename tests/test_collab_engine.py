"""The in-process engine: round logic, rejection of bad updates, timing lines, checkpoints, dropouts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyparallel.backends.collab import (
    CenterReply,
    CenterSpec,
    CollabConfig,
    FederationServer,
    ModelSpec,
    TorchTrainer,
    batch_indices,
    encode_update,
    initial_params,
    run_inprocess,
)
from polyparallel.backends.collab._validation import bound_metrics

SPEC = ModelSpec("mlp", (6,), 3, hidden=8)


def _data(names, n=48, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(6, 3))
    out = {}
    for i, c in enumerate(names):
        x = rng.normal(loc=0.3 * i, size=(n + 8 * i, 6)).astype(np.float32)
        out[c] = (x, (x @ w).argmax(1).astype(np.int64))
    return out


def _cfg(names=("a", "b", "c"), **kw):
    return CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=SPEC,
                        **{"rounds": 2, "local_steps": 4, "batch_size": 16, "lr": 0.1, **kw})


def test_fedavg_round_equals_hand_computed_local_sgd():
    """One round by the engine == each center's SGD run here by hand, averaged by sample count."""
    cfg = _cfg(rounds=1, fusion="fedavg")
    data = _data(["a", "b", "c"])
    res = run_inprocess(cfg, data)
    x0 = initial_params(cfg)
    locals_, counts = [], []
    for i, c in enumerate("abc"):
        t = TorchTrainer(SPEC, *data[c], center_index=i, batch_size=16, lr=0.1, seed=0)
        p, _ = t.train(x0, steps=4, round_idx=1, proximal_mu=0.0)
        locals_.append(p)
        counts.append(len(data[c][0]))
    for k in x0:
        expect = sum(n * p[k].astype(np.float64) for p, n in zip(locals_, counts)) / sum(counts)
        np.testing.assert_allclose(res.params[k], expect, rtol=1e-5, atol=1e-6)
    assert not np.allclose(res.params["fc1.weight"], x0["fc1.weight"])  # training did something


def test_batches_cover_epochs_without_repeats():
    idx = batch_indices(10, 4, 5, seed=1, center_index=2, round_idx=3)
    assert idx.shape == (5, 4)
    assert sorted(idx[:2].ravel()) == sorted(set(idx[:2].ravel()))  # first epoch: 8 distinct rows
    np.testing.assert_array_equal(idx, batch_indices(10, 4, 5, seed=1, center_index=2, round_idx=3))


def test_fedprox_pulls_centers_towards_the_global_model():
    data = _data(["a", "b"])
    x0 = initial_params(_cfg(("a", "b")))
    t = TorchTrainer(SPEC, *data["a"], batch_size=16, lr=0.1)
    free, _ = t.train(x0, steps=20, round_idx=1, proximal_mu=0.0)
    prox, _ = t.train(x0, steps=20, round_idx=1, proximal_mu=5.0)

    def dist(p):
        return sum(float(((p[k] - x0[k]) ** 2).sum()) for k in x0)

    assert dist(prox) < 0.8 * dist(free)


@pytest.mark.parametrize("fusion", ["fedadam", "fedyogi", "diloco", "trimmed_mean", "median", "fedprox"])
def test_every_fusion_trains(fusion):
    cfg = _cfg(fusion=fusion, rounds=3, local_steps=6)
    data = _data(["a", "b", "c"])
    res = run_inprocess(cfg, data, eval_data=data["a"])
    assert all(r.fused and r.accepted == ("a", "b", "c") for r in res.rounds)
    assert all(np.all(np.isfinite(v)) for v in res.params.values())
    assert res.rounds[-1].eval["loss"] < res.rounds[0].eval["loss"] + 0.5


def test_compression_bytes_per_round():
    data = _data(["a", "b"])
    n_params = sum(v.size for v in initial_params(_cfg(("a", "b"))).values())
    n_rows = 8 + 1 + 1 + 1 + 3 + 1  # int8 scales: a row of fc1.w / fc2.w each, one per vector
    sizes = {}
    for method in ("none", "fp16", "int8"):
        res = run_inprocess(_cfg(("a", "b"), compression=method, rounds=1), data)
        sizes[method] = res.rounds[0].bytes_up["a"]
        assert res.rounds[0].bytes_down == 2 * 4 * n_params
    assert sizes == {"none": 4 * n_params, "fp16": 2 * n_params, "int8": n_params + 4 * n_rows}


def test_compressed_federation_stays_close_to_uncompressed():
    data = _data(["a", "b"])
    ref = run_inprocess(_cfg(("a", "b"), rounds=2), data).params
    for method, tol in (("fp16", 1e-3), ("int8", 2e-2)):
        got = run_inprocess(_cfg(("a", "b"), rounds=2, compression=method), data).params
        for k in ref:
            assert np.abs(got[k] - ref[k]).max() <= tol * max(1.0, np.abs(ref[k]).max()), (method, k)


class _Byzantine:
    """A center that returns garbage of the right shape."""

    num_samples = 10_000

    def train(self, global_params, *, steps, round_idx, proximal_mu):
        return {k: np.full_like(v, 50.0) for k, v in global_params.items()}, {"train_loss": 0.0}


def test_median_neutralises_a_byzantine_center_in_a_federation():
    names = ("a", "b", "c", "d", "e")
    data = _data(names)
    honest = run_inprocess(_cfg(names[:4], fusion="median", rounds=2), {k: data[k] for k in names[:4]})
    # norm_bound=step_bound=0: the fusions alone, without the server's checks (which refuse e, see below)
    attacked = run_inprocess(_cfg(names, fusion="median", rounds=2, norm_bound=0), data,
                             trainers={"e": _Byzantine()})
    fedavg = run_inprocess(_cfg(names, fusion="fedavg", rounds=2, norm_bound=0, step_bound=0), data,
                           trainers={"e": _Byzantine()})
    for k, v in attacked.params.items():
        assert np.abs(v).max() < 10, k  # the median never moves towards 50
        assert np.abs(v - honest.params[k]).max() < 1.0
    assert np.abs(fedavg.params["fc1.weight"]).max() > 10  # FedAvg is captured by the attacker
    guarded = run_inprocess(_cfg(names, rounds=2, min_centers=4, fusion="fedavg"), data,
                            trainers={"e": _Byzantine()})
    assert all(r.fused and "e" in r.rejected and "update norm" in r.rejected["e"][0] for r in guarded.rounds)


def test_malformed_updates_are_rejected_logged_and_never_fused(caplog):
    cfg = _cfg(("a", "b", "c"), rounds=1, min_centers=1)
    x0 = initial_params(cfg)
    server = FederationServer(cfg, x0)
    r, _ = server.begin_round()
    good = encode_update({k: np.full_like(v, 0.01) for k, v in x0.items()})
    nan = dict(good)
    nan["q/fc2.bias"] = np.full(3, np.nan, np.float32)
    wrong_dtype = {k: v.astype(np.float64) for k, v in good.items()}
    wrong_shape = {**good, "q/fc1.weight": np.zeros((6, 8), np.float32)}
    bound = bound_metrics(server.nonce(r), r, server.model_digest(r), good)
    replies = [CenterReply("a", good, {"num_samples": 10, **bound}), CenterReply("b", nan, {"num_samples": 10}),
               CenterReply("c", wrong_dtype, {"num_samples": 10}), CenterReply("zz", wrong_shape, {"num_samples": 1}),
               CenterReply("b", good, {"num_samples": -3})]
    with caplog.at_level("WARNING", logger="polyparallel.collab"):
        rec = server.finish_round(r, replies)
    assert rec.accepted == ("a",)
    assert set(rec.rejected) == {"b", "c", "zz"}
    assert "rejected the update of b" in caplog.text and "non-finite" in caplog.text
    assert "dtype float64" in " ".join(rec.rejected["c"])
    for k, v in x0.items():  # only a's update fused: x + 0.01 exactly
        np.testing.assert_allclose(server.params[k], v + np.float32(0.01), rtol=1e-6)


def test_timing_json_lines(tmp_path):
    path = tmp_path / "timing.jsonl"
    run_inprocess(_cfg(("a", "b"), rounds=2), _data(["a", "b"]), timing_path=path)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    for r in (1, 2):
        for c in ("a", "b"):
            t = {e["event"]: e["t"] for e in events if e["round"] == r and e["who"] == c}
            assert t["received_model"] <= t["finished_training"] <= t["sent_update"]
        s = {e["event"]: e["t"] for e in events if e["round"] == r and e["role"] == "server"}
        assert s["round_start"] <= s["fusion_start"] <= s["fusion_end"] <= s["round_end"]


def test_checkpoint_resume_loses_no_round(tmp_path):
    cfg = _cfg(("a", "b"), rounds=4, fusion="fedadam")
    data = _data(["a", "b"])
    straight = run_inprocess(cfg, data)
    first = run_inprocess(cfg, data, checkpoint_dir=tmp_path, max_rounds=2)
    assert [r.round for r in first.rounds] == [1, 2]
    rest = run_inprocess(cfg, data, checkpoint_dir=tmp_path, resume=True)  # a restarted server
    assert [r.round for r in rest.rounds] == [3, 4]
    for k in straight.params:  # server optimiser state was checkpointed too
        np.testing.assert_array_equal(rest.params[k], straight.params[k])
    with pytest.raises(ValueError, match="different federation config"):
        run_inprocess(_cfg(("a", "b"), rounds=5), data, checkpoint_dir=tmp_path, resume=True)


def test_absent_center_round_completes_and_it_rejoins():
    cfg = _cfg(("a", "b", "c"), rounds=3, min_centers=2)
    res = run_inprocess(cfg, _data(["a", "b", "c"]), absent={2: ("b",)})
    assert [r.accepted for r in res.rounds] == [("a", "b", "c"), ("a", "c"), ("a", "b", "c")]
    assert res.rounds[1].missing == ("b",) and res.rounds[1].fused
    short = run_inprocess(_cfg(("a", "b", "c"), rounds=1), _data(["a", "b", "c"]), absent={1: ("b",)})
    assert not short.rounds[0].fused  # all three required by default: the model is kept


def test_config_errors_are_actionable():
    with pytest.raises(ValueError, match="unique"):
        _cfg(("a", "a"))
    with pytest.raises(ValueError, match="compression 'zip'"):
        _cfg(compression="zip")
    with pytest.raises(ValueError, match="framework 'jax'"):
        CenterSpec("a", framework="jax")
    with pytest.raises(ValueError, match=r"no data for centers \['b'\]"):
        run_inprocess(_cfg(("a", "b")), _data(["a"]))
    with pytest.raises(ValueError, match="data given for centers"):
        run_inprocess(_cfg(("a",)), _data(["a", "b"]))
    cfg = _cfg(fusion="trimmed_mean", fusion_options={"beta": 0.1})
    assert CollabConfig.from_json(cfg.to_json()) == cfg


def test_config_from_a_collaborative_strategy(tmp_path):
    from polyparallel.backends.collab import config_from_strategy
    from polyparallel.strategy import CenterPlan, Collaborative, Mesh, MeshAxis, ModelInfo, Strategy

    st = Strategy(model=ModelInfo(name="m", fingerprint="f"), mode="collaborative",
                  mesh=Mesh(axes=[MeshAxis(name="center", size=3, level="inter_center")], devices=[0, 1, 2]),
                  collaborative=Collaborative(
                      centers=[CenterPlan(name="a", devices=[0], share=0.5),
                               CenterPlan(name="b", framework="mindspore", devices=[1, 2], share=0.5)],
                      fusion="fedyogi", local_steps=7, rounds=4, compression="int8"))
    path = tmp_path / "s.json"
    st.to_json(path)
    cfg = config_from_strategy(path, SPEC, lr=0.2, min_centers=1)
    assert cfg.centers == (CenterSpec("a"), CenterSpec("b", framework="mindspore", devices=2))
    assert (cfg.fusion, cfg.local_steps, cfg.rounds, cfg.compression, cfg.lr) == ("fedyogi", 7, 4, "int8", 0.2)
    sync = st.model_copy(update={"mode": "synchronous", "collaborative": None, "dp": 3})
    with pytest.raises(ValueError, match="'synchronous' mode"):
        config_from_strategy(sync, SPEC)


def test_cosine_round_schedule_closed_form_and_bad_names():
    from polyparallel.backends.collab._center import round_lr

    assert [round_lr(0.1, "cosine", t, 4) for t in (1, 2, 3, 4)] == pytest.approx(
        [0.1, 0.1 * (1 + 0.5 ** 0.5) / 2, 0.05, 0.1 * (1 - 0.5 ** 0.5) / 2])
    assert round_lr(0.1, "constant", 3, 4) == 0.1
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        round_lr(0.1, "step", 1, 4)
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        CollabConfig(centers=(CenterSpec("a"),), model=ModelSpec("mlp", (4,), 2), lr_schedule="linear")


def test_group_norm_cnn_exchanges_no_running_statistics_and_errors_are_clear():
    import torch

    from polyparallel.backends.collab import build_torch_model, torch_state

    spec = ModelSpec("cnn", (1, 8, 8), 3, hidden=8, norm="group")
    model = build_torch_model(spec)
    assert isinstance(model.bn1, torch.nn.GroupNorm) and (model.bn1.num_groups, model.bn2.num_groups) == (2, 4)
    assert not any(k.endswith(("running_mean", "running_var")) for k in torch_state(model))
    x = torch.randn(5, 1, 8, 8)
    one = model(x[:1])  # no batch statistics: an example's output does not depend on its batch
    torch.testing.assert_close(model(x)[:1], one)
    with pytest.raises(ValueError, match="norm 'group'"):
        ModelSpec("mlp", (4,), 2, norm="group")
    with pytest.raises(ValueError, match="norm 'layer'"):
        ModelSpec("cnn", (1, 8, 8), 2, norm="layer")
    from polyparallel.backends.collab._mindspore import build_mindspore_model

    with pytest.raises(ValueError, match="BatchNorm only"):
        build_mindspore_model(spec)
