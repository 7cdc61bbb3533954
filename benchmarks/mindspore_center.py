"""A data-parallel MindSpore center (msrun, 2 ranks, MCCL on CPU) against a data-parallel PyTorch center
(2 spawned ranks, gloo) and against one process of each framework (issue 38).

Same model (the built-in ``mlp``: Linear, LayerNorm, Linear), same data (scikit-learn's digits), same
start, same batches. For each trainer: the start-up (msrun / spawn, imports, rendezvous, map check),
the mean and min time of one round of ``-H`` local steps over ``--rounds`` rounds (the first round
after start-up included), and the update's max relative difference to the one-process MindSpore
center's update of round 1 (``max|a − b| / max|b|`` per tensor).

Run: ``.venv/bin/python benchmarks/mindspore_center.py`` (about 2 minutes on 2 cores); writes
``benchmarks/results/mindspore_center.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


def _measure(make: Any, g: dict[str, np.ndarray], steps: int, rounds: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    trainer = make()
    startup = time.perf_counter() - t0
    times, first = [], None
    try:
        params = g
        for r in range(1, rounds + 1):
            t = time.perf_counter()
            params, _ = trainer.train(g if r == 1 else params, steps=steps, round_idx=r)
            times.append(time.perf_counter() - t)
            if r == 1:
                first = params
    finally:
        getattr(trainer, "close", lambda: None)()
    return {"startup_s": startup, "round_s_mean": float(np.mean(times)), "round_s_min": float(np.min(times)),
            "rounds": times, "first": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", "-H", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/mindspore_center.json"))
    a = p.parse_args()

    import torch  # noqa: F401  (before MindSpore: the frameworks' import order)
    from sklearn.datasets import load_digits

    from polyparallel.backends.collab._center import TorchTrainer
    from polyparallel.backends.collab._dp_center import DataParallelTrainer
    from polyparallel.backends.collab._foreign import ForeignTrainer
    from polyparallel.backends.collab._mindspore_dp import MindSporeDataParallelTrainer
    from polyparallel.backends.collab._models import ModelSpec, build_torch_model, torch_state

    d = load_digits()
    x, y = (d.data / 16).astype(np.float32), d.target.astype(np.int64)
    spec = ModelSpec("mlp", (64,), 10, hidden=a.hidden)
    g = torch_state(build_torch_model(spec, 0))
    kw = dict(batch_size=a.batch, lr=0.1, momentum=0.9, seed=0)
    load_before = os.getloadavg()[0]
    trainers = {
        "mindspore, 1 process": lambda: ForeignTrainer(spec, x, y, framework="mindspore", **kw),
        "mindspore DP2 (msrun)": lambda: MindSporeDataParallelTrainer(spec, x, y, devices=2, **kw),
        "torch, 1 process": lambda: TorchTrainer(spec, x, y, **kw),
        "torch DP2 (spawn, gloo)": lambda: DataParallelTrainer(spec, x, y, devices=2, **kw),
    }
    rows = {name: _measure(make, g, a.steps, a.rounds) for name, make in trainers.items()}
    ref = rows["mindspore, 1 process"]["first"]
    for r in rows.values():
        r["rel_to_mindspore_1p"] = _rel(r.pop("first"), ref)
    out = {"setting": {"model": f"mlp 64-{a.hidden}-10 (LayerNorm)", "data": "sklearn digits (1797 rows)",
                       "local_steps": a.steps, "rounds": a.rounds, "batch": a.batch, "machine": platform.machine(),
                       "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()[0]},
           "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'center':26} {'start-up s':>10} {'round s (mean)':>15} {'round s (min)':>14} {'rel. to MS 1p':>14}")
    for name, r in rows.items():
        print(f"{name:26} {r['startup_s']:10.2f} {r['round_s_mean']:15.3f} {r['round_s_min']:14.3f} "
              f"{r['rel_to_mindspore_1p']:14.2e}")
    print(f"H={a.steps} steps of batch {a.batch}; load {load_before:.1f} -> {out['setting']['load_after']:.1f}; "
          f"wrote {a.out}")


if __name__ == "__main__":
    main()
