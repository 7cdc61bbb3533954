"""The in-process engine: the same round logic as the Flower deployment, with no networking.

Centers train one after the other in this process (their work is independent, so the fused result
is the one a parallel deployment computes); the server code, the wire format and the validation are
the very ones the Flower ServerApp and ClientApps run. It exists for fast tests and as the reference
the Flower engine is checked against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._buffered import buffered_rounds
from ._center import LocalTrainer, center_evaluate, center_round, evaluate_torch, load_center_data
from ._config import CollabConfig
from ._foreign import import_frameworks
from ._fusion import Params
from ._link import LinkThrottle, nbytes_of
from ._models import build_torch_model, torch_state
from ._overlap import pipelined_rounds
from ._pruning import with_input_of
from ._pruning_foreign import conform
from ._server import CenterReply, FederationServer, RoundRecord, TimingLog, aggregate_evaluations
from ._trainers import make_trainer

__all__ = ["CollabResult", "check_data", "initial_params", "run_inprocess"]

Data = Mapping[str, tuple[np.ndarray, np.ndarray]]
#: rewrites one center's reply: (round, payload, metrics, the round's nonce) -> (payload, metrics)
Tamper = Callable[[int, dict[str, np.ndarray], dict[str, float], int],
                  tuple[dict[str, np.ndarray], dict[str, float]]]


@dataclass(frozen=True)
class CollabResult:
    """The fused model after the last round, the per-round records and the timing events.

    ``ok`` is False when no round of the run fused: the model is then the initial one, and a run
    reporting it must not say it succeeded (``problem`` says why).
    """

    params: Params
    rounds: tuple[RoundRecord, ...]
    timing: tuple[Mapping[str, Any], ...]
    #: a pruning job's plan, per-round masks and full-size model at the cut (``_pruning_server.ServerPruning.outcome``)
    pruning: Mapping[str, Any] | None = None

    @property
    def fused_rounds(self) -> int:
        return sum(1 for r in self.rounds if r.fused)

    @property
    def ok(self) -> bool:
        return not self.rounds or self.fused_rounds > 0

    @property
    def problem(self) -> str:
        """Why the run did not succeed ('' when it did)."""
        if self.ok:
            return ""
        reasons = sorted({f"{c}: {why[0]}" for r in self.rounds for c, why in r.rejected.items()})
        return (f"no round fused in {len(self.rounds)} rounds; the model is the initial one"
                + (" (rejected: " + " | ".join(reasons[:4]) + ")" if reasons else ""))

    def to_dict(self) -> dict[str, Any]:
        out = {"rounds": [r.to_dict() for r in self.rounds], "timing": [dict(t) for t in self.timing],
               "fused_rounds": self.fused_rounds, "ok": self.ok, "flagged": self.flagged()}
        if self.pruning is not None:
            out["pruning"] = {k: v for k, v in self.pruning.items() if k != "cut_params"}
        return out

    def flagged(self) -> dict[str, dict[str, Any]]:
        """The centers flagged in at least one round, with the rounds and why (the audit's summary).

        A center is flagged in a round when its reply was refused, when the fusion gave it no trust
        (``trust == 0``: FLTrust, FLAME, FoolsGold, centered clipping's consensus filter), or when its update
        pointed against the fused step (``cos_fused < 0``). The per-round values stay in each round's
        ``metrics``; this names who to look at.
        """
        out: dict[str, dict[str, Any]] = {}
        for r in self.rounds:
            why: dict[str, str] = {c: "refused: " + reasons[0] for c, reasons in r.rejected.items()}
            for c, m in r.metrics.items():
                if m.get("trust", 1.0) <= 0.0 and "cos_root" in m:  # FLTrust: against the server's root set
                    why[c] = f"no trust (cosine to the server's root update {m['cos_root']:+.3f})"
                elif m.get("trust", 1.0) <= 0.0 and "cos_consensus" in m:  # centered_clip's consensus filter
                    why[c] = (f"no trust: the fusion left its update out of the fused model (cosine to the "
                              f"consensus {m['cos_consensus']:+.3f})")
                elif m.get("trust", 1.0) <= 0.0:  # FLAME's minority cluster, FoolsGold's look-alike
                    why[c] = "no trust: the fusion left its update out of the fused model"
                elif m.get("cos_fused", 0.0) < 0.0:
                    why[c] = f"pulled against the fused step (cosine {m['cos_fused']:+.3f})"
            for c, w in why.items():
                entry = out.setdefault(c, {"rounds": [], "why": []})
                entry["rounds"].append(r.round)
                entry["why"].append(w)
        return dict(sorted(out.items()))


def initial_params(config: CollabConfig) -> Params:
    """The global model of round 1: the torch model of ``config.model`` initialised from ``config.seed``."""
    return torch_state(build_torch_model(config.model, config.seed))


def check_data(config: CollabConfig, data: Data | None) -> None:
    """Every center has its data from exactly one place: ``data`` here, or its own source (``CenterSpec.data``)."""
    data = data or {}
    names = {c.name for c in config.centers}
    extra = sorted(set(data) - names)
    if extra:
        raise ValueError(f"data given for centers {extra}, but the federation has {sorted(names)}")
    both = [c.name for c in config.centers if c.data and c.name in data]
    none = [c.name for c in config.centers if not c.data and c.name not in data]
    if both:
        raise ValueError(f"centers {both} have a data source ({config.center(both[0]).data!r}) and data given here: "
                         "drop one of the two")
    if none:
        raise ValueError(f"no data for centers {none}: give their (x, y) or a data source "
                         "CenterSpec(data='package.module:function')")


def run_inprocess(config: CollabConfig, data: Data | None = None, *,
                  eval_data: tuple[np.ndarray, np.ndarray] | None = None,
                  timing_path: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                  resume: bool = False, max_rounds: int | None = None,
                  trainers: Mapping[str, LocalTrainer] | None = None,
                  absent: Mapping[int, tuple[str, ...]] | None = None,
                  center_states: dict[str, dict[str, np.ndarray]] | None = None,
                  on_round: Callable[[RoundRecord], None] | None = None,
                  tamper: Mapping[str, Tamper] | None = None,
                  root_data: tuple[np.ndarray, np.ndarray] | None = None, pipelined: bool = False) -> CollabResult:
    """Run the federation in this process.

    Args:
        config: the job.
        data: center name -> ``(x, y)`` numpy arrays (they never leave their trainer), for the centers
            without a data source of their own (``CenterSpec.data``, loaded by the center).
        eval_data: held-out ``(x, y)`` on which the server evaluates every fused model. Without it and
            with ``config.holdout > 0`` the centers evaluate it on their held-out rows and the round
            records the count-weighted mean (:func:`~._server.aggregate_evaluations`).
        timing_path: JSON-lines file for the round events.
        checkpoint_dir: where the server checkpoints after each round.
        resume: continue from the checkpoint in ``checkpoint_dir`` if there is one.
        max_rounds: stop after this many rounds in this call (the rest can be resumed).
        trainers: replace the trainer of some centers (e.g. a misbehaving one in tests).
        absent: round -> centers that do not answer that round (a crashed or slow center).
        center_states: what each center keeps between rounds (SCAFFOLD's ``c_i``), updated in place;
            pass the same dict to a resumed run to model centers that stayed up while the server
            restarted (default: a fresh, empty memory per center for this call).
        on_round: called with each round's record as soon as the round ends (progress).
        tamper: center -> ``f(round, payload, metrics, nonce) -> (payload, metrics)`` applied to that
            center's reply before the server sees it (a malicious center, for the adversarial tests; it
            knows the round's nonce, as a center does).
        root_data: the server's own small labelled ``(x, y)`` (never a center's training data), which a
            fusion with ``needs_root`` (FLTrust) trains on each round for its reference direction.
        pipelined: every center in its own thread, transfers delayed by their links concurrently with the
            steps (``_overlap.pipelined_rounds``; always so with ``config.overlap``): synchronous rounds
            timed as the overlapped ones are.
    """
    check_data(config, data)
    data = data or {}
    import_frameworks({c.framework for c in config.centers})  # together, in the one order they share a process
    timing = TimingLog(timing_path)
    pool: dict[str, LocalTrainer] = {
        c.name: make_trainer(config, c.name, *(data[c.name] if c.name in data else load_center_data(c.data, c.name)))
        for c in config.centers if not trainers or c.name not in trainers}
    pool.update(trainers or {})
    if config.prune is not None:  # the server traces the model on zeros shaped like the centers' rows
        config = with_input_of(config, next((t.x[:1] for t in pool.values() if hasattr(t, "x")), None))
    server = FederationServer(config, initial_params(config), timing, checkpoint_dir, root=root_data)
    if resume:
        server.resume()
    evaluate: Callable[[Params, int], dict[str, float]] | None = None
    if eval_data is not None:
        def evaluate(p: Params, r: int) -> dict[str, float]:
            # a pruned job's model is the server's own, cut to the plan
            return evaluate_torch(config.model, p, *eval_data, model=server.pruning.model if server.pruning else None)
    elif config.holdout > 0:
        def evaluate(p: Params, r: int) -> dict[str, float]:
            _conform(server, pool)
            return aggregate_evaluations({c.name: center_evaluate(pool[c.name], p) for c in config.centers
                                          if c.name not in (absent or {}).get(r, ())})
    try:
        states = {} if center_states is None else center_states
        for c in config.centers:
            states.setdefault(c.name, {})
        if config.overlap or config.buffer or pipelined:
            if absent:
                raise ValueError("absent centers are not modelled with overlapped, buffered or pipelined rounds")
            (buffered_rounds if config.buffer else pipelined_rounds)(
                config, server, pool, evaluate, max_rounds, on_round, tamper,
                holdout_eval=eval_data is None and config.holdout > 0)
        else:
            _run_rounds(config, server, pool, evaluate, max_rounds, absent, states, on_round, tamper or {})
    finally:  # a data-parallel center's worker processes end with the run
        for name, t in pool.items():
            if not trainers or name not in trainers:
                getattr(t, "close", lambda: None)()
    return CollabResult(server.params, tuple(server.history), tuple(timing.events),
                        server.pruning.outcome() if server.pruning is not None else None)


def _conform(server: FederationServer, pool: Mapping[str, LocalTrainer]) -> None:
    """Hand the pruning plan (once cut) to every center, which cuts its own model the same way."""
    if server.cut_plan is not None:
        for t in pool.values():  # a torch center cuts its model, a MindSpore one masks its twin
            conform(t, server.cut_plan)


def _run_rounds(config: CollabConfig, server: FederationServer, pool: Mapping[str, LocalTrainer],
                evaluate: Any, max_rounds: int | None, absent: Mapping[int, tuple[str, ...]] | None,
                center_states: Mapping[str, dict[str, np.ndarray]],
                on_round: Callable[[RoundRecord], None] | None = None,
                tamper: Mapping[str, Tamper] | None = None) -> None:
    # center_states: each center's memory across rounds (SCAFFOLD's c_i); the server never reads it
    done = 0
    links = {c.name: LinkThrottle.of(c) for c in config.centers}
    while not server.done and (max_rounds is None or done < max_rounds):
        r, global_params = server.begin_round()
        control = server.control()
        _conform(server, pool)  # after the cut, every center takes the pruned architecture with the model
        replies = []
        for c in config.centers:
            if c.name in (absent or {}).get(r, ()):
                continue
            # the center's emulated WAN link (if any) holds the model's bytes, then the update's
            links[c.name].download(nbytes_of(global_params) + (nbytes_of(control) if control else 0))
            t_recv = time.time()
            payload, metrics = center_round(pool[c.name], {k: v.copy() for k, v in global_params.items()},
                                            round_idx=r, config=config, proximal_mu=server.fusion.proximal_mu,
                                            t_received=t_recv, control=control, center_state=center_states[c.name],
                                            nonce=server.nonce(r))
            links[c.name].upload(nbytes_of(payload))
            if tamper and c.name in tamper:
                payload, metrics = tamper[c.name](r, payload, metrics, server.nonce(r))
            replies.append(CenterReply(c.name, payload, metrics))
            server.timing.record(r, "server", c.name, "update_received")
        rec = server.finish_round(r, replies, evaluate=None if evaluate is None else lambda p, r=r: evaluate(p, r))
        if on_round is not None:
            on_round(rec)
        done += 1
