"""Asynchronous, buffered rounds (FedBuff): the server fuses as soon as ``K`` updates are in.

Synchronous rounds wait for the slowest center. With ``CollabConfig(buffer=K)`` (``--buffer K``,
``1 <= K <= centers``; Nguyen et al. 2022, FedBuff) every center trains continuously: it takes the
newest global model ``x_v`` (version ``v``; a center that joins later, ``CenterSpec.joins_after``, takes the
newest one when it joins), its ``H`` local steps (the synchronous round's batches of
``(seed, center, v)``), sends ``δ = x_i − x_v`` bound to ``v``'s nonce and ``x_v``'s digest, and takes
the next version published after ``v`` (a center never trains twice from the same version). The server
buffers the updates and fuses the first ``K`` that are in, from ``K`` different centers, into ``x_{v'+1}``
(``v'`` the newest version); a center that is faster than the rest contributes more often, a slow one
never blocks a fusion.

A stale update (``τ = v' − v > 0`` versions old) is not a free pass:

* its binding is checked against the nonce and digest of the version it was trained from (the server
  keeps the last ``max_staleness + 1`` versions); an update staler than ``max_staleness`` is refused;
* it is weighted by ``(1 + τ)^(−1/2)`` (FedBuff's staleness weight): the server scales ``δ`` before the
  fusion, so the norm bound, the robust fusions and every other check of
  :meth:`~._server.FederationServer.finish_round` judge the update as it is fused. The server then binds
  it to the current version itself (having checked the center's binding), and records ``staleness``
  and ``trained_on`` in the update's metrics.

In-process every center runs in its own thread (links as delivery times, as :mod:`._overlap`); over
Flower on the lean data channel (:mod:`._lean`) a server thread per center connection hands it the newest
version each time its update is in. Refused with SCAFFOLD, pruning, overlapped fusion, over Flower
messages, and with the centers' held-out evaluation over Flower (their connections are busy training).
``rounds`` counts fusions. Rounds without ``K`` valid updates (refusals) keep the model and wait for more.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._center import center_round
from ._link import LinkThrottle, nbytes_of
from ._overlap import _holdout_evaluator
from ._server import CenterReply, FederationServer, RoundRecord
from ._validation import bound_metrics, check_binding
from ._wire import decode_update, encode_update

__all__ = ["SlowTrainer", "buffered_rounds", "staleness_weight"]


class SlowTrainer:
    """A center's trainer made slower, to emulate a slow site on one machine (as ``_link`` emulates its
    link): after each round it sleeps ``(factor − 1)`` times the round's training time plus ``extra_s``.
    Everything else is the wrapped trainer's."""

    def __init__(self, trainer: Any, factor: float = 1.0, extra_s: float = 0.0) -> None:
        if factor < 1 or extra_s < 0:
            raise ValueError(f"a slower trainer needs factor >= 1 and extra_s >= 0, got {factor}, {extra_s}")
        self.trainer, self.factor, self.extra_s = trainer, factor, extra_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        out = self.trainer.train(*args, **kwargs)
        time.sleep((self.factor - 1) * (time.time() - t0) + self.extra_s)
        return out


def staleness_weight(tau: int) -> float:
    """FedBuff's weight of an update ``τ`` versions old: ``(1 + τ)^(−1/2)``."""
    return float((1.0 + tau) ** -0.5)


class _Published:
    """The newest global model, its version and nonce; centers wait here for a version newer than theirs."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.item: tuple[int, dict[str, np.ndarray], int, float] | None = None  # version, x_v, nonce, t
        self.stopped = False

    def publish(self, v: int, x: dict[str, np.ndarray], nonce: int) -> None:
        with self.cv:
            self.item = (v, {k: a.copy() for k, a in x.items()}, nonce, time.time())
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()

    def newer_than(self, v: int) -> tuple[int, dict[str, np.ndarray], int, float] | None:
        with self.cv:
            self.cv.wait_for(lambda: self.stopped or (self.item is not None and self.item[0] > v))
            return None if self.stopped else self.item


def _center_loop(name: str, trainer: Any, config: Any, mu: float, link: LinkThrottle, board: _Published,
                 replies: queue.Queue) -> None:
    v = 0
    joins_after = next(c.joins_after for c in config.centers if c.name == name)
    if joins_after and board.newer_than(joins_after) is None:  # a late join (emulated): then the newest version
        return
    try:
        while True:
            item = board.newer_than(v)
            if item is None:
                return
            v, x_v, nonce, t_pub = item
            if link.limited:
                link.transfer("down", nbytes_of(x_v), t_pub)  # the center holds its download to its link
            payload, metrics = center_round(trainer, x_v, round_idx=v, config=config, proximal_mu=mu, nonce=nonce)
            replies.put((name, payload, metrics))
    except BaseException as e:  # reported by the server
        replies.put((name, None, {"error": repr(e)}))


def _rescaled(payload: Mapping[str, np.ndarray], w: float, method: str) -> dict[str, np.ndarray]:
    return encode_update({k: w * v for k, v in decode_update(payload, method).items()}, method)


def buffered_rounds(config: Any, server: FederationServer, pool: Mapping[str, Any] | None, evaluate: Any,
                    max_rounds: int | None, on_round: Callable[[RoundRecord], None] | None = None,
                    tamper: Mapping[str, Any] | None = None, holdout_eval: bool = False,
                    centers: Callable[[_Published, queue.Queue], list[threading.Thread]] | None = None) -> None:
    """Run ``config.rounds`` buffered fusions (module docstring) with every center in its own thread
    (``pool``: their trainers), or with the threads ``centers(board, replies)`` makes, each serving one
    center elsewhere (the lean data channel, :mod:`._lean`): it takes the newest version from ``board``
    (:meth:`_Published.newer_than`) and puts ``(name, payload, metrics)`` on ``replies``."""
    import torch

    if holdout_eval:
        evaluate = _holdout_evaluator(pool, config.model)
    K, S = config.buffer, config.max_staleness
    board, replies = _Published(), queue.Queue()
    links = {c.name: LinkThrottle.of(c) for c in config.centers}
    mu = server.fusion.proximal_mu
    threads = centers(board, replies) if centers is not None else [
        threading.Thread(target=_center_loop, args=(c.name, pool[c.name], config, mu, links[c.name], board, replies),
                         name=f"center-{c.name}", daemon=True) for c in config.centers]
    versions: dict[int, tuple[int, int]] = {}  # version -> (nonce, model digest)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    v, x = server.begin_round()
    versions[v] = (server.nonce(v), server.model_digest(v))
    board.publish(v, x, versions[v][0])
    for t in threads:
        t.start()
    done = 0
    waiting: list[tuple[str, dict, dict, float]] = []  # updates sent, with when their link delivers them
    admitted: list[CenterReply] = []  # checked, weighted and bound to version v: the buffer
    refused: dict[str, tuple[str, ...]] = {}  # refused while version v was the newest: into its record
    try:
        while not server.done and (max_rounds is None or done < max_rounds):
            now = time.time()
            for item in sorted(waiting, key=lambda w: w[3]):
                who, pl, m, t_in = item
                if len(admitted) == K or t_in > now:
                    break
                if any(a.center == who for a in admitted):
                    continue  # a center's next update goes into the next fusion
                waiting.remove(item)
                reply = _admit(server, v, versions, S, who, pl, m, config.compression, refused)
                if reply is not None:
                    server.timing.record(v, "server", who, "update_received", t=t_in)
                    admitted.append(reply)
            if len(admitted) == K:
                order = [c.name for c in config.centers]
                rec = server.finish_round(v, sorted(admitted, key=lambda a: order.index(a.center)),
                                          sent_to=len(config.centers),
                                          evaluate=None if evaluate is None else lambda p, v=v: evaluate(p, v))
                if refused:  # the round's record also names the stale and forged updates refused before it
                    rec = dataclasses.replace(rec, rejected={**refused, **rec.rejected})
                    server.history[-1] = rec
                admitted, refused = [], {}
                if on_round is not None:
                    on_round(rec)
                done += 1
                v, x = server.begin_round()
                versions[v] = (server.nonce(v), server.model_digest(v))
                for old in [u for u in versions if u < v - S]:
                    del versions[old]
                board.publish(v, x, versions[v][0])
                continue
            later = [w[3] for w in waiting if w[3] > now]
            try:
                name, payload, metrics = replies.get(timeout=max(0.0, min(later) - now) if later else None)
            except queue.Empty:
                continue  # an update's link delivers it now
            if payload is None:
                raise RuntimeError(f"center {name!r} failed: {metrics['error']}")
            link = links[name]
            arrived = link.done_at("up", nbytes_of(payload), metrics["t_sent"]) if link.limited else time.time()
            if tamper and name in tamper:
                r0 = int(metrics.get("round", 0))
                payload, metrics = tamper[name](r0, payload, metrics, versions.get(r0, (0, 0))[0])
            waiting.append((name, payload, metrics, arrived))
    finally:
        board.stop()
        for t in threads:
            t.join(timeout=60)
        torch.set_num_threads(old_threads)


def _admit(server: FederationServer, v: int, versions: Mapping[int, tuple[int, int]], max_staleness: int,
           who: str, payload: dict[str, np.ndarray], metrics: dict[str, Any], method: str,
           refused: dict[str, tuple[str, ...]]) -> CenterReply | None:
    """Check a (possibly stale) update against the version it was trained from, weight it by its
    staleness and bind it to version ``v``; None (refused, logged and recorded) when it cannot be."""
    trained_on = metrics.get("round")
    tau = v - int(trained_on) if isinstance(trained_on, int | float) else -1
    problems: list[str] = []
    if tau < 0 or int(trained_on) not in versions:
        problems = [f"the update was trained from version {trained_on!r}, the server keeps versions "
                    f"{min(versions)}..{v} (max_staleness {max_staleness})"]
    else:
        nonce, digest = versions[int(trained_on)]
        problems = check_binding(metrics, int(trained_on), digest, nonce, payload)
    if problems:
        rejected: dict[str, tuple[str, ...]] = {}
        server._reject(v, who, problems, rejected)  # the log line and the timing record
        refused[who] = refused.get(who, ()) + rejected[who]
        return None
    w = staleness_weight(tau)
    scaled = payload if tau == 0 else _rescaled(payload, w, method)
    nonce_v, digest_v = server.nonce(v), server.model_digest(v)
    m = {**metrics, **bound_metrics(nonce_v, v, digest_v, scaled), "staleness": float(tau),
         "trained_on": float(trained_on), "staleness_weight": w}
    return CenterReply(who, scaled, m)
