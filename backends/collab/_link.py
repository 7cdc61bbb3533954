"""Emulated WAN links: a center's download and upload held to its bandwidth and latency.

On one machine (loopback) a center receives the global model and sends its update at memory speed
(GB/s: only the framework's serialisation costs anything), so a federation on loopback says nothing
about a WAN. Every transfer over a center's link (:class:`~._config.CenterSpec` ``down_Bps``, ``up_Bps``,
``latency_s``; 0 means unlimited) is held to it at its receiving end — the center's own process for the
model it downloads, the server for the update it uploads — on the real serialized bytes (the arrays of
the message):

* a transfer of ``n`` bytes that the sender put on the link at ``t0`` is done at
  ``start + latency + n / bandwidth`` with ``start = max(t0, when the link's previous transfer was
  done)``; the receiver takes it no earlier. This is a token bucket of rate ``bandwidth`` with no burst
  (tokens accrue from ``t0``, and a transfer waits for all of its bytes' tokens), per direction.
* download: ``t0`` is when the server created the message (Flower's ``created_at``; on one machine the
  same clock), so the framework's own transit time is part of the emulated time, not added to it;
  in the in-process engine, when the engine hands the center the model.
* upload: the same at the receiving end, the server, from when the center created its reply (the
  reply's ``created_at``; the bandwidth is the job's, not the center's word): the server counts an
  update as received, and fuses, no earlier than the link would have delivered it. Held at the
  receiver, the framework's own transit is part of the emulated time rather than added to it: on a
  loaded machine Flower's transit of a 4 MB reply alone took 2–3 s (load 20 on 2 cores), which a
  sleep in the sender would have put on top of the link. In the in-process engine (no transit) the
  center sleeps before handing its update over.

The simulator (:mod:`polyparallel.cost_models.collab_simulator`) prices the same transfers as
``latency + bytes / bandwidth`` from the same figures (a Strategy's cluster, ``center_links``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["LinkThrottle", "nbytes_of"]


def nbytes_of(arrays: Mapping[str, Any]) -> int:
    """Bytes of array data in a mapping of arrays (numpy arrays, or Flower ``Array``s with ``.data``)."""
    total = 0
    for a in arrays.values():
        if isinstance(a, np.ndarray):
            total += a.nbytes
        else:
            data = getattr(a, "data", None)
            total += len(data) if isinstance(data, bytes | bytearray) else int(np.asarray(a).nbytes)
    return int(total)


@dataclass
class LinkThrottle:
    """One center's link: ``down_Bps``/``up_Bps`` bytes/s (0: unlimited) and ``latency_s`` per transfer.

    ``sleep`` and ``clock`` are replaceable for tests. A throttle with no limits never sleeps.
    """

    down_Bps: float = 0.0
    up_Bps: float = 0.0
    latency_s: float = 0.0
    sleep: Any = time.sleep
    clock: Any = time.time
    _free_at: dict[str, float] = field(default_factory=lambda: {"down": 0.0, "up": 0.0})

    def __post_init__(self) -> None:
        for what in ("down_Bps", "up_Bps", "latency_s"):
            v = float(getattr(self, what))
            if not (v >= 0 and np.isfinite(v)):
                raise ValueError(f"link {what} must be a finite number >= 0 (0: unlimited), got {v}")

    @property
    def limited(self) -> bool:
        return bool(self.down_Bps or self.up_Bps or self.latency_s)

    def done_at(self, direction: str, nbytes: int, t0: float) -> float:
        """When a transfer of ``nbytes`` put on the link at ``t0`` is done (and book the link until then)."""
        rate = self.down_Bps if direction == "down" else self.up_Bps
        start = max(t0, self._free_at[direction])
        end = start + self.latency_s + (nbytes / rate if rate else 0.0)
        self._free_at[direction] = end
        return end

    def transfer(self, direction: str, nbytes: int, t0: float | None = None) -> float:
        """Hold a transfer to the link: sleep until it is done; returns the seconds slept."""
        if direction not in ("down", "up"):
            raise ValueError(f"direction is 'down' or 'up', got {direction!r}")
        if not self.limited:
            return 0.0
        now = self.clock()
        wait = self.done_at(direction, int(nbytes), now if t0 is None else min(float(t0), now)) - now
        if wait > 0:
            self.sleep(wait)
        return max(wait, 0.0)

    def delivered(self, direction: str, nbytes: int, sent_at: float, arrived: float) -> float:
        """When a transfer that the framework delivered at ``arrived`` would have been delivered by the
        link (never before it arrived): for a receiver that holds it until then without sleeping now."""
        return max(arrived, self.done_at(direction, int(nbytes), min(sent_at, arrived))) if self.limited else arrived

    def download(self, nbytes: int, sent_at: float | None = None) -> float:
        return self.transfer("down", nbytes, sent_at)

    def upload(self, nbytes: int) -> float:
        return self.transfer("up", nbytes)

    @classmethod
    def of(cls, center: Any) -> LinkThrottle:
        """The throttle of a :class:`~._config.CenterSpec` (its ``down_Bps``, ``up_Bps``, ``latency_s``)."""
        return cls(center.down_Bps, center.up_Bps, center.latency_s)
