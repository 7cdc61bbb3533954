"""Device types from measurements: ``polyparallel calibrate`` files (this machine's CPU processes, a
GPU's kernels and host overheads) turned into :class:`~polyparallel.cluster.devices.DeviceType` rates."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from polyparallel.cluster.devices import DeviceType
from polyparallel.cluster.units import ClusterSpecError


def _fwd_bwd_rows(table: Mapping[str, Sequence[Mapping[str, Any]]],
                  size: str = "flops") -> tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...]:
    """Measured ``{key: [{size, "forward_s", "backward_s"}, ...]}`` rows as sorted ``(key, ((size,
    forward, backward), ...))`` pairs, keys without rows left out (attention, conv, streaming kernels)."""
    return tuple(sorted((key, tuple(sorted((float(r[size]), float(r["forward_s"]), float(r["backward_s"]))
                                           for r in rows)))
                        for key, rows in table.items() if rows))


def gpu_calibrated_type(base: DeviceType, cal: Mapping[str, Any]) -> DeviceType:
    """``base`` (data-sheet figures) with a GPU calibration's measurements
    (:mod:`polyparallel.cost_models.calibrate_gpu`) laid over it.

    Kept from the data sheet: peaks (for dtypes not measured and for vector ops) and the
    bandwidth figure; the copy bandwidth measured becomes ``memory_efficiency`` = measured /
    data sheet, so a streaming kernel is priced at what this GPU reaches. Measured matmul curves
    per dtype, fused-attention rows, convolution rows per dtype and kernel class, the tiny-op floor
    and the memory capacity replace the modelled values.
    """
    curves = tuple(sorted((dt, tuple(sorted((float(r["flops"]), float(r["seconds"])) for r in rows)))
                          for dt, rows in cal["matmul"].items() if rows))
    conv: dict[str, list] = {}
    for key, rows in cal.get("conv", {}).items():  # "bf16/3x3", "bf16/1x1": one class per kernel size > 1 or = 1
        dt, _, k = key.partition("/")
        conv.setdefault(f"{dt}/{'1x1' if k == '1x1' else 'kxk'}", []).extend(rows)
    att, convs = _fwd_bwd_rows(cal.get("attention", {})), _fwd_bwd_rows(conv)
    streams = _fwd_bwd_rows(cal.get("streaming", {}), size="numel")
    host = tuple(sorted([(k, float(v)) for k, v in cal.get("training_ops", {}).items()] +
                        [(f"{dt}/{k}", float(v)) for dt in ("bf16", "fp16")
                         for k, v in cal.get(f"training_ops_{dt}", {}).items()]))
    opt_host = tuple(sorted((k, float(v["fixed"]), float(v["per_tensor"]))
                            for k, v in cal.get("optimizer_host", {}).items()))
    ratios = sorted(float(r["seconds"]) / float(r["padded_seconds"])
                    for rows in cal.get("misaligned", {}).values() for r in rows if float(r["padded_seconds"]) > 0)
    misaligned = ratios[len(ratios) // 2] if ratios else 1.0
    eff = min(1.0, float(cal["memory_bandwidth"]) / base.memory_bandwidth)
    return replace(base, misaligned_factor=max(1.0, misaligned), memory=float(cal.get("memory_bytes", base.memory)),
                   launch_overhead=float(cal["launch_overhead"]), matmul_curves=curves, attention_curves=att,
                   conv_curves=convs, streaming_rows=streams, host_op_seconds=host, optimizer_host=opt_host,
                   memory_efficiency=eff,
                   source=f"{base.source}; calibrated {cal.get('device_name', '?')} ({cal.get('host', '?')}, "
                          f"{cal.get('date', '?')}, torch {cal.get('torch', '?')})")


def default_calibration_path() -> Path:
    """``$POLYPARALLEL_CALIBRATION``, else ``~/.cache/polyparallel/calibration.json``."""
    env = os.environ.get("POLYPARALLEL_CALIBRATION")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "polyparallel" / "calibration.json"


def read_calibration(p: Path) -> dict[str, Any]:
    try:
        cal = json.loads(p.read_text())
    except FileNotFoundError:
        raise ClusterSpecError(f"calibration file {p} not found: run `polyparallel calibrate --out {p}`") from None
    except json.JSONDecodeError as e:
        raise ClusterSpecError(f"calibration file {p} is not valid JSON ({e}): run `polyparallel calibrate` "
                               "again") from None
    need = ("matmul", "memory_bandwidth", "launch_overhead") if cal.get("kind") == "cuda" else \
        ("cores", "matmul", "memory_bandwidth")
    for key in need:
        if key not in cal:
            raise ClusterSpecError(f"calibration file {p} lacks {key!r}: run `polyparallel calibrate` again")
    return cal


def calibrated_cpu_type(name: str, cal: Mapping[str, Any], procs: int, base: DeviceType | None = None) -> DeviceType:
    """A CPU process's device type from a calibration; ``procs`` processes share the cores.

    Each process computes on ``threads_per_process`` intra-op threads (1: what the torch
    backend's workers run). Rates measured with ``procs`` processes at once (``per_processes``:
    matmul curve, copy bandwidth, kernel floor, training-op floor, fused-attention rows) are
    used as they are; otherwise the rates of one process alone (``per_processes["1"]``, or
    the 1-thread ``matmul`` curve of an older calibration) are scaled by the core share
    ``min(1, cores / procs)`` (processes beyond the core count time-share).
    """
    cores = int(cal["cores"])
    threads = int(cal.get("threads_per_process", 1))
    per = cal.get("per_processes", {})
    measured = per.get(str(procs))
    if measured:  # taken with `procs` processes computing at once: no scaling to guess
        curve = tuple(sorted((float(p["flops"]), float(p["seconds"])) for p in measured["matmul"]))
        mem_bw = float(measured["memory_bandwidth"])
        floor = float(measured["launch_overhead"])
        training = float(measured.get("training_op_overhead", 0.0))  # older calibrations: not measured
        att = measured.get("attention", [])
        opt = dict(measured.get("optimizer_tensor_overhead", {}))
        framework, share = measured, 1.0
    else:
        share = min(1.0, cores / procs)
        alone = per.get("1")
        if alone:
            rows, mem_bw, floor = alone["matmul"], float(alone["memory_bandwidth"]), float(alone["launch_overhead"])
            training = float(alone.get("training_op_overhead", 0.0))
            att = alone.get("attention", [])
            opt = dict(alone.get("optimizer_tensor_overhead", {}))
            framework = alone
        else:
            by_threads = {int(k): v for k, v in cal["matmul"].items()}
            rows = by_threads[1] if 1 in by_threads else by_threads[min(by_threads)]
            # an all-core copy bandwidth: one process gets its share of the cores
            mem_bw = float(cal["memory_bandwidth"]) / cores
            floor = float(cal.get("launch_overhead", 5e-6))
            training, att, opt, framework = 0.0, [], {}, {}
        att = [{**r, "forward_s": float(r["forward_s"]) / share, "backward_s": float(r["backward_s"]) / share}
               for r in att]
        curve = tuple(sorted((float(p["flops"]), float(p["seconds"]) / share) for p in rows))
        mem_bw *= share
        floor /= share
        training /= share
        opt = {o: float(v) / share for o, v in opt.items()}
    elem, gemm, acc = _framework_rates(cal, procs, framework, share)
    peak = max(f / s for f, s in curve)
    # DTensor's dispatch cost, measured with >= 2 processes: the nearest measured process count
    dts = {int(k): float(v["dtensor_overhead"]) for k, v in per.items() if "dtensor_overhead" in v}
    sharded = dts[min(dts, key=lambda k: (abs(k - procs), -k))] if dts else 0.0
    # a tensor-parallel Linear's kernels, and the optimizer per sharded tensor, where measured (nearest P)
    tps = {int(k): v for k, v in per.items() if "tp_op_overhead" in v}
    near = tps[min(tps, key=lambda k: (abs(k - procs), -k))] if tps else {}
    try:
        if near:
            sharded = float(near["tp_op_overhead"])
        opt_dt = tuple(sorted((str(o), float(v)) for o, v in near.get("optimizer_dtensor_overhead", {}).items()))
    except (TypeError, ValueError, AttributeError) as e:
        raise ClusterSpecError(f"calibration file {cal.get('path', '?')}: malformed tp_op_overhead / "
                               f"optimizer_dtensor_overhead ({type(e).__name__}: {e}); run `polyparallel calibrate` "
                               "again") from None
    if sharded < 0 or any(v < 0 for _, v in opt_dt):
        raise ClusterSpecError(f"calibration file {cal.get('path', '?')}: negative DTensor overhead "
                               f"(tp_op_overhead {sharded}, optimizer_dtensor_overhead {dict(opt_dt)}); run "
                               "`polyparallel calibrate` again")
    return DeviceType(name=name, kind="cpu", peak=(("fp32", peak),), vendor="this machine",
                      memory=float(cal.get("memory_bytes", 8 * 2**30)) / procs, memory_bandwidth=mem_bw,
                      launch_overhead=floor, sharded_op_overhead=sharded, training_op_overhead=training,
                      attention_curves=_fwd_bwd_rows({"fp32": att}),
                      optimizer_tensor_overhead=tuple(sorted((o, float(v)) for o, v in opt.items())),
                      optimizer_element_rates=elem, gemm_rates=gemm, grad_accumulation=acc,
                      optimizer_dtensor_overhead=opt_dt,
                      source=f"calibration {cal.get('path', '')} ({cal.get('host', '?')}, {cal.get('date', '?')}, "
                             f"{threads} thread(s)/process, {procs} processes on {cores} cores)"
                             + "".join(f"; WARNING: {w}" for w in cal.get("warnings", ())),
                      matmul_curve=curve)


def _framework_rates(cal: Mapping[str, Any], procs: int, k: Mapping[str, Any], share: float) -> tuple[
        tuple[tuple[str, tuple[tuple[float, float], ...]], ...], tuple[tuple[str, int, int, float], ...], float]:
    """The optimizer-per-element, skinny-GEMM and gradient-accumulation rates of one ``per_processes``
    entry ``k`` (times scaled by ``1 / share`` when measured with fewer processes), checked: a bad
    entry is a :class:`ClusterSpecError` naming the file, the key and the fix."""
    where = f"calibration file {cal.get('path', '?')}, per_processes[{procs}]"
    fix = "run `polyparallel calibrate` again"
    try:
        elem = tuple(sorted((str(o), tuple(sorted((float(e), float(r) / share) for e, r in rows)))
                            for o, rows in k.get("optimizer_element", {}).items()))
        gemm = tuple(sorted((str(r["role"]), int(r["small"]), int(r["large"]), float(r["seconds"]) / share)
                            for r in k.get("gemm", [])))
        acc = float(k.get("grad_accumulation", 0.0)) / share
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ClusterSpecError(f"{where}: malformed optimizer_element / gemm / grad_accumulation entry "
                               f"({type(e).__name__}: {e}); {fix}") from None
    for o, rows in elem:
        if not rows or any(e <= 0 or r < 0 for e, r in rows):
            raise ClusterSpecError(f"{where}.optimizer_element[{o!r}]: needs [elements > 0, seconds >= 0] rows, "
                                   f"got {list(rows)}; {fix}")
    for role, small, large, sec in gemm:
        if role not in ("out", "reduce") or small < 1 or large < 1 or sec <= 0:
            raise ClusterSpecError(f"{where}.gemm: row (role {role!r}, small {small}, large {large}, seconds {sec}) "
                                   f"needs role 'out' or 'reduce', sizes >= 1 and seconds > 0; {fix}")
    if acc < 0:
        raise ClusterSpecError(f"{where}.grad_accumulation: {acc} s per element is negative; {fix}")
    return elem, gemm, acc
