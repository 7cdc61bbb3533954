"""Measure this machine: matmul throughput by size, memory bandwidth, kernel floor, gloo collectives.

The result is a JSON file that ``Cluster.preset("local-cpu:<P>")`` (and any spec whose device
type names it under ``calibration:``) turns into a device type and an intra-node link:

* ``matmul``: ``{threads: [{n, flops, seconds}]}`` for square fp32 matmuls, 1 thread and all
  cores; the compute model interpolates it in log–log instead of a peak × efficiency;
* ``memory_bandwidth``: bytes/s of a large tensor copy (read + write), all cores;
* ``launch_overhead``: seconds of a 1-element add (dispatcher + kernel floor);
* ``per_processes``: the same kernel measurements taken by ``P`` processes at once (the
  slowest rank per size), for each group size ``P``: what each process of a ``P``-process
  run gets when its siblings compute too; ``local-cpu:<P>`` uses them when present;
* ``collectives``: gloo all-reduce times by message size and group size (2–4 real
  ``torch.distributed`` processes on loopback), and the α–β fit of the ring formula

      t(n, p) = 2(p−1)·α + 2(p−1)/p · n/B

  by non-negative least squares over all points (``fit: {alpha, bandwidth}``) and per group
  size (``fit_by_group_size``: ``local-cpu:<P>`` uses the fit measured with ``P`` processes).

Kernel timings are means over windows of back-to-back calls about a training step long, best
window kept: on a machine shared with other work, it is the least disturbed one, and it
includes the time-sharing between sibling processes that a real step sees.

Every multi-process run has a timeout: a hung group is killed and reported, never waited on.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["calibrate", "fit_alpha_beta", "free_port", "run_gloo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, threads: int, q: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        out = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", out))
    except Exception:  # the parent reports the worker's traceback
        q.put((rank, "error", traceback.format_exc()))


def run_gloo(fn: Callable[..., Any], world: int, args: tuple = (), timeout: float = 120.0,
             threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by a gloo group.

    ``fn`` must be importable (a module-level function). Returns the per-rank results; raises
    ``RuntimeError`` with the failing rank's traceback, or ``TimeoutError`` after ``timeout``
    seconds (the processes are killed).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    thr = threads if threads is not None else max(1, (os.cpu_count() or 1) // world)
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, thr, q), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"gloo group of {world} processes did not finish in {timeout:.0f} s")
            try:
                rank, status, out = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a gloo worker exited with code {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{out}")
            results[rank] = out
    finally:
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
                pr.join(timeout=5)
    return [results[r] for r in range(world)]


def _time(fn: Callable[[], Any], window: float = 0.03, windows: int = 5, max_calls: int = 100_000) -> float:
    """Seconds per call: the mean over a window of back-to-back calls, best of ``windows`` windows.

    A window (about one training step long) includes the time-sharing with sibling processes
    that a step sees; the best window is the one least disturbed by other tenants, which is
    how the benchmark reads its measured steps too.
    """
    fn()
    best = float("inf")
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= window or n >= max_calls:
                break
        best = min(best, el / n)
    return best


def _allreduce_sizes(rank: int, world: int, sizes: Sequence[int], iters: int) -> list[tuple[int, float]]:
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        x = torch.ones(max(1, n // 4))
        for _ in range(2):
            dist.all_reduce(x)
        ts = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        # all ranks finish together; the slowest rank's best repetition is the collective's time
        t = torch.tensor([min(ts)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append((n, float(t)))
    return out


def _kernel_rates(matmul_sizes: Sequence[int]) -> dict[str, Any]:
    """Matmul times by size, copy bandwidth and the 1-element op floor, in this process."""
    import torch

    rows = []
    for n in matmul_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        rows.append({"n": n, "flops": 2.0 * n**3, "seconds": _time(lambda a=a, b=b: torch.mm(a, b))})
    big = torch.empty(16 << 20)
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / _time(lambda: dst.copy_(big), window=0.1)
    one = torch.ones(1)
    floor = _time(lambda: torch.add(one, one), window=0.01)
    return {"matmul": rows, "memory_bandwidth": bw, "launch_overhead": floor}


def _group_measure(rank: int, world: int, sizes: Sequence[int], iters: int,
                   matmul_sizes: Sequence[int]) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    import torch.distributed as dist

    dist.barrier()
    kernels = _kernel_rates(matmul_sizes)  # all ranks at once: the occupancy a P-process run sees
    dist.barrier()
    return kernels, _allreduce_sizes(rank, world, sizes, iters)


def _slowest(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rows = [{**r, "seconds": max(k["matmul"][i]["seconds"] for k in per_rank)}
            for i, r in enumerate(per_rank[0]["matmul"])]
    return {"matmul": rows, "memory_bandwidth": min(k["memory_bandwidth"] for k in per_rank),
            "launch_overhead": max(k["launch_overhead"] for k in per_rank)}


def fit_alpha_beta(points: Sequence[tuple[int, float, float]]) -> dict[str, float]:
    """Fit ``t = 2(p−1)α + 2(p−1)/p · n/B`` to ``(p, n, t)`` points; non-negative least squares."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.array([[2 * (p - 1), 2 * (p - 1) / p * n] for p, n, _ in points], dtype=float)
    y = np.array([t for _, _, t in points], dtype=float)
    # weight by 1/t so small and large messages count alike (relative error)
    w = 1.0 / np.maximum(y, 1e-9)
    sol, _ = nnls(a * w[:, None], y * w)
    alpha, inv_b = float(sol[0]), float(sol[1])
    pred = a @ sol
    rel = float(np.median(np.abs(pred - y) / y))
    return {"alpha": alpha, "bandwidth": 1.0 / inv_b if inv_b > 0 else float("inf"), "median_rel_error": rel}


def calibrate(out: str | os.PathLike[str] | None = None, *, group_sizes: Sequence[int] = (2, 3, 4),
              sizes: Sequence[int] = (4096, 65536, 1 << 20, 8 << 20), matmul_sizes: Sequence[int] = (
                  32, 64, 128, 256, 512, 1024), iters: int = 5, timeout: float = 120.0,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine and write the calibration JSON to ``out`` (if given); returns it."""
    import torch

    say = progress or (lambda s: None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    prev_threads = torch.get_num_threads()
    result: dict[str, Any] = {
        "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
        "cores": cores, "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "memory_bytes": _total_memory(),
    }
    try:
        mm: dict[str, list[dict[str, float]]] = {}
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            rows = []
            for n in matmul_sizes:
                a, b = torch.randn(n, n), torch.randn(n, n)
                s = _time(lambda a=a, b=b: torch.mm(a, b))
                rows.append({"n": n, "flops": 2.0 * n**3, "seconds": s})
                say(f"matmul {n}x{n} on {threads} thread(s): {2 * n**3 / s / 1e9:.1f} GFLOP/s")
            mm[str(threads)] = rows
        result["matmul"] = mm
        torch.set_num_threads(cores)
        conv = []
        for c in (16, 64):
            x, w = torch.randn(8, c, 32, 32), torch.randn(c, c, 3, 3)
            s = _time(lambda x=x, w=w: torch.nn.functional.conv2d(x, w, padding=1))
            conv.append({"channels": c, "flops": 2.0 * 8 * c * c * 9 * 32 * 32, "seconds": s})
            say(f"conv2d {c} channels: {conv[-1]['flops'] / s / 1e9:.1f} GFLOP/s")
        result["conv"] = conv
        big = torch.empty(16 << 20)
        dst = torch.empty_like(big)
        s = _time(lambda: dst.copy_(big), window=0.1)
        result["memory_bandwidth"] = 2 * big.numel() * 4 / s
        say(f"memory bandwidth: {result['memory_bandwidth'] / 1e9:.1f} GB/s")
        one = torch.ones(1)
        result["launch_overhead"] = _time(lambda: torch.add(one, one), window=0.01)
    finally:
        torch.set_num_threads(prev_threads)
    points = []
    runs = []
    per_procs: dict[str, Any] = {}
    for p in group_sizes:
        try:
            res = run_gloo(_group_measure, p, (tuple(sizes), iters, tuple(matmul_sizes)), timeout=timeout,
                           threads=max(1, cores // p))
        except (TimeoutError, RuntimeError) as e:
            runs.append({"p": p, "error": str(e).splitlines()[0]})
            say(f"{p} processes: FAILED {e}")
            continue
        per_procs[str(p)] = _slowest([k for k, _ in res])
        best = max(r["flops"] / r["seconds"] for r in per_procs[str(p)]["matmul"])
        say(f"{p} processes at once: best matmul {best / 1e9:.1f} GFLOP/s per process, copy "
            f"{per_procs[str(p)]['memory_bandwidth'] / 1e9:.1f} GB/s per process")
        for n, t in res[0][1]:
            points.append((p, n, t))
            runs.append({"p": p, "bytes": n, "seconds": t})
            say(f"gloo all_reduce p={p} {n} B: {t * 1e6:.0f} us")
    result["per_processes"] = per_procs
    coll: dict[str, Any] = {"op": "all_reduce", "backend": "gloo", "points": runs}
    if points:
        coll["fit"] = fit_alpha_beta(points)
        # P processes alive change gloo's latency (time-sharing): a fit per group size as well
        coll["fit_by_group_size"] = {str(p): fit_alpha_beta([x for x in points if x[0] == p])
                                     for p in sorted({x[0] for x in points})}
        say(f"fit: alpha {coll['fit']['alpha'] * 1e6:.1f} us, bandwidth {coll['fit']['bandwidth'] / 1e9:.2f} GB/s")
    result["collectives"] = coll
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30
