"""Overlapped fusion against synchronous rounds on emulated WAN links, measured and simulated.

Setting: Fashion-MNIST (Debian's ``dataset-fashion-mnist``), ``--train`` rows split over ``--centers``
centers by Dirichlet(0.3) label skew (``examples/collab_fashion_mnist.py``'s split), its CNN (width 8,
GroupNorm), SGD lr 0.02 momentum 0.9, ``--epochs`` epochs of each center's rows, fusion ``--fusion``;
every center's link emulated at ``--link-mbit`` Mbit/s and ``--latency-ms`` each way. The in-process
engine runs every center in its own thread (``run_inprocess(pipelined=True)``): synchronous rounds
(``overlap 0``) and overlapped ones (``overlap K``) on the same threads and links. Accuracy on the
official 10k test images after the last round.

Per run, rounds 2..: the median round (the server's, fused model to fused model), per center and round
the mean communication (``comm``: from sending its update until the next fused model was there),
what of it the center waited for (``exposed``) and what it spent taking steps (``hidden``), and
``exposed % = exposed / round``.

Simulated (``polyparallel.cost_models.collab_simulator``, concurrent centers): each center's step time
and the server's time per round (checks, fusion) are calibrated on the *synchronous* run of the same
seed and H — step time = the center's (sent − received) / H, the server's = round end − last update in
— and both modes are predicted from them with the configured links; the error is against the measured
median round.

Run: ``nice .venv/bin/python benchmarks/collab_overlap.py`` (defaults: 5 centers, 12k rows, H 5 and 20,
seeds 0 and 1, 100 Mbit/s, 30 ms). Writes ``benchmarks/results/collab_overlap.json`` and prints the table.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples")]  # the Fashion-MNIST loader and split

from collab_fashion_mnist import DATA_DIR, load_fashion_mnist, split  # noqa: E402

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess  # noqa: E402
from polyparallel.backends.collab._center import evaluate_torch  # noqa: E402
from polyparallel.cost_models.collab_simulator import SimInputs, simulate_rounds  # noqa: E402


def _events(res) -> dict:
    return {(e["round"], e["who"], e["event"]): e["t"] for e in res.timing}


def measure(res, names: list[str]) -> dict:
    ev = _events(res)
    later = res.rounds[1:]
    comm = [m["comm_s"] for r in later for m in r.metrics.values()]
    exposed = [m["exposed_s"] for r in later for m in r.metrics.values()]
    rounds = [r.seconds for r in later]
    server = [ev[(r.round, "server", "round_end")] - max(ev[(r.round, c, "update_received")] for c in names)
              for r in later]
    # a center's busy time in a round: its steps after the merge and the encoding, plus its steps ahead
    busy = {c: [ev[(r.round, c, "sent_update")] - ev[(r.round, c, "received_model")] + r.metrics[c]["ahead_s"]
                for r in later] for c in names}
    return {"round_s": float(np.median(rounds)), "comm_s": float(np.mean(comm)), "exposed_s": float(np.mean(exposed)),
            "hidden_s": float(np.mean(comm) - np.mean(exposed)),
            "exposed_pct": 100 * float(np.mean(exposed) / np.median(rounds)), "server_s": float(np.median(server)),
            "busy_s": {c: float(np.median(v)) for c, v in busy.items()}}


def simulated(cfg: CollabConfig, calib: dict, overlap: int, params: int) -> float:
    names = [c.name for c in cfg.centers]
    H = cfg.local_steps
    c0 = cfg.centers[0]
    x = SimInputs.make(names, [calib["busy_s"][n] / H for n in names], H, params, down_Bps=c0.down_Bps,
                       up_Bps=c0.up_Bps, latency_s=c0.latency_s, fixed_s=0.0,
                       fuse_s_per_param=calib["server_s"] / (params * len(names)), overlap=overlap)
    return float(np.median(simulate_rounds(x, cfg.rounds).round_s[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA_DIR))
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--centers", type=int, default=5)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--steps", default="5,20", help="H values")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--fusion", default="fedavg")
    ap.add_argument("--link-mbit", type=float, default=100.0)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/collab_overlap.json"))
    args = ap.parse_args()
    xtr, ytr, xte, yte = load_fashion_mnist(Path(args.data))
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load {load0}", flush=True)
    bps = args.link_mbit * 1e6 / 8
    spec = ModelSpec("cnn", (1, 28, 28), 10, hidden=8, norm="group")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        sub = np.random.default_rng(seed).permutation(len(ytr))[:args.train]
        parts = split(ytr[sub], args.centers, 0.3, seed)
        names = [f"c{i}" for i in range(args.centers)]
        data = {n: (xtr[sub][p], ytr[sub][p]) for n, p in zip(names, parts)}
        centers = tuple(CenterSpec(n, down_Bps=bps, up_Bps=bps, latency_s=args.latency_ms / 1e3) for n in names)
        for H in [int(h) for h in args.steps.split(",")]:
            rounds = max(2, round(args.epochs * np.mean([len(p) for p in parts]) / (32 * H)))
            calib = None
            for k in (0, H):
                cfg = CollabConfig(centers=centers, model=spec, rounds=rounds, local_steps=H, batch_size=32, lr=0.02,
                                   momentum=0.9, fusion=args.fusion, seed=seed, overlap=k)
                t0 = time.time()
                res = run_inprocess(cfg, data, pipelined=True)
                wall = time.time() - t0
                acc = evaluate_torch(spec, res.params, xte, yte)["accuracy"]
                m = measure(res, names)
                params = int(sum(v.size for v in res.params.values()))
                calib = calib or m
                sim, own = simulated(cfg, calib, k, params), simulated(cfg, m, k, params)
                row = {"seed": seed, "H": H, "overlap": k, "rounds": rounds, "accuracy": acc, "wall_s": wall,
                       "params": params, **m, "simulated_round_s": sim, "simulated_own_s": own,
                       "sim_error_pct": 100 * (sim - m["round_s"]) / m["round_s"],
                       "sim_own_error_pct": 100 * (own - m["round_s"]) / m["round_s"], "load": os.getloadavg()[0]}
                rows.append(row)
                print(f"seed {seed} H {H:>3} overlap {k:>3}: {rounds} rounds, acc {100 * acc:.2f}% | round "
                      f"{m['round_s']:.3f} s (simulated from sync {sim:.3f}, {row['sim_error_pct']:+.1f}%; from its "
                      f"own phases {own:.3f}, {row['sim_own_error_pct']:+.1f}%) | comm "
                      f"{m['comm_s']:.3f} s, exposed {m['exposed_s']:.3f} s ({m['exposed_pct']:.1f}% of the round), "
                      f"hidden {m['hidden_s']:.3f} s | wall {wall:.0f} s | load {row['load']:.1f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg()},
                                    "setting": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
