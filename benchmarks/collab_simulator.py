"""The collaborative-round simulator: how fast it is, and how close it comes to measured Flower rounds.

``speed``: wall time of :func:`~polyparallel.cost_models.collab_simulator.simulate_rounds` (with jitter
and dropouts, plus the statistics) for centers × rounds up to 100 × 1000 and beyond (best of 3).

``--validate``: Flower federations on loopback (``run_flower``'s defaults, the ``tuned`` mode of
``benchmarks/collab.py``), MLPs of two sizes, 3 and 5 centers; round 1 (start-up) dropped. Flower's
per-round cost has a fixed part and a part that grows with the bytes (serialisation and the object
store, far slower than the raw socket), and on one machine every center's messages go through the same
SuperLink, so the links are one shared pipe. They are fitted on *calibration* runs (H = 5: compute is
small; ``round − fusion − max compute = K + k·N + bytes_per_round / B``, least squares over 3 × 1M,
3 × 4M and 5 × 4M) and the simulator — ``fixed_s = K``, ``fixed_per_center_s = k``, every center's link
``B / N`` both ways, each center's per-step compute as measured in that run, the fusion cost per
parameter and center of the calibration runs — then predicts the *reported* runs (other ``H`` and
center counts): round time and the communication share ``1 − (max compute + fusion) / round`` (as
``benchmarks/collab.py`` defines it), simulated vs measured.

Run: ``nice .venv/bin/python benchmarks/collab_simulator.py`` (speed only) or with ``--validate``
(~10 min on 2 loaded cores). Writes ``benchmarks/results/collab_simulator.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from polyparallel.cost_models.collab_simulator import SimInputs, measured_phases, simulate_rounds

OUT = Path(__file__).parent / "results" / "collab_simulator.json"


def speed(sizes=((10, 100), (100, 100), (100, 1000), (1000, 1000))) -> list[dict]:
    rows = []
    for n, rounds in sizes:
        rng = np.random.default_rng(0)
        x = SimInputs.make([f"c{i}" for i in range(n)], rng.uniform(0.01, 0.05, n), 50, 10**8,
                           down_Bps=rng.uniform(1e8, 1e9, n), up_Bps=rng.uniform(1e8, 1e9, n),
                           latency_s=rng.uniform(0.005, 0.05, n), compression="int8")
        best = best_stats = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            res = simulate_rounds(x, rounds, compute_jitter=0.1, link_jitter=0.1, dropout=0.02, seed=1)
            t1 = time.perf_counter()
            res.summary()
            t2 = time.perf_counter()
            best, best_stats = min(best, t1 - t0), min(best_stats, t2 - t0)
        t0 = time.perf_counter()
        events = len(res.trace()["traceEvents"]) if n * rounds <= 100_000 else 0
        trace_s = time.perf_counter() - t0 if events else None
        rows.append({"centers": n, "rounds": rounds, "simulate_s": best, "simulate_and_stats_s": best_stats,
                     "trace_events": events, "trace_s": trace_s})
        print(f"{n:>5} centers × {rounds:>5} rounds: simulate {1e3 * best:8.2f} ms, + statistics "
              f"{1e3 * best_stats:8.2f} ms" + (f", trace {events} events in {trace_s:.2f} s" if events else ""),
              flush=True)
    return rows


# ------------------------------------------------------------------------------- validation

SIZES = {"1M": (1000, 1000), "4M": (2000, 2000)}  # MLP (input features, hidden): ~1.0M and ~4.0M parameters
CALIBRATE = [(3, "1M", 5), (3, "4M", 5), (5, "4M", 5)]
REPORT = [(3, "1M", 100), (5, "1M", 100), (3, "4M", 40), (5, "4M", 40), (5, "1M", 5)]


def flower_run(n: int, size: str, H: int, rounds: int, workroot: Path) -> dict:
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec
    from polyparallel.backends.collab._flower import run_flower

    feats, hidden = SIZES[size]
    spec = ModelSpec("mlp", (feats,), 10, hidden=hidden)
    names = [f"c{i}" for i in range(n)]
    cfg = CollabConfig(centers=tuple(CenterSpec(c) for c in names), model=spec, rounds=rounds, local_steps=H,
                       batch_size=16, lr=0.01, round_timeout_s=600)
    rng = np.random.default_rng(0)
    data = {c: (rng.normal(size=(64, feats)).astype(np.float32), rng.integers(0, 10, 64)) for c in names}
    wd = workroot / f"{n}-{size}-H{H}"
    shutil.rmtree(wd, ignore_errors=True)
    t0 = time.time()
    res = run_flower(cfg, data, workdir=wd, timeout_s=1200)
    m = measured_phases(res.timing)
    recs = {r.round: r for r in res.rounds}
    per = []
    for r in sorted(m)[1:]:  # round 1 carries the start-up
        comp = {c: m[r]["centers"][c]["compute"] for c in names}
        per.append({"round": r, "round_s": m[r]["round_s"], "fuse_s": m[r]["fuse_s"], "compute_s": comp,
                    "bytes_down": recs[r].bytes_down, "bytes_up": sum(recs[r].bytes_up.values())})
    out = {"centers": n, "size": size, "params": int(sum(v.size for v in res.params.values())), "local_steps": H,
           "wall_s": time.time() - t0, "loadavg": os.getloadavg(), "rounds": per}
    print(f"flower {n} × {size} H={H}: rounds {[round(p['round_s'], 2) for p in per]}", flush=True)
    return out


def fit_framework(calib: list[dict]) -> tuple[float, float, float, float]:
    """``round − fusion − max compute = K + k·N + bytes / B`` over the calibration rounds (least squares),
    and the fusion seconds per parameter and center ``φ`` (their mean)."""
    a, b, phi = [], [], []
    for run in calib:
        for p in run["rounds"]:
            a.append([1.0, run["centers"], p["bytes_down"] + p["bytes_up"]])
            b.append(p["round_s"] - p["fuse_s"] - max(p["compute_s"].values()))
            phi.append(p["fuse_s"] / (run["params"] * run["centers"]))
    A, y = np.array(a), np.array(b)
    (K, k, inv_B), *_ = np.linalg.lstsq(A, y, rcond=None)
    if k < 0:  # noise, not a cost: fit without the per-center term
        (K, inv_B), *_ = np.linalg.lstsq(A[:, [0, 2]], y, rcond=None)
        k = 0.0
    return float(K), float(k), float(1 / inv_B) if inv_B > 0 else float("inf"), float(np.mean(phi))


def predict(run: dict, K: float, k: float, B: float, phi: float) -> dict:
    """Simulate a measured run from its per-step compute and the calibrated K, k, B, φ; compare."""
    names = sorted(run["rounds"][0]["compute_s"])
    n, H, P = run["centers"], run["local_steps"], run["params"]
    step = np.array([[p["compute_s"][c] / H for c in names] for p in run["rounds"]])
    # on one machine every center's bytes share the SuperLink: each link gets B / N
    x = SimInputs.make(names, step[0], H, P, down_Bps=B / n, up_Bps=B / n, fixed_s=max(K, 0.0),
                      fixed_per_center_s=k, fuse_s_per_param=phi)
    sim = simulate_rounds(x, len(step), step_s=step)
    meas_round = np.array([p["round_s"] for p in run["rounds"]])
    busy = np.array([max(p["compute_s"].values()) + p["fuse_s"] for p in run["rounds"]])
    meas_comm = float(1 - busy.sum() / meas_round.sum())
    sim_round, sim_comm = float(sim.round_s.mean()), sim.critical_comm_share()
    return {"centers": n, "size": run["size"], "local_steps": H, "measured_round_s": float(meas_round.mean()),
            "simulated_round_s": sim_round, "round_error_pct": 100 * (sim_round / meas_round.mean() - 1),
            "measured_comm_pct": 100 * meas_comm, "simulated_comm_pct": 100 * sim_comm,
            "comm_error_points": 100 * (sim_comm - meas_comm), "loadavg": run["loadavg"]}


def planner_check(raw: dict, fit: tuple[float, float, float, float], raw_path: Path, rounds: int,
                  target: float = 0.5) -> dict:
    """The H that :func:`choose_local_steps` picks for 3 × 1M at a target communication share (step time
    from the 3 × 1M, H = 100 run, Flower's cost as calibrated), run on Flower: measured share vs target."""
    from polyparallel.cost_models.collab_simulator import choose_local_steps

    K, k, B, phi = fit
    ref = raw["3-1M-H100"]
    names = sorted(ref["rounds"][0]["compute_s"])
    step = [float(np.mean([p["compute_s"][c] for p in ref["rounds"]])) / 100 for c in names]
    x = SimInputs.make(names, step, 1, ref["params"], down_Bps=B / 3, up_Bps=B / 3, fixed_s=max(K, 0.0),
                       fixed_per_center_s=k, fuse_s_per_param=phi)
    H, sim = choose_local_steps(x, target)
    key = f"planner-3-1M-H{H}"
    if key not in raw:
        with tempfile.TemporaryDirectory(prefix="ppsim-") as tmp:
            raw[key] = flower_run(3, "1M", H, rounds, Path(tmp))
        raw_path.write_text(json.dumps(raw, indent=1))
    run = raw[key]
    busy = sum(max(p["compute_s"].values()) + p["fuse_s"] for p in run["rounds"])
    measured = 1 - busy / sum(p["round_s"] for p in run["rounds"])
    print(f"planner check: target comm {100 * target:.0f}% -> H = {H} (simulated {100 * sim.critical_comm_share():.1f}%"
          f"), measured on Flower {100 * measured:.1f}% (load {run['loadavg'][0]:.0f})")
    return {"target_pct": 100 * target, "local_steps": H, "simulated_pct": 100 * sim.critical_comm_share(),
            "measured_pct": 100 * measured, "loadavg": run["loadavg"]}


def validate(rounds: int, raw_path: Path, check_planner: bool = False) -> dict:
    raw = json.loads(raw_path.read_text()) if raw_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="ppsim-") as tmp:
        for n, size, H in CALIBRATE + REPORT:
            key = f"{n}-{size}-H{H}"
            if key not in raw:
                raw[key] = flower_run(n, size, H, rounds, Path(tmp))
                raw_path.write_text(json.dumps(raw, indent=1))
    K, k, B, phi = fit_framework([raw[f"{n}-{s}-H{h}"] for n, s, h in CALIBRATE])
    print(f"calibrated on {CALIBRATE}: fixed cost K = {K:.3f} s/round + k = {k:.3f} s per center, shared pipe "
          f"B = {B / 1e6:.1f} MB/s, fusion {phi:.3g} s per parameter and center")
    rows = [predict(raw[f"{n}-{s}-H{h}"], K, k, B, phi) for n, s, h in REPORT]
    print("| centers | params | H | measured round s | simulated round s | error % | measured comm % | "
          "simulated comm % | Δ points | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['centers']} | {r['size']} | {r['local_steps']} | {r['measured_round_s']:.3f} | "
              f"{r['simulated_round_s']:.3f} | {r['round_error_pct']:+.1f} | {r['measured_comm_pct']:.1f} | "
              f"{r['simulated_comm_pct']:.1f} | {r['comm_error_points']:+.1f} | {r['loadavg'][0]:.0f} |")
    out = {"calibration": {"configs": CALIBRATE, "fixed_s": K, "fixed_per_center_s": k, "shared_Bps": B,
                           "fuse_s_per_param": phi}, "rows": rows}
    if check_planner:
        out["planner"] = planner_check(raw, (K, k, B, phi), raw_path, rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="also run the Flower validation (minutes)")
    ap.add_argument("--planner", action="store_true", help="with --validate: run the H the simulator picks for "
                                                           "a 50%% communication share on Flower (minutes)")
    ap.add_argument("--rounds", type=int, default=5, help="Flower rounds per configuration (round 1 dropped)")
    ap.add_argument("--raw", type=Path, default=OUT.with_name("collab_simulator_flower_raw.json"),
                    help="measured Flower rounds, kept between calls (a configuration present is not rerun)")
    args = ap.parse_args()
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
           "speed": speed()}
    if args.validate:
        out["validation"] = validate(args.rounds, args.raw, args.planner)
    elif OUT.exists():  # keep the last validation when only the speed is rerun
        out["validation"] = json.loads(OUT.read_text()).get("validation")
    OUT.write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
