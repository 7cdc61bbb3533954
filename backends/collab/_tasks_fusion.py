"""Fusing the task groups' models (*members*) into one cross-center model.

- ``average`` — members of one architecture: the collaborative backend's parameter fusion
  (:class:`~._fusion.FedAvg`, weighted by each member's training rows).
- ``ensemble`` — weighted ensembling: ``p(y|x) = Σ_k w_k softmax(z_k(x))``; the weights maximise the
  likelihood of the centers' held-out rows (EM on the mixture weights; each EM step a center returns
  only the sums of its rows' responsibilities). Exported as one module over all members.
- ``distill`` — ensemble distillation into one architecture (FedDF, Lin et al. 2020): the student starts
  from the target architecture's members (their parameter average), and minimises
  ``T² · KL(softmax(ensemble / T) ‖ softmax(student / T))`` on a transfer set — the task file's unlabeled
  ``public`` rows, or without one synthetic inputs made from the members themselves (DeepInversion-style,
  Yin et al. 2020: inputs optimised so that the ensemble is confident of a drawn label while every
  BatchNorm layer of the members sees its running statistics and the inputs keep the per-feature mean and
  variance the centers report as sums), mixed pairwise (mixup) at every step. The student is validated on
  the held-out rows every ``check_every`` steps and the best is kept.
- ``auto`` — every candidate that applies is validated on the centers' held-out rows (never the
  evaluation set); the smallest model within ``auto_tolerance`` of the best accuracy is taken.

Only counts and sums leave a center: the held-out rows are evaluated where they are (here, in this
process, one dataset at a time), and so are the feature moments of the synthetic inputs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ._center import torch_threads
from ._fusion import CenterUpdate, FedAvg
from ._models import ModelSpec, build_torch_model, load_torch_state, torch_state
from ._objective import TorchObjective
from ._pruning import example_input
from ._release import _export, onnx_check
from ._tasks import Data, Member, TaskSet

__all__ = ["Candidate", "FusionOutcome", "ensemble_module", "fuse_members", "infer", "logits_of", "write_outputs"]

FUSED_FILES = ("fused.pt2", "fused.onnx", "result.json")


class Logits(nn.Module):
    """The model's prediction tensor (its ``.logits``, a tuple's first element) as its one output."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self._objective = TorchObjective(model)

    def forward(self, x: Any) -> Any:
        return self._objective.outputs(self.model, x)


class Ensemble(nn.Module):
    """``log Σ_k w_k softmax(model_k(x))`` (log-probabilities; argmax is the ensemble's class)."""

    def __init__(self, models: Sequence[Any], weights: Sequence[float]) -> None:
        super().__init__()
        self.members = nn.ModuleList(models)
        w = torch.tensor(np.asarray(weights, dtype=np.float64), dtype=torch.float32)
        self.register_buffer("log_w", torch.log(w.clamp_min(1e-12)))

    def forward(self, x: Any) -> Any:
        z = torch.stack([torch.log_softmax(m(x), -1) for m in self.members])
        return torch.logsumexp(z + self.log_w[:, None, None], 0)


def member_module(spec: ModelSpec, params: Mapping[str, np.ndarray], seed: int = 0) -> Any:
    """The member's model with its parameters, in eval mode, returning logits."""
    m = build_torch_model(spec, seed)
    load_torch_state(m, dict(params))
    return Logits(m).eval()


def ensemble_module(models: Sequence[Any], weights: Sequence[float]) -> Any:
    """The weighted ensemble of ``models`` as one module, in eval mode."""
    return Ensemble(models, weights).eval()


def logits_of(model: Any, x: np.ndarray, batch: int = 1024) -> np.ndarray:
    """``model(x)`` in eval mode, batched, as float64 numpy."""
    model.eval()
    out = []
    with torch_threads(max(1, torch.get_num_threads())), torch.no_grad():
        for s in range(0, len(x), batch):
            out.append(model(torch.from_numpy(np.ascontiguousarray(x[s:s + batch]))).double().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def held_accuracy(model: Any, held: Mapping[str, Data]) -> float:
    """Accuracy on every center's held-out rows: each center counts its correct rows, the sums are pooled."""
    correct = n = 0
    for x, y in held.values():
        correct += int((logits_of(model, x).argmax(-1) == y).sum())
        n += len(y)
    return correct / max(n, 1)


def em_weights(members: Sequence[Any], held: Mapping[str, Data], iters: int = 100) -> np.ndarray:
    """Mixture weights maximising the held-out rows' likelihood of ``Σ w_k p_k(y|x)``: EM, each step every
    center returning only its sum of responsibilities (the probabilities stay at the center)."""
    local = []  # at each center: p_k(y_i | x_i), rows × members
    for x, y in held.values():
        lp = np.stack([_log_softmax(logits_of(m, x))[np.arange(len(y)), y] for m in members], 1)
        local.append(np.exp(lp))
    k = len(members)
    w = np.full(k, 1.0 / k)
    for _ in range(iters):
        sums, n = np.zeros(k), 0
        for p in local:  # the center's reply: Σ_i r_ik and its row count
            r = p * w
            r /= np.maximum(r.sum(1, keepdims=True), 1e-300)
            sums += r.sum(0)
            n += len(p)
        w_new = sums / max(n, 1)
        if np.max(np.abs(w_new - w)) < 1e-7:
            w = w_new
            break
        w = w_new
    return w


def average_members(members: Sequence[Member]) -> dict[str, np.ndarray]:
    """The backend's parameter fusion (FedAvg over the members, weighted by their training rows)."""
    updates = [CenterUpdate(m.name, m.params, m.samples) for m in members]
    return FedAvg().fuse(members[0].params, updates)


# ------------------------------------------------------------------------------------ distillation
def feature_moments(train: Mapping[str, Data]) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and standard deviation over every center's training rows, from the sums each center
    returns (Σx, Σx², n)."""
    s1 = s2 = None
    n = 0
    for x, _ in train.values():
        a = x.astype(np.float64)
        s1 = a.sum(0) if s1 is None else s1 + a.sum(0)
        s2 = (a * a).sum(0) if s2 is None else s2 + (a * a).sum(0)
        n += len(a)
    assert s1 is not None and s2 is not None
    mean = s1 / n
    return mean, np.sqrt(np.maximum(s2 / n - mean * mean, 1e-12))


def synthesize(teacher: Any, members: Sequence[Any], moments: tuple[np.ndarray, np.ndarray], classes: int, n: int,
               steps: int, seed: int, say: Callable[[str], None] = lambda _: None) -> np.ndarray:
    """``n`` inputs optimised so that the ``teacher`` gives a drawn label, the members' BatchNorm layers see
    their running statistics, and the per-feature moments are kept (the module docstring)."""

    g = torch.Generator().manual_seed(seed)
    mean, std = (torch.from_numpy(m.astype(np.float32)) for m in moments)
    x = (mean + std * torch.randn((n, *mean.shape), generator=g)).requires_grad_(True)
    y = torch.randint(0, classes, (n,), generator=g)
    bn_loss: list[Any] = []

    def hook(mod: Any, inp: Any, _out: Any) -> None:
        a = inp[0]
        dims = [0, *range(2, a.dim())]
        bn_loss.append(torch.norm(a.mean(dims) - mod.running_mean) + torch.norm(a.var(dims, unbiased=False)
                                                                                - mod.running_var))

    handles = [mod.register_forward_hook(hook) for m in members for mod in m.modules()
               if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None]
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([x], lr=0.05)
    batch = min(256, n)
    try:
        for step in range(steps):
            for s in range(0, n, batch):
                bn_loss.clear()
                xb = x[s:s + batch]
                loss = nn.functional.nll_loss(teacher(xb), y[s:s + batch])
                if bn_loss:
                    loss = loss + 0.1 * torch.stack(bn_loss).sum() / max(1, len(members))
                loss = loss + 1e-3 * (((xb - mean) / std) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            if (step + 1) % max(1, steps // 4) == 0:
                say(f"synthetic inputs: step {step + 1}/{steps}, loss {float(loss.detach()):.4f}")
    finally:
        for h in handles:
            h.remove()
        for p in teacher.parameters():
            p.requires_grad_(True)
    return x.detach().numpy()


@dataclass
class Distilled:
    params: dict[str, np.ndarray]
    val_accuracy: float
    best_step: int
    history: list[tuple[int, float]]
    transfer: str
    transfer_rows: int


def distill(spec: ModelSpec, init: Mapping[str, np.ndarray], teacher: Any, transfer: np.ndarray, synthetic: bool,
            held: Mapping[str, Data], opts: Any, seed: int, say: Callable[[str], None] = lambda _: None) -> Distilled:
    """FedDF's server step: the student (``spec`` from ``init``) trained towards the ``teacher``'s tempered
    distribution on ``transfer`` rows; validated on ``held`` every ``opts.check_every`` steps, best kept."""

    student = build_torch_model(spec, seed)
    load_torch_state(student, dict(init))
    net = Logits(student)
    teacher.eval()
    opt = torch.optim.Adam(student.parameters(), lr=opts.lr)
    rng = np.random.default_rng([seed, 0xD157])
    t = float(opts.temperature)
    best = (held_accuracy(net, held), 0, torch_state(student))
    history = [(0, best[0])]
    xs = torch.from_numpy(np.ascontiguousarray(transfer))
    # public rows are used as they are: the teacher's distribution on each is computed once
    cached = None if synthetic else torch.softmax(torch.from_numpy(logits_of(teacher, transfer)).float() / t, -1)
    bns = [m for m in student.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for step in range(1, opts.steps + 1):
        idx = torch.from_numpy(rng.integers(0, len(xs), opts.batch_size))
        xb = xs[idx]
        if synthetic:  # augmented: each row mixed with another (mixup), the mixing weight uniform
            lam = torch.from_numpy(rng.uniform(0, 1, (len(xb),) + (1,) * (xb.dim() - 1)).astype(np.float32))
            xb = lam * xb + (1 - lam) * xs[torch.from_numpy(rng.integers(0, len(xs), opts.batch_size))]
        if cached is not None:
            target = cached[idx]
        else:
            with torch.no_grad():
                target = torch.softmax(teacher(xb) / t, -1)
        student.train()
        for m in bns if synthetic else ():  # synthetic rows must not move the running statistics
            m.eval()
        loss = nn.functional.kl_div(torch.log_softmax(net(xb) / t, -1), target, reduction="batchmean") * t * t
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % opts.check_every == 0 or step == opts.steps:
            loss = loss.detach()
            acc = held_accuracy(net, held)
            history.append((step, acc))
            say(f"distill step {step}/{opts.steps}: KL {float(loss):.4f}, held-out accuracy {acc:.4f}")
            if acc > best[0]:
                best = (acc, step, torch_state(student))
    return Distilled(best[2], best[0], best[1], history, "synthetic" if synthetic else "public", len(transfer))


# ------------------------------------------------------------------------------------------- fusion
@dataclass
class Candidate:
    """One way to fuse: its module (logits or log-probabilities), held-out accuracy and size."""

    method: str
    module: Any
    val_accuracy: float
    params: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class FusionOutcome:
    chosen: Candidate
    candidates: dict[str, Candidate]
    member_modules: dict[str, Any]
    member_val: dict[str, float]
    averages: dict[str, Candidate]


def _size(module: Any) -> int:
    return int(sum(p.numel() for p in module.parameters()))


def fuse_members(ts: TaskSet, members: Sequence[Member], train: Mapping[str, Data], held: Mapping[str, Data],
                 public: np.ndarray | None, say: Callable[[str], None] = lambda _: None) -> FusionOutcome:
    """Fuse ``members`` as the task file says (``fusion``: auto, average, ensemble or distill)."""
    spec, seed = ts.spec, ts.spec.training.seed
    method = spec.fusion
    mods = {m.name: member_module(m.spec, m.params, seed) for m in members}
    member_val = {n: held_accuracy(mod, held) for n, mod in mods.items()}
    say("held-out accuracy of the members: " + ", ".join(f"{n} {a:.4f}" for n, a in member_val.items()))
    cands: dict[str, Candidate] = {}
    w = em_weights(list(mods.values()), held) if len(members) > 1 else np.ones(1)
    ens = ensemble_module(list(mods.values()), w)
    cands["ensemble"] = Candidate("ensemble", ens, held_accuracy(ens, held), _size(ens),
                                  {"weights": {m.name: float(x) for m, x in zip(members, w)}})
    by_arch: dict[str, list[Member]] = {}
    for m in members:
        by_arch.setdefault(m.spec.kind, []).append(m)
    averages = {}
    for kind, ms in by_arch.items():
        if len(ms) > 1:
            avg = member_module(ms[0].spec, average_members(ms), seed)
            averages[kind] = Candidate("average", avg, held_accuracy(avg, held), _size(avg),
                                       {"members": [m.name for m in ms], "model": kind})
    if len(by_arch) == 1 and next(iter(by_arch)) in averages:
        cands["average"] = averages[next(iter(by_arch))]
    if method in ("auto", "distill") and len(members) > 1:
        cands["distill"] = _distill_candidate(ts, members, by_arch, member_val, ens, mods, train, held, public, say)
    if method == "auto":
        best = max(c.val_accuracy for c in cands.values())
        ok = [c for c in cands.values() if c.val_accuracy >= best - spec.auto_tolerance]
        chosen = min(ok, key=lambda c: (c.params, -c.val_accuracy))
    elif len(members) == 1:
        chosen = Candidate("member", mods[members[0].name], member_val[members[0].name], _size(mods[members[0].name]))
    else:
        chosen = cands[method]
    say(f"fused by {chosen.method}: held-out accuracy {chosen.val_accuracy:.4f} (" +
        ", ".join(f"{k} {c.val_accuracy:.4f}" for k, c in cands.items()) + ")")
    return FusionOutcome(chosen, cands, mods, member_val, averages)


def _distill_candidate(ts: TaskSet, members: Sequence[Member], by_arch: Mapping[str, list[Member]],
                       member_val: Mapping[str, float], teacher: Any, mods: Mapping[str, Any],
                       train: Mapping[str, Data], held: Mapping[str, Data], public: np.ndarray | None,
                       say: Callable[[str], None]) -> Candidate:
    spec, seed = ts.spec, ts.spec.training.seed
    if spec.target is not None:
        kind = ts.spec.algorithms[spec.target].model
    else:  # the best member's architecture
        kind = max(members, key=lambda m: member_val[m.name]).spec.kind
    ms = by_arch[kind]
    init = average_members(ms) if len(ms) > 1 else ms[0].params
    if public is not None:
        transfer, synthetic = public, False
    else:
        classes = int(max(int(y.max()) for _, y in train.values()) + 1)
        say(f"no public set: making {spec.distill.synthetic} synthetic inputs from the members")
        transfer = synthesize(teacher, list(mods.values()), feature_moments(train), classes, spec.distill.synthetic,
                              spec.distill.synthesis_steps, seed, say)
        synthetic = True
    d = distill(ms[0].spec, init, teacher, transfer, synthetic, held, spec.distill, seed, say)
    mod = member_module(ms[0].spec, d.params, seed)
    return Candidate("distill", mod, d.val_accuracy, _size(mod),
                     {"target": kind, "init": [m.name for m in ms], "best_step": d.best_step, "transfer": d.transfer,
                      "transfer_rows": d.transfer_rows, "history": d.history, "steps": spec.distill.steps,
                      "temperature": spec.distill.temperature})


# ------------------------------------------------------------------------------------------ outputs
def accuracy(module: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float((logits_of(module, x).argmax(-1) == y).mean())


def export(module: Any, x_like: np.ndarray, out: Path, stem: str) -> dict[str, float]:
    """``OUT/STEM.pt2`` and ``OUT/STEM.onnx`` written as a release writes its model (``_release._export``),
    the ONNX checked under onnxruntime against torch on ``x_like``."""
    ex = example_input(x_like[:1])
    ex = ex if not ex.is_floating_point() else ex.normal_()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        _export(module, ex, Path(tmp))
        for suffix in ("pt2", "onnx"):
            shutil.move(str(Path(tmp) / f"model.{suffix}"), str(out / f"{stem}.{suffix}"))
    return onnx_check(out / f"{stem}.onnx", module, x_like)


def write_outputs(out: Path, ts: TaskSet, members: Sequence[Member], outcome: FusionOutcome, eval_data: Data,
                  held_rows: int, plans: Sequence[Any] = ()) -> dict[str, Any]:
    """``OUT/result.json``, ``OUT/fused.pt2``, ``OUT/fused.onnx`` and every member's parameters
    (``OUT/members/NAME.npz``); returns what result.json holds."""
    x, y = eval_data
    out.mkdir(parents=True, exist_ok=True)
    (out / "members").mkdir(exist_ok=True)
    res: dict[str, Any] = {"members": {}, "eval_rows": len(y), "held_out_rows": held_rows}
    for m in members:
        np.savez(out / "members" / f"{m.name}.npz", **m.params)
        mod = outcome.member_modules[m.name]
        last = m.result.rounds[-1] if m.result is not None and m.result.rounds else None
        res["members"][m.name] = {
            "algorithm": m.algorithm, "model": m.spec.kind, "loss": m.spec.loss, "accuracy": accuracy(mod, x, y),
            "val_accuracy": outcome.member_val[m.name], "params": _size(mod), "samples": m.samples,
            "centers": list(next(g.centers for g in ts.groups if g.name == m.name)),
            "rounds": len(m.result.rounds) if m.result is not None else 0, "seconds": m.seconds,
            "last_round": last.to_dict() if last is not None else None}
    ens = outcome.candidates["ensemble"]
    uniform = ensemble_module(list(outcome.member_modules.values()), np.full(len(members), 1 / len(members)))
    res["ensemble"] = {"accuracy": accuracy(ens.module, x, y), "val_accuracy": ens.val_accuracy,
                       "weights": ens.info["weights"], "uniform_accuracy": accuracy(uniform, x, y),
                       "params": ens.params}
    res["average"] = {kind: {"accuracy": accuracy(c.module, x, y), "val_accuracy": c.val_accuracy, **c.info}
                      for kind, c in outcome.averages.items()}
    if "distill" in outcome.candidates:
        c = outcome.candidates["distill"]
        res["distill"] = {"accuracy": accuracy(c.module, x, y), "val_accuracy": c.val_accuracy, "params": c.params,
                          **c.info}
    ch = outcome.chosen
    check = export(ch.module, x, out, "fused")
    res["fused"] = {"method": ch.method, "accuracy": accuracy(ch.module, x, y), "val_accuracy": ch.val_accuracy,
                    "params": ch.params, "fusion": ts.spec.fusion, "auto_tolerance": ts.spec.auto_tolerance,
                    "candidates": {k: c.val_accuracy for k, c in outcome.candidates.items()}, "onnx_check": check,
                    "files": ["fused.pt2", "fused.onnx"]}
    res["groups"] = [p.to_dict() for p in plans] or [
        {"group": g.name, "algorithm": g.algorithm, "model": g.model.kind, "datasets": list(g.datasets),
         "centers": list(g.centers), "rounds": g.rounds, "local_steps": g.local_steps} for g in ts.groups]
    (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def infer(out: Path, x: np.ndarray, use: str = "fused", runtime: str = "torch", seed: int = 0) -> np.ndarray:
    """The fused model's (``use="fused"``: ``fused.pt2`` in torch, or ``fused.onnx`` under onnxruntime) or
    the weighted ensemble's (``use="ensemble"``: rebuilt from ``members/NAME.npz`` and result.json's
    weights) outputs on ``x``: logits, or log-probabilities for an ensemble."""
    res = json.loads((out / "result.json").read_text())
    if use == "ensemble":
        mods = [member_module(ModelSpec(m["model"], loss=m["loss"]), dict(np.load(out / "members" / f"{n}.npz")),
                              seed) for n, m in res["members"].items()]
        w = [res["ensemble"]["weights"][n] for n in res["members"]]
        return logits_of(ensemble_module(mods, w), x)
    if runtime == "onnx":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out / "fused.onnx"), providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return np.concatenate([sess.run(None, {name: np.ascontiguousarray(x[s:s + 1024])})[0]
                               for s in range(0, len(x), 1024)]).astype(np.float64)
    prog = torch.export.load(str(out / "fused.pt2")).module()
    with torch.no_grad():
        return np.concatenate([prog(torch.from_numpy(np.ascontiguousarray(x[s:s + 1024]))).double().numpy()
                               for s in range(0, len(x), 1024)])
