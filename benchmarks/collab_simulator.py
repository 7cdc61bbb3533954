"""The collaborative-round simulator: how fast it is, and how close it comes to measured Flower rounds.

``speed``: wall time of :func:`~polyparallel.cost_models.collab_simulator.simulate_rounds` (with jitter
and dropouts, plus the statistics) for centers × rounds up to 100 × 1000 and beyond (best of 3).

``--validate``: Flower federations on loopback (``run_flower``'s defaults), MLPs of two sizes (1M and 2M
parameters), 3 and 5 centers, every center on an emulated WAN link (``CenterSpec.down_Bps``/``up_Bps``/
``latency_s``, held at the receiving end of each transfer, ``backends/collab/_link.py``): center ``i`` at
``BASE_BPS[size] × LINK_FACTORS[i]`` (0.8 and 1.2 MB/s × 0.65–1: slow WAN links, so that the emulated
transfers, not Flower's loopback transit, set the communication time: at load 12–24 on 2 cores, 5
centers' 4 MB updates took 3–4 s and 16 MB ones 6–14 s to reach the ServerApp), 20 ms latency; round 1
(start-up) dropped.
*Calibration* runs (other ``H``, links 1.5× faster) give the framework's cost beside the links (``round −
fusion − max_i (D_i + C_i + U_i)``, median over the rounds: ``K``), the fusion cost per parameter and center,
and every center's step time (in the calibration run with the same centers and model: the same number of
processes sharing the CPU). The simulator — the reported runs' own links (the same ``CenterSpec``
figures), those costs, and each center's step time either from the calibration run (fully predicted) or as
measured in the reported run itself (compute given; the transfers, waits, framework and fusion predicted:
the load of the 2 shared cores drifts by ±40% between runs, which no simulator of the federation predicts)
— then predicts the *reported* runs: round time, and the communication share ``1 − (max compute + fusion)
/ round`` (as ``benchmarks/collab.py`` defines it), simulated vs measured.
``--planner``: the ``H`` :func:`choose_local_steps` picks for 5 × 1M on the reported links at each
``--targets`` share, run on Flower: measured share vs target.

Always (simulation only): ``speed``, and unequal centers at one ``H`` vs per-center ``H`` (``balance``).

Run: ``nice .venv/bin/python benchmarks/collab_simulator.py`` (simulation only) or with ``--validate
--planner`` (~15 min on 2 loaded cores; measured runs are kept in ``--raw`` and not rerun). Writes
``benchmarks/results/collab_simulator.json``.
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

SIZES = {"1M": (1000, 1000), "2M": (1414, 1414)}  # MLP (input features, hidden): ~1.0M and ~2.0M parameters
#: the centers' emulated links: center i gets BASE_BPS[size] × LINK_FACTORS[i] both ways and LATENCY_S
BASE_BPS = {"1M": 0.8e6, "2M": 1.2e6}
LINK_FACTORS = (1.0, 0.8, 0.65, 0.9, 0.75)
LATENCY_S = 0.02
#: (centers, size, H, link scale): calibration at other H and 1.5 × the reported bandwidths
CALIBRATE = [(3, "1M", 200, 1.5), (5, "1M", 200, 1.5), (3, "2M", 60, 1.5), (5, "2M", 60, 1.5)]
REPORT = [(3, "1M", 600, 1.0), (5, "1M", 300, 1.0), (3, "2M", 200, 1.0), (5, "2M", 120, 1.0)]
PROBE_H = 150  # the planner check's short run for the step time


def job(n: int, size: str, H: int, scale: float, rounds: int):
    """The federation of one configuration: ``n`` MLP centers, their emulated links (``CenterSpec``)."""
    from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec

    feats, hidden = SIZES[size]
    bw = [BASE_BPS[size] * scale * f for f in LINK_FACTORS[:n]]
    centers = tuple(CenterSpec(f"c{i}", down_Bps=b, up_Bps=b, latency_s=LATENCY_S) for i, b in enumerate(bw))
    return CollabConfig(centers=centers, model=ModelSpec("mlp", (feats,), 10, hidden=hidden), rounds=rounds,
                        local_steps=H, batch_size=16, lr=0.01, fusion="fedavg", round_timeout_s=600)


def key_of(n: int, size: str, H: int, scale: float) -> str:
    return f"{n}-{size}-H{H}-x{scale:g}"


def data_of(cfg) -> dict:
    feats = cfg.model.in_shape[0]
    rng = np.random.default_rng(0)
    return {c.name: (rng.normal(size=(64, feats)).astype(np.float32), rng.integers(0, 10, 64)) for c in cfg.centers}


def flower_run(n: int, size: str, H: int, scale: float, rounds: int, workroot: Path) -> dict:
    from polyparallel.backends.collab._flower import run_flower

    cfg = job(n, size, H, scale, rounds)
    data = data_of(cfg)
    wd = workroot / key_of(n, size, H, scale)
    shutil.rmtree(wd, ignore_errors=True)
    t0, load0 = time.time(), os.getloadavg()
    res = run_flower(cfg, data, workdir=wd, timeout_s=1200)
    m = measured_phases(res.timing)
    recs = {r.round: r for r in res.rounds}
    per = []
    for r in sorted(m)[1:]:  # round 1 carries the start-up
        ph = m[r]["centers"]
        per.append({"round": r, "round_s": m[r]["round_s"], "fuse_s": m[r]["fuse_s"],
                    **{k: {c: ph[c][k] for c in ph} for k in ("distribute", "compute", "upload")},
                    "bytes_down": recs[r].bytes_down, "bytes_up": sum(recs[r].bytes_up.values())})
    out = {"centers": n, "size": size, "params": int(sum(v.size for v in res.params.values())), "local_steps": H,
           "link_scale": scale, "wall_s": time.time() - t0, "loadavg_before": load0, "loadavg": os.getloadavg(),
           "rounds": per}
    print(f"flower {key_of(n, size, H, scale)}: rounds {[round(p['round_s'], 2) for p in per]} "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return out


def sim_inputs(run: dict, step_s: np.ndarray, cal: dict, H: int | None = None) -> SimInputs:
    """The simulator's inputs for a run: the links its centers emulated (the job's ``CenterSpec``s, one
    definition), the per-step compute ``step_s`` and the framework and fusion costs ``cal``."""
    cfg = job(run["centers"], run["size"], H or run["local_steps"], run["link_scale"], 1)
    return SimInputs.make([c.name for c in cfg.centers], step_s, H or run["local_steps"], run["params"],
                          down_Bps=[c.down_Bps for c in cfg.centers], up_Bps=[c.up_Bps for c in cfg.centers],
                          latency_s=[c.latency_s for c in cfg.centers], fixed_s=cal["fixed_s"],
                          fixed_per_center_s=cal["fixed_per_center_s"], fuse_s_per_param=cal["fuse_s_per_param"])


def step_of(run: dict) -> np.ndarray:
    """Each center's mean seconds per local step in a run."""
    names = sorted(run["rounds"][0]["compute"])
    return np.array([np.mean([p["compute"][c] for p in run["rounds"]]) / run["local_steps"] for c in names])


def fit_framework(calib: list[dict]) -> dict:
    """The framework's cost per round beside the emulated links, from the calibration rounds: ``K``, the
    median over them of ``round − fusion − max_i (D_i + C_i + U_i)`` (``D_i``, ``U_i`` the links'
    ``latency + bytes / bandwidth``, ``C_i`` the measured compute); and the fusion seconds per parameter
    and center ``φ`` (their mean). The median, not a least-squares fit with a per-center and a per-byte
    term: in some loaded rounds Flower's own transit outlasted the emulated link (5 centers' 8 MB updates
    took up to 12 s to reach the ServerApp at load 24), which no cost beside the link describes — a
    least-squares fit over those rounds gave a negative fixed cost."""
    resid, phi = [], []
    for run in calib:
        x = sim_inputs(run, step_of(run), {"fixed_s": 0.0, "fixed_per_center_s": 0.0, "fuse_s_per_param": 0.0})
        for p in run["rounds"]:
            busy = max(2 * x.latency_s[i] + x.model_bytes / x.down_Bps[i] + p["compute"][c]
                       + x.upload_bytes / x.up_Bps[i] for i, c in enumerate(x.names))
            resid.append(p["round_s"] - p["fuse_s"] - busy)
            phi.append(p["fuse_s"] / (run["params"] * run["centers"]))
    return {"fixed_s": max(float(np.median(resid)), 0.0), "fixed_per_center_s": 0.0,
            "fuse_s_per_param": float(np.mean(phi)), "residuals_s": [float(r) for r in resid]}


def measured_comm(run: dict) -> float:
    """``1 − (max compute + fusion) / round`` summed over the rounds (``benchmarks/collab.py``'s comm %)."""
    busy = sum(max(p["compute"].values()) + p["fuse_s"] for p in run["rounds"])
    return 1 - busy / sum(p["round_s"] for p in run["rounds"])


def predict(run: dict, step_s: np.ndarray, cal: dict) -> dict:
    """Simulate a measured run from the calibrated compute and framework costs; compare."""
    sim = simulate_rounds(sim_inputs(run, step_s, cal), len(run["rounds"]))
    meas_round = float(np.mean([p["round_s"] for p in run["rounds"]]))
    meas_comm = measured_comm(run)
    sim_round, sim_comm = float(sim.round_s.mean()), sim.critical_comm_share()
    mean = {k: float(np.mean([max(p[k].values()) for p in run["rounds"]])) for k in ("distribute", "compute", "upload")}
    return {"centers": run["centers"], "size": run["size"], "local_steps": run["local_steps"],
            "slowest_link_MBps": min(sim.inputs.up_Bps) / 1e6, "measured_round_s": meas_round,
            "simulated_round_s": sim_round, "round_error_pct": 100 * (sim_round / meas_round - 1),
            "measured_comm_pct": 100 * meas_comm, "simulated_comm_pct": 100 * sim_comm,
            "comm_error_points": 100 * (sim_comm - meas_comm), "measured_max_phase_s": mean,
            "simulated_max_phase_s": {k: float(sim.dur[k].max(axis=1).mean()) for k in ("distribute", "compute",
                                                                                          "upload")},
            "loadavg": run["loadavg"]}


def planner_check(raw: dict, cal: dict, raw_path: Path, rounds: int, target: float) -> dict:
    """The H that :func:`choose_local_steps` picks for 5 × 1M on the reported links at a target
    communication share (compute probed just before, framework as calibrated), run on Flower: measured
    share vs target."""
    from polyparallel.cost_models.collab_simulator import choose_local_steps

    ref = {"centers": 5, "size": "1M", "local_steps": 1, "link_scale": 1.0,
           "params": raw[key_of(*CALIBRATE[1])]["params"]}
    with tempfile.TemporaryDirectory(prefix="ppsim-") as tmp:
        # compute as the machine runs it now: a short run (3 rounds, 2 measured) just before
        probe = flower_run(5, "1M", PROBE_H, 1.0, 3, Path(tmp))
        H, sim = choose_local_steps(sim_inputs(ref, step_of(probe), cal, H=1), target)
        key = f"planner-{100 * target:.0f}-" + key_of(5, "1M", H, 1.0)
        run = raw[key] = flower_run(5, "1M", H, 1.0, rounds, Path(tmp)) | {"probe": probe}
    raw_path.write_text(json.dumps(raw, indent=1))
    measured = measured_comm(run)
    print(f"planner check: target comm {100 * target:.0f}% -> H = {H} (simulated {100 * sim.critical_comm_share():.1f}%"
          f"), measured on Flower {100 * measured:.1f}% (load {run['loadavg'][0]:.1f})")
    return {"target_pct": 100 * target, "local_steps": H, "simulated_pct": 100 * sim.critical_comm_share(),
            "measured_pct": 100 * measured, "error_points": 100 * (measured - target),
            "measured_round_s": float(np.mean([p["round_s"] for p in run["rounds"]])),
            "simulated_round_s": float(sim.round_s[0]), "loadavg": run["loadavg"]}


def validate(rounds: int, raw_path: Path, check_planner: bool = False, targets: tuple[float, ...] = (0.5,)) -> dict:
    raw = json.loads(raw_path.read_text()) if raw_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="ppsim-") as tmp:
        for cfg in CALIBRATE + REPORT:
            if key_of(*cfg) not in raw:
                raw[key_of(*cfg)] = flower_run(*cfg, rounds, Path(tmp))
                raw_path.write_text(json.dumps(raw, indent=1))
    calib = [raw[key_of(*c)] for c in CALIBRATE]
    cal = fit_framework(calib)
    # compute, two ways: each center's step time in the calibration run with the same centers and model
    # (fully predicted: but the machine's load drifts between runs), and as measured in the reported run
    # itself (the compute given, the links, waits, framework and fusion predicted)
    steps = {(r["centers"], r["size"]): step_of(r) for r in calib}
    r = np.array(cal["residuals_s"])
    print(f"calibrated on {[key_of(*c) for c in CALIBRATE]}: fixed cost K = {cal['fixed_s']:.3f} s/round (median "
          f"of {len(r)} rounds; quartiles {np.percentile(r, 25):.2f}–{np.percentile(r, 75):.2f} s), fusion "
          f"{cal['fuse_s_per_param']:.3g} s per parameter and center")
    rows = [predict(raw[key_of(*c)], step_of(raw[key_of(*c)]), cal) | {"compute_from": "this run"} for c in REPORT]
    rows += [predict(raw[key_of(*c)], steps[(c[0], c[1])], cal) | {"compute_from": "calibration run"}
             for c in REPORT]
    print("| compute from | centers | params | H | slowest link MB/s | measured round s | simulated round s | "
          "error % | measured comm % | simulated comm % | Δ points | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['compute_from']} | {r['centers']} | {r['size']} | {r['local_steps']} | "
              f"{r['slowest_link_MBps']:.2f} | "
              f"{r['measured_round_s']:.3f} | {r['simulated_round_s']:.3f} | {r['round_error_pct']:+.1f} | "
              f"{r['measured_comm_pct']:.1f} | {r['simulated_comm_pct']:.1f} | {r['comm_error_points']:+.1f} | "
              f"{r['loadavg'][0]:.1f} |")
    out = {"calibration": {"configs": [key_of(*c) for c in CALIBRATE], **cal,
                           "step_s": {f"{n}-{s}": v.tolist() for (n, s), v in steps.items()}},
           "links": {"base_Bps": BASE_BPS, "factors": LINK_FACTORS, "latency_s": LATENCY_S}, "rows": rows}
    if check_planner:
        out["planner"] = [planner_check(raw, cal, raw_path, rounds, t) for t in targets]
    return out


def balance(H: int = 50) -> list[dict]:
    """Unequal centers, simulated: the idle share at one ``H`` for all, and with per-center ``H_i``
    (:func:`~polyparallel.cost_models.collab_simulator.balanced_local_steps`: faster centers fill their
    wait with steps), which the collaborative backend does not run (one ``H`` for every center)."""
    from polyparallel.cost_models.collab_simulator import balanced_local_steps

    rows = []
    for speeds in ((1, 1, 1), (1, 1.5, 3), (1, 2, 4, 8, 8)):
        n = len(speeds)
        x = SimInputs.make([f"c{i}" for i in range(n)], [0.02 * v for v in speeds], H, 10**7,
                           down_Bps=[50e6 * LINK_FACTORS[i] for i in range(n)],
                           up_Bps=[50e6 * LINK_FACTORS[i] for i in range(n)], latency_s=LATENCY_S)
        h = balanced_local_steps(x)
        eq, bal = simulate_rounds(x, 10), simulate_rounds(x, 10, step_s=x.step_s * h / H)
        rows.append({"step_ratio": list(speeds), "local_steps": h.tolist(), "round_s": float(eq.round_s.mean()),
                     "idle_pct_equal_H": 100 * eq.shares()["idle"], "idle_pct_balanced": 100 * bal.shares()["idle"],
                     "steps_per_s_equal_H": n * H / float(eq.round_s.mean()),
                     "steps_per_s_balanced": float(h.sum()) / float(bal.round_s.mean())})
    print(f"\nunequal centers (10M parameters, links 50 MB/s × {LINK_FACTORS}, 20 ms step of the fastest, H = {H}; "
          "simulated):")
    print("| step time ratio | H per center (balanced) | round s | idle % (one H) | idle % (balanced) | "
          "local steps/s (one H) | local steps/s (balanced) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {':'.join(f'{v:g}' for v in r['step_ratio'])} | {r['local_steps']} | {r['round_s']:.2f} | "
              f"{r['idle_pct_equal_H']:.1f} | {r['idle_pct_balanced']:.1f} | {r['steps_per_s_equal_H']:.1f} | "
              f"{r['steps_per_s_balanced']:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="also run the Flower validation (minutes)")
    ap.add_argument("--planner", action="store_true", help="with --validate: run the H the simulator picks for "
                                                           "a 50%% communication share on Flower (minutes)")
    ap.add_argument("--rounds", type=int, default=5, help="Flower rounds per configuration (round 1 dropped)")
    ap.add_argument("--targets", default="0.5", help="with --planner: communication share targets, comma separated")
    ap.add_argument("--raw", type=Path, default=OUT.with_name("collab_simulator_flower_links_raw.json"),
                    help="measured Flower rounds, kept between calls (a configuration present is not rerun)")
    args = ap.parse_args()
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
           "speed": speed(), "balance": balance()}
    if args.validate:
        out["validation"] = validate(args.rounds, args.raw, args.planner,
                                     tuple(float(t) for t in args.targets.split(",")))
    elif OUT.exists():  # keep the last validation when only the speed is rerun
        out["validation"] = json.loads(OUT.read_text()).get("validation")
    OUT.write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
