"""The in-process engine: the same round logic as the Flower deployment, with no networking.

Centers train one after the other in this process (their work is independent, so the fused result
is the one a parallel deployment computes); the server code, the wire format and the validation are
the very ones the Flower ServerApp and ClientApps run. It exists for fast tests and as the reference
the Flower engine is checked against.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._center import LocalTrainer, center_round, evaluate_torch, make_trainer
from ._config import CollabConfig
from ._fusion import Params
from ._models import build_torch_model, torch_state
from ._server import CenterReply, FederationServer, RoundRecord, TimingLog

__all__ = ["CollabResult", "initial_params", "run_inprocess"]

Data = Mapping[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class CollabResult:
    """The fused model after the last round, the per-round records and the timing events."""

    params: Params
    rounds: tuple[RoundRecord, ...]
    timing: tuple[Mapping[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": [r.to_dict() for r in self.rounds], "timing": [dict(t) for t in self.timing]}


def initial_params(config: CollabConfig) -> Params:
    """The global model of round 1: the torch model of ``config.model`` initialised from ``config.seed``."""
    return torch_state(build_torch_model(config.model, config.seed))


def _check_data(config: CollabConfig, data: Data) -> None:
    names = {c.name for c in config.centers}
    if set(data) != names:
        raise ValueError(f"data given for centers {sorted(data)}, but the federation has {sorted(names)}")


def run_inprocess(config: CollabConfig, data: Data, *, eval_data: tuple[np.ndarray, np.ndarray] | None = None,
                  timing_path: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                  resume: bool = False, max_rounds: int | None = None,
                  trainers: Mapping[str, LocalTrainer] | None = None,
                  absent: Mapping[int, tuple[str, ...]] | None = None,
                  center_states: dict[str, dict[str, np.ndarray]] | None = None) -> CollabResult:
    """Run the federation in this process.

    Args:
        config: the job.
        data: center name -> ``(x, y)`` numpy arrays (they never leave their trainer).
        eval_data: held-out ``(x, y)`` on which the server evaluates every fused model.
        timing_path: JSON-lines file for the round events.
        checkpoint_dir: where the server checkpoints after each round.
        resume: continue from the checkpoint in ``checkpoint_dir`` if there is one.
        max_rounds: stop after this many rounds in this call (the rest can be resumed).
        trainers: replace the trainer of some centers (e.g. a misbehaving one in tests).
        absent: round -> centers that do not answer that round (a crashed or slow center).
        center_states: what each center keeps between rounds (SCAFFOLD's ``c_i``), updated in place;
            pass the same dict to a resumed run to model centers that stayed up while the server
            restarted (default: a fresh, empty memory per center for this call).
    """
    _check_data(config, data)
    timing = TimingLog(timing_path)
    server = FederationServer(config, initial_params(config), timing, checkpoint_dir)
    if resume:
        server.resume()
    pool: dict[str, LocalTrainer] = {c.name: make_trainer(config, c.name, *data[c.name]) for c in config.centers
                                     if not trainers or c.name not in trainers}
    pool.update(trainers or {})
    evaluate = None
    if eval_data is not None:
        def evaluate(p: Params) -> dict[str, float]:
            return evaluate_torch(config.model, p, *eval_data)
    try:
        states = {} if center_states is None else center_states
        for c in config.centers:
            states.setdefault(c.name, {})
        _run_rounds(config, server, pool, evaluate, max_rounds, absent, states)
    finally:  # a data-parallel center's worker processes end with the run
        for name, t in pool.items():
            if not trainers or name not in trainers:
                getattr(t, "close", lambda: None)()
    return CollabResult(server.params, tuple(server.history), tuple(timing.events))


def _run_rounds(config: CollabConfig, server: FederationServer, pool: Mapping[str, LocalTrainer],
                evaluate: Any, max_rounds: int | None, absent: Mapping[int, tuple[str, ...]] | None,
                center_states: Mapping[str, dict[str, np.ndarray]]) -> None:
    # center_states: each center's memory across rounds (SCAFFOLD's c_i); the server never reads it
    done = 0
    while not server.done and (max_rounds is None or done < max_rounds):
        r, global_params = server.begin_round()
        control = server.control()
        replies = []
        for c in config.centers:
            if c.name in (absent or {}).get(r, ()):
                continue
            t_recv = time.time()
            payload, metrics = center_round(pool[c.name], {k: v.copy() for k, v in global_params.items()},
                                            round_idx=r, config=config, proximal_mu=server.fusion.proximal_mu,
                                            t_received=t_recv, control=control, center_state=center_states[c.name])
            replies.append(CenterReply(c.name, payload, metrics))
            server.timing.record(r, "server", c.name, "update_received")
        server.finish_round(r, replies, evaluate=evaluate)
        done += 1
