"""Poisoned updates against the collaborative-training server: attack × fusion × centers → accuracy.

One center of 3 (or of 5) is malicious; the others train honestly on an IID split of scikit-learn's
digits (8×8, 10 classes) with a small MLP; the server evaluates every fused model on 20% held-out
digits. Attacks (``ATTACKS``), all through the in-process engine (the server code the Flower
deployment runs):

- ``huge``: ``1e30`` in every coordinate of the update;
- ``scaled``: the honest update × 1000;
- ``int8_scale``: an int8 payload (the run uses int8) whose row scales are ``3e38``;
- ``samples``: the honest update claiming ``1e9`` samples (``samples_declared``: the federation
  declared every center's count at enrolment; ``samples``: nothing declared, the server pins the first
  claim, capped);
- ``sign_flip``: ``−δ``, the honest update negated;
- ``replay``: the center's round-1 reply re-sent every round (refused: it names round 1 and the
  round-1 model);
- ``replay_forged``: the round-1 update re-sent with this round's metrics, round index, model digest
  and binding forged under this round's nonce (the center knows it): refused, the server has seen
  those bytes for another model;
- ``label_flip``: the center trains honestly on permuted labels (``y → (y + 1) mod 10``).

``none`` is the run with every center honest; ``absent`` the run without the malicious center at all.
Prints the table and writes ``benchmarks/results/collab_attacks.json``::

    .venv/bin/python benchmarks/collab_attacks.py            # the full table
    .venv/bin/python benchmarks/collab_attacks.py --quick    # 3 centers, fedavg only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))
if str(ROOT) not in sys.path:  # residual_cnn is loaded by reference, benchmarks.collab_attacks:residual_cnn
    sys.path.append(str(ROOT))

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, make_trainer, run_inprocess  # noqa: E402
from polyparallel.backends.collab._validation import bound_metrics  # noqa: E402
from polyparallel.backends.collab._wire import decode_update, encode_update  # noqa: E402

ATTACKS = ("none", "absent", "huge", "scaled", "int8_scale", "samples", "samples_declared", "sign_flip", "replay",
           "replay_forged", "label_flip")
FUSIONS = ("fedavg", "median", "trimmed_mean", "krum", "centered_clip", "fltrust")
SPEC = ModelSpec("mlp", (64,), 10, hidden=32)
BAD = "c0"  # the malicious center
ROOT_ROWS = 100  # the server's root set (FLTrust), never a center's training rows


def digits(n_centers: int) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """An IID split of 80% of the digits over ``n_centers`` centers, and the other 20% for evaluation."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    rows = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = rows[:cut], rows[cut:]
    return ({f"c{i}": (x[train[i::n_centers]], y[train[i::n_centers]]) for i in range(n_centers)},
            (x[test], y[test]))


def config(n_centers: int, fusion: str, *, compression: str = "none", declared: dict[str, int] | None = None,
           **kw: Any) -> CollabConfig:
    """The job: ``rounds`` of 10 local SGD steps; a round fuses with one center missing or refused."""
    centers = tuple(CenterSpec(f"c{i}", samples=(declared or {}).get(f"c{i}", 0)) for i in range(n_centers))
    return CollabConfig(centers=centers, model=SPEC, fusion=fusion, compression=compression,
                        min_centers=max(1, n_centers - 1),
                        **{"rounds": 8, "local_steps": 10, "batch_size": 32, "lr": 0.1, "momentum": 0.5, **kw})


def _recode(payload: dict[str, np.ndarray], method: str, f: Callable[[np.ndarray], np.ndarray]):
    return encode_update({k: f(v) for k, v in decode_update(payload, method).items()}, method)


def _rebound(f: Callable) -> Callable:
    """``f`` followed by what a malicious center does last: bind whatever it sends to this round's nonce."""
    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        p, m = f(r, p, m, nonce)
        return p, {**m, **bound_metrics(nonce, r, int(m["model_digest"]), p)}
    return tamper


def tampers(attack: str, method: str) -> dict[str, Callable]:
    """The malicious center's rewrite of its reply (``run_inprocess(tamper=...)``), bound to the round's
    nonce after the rewrite (except ``replay``, which re-sends its round-1 reply as it was)."""
    out = _tampers(attack, method)
    return out if attack == "replay" else {c: _rebound(f) for c, f in out.items()}


def _tampers(attack: str, method: str) -> dict[str, Callable]:
    if attack == "huge":
        return {BAD: lambda r, p, m, nonce: ({k: np.full_like(v, 1e30) for k, v in p.items()}, m)}
    if attack == "scaled":
        return {BAD: lambda r, p, m, nonce: (_recode(p, method, lambda d: d * 1000.0), m)}
    if attack == "sign_flip":
        return {BAD: lambda r, p, m, nonce: (_recode(p, method, lambda d: -d), m)}
    if attack == "int8_scale":
        return {BAD: lambda r, p, m, nonce: ({k: np.full_like(v, 3e38) if k.startswith("s/") else v
                                       for k, v in p.items()}, m)}
    if attack in ("samples", "samples_declared"):
        return {BAD: lambda r, p, m, nonce: (p, {**m, "num_samples": 1e9})}
    if attack in ("replay", "replay_forged"):
        first: dict[str, Any] = {}

        def replay(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
            old_p, old_m = first.setdefault("reply", (p, m))
            return (old_p, m) if attack == "replay_forged" else (old_p, old_m)
        return {BAD: replay}
    return {}


def run_case(attack: str, fusion: str, n_centers: int, **kw: Any) -> dict[str, Any]:
    """One federation under ``attack``: final accuracy and, per round, who was accepted and refused."""
    data, test = digits(n_centers)
    method = "int8" if attack == "int8_scale" else "none"
    declared = {c: len(v[1]) for c, v in data.items()} if attack == "samples_declared" else None
    if attack == "absent":
        data = {c: v for c, v in data.items() if c != BAD}
        cfg = config(n_centers, fusion, compression=method, **kw)
        cfg = CollabConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                              "centers": cfg.centers[1:], "min_centers": n_centers - 1})
    else:
        cfg = config(n_centers, fusion, compression=method, declared=declared, **kw)
    if attack == "label_flip":
        x, y = data[BAD]
        data = {**data, BAD: (x, (y + 1) % 10)}
    root = None
    if cfg.make_fusion().needs_root:  # the server's root set: 100 held-out digits, not evaluated on
        root, test = (test[0][:ROOT_ROWS], test[1][:ROOT_ROWS]), (test[0][ROOT_ROWS:], test[1][ROOT_ROWS:])
    t0 = time.perf_counter()
    res = run_inprocess(cfg, data, eval_data=test, tamper=tampers(attack, method), root_data=root)
    acc = res.rounds[-1].eval.get("accuracy", float("nan"))
    return {"attack": attack, "fusion": fusion, "centers": n_centers, "accuracy": 100.0 * acc,
            "fused_rounds": res.fused_rounds, "ok": res.ok,
            "bad_accepted": sum(BAD in r.accepted for r in res.rounds),
            "bad_rejected": sum(BAD in r.rejected for r in res.rounds),
            "honest_rejected": sum(len(set(r.rejected) - {BAD}) for r in res.rounds),
            "reasons": sorted({why[0].split(":")[0][:60] for r in res.rounds for c, why in r.rejected.items()}),
            "seconds": round(time.perf_counter() - t0, 2)}


# ------------------------------------------------------------------------ BatchNorm CNN, label skew, backdoor
BN_SPEC = ModelSpec("cnn", (1, 8, 8), 10, hidden=8)  # conv-BN-ReLU-pool twice, then a linear layer
#: a user model (the project's code does not know it): a small residual CNN with BatchNorm
RESNET_SPEC = ModelSpec("benchmarks.collab_attacks:residual_cnn", (1, 8, 8), 10)
SPECS = {"cnn": BN_SPEC, "resnet": RESNET_SPEC}


def residual_cnn() -> Any:
    """conv 3×3 (16)–BN–ReLU, one residual block (conv–BN–ReLU–conv–BN, + the input, ReLU), 2×2 max-pool,
    a second block, global average pool, linear 16 → 10 (11k parameters)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), Block(16),
                         nn.MaxPool2d(2), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
BN_ATTACKS = ("none", "absent", "sign_flip", "backdoor", "backdoor_boost", "replay_forged", "alie0.5", "alie1",
              "alie2", "alie3")
#: the omniscient and adaptive attacks (issue 33): the attacker answers last, having seen the honest
#: updates of the round, and sizes its update to the bounds it knows (run with --attacks)
ADAPTIVE_ATTACKS = ("ipm0.5", "ipm2", "sign_flip_norm", "sign_flip_bound", "sign_flip_cos", "backdoor_bound",
                    "backdoor_layer")
#: the cosine to the last global step an adaptive sign flip keeps (``sign_flip_cos``)
COS_KEPT = 0.05
#: how close to a bound an adaptive attacker goes (0.95: 5% under, a margin for the history's reference)
UNDER = 0.95
#: the per-layer bound an adaptive backdoor sizes its layers to when the server runs none
LAYER_GUESS = 3.0
BN_FUSIONS = ("fedavg", "centered_clip", "fltrust", "flame", "foolsgold")
TARGET = 0  # the backdoor's class
POISONED = 0.2  # share of the malicious center's rows carrying the trigger, relabelled TARGET
SKEW = 0.8  # share of a center's rows from its own classes (class k belongs to center k mod K)


def trigger(x: np.ndarray) -> np.ndarray:
    """The backdoor's pixel trigger: the bottom-right 2×2 pixels at full intensity."""
    x = x.copy()
    x[..., 6:, 6:] = 1.0
    return x


def skewed_digits(n_centers: int, seed: int, dirichlet: float = 0.0) -> tuple[
        dict[str, tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Label-skewed centers (``SKEW`` of a center's rows from its own classes; with ``dirichlet`` = α > 0
    instead each class's rows shared out by proportions drawn from Dir(α, ..., α)), the server's root set
    (``ROOT_ROWS`` rows, balanced by chance, no center's) and a 25% test set, all disjoint; images (1, 8, 8)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), d.target.astype(np.int64)
    rng = np.random.default_rng([seed, 0x5EED])
    rows = rng.permutation(len(y))
    n_test = len(y) // 4
    test, root, train = rows[:n_test], rows[n_test:n_test + ROOT_ROWS], rows[n_test + ROOT_ROWS:]
    if dirichlet > 0:
        where = np.zeros(len(train), dtype=np.int64)
        for k in range(10):
            rows_k = np.flatnonzero(y[train] == k)
            share = rng.dirichlet(np.full(n_centers, dirichlet))
            cuts = (np.cumsum(share)[:-1] * len(rows_k)).astype(int)
            for i, part in enumerate(np.split(rng.permutation(rows_k), cuts)):
                where[part] = i
    else:
        owner = y[train] % n_centers
        other = (owner + rng.integers(1, n_centers, len(train))) % n_centers
        where = np.where(rng.random(len(train)) < SKEW, owner, other)
    data = {f"c{i}": (x[train[where == i]], y[train[where == i]]) for i in range(n_centers)}
    return data, (x[root], y[root]), (x[test], y[test])


def attack_success(params: dict[str, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                   spec: ModelSpec = BN_SPEC) -> float:
    """% of test rows of another class than ``TARGET`` that the model puts in ``TARGET`` once triggered."""
    from polyparallel.backends.collab._center import evaluate_torch

    x, y = test
    keep = y != TARGET
    return 100.0 * evaluate_torch(spec, params, trigger(x[keep]), np.full(int(keep.sum()), TARGET))["accuracy"]


class _Recorder:
    """An honest center's trainer that lets the omniscient attacker read its update of each round."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.num_samples, self.updates, self.models = inner, inner.num_samples, {}, {}

    def train(self, global_params: dict[str, np.ndarray], **kw: Any) -> tuple[dict, dict]:
        self.models[kw["round_idx"]] = {k: np.asarray(v, np.float64) for k, v in global_params.items()}
        local, m = self.inner.train(global_params, **kw)
        self.updates[kw["round_idx"]] = {k: np.asarray(local[k], np.float64) - global_params[k] for k in global_params}
        return local, m

    def evaluate(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return self.inner.evaluate(params, x, y)


def _alie(z: float, honest: dict[str, _Recorder]) -> Callable:
    """ALIE (Baruch et al. 2019), omniscient: the coordinate-wise mean of the honest updates minus ``z``
    of their standard deviations, sent in place of the attacker's own."""
    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        ups = [h.updates[r] for h in honest.values()]
        return encode_update({k: np.mean([u[k] for u in ups], axis=0) - z * np.std([u[k] for u in ups], axis=0)
                              for k in ups[0]}), m
    return tamper


def _ipm(eps: float, honest: dict[str, _Recorder]) -> Callable:
    """IPM (inner product manipulation, Xie, Koyejo & Gupta 2020), omniscient: ``−ε`` × the mean of the
    honest updates, whose inner product with the honest mean is negative."""
    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        ups = [h.updates[r] for h in honest.values()]
        return encode_update({k: -eps * np.mean([u[k] for u in ups], axis=0) for k in ups[0]}), m
    return tamper


def _norm(d: dict[str, np.ndarray], names: Sequence[str] | None = None) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(d[k]))) for k in (names or d))))


def _upper_median(values: Sequence[float]) -> float:
    return float(sorted(values)[len(values) // 2])


def _sized(kind: str, norm_bound: float, layer_bound: float, honest: dict[str, _Recorder]) -> Callable:
    """The adaptive attacks: the attacker's own update (``kind`` ``flip``: negated) scaled to just under the
    bounds the server checks, as the attacker computes them from the honest updates of the round (the
    upper median of the round's norms with its own, larger, among them; ``UNDER`` of the way).

    ``norm``: to the median honest norm; ``bound``: to just under ``norm_bound``; ``layer``: every trained
    tensor to just under ``layer_bound`` (``LAYER_GUESS`` when the server runs none) × that tensor's upper
    median, then all of it down to just under ``norm_bound`` if it exceeds it."""
    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        own = {k: np.asarray(v, np.float64) for k, v in decode_update(p, "none").items()}
        if kind.startswith("flip"):
            own = {k: -v for k, v in own.items()}
        ups = [h.updates[r] for h in honest.values()]
        ref = _upper_median([_norm(u) for u in ups] + [np.inf])
        if kind.endswith("norm"):
            own = {k: v * float(np.median([_norm(u) for u in ups])) / _norm(own) for k, v in own.items()}
        if kind.endswith("layer"):
            for k in (k for k in own if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))):
                ref_k = _upper_median([_norm(u, [k]) for u in ups] + [np.inf])
                if _norm(own, [k]) > 0:
                    own[k] = own[k] * UNDER * (layer_bound or LAYER_GUESS) * ref_k / _norm(own, [k])
        if kind.endswith(("bound", "layer")) and (kind.endswith("bound") or _norm(own) > UNDER * norm_bound * ref):
            own = {k: v * UNDER * norm_bound * ref / _norm(own) for k, v in own.items()}
        return encode_update({k: v.astype(np.float32) for k, v in own.items()}), m
    return tamper


def _flip_cos(honest: dict[str, _Recorder]) -> Callable:
    """A sign flip that keeps a small positive cosine (``COS_KEPT``) to the last global step, which every
    center sees (the difference of the last two global models it received), and to the mean of this
    round's honest updates (omniscient): ``−δ`` with just enough added along each (a few alternating
    passes), over the trained tensors."""
    rec = next(iter(honest.values()))

    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        own = {k: -np.asarray(v, np.float64) for k, v in decode_update(p, "none").items()}
        names = [k for k in own if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
        steps = [{k: rec.models[t][k] - rec.models[t - 1][k] for k in names} for t in range(r, 1, -1)]
        ups = [h.updates[r] for h in honest.values()]
        refs = [{k: np.mean([u[k] for u in ups], axis=0) for k in names},
                *[s for s in steps if _norm(s) > 0][:1]]
        u = {k: own[k] for k in names}
        for _ in range(8):
            for ref in refs:
                w = {k: ref[k] / _norm(ref) for k in names}
                along = sum(float(np.sum(u[k] * w[k])) for k in names)
                perp = _norm({k: u[k] - along * w[k] for k in names})
                want = 1.05 * COS_KEPT * perp / np.sqrt(1.0 - COS_KEPT ** 2)
                if along < want:
                    u = {k: u[k] + (want - along) * w[k] for k in names}
        own.update(u)
        return encode_update({k: v.astype(np.float32) for k, v in own.items()}), m
    return tamper


def fusion_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME`` or ``NAME:OPT=NUMBER,...`` (``flame:noise=0.01``) -> the fusion and its options."""
    name, _, opts = spec.partition(":")
    return name, {k: float(v) for k, v in (o.split("=", 1) for o in opts.split(",") if o)}


def defence_spec(spec: str) -> tuple[str, dict[str, float], dict[str, float]]:
    """A :func:`fusion_spec` with server checks after ``+``: ``centered_clip+layer_bound=3`` -> the fusion,
    its options and more :class:`CollabConfig` fields."""
    fusion, _, checks = spec.partition("+")
    return (*fusion_spec(fusion), {k: float(v) for k, v in (o.split("=", 1) for o in checks.split(",") if o)})


def run_bn_case(attack: str, fusion: str, n_centers: int, seed: int, rounds: int = 10, *, model: str = "cnn",
                dirichlet: float = 0.0, record: dict[str, _Recorder] | None = None, **kw: Any) -> dict[str, Any]:
    """One label-skewed federation of the BatchNorm CNN under ``attack`` (``BN_ATTACKS``); ``fusion``: a
    :func:`fusion_spec`; ``kw``: more :class:`CollabConfig` fields (e.g. ``min_cosine``). ``record``: a dict
    that receives every center's :class:`_Recorder` (the global model and the update of each round; not the
    omniscient attacker's), for offline analyses (``collab_crowdguard_probe.py``)."""
    data, root, test = skewed_digits(n_centers, seed, dirichlet)
    names = list(data)
    if attack == "absent":
        names = names[1:]
    if attack.startswith("backdoor"):
        x, y = data[BAD]
        k = int(POISONED * len(y))
        pick = np.random.default_rng([seed, 0xBAD]).permutation(len(y))[:k]
        x, y = x.copy(), y.copy()
        x[pick], y[pick] = trigger(x[pick]), TARGET
        data = {**data, BAD: (x, y)}
    omniscient = attack.startswith("alie") or attack in ADAPTIVE_ATTACKS
    if omniscient:  # the attacker answers last, having seen the honest updates
        names = [*names[1:], BAD]
    name, options, checks = defence_spec(fusion)
    cfg = CollabConfig(centers=tuple(CenterSpec(c) for c in names), model=SPECS[model], fusion=name,
                       fusion_options=options, min_centers=max(1, len(names) - (attack != "absent")), rounds=rounds,
                       local_steps=10, batch_size=32, lr=0.05, momentum=0.5, seed=seed, **{**checks, **kw})
    tamper = {}
    if attack == "sign_flip":
        tamper = tampers("sign_flip", "none")
    elif attack == "replay_forged":
        tamper = tampers("replay_forged", "none")
    elif attack == "backdoor_boost":  # scaled to just under the norm bound (k = 4 × the honest norms)
        tamper = {BAD: _rebound(lambda r, p, m, nonce: (_recode(p, "none", lambda d: d * 3.5), m))}
    trainers = None
    if omniscient:
        trainers = {c: _Recorder(make_trainer(cfg, c, *data[c])) for c in names if c != BAD}
        if attack.startswith("alie"):
            tamper = {BAD: _rebound(_alie(float(attack[4:]), trainers))}
        elif attack.startswith("ipm"):
            tamper = {BAD: _rebound(_ipm(float(attack[3:]), trainers))}
        elif attack == "sign_flip_cos":
            tamper = {BAD: _rebound(_flip_cos(trainers))}
        else:
            kind = {"sign_flip_norm": "flip_norm", "sign_flip_bound": "flip_bound", "backdoor_bound": "bound",
                    "backdoor_layer": "layer"}[attack]
            tamper = {BAD: _rebound(_sized(kind, cfg.norm_bound, cfg.layer_bound, trainers))}
    if record is not None:
        trainers = trainers or {c: _Recorder(make_trainer(cfg, c, *data[c])) for c in names}
        record.update(trainers)
    t0 = time.perf_counter()
    res = run_inprocess(cfg, {c: data[c] for c in names}, eval_data=test,
                        tamper=tamper, trainers=trainers, root_data=root if cfg.make_fusion().needs_root else None)
    audit = [{c: {k: round(v, 4) for k, v in m.items()
                  if k in ("update_norm", "cos_fused", "cos_others", "cos_root", "cos_consensus", "trust",
                           "layer_ratio")}
              for c, m in r.metrics.items()} for r in res.rounds]
    return {"attack": attack, "fusion": fusion, "centers": n_centers, "seed": seed, "model": model,
            "dirichlet": dirichlet, **kw,
            "accuracy": 100.0 * res.rounds[-1].eval.get("accuracy", float("nan")),
            "attack_success": attack_success(res.params, test, SPECS[model]), "fused_rounds": res.fused_rounds,
            "bad_accepted": sum(BAD in r.accepted for r in res.rounds),
            "bad_rejected": sum(BAD in r.rejected for r in res.rounds),
            "honest_rejected": sum(len(set(r.rejected) - {BAD}) for r in res.rounds),
            "bad_untrusted": sum(r.get(BAD, {}).get("trust", 1.0) <= 0 for r in audit),  # fused without it
            "honest_untrusted": sum(m.get("trust", 1.0) <= 0 for r in audit for c, m in r.items() if c != BAD),
            "audit": audit, "seconds": round(time.perf_counter() - t0, 2)}


def _grid(rows: Sequence[dict[str, Any]], title: Callable[[int], str], width: int, first: int,
          cell: Callable[[str, str, int], str | None]) -> str:
    """Attack × fusion tables, one per center count: ``cell(attack, fusion, centers)`` (None: ``-``)."""
    fusions = list(dict.fromkeys(r["fusion"] for r in rows))
    out = []
    for n in sorted({r["centers"] for r in rows}):
        out += [title(n), f"{'attack':<{first}}" + "".join(f"{f:>{width}}" for f in fusions)]
        for a in dict.fromkeys(r["attack"] for r in rows):
            out.append(f"{a:<{first}}" + "".join(f"{cell(a, f, n) or '-':>{width}}" for f in fusions))
    return "\n".join(out)


def bn_table(rows: Sequence[dict[str, Any]]) -> str:
    """Mean over seeds: accuracy % (attack success % for the backdoors), and the worst seed's change
    against ``absent`` of the same seed."""
    def title(n: int) -> str:
        seeds = {r["seed"] for r in rows if r["centers"] == n}
        r0 = next(r for r in rows if r["centers"] == n)
        skew = f"Dirichlet {r0['dirichlet']:g}" if r0.get("dirichlet") else f"label skew {SKEW:g}"
        return (f"\n1 malicious of {n} ({r0.get('model', 'cnn')}, {skew}, {len(seeds)} seeds): mean accuracy % "
                "[worst seed − absent]; backdoors: (attack success %)")

    def cell(a: str, f: str, n: int) -> str | None:
        got = {r["seed"]: r for r in rows if (r["attack"], r["fusion"], r["centers"]) == (a, f, n)}
        base = {r["seed"]: r for r in rows if (r["attack"], r["fusion"], r["centers"]) == ("absent", f, n)}
        if not got:
            return None
        out = f"{np.mean([r['accuracy'] for r in got.values()]):.1f}"
        if a != "absent" and base and set(got) <= set(base):
            out += f" [{min(got[s]['accuracy'] - base[s]['accuracy'] for s in got):+.1f}]"
        if a.startswith("backdoor") or a == "none":
            out += f" ({np.mean([r['attack_success'] for r in got.values()]):.0f})"
        return out
    return _grid(rows, title, 28, 16, cell)


def verdict_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per fusion and center count, issue 33's bars: the honest-only federation's mean change against
    FedAvg's on the same seeds (bar: ≥ −0.5), the attacks whose worst seed is more than 1 point under
    ``absent`` (same fusion, same seed), the backdoors' mean attack success (bar: ≤ 10%), and the rounds
    in which the fusion gave the attacker / an honest center no trust."""
    out = ["\nfusion, K: honest-only vs fedavg (mean, worst seed) | attacks > 1 point under absent (worst seed) | "
           "backdoor success % | attacker / honest untrusted rounds"]
    for n in sorted({r["centers"] for r in rows}):
        fed = {r["seed"]: r["accuracy"] for r in rows
               if (r["fusion"], r["attack"], r["centers"]) == ("fedavg", "none", n)}
        for f in dict.fromkeys(r["fusion"] for r in rows):
            mine = [r for r in rows if r["fusion"] == f and r["centers"] == n]
            none = {r["seed"]: r["accuracy"] for r in mine if r["attack"] == "none"}
            base = {r["seed"]: r["accuracy"] for r in mine if r["attack"] == "absent"}
            common = sorted(set(none) & set(fed))
            diff = [none[s] - fed[s] for s in common]
            honest = f"{np.mean(diff):+.2f} ({min(diff):+.1f})" if common else "-"
            bad = []
            for a in dict.fromkeys(r["attack"] for r in mine if r["attack"] not in ("none", "absent")):
                d = [r["accuracy"] - base[r["seed"]] for r in mine if r["attack"] == a and r["seed"] in base]
                if d and min(d) < -1.0:
                    bad.append(f"{a} {min(d):+.1f}")
            asr = " ".join(f"{a}:{np.mean([r['attack_success'] for r in mine if r['attack'] == a]):.0f}"
                           for a in dict.fromkeys(r["attack"] for r in mine if r["attack"].startswith("backdoor")))
            untrusted = (f"{sum(r['bad_untrusted'] for r in mine if r['attack'] not in ('none', 'absent'))}/"
                         f"{sum(r['honest_untrusted'] for r in mine)}")
            out.append(f"{f:>40} K={n}: {honest:>14} | {', '.join(bad) or 'none'} | {asr} | {untrusted}")
    return "\n".join(out)


def table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(a: str, f: str, n: int) -> str | None:
        r = next((r for r in rows if r["attack"] == a and r["fusion"] == f and r["centers"] == n), None)
        if r is None:
            return None
        acc = f"{r['accuracy']:.1f}" + ("" if r["ok"] else " FAIL")
        ar = "" if a in ("none", "absent") else f" {r['bad_accepted']}/{r['bad_rejected']}"
        return acc + ar + (f" !h{r['honest_rejected']}" if r["honest_rejected"] else "")
    return _grid(rows, lambda n: f"\n1 malicious of {n} centers: final accuracy % (malicious reply accepted/rejected "
                 "over 8 rounds; !h = honest replies rejected)", 20, 18, cell)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 centers, fedavg only")
    ap.add_argument("--fusions", nargs="*", default=list(FUSIONS),
                    help="bn: NAME or NAME:OPT=NUMBER,... (flame:noise=0.01), then +FIELD=NUMBER,... for server "
                    "checks (centered_clip:min_cos=0+layer_bound=3)")
    ap.add_argument("--centers", nargs="*", type=int, default=[3, 5])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", choices=("mlp", "bn"), default="mlp",
                    help="mlp: the IID MLP table; bn: BatchNorm CNN under label skew, backdoors, seeds")
    ap.add_argument("--seeds", type=int, default=3, help="bn: seeds per cell")
    ap.add_argument("--first-seed", type=int, default=0, help="bn: seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--attacks", nargs="*", default=None,
                    help="bn: a subset of " + ", ".join(BN_ATTACKS + ADAPTIVE_ATTACKS))
    ap.add_argument("--model", choices=sorted(SPECS), default="cnn",
                    help="bn: the built-in cnn, or resnet (a user model: a residual CNN with BatchNorm)")
    ap.add_argument("--dirichlet", type=float, default=0.0,
                    help="bn: label skew by Dirichlet(α) proportions per class instead of 80%% own classes")
    ap.add_argument("--min-cosine", type=float, default=None, help="CollabConfig.min_cosine (default: the config's)")
    ap.add_argument("--from-json", type=Path, nargs="*", default=None,
                    help="bn: print the tables of results files (their rows together), run nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        rows = [r for f in args.from_json for r in json.loads(f.read_text())["rows"]]
        print(bn_table(rows))
        print(verdict_table(rows))
        return 0
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)  # the rejections are in the table
    kw = {} if args.min_cosine is None else {"min_cosine": args.min_cosine}
    if args.part == "bn":
        fusions = list(BN_FUSIONS) if args.fusions == list(FUSIONS) else args.fusions
        rows = []
        for n in args.centers:
            for f in fusions:
                for a in args.attacks or BN_ATTACKS:
                    for s in range(args.first_seed, args.first_seed + args.seeds):
                        rows.append(run_bn_case(a, f, n, s, model=args.model, dirichlet=args.dirichlet, **kw))
                        r = rows[-1]
                        print(f"{n} {f} {a} seed {s}: {r['accuracy']:.1f}% (attack success {r['attack_success']:.0f}%, "
                              f"{r['seconds']:.1f} s)", file=sys.stderr, flush=True)
        print(bn_table(rows))
        print(verdict_table(rows))
        out = args.out or ROOT / "benchmarks" / "results" / "collab_attacks_bn.json"
        skew = f"Dirichlet {args.dirichlet:g}" if args.dirichlet > 0 else SKEW
        out.write_text(json.dumps({"model": f"{SPECS[args.model]}", "skew": skew, "poisoned": POISONED,
                                   "target": TARGET, "root_rows": ROOT_ROWS, "rounds": 10, "local_steps": 10,
                                   "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {out}")
        return 0
    args.out = args.out or ROOT / "benchmarks" / "results" / "collab_attacks.json"
    fusions, centers = (["fedavg"], [3]) if args.quick else (args.fusions, args.centers)
    rows = [run_case(a, f, n, **kw) for n in centers for f in fusions for a in ATTACKS]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "mlp 64-32-10, sklearn digits (80/20 split, IID over centers)",
                                    "rounds": 8, "local_steps": 10, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
