"""SCAFFOLD: the center-side gradient correction and the server's control variates, against closed forms.

- local steps: a center's corrected SGD equals a hand-written loop, and the mean raw gradient it
  reports equals the paper's option II, ``c_i − c + (x − y_K)/(K η)``, for plain SGD;
- a federation of diagonal quadratics ``f_i(w) = ½ Σ a_i (w − b_i)²`` run through the real engine:
  FedAvg with ``K`` local steps settles at its known biased fixed point, SCAFFOLD at the optimum of
  ``Σ p_i f_i`` (both in closed form);
- the centers' memory and the server's checkpoint; the Flower ClientApp keeps ``c_i`` in
  ``context.state`` across messages (fast, no processes) and a real Flower federation fuses exactly
  what the in-process engine fuses.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyparallel.backends.collab import (
    CenterSpec,
    CenterUpdate,
    CollabConfig,
    Scaffold,
    TorchTrainer,
    batch_indices,
    build_torch_model,
    center_round,
    initial_params,
    load_torch_state,
    run_inprocess,
)
from tests.collab_fixtures import SPEC, mlp_config, random_data


def _data(names, n=48):
    return random_data(names, n, seed=5, grow=16)


def _cfg(names, **kw):
    return mlp_config(names, **{"fusion": "scaffold", **kw})


def test_corrected_local_sgd_is_the_hand_loop_and_reports_option_two():
    import torch

    x, y = _data(("a",))["a"]
    x0 = initial_params(_cfg(("a",)))
    rng = np.random.default_rng(0)
    corr = {k: rng.normal(scale=0.1, size=v.shape).astype(np.float32) for k, v in x0.items()}
    steps, lr = 4, 0.1
    trainer = TorchTrainer(SPEC, x, y, batch_size=16, lr=lr, seed=3, center_index=1)
    grad_mean: dict[str, np.ndarray] = {}
    got, _ = trainer.train(x0, steps=steps, round_idx=2, correction=corr, grad_mean=grad_mean)

    model = build_torch_model(SPEC)  # the same steps written out: w <- w - lr (grad + correction)
    load_torch_state(model, dict(x0))
    raw = {k: np.zeros(v.shape, np.float64) for k, v in x0.items()}
    for idx in batch_indices(len(x), 16, steps, 3, 1, 2):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]).long()).backward()
        with torch.no_grad():
            for k, p in model.named_parameters():
                raw[k] += p.grad.numpy()
                p -= lr * (p.grad + torch.from_numpy(corr[k]))
    for k, p in model.named_parameters():
        np.testing.assert_allclose(got[k], p.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad_mean[k], raw[k] / steps, rtol=1e-5, atol=1e-6)
        # option II: c_i+ = c_i - c + (x - y_K) / (K lr), with c - c_i = corr
        np.testing.assert_allclose(grad_mean[k], (x0[k] - got[k]) / (steps * lr) - corr[k], rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="does not match the model's parameters"):
        trainer.train(x0, steps=1, round_idx=1, correction={"fc1.weight": corr["fc1.weight"]})


class _Quadratic:
    """``f(w) = ½ Σ a (w − b)²`` per tensor, ``steps`` of gradient descent at rate ``lr`` (exact gradients)."""

    def __init__(self, a, b, n, lr):
        self.a, self.b, self.num_samples, self.lr = a, b, n, lr

    def train(self, global_params, *, steps, round_idx, proximal_mu, correction=None, grad_mean=None):
        out = {}
        for k, x in global_params.items():
            w, total = x.astype(np.float64), 0.0
            for _ in range(steps):
                g = self.a[k] * (w - self.b[k])
                total = total + g
                w = w - self.lr * (g + (0.0 if correction is None else correction[k]))
            out[k] = w.astype(np.float32)
            if grad_mean is not None:
                grad_mean[k] = (total / steps).astype(np.float32)
        return out, {"train_loss": 0.0}


def test_scaffold_removes_the_client_drift_fedavg_settles_into_on_quadratics():
    names, steps, lr = ("a", "b", "c"), 5, 0.3
    x0 = initial_params(_cfg(names))
    rng = np.random.default_rng(1)
    a = [{k: rng.uniform(0.2, 1.5, v.shape) for k, v in x0.items()} for _ in names]
    b = [{k: rng.normal(size=v.shape) for k, v in x0.items()} for _ in names]
    n = np.array([10, 30, 60])
    p = n / n.sum()
    trainers = {c: _Quadratic(a[i], b[i], int(n[i]), lr) for i, c in enumerate(names)}
    data = {c: (np.zeros((1, 6), np.float32), np.zeros(1, np.int64)) for c in names}  # never read
    optimum, fedavg_fixed = {}, {}
    for k in x0:
        optimum[k] = sum(p[i] * a[i][k] * b[i][k] for i in range(3)) / sum(p[i] * a[i][k] for i in range(3))
        m = [(1 - lr * a[i][k]) ** steps for i in range(3)]  # K GD steps: w_K − b = m (x − b)
        fedavg_fixed[k] = sum(p[i] * (1 - m[i]) * b[i][k] for i in range(3)) / (1 - sum(p[i] * m[i] for i in range(3)))
    cfg = _cfg(names, rounds=60, local_steps=steps, lr=lr)
    scaffold = run_inprocess(cfg, data, trainers=trainers).params
    fedavg = run_inprocess(_cfg(names, rounds=60, local_steps=steps, lr=lr, fusion="fedavg"), data,
                           trainers=trainers).params
    for k in x0:
        np.testing.assert_allclose(scaffold[k], optimum[k], atol=2e-4)
        np.testing.assert_allclose(fedavg[k], fedavg_fixed[k], atol=2e-4)
    drift = max(np.abs(fedavg_fixed[k] - optimum[k]).max() for k in x0)
    assert drift > 0.05  # the two closed forms differ, so the test tells the fusions apart


def test_server_control_is_the_sample_weighted_mean_of_the_last_reported_variates():
    x = {"w": np.zeros(3, np.float32), "bn.running_mean": np.zeros(3, np.float32)}
    f = Scaffold(lr=0.5)
    assert set(f.control(x)) == {"w"} and not f.control(x)["w"].any()  # statistics carry none
    ups = [CenterUpdate("a", {"w": np.ones(3), "bn.running_mean": np.ones(3)}, 10, controls={"w": np.full(3, 2.0)}),
           CenterUpdate("b", {"w": np.full(3, 3.0), "bn.running_mean": np.full(3, 3.0)}, 30,
                        controls={"w": np.full(3, -2.0)})]
    new = f.fuse(x, ups)
    np.testing.assert_allclose(new["w"], 0.5 * 2.5)  # x + eta_g * weighted delta
    np.testing.assert_allclose(new["bn.running_mean"], 2.5)  # statistics: the plain weighted average
    np.testing.assert_allclose(f.control(x)["w"], (10 * 2 - 30 * 2) / 40)
    f.fuse(new, [CenterUpdate("a", new, 10, controls={"w": np.full(3, 6.0)})])  # only a reports again
    np.testing.assert_allclose(f.control(x)["w"], (10 * 6 - 30 * 2) / 40)
    g = Scaffold(lr=0.5)
    g.load_state(f.state())
    np.testing.assert_array_equal(g.control(x)["w"], f.control(x)["w"])
    with pytest.raises(ValueError, match="expected one per trained tensor"):
        f.fuse(x, [CenterUpdate("a", x, 10)])


def test_scaffold_with_outer_momentum_steps_the_model_as_diloco_does():
    from polyparallel.backends.collab import DiLoCo

    rng = np.random.default_rng(4)
    x = {"w": rng.normal(size=(3, 2)).astype(np.float32), "bn.running_var": np.ones(2, np.float32)}
    s, d = Scaffold(lr=0.7, momentum=0.9), DiLoCo(lr=0.7, momentum=0.9)
    xs = xd = x
    for r in range(3):
        ups = [CenterUpdate(c, {k: v + rng.normal(size=v.shape) for k, v in x.items()}, n,
                            controls={"w": rng.normal(size=(3, 2))}) for c, n in (("a", 5), ("b", 15))]
        xs = s.fuse(xs, [CenterUpdate(u.center, {k: u.params[k] - x[k] + xs[k] for k in x}, u.num_samples,
                                      controls=u.controls) for u in ups])
        xd = d.fuse(xd, [CenterUpdate(u.center, {k: u.params[k] - x[k] + xd[k] for k in x}, u.num_samples)
                         for u in ups])
        for k in x:
            np.testing.assert_allclose(xs[k], xd[k], rtol=1e-6)
        if r == 1:  # the outer momentum is checkpointed with the variates
            t = Scaffold(lr=0.7, momentum=0.9)
            t.load_state(s.state())
            s = t


def test_the_server_rejects_a_reply_without_control_variates():
    cfg = _cfg(("a", "b"), rounds=1, min_centers=1)
    data = _data(("a", "b"))
    from polyparallel.backends.collab import CenterReply, FederationServer, make_trainer

    server = FederationServer(cfg, initial_params(cfg))
    r, x = server.begin_round()
    full, m = center_round(make_trainer(cfg, "a", *data["a"]), x, round_idx=r, config=cfg,
                           control=server.control(), center_state={}, nonce=server.nonce(r))
    bare = {k: v for k, v in full.items() if not k.startswith("c/")}
    rec = server.finish_round(r, [CenterReply("a", full, m), CenterReply("b", bare, m)])
    assert rec.accepted == ("a",) and "missing tensor 'c/q/fc1.weight'" in rec.rejected["b"]


def test_centers_keep_their_variates_so_a_restarted_server_loses_nothing(tmp_path):
    cfg = _cfg(("a", "b"), rounds=4, compression="int8")
    data = _data(("a", "b"))
    straight = run_inprocess(cfg, data)
    states: dict = {}
    run_inprocess(cfg, data, checkpoint_dir=tmp_path, max_rounds=2, center_states=states)
    assert set(states["a"]) == {k for k in straight.params}  # c_i over every trained tensor (the MLP has no stats)
    rest = run_inprocess(cfg, data, checkpoint_dir=tmp_path, resume=True, center_states=states)
    forgetful = run_inprocess(cfg, data, checkpoint_dir=tmp_path / "f", max_rounds=2)
    forgetful = run_inprocess(cfg, data, checkpoint_dir=tmp_path / "f", resume=True)  # centers restarted too
    for k, v in straight.params.items():
        np.testing.assert_array_equal(rest.params[k], v)
    assert any(not np.array_equal(forgetful.params[k], straight.params[k]) for k in straight.params)
    assert rest.rounds[0].bytes_down == 2 * 2 * sum(v.nbytes for v in straight.params.values())  # model + c


def test_scaffold_needs_single_process_torch_centers():
    with pytest.raises(ValueError, match="single-process torch centers"):
        CollabConfig(centers=(CenterSpec("a"), CenterSpec("b", framework="mindspore")), model=SPEC,
                     fusion="scaffold")
    with pytest.raises(ValueError, match="single-process torch centers"):
        CollabConfig(centers=(CenterSpec("a", devices=2),), model=SPEC, fusion="scaffold")


def test_the_flower_client_keeps_its_variate_in_the_context_state(tmp_path):
    """Two messages to the ClientApp with one Context, as the SuperNode sends them: the second round is
    corrected by the c_i the first one stored, exactly as the in-process center does."""
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from polyparallel.backends.collab import make_trainer
    from polyparallel.backends.collab._flower import write_center_data
    from polyparallel.backends.collab._flower_app import client_app
    from polyparallel.backends.collab._wire import pack_arrays, unpack_arrays

    cfg = _cfg(("a", "b"))
    data = _data(("a", "b"))
    paths = write_center_data(tmp_path, data)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    ctx = Context(run_id=1, node_id=7, node_config={"center": "b", "data": str(paths["b"])}, state=RecordDict(),
                  run_config={"collab-config": cfg.to_json(), "out-dir": str(tmp_path)})
    rng = np.random.default_rng(2)
    x = initial_params(cfg)
    trainer, mine = make_trainer(cfg, "b", *data["b"]), {}
    for r in (1, 2):
        c = {k: rng.normal(scale=0.05, size=v.shape).astype(np.float32) for k, v in x.items()}
        (mb, ml), (cb, cl) = pack_arrays(x), pack_arrays(c)
        msg = Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in mb.items()}),
                                  "layout": ConfigRecord(ml),
                                  "control": ArrayRecord({k: Array(v) for k, v in cb.items()}),
                                  "control-layout": ConfigRecord(cl),
                                  "config": ConfigRecord({"round": r, "proximal_mu": 0.0})}),
                      dst_node_id=7, message_type="train")
        content = client_app(message=msg, context=ctx).content
        got = unpack_arrays({k: v.numpy() for k, v in content["update"].items()}, dict(content["layout"]))
        want, _ = center_round(trainer, x, round_idx=r, config=cfg, control=c, center_state=mine)
        assert set(got) == set(want) and any(k.startswith("c/") for k in got)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        if r == 2:  # the stored c_i mattered: a center with an empty memory sends something else
            fresh, _ = center_round(trainer, x, round_idx=r, config=cfg, control=c, center_state={})
            assert any(not np.array_equal(got[k], fresh[k]) for k in fresh)
        stored = {k: v.numpy() for k, v in ctx.state["scaffold-ci"].items()}
        assert set(stored) == set(mine) and all(np.array_equal(stored[k], mine[k]) for k in mine)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaffold_over_flower_fuses_exactly_what_the_inprocess_engine_fuses(tmp_path):
    """Real SuperLink and SuperNodes: c goes out with the model, c_i stays in each SuperNode's context
    between rounds (a center that forgot it would fuse something else: the last assertion)."""
    pytest.importorskip("flwr")
    from polyparallel.backends.collab._flower import run_flower

    names = ("a", "b")
    cfg = _cfg(names, rounds=3)
    data = _data(names)
    res = run_flower(cfg, data, workdir=tmp_path, timeout_s=240)
    ref = run_inprocess(cfg, data)
    assert [r.accepted for r in res.rounds] == [names] * 3
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    assert [r.bytes_down for r in res.rounds] == [r.bytes_down for r in ref.rounds]
    run_inprocess(cfg, data, checkpoint_dir=tmp_path / "f", max_rounds=2)
    forgetful = run_inprocess(cfg, data, checkpoint_dir=tmp_path / "f", resume=True)
    assert any(not np.array_equal(forgetful.params[k], res.params[k]) for k in res.params)
