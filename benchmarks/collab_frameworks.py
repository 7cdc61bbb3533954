"""Four frameworks in one federation (issue 37): a PyTorch, a MindSpore, a PaddlePaddle and a TensorFlow
center against four PyTorch centers, on Fashion-MNIST, same seeds, same data, same job.

For the built-in ``cnn`` and for a user CNN given once per framework (``examples/models/cnn_frameworks.py``):

- ``equal_start``: every center gets the *same* rows and starts from the same model; after one round of
  H = 1, 3 and ``-H`` local steps, the fused model of the mixed federation vs the all-torch one: max
  relative difference over the tensors (``max|a − b| / max|b|`` per tensor), beside the same figure for
  the all-torch federation run with 2 intra-op threads instead of 1 (the same computation, only rounded
  otherwise: how far float32 rounding alone moves this model in H steps); on the raw rows and on rows
  with N(0, 1e-3) noise (``ties_broken``: the images' constant background ties max-pooling maxima
  exactly, and which element takes a tie's gradient turns on rounding, in torch alone too);
- ``federation``: ``--train`` rows split IID over the 4 centers, ``--rounds`` rounds of ``-H`` local steps
  (default fusion: centered_clip, with the server's validation), accuracy of the fused model on the
  official 10k test rows after the last round, mixed vs all-torch (target: within 0.5 points);
- per-framework mean local step time (the center's ``train`` call over its steps, map conversion
  included) and the mean round time, from the mixed federation; all centers run one after the other in
  this process (the in-process engine), one intra-op thread for torch.

Run: ``.venv/bin/python benchmarks/collab_frameworks.py`` (about 5 minutes on 2 cores); writes
``benchmarks/results/collab_frameworks.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]  # the user models (models.*) and the Fashion-MNIST loader
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from collab_fashion_mnist import DATA_DIR, load_fashion_mnist, split  # noqa: E402

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, make_trainer, run_inprocess  # noqa: E402
from polyparallel.backends.collab._foreign import IMPORT_ORDER, import_frameworks  # noqa: E402

FRAMEWORKS = ("torch", "mindspore", "paddle", "tensorflow")
NAMES = ("pt", "ms", "pd", "tf")
USER = ModelSpec("models.cnn_frameworks:torch_cnn", loss="cross_entropy",
                 builders={"mindspore": "models.cnn_frameworks:mindspore_cnn",
                           "paddle": "models.cnn_frameworks:paddle_cnn",
                           "tensorflow": "models.cnn_frameworks:keras_cnn"})
MODELS = {"cnn": ModelSpec("cnn", (1, 28, 28), 10, hidden=16), "user_cnn": USER}


class Timed:
    """A center's trainer whose ``train`` calls are timed (seconds and steps, per call)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.calls = trainer, []
        self.num_samples = trainer.num_samples

    def train(self, params: Any, *, steps: int, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self.trainer.train(params, steps=steps, **kw)
        self.calls.append((time.perf_counter() - t0, steps))
        return out

    def __getattr__(self, name: str) -> Any:  # everything else is the trainer's
        return getattr(self.trainer, name)


def _config(spec: ModelSpec, frameworks: tuple[str, ...], **kw: Any) -> CollabConfig:
    return CollabConfig(centers=tuple(CenterSpec(n, framework=f) for n, f in zip(NAMES, frameworks)), model=spec, **kw)


def _max_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str]:
    rel = {k: float(np.abs(a[k] - b[k]).max() / max(float(np.abs(b[k]).max()), 1e-12)) for k in b}
    worst = max(rel, key=rel.__getitem__)
    return rel[worst], worst


def _torch_threads(cfg: CollabConfig, data: dict[str, Any], threads: int) -> dict[str, Any]:
    trainers = {}
    for n in NAMES:
        trainers[n] = make_trainer(cfg, n, *data[n])
        trainers[n].threads = threads
    return trainers


def equal_start(spec: ModelSpec, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """After one round from an equal start on the same rows, at several H: the mixed federation vs the all-torch
    one, beside the all-torch one with 2 intra-op threads vs 1 (the same computation, rounded otherwise)."""
    out: dict[str, Any] = {"rows": len(y)}
    # Fashion-MNIST's constant background gives tied maxima in the max-pooling windows: which element takes a
    # tie's gradient turns on float32 rounding (torch with 2 threads differs from torch with 1 as much as the
    # other frameworks do); N(0, 1e-3) noise on the rows breaks the exact ties
    noisy = x + np.random.default_rng(5).normal(scale=1e-3, size=x.shape).astype(np.float32)
    for steps in sorted({1, 3, args.H}):
        kw = dict(rounds=1, local_steps=steps, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                  seed=args.seed)
        for tag, xs in (("raw", x), ("ties_broken", noisy)):
            data = dict.fromkeys(NAMES, (xs, y))
            ref_cfg = _config(spec, ("torch",) * 4, **kw)
            mixed = run_inprocess(_config(spec, FRAMEWORKS, **kw), data)
            ref = run_inprocess(ref_cfg, data)
            ref2 = run_inprocess(ref_cfg, data, trainers=_torch_threads(ref_cfg, data, 2))
            err, worst = _max_rel(mixed.params, ref.params)
            err2, worst2 = _max_rel(ref2.params, ref.params)
            out[f"H{steps}_{tag}"] = {"local_steps": steps, "max_rel_param_diff": err, "worst_tensor": worst,
                                      "torch_2_threads_max_rel_param_diff": err2, "torch_2_threads_worst": worst2,
                                      "accepted": list(mixed.rounds[0].accepted)}
    return out


def federation(spec: ModelSpec, frameworks: tuple[str, ...], data: dict[str, Any], test: Any,
               args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(spec, frameworks, rounds=args.rounds, local_steps=args.H, batch_size=args.batch_size, lr=args.lr,
                  momentum=args.momentum, seed=args.seed)
    t0 = time.perf_counter()
    trainers = {n: Timed(make_trainer(cfg, n, *data[n])) for n in NAMES}
    setup = time.perf_counter() - t0
    res = run_inprocess(cfg, data, trainers=trainers, eval_data=test)
    step = {f: float(np.mean([s / n for c, g in zip(NAMES, frameworks) if g == f for s, n in trainers[c].calls]))
            for f in dict.fromkeys(frameworks)}
    return {"frameworks": list(frameworks), "accuracy": res.rounds[-1].eval["accuracy"],
            "loss": res.rounds[-1].eval["loss"], "accuracy_per_round": [r.eval["accuracy"] for r in res.rounds],
            "fused_rounds": res.fused_rounds, "round_s_mean": float(np.mean([r.seconds for r in res.rounds])),
            "step_s_by_framework": step, "setup_s": setup, "params": res.params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(DATA_DIR))
    p.add_argument("--train", type=int, default=12000, help="training rows, split IID over the 4 centers")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("-H", type=int, default=20, help="local steps per round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default="cnn,user_cnn")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/collab_frameworks.json"))
    args = p.parse_args()
    import_frameworks(IMPORT_ORDER)  # all four share this process only in this order
    xtr, ytr, xte, yte = load_fashion_mnist(Path(args.data))
    rng = np.random.default_rng(args.seed)
    rows = rng.permutation(len(ytr))[:args.train]
    xtr, ytr = xtr[rows], ytr[rows]
    parts = split(ytr, len(NAMES), None, args.seed)
    data = {n: (xtr[idx], ytr[idx]) for n, idx in zip(NAMES, parts)}
    out: dict[str, Any] = {
        "setting": {"data": "Fashion-MNIST (Debian dataset-fashion-mnist)", "train_rows": args.train,
                    "split": "IID over 4 centers", "test_rows": len(yte), "rounds": args.rounds,
                    "local_steps": args.H, "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
                    "seed": args.seed, "fusion": "centered_clip (default, with validation)",
                    "engine": "in-process (centers one after the other)", "machine": platform.processor() or
                    platform.machine(), "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]},
        "models": {}}
    for name in args.models.split(","):
        spec = MODELS[name]
        row: dict[str, Any] = {"equal_start": equal_start(spec, xtr[:2000], ytr[:2000], args)}
        mixed = federation(spec, FRAMEWORKS, data, (xte, yte), args)
        ref = federation(spec, ("torch",) * 4, data, (xte, yte), args)
        err, worst = _max_rel(mixed.pop("params"), ref.pop("params"))
        row.update(mixed=mixed, torch=ref, accuracy_diff_points=100 * (mixed["accuracy"] - ref["accuracy"]),
                   final_max_rel_param_diff=err, final_worst_tensor=worst)
        out["models"][name] = row
        _print(name, row)
    out["setting"]["load_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


def _print(name: str, row: dict[str, Any]) -> None:
    m, t = row["mixed"], row["torch"]
    e = row["equal_start"]
    print(f"\n{name}: one round from an equal start on the same {e['rows']} rows, max relative param diff, "
          "mixed vs 4 x torch (4 x torch with 2 threads vs 1 thread)")
    for key, v in e.items():
        if key != "rows":
            print(f"  H={v['local_steps']:<3} {key.split('_', 1)[1]:<12} {v['max_rel_param_diff']:.2e} "
                  f"({v['worst_tensor']})   ({v['torch_2_threads_max_rel_param_diff']:.2e} "
                  f"{v['torch_2_threads_worst']})")
    print(f"{'federation':<28}{'accuracy':>10}{'round s':>10}" + "".join(f"{f + ' step ms':>18}" for f in FRAMEWORKS))
    for label, r in (("pt+ms+pd+tf", m), ("4 x pt", t)):
        print(f"{label:<28}{100 * r['accuracy']:>9.2f}%{r['round_s_mean']:>10.2f}"
              + "".join(f"{1e3 * r['step_s_by_framework'].get(f, float('nan')):>18.2f}" for f in FRAMEWORKS))
    print(f"accuracy difference {row['accuracy_diff_points']:+.2f} points; final max relative param diff "
          f"{row['final_max_rel_param_diff']:.2e} ({row['final_worst_tensor']})")


if __name__ == "__main__":
    main()
