"""The round protocol of a center whose local training runs in several long-lived rank processes,
whatever starts them (torch processes in ``_dp_center``, MindSpore's msrun in ``_mindspore_dp``).

Each rank holds one connection to the trainer. Per round the trainer sends every rank one request
(``("round", params, steps, round_idx, proximal_mu, ...)``) and waits for each reply
``("done", model, losses)``, checking while it waits that the rank can still answer; rank 0's model
is the center's local model and the mean of the ranks' losses (each the mean over an equal share)
the global batch's. ``("error", why)`` from any rank, a rank that can no longer answer, or no
answer within ``timeout_s`` stops every rank and raises naming the rank and the round.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._center import CenterData

__all__ = ["RankedCenter"]


@dataclass
class RankedCenter(CenterData):
    """A :class:`~._center.CenterData` trained by ``devices`` rank processes. A subclass starts
    them in its ``__post_init__``, fills ``_conns`` (rank order) and sets ``_finalizer`` (a
    ``weakref.finalize`` that stops them); it says when a rank can no longer answer (:meth:`_dead`)
    and may say more about one that is late (:meth:`_late`) and add to the round request
    (:meth:`_round_request`)."""

    devices: int = 2
    timeout_s: float = 300.0
    _conns: list[Any] = field(default_factory=list, init=False, repr=False)

    def _dead(self, rank: int) -> str | None:
        """Why ``rank`` can no longer answer (its process exited, say); ``None`` while it can."""
        raise NotImplementedError

    def _late(self, rank: int) -> str:
        """What to say when ``rank`` has not answered within ``timeout_s``."""
        return f"no answer within {self.timeout_s:.0f} s"

    def _round_request(self, params: dict[str, np.ndarray], steps: int, round_idx: int, mu: float) -> tuple:
        return ("round", params, steps, round_idx, mu)

    def _recv(self, rank: int, what: str) -> tuple:
        conn = self._conns[rank]
        end = time.time() + self.timeout_s
        while not conn.poll(0.1):
            why = self._dead(rank) or (self._late(rank) if time.time() > end else None)
            if why:
                self.close()
                raise RuntimeError(f"rank {rank} of center {self.center_index} failed during {what}: {why}")
        msg = conn.recv()
        if msg[0] == "error":
            self.close()
            raise RuntimeError(f"center {self.center_index} failed during {what}: {msg[1]}")
        return msg

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float = 0.0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        if not self._conns:
            raise RuntimeError("this center's trainer was closed")
        params = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in global_params.items()}
        for conn in self._conns:
            conn.send(self._round_request(params, steps, round_idx, float(proximal_mu)))
        replies = [self._recv(r, f"round {round_idx}") for r in range(self.devices)]
        # each rank's loss is the mean over its equal share (tensor-parallel peers: the same share):
        # the global batch's is their mean
        return replies[0][1], {"train_loss": float(np.mean([np.mean(r[2]) for r in replies]))}

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None and finalizer.alive:
            finalizer()
        self._conns.clear()

    def __enter__(self) -> RankedCenter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
