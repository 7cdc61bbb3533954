"""Overlapped fusion against synchronous rounds on emulated WAN links, measured and simulated.

Setting: Fashion-MNIST (Debian's ``dataset-fashion-mnist``), ``--train`` rows split over ``--centers``
centers by Dirichlet(0.3) label skew (``examples/collab_fashion_mnist.py``'s split), its CNN (width 8,
GroupNorm), SGD lr 0.02 momentum 0.9, ``--epochs`` epochs of each center's rows, fusion ``--fusion``
with the server's default checks and ``min_centers = centers − 1`` (an update the norm bound refuses
does not stop the round; the refusals are counted);
every center's link emulated at ``--link-mbit`` Mbit/s and ``--latency-ms`` each way. The in-process
engine runs every center in its own thread (``run_inprocess(pipelined=True)``): synchronous rounds
(``overlap 0``) and overlapped ones (``overlap K``) on the same threads and links. Accuracy on the
official 10k test images after the last round.

Per run, rounds 2..: the median round (the server's, fused model to fused model), per center and round
the mean communication (``comm``: from sending its update until the next fused model was there),
what of it the center waited for (``exposed``) and what it spent taking steps (``hidden``; over Flower,
where the frame's arrival is not observed while a center runs ahead, the time of its steps ahead, the
most they can hide), and
``exposed %``: the exposed communication's share of the centers' wall time (summed over rounds 2.. and
centers, over the time from one update sent to the next).

Simulated (``polyparallel.cost_models.collab_simulator``, concurrent centers): each center's step time
and the server's time per round (checks, fusion) are calibrated on the *synchronous* run of the same
seed and H — step time = the center's (sent − received) / H, the server's = round end − last update in
— and both modes are predicted from them with the configured links; the error is against the measured
median round.

The pooled model (one model on the union of the rows, ``centers × H`` steps a round, the same SGD) is
the reference of the seeds' target "≤ 1 point below pooled".

``--engine flower``: the same over Flower, one SuperNode process per center, the rounds on the lean
data channel (``data_channel="socket"``; the links emulated at the receivers as in Flower messages).

Run: ``nice .venv/bin/python benchmarks/collab_overlap.py`` (defaults: 5 centers, 12k rows, H 5 and 20,
seeds 0 and 1, 100 Mbit/s, 30 ms). Writes ``benchmarks/results/collab_overlap.json`` (``--engine flower``:
``collab_overlap_flower.json``) and prints the table; the JSON is rewritten after every run.

The issue's closing experiment (SCAFFOLD + DiLoCo's outer step, 15 epochs, cosine schedule, one seed per
command; ``docs/collab.md`` has the tables): ``nice .venv/bin/python benchmarks/collab_overlap.py --engine
flower --epochs 15 --steps 5 --seeds 3 --fusion scaffold --fusion-options lr=0.7,momentum=0.9 --lr-schedule
cosine --overlaps 0.2,0.4 --out benchmarks/results/collab_overlap_scaffold_heldout_s3.json``.
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
from polyparallel.backends.collab._flower import run_flower  # noqa: E402
from polyparallel.cost_models.collab_simulator import SimInputs, simulate_rounds  # noqa: E402


def _events(res) -> dict:
    return {(e["round"], e["who"], e["event"]): e["t"] for e in res.timing}


def measure(res, names: list[str]) -> dict:
    ev = _events(res)
    later = res.rounds[1:]
    # only the rounds where every center's update was accepted (a refused one's metrics are not recorded)
    later = [r for r in later if len(r.metrics) == len(names) and len(res.rounds) >= r.round > 1
             and len(res.rounds[r.round - 2].metrics) == len(names)]
    for r in later:  # a synchronous center over Flower reports no overlap metrics: all of its comm is exposed
        for c, m in r.metrics.items():
            if "comm_s" not in m:
                m = r.metrics[c] = dict(m)
                m["comm_s"] = m["exposed_s"] = ev[(r.round, c, "received_model")] - ev[(r.round - 1, c, "sent_update")]
                m["ahead_s"] = 0.0
    comm = [m["comm_s"] for r in later for m in r.metrics.values()]
    exposed = [m["exposed_s"] for r in later for m in r.metrics.values()]
    rounds = [r.seconds for r in later]
    server = [ev[(r.round, "server", "round_end")] - max(ev[(r.round, c, "update_received")] for c in names)
              for r in later]
    # a center's busy time in a round: its steps after the merge and the encoding, plus its steps ahead
    busy = {c: [ev[(r.round, c, "sent_update")] - ev[(r.round, c, "received_model")] + r.metrics[c]["ahead_s"]
                for r in later] for c in names}
    # a center's wall time per round: from one update sent to the next (its steps plus what it waited)
    period = [ev[(r.round, c, "sent_update")] - ev[(r.round - 1, c, "sent_update")] for r in later for c in names]
    refused = sum(len(r.rejected) for r in res.rounds)
    return {"round_s": float(np.median(rounds)), "comm_s": float(np.mean(comm)), "exposed_s": float(np.mean(exposed)),
            "hidden_s": float(np.mean(comm) - np.mean(exposed)), "period_s": float(np.mean(period)),
            "exposed_pct": 100 * float(np.sum(exposed) / np.sum(period)), "server_s": float(np.median(server)),
            "refused_updates": refused, "unfused_rounds": sum(not r.fused for r in res.rounds),
            "busy_s": {c: float(np.median(v)) for c, v in busy.items()}}


def simulated(cfg: CollabConfig, calib: dict, overlap: int, params: int) -> float:
    names = [c.name for c in cfg.centers]
    H = cfg.local_steps
    c0 = cfg.centers[0]
    x = SimInputs.make(names, [calib["busy_s"][n] / H for n in names], H, params, down_Bps=c0.down_Bps,
                       up_Bps=c0.up_Bps, latency_s=c0.latency_s, fixed_s=0.0,
                       fuse_s_per_param=calib["server_s"] / (params * len(names)), overlap=overlap)
    return float(np.median(simulate_rounds(x, cfg.rounds).round_s[1:]))


def _pooled(spec: ModelSpec, data: dict, H: int, rounds: int, seed: int, xte, yte,
            lr_schedule: str = "constant") -> float:
    """The pooled model's accuracy: one model on the union of the centers' rows, centers x H steps a round
    (the same per-round learning-rate schedule)."""
    from polyparallel.backends.collab._center import TorchTrainer
    from polyparallel.backends.collab._engine import initial_params

    x = np.concatenate([v[0] for v in data.values()])
    y = np.concatenate([v[1] for v in data.values()])
    t = TorchTrainer(spec, x, y, batch_size=32, lr=0.02, momentum=0.9, seed=seed, rounds=rounds,
                     lr_schedule=lr_schedule)
    p = initial_params(CollabConfig(centers=(CenterSpec("c0"),), model=spec, seed=seed))
    for r in range(1, rounds + 1):
        p = t.train(p, steps=H * len(data), round_idx=r)[0]
    return float(evaluate_torch(spec, p, xte, yte)["accuracy"])


def table(rows: list[dict]) -> str:
    """Mean ± std over seeds per (H, overlap): accuracy vs pooled and vs synchronous (per seed), exposed
    communication's share of the centers' time, round, simulated-round errors, refusals."""
    def pm(v: list[float], f: str = "+.2f") -> str:
        return f"{np.mean(v):{f}} ± {np.std(v):.2f}" if len(v) > 1 else f"{v[0]:{f}}"

    sync = {(r["seed"], r["H"]): r for r in rows if r["overlap"] == 0}

    def vs_sync(r: dict) -> float:  # nan where the synchronous run was not made (--no-sync)
        s = sync.get((r["seed"], r["H"]))
        return 100 * (r["accuracy"] - s["accuracy"]) if s else float("nan")

    out = ["| H | overlap K | seeds | accuracy % | vs pooled (points) | vs synchronous (points) | exposed comm % "
           "| hidden comm s | round s | simulated from sync, error % | from own phases, error % | refused |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for H, k in sorted({(r["H"], r["overlap"]) for r in rows}):
        g = [r for r in rows if (r["H"], r["overlap"]) == (H, k)]
        out.append(f"| {H} | {k} | {len(g)} | {pm([100 * r['accuracy'] for r in g], '.2f')} "
                   f"| {pm([100 * (r['accuracy'] - r['pooled']) for r in g])} "
                   f"| {pm([vs_sync(r) for r in g])} "
                   f"| {pm([r['exposed_pct'] for r in g], '.1f')} | {pm([r['hidden_s'] for r in g], '.3f')} "
                   f"| {pm([r['round_s'] for r in g], '.3f')} | {pm([r['sim_error_pct'] for r in g], '+.1f')} "
                   f"| {pm([r['sim_own_error_pct'] for r in g], '+.1f')} | {sum(r['refused_updates'] for r in g)} |")
    return "\n".join(out)


def _write(args: argparse.Namespace, load0: tuple, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg()},
                                    "setting": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA_DIR))
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--centers", type=int, default=5)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--steps", default="5,20", help="H values")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--fusion", default="fedavg")
    ap.add_argument("--fusion-options", default="", help="the fusion's options, e.g. lr=0.7,momentum=0.9 (SCAFFOLD "
                    "with DiLoCo's outer Nesterov step, the setting that met 'within 1 point of pooled')")
    ap.add_argument("--lr-schedule", default="constant", help="constant or cosine (per round, every arm)")
    ap.add_argument("--overlaps", default="0.5,1", help="overlapped steps as fractions of H (0: synchronous, "
                    "always run first: the simulator is calibrated on it)")
    ap.add_argument("--width", type=int, default=8, help="the CNN's channels (conv1; conv2 has twice): 8 is 9.1k "
                    "parameters, 32 is 50k")
    ap.add_argument("--link-mbit", type=float, default=100.0)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--engine", default="inprocess", help="inprocess (centers in threads) or flower (one "
                    "SuperNode process per center, the rounds on the lean data channel)")
    ap.add_argument("--skip-pooled", action="store_true", help="no pooled reference (a probe of settings: "
                    "'vs pooled' is then nan)")
    ap.add_argument("--no-sync", action="store_true", help="no synchronous run (a probe: the simulator is then "
                    "calibrated on the first run)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table-only", action="store_true", help="print the table of --out's rows and exit")
    args = ap.parse_args()
    if args.out is None:
        args.out = Path(f"benchmarks/results/collab_overlap{'_flower' if args.engine == 'flower' else ''}.json")
    opts = {k: float(v) for k, v in (o.split("=") for o in args.fusion_options.split(",") if o)}
    if args.table_only:
        print(table(json.loads(args.out.read_text())["rows"]))
        return
    xtr, ytr, xte, yte = load_fashion_mnist(Path(args.data))
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load {load0}", flush=True)
    bps = args.link_mbit * 1e6 / 8
    spec = ModelSpec("cnn", (1, 28, 28), 10, hidden=args.width, norm="group")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        sub = np.random.default_rng(seed).permutation(len(ytr))[:args.train]
        parts = split(ytr[sub], args.centers, 0.3, seed)
        names = [f"c{i}" for i in range(args.centers)]
        data = {n: (xtr[sub][p], ytr[sub][p]) for n, p in zip(names, parts)}
        centers = tuple(CenterSpec(n, down_Bps=bps, up_Bps=bps, latency_s=args.latency_ms / 1e3) for n in names)
        for H in [int(h) for h in args.steps.split(",")]:
            rounds = max(2, round(args.epochs * np.mean([len(p) for p in parts]) / (32 * H)))
            pooled = (float("nan") if args.skip_pooled else
                      _pooled(spec, data, H, rounds, seed, xte, yte, args.lr_schedule))
            print(f"seed {seed} H {H:>3} pooled (one model, {len(names) * H} steps a round): {100 * pooled:.2f}%",
                  flush=True)
            calib = None
            for k in sorted({*(() if args.no_sync else (0,)), *(int(float(f) * H) for f in args.overlaps.split(","))}):
                cfg = CollabConfig(centers=centers, model=spec, rounds=rounds, local_steps=H, batch_size=32, lr=0.02,
                                   momentum=0.9, fusion=args.fusion, fusion_options=opts, seed=seed, overlap=k,
                                   lr_schedule=args.lr_schedule,
                                   min_centers=len(names) - 1)  # a refused update does not stop the round
                t0 = time.time()
                res = (run_inprocess(cfg, data, pipelined=True) if args.engine == "inprocess" else
                       run_flower(cfg, data, data_channel="socket", timeout_s=3600))
                wall = time.time() - t0
                acc = evaluate_torch(spec, res.params, xte, yte)["accuracy"]
                m = measure(res, names)
                params = int(sum(v.size for v in res.params.values()))
                calib = calib or m
                sim, own = simulated(cfg, calib, k, params), simulated(cfg, m, k, params)
                row = {"seed": seed, "H": H, "overlap": k, "rounds": rounds, "accuracy": acc, "pooled": pooled,
                       "engine": args.engine, "wall_s": wall,
                       "params": params, **m, "simulated_round_s": sim, "simulated_own_s": own,
                       "sim_error_pct": 100 * (sim - m["round_s"]) / m["round_s"],
                       "sim_own_error_pct": 100 * (own - m["round_s"]) / m["round_s"], "load": os.getloadavg()[0]}
                rows.append(row)
                _write(args, load0, rows)  # after every run: a long sweep stopped early keeps what it measured
                print(f"seed {seed} H {H:>3} overlap {k:>3}: {rounds} rounds, acc {100 * acc:.2f}% "
                      f"({100 * (acc - pooled):+.2f} vs pooled) | round "
                      f"{m['round_s']:.3f} s (simulated from sync {sim:.3f}, {row['sim_error_pct']:+.1f}%; from its "
                      f"own phases {own:.3f}, {row['sim_own_error_pct']:+.1f}%) | comm "
                      f"{m['comm_s']:.3f} s, exposed {m['exposed_s']:.3f} s ({m['exposed_pct']:.1f}% of the centers' "
                      f"time), "
                      f"hidden {m['hidden_s']:.3f} s | refused {m['refused_updates']} | wall {wall:.0f} s | "
                      f"load {row['load']:.1f}", flush=True)
    _write(args, load0, rows)
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
