"""The server side of a round, shared by the in-process engine and the Flower ServerApp.

Per round ``t``: the server hands out the global model ``x_t``; for every reply it checks the payload
(:func:`~._wire.check_payload`), the metrics, the round the reply was trained for and its binding to the
round's nonce (drawn in :meth:`FederationServer.begin_round`, sent with the model), whether its bytes
are a replay, and, before decoding, the magnitudes; then the update norms and sample counts
(:mod:`._validation`, which also checks the fused model before it replaces ``x_t``). It decodes accepted
updates ``δ̂_i`` into local models ``x_t + δ̂_i`` (float64, so ``x_i − x_t`` is ``δ̂_i`` again), and,
when at least ``min_centers`` are valid, fuses them into ``x_{t+1}``. A fusion with control variates
(SCAFFOLD) also hands out ``c`` (:meth:`FederationServer.control`), and every reply must carry the
center's ``c_i⁺`` for each trained tensor, checked and decoded the same way. Otherwise the round is
recorded as skipped and ``x_t`` stays. After every round the global model, the fusion's optimiser state
and the round number are written atomically to ``checkpoint_dir``; :meth:`FederationServer.resume`
continues from the last one.

Time stamps (seconds since the epoch) go to a JSON-lines file, one object per event:
``{"round", "role": "center"|"server", "who", "event", "t"}`` with center events ``received_model``,
``finished_training``, ``sent_update`` and server events ``round_start``, ``update_received`` (one per
center, ``who`` = the center), ``rejected`` (one per refused reply, ``who`` = the center, with its
``reason``; also a ``log.warning`` line), ``samples_capped`` (likewise), ``fusion_start``,
``fusion_refused`` (with ``reason``: the fused model was not taken), ``fusion_end``, ``round_end``. All
on one clock on a single machine; across machines the center stamps carry that machine's clock offset.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._center import TorchTrainer
from ._config import CollabConfig
from ._fusion import CenterUpdate, Params, trained_names
from ._pruning_server import ServerPruning
from ._validation import (
    UpdateGuard,
    check_binding,
    check_values,
    direction_screen,
    draw_nonce,
    layer_screen,
    model_digest,
    params_norm,
    payload_digest,
)
from ._wire import check_payload, decode_controls, decode_update, payload_nbytes

__all__ = ["CenterReply", "FederationServer", "RoundRecord", "TimingLog", "aggregate_evaluations"]

log = logging.getLogger("polyparallel.collab")


class TimingLog:
    """Collects round events in memory and, when given a path, appends them as JSON lines."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self.events: list[dict[str, Any]] = []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, round_idx: int, role: str, who: str, event: str, t: float | None = None, **extra: Any) -> None:
        ev = {"round": round_idx, "role": role, "who": who, "event": event,
              "t": time.time() if t is None else float(t), **extra}
        self.events.append(ev)
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(ev) + "\n")


@dataclass(frozen=True)
class CenterReply:
    """What came back from one center in one round (before any checking)."""

    center: str
    payload: Mapping[str, Any]
    metrics: Mapping[str, Any]


@dataclass(frozen=True)
class RoundRecord:
    """The outcome of one round."""

    round: int
    accepted: tuple[str, ...]
    rejected: Mapping[str, tuple[str, ...]]
    missing: tuple[str, ...]
    fused: bool
    bytes_up: Mapping[str, int]
    bytes_down: int
    fusion_s: float
    metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    eval: Mapping[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "accepted": list(self.accepted),
                "rejected": {k: list(v) for k, v in self.rejected.items()}, "missing": list(self.missing),
                "fused": self.fused, "bytes_up": dict(self.bytes_up), "bytes_down": self.bytes_down,
                "fusion_s": self.fusion_s, "metrics": {k: dict(v) for k, v in self.metrics.items()},
                "eval": dict(self.eval), "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoundRecord:
        return cls(d["round"], tuple(d["accepted"]), {k: tuple(v) for k, v in d["rejected"].items()},
                   tuple(d["missing"]), d["fused"], d["bytes_up"], d["bytes_down"], d["fusion_s"], d["metrics"],
                   d["eval"], float(d.get("seconds", 0.0)))

    @property
    def train_loss(self) -> float | None:
        """The accepted centers' local training loss, weighted by their sample counts."""
        m = [v for v in self.metrics.values() if "train_loss" in v and "num_samples" in v]
        if not m:
            return None
        return sum(v["train_loss"] * v["num_samples"] for v in m) / sum(v["num_samples"] for v in m)


def aggregate_evaluations(per_center: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The federation's metrics from each center's metrics on its held-out rows.

    Every metric is the mean weighted by the centers' ``count`` (targets evaluated), so ``loss`` and
    ``accuracy`` are those of the union of the held-out rows; ``perplexity`` is ``exp`` of that loss.
    Adds ``count`` (the total) and ``centers`` (how many reported).
    """
    # in center-name order: the sums, and so the numbers, do not depend on the order replies arrived in
    valid = {c: per_center[c] for c in sorted(per_center)
             if per_center[c].get("count", 0) > 0 and np.isfinite(per_center[c].get("loss", np.nan))}
    if not valid:
        return {}
    total = sum(float(m["count"]) for m in valid.values())
    out: dict[str, float] = {}
    for key in ("loss", "accuracy"):
        if all(key in m for m in valid.values()):
            out[key] = sum(float(m[key]) * float(m["count"]) for m in valid.values()) / total
    if all("perplexity" in m for m in valid.values()):
        out["perplexity"] = float(np.exp(min(out["loss"], 700.0)))
    out["count"], out["centers"] = total, float(len(valid))
    return out


def _check_metrics(metrics: Mapping[str, Any]) -> list[str]:
    n = metrics.get("num_samples")
    if not isinstance(n, int | float) or not np.isfinite(n) or n <= 0 or float(n) != int(n):
        return [f"num_samples must be a positive integer, got {n!r}"]
    return []


def _round_metrics(center: str, m: Mapping[str, Any], counts: Mapping[str, float], norms: Mapping[str, float],
                   cos_others: Mapping[str, float], layer_ratio: Mapping[str, float]) -> dict[str, float]:
    """An accepted center's numbers in the round record: its reply's metrics with the server's sample
    count (not the claim), its update norm and, where the checks computed them, its direction and layer
    numbers."""
    out = {k: float(v) for k, v in m.items() if isinstance(v, int | float)}
    out["num_samples"] = float(counts[center])
    out["update_norm"] = norms[center]
    if center in cos_others:
        out["cos_others"] = cos_others[center]
    if center in layer_ratio:
        out["layer_ratio"] = layer_ratio[center]
    return out


def _flat_step(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The fused step ``x' − x`` in float64, flat over ``old``'s tensors (in order), and the same
    numbers per tensor (views into it): computed once for the audit and the step bound."""
    flat = np.empty(sum(int(np.asarray(v).size) for v in old.values()), dtype=np.float64)
    views, off = {}, 0
    for k, v in old.items():
        v = np.asarray(v)
        np.subtract(np.asarray(new[k]).reshape(-1), v.reshape(-1), out=flat[off:off + v.size], dtype=np.float64)
        views[k] = flat[off:off + v.size].reshape(v.shape)
        off += v.size
    return flat, views


def _audit(metrics: dict[str, dict[str, float]], deltas: Mapping[str, Mapping[str, np.ndarray]],
           keys: Sequence[str], step: np.ndarray, scores: Mapping[str, Mapping[str, float]]) -> None:
    """Per accepted center, what the fusion made of it, into its round metrics: ``cos_fused``, the
    cosine of its update to the fused step ``step`` (``x' − x`` flat over ``keys``, :func:`_flat_step`;
    the consensus; negative: it pulled against it), and the fusion's own scores (FLTrust: ``cos_root``,
    ``trust``)."""
    ns = float(np.linalg.norm(step))
    for c, m in metrics.items():
        d = np.concatenate([np.asarray(deltas[c][k]).reshape(-1) for k in keys], dtype=np.float64)
        nd = float(np.linalg.norm(d))
        m["cos_fused"] = float(d @ step / (nd * ns)) if nd > 0 and ns > 0 else 0.0
        m.update({k: float(v) for k, v in scores.get(c, {}).items()})


class FederationServer:
    """Holds the global model and fuses the centers' replies round by round."""

    def __init__(self, config: CollabConfig, initial_params: Mapping[str, np.ndarray],
                 timing: TimingLog | None = None, checkpoint_dir: str | Path | None = None,
                 root: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """A pruning job's ``config.prune`` names the shape of one input row, which the server traces
        the model on (``_pruning.with_input_of``)."""
        self.config = config
        self.fusion = config.make_fusion()
        self._root = None  # the server's own trainer on its root set (FLTrust)
        if self.fusion.needs_root:
            if root is None:
                raise ValueError(f"fusion {config.fusion!r} needs a root set: a small labelled (x, y) the server "
                                 "holds, never a center's training data (run_inprocess(root_data=...), "
                                 "--root-data FILE.npz)")
            self._root = TorchTrainer(config.model, *root, center_index=len(config.centers),
                                      batch_size=config.batch_size, lr=config.lr, momentum=config.momentum,
                                      seed=config.seed, lr_schedule=config.lr_schedule, rounds=config.rounds)
        self.params: Params = {k: np.asarray(v, dtype=np.float32).copy() for k, v in initial_params.items()}
        self.round = 0  # rounds completed
        self.timing = timing or TimingLog()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.history: list[RoundRecord] = []
        self._t_round = 0.0  # when the current round began (its record's seconds)
        self.guard = UpdateGuard(config.norm_bound, config.step_bound, {c.name: c.samples for c in config.centers})
        self._digest: tuple[int, int] | None = None  # (round, digest of the model sent in it)
        self._nonce: tuple[int, int] | None = None  # (round, the nonce drawn for it)
        self.pruning = None  # online pruning's server side (_pruning_server.ServerPruning)
        if config.prune is not None:
            self.pruning = ServerPruning(config, self.params)

    # ----------------------------------------------------------------- checkpoints
    def _ckpt_path(self) -> Path:
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / "server_checkpoint.npz"

    def save_checkpoint(self) -> None:
        if self.checkpoint_dir is None:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        arrays = {f"param/{k}": v for k, v in self.params.items()}
        arrays.update({f"fusion/{k}": v for k, v in self.fusion.state().items()})
        arrays.update({f"guard/{k}": v for k, v in self.guard.state().items()})
        if self.pruning is not None:
            arrays.update({f"prune/{k}": v for k, v in self.pruning.state().items()})
        arrays["meta/round"] = np.array(self.round, dtype=np.int64)
        arrays["meta/config"] = np.frombuffer(self.config.to_json().encode(), dtype=np.uint8)
        tmp = self._ckpt_path().with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, self._ckpt_path())  # a crash mid-write never leaves a torn checkpoint

    def resume(self) -> bool:
        """Load the last checkpoint if there is one; returns whether it did."""
        if self.checkpoint_dir is None or not self._ckpt_path().exists():
            return False
        with np.load(self._ckpt_path()) as z:
            saved = bytes(z["meta/config"]).decode()
            if CollabConfig.from_json(saved) != self.config:
                raise ValueError(f"checkpoint {self._ckpt_path()} was written by a different federation "
                                 "config; use a new checkpoint directory or the same config")
            params = {k[6:]: z[k] for k in z.files if k.startswith("param/")}
            if set(params) != set(self.params):
                raise ValueError(f"checkpoint {self._ckpt_path()} holds other tensors than the model")
            self.params = params
            self.fusion.load_state({k[7:]: z[k] for k in z.files if k.startswith("fusion/")})
            self.guard.load_state({k[6:]: z[k] for k in z.files if k.startswith("guard/")})
            if self.pruning is not None:  # after the cut, the server's model takes the plan's architecture
                self.pruning.load_state({k[6:]: z[k] for k in z.files if k.startswith("prune/")})
            self.round = int(z["meta/round"])
        log.info("resumed from %s after round %d", self._ckpt_path(), self.round)
        return True

    # ----------------------------------------------------------------- rounds
    @property
    def done(self) -> bool:
        return self.round >= self.config.rounds

    @property
    def cut_plan(self) -> list[list[Any]] | None:
        """A pruning job's plan once the server has cut (every center cuts its model alike with the next
        message it gets); None before the cut and for a job without pruning."""
        return self.pruning.plan if self.pruning is not None else None

    def begin_round(self) -> tuple[int, Params]:
        """Index of the next round (1-based) and the model to send."""
        r = self.round + 1
        self._t_round = time.time()
        self.timing.record(r, "server", "server", "round_start", t=self._t_round)
        self._digest = (r, model_digest(self.params))
        self._nonce = (r, draw_nonce())
        return r, self.params

    def nonce(self, round_idx: int) -> int:
        """The nonce of ``round_idx``, sent with its model; a reply must bind its update to it
        (:func:`~._validation.reply_binding`). Drawn afresh for a round :meth:`begin_round` did not start."""
        if self._nonce is None or self._nonce[0] != round_idx:
            self._nonce = (round_idx, draw_nonce())
        return self._nonce[1]

    def model_digest(self, round_idx: int) -> int:
        """The digest of the global model sent in ``round_idx`` (what a reply of that round must name)."""
        if self._digest is None or self._digest[0] != round_idx:
            self._digest = (round_idx, model_digest(self.params))
        return self._digest[1]

    def _reject(self, round_idx: int, center: str, problems: Sequence[str],
                rejected: dict[str, tuple[str, ...]]) -> None:
        """The audit trail of a refused update: a server log line and a timing record, with the reasons."""
        log.warning("round %d: rejected the update of %s: %s", round_idx, center, "; ".join(problems))
        self.timing.record(round_idx, "server", center, "rejected", reason="; ".join(problems))
        rejected[center] = tuple(problems)

    def control(self) -> Params | None:
        """The control variate ``c`` to send with the model (SCAFFOLD), None for other fusions."""
        return self.fusion.control(self.params) if self.fusion.uses_controls else None

    def finish_round(self, round_idx: int, replies: Sequence[CenterReply], *, sent_to: int | None = None,
                     evaluate: Any = None) -> RoundRecord:
        """Check, decode and fuse the replies of round ``round_idx``; checkpoint; return the record.

        ``sent_to`` is how many centers were sent the model (default: all); ``evaluate`` maps the new
        global model to metrics recorded with the round.
        """
        cfg = self.config
        updates: list[CenterUpdate] = []
        rejected: dict[str, tuple[str, ...]] = {}
        bytes_up: dict[str, int] = {}
        metrics: dict[str, dict[str, float]] = {}
        control_names = trained_names(self.params) if self.fusion.uses_controls else []
        digest, nonce = self.model_digest(round_idx), self.nonce(round_idx)
        candidates: list[tuple[CenterReply, dict[str, Any], dict[str, np.ndarray]]] = []
        score_parts: dict[str, dict[str, np.ndarray]] = {}  # pruning: each candidate's scores
        for rep in replies:
            m = dict(rep.metrics)
            for ev, key in (("received_model", "t_received"), ("finished_training", "t_trained"),
                            ("sent_update", "t_sent")):
                if isinstance(m.get(key), int | float):
                    self.timing.record(round_idx, "center", rep.center, ev, t=float(m[key]))
            payload = dict(rep.payload)
            scores: dict[str, Any] = {}
            if self.pruning is not None:  # the pruning scores travel beside the update, checked on their own
                payload, scores = self.pruning.split(payload)
            problems = check_payload(payload, self.params, cfg.compression, control_names) + _check_metrics(m)
            if self.pruning is not None:
                problems += self.pruning.check(scores, round_idx)
            if rep.center not in {c.name for c in cfg.centers}:
                problems.append(f"{rep.center!r} is not a center of this federation")
            elif rep.center in bytes_up:
                problems.append("a second reply in the same round")
            if not problems:  # the round the reply was trained for, replays, and magnitudes before decoding
                sealed = {**payload, **scores}
                pdigest = payload_digest(sealed)  # once: the binding and the replay check both hash the bytes
                problems = check_binding(m, round_idx, digest, nonce, sealed, pdigest)
                if not problems and (why := self.guard.replayed(rep.center, sealed, round_idx, digest, pdigest)):
                    problems = [why]
                problems = problems or check_values(payload, cfg.compression, cfg.max_abs_update)
            if problems:
                self._reject(round_idx, rep.center, problems, rejected)
                continue
            bytes_up[rep.center] = payload_nbytes(payload) + payload_nbytes(scores)
            candidates.append((rep, m, payload))
            if scores:
                score_parts[rep.center] = scores
        counts, liars, capped = self.guard.samples({rep.center: float(m["num_samples"]) for rep, m, _ in candidates})
        for c, why in capped.items():
            log.warning("round %d: %s %s", round_idx, c, why)
            self.timing.record(round_idx, "server", c, "samples_capped", reason=why)
        deltas = {rep.center: decode_update(payload, cfg.compression) for rep, _, payload in candidates
                  if rep.center not in liars}
        norms = {c: params_norm(d) for c, d in deltas.items()}
        outliers = {**liars, **self.guard.screen(norms, params_norm(self.params))}
        layer_ratio, boosted = layer_screen({c: d for c, d in deltas.items() if c not in outliers},
                                            trained_names(self.params), cfg.layer_bound)
        outliers.update(boosted)
        cos_others, away = direction_screen({c: d for c, d in deltas.items() if c not in outliers},
                                            trained_names(self.params), cfg.min_cosine)
        outliers.update(away)
        for rep, m, payload in candidates:
            if rep.center in outliers:
                self._reject(round_idx, rep.center, [outliers[rep.center]], rejected)
                continue
            metrics[rep.center] = _round_metrics(rep.center, m, counts, norms, cos_others, layer_ratio)
            delta = deltas[rep.center]
            local = {k: np.add(self.params[k], delta[k], dtype=np.float64) for k in self.params}  # no float64 copies
            controls = decode_controls(payload, cfg.compression) if control_names else None
            updates.append(CenterUpdate(rep.center, local, counts[rep.center], metrics[rep.center], controls))
        answered = {r.center for r in replies}
        missing = tuple(c.name for c in cfg.centers if c.name not in answered)
        fused = len(updates) >= cfg.required_centers and len(updates) > 0
        t0 = time.time()
        if fused:
            self.timing.record(round_idx, "server", "server", "fusion_start", t=t0)
            # order by center so the fused numbers do not depend on arrival order
            updates.sort(key=lambda u: cfg.center_index(u.center))
            saved = {k: np.array(v, copy=True) for k, v in self.fusion.state().items()}
            if self._root is not None:  # the server's own update on its root set, FLTrust's reference
                local, _ = self._root.train(self.params, steps=cfg.local_steps, round_idx=round_idx,
                                            proximal_mu=self.fusion.proximal_mu)
                self.fusion.reference = {k: np.asarray(local[k], np.float64) - self.params[k] for k in self.params}
            new = self.fusion.fuse(self.params, updates)
            flat, diff = _flat_step(self.params, new)
            _audit(metrics, deltas, list(self.params), flat, getattr(self.fusion, "scores", {}))
            step = params_norm(diff)
            del flat, diff
            why = self.guard.check_step(self.params, new, step)
            if why is None:
                self.guard.record([norms[u.center] for u in updates], self.params, new, step)
                self.params = new
            else:  # the old model and the optimiser state stay; later rounds are judged against them
                self.fusion.load_state(saved)
                fused = False
                log.warning("round %d: the fused model was refused: %s; global model kept", round_idx, why)
                self.timing.record(round_idx, "server", "server", "fusion_refused", reason=why)
            self.timing.record(round_idx, "server", "server", "fusion_end")
        else:
            log.warning("round %d: %d valid updates < %d required; global model kept", round_idx, len(updates),
                        cfg.required_centers)
        if self.pruning is not None:  # the accepted centers' scores: masks in rounds < K, the cut after K
            self.params = self.pruning.after_round(round_idx, self.params, [
                (u.center, u.num_samples, score_parts[u.center]) for u in updates if u.center in score_parts]
                if fused else [])
        fusion_s = time.time() - t0
        self.round = round_idx
        ev = dict(evaluate(self.params)) if evaluate is not None else {}
        # the model, and c (float32, one per trained tensor) for SCAFFOLD
        sent = payload_nbytes(self.params) + sum(self.params[k].nbytes for k in control_names)
        down = sent * (len(cfg.centers) if sent_to is None else sent_to)
        rec = RoundRecord(round_idx, tuple(u.center for u in updates), rejected, missing, fused, bytes_up,
                          down, fusion_s, metrics, ev, time.time() - (self._t_round or t0))
        self.history.append(rec)
        self.save_checkpoint()
        self.timing.record(round_idx, "server", "server", "round_end")
        return rec
