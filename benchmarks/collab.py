"""Wall time per collaborative round on loopback, and where it goes.

For each setting a Flower federation (SuperLink + one SuperNode per center on 127.0.0.1) runs a few
rounds of an MLP; from the timing JSON lines of rounds 2.. (round 1 carries one-off start-up) we
split a round into, averaged over centers:

- ``down``    round start → center received the model (serialise, SuperNode poll, transfer, deserialise)
- ``compute`` center received → finished its local steps
- ``up``      center sent → server pulled its update
- ``wait``    server pulled it → fusion starts (waiting for the slowest center)
- ``fusion``  fusion start → end
- ``round``   round start → end

``overhead = round − max_c compute_c − fusion − raw`` where ``raw`` is the time the same bytes take
through a plain loopback TCP socket (measured here): what the framework adds beyond computing and
moving bytes. ``comm%`` is ``(round − max compute − fusion) / round``, the share the seeds' 20%
budget refers to.

Modes (what each changes is in ``MODES``; see :mod:`polyparallel.backends.collab._flwr_timing` for
why the waits dominate):

- ``cold`` = Flower defaults: a new ClientApp process per message, SuperNode idle poll 3 s and reply
  checks every 0.5 s, object-pull retries after 1 s doubling to 10 s, SuperLink state in SQLite;
- ``warm`` = long-lived ClientApp executors (``--isolation process``), executors and ServerApp polling
  every 0.05 s; ``warm-lazy`` = the same polling every 0.25 s;
- ``warm+poll`` = warm-lazy and the SuperNode's idle poll and reply checks capped at 0.5 s (the best
  setting before the object-pull back-off and the SQLite store were found: the "before");
- ``tuned-waits`` = SuperNode idle poll 0.25 s, reply checks 0.02 s, object-pull retries from 0.02 s
  (cap 0.2 s) in every process, executors and ServerApp polling every 0.1 s;
- ``tuned-memory`` = tuned-waits with the SuperLink's state and objects in memory, not SQLite;
- ``tuned`` = tuned-memory with the arrays packed into one buffer per dtype: ``run_flower``'s defaults.

Run: ``nice python benchmarks/collab.py`` (3 centers × 1M in every mode, then 5 × 1M, 3 × 25M and 5 × 25M
in ``warm+poll`` and ``tuned``; ``--quick``: only 3 × 1M; ``--modes a,b``: only those modes).
Writes ``benchmarks/results/collab.json``.

``--experiment`` measures the Fashion-MNIST experiment's own setting over Flower (``tuned`` mode):
five centers, its CNN (``examples/collab_fashion_mnist.py``: width 8, 28×28 inputs, batch 32), the
fusion of ``--fusion`` (default ``scaffold``: it also sends ``c`` down and ``c_i`` up), at each ``H`` of
``--steps-sweep`` (default ``9,19,100,400,1000``; the experiment runs ``H = 9`` or ``19``); inputs are
random arrays of the images' shape (timing does not depend on the pixels). Writes
``benchmarks/results/collab_experiment.json``. On one machine the five centers share its cores, so
``compute`` here is what a center takes while the others train too.

``--steps-sweep 5,100,400`` instead runs ``--sweep-centers`` (3) centers × 1M params in ``warm+poll``
and ``tuned`` (or ``--modes``) at each number of local steps per round ``H`` and writes
``benchmarks/results/collab_steps.json``: the per-round cost of Flower is a constant ``c``, so its
share of the round falls as ``1 / (1 + H·t_step / c)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess
from polyparallel.backends.collab._flower import run_flower

SIZES = {"1M": ModelSpec("mlp", (1000,), 10, hidden=1000), "25M": ModelSpec("mlp", (5000,), 10, hidden=5000),
         "fmnist-cnn": ModelSpec("cnn", (1, 28, 28), 10, hidden=8)}  # the Fashion-MNIST experiment's model
_STOCK = dict(supernode_poll_s=None, supernode_wait_s=None, pull_backoff_s=None, superlink_database="superlink.db",
              pack_arrays=False)
_WAITS = dict(warm=True, poll_s=0.1, supernode_poll_s=0.25, supernode_wait_s=0.02, pull_backoff_s=0.02)
MODES = {
    "cold": dict(warm=False, **_STOCK),
    "warm": dict(warm=True, poll_s=0.05, **_STOCK),
    "warm-lazy": dict(warm=True, poll_s=0.25, **_STOCK),
    "warm+poll": dict(warm=True, poll_s=0.25, **{**_STOCK, "supernode_poll_s": 0.5, "supernode_wait_s": 0.5}),
    "tuned-waits": dict(**_WAITS, superlink_database="superlink.db", pack_arrays=False),
    "tuned-memory": dict(**_WAITS, superlink_database=None, pack_arrays=False),
    "tuned": dict(**_WAITS, superlink_database=None, pack_arrays=True),
}


def loopback_bytes_per_s(nbytes: int = 64 << 20) -> float:
    """Throughput of one plain TCP connection on 127.0.0.1."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    buf = b"\0" * (1 << 20)

    def sink() -> None:
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for _ in range(nbytes // len(buf)):
            c.sendall(buf)
        th.join()
        dt = time.perf_counter() - t0
    srv.close()
    return nbytes / dt


def split_rounds(res, centers: list[str], bps: float) -> dict:
    ev: dict[tuple, float] = {(e["round"], e["who"], e["event"]): e["t"] for e in res.timing}
    rows = []
    for rec in res.rounds[1:]:
        r = rec.round
        s = {k: ev[(r, "server", k)] for k in ("round_start", "fusion_start", "fusion_end", "round_end")}
        per = []
        for c in centers:
            per.append({"down": ev[(r, c, "received_model")] - s["round_start"],
                        "compute": ev[(r, c, "finished_training")] - ev[(r, c, "received_model")],
                        "up": ev[(r, c, "update_received")] - ev[(r, c, "sent_update")],
                        "wait": s["fusion_start"] - ev[(r, c, "update_received")]})
        row = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        row["fusion"] = s["fusion_end"] - s["fusion_start"]
        row["round"] = s["round_end"] - s["round_start"]
        row["bytes"] = rec.bytes_down + sum(rec.bytes_up.values())
        row["raw"] = row["bytes"] / bps
        busy = max(p["compute"] for p in per) + row["fusion"]
        row["overhead"] = row["round"] - busy - row["raw"]
        row["comm_frac"] = (row["round"] - busy) / row["round"]
        rows.append(row)
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def bench(n_centers: int, size: str, mode: str, rounds: int, steps: int, bps: float, workroot: Path,
          fusion: str = "fedavg") -> dict:
    spec = SIZES[size]
    names = [f"c{i}" for i in range(n_centers)]
    batch = 32 if size == "fmnist-cnn" else 16
    cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=spec, rounds=rounds, local_steps=steps,
                       batch_size=batch, lr=0.01, round_timeout_s=600, fusion=fusion)
    rng = np.random.default_rng(0)
    data = {n: (rng.normal(size=(64, *spec.in_shape)).astype(np.float32), rng.integers(0, 10, 64)) for n in names}
    workdir = workroot / f"{n_centers}-{size}-{mode}-{fusion}-H{steps}"
    # a stale work directory holds a finished server checkpoint, which the ServerApp would resume from
    shutil.rmtree(workdir, ignore_errors=True)
    t0 = time.time()
    res = run_flower(cfg, data, workdir=workdir, timeout_s=1800, **MODES[mode])
    wall = time.time() - t0
    t1 = time.time()
    ref = run_inprocess(cfg, data)
    inproc = (time.time() - t1) / rounds
    same = all(np.array_equal(ref.params[k], res.params[k]) for k in ref.params)
    out = {"centers": n_centers, "size": size, "params": int(sum(v.size for v in ref.params.values())),
           "mode": mode, "fusion": fusion, "batch": batch, "rounds": rounds, "local_steps": steps, "total_wall_s": wall,
           "inprocess_round_s": inproc, "matches_inprocess": same, **split_rounds(res, names, bps)}
    print(f"{n_centers:>2} {size:>4} {mode:>10} {fusion} H={steps:<4d} | round {out['round']:7.2f} s "
          f"| down {out['down']:6.2f} "
          f"compute {out['compute']:6.2f} up {out['up']:6.2f} wait {out['wait']:6.2f} fusion {out['fusion']:5.2f} "
          f"| raw {out['raw']:5.2f} overhead {out['overhead']:6.2f} comm {100 * out['comm_frac']:5.1f}% "
          f"| in-process {inproc:6.2f} s/round | exact {same}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/collab.json"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ppcollab-bench"))
    ap.add_argument("--steps-sweep", default="", help="comma-separated H values: the local-steps sweep only")
    ap.add_argument("--sweep-centers", type=int, default=3)
    ap.add_argument("--modes", default="", help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--experiment", action="store_true",
                    help="the Fashion-MNIST experiment's setting (5 centers, its CNN) at each H of --steps-sweep")
    ap.add_argument("--fusion", default="scaffold", help="fusion of the --experiment rows")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m] or list(MODES)
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    compared = [m for m in ("warm+poll", "tuned") if m in modes] if not args.modes else modes
    bps = loopback_bytes_per_s()
    print(f"loopback TCP: {bps / 1e9:.2f} GB/s; {os.cpu_count()} CPUs; load {os.getloadavg()}", flush=True)
    plan = [(3, "1M", m, args.steps) for m in modes]
    if not args.quick:
        plan += [(n, size, m, args.steps) for n, size in ((5, "1M"), (3, "25M"), (5, "25M")) for m in compared]
    default_out = args.out == Path("benchmarks/results/collab.json")
    if args.steps_sweep and not args.experiment:
        plan = [(args.sweep_centers, "1M", m, int(h)) for m in compared for h in args.steps_sweep.split(",")]
        if default_out:
            args.out = Path("benchmarks/results/collab_steps.json")
    fusion = "fedavg"
    if args.experiment:
        fusion = args.fusion
        sweep = args.steps_sweep or "9,19,100,400,1000"
        plan = [(5, "fmnist-cnn", m, int(h)) for m in (modes if args.modes else ["tuned"]) for h in sweep.split(",")]
        if default_out:
            args.out = Path("benchmarks/results/collab_experiment.json")
    rows = [bench(n, s, m, args.rounds, h, bps, args.workdir, fusion) for n, s, m, h in plan]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "loadavg_at_start": os.getloadavg()},
                                    "loopback_bytes_per_s": bps, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
