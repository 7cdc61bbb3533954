"""The center side of a round: load the global model, train ``H`` local steps, send the encoded update.

Local training is stateless across rounds (a fresh SGD optimiser each round; the data order of
round ``t`` at center ``i`` is drawn from ``default_rng([seed, i, t])``), so the in-process engine
and a Flower ClientApp started fresh for every message compute bit-identical updates, and a center
that crashed can rejoin any later round.

With FedProx the local objective is ``f_i(w) + mu/2 ||w − x||²`` over the trainable parameters
(``x`` the global model of the round).

SCAFFOLD is the one exception to statelessness: a center keeps its control variate ``c_i`` from round
to round (:func:`center_round`'s ``center_state``, a dict the caller holds for the center: the
in-process engine keeps one per center, the Flower ClientApp keeps it in the SuperNode's per-run
``Context.state``, which the SuperNode hands to the ClientApp with each message and stores back after
it, in the warm executor and the process-per-message isolation alike; it never goes to the server).
Each local gradient is corrected by ``c − c_i`` (``c`` the server's, sent with the model) and the
center sends its new ``c_i⁺`` with the update (see :class:`~._fusion.Scaffold`). A center that lost
its ``c_i`` starts again from zero, which only costs that round's correction.

Only parameters and metrics leave a center: :func:`center_round` returns the encoded update and a
flat dict of numbers (sample count, loss, the three time stamps) — never data.

A center's data is its ``(x, y)`` arrays, given to it or loaded by it from a data source
(:func:`load_center_data`: ``"package.module:function"`` called with the center's name). With
``CollabConfig.holdout > 0`` it keeps a seeded share of its rows apart (:func:`split_holdout`) and
evaluates the fused model on them when the server asks (:func:`center_evaluate`): numbers again.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._config import CollabConfig, check_logit_adjust
from ._distill import Distill, distill_teacher
from ._models import ModelSpec, build_torch_model, load_torch_state, resolve_reference, torch_state
from ._objective import TorchObjective, evaluate, label_tensor
from ._pruning import center_scores, scoring_model
from ._validation import bound_metrics, model_digest
from ._wire import Payload, decode_controls, encode_controls, encode_update

__all__ = ["LR_SCHEDULES", "CenterData", "LocalTrainer", "TorchTrainer", "batch_indices",
           "center_evaluate", "center_round", "label_log_prior", "load_center_data", "round_lr",
           "split_holdout"]


def batch_indices(n: int, batch_size: int, steps: int, seed: int, center_index: int, round_idx: int) -> np.ndarray:
    """Row indices of each local step: ``steps × min(batch_size, n)``, epochs drawn as permutations."""
    rng = np.random.default_rng([seed, center_index, round_idx])
    b = min(batch_size, n)
    per_epoch = n // b
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(n)[: per_epoch * b] for _ in range(epochs)])
    return order[: steps * b].reshape(steps, b)


LR_SCHEDULES = ("constant", "cosine")


def round_lr(lr: float, schedule: str, round_idx: int, rounds: int) -> float:
    """Learning rate of round ``t = round_idx`` out of ``R = rounds``: constant, or cosine decay per round.

    ``cosine``: ``lr_t = lr · ½ (1 + cos(π (t − 1) / R))`` — ``lr`` in round 1, decaying towards 0 (the
    last round gets ``lr · ½ (1 − cos(π / R))``). The schedule depends on the round only, so every arm of
    an experiment that shares the round structure (local-only, pooled, collaborative) sees the same rates,
    and a stateless center that rejoins in round ``t`` uses the rate it would have had.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {LR_SCHEDULES}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 for an lr schedule, got {rounds}")
    if schedule == "constant":
        return float(lr)
    t = min(max(round_idx, 1), rounds)
    return float(lr) * 0.5 * (1.0 + math.cos(math.pi * (t - 1) / rounds))


def label_log_prior(y: np.ndarray, num_classes: int, tau: float = 1.0) -> np.ndarray:
    """``τ · log π_k`` for the label frequencies ``π_k`` of ``y`` (float32, one entry per class).

    The logit-adjusted loss (Menon et al. 2021; "balanced softmax", Ren et al. 2020; used across label-skewed
    centers by FedLC, Zhang et al. 2022) trains on ``softmax(z + τ log π)`` and predicts with ``z``: a center
    whose data under-represents a class no longer learns to push that class's logit down, which is what
    biases local models under label skew. A class the center never saw gets ``log`` of a floor far below
    any observed frequency (``1e-6``), so it drops out of the local softmax instead of being pushed down.
    ``τ = 1`` is the value the theory gives (the Bayes-optimal correction for a balanced test set).
    """
    y = np.asarray(y).reshape(-1)
    if len(y) == 0:
        raise ValueError("label_log_prior needs at least one label")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    freq = np.bincount(y.astype(np.int64), minlength=num_classes) / len(y)
    return (tau * np.log(np.maximum(freq, 1e-6))).astype(np.float32)


class LocalTrainer(Protocol):
    """What a center needs from its framework."""

    num_samples: int

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Train from ``global_params`` (torch names) and return the local model and metrics.

        A trainer that supports SCAFFOLD (:class:`TorchTrainer`) also takes ``correction`` (added to
        every local gradient) and ``grad_mean`` (a dict it fills with the mean raw mini-batch gradient).
        """
        ...

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Loss and accuracy of ``params`` on ``(x, y)``."""
        ...


@dataclass
class CenterData:
    """What every framework's trainer holds: the model, the center's data and the SGD settings.

    The data order comes from :func:`batch_indices`, so trainers of different frameworks
    given the same fields take the same batches.
    """

    model_spec: ModelSpec
    x: np.ndarray
    y: np.ndarray
    center_index: int = 0
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    seed: int = 0
    lr_schedule: str = "constant"
    rounds: int = 1
    logit_adjust: float = 0.0

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y) or len(self.x) == 0:
            raise ValueError(f"center data: {len(self.x)} inputs vs {len(self.y)} labels (need equal, > 0)")
        round_lr(self.lr, self.lr_schedule, 1, self.rounds)  # the schedule is checked now, not in round 1
        check_logit_adjust(self.logit_adjust)

    def logit_bias(self) -> np.ndarray | None:
        """What the local loss adds to the logits: ``τ · log π`` (see :func:`label_log_prior`), or None (τ = 0)."""
        if not self.logit_adjust:
            return None
        return label_log_prior(self.y, self.model_spec.num_classes, self.logit_adjust)

    def lr_at(self, round_idx: int) -> float:
        """The local learning rate of round ``round_idx`` (see :func:`round_lr`)."""
        return round_lr(self.lr, self.lr_schedule, round_idx, self.rounds)

    @property
    def num_samples(self) -> int:
        return len(self.x)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch with ``n`` intra-op threads, restoring the previous count afterwards."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclass
class TorchTrainer(CenterData):
    """Local SGD in PyTorch on one center's data (single device, one intra-op thread for determinism)."""

    threads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._model = build_torch_model(self.model_spec, self.seed)
        self._objective = TorchObjective(self._model, self.model_spec.loss)

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float = 0.0, correction: Mapping[str, np.ndarray] | None = None,
              grad_mean: dict[str, np.ndarray] | None = None,
              distill: Distill | None = None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Local SGD from ``global_params``; see :func:`local_sgd` for ``correction``, ``grad_mean`` and
        ``distill``."""
        import torch

        with torch_threads(self.threads):
            model = self._model
            load_torch_state(model, dict(global_params))
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=self.lr_at(round_idx), momentum=self.momentum)
            xb_all = torch.from_numpy(np.ascontiguousarray(self.x))
            yb_all = label_tensor(self.y, self.model_spec.loss)
            batches = batch_indices(len(self.x), self.batch_size, steps, self.seed, self.center_index, round_idx)
            losses = local_sgd(model, model, opt, xb_all, yb_all, batches, proximal_mu, correction, grad_mean,
                               logit_bias=self.logit_bias(), objective=self._objective, distill=distill)
            return torch_state(model), {"train_loss": float(np.mean(losses))}

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return evaluate_torch(self.model_spec, params, x, y, threads=self.threads, model=self._model)


def local_sgd(model: Any, net: Any, opt: Any, x: Any, y: Any, batches: Iterable[np.ndarray],
              proximal_mu: float, correction: Mapping[str, np.ndarray] | None = None,
              grad_mean: dict[str, np.ndarray] | None = None, logit_bias: np.ndarray | None = None,
              objective: TorchObjective | None = None,
              weigh: Callable[[Callable[[], Any]], tuple[Any, float]] | None = None,
              distill: Distill | None = None) -> list[float]:
    """A center's local steps: the loss of ``net`` (the model, or its DDP wrapper) on each index
    batch, plus FedProx's ``mu/2 * ||w - w_round_start||^2`` on ``model``'s parameters when
    ``proximal_mu > 0``; returns the data losses (without the proximal term).

    ``objective`` is the loss (:class:`~._objective.TorchObjective`, built from ``model`` and the
    spec's ``loss``); None: ``TorchObjective(model, "auto")`` (the model's own loss if it takes labels,
    else cross-entropy).

    ``logit_bias`` (one value per class, :func:`label_log_prior`) is added to the logits inside the
    loss only (the logit-adjusted loss); the reported losses include it.

    ``weigh``: a center whose data-parallel ranks each see a share of the batch runs each step's
    forward through it, ``weigh(forward) -> (loss to backpropagate, the whole batch's loss)``, so the
    ranks' gradients average to the whole batch's where shares count different targets (padding).

    ``distill`` (a pruning job's fine-tuning rounds, :mod:`._distill`): the loss backpropagated is
    ``(1 − a)·CE + a·T²·KL(teacher ‖ student)``; the reported losses are the cross-entropy alone.

    SCAFFOLD: ``correction`` (parameter name -> ``c − c_i``) is added to every parameter's gradient
    before the optimiser step; ``grad_mean``, when given, is filled with the mean over the steps of the
    gradients *before* that correction, ``(1/K) Σ_k ∇ loss_k`` (the center's next ``c_i``).
    """
    import torch

    named = list(model.named_parameters())
    corr: dict[str, Any] = {}
    if correction is not None:
        have = {n for n, _ in named}
        if set(correction) != have:
            raise ValueError(f"control-variate correction for {sorted(correction)} does not match the model's "
                             f"parameters {sorted(have)}")
        corr = {n: torch.from_numpy(np.ascontiguousarray(correction[n], dtype=np.float32)) for n in correction}
    sums = {n: torch.zeros_like(p) for n, p in named} if grad_mean is not None else {}
    anchors = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    bias = None if logit_bias is None else torch.from_numpy(np.ascontiguousarray(logit_bias, dtype=np.float32))
    objective = objective or TorchObjective(model, "auto")
    losses = []
    for idx in batches:
        t = torch.from_numpy(idx)
        if distill is not None:
            if weigh is not None:
                raise ValueError("distillation while fine-tuning runs in single-process centers only")
            loss, ce = distill.loss(objective, net, x[t], y[t], bias)
            losses.append(float(ce.detach()))
        elif weigh is None:
            loss = objective(net, x[t], y[t], bias)
            losses.append(float(loss.detach()))
        else:
            loss, whole = weigh(lambda t=t: objective(net, x[t], y[t], bias))
            losses.append(whole)
        if anchors:
            loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchors))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for n, p in named:
            if n in sums:
                sums[n] += p.grad
            if n in corr:
                p.grad += corr[n]
        opt.step()
    if grad_mean is not None:
        grad_mean.update({n: (g / max(1, len(losses))).numpy().astype(np.float32) for n, g in sums.items()})
    return losses


def evaluate_torch(spec: ModelSpec, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                   threads: int = 1, batch: int = 2048, model: Any = None) -> dict[str, float]:
    """The metrics of the torch model with ``params`` on ``(x, y)``: ``loss`` (the spec's loss, mean
    over targets), ``count`` (targets), ``accuracy`` for classifiers, ``perplexity`` for per-token
    labels (see :func:`~._objective.evaluate`). ``model``: a built model of ``spec`` to reuse."""
    model = build_torch_model(spec) if model is None else model
    load_torch_state(model, dict(params))
    model.eval()
    try:
        with torch_threads(threads):
            return evaluate(model, TorchObjective(model, spec.loss), x, y, batch)
    finally:
        model.train()


def load_center_data(source: str, center: str) -> tuple[np.ndarray, np.ndarray]:
    """A center's ``(x, y)`` from its data source, loaded where the center runs.

    ``source``: an ``.npz`` path holding ``x`` and ``y``, or ``"package.module:function"`` called as
    ``function(center)`` and returning ``(x, y)`` arrays with one row per example (a classifier's
    inputs and labels, or a language model's token blocks ``(N, S)`` and their next-token labels
    ``(N, S)`` with ``-100`` where nothing is predicted).
    """
    if source.endswith(".npz") or "/" in source:
        with np.load(source) as z:
            if "x" not in z.files or "y" not in z.files:
                raise ValueError(f"{source}: needs arrays named x and y, found {z.files}")
            return z["x"], z["y"]
    fn = resolve_reference(source, "data source")
    try:
        inspect.signature(fn).bind(center)
    except TypeError:
        raise ValueError(f"data source {source!r} is called with the center's name and returns its (x, y): define it "
                         f"as def {source.rpartition(':')[2]}(center)") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    out = fn(center)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ValueError(f"data source {source!r} returned a {type(out).__name__} for center {center!r}; it must "
                         "return (x, y) arrays")
    x, y = (np.asarray(a) for a in out)
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    return x, y


def split_holdout(x: np.ndarray, y: np.ndarray, fraction: float, seed: int, center_index: int
                  ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """``(train, held_out)``: a seeded ``fraction`` of the rows (at least one) held out, None when 0."""
    if fraction <= 0:
        return (x, y), None
    n = len(x)
    k = max(1, round(fraction * n))
    if k >= n:
        raise ValueError(f"center {center_index}: holdout {fraction} of {n} rows leaves nothing to train on")
    order = np.random.default_rng([seed, center_index, 0x401D]).permutation(n)
    tr, ho = np.sort(order[k:]), np.sort(order[:k])
    return (x[tr], y[tr]), (x[ho], y[ho])


def center_evaluate(trainer: LocalTrainer, params: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The fused model's metrics on the center's held-out rows (numbers only; ``count`` weighs them)."""
    held = getattr(trainer, "holdout", None)
    if held is None:
        raise ValueError("this center holds no rows out: set CollabConfig.holdout > 0")
    m = dict(trainer.evaluate(params, *held))
    m.setdefault("count", float(len(held[1])))
    return {k: float(v) for k, v in m.items()}


def _scores(trainer: Any, local: Mapping[str, np.ndarray], config: CollabConfig, round_idx: int) -> Payload:
    """The center's pruning scores of its local model (``_pruning.center_scores``), on batches of its own rows
    drawn apart from the training batches (torch_pruning is imported only where a score or a cut needs it)."""
    if getattr(trainer, "_model", None) is None:
        raise ValueError(f"pruning needs a trainer holding its model; {type(trainer).__name__} does not")
    model, objective = scoring_model(trainer)  # a MindSpore center's: its torch twin, under the map's names
    load_torch_state(model, dict(local))
    batches = batch_indices(len(trainer.x), trainer.batch_size, config.prune.score_batches, trainer.seed,
                            trainer.center_index, 0x5C0000 + round_idx)
    return center_scores(model, objective, torch_from(trainer.x),
                         label_tensor(trainer.y, trainer.model_spec.loss), batches, config.prune, config.compression)


def torch_from(x: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


def center_round(trainer: LocalTrainer, global_params: Mapping[str, np.ndarray], *, round_idx: int,
                 config: CollabConfig, proximal_mu: float = 0.0, t_received: float | None = None,
                 control: Mapping[str, np.ndarray] | None = None,
                 center_state: MutableMapping[str, np.ndarray] | None = None,
                 nonce: int | None = None) -> tuple[Payload, dict[str, float]]:
    """Run one round at a center: returns the encoded update ``x_i − x`` and the metrics to send.

    ``nonce`` is the round's nonce the server sent with the model: the metrics then bind the payload to
    it (``binding``, :func:`~._validation.reply_binding`); a server refuses a reply without one.

    With ``control`` (the server's ``c``, SCAFFOLD) the center corrects its gradients by ``c − c_i``,
    ``c_i`` read from ``center_state`` (zero when absent), stores its new ``c_i⁺`` there (as the server
    will decode it, so both sides hold the same numbers) and appends it to the payload.
    """
    t_received = time.time() if t_received is None else t_received
    extra: dict[str, Any] = {}
    if control is not None:
        if center_state is None:
            raise ValueError("a fusion with control variates needs center_state: the dict that keeps the "
                             "center's c_i between rounds")
        ci = {k: np.asarray(center_state[k], dtype=np.float32) if k in center_state else np.zeros_like(v)
              for k, v in control.items()}
        extra = {"correction": {k: np.asarray(control[k], dtype=np.float32) - ci[k] for k in control},
                 "grad_mean": {}}
    if config.prune is not None and config.prune.distill > 0 and getattr(trainer, "_pruned_by", None) is not None:
        extra["distill"] = distill_teacher(trainer, global_params, config.prune)  # fine-tuning after the cut
    local, metrics = trainer.train(global_params, steps=config.local_steps, round_idx=round_idx,
                                   proximal_mu=proximal_mu, **extra)
    t_trained = time.time()
    delta = {k: local[k].astype(np.float32) - np.asarray(global_params[k], dtype=np.float32) for k in global_params}
    payload = encode_update(delta, config.compression)
    if control is not None:
        assert center_state is not None
        controls = encode_controls(extra["grad_mean"], config.compression)
        payload.update(controls)
        center_state.clear()
        center_state.update(decode_controls(controls, config.compression))
    if config.prune is not None and round_idx <= config.prune.rounds:  # scores of its channels, on its own rows
        payload.update(_scores(trainer, local, config, round_idx))
    # round, model digest and the binding of the payload under the round's nonce tie the reply to this
    # round: the server refuses an old reply re-sent, and an old update under this round's metrics
    digest = model_digest(global_params)
    bound = (bound_metrics(nonce, round_idx, digest, payload) if nonce is not None
             else {"round": float(round_idx), "model_digest": float(digest)})
    out = {"num_samples": float(trainer.num_samples), **{k: float(v) for k, v in metrics.items()}, **bound,
           "t_received": t_received, "t_trained": t_trained, "t_sent": time.time()}
    return payload, out
