"""Quantities with units (``"200 Gb/s"``, ``"5 us"``, ``"80 GB"``) and the error every part of a cluster
spec reports its mistakes with."""

from __future__ import annotations

import re
from typing import Any


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be used: says which file, which field, and what to do."""


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
UNIT_KINDS = {
    "bandwidth": "bytes/s (e.g. '200 Gb/s', '25 GB/s')",
    "time": "seconds (e.g. '5 us', '20 ms')",
    "bytes": "bytes (e.g. '80 GB', '32 GiB')",
    "flops": "FLOP/s (e.g. '312 TFLOP/s')",
}
_QTY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def _unit_factor(kind: str, unit: str) -> float | None:
    if kind == "time":  # divisors, so that "5 us" is exactly 5e-06
        div = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}.get(unit)
        return None if div is None else -div
    if kind == "flops":
        m = re.fullmatch(r"([kKMGTP]?)(?:FLOP/s|FLOPS|flop/s|OP/s|OPS)", unit)
        if unit == "":
            return 1.0
        return _PREFIX[m.group(1)] if m else None
    if kind == "bytes":
        m = re.fullmatch(r"([kKMGTP]i?)?B", unit)
        if unit == "":
            return 1.0
        return _PREFIX[m.group(1) or ""] if m else None
    if kind == "bandwidth":
        if unit == "":
            return 1.0
        m = re.fullmatch(r"([kKMGTP]i?)?(B|b)(?:/s|ps)", unit)
        if not m:
            return None
        return _PREFIX[m.group(1) or ""] * (1.0 if m.group(2) == "B" else 1.0 / 8)
    raise KeyError(kind)


def parse_quantity(value: Any, kind: str) -> float:
    """Parse ``"200 Gb/s"`` / ``"5 us"`` / ``"80 GB"`` / ``"312 TFLOP/s"`` into SI base units.

    Args:
        value: a number (already in SI base units) or a string with a unit.
        kind: ``bandwidth`` (bytes/s; ``b`` is bits, ``B`` bytes), ``time`` (s), ``bytes``,
            ``flops`` (FLOP/s).

    Raises:
        ValueError: the string has no number or an unknown unit.

    Examples:
        >>> parse_quantity("200 Gb/s", "bandwidth"), parse_quantity("5 us", "time")
        (25000000000.0, 5e-06)
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {UNIT_KINDS[kind]}, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {UNIT_KINDS[kind]}, got {value!r}")
    m = _QTY.match(value)
    factor = _unit_factor(kind, m.group(2)) if m else None
    if m is None or factor is None:
        raise ValueError(f"cannot read {value!r} as {UNIT_KINDS[kind]}")
    return float(m.group(1)) / -factor if factor < 0 else float(m.group(1)) * factor


def format_bandwidth(bps: float) -> str:
    for unit, f in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= f:
            return f"{bps / f:.4g} {unit}"
    return f"{bps:.4g} B/s"


def format_duration(s: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= f:
            return f"{s / f:.4g} {unit}"
    return f"{s * 1e9:.4g} ns"
