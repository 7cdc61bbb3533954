"""The buffered-round simulator (``collab_simulator.simulate_buffered``) against measured buffered rounds.

Asynchronous buffered rounds (``CollabConfig.buffer = K``) run through the in-process engine (every center in
its own thread; ``--engine flower``: a Flower SuperNode process per center, the rounds on the lean data
channel), each center's link emulated and one center made slower by ``--slow-factor``; the simulator is given what
the run measured of each center's local steps (received -> trained, the slowdown included, median over its
updates), how much later than that its first update left (its start-up), the server's fusion (median), the
links as configured, and nothing else. It predicts the
seconds between published versions, how many updates of each center the fusions take and how stale they are.
Table: per buffer, measured vs simulated mean round (fusion to fusion), the slow center's updates and their
mean staleness. Writes ``benchmarks/results/collab_buffered_sim.json``.

    nice -n 5 .venv/bin/python benchmarks/collab_buffered_sim.py
    nice -n 5 .venv/bin/python benchmarks/collab_buffered_sim.py --centers 4 --buffers 4,3,1 --slow-factor 2 \
        --down 1e6 --latency 0.08 --local-steps 40 --hidden 256 \
        --out benchmarks/results/collab_buffered_sim_slowlink.json
    nice -n 5 .venv/bin/python benchmarks/collab_buffered_sim.py --engine flower --fusions 60 --buffers 5,4,3 \
        --out benchmarks/results/collab_buffered_sim_flower.json
    nice -n 5 .venv/bin/python benchmarks/collab_buffered_sim.py --engine flower --fusions 60 --centers 4 \
        --buffers 4,3,1 --slow-factor 2 --down 1e6 --latency 0.08 --local-steps 40 --hidden 256 \
        --out benchmarks/results/collab_buffered_sim_flower_slowlink.json

Over Flower the simulator is given ``pushed=False`` (the data channel sends a center its next model when
its update frame is in).

The threads share the machine's cores, so a center's measured step time is its time under that contention
(the input the simulator gets); say the machine's load with the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess  # noqa: E402
from polyparallel.cost_models.collab_simulator import SimInputs, simulate_buffered  # noqa: E402


def digits(names: list[str]) -> tuple[dict, tuple]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    per = 1400 // len(names)
    return {c: (x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]) for i, c in enumerate(names)}, (x[1400:], y[1400:])


def measured(res, names: list[str], H: int) -> dict:
    """Per center: median seconds per local step over its fused updates and when its first update was
    trained; the median fusion; the published versions' times (the server's round starts)."""
    comp: dict[str, list[float]] = {c: [] for c in names}
    first: dict[str, float] = {}
    for r in res.rounds:
        for c, m in r.metrics.items():
            comp[c].append(float(m["t_trained"]) - float(m["t_received"]))
            first[c] = min(first.get(c, math.inf), float(m["t_trained"]))
    starts = sorted({float(e["t"]) for e in res.timing if e["who"] == "server" and e["event"] == "round_start"})
    fuse = [float(b["t"]) - float(a["t"]) for a, b in zip(
        (e for e in res.timing if e["who"] == "server" and e["event"] == "fusion_start"),
        (e for e in res.timing if e["who"] == "server" and e["event"] == "fusion_end"))]
    return {"step_s": {c: statistics.median(v) / H if v else float("nan") for c, v in comp.items()},
            "fuse_s": statistics.median(fuse) if fuse else 0.0, "published": starts, "first_trained": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--centers", type=int, default=5)
    ap.add_argument("--buffers", default="5,4,3,2")
    ap.add_argument("--fusions", type=int, default=16)
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--down", type=float, default=2e6, help="B/s of every center's emulated link, both ways")
    ap.add_argument("--latency", type=float, default=0.03)
    ap.add_argument("--engine", default="inprocess",
                    help="inprocess (centers in threads) or flower (a SuperNode process per center, the rounds on "
                         "the lean data channel)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "collab_buffered_sim.json"))
    args = ap.parse_args()
    names = [f"c{i}" for i in range(args.centers)]
    data, _ = digits(names)
    H = args.local_steps
    rows, load0 = [], os.getloadavg()[0]
    print(f"{'K':>3} {'measured s':>11} {'simulated s':>12} {'error %':>8}  slow center: updates (meas / sim), "
          "mean staleness (meas / sim)")
    for K in (int(k) for k in args.buffers.split(",")):
        centers = tuple(CenterSpec(c, down_Bps=args.down, up_Bps=args.down, latency_s=args.latency,
                                   slowdown=args.slow_factor if i == 0 else 1.0) for i, c in enumerate(names))
        cfg = CollabConfig(centers=centers, model=ModelSpec("mlp", (64,), 10, hidden=args.hidden), rounds=args.fusions,
                           local_steps=H, batch_size=64, lr=0.05, fusion="fedavg", buffer=K,
                           max_staleness=args.fusions)
        if args.engine == "flower":
            from polyparallel.backends.collab._flower import run_flower

            res = run_flower(cfg, data, data_channel="socket", timeout_s=1200)
        else:
            res = run_inprocess(cfg, data)
        m = measured(res, names, H)
        missing = [c for c in names if not np.isfinite(m["step_s"][c])]
        if missing:  # a center none of whose updates was fused: nothing measured of its steps
            print(f"{K:>3} skipped: no update of {', '.join(missing)} fused in {args.fusions} fusions "
                  f"(accepted per fusion: {[r.accepted for r in res.rounds]})", flush=True)
            continue
        params = sum(int(v.size) for v in res.params.values())
        x = SimInputs.make(names, [m["step_s"][c] for c in names], H, params, down_Bps=args.down, up_Bps=args.down,
                           latency_s=args.latency, fixed_s=0.0, fuse_s_per_param=m["fuse_s"] / (params * K))
        # a center's start-up: how much later than its download and H steps its first update left, from the
        # first version's publication (process start, the first steps' warm-up; the slow site's is slowed too)
        down = x.legs_s()[0]
        startup = [max(0.0, m["first_trained"][c] - m["published"][0] - down[i] - H * m["step_s"][c])
                   for i, c in enumerate(names)]
        sim = simulate_buffered(x, args.fusions, K, max_staleness=args.fusions, pushed=args.engine != "flower",
                                startup_s=startup)
        pub = np.array(m["published"])
        meas_round = float(np.diff(pub[1:]).mean())  # the first version's start-up left out, as below
        sim_round = float(sim.round_s[1:].mean())
        slow_meas = [m_["staleness"] for r in res.rounds for c, m_ in r.metrics.items() if c == names[0]]
        slow_sim = [t for f in sim.fused for c, t in f if c == names[0]]
        row = {"buffer": K, "measured_round_s": meas_round, "simulated_round_s": sim_round,
               "error": (sim_round - meas_round) / meas_round,
               "slow_updates": [len(slow_meas), len(slow_sim)],
               "slow_mean_staleness": [float(np.mean(slow_meas)) if slow_meas else None,
                                       float(np.mean(slow_sim)) if slow_sim else None],
               "step_s": m["step_s"], "startup_s": dict(zip(names, startup, strict=True)), "fuse_s": m["fuse_s"],
               "params": params,
               "published_measured_s": (pub - pub[0]).tolist(), "published_simulated_s": sim.published_s.tolist()}
        rows.append(row)
        st = row["slow_mean_staleness"]
        print(f"{K:>3} {meas_round:>11.4f} {sim_round:>12.4f} {100 * row['error']:>8.1f}  "
              f"{len(slow_meas)} / {len(slow_sim)}, "
              f"{'-' if st[0] is None else f'{st[0]:.2f}'} / {'-' if st[1] is None else f'{st[1]:.2f}'}", flush=True)
    out = {"setting": {**vars(args), "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "load_avg_start": load0, "load_avg_end": os.getloadavg()[0]}, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
