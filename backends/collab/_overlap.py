"""Overlapped fusion: a center keeps training while its update travels and the server fuses.

Synchronous rounds (``overlap=0``) leave every center idle from the moment it sends its update until
the fused model has come back: upload, the server's wait for the slowest center, its checks and
fusion, download. With ``CollabConfig(overlap=k)`` (``--overlap K``, ``1 <= k <= H``) a center goes on
with the next round's first ``k`` local steps from its own local model meanwhile, and merges the fused
model when those are done — a one-round-delayed outer step, as in overlapped DiLoCo (Kale et al.
2025) and Streaming DiLoCo's overlap of ``τ`` inner steps (Douillard et al. 2025):

* round ``r`` starts from the center's model ``s`` (its own result of round ``r − 1``); it takes the
  round's first ``k`` steps (batches of ``(seed, center, r)``, as a synchronous round) to ``a``;
* it waits for the fused ``x_r`` (the exposed communication: zero when upload, fusion and download
  took less than those ``k`` steps) and merges: ``m = x_r + (a − s)``, the fused model plus the
  progress made since — its own result of round ``r − 1`` is replaced by the federation's;
* it takes the remaining ``H − k`` steps from ``m`` (same optimiser: momentum carries over the merge)
  to ``e`` and sends ``δ_r = e − x_r``, bound to round ``r``'s nonce and the digest of ``x_r`` like any
  reply, so the server's checks and fusions are unchanged: ``x_{r+1} = x_r + F(δ_r)``.

Round 1 has nothing to overlap (the center starts from ``x_1``). With ``k = 0`` the merge comes before
any step (``m = x_r``) and a round is the synchronous one bit for bit; ``k = H`` hides up to a whole
round's compute. The updates are one round stale in their first ``k`` steps, which is what costs
accuracy (``docs/collab.md``).

SCAFFOLD (Karimireddy et al. 2020) overlapped: a synchronous center corrects each gradient of round
``r`` by ``c_r − c_i`` (``c_r`` the server's control variate sent with ``x_r``, ``c_i`` its own, the
mean raw gradient of its round ``r − 1``) and sends ``c_i⁺``, the mean raw gradient of the round's
``H`` steps. Both are estimates — ``c_r − c_i`` of the drift between the federation's gradient and the
center's own — and the correction works with the freshest estimate a center holds. Overlapped, the
``k`` steps ahead are taken before ``c_r`` arrives: they are corrected by ``c_{r−1} − c_i'`` (the
server's variate that came with ``x_{r−1}`` and the center's ``c_i'`` of the round before its newest,
the one ``c_{r−1}`` averages: estimates of the same age, so that the corrections of all centers still
sum to zero, ``Σ_i p_i (c − c_i) = 0``, as SCAFFOLD's do; pairing ``c_{r−1}`` with the newest ``c_i``
would add ``c_{r−1} − c_r`` to every center's steps); the ``H − k`` steps after the merge by
``c_r − c_i``. ``c_i⁺`` is the mean raw (uncorrected) gradient over all ``H``
steps of the round, ahead and after the merge, as a synchronous center's over its ``H``: it estimates
the center's gradient near the models it trains, which is what ``c`` averages. The server's side is
unchanged (``c ← c + (1/N) Σ (c_i⁺ − c_i)`` over the reported variates, whatever steps produced them).
With ``k = 0`` there are no steps ahead and this is synchronous SCAFFOLD bit for bit (test); the
two-round example in ``tests/test_collab_overlap_scaffold.py`` recomputes it independently.

The engine (:func:`pipelined_rounds`): every center trains in its own thread (torch with one
intra-op thread, the centers' steps overlap where the GIL allows), the server fuses in the calling
thread; an emulated link (``CenterSpec.down_Bps`` ...) delays each transfer to when the link would
deliver it (:meth:`~._link.LinkThrottle.done_at`, the receiver waits), so uploads, fusion and
downloads run concurrently with the centers' steps. Each reply's metrics carry ``comm_s`` (from
sending its previous update until the fused model was there for it: what a synchronous center waits;
over the data channel, where the frame's arrival is not observed while the center runs ahead, until
the center took it, so there it is at least the time of the steps ahead) and
``exposed_s`` (what this center actually waited) and ``ahead_s`` (how long its steps before the
merge took), and the timing log a ``comm`` event per center and round with ``exposed_s`` and
``hidden_s``. Over Flower the same center runs on the lean data channel (:mod:`._lean`): it runs ahead
after sending its update, and the next frame is the fused model. Single-process torch centers only;
pruning is refused with the job.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._center import batch_indices, evaluate_torch, label_tensor, local_sgd, torch_from
from ._fusion import is_statistic
from ._link import LinkThrottle, nbytes_of
from ._models import build_torch_model, load_torch_state, torch_state
from ._server import CenterReply, FederationServer, RoundRecord, aggregate_evaluations
from ._validation import bound_metrics, model_digest
from ._wire import decode_controls, encode_controls, encode_update

__all__ = ["OverlapCenter", "pipelined_rounds"]


class OverlapCenter:
    """One center's overlapped rounds, whatever carries its messages (this module's threads, or the lean
    data channel over Flower, :mod:`._lean`): :meth:`ahead` takes the next round's first ``k`` steps from
    the center's own model (call it right after sending an update), :meth:`finish` merges the fused model
    that came meanwhile, takes the rest of the round and returns the reply."""

    def __init__(self, trainer: Any, config: Any, steps_before_merge: int | None = None) -> None:
        for need in ("_model", "_objective", "x", "y"):
            if not hasattr(trainer, need):
                raise ValueError(f"overlapped fusion needs a torch trainer holding its model and data; "
                                 f"{type(trainer).__name__} has no {need!r}")
        self.t, self.config = trainer, config
        self.k = config.overlap if steps_before_merge is None else steps_before_merge
        self.local: dict[str, np.ndarray] | None = None  # the center's own model: None before round 1
        self.start: dict[str, np.ndarray] | None = None  # where its steps ahead start: its guess of the next model
        self.outer = outer_step(config)
        self.r = 0  # the last round it sent
        # round, opt, start, a, losses, t, mean raw gradient of the steps ahead (SCAFFOLD)
        self._ahead: tuple[int, Any, dict, dict, list[float], float, dict] | None = None
        self.ci: dict[str, np.ndarray] = {}  # SCAFFOLD: the center's c_i, as the server decoded it
        self.ci_prev: dict[str, np.ndarray] = {}  # SCAFFOLD: its c_i of the round before, which c_prev averages
        self.c_prev: dict[str, np.ndarray] | None = None  # SCAFFOLD: the server's c that came with the last model
        self._t_sent = 0.0
        self._ahead_s = 0.0  # how long the last steps ahead took
        self._x, self._y = torch_from(trainer.x), label_tensor(trainer.y, trainer.model_spec.loss)

    def _steps(self, opt: Any, batches: np.ndarray, mu: float, control: dict | None = None,
               grad_mean: dict | None = None, ci: dict | None = None) -> list[float]:
        """Local steps; with SCAFFOLD's ``control`` (``c``) each gradient is corrected by ``c − c_i``
        (``ci``, default the center's newest) and ``grad_mean`` gets the steps' mean raw gradient (as
        :func:`~._center.center_round` does)."""
        t = self.t
        ci = self.ci if ci is None else ci
        correction = None if control is None else {
            k: np.asarray(control[k], dtype=np.float32) - (ci[k] if k in ci else np.zeros_like(v))
            for k, v in control.items()}
        return local_sgd(t._model, t._model, opt, self._x, self._y, batches, mu, correction, grad_mean,
                         logit_bias=t.logit_bias(), objective=t._objective)

    def _begin(self, r: int, start: dict[str, np.ndarray]) -> tuple[Any, np.ndarray]:
        import torch

        t = self.t
        load_torch_state(t._model, dict(start))
        t._model.train()
        opt = torch.optim.SGD(t._model.parameters(), lr=t.lr_at(r), momentum=t.momentum)
        return opt, batch_indices(len(t.x), t.batch_size, self.config.local_steps, t.seed, t.center_index, r)

    def ahead(self, mu: float = 0.0) -> None:
        """The next round's first ``k`` steps, before its fused model is there (nothing before round 1)."""
        if self.start is None or self._ahead is not None:
            return
        r, t0 = self.r + 1, time.time()
        opt, batches = self._begin(r, self.start)
        g: dict[str, np.ndarray] = {}
        losses = self._steps(opt, batches[:self.k], mu, self.c_prev, g if self.c_prev is not None else None,
                             ci=self.ci_prev)
        self._ahead = (r, opt, self.start, torch_state(self.t._model), losses, time.time(), g)
        self._ahead_s = self._ahead[5] - t0

    def finish(self, r: int, x_r: dict[str, np.ndarray], nonce: int, mu: float = 0.0,
               t_available: float | None = None, control: dict[str, np.ndarray] | None = None,
               outer_u: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
        """Merge ``x_r`` (the fused model of round ``r``), take the round's remaining steps, return
        ``(payload, metrics)`` bound to round ``r`` and ``x_r``. ``t_available``: when ``x_r`` was there
        for the center (its link delivered it), for ``comm_s``; None: when it is taken (now), which is
        later when it came during the steps ahead. ``control``: SCAFFOLD's ``c_r`` that came with ``x_r``
        (the payload then carries ``c_i⁺``, see the module's docstring); ``outer_u``: the server's outer
        momentum buffer as of ``x_r`` (fusions with an outer Nesterov step), for the guess of ``x_{r+1}``
        the next steps ahead start from."""
        t = self.t
        t_got = time.time()
        t_available = t_got if t_available is None else min(t_available, t_got)
        g_ahead: dict[str, np.ndarray] = {}
        if self._ahead is None:  # round 1 (or a center that did not run ahead): start from x_r
            opt, batches = self._begin(r, x_r)
            k, losses, t_ready, self._ahead_s = 0, [], t_got, 0.0
        else:
            ahead_r, opt, start, a, losses, t_ready, g_ahead = self._ahead
            if ahead_r != r:
                raise ValueError(f"the fused model of round {r} came while the center ran ahead into round {ahead_r}")
            batches = batch_indices(len(t.x), t.batch_size, self.config.local_steps, t.seed, t.center_index, r)
            k = self.k
            load_torch_state(t._model, {n: x_r[n] + (a[n] - start[n]) for n in x_r})  # the delayed outer step
        self._ahead = None
        g_rest: dict[str, np.ndarray] = {}
        losses = losses + self._steps(opt, batches[k:], mu, control, g_rest if control is not None else None)
        t_trained = time.time()
        self.local, self.r = torch_state(t._model), r
        delta = {n: self.local[n].astype(np.float32) - np.asarray(x_r[n], dtype=np.float32) for n in x_r}
        self.start = self.local if self.outer is None else guess_next(x_r, delta, *self.outer, outer_u or {})
        payload = encode_update(delta, self.config.compression)
        if control is not None:  # c_i+: the mean raw gradient over the round's H steps, ahead and after the merge
            H = len(batches)
            g = g_rest if not (k and g_ahead) else {
                n: ((k * g_ahead[n].astype(np.float64) + (H - k) * g_rest[n]) / H).astype(np.float32) for n in g_rest}
            controls = encode_controls(g, self.config.compression)
            payload.update(controls)
            self.ci_prev, self.ci = self.ci, decode_controls(controls, self.config.compression)  # as the server has it
            self.c_prev = {n: np.asarray(v, dtype=np.float32) for n, v in control.items()}
        metrics = {"num_samples": float(t.num_samples), "train_loss": float(np.mean(losses)),
                   **bound_metrics(nonce, r, model_digest(x_r), payload), "t_received": t_got,
                   "t_trained": t_trained, "exposed_s": max(0.0, t_got - t_ready), "ahead_s": self._ahead_s,
                   "comm_s": t_available - self._t_sent if self._t_sent else max(0.0, t_got - t_ready)}
        metrics["t_sent"] = self._t_sent = time.time()
        return payload, metrics


def outer_step(config: Any) -> tuple[float, float] | None:
    """``(lr, momentum)`` of the job's fusion's outer step that a center replays on its own update
    (:meth:`~._fusion.FusionStrategy.outer_step`: SCAFFOLD, DiLoCo); None for the others (the steps
    ahead start from the center's own model)."""
    return config.make_fusion().outer_step()


def server_momentum(server: FederationServer) -> dict[str, np.ndarray] | None:
    """The outer momentum buffer ``u`` of the server's fusion, sent with the model to overlapped centers
    (zeros before the first fusion); None where the fusion has no outer momentum."""
    o = outer_step(server.config)
    if o is None or not o[1]:
        return None
    u = {k[2:]: v for k, v in server.fusion.state().items() if k.startswith("u/")}
    return {k: np.asarray(u[k], dtype=np.float32) if k in u else np.zeros(np.shape(v), np.float32)
            for k, v in server.params.items() if not is_statistic(k)}


def guess_next(x_r: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], lr: float, mu: float,
               u: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A center's guess of ``x_{r+1}``: the server's outer step with its own update ``δ_i`` for the
    average (the eager update of Kale et al. 2025), ``x_r + lr((1 + μ) δ_i − μ² u)``; running statistics
    take ``x_r + δ_i`` as the server's average does."""
    out = {}
    for n, x in x_r.items():
        x64, d = np.asarray(x, dtype=np.float64), np.asarray(delta[n], dtype=np.float64)
        step = d if is_statistic(n) else lr * ((1 + mu) * d - mu * mu * np.asarray(u.get(n, 0.0), dtype=np.float64))
        out[n] = (x64 + step).astype(np.asarray(x).dtype)
    return out


class _Center:
    """A center's thread in the in-process engine: the fused models it is sent, the replies it sends."""

    def __init__(self, name: str, trainer: Any, config: Any, proximal_mu: float, replies: queue.Queue) -> None:
        try:
            self.oc = OverlapCenter(trainer, config)
        except ValueError as e:
            raise ValueError(f"center {name!r}: {e}") from None
        self.name, self.mu = name, proximal_mu
        self.inbox: queue.Queue = queue.Queue()  # (round, x_r, nonce, available_at, c_r, u_r) or None: stop
        self.replies = replies
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"center-{name}", daemon=True)

    def _run(self) -> None:
        try:
            while True:
                self.oc.ahead(self.mu)
                item = self.inbox.get()
                if item is None:
                    return
                r, x_r, nonce, available, control, outer_u = item
                if available > time.time():
                    time.sleep(available - time.time())  # the emulated downlink delivers it then
                self.replies.put((self.name, (r, *self.oc.finish(r, x_r, nonce, self.mu, t_available=available,
                                                                 control=control, outer_u=outer_u))))
        except BaseException as e:  # reported by the server thread
            self.error = e
            self.replies.put((self.name, None))


def _holdout_evaluator(pool: Mapping[str, Any], spec: Any) -> Callable[[dict[str, np.ndarray], int], dict[str, float]]:
    """The centers' held-out evaluation on a model of the server's own (the centers' models are busy training)."""
    model = build_torch_model(spec)

    def evaluate(p: dict[str, np.ndarray], r: int) -> dict[str, float]:
        per = {}
        for name, t in pool.items():
            m = dict(evaluate_torch(spec, p, *t.holdout, model=model))
            m.setdefault("count", float(len(t.holdout[1])))
            per[name] = {k: float(v) for k, v in m.items()}
        return aggregate_evaluations(per)

    return evaluate


def pipelined_rounds(config: Any, server: FederationServer, pool: Mapping[str, Any], evaluate: Any,
                     max_rounds: int | None, on_round: Callable[[RoundRecord], None] | None = None,
                     tamper: Mapping[str, Any] | None = None, holdout_eval: bool = False) -> None:
    """Run the rounds with every center in its own thread, merging the fused model after
    ``config.overlap`` steps of the next round (0: synchronous rounds on the same threads and links,
    which is what the overlapped ones are compared with). ``evaluate(params, round)``: the server's
    evaluation of each fused model; ``holdout_eval``: instead, the centers' held-out rows, evaluated on
    a model of the server's own (the centers' models are busy training)."""
    import torch

    if holdout_eval:
        evaluate = _holdout_evaluator(pool, config.model)

    replies: queue.Queue = queue.Queue()
    centers = {c.name: _Center(c.name, pool[c.name], config, server.fusion.proximal_mu, replies)
               for c in config.centers}
    links = {c.name: LinkThrottle.of(c) for c in config.centers}
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for c in centers.values():
        c.thread.start()
    done = 0
    try:
        while not server.done and (max_rounds is None or done < max_rounds):
            r, x_r = server.begin_round()
            t_pub, nonce, control, u = time.time(), server.nonce(r), server.control(), server_momentum(server)
            down = nbytes_of(x_r) + sum(nbytes_of(a) for a in (control, u) if a)
            for name, c in centers.items():
                c.inbox.put((r, {n: v.copy() for n, v in x_r.items()}, nonce,
                             links[name].done_at("down", down, t_pub) if links[name].limited else t_pub,
                             None if control is None else {n: v.copy() for n, v in control.items()}, u))
            got: list[CenterReply] = []
            delivered: dict[str, float] = {}
            while len(got) < len(centers):
                name, reply = replies.get()
                if reply is None:
                    raise RuntimeError(f"center {name!r} failed in round {r}: {centers[name].error!r}") \
                        from centers[name].error
                rr, payload, metrics = reply
                assert rr == r, (rr, r)
                link = links[name]
                delivered[name] = (link.done_at("up", nbytes_of(payload), metrics["t_sent"]) if link.limited
                                   else time.time())
                if tamper and name in tamper:
                    payload, metrics = tamper[name](r, payload, metrics, nonce)
                got.append(CenterReply(name, payload, metrics))
            last = max(delivered.values())
            if last > time.time():
                time.sleep(last - time.time())
            for rep in sorted(got, key=lambda g: delivered[g.center]):
                server.timing.record(r, "server", rep.center, "update_received", t=max(delivered[rep.center], 0.0))
                m = rep.metrics
                if isinstance(m.get("comm_s"), float) and r > 1:
                    server.timing.record(r, "center", rep.center, "comm", exposed_s=m["exposed_s"],
                                         hidden_s=max(0.0, m["comm_s"] - m["exposed_s"]))
            order = [c.name for c in config.centers]  # the synchronous engine's order: the same sums
            rec = server.finish_round(r, sorted(got, key=lambda g: order.index(g.center)),
                                      evaluate=None if evaluate is None else lambda p, r=r: evaluate(p, r))
            if on_round is not None:
                on_round(rec)
            done += 1
    finally:
        for c in centers.values():
            c.inbox.put(None)
        for c in centers.values():
            c.thread.join(timeout=60)
        torch.set_num_threads(old_threads)
