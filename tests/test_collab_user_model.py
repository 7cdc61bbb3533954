"""Collaborative training of the user's own torch model, loss and data, given as ``package.module:function``.

The models and data sources are defined in this module and referenced as ``tests.test_collab_user_model:NAME``,
so every process that trains or evaluates (this one, Flower's SuperNodes and ServerApp) imports them itself:

- a residual CNN with BatchNorm on scikit-learn's digits (8×8), whose forward returns an HF-style output with
  ``.loss`` and ``.logits`` when given labels;
- a tiny GPT (``polyparallel.models.GPT``) on token blocks whose labels are the next tokens, ``-100``-padded;
- a linear regressor trained with ``loss="mse"``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyparallel.backends.collab import (
    CenterSpec,
    CollabConfig,
    FederationServer,
    ModelSpec,
    build_torch_model,
    initial_params,
    load_torch_state,
    run_inprocess,
    split_holdout,
)
from tests.test_collab_cli import _run as _cli

HERE = "tests.test_collab_user_model"


# ------------------------------------------------------------------------------------------ models
@dataclass
class Output:
    """What an HF model returns: the loss (when labels were given) and the logits."""

    loss: torch.Tensor
    logits: torch.Tensor


class Block(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)
        self.conv2, self.bn2 = nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResidualCNN(nn.Module):
    """stem conv → BatchNorm → one residual block → max-pool 2 → Linear, for 1×8×8 images."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.block = Block(width)
        self.head = nn.Linear(width * 16, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | Output:
        logits = self.head(F.max_pool2d(self.block(F.relu(self.bn(self.stem(x)))), 2).flatten(1))
        if labels is None:
            return logits
        return Output(F.cross_entropy(logits, labels), logits)


def resnet() -> nn.Module:
    return ResidualCNN()


def resnet_triple() -> tuple[nn.Module, tuple, dict]:
    """The ``(model, args, kwargs)`` form ``polyparallel search`` takes."""
    return ResidualCNN(), (torch.zeros(2, 1, 8, 8),), {}


VOCAB, SEQ = 32, 12


def tiny_gpt() -> nn.Module:
    from polyparallel.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=VOCAB, seq=SEQ, layers=1, hidden=16, heads=2, mlp_ratio=2))


def linear() -> nn.Module:
    return nn.Linear(5, 2)


# ------------------------------------------------------------------------------------------ data
def digits_center(center: str) -> tuple[np.ndarray, np.ndarray]:
    """A third of scikit-learn's digits for center a, b or c (a seeded split), as (N, 1, 8, 8) in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = np.random.default_rng(0).permutation(len(d.target))["abc".index(center)::3]
    return (d.data[rows] / 16.0).reshape(-1, 1, 8, 8).astype(np.float32), d.target[rows].astype(np.int64)


def token_center(center: str) -> tuple[np.ndarray, np.ndarray]:
    """Token blocks of a walk ``t -> t + 1`` with random jumps (10%, seeded per center) and their next
    tokens, the last 0–4 labels of each row ``-100`` (padding that predicts nothing)."""
    i = "abc".index(center)
    rng = np.random.default_rng(10 + i)
    n = 48
    seq = np.zeros((n, SEQ + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, VOCAB, n)
    for k in range(1, SEQ + 1):
        jump = rng.random(n) < 0.1
        seq[:, k] = np.where(jump, rng.integers(0, VOCAB, n), (seq[:, k - 1] + 1) % VOCAB)
    x, y = seq[:, :-1].copy(), seq[:, 1:].copy()
    for r, pad in enumerate(rng.integers(0, 5, n)):
        if pad:
            y[r, -pad:] = -100
    return x, y


def regression_center(center: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng("ab".index(center))
    x = rng.normal(size=(40, 5)).astype(np.float32)
    return x, (x @ rng.normal(size=(5, 2))).astype(np.float32)


# ------------------------------------------------------------------------------------------ tests
def _digits_cfg(names=("a", "b"), **kw) -> CollabConfig:
    return CollabConfig(centers=tuple(CenterSpec(n, data=f"{HERE}:digits_center") for n in names),
                        model=ModelSpec(f"{HERE}:resnet"),
                        **{"rounds": 2, "local_steps": 10, "batch_size": 32, "lr": 0.05, "momentum": 0.9,
                           "holdout": 0.2, "round_timeout_s": 120, **kw})


def test_a_user_model_is_built_seeded_and_named_as_the_module_names_it():
    spec = ModelSpec(f"{HERE}:resnet_triple")  # (model, args, kwargs): the model is the first element
    a, b = build_torch_model(spec, seed=3), build_torch_model(spec, seed=3)
    assert set(a.state_dict()) == set(ResidualCNN().state_dict())
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=0, atol=0)
    torch.manual_seed(3)
    for k, v in ResidualCNN().state_dict().items():
        torch.testing.assert_close(a.state_dict()[k], v, rtol=0, atol=0)
    p = initial_params(_digits_cfg())
    assert "block.bn1.running_var" in p and "block.bn1.num_batches_tracked" not in p  # counters stay local
    with pytest.raises(ValueError, match="PYTHONPATH"):
        build_torch_model(ModelSpec("no_such_module_xyz:net"))
    with pytest.raises(ValueError, match=r"package\.module:function"):
        ModelSpec("resnet50")
    with pytest.raises(ValueError, match="torch model"):
        CollabConfig(centers=(CenterSpec("a", framework="mindspore"),), model=ModelSpec(f"{HERE}:resnet"))


def test_one_round_of_one_center_is_plain_local_training():
    """Fused result of 1 round, 1 center, H steps == H steps of SGD written out here (the data order
    drawn as documented: a permutation per epoch from default_rng([seed, center, round]))."""
    for model, source, loss in ((f"{HERE}:resnet", "digits_center", "auto"), (f"{HERE}:linear", None, "mse")):
        if source:
            x, y = digits_center("a")
            x, y = x[:100], y[:100]
        else:
            x, y = regression_center("a")
        H, B, lr, seed = 5, 16, 0.05, 4
        cfg = CollabConfig(centers=(CenterSpec("a"),), model=ModelSpec(model, loss=loss), rounds=1, local_steps=H,
                           batch_size=B, lr=lr, seed=seed)
        res = run_inprocess(cfg, {"a": (x, y)})
        torch.manual_seed(seed)
        net = ResidualCNN() if source else nn.Linear(5, 2)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        rng = np.random.default_rng([seed, 0, 1])
        order = np.concatenate([rng.permutation(len(x))[: (len(x) // B) * B] for _ in range(H)])
        for s in range(H):
            idx = torch.from_numpy(order[s * B:(s + 1) * B])
            out = net(torch.from_numpy(x)[idx])
            target = torch.from_numpy(y)[idx]
            loss_t = F.cross_entropy(out, target) if source else ((out - target) ** 2).mean()
            opt.zero_grad()
            loss_t.backward()
            opt.step()
        ref = {k: v.detach().numpy() for k, v in net.state_dict().items() if v.is_floating_point()}
        assert set(res.params) == set(ref)
        for k, v in ref.items():
            np.testing.assert_allclose(res.params[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
        assert not np.allclose(res.params[next(iter(ref))], initial_params(cfg)[next(iter(ref))])


def test_the_models_own_loss_and_the_loss_option_give_the_same_numbers():
    """Both models offer their loss (CNN: HF-style output with .loss; GPT: a scalar from forward(ids, labels))
    and plain logits: loss='auto' uses theirs, loss='cross_entropy' ours over the last dimension."""
    for model, source in (("resnet", "digits_center"), ("tiny_gpt", "token_center")):
        runs = []
        for loss in ("auto", "model", "cross_entropy"):
            cfg = CollabConfig(centers=tuple(CenterSpec(n, data=f"{HERE}:{source}") for n in "ab"),
                               model=ModelSpec(f"{HERE}:{model}", loss=loss), rounds=2, local_steps=3, batch_size=8,
                               lr=0.1, holdout=0.25)
            runs.append(run_inprocess(cfg))
        for other in runs[1:]:
            for k, v in runs[0].params.items():
                np.testing.assert_array_equal(other.params[k], v, err_msg=f"{model} {k}")
            assert [r.eval for r in other.rounds] == [r.eval for r in runs[0].rounds]
            assert [r.metrics["a"]["train_loss"] for r in other.rounds] == [r.metrics["a"]["train_loss"]
                                                                             for r in runs[0].rounds]


def test_tiny_gpt_learns_next_tokens_with_padding_and_reports_perplexity():
    cfg = CollabConfig(centers=tuple(CenterSpec(n, data=f"{HERE}:token_center") for n in "abc"),
                       model=ModelSpec(f"{HERE}:tiny_gpt"), rounds=4, local_steps=20, batch_size=8, lr=0.3,
                       holdout=0.25)
    res = run_inprocess(cfg)
    ev = [r.eval for r in res.rounds]
    # independent: token-weighted cross-entropy of the fused model over the three centers' held-out rows
    model = tiny_gpt()
    load_torch_state(model, res.params)
    model.eval()
    nll, count = 0.0, 0
    for i, c in enumerate("abc"):
        _, (xh, yh) = split_holdout(*token_center(c), 0.25, cfg.seed, i)
        with torch.no_grad():
            logits = model(torch.from_numpy(xh))
        yt = torch.from_numpy(yh)
        nll += float(F.cross_entropy(logits.reshape(-1, VOCAB), yt.reshape(-1), ignore_index=-100, reduction="sum"))
        count += int((yt != -100).sum())
    assert ev[-1]["count"] == count and ev[-1]["centers"] == 3
    assert math.isclose(ev[-1]["loss"], nll / count, rel_tol=1e-5)
    assert math.isclose(ev[-1]["perplexity"], math.exp(nll / count), rel_tol=1e-5)
    assert ev[0]["perplexity"] < VOCAB  # below uniform guessing after one round ...
    assert ev[-1]["perplexity"] < 0.5 * ev[0]["perplexity"]  # ... and learning across rounds (27 -> 10)


def test_the_server_never_receives_training_data(monkeypatch):
    """Everything that reaches the server object — replies (payloads and metrics) and evaluations — holds
    parameters and numbers only: no row of any center's inputs appears in it."""
    seen: list = []
    orig = FederationServer.finish_round

    def spy(self, round_idx, replies, **kw):
        seen.extend(replies)
        ev = kw.get("evaluate")
        if ev is not None:
            kw["evaluate"] = lambda p: seen.append(ev(p)) or seen[-1]
        return orig(self, round_idx, replies, **kw)

    monkeypatch.setattr(FederationServer, "finish_round", spy)
    cfg = _digits_cfg(rounds=1)
    run_inprocess(cfg)
    rows = [r.tobytes() for c in ("a", "b") for r in digits_center(c)[0][:200]]
    blobs = []
    for item in seen:
        if isinstance(item, dict):  # an aggregated evaluation
            assert set(item) <= {"loss", "accuracy", "count", "centers"}
            continue
        # round, model_digest (a hash of the global model received) and binding tie the reply to its round
        assert set(item.metrics) == {"num_samples", "train_loss", "t_received", "t_trained", "t_sent", "round",
                                     "model_digest", "binding"}
        assert set(item.payload) == {f"q/{k}" for k in initial_params(cfg)}
        blobs.append(b"".join(np.asarray(v).tobytes() for v in item.payload.values()))
    assert len(blobs) == 2
    assert not any(row[:32] in blob for row in rows for blob in blobs)
    assert cfg.to_json().count("digits_center") == 2  # the job carries the reference, not the data


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_flower_trains_the_user_model_from_center_sources_as_the_inprocess_engine(tmp_path):
    """Residual CNN on digits over Flower: every SuperNode imports the model and loads its own data from
    the reference; fused parameters and the centers' held-out evaluations equal the in-process engine's
    bit for bit, and no center data was written anywhere for the federation."""
    pytest.importorskip("flwr")
    from polyparallel.backends.collab._flower import run_flower

    cfg = _digits_cfg()
    progress = []
    res = run_flower(cfg, workdir=tmp_path, timeout_s=200, on_round=progress.append)
    ref = run_inprocess(cfg)
    assert [r.accepted for r in res.rounds] == [("a", "b")] * 2
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v, err_msg=k)
    assert [r.eval for r in res.rounds] == [r.eval for r in ref.rounds]
    assert res.rounds[-1].eval["accuracy"] > 0.8 and res.rounds[-1].eval["count"] == 240  # 0.2 of 2 × 599
    assert [r.round for r in progress] == [1, 2]
    assert not any(p.suffix == ".npz" and "data" in p.parts for p in tmp_path.rglob("*"))


def test_cli_trains_a_user_model_from_a_data_source_with_progress(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = _cli(["collab", "--centers", "a,b", "--model", f"{HERE}:resnet", "--data",
                              f"{HERE}:digits_center", "--holdout", "0.2", "--rounds", "2", "-H", "10",
                              "--lr", "0.05", "--momentum", "0.9", "--round-timeout", "120", "--out", str(out)], capsys)
    assert code == 0, err
    lines = [ln for ln in stdout.splitlines() if ln.startswith("round ")]
    assert len(lines) == 2 and "accepted a,b" in lines[0] and "acc" in lines[0]
    ref = run_inprocess(_digits_cfg())
    with np.load(out / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    res = json.loads((out / "result.json").read_text())
    assert res["rounds"][-1]["eval"] == dict(ref.rounds[-1].eval)
    assert not list(out.rglob("*.npz"))[1:]  # final.npz only: no copy of any center's data


@pytest.mark.parametrize("argv,msg", [
    (["collab", "--model", "no_such_module_xyz:net", "--data", f"{HERE}:digits_center"], "PYTHONPATH"),
    (["collab", "--model", f"{HERE}:resnet"], "--data"),
    (["collab", "--model", f"{HERE}:resnet", "--loss", "hinge", "--data", f"{HERE}:digits_center"],
     "unknown loss 'hinge'"),
    (["collab", "--model", "cnn", "--in-shape", "1,8,8", "--norm", "layer"], "norm 'layer'"),
    (["collab", "--eval-data", "/nonexistent.npz"], "--eval-data"),
    (["collab", "--holdout", "1.5"], "holdout must be a fraction"),
    (["collab", "--model", f"{HERE}:resnet", "--data", f"{HERE}:resnet"], "define it as def resnet(center)"),
])
def test_cli_errors_are_one_line(argv, msg, capsys):
    code, _, err = _cli(argv, capsys)
    assert code == 2, err
    assert msg in err and "Traceback" not in err
