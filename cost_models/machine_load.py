"""Other work on the machine while something is measured: is a measurement this machine's own?

A calibration (:mod:`.calibrate`) and a measured run share the machine with whatever else runs on
it. :func:`cpu_clock` reads the machine's CPU time counters and this process tree's own CPU time;
between two readings :func:`other_work` gives the cores other processes kept busy and the share of
the CPU time a hypervisor gave to other virtual machines (:func:`stolen_since` that share alone).
:func:`calibration_warnings` says what makes a calibration untrustworthy: more other work than
``LOADED`` per core, more stolen time than ``STOLEN``, or a rate far below the machine's own best.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

__all__ = ["LOADED", "STOLEN", "calibration_warnings", "cpu_clock", "load_average", "other_work", "stolen_since"]

LOADED = 0.5  # load average per core above which measurements are slowed by other work
STOLEN = 0.05  # share of a virtual machine's CPU time its hypervisor gave to other machines


def cpu_clock() -> dict[str, Any]:
    """The machine's CPU time counters (``/proc/stat``: user nice system idle iowait irq softirq
    steal, in seconds) and this process's own CPU seconds with its waited-for children's, now;
    empty counters where ``/proc/stat`` is not there."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        tick = os.sysconf("SC_CLK_TCK")
        machine = [int(x) / tick for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        machine = []
    return {"machine": machine, "own": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime}


def other_work(start: dict[str, Any], end: dict[str, Any], cores: int) -> dict[str, float]:
    """Between two :func:`cpu_clock` readings: ``others``, the cores other processes kept busy on
    average (the machine's busy time less this process tree's), and ``steal``, the share of the CPU
    time a hypervisor gave to other virtual machines; empty without the machine's counters."""
    a, b = start["machine"], end["machine"]
    if len(a) != 8 or len(b) != 8:
        return {}
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d)
    if total <= 0:
        return {}
    busy = d[0] + d[1] + d[2] + d[5] + d[6]
    wall = total / max(cores, 1)
    return {"others": round(max(0.0, busy - (end["own"] - start["own"])) / wall, 3), "steal": round(d[7] / total, 4)}


def stolen_since(start: dict[str, Any]) -> float:
    """The share of the CPU time the hypervisor took since the :func:`cpu_clock` reading ``start``
    (0 without the machine's counters)."""
    return other_work(start, cpu_clock(), 1).get("steal", 0.0)


def calibration_warnings(cal: dict[str, Any]) -> list[str]:
    """What makes a calibration untrustworthy: other work running while it measured (the cores
    other processes kept busy during it, or without those counters the load average before it,
    above ``LOADED`` per core; a hypervisor taking more than ``STOLEN`` of the CPU time), or a
    matmul rate far below the machine's own best (a measurement hit by a burst)."""
    out = []
    cores = int(cal.get("cores") or 1)
    during = cal.get("other_work") or {}
    # the CPU time other processes took while it measured; the load average before it (it also
    # counts work that had just ended) only where the machine's counters were not there
    busy = during.get("others", cal.get("load_average"))
    again = "run `polyparallel calibrate` again when it is quiet"
    if busy is not None and busy > LOADED * cores:
        what = (f"other processes kept {busy:.1f} cores busy" if "others" in during else
                f"load average {busy:.1f}")
        out.append(f"the machine was busy while measuring ({what} on {cores} cores): the figures are slower than "
                   f"this machine; {again}")
    if during.get("steal", 0.0) > STOLEN:
        out.append(f"the virtual machine lost {100 * during['steal']:.0f}% of its CPU time to its hypervisor while "
                   f"measuring (other machines on the host): the figures are slower and noisier; {again}")
    rows = [r for rs in (cal.get("matmul") or {}).values() for r in rs if r.get("seconds")]
    rates = sorted(r["flops"] / r["seconds"] for r in rows)
    if rates and rates[0] < 0.01 * rates[-1] and rows:
        worst = min(rows, key=lambda r: r["flops"] / r["seconds"])
        out.append(f"matmul {worst['n']}x{worst['n']} ran at {worst['flops'] / worst['seconds'] / 1e9:.3f} GFLOP/s, "
                   f"under 1% of the best {rates[-1] / 1e9:.1f} GFLOP/s: a measurement disturbed by other work")
    return out


def load_average() -> float | None:
    """The machine's 1-minute load average, or None where the system does not say."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None
