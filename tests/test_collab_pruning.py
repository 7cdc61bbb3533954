"""Online pruning across centers (issue 35): scores against hand computations, the cut against the
masked model, a pruning federation that releases, and the one-line refusals."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch_pruning")

import torch
from torch import nn

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, collaborate
from polyparallel.backends.collab import _pruning as P
from polyparallel.backends.collab._pruning import PruneError, PruneSpec
from tests.test_collab_cli import _run  # the command's exit code, stdout and stderr

HERE = "tests.test_collab_pruning"


# --------------------------------------------------------------------------- models (also used by reference)
class ResBlock(nn.Module):
    """conv-BN, depthwise conv-BN and a residual add: one channel group across all of them."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b2(self.dw(torch.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.block = ResBlock(16)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.fc1 = nn.Linear(32, 24)
        self.fc = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(torch.relu(self.bn(self.stem(x))))
        x = torch.relu(self.grouped(x)).mean((2, 3))
        return self.fc(torch.relu(self.fc1(x)))


def resnet() -> nn.Module:
    return ResNet()


class Untraceable(nn.Module):
    """``hidden``'s output leaves autograd (numpy round trip): the dependency graph cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.from_numpy(self.hidden(x.flatten(1)).detach().numpy())
        return self.out(torch.relu(h))


def untraceable() -> nn.Module:
    return Untraceable()


class UserBlock(nn.Module):
    """A user's basic block: conv-BN-ReLU-conv-BN plus an identity or strided 1×1-conv-BN shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class UserResCNN(nn.Module):
    """A residual CNN with BatchNorm as a user writes one (none of the benchmark's or the other tests'):
    two blocks, the second strided with a projection shortcut, adaptive pooling, dropout, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU())
        self.b1 = UserBlock(12, 12, 1)
        self.b2 = UserBlock(12, 24, 2)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b2(self.b1(self.stem(x)))
        return self.fc(self.drop(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)))


def user_rescnn() -> nn.Module:
    return UserResCNN()


class HeadAttention(nn.Module):
    """Attention that keeps its head count as ``num_heads`` and reads the head width from ``qkv``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(((q @ k.transpose(-2, -1)) * self.scale).softmax(-1).matmul(v).transpose(1, 2)
                         .reshape(b, n, -1))


class FixedAttention(HeadAttention):
    """The same attention with its shapes written as constants (no head count the pruner can read)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(((q @ k.transpose(-2, -1)) * self.scale).softmax(-1).matmul(v).transpose(1, 2)
                         .reshape(b, n, d))


class TinyViT(nn.Module):
    """Patches of an 8×8 image (2×2 grid), one pre-LayerNorm block of width 16 with 4 heads, MLP 32."""

    def __init__(self, attention: type = HeadAttention) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, 16, 4, 4)
        self.norm1, self.attn = nn.LayerNorm(16), attention(16, 4)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(x.mean(1))


def tiny_vit() -> nn.Module:
    return TinyViT()


class TiedTokens(nn.Module):
    """Digits as 64 tokens (pixel intensities 0..16): an embedding, a residual MLP, a projection back
    onto the 17-token vocabulary that shares the embedding's weight (tied, as a language model's output
    layer does), and a classifier over the mean of those logits."""

    def __init__(self, vocab: int = 17, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.unembed = nn.Linear(d, vocab, bias=False)
        self.unembed.weight = self.emb.weight
        self.head = nn.Linear(vocab, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(self.unembed(h).mean(1))


def tied_tokens() -> nn.Module:
    return TiedTokens()


def _digits(n_centers: int = 3, rows: int = 300) -> tuple[dict, tuple]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype(np.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    names = "abcdefgh"[:n_centers]
    data = {c: (x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) for i, c in enumerate(names)}
    return data, (x[1400:], y[1400:])


# --------------------------------------------------------------------------- the spec
def test_spec_refuses_bad_values_and_schedules_cubically():
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(PruneError, match=r"in \(0, 1\)"):
            PruneSpec(bad)
    with pytest.raises(PruneError, match="rounds"):
        PruneSpec(0.5, rounds=0)
    with pytest.raises(PruneError, match="unknown pruning score"):
        PruneSpec(0.5, score="random")
    with pytest.raises(PruneError, match="unknown pruning target"):
        PruneSpec(0.5, target="flops")
    with pytest.raises(PruneError, match="unknown pruning allocation"):
        PruneSpec(0.5, allocation="random")
    s = PruneSpec(0.5, rounds=4)
    assert (s.target, s.allocation, s.score) == ("params", "global", "fisher")  # the defaults the benchmark met
    assert s.sparsity(1) == pytest.approx(0.5 * (1 - 0.75 ** 3))
    assert s.sparsity(2) == pytest.approx(0.5 * (1 - 0.5 ** 3))
    assert s.sparsity(4) == s.sparsity(9) == 0.5
    for bad in (-1, 4, 1.5):
        with pytest.raises(PruneError, match=r"warmup must be an integer in \[0, K=4\)"):
            PruneSpec(0.5, rounds=4, warmup=bad)
    w = PruneSpec(0.5, rounds=6, warmup=2)  # dense rounds 1-2, then the same cubic ramp over rounds 3..6
    assert w.sparsity(1) == w.sparsity(2) == 0.0
    assert [w.sparsity(t) for t in (3, 4, 6)] == [s.sparsity(t) for t in (1, 2, 4)]


# --------------------------------------------------------------------------- scores by hand
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _hand_group(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> np.ndarray:
    """The hidden neuron i's group: row i of fc1 (weight and bias) and column i of fc2 (fc2 is the output)."""
    return (w1.sum(1) + b1 + w2.sum(0)).double().numpy()


def test_magnitude_scores_are_the_group_sum_of_squares():
    torch.manual_seed(0)
    m = MLP()
    got = P.group_scores(m, torch.zeros(2, 4), P.saliency(m, "magnitude"))
    assert set(got) == {"fc1"}  # fc2 writes the output: never pruned, not scored
    want = _hand_group(m.fc1.weight.detach() ** 2, m.fc1.bias.detach() ** 2, m.fc2.weight.detach() ** 2)
    np.testing.assert_allclose(got["fc1"], want, rtol=1e-5)


def test_taylor_and_fisher_scores_match_gradients_taken_by_hand():
    torch.manual_seed(1)
    m = MLP()
    x, y = torch.randn(12, 4), torch.randint(0, 2, (12,))
    batches = [np.arange(0, 6), np.arange(6, 12)]
    grads = []
    for b in batches:  # independent: autograd.grad of the cross-entropy, batch by batch
        loss = nn.functional.cross_entropy(m(x[b]), y[b])
        grads.append(torch.autograd.grad(loss, [m.fc1.weight, m.fc1.bias, m.fc2.weight]))
    ws = [m.fc1.weight.detach(), m.fc1.bias.detach(), m.fc2.weight.detach()]
    mean_g = [(a + b) / 2 for a, b in zip(*grads)]
    mean_g2 = [(a ** 2 + b ** 2) / 2 for a, b in zip(*grads)]

    def objective(model, xb, yb, bias):
        return nn.functional.cross_entropy(model(xb), yb)

    taylor = P.group_scores(m, x[:2], P.saliency(m, "taylor", objective, x, y, batches))["fc1"]
    fisher = P.group_scores(m, x[:2], P.saliency(m, "fisher", objective, x, y, batches))["fc1"]
    np.testing.assert_allclose(taylor, _hand_group(*[(w * g).abs() for w, g in zip(ws, mean_g)]), rtol=1e-5)
    np.testing.assert_allclose(fisher, _hand_group(*[0.5 * w ** 2 * g for w, g in zip(ws, mean_g2)]), rtol=1e-5)
    assert m.fc1.weight.grad is None  # scoring leaves no gradient behind


# --------------------------------------------------------------------------- the cut
def _randomised_bn(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):  # non-trivial statistics and affine, so a wrong cut shows
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g))
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.weight.data.copy_(torch.randn(mod.num_features, generator=g))
            mod.bias.data.copy_(torch.randn(mod.num_features, generator=g))
    return model


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
def test_cut_computes_what_the_masked_model_computes(ratio):
    torch.manual_seed(0)
    full = _randomised_bn(ResNet()).eval()
    ex = torch.zeros(2, 1, 8, 8)
    rng = np.random.default_rng(4)
    layout = P.group_scores(full, ex, P.saliency(full, "magnitude"))
    scores = {k: rng.random(len(v)) for k, v in layout.items()}  # any fused scores
    x = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        y_full = full(x)
    masked = copy.deepcopy(full)
    plan = P.mask_and_plan(masked, ex, ratio, scores)
    with torch.no_grad():
        y_masked = masked(x)
    assert not torch.allclose(y_full, y_masked)  # the mask did something
    # every group lost its share: the residual group (stem, bn, block), the grouped conv's, fc1's
    assert {p[0] for p in plan} == set(layout)
    # the grouped conv's output and its input (the residual stream, rooted at the depthwise conv) lose the
    # same share of each of its 4 channel groups, so its groups stay equal
    for name, _, idxs in plan:
        groups = 4 if name in ("grouped", "block.dw") else 1
        per = len(layout[name]) // groups
        assert len(idxs) == groups * (per - int(per * (1 - ratio)))
    cut = copy.deepcopy(masked)
    P.apply_plan(cut, ex, plan)
    cut.eval()
    with torch.no_grad():
        y_cut = cut(x)
    torch.testing.assert_close(y_cut, y_masked, rtol=1e-5, atol=1e-5)
    n_full, n_cut = (sum(p.numel() for p in m.parameters()) for m in (full, cut))
    assert n_cut < (1 - ratio + 0.1) * n_full
    # consistency across the dependent layers: the residual add and the depthwise conv agree
    assert cut.stem.out_channels == cut.block.c1.out_channels == cut.block.dw.groups == cut.bn.num_features
    assert cut.grouped.groups == 4 and cut.grouped.out_channels % 4 == 0


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_parameter_target_is_the_smallest_channel_ratio_that_removes_the_share(allocation):
    torch.manual_seed(0)
    full = _randomised_bn(ResNet()).eval()
    ex = torch.zeros(2, 1, 8, 8)
    layout = P.group_scores(full, ex, P.saliency(full, "magnitude"))
    rng = np.random.default_rng(5)
    scores = {k: rng.random(len(v)) ** 3 for k, v in layout.items()}
    n_full = _count(full)
    ratio, kept = P.channel_ratio_for(full, ex, 0.5, scores, allocation=allocation)

    def cut_count(r: float) -> tuple[int, list]:
        masked = copy.deepcopy(full)
        plan = P.mask_and_plan(masked, ex, r, scores, allocation=allocation)
        fresh = resnet()  # the plan replayed on another instance, its parameters counted here
        P.apply_plan(fresh, ex, plan)
        return _count(fresh), plan

    n_cut, plan = cut_count(ratio)
    assert n_cut == kept and n_cut <= 0.5 * n_full
    assert cut_count(ratio - 0.01)[0] > 0.5 * n_full  # fewer channels miss the target
    shares = {name: len(idxs) / len(layout[name]) for name, _, idxs in plan}
    if allocation == "global":  # one ranking: the groups lose different shares, none below its floor
        assert max(shares.values()) - min(shares.values()) > 0.1
        assert all(len(layout[n]) - len(i) >= np.ceil(P.MIN_KEEP * len(layout[n])) for n, _, i in plan)
    with pytest.raises(PruneError, match="out of reach: at most"):
        P.channel_ratio_for(full, ex, 0.99, scores, allocation=allocation)


def test_global_cut_computes_what_the_masked_model_computes():
    torch.manual_seed(0)
    full = _randomised_bn(ResNet()).eval()
    ex = torch.zeros(2, 1, 8, 8)
    layout = P.group_scores(full, ex, P.saliency(full, "magnitude"))
    rng = np.random.default_rng(6)
    masked = copy.deepcopy(full)
    plan = P.mask_and_plan(masked, ex, 0.4, {k: rng.random(len(v)) for k, v in layout.items()}, allocation="global")
    cut = copy.deepcopy(masked)
    P.apply_plan(cut, ex, plan)
    x = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(cut.eval()(x), masked(x), rtol=1e-5, atol=1e-5)


def test_untraceable_layer_is_named():
    with pytest.raises(PruneError, match="'hidden'"):
        P.group_scores(Untraceable(), torch.zeros(2, 1, 8, 8), P.saliency(Untraceable(), "magnitude"))


def test_tied_weights_stay_one_parameter_through_the_cut_and_the_federation():
    """The embedding and the vocabulary projection share one weight: the cut removes the residual
    stream's channels from it once and both layers keep holding it (Torch-Pruning alone leaves two
    parameters that then train apart); the vocabulary group itself is kept whole (its rows are the
    tokens the embedding looks up)."""
    torch.manual_seed(0)
    full, ex = TiedTokens().eval(), torch.zeros(2, 64, dtype=torch.long)
    layout = P.group_scores(full, ex, P.saliency(full, "magnitude"))
    assert set(layout) == {"fc1", "fc2"} and "unembed" in P.kept_whole(full, ex)
    rng = np.random.default_rng(1)
    masked = copy.deepcopy(full)
    plan = P.mask_and_plan(masked, ex, 0.5, {k: rng.random(len(v)) for k, v in layout.items()})
    cut = copy.deepcopy(masked)
    P.apply_plan(cut, ex, plan)
    x = torch.randint(0, 17, (4, 64))
    with torch.no_grad():
        torch.testing.assert_close(cut(x), masked(x), rtol=1e-5, atol=1e-5)
    assert cut.unembed.weight is cut.emb.weight and cut.emb.weight.shape == (17, 8)
    assert _count(cut) == 17 * 8 + (8 * 16 + 16) + (16 * 8 + 8) + (17 * 10 + 10)

    data, _ = _digits()
    tokens = {c: (np.rint(x.reshape(len(x), 64) * 16).astype(np.int64), y) for c, (x, y) in data.items()}
    res = collaborate(_config(model=ModelSpec(f"{HERE}:tied_tokens"), rounds=3), tokens)
    assert res.pruning["plan"] and res.params["emb.weight"].shape == (17, 8)
    # two rounds trained after the cut: apart, the two would differ (each its own gradient)
    np.testing.assert_array_equal(res.params["emb.weight"], res.params["unembed.weight"])


# --------------------------------------------------------------------------- the federation
def _config(**kw) -> CollabConfig:
    base = dict(centers=(CenterSpec("a"), CenterSpec("b"), CenterSpec("c")), model=ModelSpec(f"{HERE}:resnet"),
                rounds=2, local_steps=8, batch_size=32, lr=0.1, fusion="fedavg",
                prune=PruneSpec(0.5, rounds=1, score="taylor", score_batches=2, target="channels",
                                allocation="uniform"))
    return CollabConfig(**{**base, **kw})


def test_two_round_federation_cuts_after_round_k_and_every_side_agrees():
    data, ev = _digits()
    res = collaborate(_config(), data, eval_data=ev)
    assert [r.accepted for r in res.rounds] == [("a", "b", "c")] * 2
    plan = res.pruning["plan"]
    assert plan and res.pruning["masks"][0]["sparsity"] == 0.5
    # the server's final model has the cut architecture: the same plan on a fresh model fits it
    m = resnet()
    P.apply_plan(m, torch.zeros(2, 1, 8, 8), plan)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items() if v.is_floating_point()} == \
        {k: v.shape for k, v in res.params.items()}
    assert res.params["stem.weight"].shape[0] == 8 and res.params["fc1.weight"].shape[0] == 12
    # round 2's updates were trained on the pruned model by every center (same shapes, accepted)
    assert res.rounds[1].bytes_up["a"] < res.rounds[0].bytes_up["a"]
    assert np.isfinite(res.rounds[1].eval["loss"])  # the server evaluates the cut model
    assert json.dumps(res.to_dict()["pruning"])  # plan and masks are JSON


@pytest.mark.slow
def test_warmup_rounds_train_the_whole_model_and_still_score():
    """With warmup 1 the first round's fused model is left whole (no channel zeroed), its scores count."""
    data, _ = _digits(rows=60)
    seen = []
    cfg = _config(rounds=2, local_steps=1, prune=PruneSpec(0.5, rounds=2, score="magnitude", warmup=1,
                                                            target="channels", allocation="uniform"))
    res = collaborate(cfg, data, on_round=lambda rec: seen.append(rec.accepted))
    assert seen == [("a", "b", "c")] * 2  # round 1's scores were checked and taken
    assert [m["sparsity"] for m in res.pruning["masks"]] == [0.0, 0.5]
    assert res.pruning["masks"][0]["masked_channels"] == 0 and res.pruning["masks"][1]["masked_channels"] > 0
    assert res.params["stem.weight"].shape[0] == 8  # cut after round 2 at half the channels


def test_scores_are_checked_like_the_update():
    data, _ = _digits(rows=100)

    def drop_scores(r, payload, metrics, nonce):
        return {k: v for k, v in payload.items() if not k.startswith("p/")}, metrics

    def negative_scores(r, payload, metrics, nonce):
        return {k: (-v if k.startswith("p/") else v) for k, v in payload.items()}, metrics

    res = collaborate(_config(rounds=1, local_steps=2, prune=PruneSpec(0.5, 1, "magnitude")), data,
                      tamper={"b": drop_scores, "c": negative_scores})
    rej = res.rounds[0].rejected
    assert any("pruning scores: missing tensor 'q/" in p for p in rej["b"])
    assert any("outside [0," in p for p in rej["c"])
    assert res.rounds[0].accepted == ("a",)


def test_a_restarted_server_resumes_a_pruning_job_before_and_after_the_cut(tmp_path):
    """Four rounds, masks in 1-2, the cut after round 2, stopped after rounds 1 and 3 and resumed from the
    checkpoint by a fresh server and fresh centers: the same model, plan and masks as the run that never
    stopped (bit for bit)."""
    from polyparallel.backends.collab import run_inprocess

    data, _ = _digits(rows=100)
    cfg = _config(rounds=4, local_steps=2, prune=PruneSpec(0.5, rounds=2, score="taylor", score_batches=1,
                                                           target="channels", allocation="uniform"))
    straight = run_inprocess(cfg, data)
    parts = [run_inprocess(cfg, data, checkpoint_dir=tmp_path, resume=True, max_rounds=n) for n in (1, 2, 1)]
    assert [[r.round for r in p.rounds] for p in parts] == [[1], [2, 3], [4]]
    assert [p.pruning["plan"] is None for p in parts] == [True, False, False]
    end = parts[-1]
    assert end.pruning["plan"] == straight.pruning["plan"] and end.pruning["masks"] == straight.pruning["masks"]
    assert {k: v.shape for k, v in end.params.items()} == {k: v.shape for k, v in straight.params.items()}
    for k, v in straight.params.items():
        np.testing.assert_array_equal(end.params[k], v)
    for k, v in straight.pruning["cut_params"].items():  # the release's "at the cut" model survives the restart
        np.testing.assert_array_equal(end.pruning["cut_params"][k], v)


def test_config_refuses_what_cannot_prune_and_round_trips():
    with pytest.raises(ValueError, match="SCAFFOLD"):
        _config(fusion="scaffold")
    with pytest.raises(ValueError, match="cannot carry pruning scores"):
        _config(fusion="fedadam")
    with pytest.raises(ValueError, match="K=3 > rounds=2"):
        _config(prune=PruneSpec(0.5, rounds=3))
    cfg = _config()
    assert CollabConfig.from_json(cfg.to_json()) == cfg
    off = _config(prune=None)
    assert "prune" not in json.loads(off.to_json())  # a job without pruning writes the JSON it wrote before


# --------------------------------------------------------------------------- the command and its release
def _write_digits(tmp_path, rows=300):
    data, ev = _digits(rows=rows)
    d = tmp_path / "data"
    d.mkdir()
    for c, (x, y) in data.items():
        np.savez(d / f"{c}.npz", x=x, y=y)
    np.savez(tmp_path / "ev.npz", x=ev[0], y=ev[1])
    return ["--centers", "a,b,c", "--data", str(d), "--eval-data", str(tmp_path / "ev.npz"), "--fusion", "fedavg"]


@pytest.mark.parametrize("extra, message", [
    (["--prune", "1.5"], "pruning ratio must be in (0, 1)"),
    (["--prune", "0", "--model", f"{HERE}:resnet"], "pruning ratio must be in (0, 1)"),
    (["--prune", "0.5", "--fusion", "scaffold"], "pruning with SCAFFOLD is refused"),
    (["--prune", "0.5", "--fusion", "fltrust"], "cannot carry pruning scores"),
    (["--prune", "0.5", "--model", f"{HERE}:untraceable"], "cannot trace layer 'hidden'"),
    (["--prune", "0.99"], "of the parameters is out of reach"),
    (["--prune", "0.5", "--prune-allocation", "random"], "unknown pruning allocation"),
    (["--prune", "0.5", "--prune-heads", "some"], "unknown head pruning 'some'"),
    (["--release", "REL"], "go with --prune"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    argv = ["collab", *_write_digits(tmp_path, rows=40), "--model", f"{HERE}:resnet", "--rounds", "2",
            "--local-steps", "1", *[str(tmp_path / "rel") if a == "REL" else a for a in extra]]
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_saved_pruning_job_names_the_input_row_and_serve_refuses_one_that_does_not(tmp_path, capsys):
    """`collab --prune --save-config` writes the shape a deployment's server traces the model on (from
    --eval-data's rows); `serve` refuses a job file without it before starting anything, in one line."""
    job = tmp_path / "job.json"
    argv = ["collab", *_write_digits(tmp_path, rows=40), "--model", f"{HERE}:resnet", "--rounds", "2",
            "--prune", "0.5", "--save-config", str(job)]
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    cfg = CollabConfig.from_json(job.read_text())
    assert cfg.prune.input_shape == (1, 8, 8) and cfg.prune.input_dtype == "float32"
    bare = dataclasses.replace(cfg, prune=dataclasses.replace(cfg.prune, input_shape=()))
    job.write_text(bare.to_json())
    code, _, err = _run(["serve", "--config", str(job), "--workdir", str(tmp_path / "wd")], capsys)
    assert code == 2 and "input row" in err and "--save-config" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "wd").exists()
    job.write_text(cfg.to_json())
    for extra, message in ((["--release", str(tmp_path / "rel")], "--release writes a pruning job"),
                           (["--eval-data", str(tmp_path / "data" / "a.npz"), "--release", str(tmp_path / "data")],
                            "exists")):
        code, _, err = _run(["serve", "--config", str(job), "--workdir", str(tmp_path / "wd"), *extra], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(PruneError, match=r"shape \(1, 8, 8\) \(input_shape\), but the centers. rows are \(64,\)"):
        P.with_input_of(cfg, np.zeros((3, 64), np.float32))
    flat = tmp_path / "flat.npz"  # --eval-data of the wrong shape: the line names that file, not the centers
    np.savez(flat, x=np.zeros((3, 64), np.float32), y=np.zeros(3, np.int64))
    code, _, err = _run(["serve", "--config", str(job), "--workdir", str(tmp_path / "wd"), "--eval-data", str(flat)],
                        capsys)
    assert code == 2 and f"the rows of --eval-data {flat} are (64,)" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "wd").exists()


def _pruning_job_file(tmp_path, capsys):
    """(job file of a pruning job, --data DIR, --eval-data FILE) on a few digits."""
    job = tmp_path / "job.json"
    common = _write_digits(tmp_path, rows=40)
    code, _, err = _run(["collab", *common, "--model", f"{HERE}:resnet", "--rounds", "2", "--local-steps", "1",
                         "--prune", "0.5", "--prune-rounds", "1", "--save-config", str(job)], capsys)
    assert code == 0, err
    return job, common[common.index("--data") + 1], common[common.index("--eval-data") + 1]


def test_a_pruning_job_file_takes_release_in_process(tmp_path, capsys):
    """`collab --config job.json --release DIR` with a job file that prunes: the job's pruning is used, so
    --release is accepted (it was refused as if no --prune had been given) and checked before training."""
    job, data, ev = _pruning_job_file(tmp_path, capsys)
    (tmp_path / "old").mkdir()
    for extra, message in ((["--eval-data", ev, "--release", str(tmp_path / "old")], "exists"),
                           (["--release", str(tmp_path / "rel")], "--release measures accuracy")):
        code, out, err = _run(["collab", "--config", str(job), "--data", data, *extra], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "round 1" not in out, err
    plain = tmp_path / "plain.json"
    plain.write_text(dataclasses.replace(CollabConfig.from_json(job.read_text()), prune=None).to_json())
    code, _, err = _run(["collab", "--config", str(plain), "--data", data, "--eval-data", ev, "--release",
                         str(tmp_path / "rel")], capsys)
    assert code == 2 and "go with --prune" in err, err


@pytest.mark.slow
def test_a_pruning_job_file_releases_in_process(tmp_path, capsys):
    job, data, ev = _pruning_job_file(tmp_path, capsys)
    code, _, err = _run(["collab", "--config", str(job), "--data", data, "--eval-data", ev, "--release",
                           str(tmp_path / "rel")], capsys)
    assert code == 0, err
    r = json.loads((tmp_path / "rel" / "release.json").read_text())
    assert r["pruning"]["ratio"] == 0.5 and r["params_after"] < r["params_before"]


def test_existing_release_dir_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "rel").mkdir()
    argv = ["collab", *_write_digits(tmp_path, rows=40), "--model", f"{HERE}:resnet", "--rounds", "2",
            "--prune", "0.5", "--release", str(tmp_path / "rel")]
    code, out, err = _run(argv, capsys)
    assert code == 2 and "exists" in err and "--force" in err and "round 1" not in out


@pytest.mark.slow
def test_command_prunes_and_releases_a_model_that_deploys(tmp_path, capsys):
    import onnxruntime as ort

    rel = tmp_path / "rel"
    argv = ["collab", *_write_digits(tmp_path), "--model", f"{HERE}:resnet", "--rounds", "3", "--local-steps",
            "10", "--lr", "0.1", "--prune", "0.5", "--prune-rounds", "1", "--prune-score", "fisher",
            "--release", str(rel), "--out", str(tmp_path / "out")]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert f"release {rel}" in out
    r = json.loads((rel / "release.json").read_text())
    assert r["pruning"]["target"] == "params" and r["params_after"] <= 0.5 * r["params_before"]
    assert r["flops_after"] < 0.7 * r["flops_before"]
    assert r["accuracy_at_cut"] == pytest.approx(r["accuracy_before"])  # the cut keeps the masked function
    assert r["onnx_check"]["max_abs_diff"] < 1e-4 and r["onnx_check"]["argmax_agreement"] == 1.0
    assert set(r["latency_s"]["before"]) == set(r["latency_s"]["after"]) == {"1", "32"}
    # the released files load and compute the same as each other
    x = np.load(tmp_path / "ev.npz")["x"][:32]
    ep = torch.export.load(str(rel / "model.pt2"))
    # the target against a count of the released program's own parameters, and of the model it came from
    assert sum(p.numel() for p in ep.module().parameters()) == r["params_after"]
    assert _count(resnet()) == r["params_before"]
    want = ep.module()(torch.from_numpy(x)).detach().numpy()
    sess = ort.InferenceSession(str(rel / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    # --force overwrites
    code, _, err = _run([*argv, "--force"], capsys)
    assert code == 0, err


# --------------------------------------------------------------------------- attention
def _mask_cut(model: nn.Module, ex: torch.Tensor, ratio: float, seed: int = 0):
    """(masked model, its cut copy, the plan, the layout) for random fused scores."""
    layout = P.group_scores(model, ex, P.saliency(model, "magnitude"))
    rng = np.random.default_rng(seed)
    masked = copy.deepcopy(model).eval()
    plan = P.mask_and_plan(masked, ex, ratio, {k: rng.random(len(v)) for k, v in layout.items()})
    cut = copy.deepcopy(masked)
    P.apply_plan(cut, ex, plan)
    return masked, cut.eval(), plan, layout


def test_attention_loses_the_same_dimensions_in_every_head_and_keeps_the_residual_stream():
    torch.manual_seed(0)
    model = TinyViT().eval()
    ex = torch.zeros(2, 1, 8, 8)
    assert P.attention_heads(model) == {model.attn.qkv: 4}
    # the residual stream is read by LayerNorm: removing its zeroed channels would change the model
    kept = P.kept_whole(model, ex)
    assert len(kept) == 1 and kept[0] in ("embed", "attn.proj", "fc2")
    masked, cut, _, layout = _mask_cut(model, ex, 0.5)
    assert set(layout) == {"fc1", "attn.proj:in"}  # the MLP's neurons; the heads' dimensions (at proj's input)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(cut(x), masked(x), rtol=1e-5, atol=1e-5)
    assert cut.embed.out_channels == 16 and cut.norm1.normalized_shape == (16,)  # the stream kept whole
    assert cut.fc1.out_features == 16  # half the MLP's neurons
    assert cut.attn.num_heads == 4 and cut.attn.qkv.out_features == 3 * 4 * 2  # 4 heads of 2 dims (from 4)
    assert cut.attn.proj.in_features == 4 * 2


def test_whole_heads_leave_and_the_head_count_follows():
    """heads="whole": half of the 4 heads go, the two whose channels score lowest on average (the heads'
    score vector is at the output projection's input: 4 heads x 4 dimensions); the masked and the cut
    model both compute the full model with those heads' output-projection columns zeroed."""
    torch.manual_seed(0)
    full, ex = TinyViT().eval(), torch.zeros(2, 1, 8, 8)
    assert "attn.proj:in" not in P.kept_whole(full, ex, heads="whole")
    scores = {"attn.proj:in": np.random.default_rng(3).random(16)}  # the heads only: the MLP stays
    masked = copy.deepcopy(full)
    plan = P.mask_and_plan(masked, ex, 0.5, scores, heads="whole")
    assert plan[-1] == ["attn", "heads", 2] and len(P.channels_of(plan)) == len(plan) - 1
    gone = np.argsort(scores["attn.proj:in"].reshape(4, 4).mean(1))[:2]
    ref = copy.deepcopy(full)
    with torch.no_grad():
        for h in gone:
            ref.attn.proj.weight[:, 4 * h:4 * h + 4] = 0
    cut = copy.deepcopy(masked)
    P.apply_plan(cut, ex, plan)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(masked(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cut.eval()(x), ref(x), rtol=1e-5, atol=1e-5)
    assert cut.attn.num_heads == 2 and cut.attn.qkv.out_features == 3 * 2 * 4 and cut.attn.proj.in_features == 2 * 4
    # an attention that hard-codes its head count cannot lose heads either: kept whole, its MLP still pruned
    fixed = TinyViT(FixedAttention).eval()
    assert "attn.proj:in" in P.kept_whole(fixed, ex, heads="whole")
    with pytest.raises(PruneError, match=r"'blocks\.0\.attn'.*no attention module"):
        P.apply_plan(copy.deepcopy(full), ex, [["blocks.0.attn", "heads", 2]])


def test_a_federation_prunes_whole_heads_and_releases_the_smaller_attention(tmp_path):
    from polyparallel.backends.collab._release import write_release

    data, ev = _digits()
    spec = PruneSpec(0.5, rounds=1, score="taylor", score_batches=2, target="channels", allocation="uniform",
                     heads="whole")
    cfg = _config(model=ModelSpec(f"{HERE}:tiny_vit"), prune=spec)
    assert CollabConfig.from_json(cfg.to_json()).prune.heads == "whole"
    assert '"heads"' not in _config(model=ModelSpec(f"{HERE}:tiny_vit")).to_json()  # the default: as before
    res = collaborate(cfg, data, eval_data=ev)
    assert ["attn", "heads", 2] in res.pruning["plan"]
    assert res.params["attn.qkv.weight"].shape == (24, 16) and res.params["attn.proj.weight"].shape == (16, 8)
    rel = write_release(tmp_path / "rel", cfg, res.params, res.pruning, ev)
    assert rel["params_after"] < rel["params_before"] and rel["onnx_check"]["argmax_agreement"] == 1.0


def test_attention_whose_shapes_are_constants_is_kept_whole_and_its_mlp_pruned():
    torch.manual_seed(0)
    model = TinyViT(FixedAttention).eval()
    ex = torch.zeros(2, 1, 8, 8)
    kept = P.kept_whole(model, ex)  # cutting head dimensions breaks its reshape: found on a copy, kept
    assert "attn.proj:in" in kept
    masked, cut, _, layout = _mask_cut(model, ex, 0.5)
    assert set(layout) == {"fc1"}
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(cut(x), masked(x), rtol=1e-5, atol=1e-5)
    assert cut.attn.qkv.out_features == 48 and cut.fc1.out_features == 16


# --------------------------------------------------------------------------- a user's model on unseen data
@pytest.mark.slow
def test_users_residual_cnn_on_unseen_data_prunes_releases_and_is_captured_again(tmp_path, capsys):
    """A residual CNN with BatchNorm the pruning was never tried on, on a data set no setting was chosen
    on (scikit-learn's digits upsampled to 16×16), through the command as a user runs it; its released
    ONNX captured again by ``pp.capture`` with the pruned widths, and searched."""
    from sklearn.datasets import load_digits

    import polyparallel as pp

    x, y = load_digits(return_X_y=True)
    x = np.kron((x / 16).astype(np.float32).reshape(-1, 1, 8, 8), np.ones((1, 1, 2, 2), np.float32))
    order = np.random.default_rng(1).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    d = tmp_path / "data"
    d.mkdir()
    for i, c in enumerate("abc"):
        np.savez(d / f"{c}.npz", x=x[i * 450:(i + 1) * 450], y=y[i * 450:(i + 1) * 450])
    np.savez(tmp_path / "ev.npz", x=x[1350:], y=y[1350:])
    rel = tmp_path / "rel"
    code, _, err = _run(["collab", "--centers", "a,b,c", "--data", str(d), "--eval-data", str(tmp_path / "ev.npz"),
                         "--fusion", "fedavg", "--model", f"{HERE}:user_rescnn", "--rounds", "10", "--local-steps",
                         "20", "--lr", "0.05", "--momentum", "0.9", "--prune", "0.5", "--prune-rounds", "5",
                         "--release", str(rel)], capsys)
    assert code == 0, err
    r = json.loads((rel / "release.json").read_text())
    assert r["params_after"] <= 0.5 * r["params_before"] and r["flops_after"] < 0.8 * r["flops_before"]
    assert r["accuracy_at_cut"] == pytest.approx(r["accuracy_before"])
    assert r["accuracy_after"] > 0.8  # 447 held-out digits, 10 classes
    assert r["onnx_check"]["argmax_agreement"] == 1.0 and r["pruning"]["kept_whole"] == []
    # the released ONNX, captured again: every weight with the pruned model's shape, the batch bound
    pruned = torch.export.load(str(rel / "model.pt2")).module()
    state = {k: tuple(v.shape) for k, v in pruned.state_dict().items()}
    g = pp.capture(rel / "model.onnx", dim_values={"batch": 8})
    convs = {n: t.shape for n, t in g.tensors.items() if n in state and n.endswith("weight") and len(t.shape) == 4}
    assert len(convs) == 6 and all(shape == state[n] for n, shape in convs.items())
    assert g.tensors["b2.body.0.weight"].shape[0] < 24  # narrower than the model the user wrote
    assert g.tensors[g.inputs[0]].shape == (8, 1, 16, 16) and g.tensors[g.outputs[0]].shape == (8, 10)
    s = pp.search(g, cluster="local-cpu:2")
    assert s.estimate.step_time_s > 0


def _masked_then_trained(model: nn.Module, seed: int) -> tuple[dict, dict]:
    """``(entries the mask zeroed, the parameters after 3 SGD steps)`` for half of every group masked."""
    ex = torch.zeros(2, 1, 8, 8)
    layout = P.group_scores(model, ex, P.saliency(model, "magnitude"))
    rng = np.random.default_rng(seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    P.mask_and_plan(model, ex, 0.5, {k: rng.random(len(v)) for k, v in layout.items()})
    zeroed = {n: (p.detach() == 0) & (before[n] != 0) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return zeroed, {n: p.detach() for n, p in model.named_parameters()}


def test_masked_channels_grow_back_only_where_a_zero_passes_a_gradient():
    # conv-BatchNorm-ReLU: a masked channel's ReLU input is exactly 0, where ReLU's gradient is 0, so no
    # entry the mask zeroed moves again (the docs: a ResNet's soft masks are hard ones)
    torch.manual_seed(0)
    zeroed, after = _masked_then_trained(_randomised_bn(UserResCNN()), 7)
    assert sum(int(z.sum()) for z in zeroed.values()) > 100  # conv rows, BatchNorm scales and shifts
    assert all(torch.all(after[n][z] == 0) for n, z in zeroed.items())
    # a linear layer before GELU (the MLP of a transformer): GELU'(0) = 1/2, the zeroed rows train again
    torch.manual_seed(0)
    zeroed, after = _masked_then_trained(TinyViT(), 7)
    assert int(zeroed["fc1.weight"].sum()) >= 16 * 16  # half of fc1's 32 rows, 16 inputs each
    assert torch.count_nonzero(after["fc1.weight"][zeroed["fc1.weight"]]) > 0.9 * int(zeroed["fc1.weight"].sum())
