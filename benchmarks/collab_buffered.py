"""One center 3x slower: buffered asynchronous rounds (FedBuff) against synchronous ones.

The setting of ``benchmarks/collab_overlap.py`` (Fashion-MNIST, ``--train`` rows split over 5 centers by
Dirichlet(0.3), the CNN with GroupNorm, SGD lr 0.02 momentum 0.9, FedAvg, every link 100 Mbit/s and
30 ms), with the last center ``--factor`` times slower (it sleeps ``factor − 1`` times its own training
time after each round). Every mode runs on the same engine (centers in threads, ``buffer=K``): ``K = 5``
is the synchronous round bit for bit (``tests/test_collab_overlap.py``), ``K = 4`` and ``K = 3`` fuse the
first 4 or 3 updates in: once with the synchronous run's number of fusions, once with ``factor`` times
as many (about the synchronous run's wall time). Accuracy on the 10k test images; the slow center's
accepted updates with their mean staleness.

``--engine flower``: one Flower SuperNode process per center, the rounds on the lean data channel (the
server hands each center the newest version as soon as its update is in), the slow site emulated in its
own process (``CenterSpec.slowdown``).

Run: ``nice .venv/bin/python benchmarks/collab_buffered.py`` → ``benchmarks/results/collab_buffered.json``
(``--engine flower``: ``collab_buffered_flower.json``); the JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collab_overlap import DATA_DIR, _pooled, load_fashion_mnist, split

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess
from polyparallel.backends.collab._center import evaluate_torch
from polyparallel.backends.collab._flower import run_flower


def _write(args: argparse.Namespace, load0: tuple, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg()},
                                    "setting": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA_DIR))
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("-H", "--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--buffers", default="5,4,3")
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--engine", default="inprocess", help="inprocess (centers in threads) or flower (one "
                    "SuperNode process per center, the rounds on the lean data channel)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.out is None:
        args.out = Path(f"benchmarks/results/collab_buffered{'_flower' if args.engine == 'flower' else ''}.json")
    xtr, ytr, xte, yte = load_fashion_mnist(Path(args.data))
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load {load0}", flush=True)
    spec = ModelSpec("cnn", (1, 28, 28), 10, hidden=8, norm="group")
    bps, H, rows = 100e6 / 8, args.steps, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        sub = np.random.default_rng(seed).permutation(len(ytr))[:args.train]
        parts = split(ytr[sub], 5, 0.3, seed)
        names = [f"c{i}" for i in range(5)]
        data = {n: (xtr[sub][p], ytr[sub][p]) for n, p in zip(names, parts)}
        rounds = max(2, round(args.epochs * np.mean([len(p) for p in parts]) / (32 * H)))
        pooled = _pooled(spec, data, H, rounds, seed, xte, yte)
        for k, fusions in [(int(b), n) for b in args.buffers.split(",")
                           for n in ((rounds,) if int(b) == 5 else (rounds, round(rounds * args.factor)))]:
            cfg = CollabConfig(centers=tuple(CenterSpec(n, down_Bps=bps, up_Bps=bps, latency_s=0.03,
                                                        slowdown=args.factor if n == names[-1] else 1.0)
                                             for n in names),
                               model=spec, rounds=fusions, local_steps=H, batch_size=32, lr=0.02, momentum=0.9,
                               fusion="fedavg", seed=seed, buffer=k, max_staleness=8)
            t0 = time.time()
            res = (run_inprocess(cfg, data) if args.engine == "inprocess" else
                   run_flower(cfg, data, data_channel="socket", timeout_s=3600))
            wall = time.time() - t0
            acc = evaluate_torch(spec, res.params, xte, yte)["accuracy"]
            slow_m = [r.metrics[names[-1]] for r in res.rounds if names[-1] in r.metrics]
            row = {"seed": seed, "buffer": k, "rounds": fusions, "H": H, "accuracy": acc, "pooled": pooled,
                   "wall_s": wall, "round_s": float(np.median([r.seconds for r in res.rounds[1:]])),
                   "slow_center_updates": len(slow_m),
                   "slow_center_staleness": float(np.mean([m["staleness"] for m in slow_m])) if slow_m else None,
                   "refused": sum(len(r.rejected.get(names[-1], ())) for r in res.rounds),
                   "load": os.getloadavg()[0], "engine": args.engine}
            rows.append(row)
            _write(args, load0, rows)
            print(f"seed {seed} buffer {k}: {fusions} fusions in {wall:.1f} s (median round {row['round_s']:.3f} s), "
                  f"acc {100 * acc:.2f}% (pooled {100 * pooled:.2f}%), slow center fused {len(slow_m)} times "
                  f"(staleness {row['slow_center_staleness']}), refused {row['refused']} | load {row['load']:.1f}",
                  flush=True)
    sync = {r["seed"]: r for r in rows if r["buffer"] == 5}
    print("| buffer K | fusions | seeds | accuracy % | vs synchronous (points) | wall s | vs synchronous "
          "| median round s | slow center's updates fused | their mean staleness |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, many in sorted({(r["buffer"], r["rounds"] > sync[r["seed"]]["rounds"]) for r in rows}, reverse=True):
        g = [r for r in rows if r["buffer"] == k and (r["rounds"] > sync[r["seed"]]["rounds"]) == many]
        d = [100 * (r["accuracy"] - sync[r["seed"]]["accuracy"]) for r in g]
        w = [r["wall_s"] / sync[r["seed"]]["wall_s"] for r in g]
        st = [r["slow_center_staleness"] for r in g if r["slow_center_staleness"] is not None]
        print(f"| {k} | {g[0]['rounds']} | {len(g)} | {np.mean([100 * r['accuracy'] for r in g]):.2f} ± "
              f"{np.std([100 * r['accuracy'] for r in g]):.2f} | {np.mean(d):+.2f} ± {np.std(d):.2f} "
              f"| {np.mean([r['wall_s'] for r in g]):.1f} | {np.mean(w):.2f}x | "
              f"{np.mean([r['round_s'] for r in g]):.3f} | {np.mean([r['slow_center_updates'] for r in g]):.1f} "
              f"| {np.mean(st) if st else float('nan'):.2f} |")
    _write(args, load0, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
