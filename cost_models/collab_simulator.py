"""Efficiency simulator of collaborative training: five phases per center per round.

A round ``r`` of a collaborative job (``Strategy.collaborative``) runs, for every center ``i``:

1. **distribute** ``D_i = λ_i + M / down_i`` — the global model (``M`` bytes, float32) down the center's link;
2. **compute** ``C_i = H · s_i`` — ``H`` local steps of the center's own plan, ``s_i`` the step time the
   cost model priced for its devices (``local_strategy["step_time_s"]`` written by the planner's
   collaborative search; this module has no step-time model of its own);
3. **upload** ``U_i = λ_i + Q / up_i`` — the update after compression (``Q`` bytes: float32 ``4P``,
   fp16 ``2P``, int8 ``P`` plus one float32 scale per row, as :mod:`polyparallel.backends.collab._wire` codes it);
4. **wait** ``W_i = max_j (D_j + C_j + U_j) − (D_i + C_i + U_i)`` — idle until the slowest center's update is in;
5. **fuse** ``F = φ · P · n`` — the server fuses the ``n`` updates it received (``φ`` seconds per parameter
   and center).

plus the framework's fixed cost per round ``K`` (serialisation, polling and messaging that does not
scale with the bytes: Flower on loopback, :data:`FIXED_ROUND_S`), and optionally ``k`` per center taking
part (one server handles every center's messages), placed at the start of the round: ``K + k·n``.
So a round lasts ``T = K + max_i (D_i + C_i + U_i) + F`` and the phases of every center add up to ``T``.
With ``concurrent=False`` the centers run one after another (the in-process engine): center ``i``
starts when center ``i−1`` has uploaded, and ``T = K + Σ_i (D_i + C_i + U_i) + F``.

**Overlapped rounds** (``SimInputs.overlap = k``, the collaborative backend's ``CollabConfig.overlap``):
a center sends its update and goes on with the next round's first ``k`` steps; it needs the fused
model only then. Center ``i`` sends round ``r``'s update at ``t_i(r)``; the server fuses when the last
update is in, so the fused model reaches it at ``A_i = max_j (t_j(r) + U_j) + F + K + D_i`` and

    t_i(r+1) = max(t_i(r) + k·s_i, A_i) + (H − k)·s_i,   exposed E_i = max(0, A_i − t_i(r) − k·s_i)

— the exposed communication is what is left of the communication ``A_i − t_i(r)`` after the ``k``
overlapped steps (``k = 0``: the synchronous round). A round is the server's, from one fused model to
the next; per center it splits into ``compute`` (its ``H`` steps) and ``wait`` (the rest: the exposed
communication and waiting for the slowest center); distribute, upload, fusion and the framework's
cost run behind the steps and are reported as ``hidden_comm_s`` (the trace draws a round's steps as
one block). Concurrent centers only.

Variability (seeded): ``compute_jitter`` and ``link_jitter`` multiply ``C_i`` and the transfer times of
``D_i``/``U_i`` by a log-normal factor of mean 1 and that standard deviation of its log; a center
drops out of a round with probability ``dropout`` (it receives nothing, sends nothing and idles the
round; the server does not wait for it and fuses the others).

Statistics (:class:`SimResult`): time to ``N`` rounds, per-center utilisation (compute / wall time),
the shares of wall time of each phase (summed over centers and rounds, they add up to 1), and the
communication (distribute + upload + framework), idle (wait) and fusion shares. Outputs: a text table,
a Chrome-trace / Perfetto JSON (one track per center and phase) and a PNG timeline (matplotlib).

Everything is an ``(rounds, centers)`` numpy array: 100 centers × 1000 rounds take milliseconds
(``benchmarks/collab_simulator.py``).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from polyparallel.cluster.devices import Link
from polyparallel.strategy import Strategy

__all__ = ["FIXED_ROUND_S", "FUSE_S_PER_PARAM", "PHASES", "BufferedSimResult", "SimInputs",
           "SimResult", "balanced_local_steps", "center_links", "choose_local_steps", "inputs_from_strategy",
           "measured_phases", "simulate", "simulate_buffered", "simulate_rounds", "stragglers", "update_bytes"]

PHASES = ("framework", "distribute", "compute", "upload", "wait", "fuse")

#: Flower's fixed cost of one round on loopback (s) by framework: ``run_flower``'s defaults (``tuned``),
#: 1M-parameter MLP, 3 centers, H = 100 and 400, ``overhead = round − max compute − fusion − raw TCP time``:
#: 0.94 s and 0.83 s at load 3.3–3.8 (benchmarks/results/collab_flower_rounds.md, second table; the
#: issue's "0.8–1.0 s quiet"); 1.0–3.1 s at load 6–9 (its first table); 0.93 s, the median of 16 rounds
#: with emulated WAN links at load 12–24 (``benchmarks/collab_simulator.py --validate``, calibration
#: runs). The in-process engine has none.
FIXED_ROUND_S = {"flower": 0.9, "inprocess": 0.0}

#: Fusion seconds per parameter and fused center (FedAvg in float64 on one CPU core): 1.47 s for 3 × 25M
#: and 1.73 s for 5 × 25M, 0.05 s for 3 × 1M (benchmarks/results/collab.json, ``fusion`` column,
#: 2 shared cores under load) — 1.4–2.0e-8; we take 2e-8.
FUSE_S_PER_PARAM = 2e-8


def update_bytes(params: int, compression: str = "none", rows: int = 0) -> int:
    """Bytes of one center's update on the wire (:mod:`~polyparallel.backends.collab._wire`): float32
    ``4P``, fp16 ``2P``, int8 ``P`` plus a float32 scale for each of the model's ``rows`` (first axis of
    every tensor; 0 when unknown, which undercounts by ``4·rows`` bytes)."""
    per = {"none": 4, "fp16": 2, "int8": 1}
    if compression not in per:
        raise ValueError(f"unknown compression {compression!r}; choose one of {tuple(per)}")
    return int(params) * per[compression] + (4 * int(rows) if compression == "int8" else 0)


@dataclass(frozen=True)
class SimInputs:
    """What the simulator needs, one entry per center where a sequence.

    ``down_Bps``/``up_Bps`` may be ``inf`` (loopback: only latency and the fixed cost remain).
    """

    names: tuple[str, ...]
    step_s: np.ndarray
    local_steps: int
    params: int
    down_Bps: np.ndarray
    up_Bps: np.ndarray
    latency_s: np.ndarray
    model_bytes: float = 0.0
    upload_bytes: float = 0.0
    fixed_s: float = FIXED_ROUND_S["flower"]
    fuse_s_per_param: float = FUSE_S_PER_PARAM
    compression: str = "none"
    fixed_per_center_s: float = 0.0
    overlap: int = 0

    @classmethod
    def make(cls, names: Sequence[str], step_s: Sequence[float] | float, local_steps: int, params: int, *,
             down_Bps: Sequence[float] | float = math.inf, up_Bps: Sequence[float] | float = math.inf,
             latency_s: Sequence[float] | float = 0.0, compression: str = "none", model_bytes: float | None = None,
             upload_bytes: float | None = None, fixed_s: float = FIXED_ROUND_S["flower"],
             fuse_s_per_param: float = FUSE_S_PER_PARAM, fixed_per_center_s: float = 0.0,
             overlap: int = 0) -> SimInputs:
        n = len(names)

        def vec(v: Sequence[float] | float, what: str) -> np.ndarray:
            a = np.broadcast_to(np.asarray(v, dtype=float), (n,)).copy()
            if not np.all(np.isfinite(a) | (a == math.inf)) or np.any(a < 0):
                raise ValueError(f"{what} must be >= 0 for every center, got {a.tolist()}")
            return a

        if n < 1:
            raise ValueError("the simulation needs at least one center")
        if int(local_steps) < 1:
            raise ValueError(f"local_steps (H) must be >= 1, got {local_steps}")
        down, up = vec(down_Bps, "down bandwidth"), vec(up_Bps, "up bandwidth")
        if np.any(down <= 0) or np.any(up <= 0):
            raise ValueError("link bandwidths must be > 0 (inf for loopback)")
        if fixed_s < 0 or fuse_s_per_param < 0 or fixed_per_center_s < 0:
            raise ValueError("the fixed round cost and the fusion cost per parameter must be >= 0")
        if not 0 <= int(overlap) <= int(local_steps):
            raise ValueError(f"overlap must be in [0, H={local_steps}] local steps, got {overlap}")
        return cls(tuple(names), vec(step_s, "step time"), int(local_steps), int(params), down, up,
                   vec(latency_s, "latency"), float(4 * params if model_bytes is None else model_bytes),
                   float(update_bytes(params, compression) if upload_bytes is None else upload_bytes),
                   float(fixed_s), float(fuse_s_per_param), compression, float(fixed_per_center_s), int(overlap))

    @property
    def n(self) -> int:
        return len(self.names)

    def legs_s(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per center, the seconds of a round's three legs without jitter: its download of the model
        (latency + bytes on its link) ``D``, its ``H`` local steps ``C`` and its upload of the update ``U``."""
        return (self.latency_s + self.model_bytes / self.down_Bps, self.local_steps * self.step_s,
                self.latency_s + self.upload_bytes / self.up_Bps)

    def cycle_s(self) -> np.ndarray:
        """Per center, the seconds of one round alone: ``D + C + U`` (:meth:`legs_s`)."""
        return sum(self.legs_s())


def stragglers(inputs: SimInputs, factor: float = 1.5) -> list[int]:
    """The centers whose round alone (:meth:`SimInputs.cycle_s`) takes more than ``factor`` times the
    median center's: those a synchronous round waits for."""
    cycle = inputs.cycle_s()
    return [i for i, c in enumerate(cycle) if c > factor * float(np.median(cycle))]


def center_links(strategy: Any) -> dict[str, tuple[float, float, float]]:
    """Each center's WAN link from a Strategy's cluster echo: ``(down B/s, up B/s, latency s)``, the
    bandwidths as the cluster's ``Link`` counts them (× ports × efficiency / oversubscription); centers
    without a ``wan`` are left out (loopback). The simulator prices transfers with these figures and the
    collaborative backend emulates them (``config_from_strategy(..., emulate_links=True)``)."""
    out = {}
    for c in (getattr(strategy, "cluster", None) or {}).get("centers", []):
        w = c.get("wan")
        if w:  # the echo of ClusterTopology.to_dict back into the Link it came from
            lk = Link(w.get("kind", "wan"), w["up_Bps"], w["down_Bps"], float(w.get("latency_s", 0.0)),
                      w.get("ports", 1), w.get("efficiency", 1.0), w.get("oversubscription", 1.0))
            out[c.get("name")] = (lk.down_bandwidth, lk.up_bandwidth, lk.latency)
    return out


def inputs_from_strategy(strategy: Any, *, framework: str = "flower", fixed_s: float | None = None,
                         fuse_s_per_param: float = FUSE_S_PER_PARAM, local_steps: int | None = None,
                         compression: str | None = None, overlap: int | None = None) -> SimInputs:
    """The simulator's inputs from a collaborative :class:`~polyparallel.strategy.Strategy`: each center's
    step time as the planner priced it (``local_strategy["step_time_s"]``), its WAN link from the
    strategy's cluster echo (none: loopback), ``H``, the compression and the overlapped steps of the plan
    (or the overrides)."""
    collab = getattr(strategy, "collaborative", None)
    if collab is None:
        raise ValueError("the strategy has no 'collaborative' section: simulate a strategy from "
                         "`polyparallel search MODEL -c CLUSTER --mode collaborative`")
    if fixed_s is None:
        if framework not in FIXED_ROUND_S:
            raise ValueError(f"unknown framework {framework!r}; choose one of {tuple(FIXED_ROUND_S)} or give fixed_s")
        fixed_s = FIXED_ROUND_S[framework]
    links = center_links(strategy)
    steps, down, up, lat = [], [], [], []
    for c in collab.centers:
        s = c.local_strategy.get("step_time_s")
        if not isinstance(s, int | float) or not s > 0:
            raise ValueError(f"center {c.name!r} has no step_time_s in its local_strategy: re-run "
                             "`polyparallel search ... --mode collaborative` to price every center's plan")
        steps.append(float(s))
        d, u, la = links.get(c.name, (math.inf, math.inf, 0.0))
        down.append(d)
        up.append(u)
        lat.append(la)
    params = int(strategy.model.params)
    if params <= 0:
        raise ValueError("the strategy's model has no parameter count (model.params): re-run the search")
    H = local_steps or collab.local_steps
    return SimInputs.make([c.name for c in collab.centers], steps, H, params,
                          down_Bps=down, up_Bps=up, latency_s=lat, compression=compression or collab.compression,
                          fixed_s=fixed_s, fuse_s_per_param=fuse_s_per_param,
                          overlap=min(H, collab.overlap) if overlap is None else overlap)


@dataclass
class SimResult:
    """Per round and center: when each phase starts (``start``) and how long it lasts (``dur``)."""

    inputs: SimInputs
    round_start: np.ndarray  # (R,)
    round_s: np.ndarray  # (R,)
    dur: dict[str, np.ndarray]  # phase -> (R, N)
    start: dict[str, np.ndarray]  # phase -> (R, N)
    present: np.ndarray  # (R, N) bool
    concurrent: bool = True
    lead: np.ndarray | None = None  # (R, N) idle time before a center starts (centers one after another)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return len(self.round_s)

    @property
    def total_s(self) -> float:
        """Time to ``N`` rounds."""
        return float(self.round_s.sum())

    def shares(self) -> dict[str, float]:
        """Share of the centers' wall time in each phase (adds up to 1), and the grouped shares."""
        total = self.total_s * self.inputs.n
        out = {p: float(self.dur[p].sum() / total) if total > 0 else 0.0 for p in PHASES}
        out["communication"] = out["framework"] + out["distribute"] + out["upload"]
        out["idle"] = out["wait"]
        out["fusion"] = out["fuse"]
        return out

    def utilisation(self) -> np.ndarray:
        """Per center: compute time / wall time."""
        return self.dur["compute"].sum(axis=0) / self.total_s if self.total_s > 0 else np.zeros(self.inputs.n)

    def critical_comm_share(self) -> float:
        """``1 − (max_i C_i + F) / T`` summed over rounds: the share `benchmarks/collab.py` calls ``comm%``
        (everything of a round that is neither the slowest center's compute nor the fusion)."""
        busy = self.dur["compute"].max(axis=1) + self.dur["fuse"][:, 0]
        return float(1 - busy.sum() / self.total_s) if self.total_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        u = self.utilisation()
        per = {name: {p: float(self.dur[p][:, i].mean()) for p in PHASES} | {"utilisation": float(u[i])}
               for i, name in enumerate(self.inputs.names)}
        return {"rounds": self.rounds, "centers": self.inputs.n, "local_steps": self.inputs.local_steps,
                "concurrent": self.concurrent, "time_to_rounds_s": self.total_s,
                "mean_round_s": float(self.round_s.mean()), "utilisation": float(u.mean()),
                "shares": self.shares(), "comm_share_critical": self.critical_comm_share(),
                "fixed_s": self.inputs.fixed_s, "per_center_mean_s": per, **self.extra}

    # ------------------------------------------------------------------ outputs
    def table(self, max_centers: int = 20) -> str:
        s = self.summary()
        lines = [f"{self.rounds} rounds of H = {self.inputs.local_steps} local steps, {self.inputs.n} centers "
                 f"({'concurrent' if self.concurrent else 'one after another'}): {s['time_to_rounds_s']:.3f} s, "
                 f"mean round {s['mean_round_s']:.4f} s (framework fixed cost {self.inputs.fixed_s:g} s/round)",
                 "per center, mean seconds per round:",
                 f"  {'center':<14}" + "".join(f"{p:>11}" for p in PHASES) + f"{'util %':>9}"]
        for name, row in list(s["per_center_mean_s"].items())[:max_centers]:
            lines.append(f"  {name[:14]:<14}" + "".join(f"{row[p]:>11.4g}" for p in PHASES)
                         + f"{100 * row['utilisation']:>9.1f}")
        if self.inputs.n > max_centers:
            lines.append(f"  ... {self.inputs.n - max_centers} more centers")
        if self.inputs.overlap:
            lines.append(f"overlapped rounds (K = {self.inputs.overlap} steps): communication exposed "
                         f"{s['exposed_comm_s']:.4g} s, hidden {s['hidden_comm_s']:.4g} s per center and round; "
                         "the exposed part and waiting for the slowest center are 'wait', the rest runs behind "
                         "the steps")
        sh = s["shares"]
        lines.append("shares of wall time: " + ", ".join(f"{p} {100 * sh[p]:.1f}%" for p in PHASES))
        lines.append(f"communication {100 * sh['communication']:.1f}% (distribute + upload + framework), idle "
                     f"{100 * sh['idle']:.1f}%, fusion {100 * sh['fusion']:.1f}%, utilisation "
                     f"{100 * s['utilisation']:.1f}%; critical-path comm share "
                     f"{100 * s['comm_share_critical']:.1f}%")
        return "\n".join(lines)

    def blocks(self, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The intervals of ``phase``: (round index, center index, start s, duration s), non-empty ones."""
        st, du = self.start[phase], self.dur[phase]
        parts = []
        if phase == "wait" and self.lead is not None:  # the part of the wait before the center's turn
            du = du - self.lead
            lead_st = np.broadcast_to((self.round_start + self.dur["framework"][:, 0])[:, None], du.shape)
            r, c = np.nonzero(self.lead > 0)
            parts.append((r, c, lead_st[r, c], self.lead[r, c]))
        r, c = np.nonzero(du > 0)
        parts.append((r, c, st[r, c], du[r, c]))
        return tuple(np.concatenate(x) for x in zip(*parts))  # type: ignore[return-value]

    def trace(self) -> dict[str, Any]:
        """Chrome-trace / Perfetto JSON: one process per center, one thread (track) per phase, ``X`` events in µs."""
        ev: list[dict[str, Any]] = []
        for i, name in enumerate(self.inputs.names):
            ev.append({"ph": "M", "name": "process_name", "pid": i, "tid": 0, "args": {"name": name}})
            for k, p in enumerate(PHASES):
                ev.append({"ph": "M", "name": "thread_name", "pid": i, "tid": k, "args": {"name": p}})
        for k, p in enumerate(PHASES):
            r, c, st, du = self.blocks(p)
            ev.extend({"ph": "X", "name": p, "cat": "collab", "pid": int(ci), "tid": k, "ts": float(t * 1e6),
                       "dur": float(d * 1e6), "args": {"round": int(ri) + 1}}
                      for ri, ci, t, d in zip(r.tolist(), c.tolist(), st.tolist(), du.tolist()))
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"summary": self.summary()}}

    def write_trace(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.trace()))
        return p

    def plot(self, path: str | Path, max_rounds: int = 20, max_centers: int = 20) -> Path | None:
        """A PNG timeline of the first rounds (one row per center); None when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        colors = dict(zip(PHASES, ("#999999", "#4c72b0", "#55a868", "#dd8452", "#eeeeee", "#c44e52")))
        R, N = min(self.rounds, max_rounds), min(self.inputs.n, max_centers)
        fig, ax = plt.subplots(figsize=(10, 0.4 * N + 1.5))
        for p in PHASES:
            r, c, st, du = self.blocks(p)
            for i in range(N):
                keep = (c == i) & (r < R)
                ax.broken_barh(list(zip(st[keep], du[keep])), (i - 0.4, 0.8), facecolors=colors[p],
                               edgecolor="none", label=p if i == 0 else None)
        ax.set_yticks(range(N), list(self.inputs.names[:N]))
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"{R} of {self.rounds} rounds, H = {self.inputs.local_steps}")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(PHASES), frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return Path(path)


def _factor(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray | float:
    """Log-normal factors of mean 1 (log-sd ``sigma``), or 1.0 when ``sigma`` is 0."""
    if sigma <= 0:
        return 1.0
    return np.exp(rng.normal(-sigma * sigma / 2, sigma, shape))


def simulate(strategy: Any, rounds: int = 100, *, framework: str = "flower", compute_jitter: float = 0.0,
             link_jitter: float = 0.0, dropout: float = 0.0, seed: int | None = 0) -> SimResult:
    """``rounds`` rounds of a collaborative strategy (a :class:`~polyparallel.strategy.Strategy` or its
    JSON path) as planned: :func:`inputs_from_strategy` then :func:`simulate_rounds`."""
    if isinstance(strategy, str | Path):
        strategy = Strategy.from_json(strategy)
    return simulate_rounds(inputs_from_strategy(strategy, framework=framework), rounds,
                           compute_jitter=compute_jitter, link_jitter=link_jitter, dropout=dropout, seed=seed)


def simulate_rounds(inputs: SimInputs, rounds: int, *, compute_jitter: float = 0.0, link_jitter: float = 0.0,
                    dropout: float = 0.0, seed: int | None = 0, concurrent: bool = True,
                    step_s: np.ndarray | None = None) -> SimResult:
    """Simulate ``rounds`` rounds (module docstring). ``step_s``: an ``(rounds, centers)`` array of
    per-step times replacing ``inputs.step_s`` (e.g. measured ones)."""
    if int(rounds) < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout is a probability in [0, 1), got {dropout}")
    if compute_jitter < 0 or link_jitter < 0:
        raise ValueError("jitter must be >= 0 (the log-sd of a factor of mean 1)")
    R, N, x = int(rounds), inputs.n, inputs
    rng = np.random.default_rng(seed)
    present = rng.random((R, N)) >= dropout if dropout > 0 else np.ones((R, N), dtype=bool)
    steps = np.broadcast_to(x.step_s if step_s is None else np.asarray(step_s, dtype=float), (R, N))
    link_f = _factor(rng, link_jitter, (2, R, N))
    d_tx, u_tx = x.model_bytes / x.down_Bps, x.upload_bytes / x.up_Bps
    dist = np.where(present, x.latency_s + d_tx * (link_f[0] if link_jitter > 0 else 1.0), 0.0)
    comp = np.where(present, x.local_steps * steps * _factor(rng, compute_jitter, (R, N)), 0.0)
    up = np.where(present, x.latency_s + u_tx * (link_f[1] if link_jitter > 0 else 1.0), 0.0)
    busy = dist + comp + up
    fuse = x.fuse_s_per_param * x.params * present.sum(axis=1)  # (R,)
    fw = x.fixed_s + x.fixed_per_center_s * present.sum(axis=1)  # (R,)
    if x.overlap:
        if not concurrent or dropout > 0:
            raise ValueError("overlapped rounds are simulated for concurrent centers without dropouts")
        return _overlapped(x, dist, comp, up, fuse, fw)
    if concurrent:
        offset = np.zeros((R, N))
        ready = busy
    else:  # one after another: a center starts when the one before it has uploaded
        ready = np.cumsum(busy, axis=1)
        offset = ready - busy
    slowest = ready.max(axis=1)  # (R,)
    round_s = fw + slowest + fuse
    round_start = np.concatenate([[0.0], np.cumsum(round_s)[:-1]])
    t0 = round_start[:, None] + fw[:, None] + offset
    dur = {"framework": np.broadcast_to(fw[:, None], (R, N)).copy(), "distribute": dist, "compute": comp, "upload": up,
           "wait": slowest[:, None] - busy,  # = lead + (slowest − ready)
           "fuse": np.broadcast_to(fuse[:, None], (R, N)).copy()}
    # a center's wait is after its upload; one after another, also before it starts (``lead``)
    start = {"framework": np.broadcast_to(round_start[:, None], (R, N)).copy(), "distribute": t0,
             "compute": t0 + dist, "upload": t0 + dist + comp, "wait": t0 + busy,
             "fuse": np.broadcast_to((round_start + fw + slowest)[:, None], (R, N)).copy()}
    return SimResult(x, round_start, round_s, dur, start, present, concurrent, lead=offset)


def _overlapped(x: SimInputs, dist: np.ndarray, comp: np.ndarray, up: np.ndarray, fuse: np.ndarray,
                fw: np.ndarray) -> SimResult:
    """Overlapped rounds (module docstring): the send times ``t_i(r)`` round by round, vectorised over centers."""
    R, N = comp.shape
    H, k = x.local_steps, x.overlap
    step = comp / H
    round_start = np.zeros(R)
    compute_start, exposed, ready = np.zeros((R, N)), np.zeros((R, N)), np.zeros((R, N))
    hidden = np.zeros((R, N))
    sent = np.zeros(N)
    t = 0.0
    for r in range(R):
        round_start[r] = t
        avail = t + fw[r] + dist[r]  # the fused model x_r at each center
        if r == 0:
            compute_start[r] = avail
            sent = avail + comp[r]
        else:
            ready[r] = sent + k * step[r]
            exposed[r] = np.maximum(0.0, avail - ready[r])
            hidden[r] = (avail - sent) - exposed[r]
            compute_start[r] = sent
            sent = np.maximum(ready[r], avail) + (H - k) * step[r]
        t = float((sent + up[r]).max() + fuse[r])  # the next fused model leaves the server
    round_s = np.diff(np.append(round_start, t))
    wait = np.maximum(0.0, round_s[:, None] - comp)
    zero = np.zeros((R, N))
    first = np.zeros((R, N))
    first[0] = dist[0]
    dur = {"framework": zero.copy(), "distribute": first, "compute": comp, "upload": zero.copy(), "wait": wait,
           "fuse": zero.copy()}
    start = {"framework": np.broadcast_to(round_start[:, None], (R, N)).copy(),
             "distribute": np.broadcast_to(round_start[:, None], (R, N)) + first * 0, "compute": compute_start,
             "upload": compute_start + comp, "wait": np.where(exposed > 0, ready, compute_start + comp),
             "fuse": np.broadcast_to(round_start[:, None], (R, N)).copy()}
    dur["wait"] = wait - first
    res = SimResult(x, round_start, round_s, dur, start, np.ones((R, N), dtype=bool), True)
    res.extra.update(overlap=k, exposed_comm_s=float(exposed[1:].mean()) if R > 1 else 0.0,
                     hidden_comm_s=float(hidden[1:].mean()) if R > 1 else 0.0)
    return res


@dataclass
class BufferedSimResult:
    """Buffered asynchronous rounds, fusion by fusion: when each version is published, which centers'
    updates each fusion took and how stale they were, and each center's compute seconds."""

    inputs: SimInputs
    buffer: int
    published_s: np.ndarray  # (F + 1,): version 1 at 0, then after each fusion
    fused: list[list[tuple[str, int]]]  # per fusion: (center, staleness) of the updates it took
    compute_s: np.ndarray  # (N,): each center's seconds of local steps up to the last fusion
    refused: int = 0  # updates staler than max_staleness

    @property
    def round_s(self) -> np.ndarray:
        """Seconds between consecutive published versions (one per fusion)."""
        return np.diff(self.published_s)

    def updates(self) -> dict[str, int]:
        """Per center, how many of its updates the fusions took."""
        out = dict.fromkeys(self.inputs.names, 0)
        for f in self.fused:
            for c, _ in f:
                out[c] += 1
        return out

    def summary(self) -> dict[str, Any]:
        stale = [t for f in self.fused for _, t in f]
        total = float(self.published_s[-1])
        return {"fusions": len(self.fused), "buffer": self.buffer, "centers": self.inputs.n,
                "time_to_fusions_s": total, "mean_round_s": float(self.round_s.mean()),
                "updates": self.updates(), "mean_staleness": float(np.mean(stale)) if stale else 0.0,
                "refused": self.refused,
                "utilisation": (self.compute_s / total).tolist() if total > 0 else [0.0] * self.inputs.n}

    def table(self) -> str:
        s = self.summary()
        stale: dict[str, list[int]] = {c: [] for c in self.inputs.names}
        for f in self.fused:
            for c, t in f:
                stale[c].append(t)
        lines = [f"{s['fusions']} buffered fusions of K = {self.buffer} of {self.inputs.n} centers' updates (H = "
                 f"{self.inputs.local_steps}): {s['time_to_fusions_s']:.3f} s, mean round {s['mean_round_s']:.4f} s "
                 f"(fusion to fusion), mean staleness {s['mean_staleness']:.2f} versions"
                 + (f", {self.refused} updates refused as too stale" if self.refused else ""),
                 f"  {'center':<14}{'updates':>9}{'staleness':>11}{'util %':>9}"]
        for i, c in enumerate(self.inputs.names):
            mean = f"{np.mean(stale[c]):.2f}" if stale[c] else "-"
            lines.append(f"  {c[:14]:<14}{len(stale[c]):>9}{mean:>11}{100 * s['utilisation'][i]:>9.1f}")
        return "\n".join(lines)


def simulate_buffered(inputs: SimInputs, fusions: int, buffer: int, max_staleness: int | None = None,
                      pushed: bool = True, startup_s: Sequence[float] | float = 0.0,
                      join_s: Sequence[float] | float = 0.0) -> BufferedSimResult:
    """Buffered asynchronous rounds (``CollabConfig.buffer = K``, ``backends/collab/_buffered.py``), event by
    event. Version ``v`` is published at ``P_v``. A center that asks for a model at ``t`` takes the newest
    version if it is newer than the one it trained last, else waits for the next; its download of version
    ``v`` ends at ``max(P_v, its link's last download) + D_i`` (the server puts the model on the link when it
    publishes it), its ``H`` steps take ``C_i``, it sends at ``s = max(t, download end) + C_i`` and asks
    again at once; the update is in at ``max(s, its link's last upload) + U_i``. The server takes updates
    in the order they are in, one per center per fusion (a center's next one waits for the next fusion,
    as do updates that come in while it fuses), refuses one staler than ``max_staleness`` versions, and
    when it holds ``K`` fuses them: the next version is published ``F + K_fixed`` later (``F`` for ``K``
    updates). ``buffer = N`` is the synchronous round (:func:`simulate_rounds`); the centers' ``step_s``
    carry any slowdown.

    ``pushed=False`` is the data channel's protocol (``backends/collab/_lean.py``, one request and one
    reply per round on a center's connection): the server's thread for a center sends it the newest
    version when the center's update frame is in (the emulated upload is held on the server's side, after
    that), so a center's download starts when it asks (or at the next publish), not at ``P_v``.

    ``startup_s``: per center (or one for all), the seconds its first round takes beyond its ``H`` steps
    (a process's first steps warm up its kernels and allocator; a slow site's start-up is slow too). While a
    straggler starts up, the fusions are the other centers' alone. ``join_s``: when each center asks for
    its first model (a center joining mid-run takes the newest version then; 0: at the start)."""
    x, K, n = inputs, int(buffer), inputs.n
    if not 1 <= K <= n:
        raise ValueError(f"buffer must be in [1, {n}] (the centers), got {buffer}")
    if int(fusions) < 1:
        raise ValueError(f"fusions must be >= 1, got {fusions}")
    S = math.inf if max_staleness is None else int(max_staleness)
    D, C, U = x.legs_s()
    first = np.broadcast_to(np.asarray(startup_s, dtype=float), (n,))
    join = np.broadcast_to(np.asarray(join_s, dtype=float), (n,))
    for what, a in (("startup_s", first), ("join_s", join)):
        if np.any(a < 0) or not np.all(np.isfinite(a)):
            raise ValueError(f"{what} must be finite and >= 0 for every center, got {a.tolist()}")
    fuse_s = x.fuse_s_per_param * x.params * K + x.fixed_s + x.fixed_per_center_s * K
    events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, center, version): publish < in < ask
    seq = iter(range(1 << 62))
    published, trained = [0.0], [0] * n  # published[v - 1]: when version v came out
    down_free, up_free = np.zeros(n), np.zeros(n)
    steps: list[tuple[int, float]] = []  # (center, when its local steps end)
    waiting: list[int] = []  # centers that asked and wait for a newer version
    held: list[tuple[float, int, int]] = []  # updates in but not admissible yet (same center, or fusing)
    admitted: list[tuple[int, int]] = []
    fused: list[list[tuple[str, int]]] = []
    refused, busy_until = 0, 0.0

    def train(i: int, v: int, t: float) -> None:
        down_free[i] = max(published[v - 1] if pushed else t, down_free[i]) + D[i]
        sent = max(t, down_free[i]) + C[i] + (first[i] if v == 1 else 0.0)
        up_free[i] = max(sent, up_free[i]) + U[i]
        trained[i] = v
        steps.append((i, sent))
        heapq.heappush(events, (sent, 2, next(seq), i, v))
        heapq.heappush(events, (up_free[i], 1, next(seq), i, v))

    def admit(t: float, i: int, v_trained: int) -> None:
        nonlocal refused, busy_until
        if t < busy_until or any(c == i for c, _ in admitted):
            held.append((t, i, v_trained))
            return
        tau = len(published) - v_trained
        if tau > S:
            refused += 1
            return
        admitted.append((i, tau))
        if len(admitted) == K:
            busy_until = t + fuse_s
            heapq.heappush(events, (busy_until, 0, next(seq), -1, 0))

    for i in range(n):
        if join[i] > 0:  # it asks when it joins, and takes the newest version then
            heapq.heappush(events, (float(join[i]), 2, next(seq), i, 0))
        else:
            train(i, 1, 0.0)
    while len(fused) < fusions:
        t, kind, _, i, v = heapq.heappop(events)
        if kind == 0:  # a fusion is done: the next version is out
            fused.append([(x.names[c], tau) for c, tau in admitted])
            admitted.clear()
            published.append(t)
            for c in waiting:
                train(c, len(published), t)
            waiting.clear()
            again, held[:] = sorted(held), []
            for item in again:
                admit(t, item[1], item[2])
        elif kind == 1:
            admit(t, i, v)
        elif len(published) > trained[i]:  # asks: a newer version is out
            train(i, len(published), t)
        else:
            waiting.append(i)
    end, compute = published[-1], np.zeros(n)
    for i, done in steps:  # the steps within the simulated time (the last fusion's): one may run past it
        compute[i] += max(0.0, min(done, end) - (done - C[i]))
    return BufferedSimResult(x, buffer=K, published_s=np.array(published), fused=fused, compute_s=compute,
                             refused=refused)


def measured_phases(timing: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per round, from a run's timing events (``TimingLog``, ``rounds.jsonl``'s sibling): the round's wall
    time, the fusion time, and per center ``distribute`` (round start or the previous center's upload →
    received), ``compute`` (received → trained) and ``upload`` (trained → update received)."""
    by: dict[int, dict[str, Any]] = {}
    for e in timing:
        r = by.setdefault(int(e["round"]), {"center": {}, "server": {}})
        if e["role"] == "server" and e["who"] == "server":
            r["server"][e["event"]] = float(e["t"])
        elif e["role"] == "server" and e["event"] == "update_received":
            r["center"].setdefault(e["who"], {})["update_received"] = float(e["t"])
        elif e["role"] == "center":
            r["center"].setdefault(e["who"], {})[e["event"]] = float(e["t"])
    out: dict[int, dict[str, Any]] = {}
    for rnd, r in sorted(by.items()):
        s = r["server"]
        if not {"round_start", "round_end"} <= set(s):
            continue
        full = {c: v for c, v in r["center"].items()
                if {"received_model", "finished_training", "update_received"} <= set(v)}
        centers = {}
        for c, v in full.items():
            # the model is handed out at round start, or (centers one after another) once the center
            # before has been served
            before = [w["update_received"] for w in full.values()
                      if w["update_received"] <= v["received_model"]]
            t_out = max([s["round_start"], *before])
            centers[c] = {"distribute": v["received_model"] - t_out,
                          "compute": v["finished_training"] - v["received_model"],
                          "upload": v["update_received"] - v["finished_training"]}
        out[rnd] = {"round_s": s["round_end"] - s["round_start"],
                    "fuse_s": s.get("fusion_end", s["round_start"]) - s.get("fusion_start", s["round_start"]),
                    "centers": centers}
    return out


def choose_local_steps(inputs: SimInputs, target_comm: float, max_local_steps: int | None = None,
                       limit: int = 1 << 24, overlapped: bool = False) -> tuple[int, SimResult]:
    """The smallest ``H`` whose simulated round has a critical-path communication share
    (:meth:`SimResult.critical_comm_share`) of at most ``target_comm``, capped at ``max_local_steps``
    (label skew wants frequent fusion); with the simulated round at that ``H``.

    The share falls with ``H`` (numerator ``K + max_i(D_i + U_i − H(s_max − s_i))`` falls, the round
    grows), so a bisection over ``H`` finds it.

    ``overlapped``: rounds overlapped by a whole round (``overlap = H``); the share is then the steady
    state's (the third simulated round): the exposed communication ``max(0, c − H·s)`` over the round.
    One center with communication ``c`` and step ``s`` needs ``H ≥ c(1 − t) / s`` instead of the
    synchronous ``c(1 − t) / (t·s)``: a ``1/t`` times smaller ``H`` for a budget ``t``.
    """
    if not 0 < target_comm < 1:
        raise ValueError(f"the target communication share must be in (0, 1), got {target_comm}")
    cap = limit if max_local_steps is None else max(1, int(max_local_steps))

    def at(h: int) -> SimResult:
        if overlapped:
            return simulate_rounds(replace(inputs, local_steps=h, overlap=h), 3)
        return simulate_rounds(replace(inputs, local_steps=h, overlap=0), 1)

    def share(res: SimResult) -> float:
        if not overlapped:
            return res.critical_comm_share()
        return float(1 - res.dur["compute"][-1].max() / res.round_s[-1])

    lo, hi = 1, 1
    while hi < cap and share(at(hi)) > target_comm:
        lo, hi = hi + 1, min(cap, 2 * hi)
    while lo < hi:  # at(hi) meets the target (or hi == cap); the first H that does lies in [lo, hi]
        mid = (lo + hi) // 2
        if share(at(mid)) <= target_comm:
            hi = mid
        else:
            lo = mid + 1
    return hi, at(hi)


def balanced_local_steps(inputs: SimInputs) -> np.ndarray:
    """Per center, the local steps that fill its wait: ``H_i = ⌊(T − D_i − U_i) / s_i⌋`` with
    ``T = max_j (D_j + H·s_j + U_j)`` the slowest center's busy time at the job's ``H`` (so that center
    keeps ``H`` and the round does not grow). What per-center ``H`` would buy on unequal centers: the
    collaborative backend runs one ``H`` for every center (FedAvg of updates from unequal step counts
    also needs normalising, as FedNova does), so this is for the simulator and the planner's estimate only.
    Simulate it with ``simulate_rounds(inputs, R, step_s=inputs.step_s * H_i / H)``."""
    x = inputs
    d, _, u = x.legs_s()
    return np.maximum(1, np.floor((x.cycle_s().max() - d - u) / x.step_s + 1e-9)).astype(int)
