"""Fusion strategies: how the server turns the centers' local models into the next global model.

Notation for round ``t``: the global model ``x`` (a dict of named float arrays), ``K`` centers that
returned local models ``x_i`` trained on ``n_i`` samples, weights ``p_i = n_i / sum_j n_j`` and the
averaged update ``Δ = sum_i p_i (x_i - x)``. Every strategy below is one small class with a
``fuse(global_params, updates) -> new_params`` method; a new fusion is a subclass plus one entry in
:data:`FUSIONS`.

- :class:`FedAvg`      ``x' = sum_i p_i x_i = x + Δ``                      (McMahan et al. 2017)
- :class:`FedProx`     server as FedAvg; centers add ``mu/2 ||w - x||²`` to their loss (Li et al. 2020)
- :class:`FedAdam`     ``m = b1 m + (1-b1) Δ``, ``v = b2 v + (1-b2) Δ²``,
                       ``x' = x + η m / (sqrt(v) + τ)``                      (Reddi et al. 2021)
- :class:`FedYogi`     as FedAdam with ``v = v - (1-b2) Δ² sign(v - Δ²)``
- :class:`DiLoCo`      outer gradient ``g = -Δ``, ``u = μ u + g``, ``x' = x - η (g + μ u)``
                       (Nesterov momentum, Douillard et al. 2023)
- :class:`Scaffold`    ``x' = x + η_g Δ``; centers correct every local gradient by ``c − c_i``
                       (control variates, Karimireddy et al. 2020; see the class)
- :class:`TrimmedMean` per coordinate: sort the ``K`` values, drop ``⌊βK⌋`` at each end, average the rest
- :class:`Median`      per coordinate median of the ``K`` values
- :class:`MultiKrum`   score each update by the squared distances to its ``K − f − 2`` nearest others,
                       average (sample-weighted) the ``m = K − f`` best (Blanchard et al. 2017; ``m = 1``
                       is Krum)
- :class:`CenteredClip` start at the coordinate-wise median ``v`` of the updates, then
                       ``v ← v + Σ p_i clip_τ(δ_i − v)`` a few times, ``clip_τ(z) = z·min(1, τ/‖z‖)``,
                       ``τ`` = ``tau`` × the median distance ``‖δ_i − v‖`` (Karimireddy, He & Jaggi 2021)
- :class:`FLTrust`     trust ``max(0, cos(δ_i, g₀))`` in each update, ``g₀`` the server's own update on a
                       root set (Cao et al. 2021)
- :class:`FLAME`       keep the majority cluster of the updates' cosine distances, clip each to the median
                       norm, average, add Gaussian noise (Nguyen et al. 2022)
- :class:`FoolsGold`   weight ``α_i`` falls as a center's summed updates grow alike to another's
                       (Fung, Yoon & Beschastnikh 2020)

Choosing a robust fusion. The server (:mod:`._validation`) already refuses updates that are
non-finite, too large per coordinate or in norm, lie about their sample count, or replay an old round;
what passes is an update of ordinary size that may still point the wrong way (sign flipping, a
center trained on wrong labels). The coordinate-wise median and trimmed mean (Yin et al. 2018) resist
that but throw away the sample weights and, with few non-IID centers, much of the honest signal.
Multi-Krum keeps the updates that agree with most others and averages them (with weights), so with
honest centers it is close to FedAvg; it needs ``K >= 2f + 3`` to be sure (``f = 1``: 5 centers), and
with 3 centers it keeps the 2 closest. Centered clipping is the aggregator Karimireddy et al. prove
robust with few assumptions: an update far from the robust centre moves the result by at most ``τ``,
honest updates within ``τ`` are averaged as FedAvg does. See ``docs/collab.md`` for the measured
table (``benchmarks/collab_attacks.py``).

The server-side optimisers (FedAdam, FedYogi, DiLoCo) step only the trained parameters. Running
statistics (BatchNorm's ``running_mean`` / ``running_var``, see :func:`is_statistic`) are estimates, not
the result of gradient steps: extrapolating them with momentum or an adaptive step can drive a variance
negative (a NaN model after a few rounds), so they take the sample-weighted average ``x + Δ`` instead.

The robust pair ignores the sample counts on purpose: a center that lies about its data size must
not buy itself a larger say. The server-side optimisers keep state (``m``, ``v``, ``u``); it is
exposed through :meth:`FusionStrategy.state` so the server checkpoint can carry it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "FLAME",
    "FUSIONS",
    "CenterUpdate",
    "CenteredClip",
    "DiLoCo",
    "FLTrust",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FoolsGold",
    "FusionStrategy",
    "Median",
    "MultiKrum",
    "Params",
    "Scaffold",
    "TrimmedMean",
    "is_statistic",
    "majority_cluster",
    "make_fusion",
]

#: exchanged tensors that are running statistics, not trained parameters (torch names on the wire)
STATISTIC_SUFFIXES = ("running_mean", "running_var")


def is_statistic(name: str) -> bool:
    """Whether the exchanged tensor ``name`` is a running statistic (averaged, never optimised)."""
    return name.rsplit(".", 1)[-1] in STATISTIC_SUFFIXES

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class CenterUpdate:
    """One center's contribution to a round: its local model after local training (and, for a fusion
    with control variates, the center's new control variate ``c_i⁺`` over the trained parameters)."""

    center: str
    params: Mapping[str, np.ndarray]
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    controls: Mapping[str, np.ndarray] | None = None


def trained_names(params: Mapping[str, np.ndarray]) -> list[str]:
    """The exchanged tensors that gradient steps train (everything but running statistics)."""
    return [k for k in params if not is_statistic(k)]


def _weights(updates: Sequence[CenterUpdate]) -> np.ndarray:
    n = np.array([u.num_samples for u in updates], dtype=np.float64)
    if np.any(n <= 0):
        raise ValueError("every fused update needs num_samples > 0")
    return n / n.sum()


def _weighted_delta(global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
    """Δ = Σ p_i (x_i − x), accumulated in float64 so the order of centers does not matter."""
    p = _weights(updates)
    out: Params = {}
    for name, x in global_params.items():
        acc = np.zeros(x.shape, dtype=np.float64)
        for w, u in zip(p, updates):
            acc += w * (np.asarray(u.params[name], dtype=np.float64) - x)
        out[name] = acc
    return out


class FusionStrategy(ABC):
    """Base class: fuse the centers' local models into the next global model."""

    name: ClassVar[str] = ""
    #: proximal coefficient the centers add to their loss (only FedProx sets it)
    proximal_mu: float = 0.0
    #: whether the server sends a control variate ``c`` with the model and every center answers with
    #: its own ``c_i⁺`` (only SCAFFOLD)
    uses_controls: ClassVar[bool] = False
    #: whether the server must train on its own root set each round and hand the result over as
    #: :attr:`reference` before :meth:`fuse` (only FLTrust)
    needs_root: ClassVar[bool] = False
    reference: Params | None = None

    def control(self, global_params: Mapping[str, np.ndarray]) -> Params:
        """The server control variate ``c`` sent with the model of the next round (fusions with
        :attr:`uses_controls`; the others send none)."""
        raise TypeError(f"{type(self).__name__} uses no control variates")

    @abstractmethod
    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        """Return the next global model (same names, shapes and dtypes as ``global_params``)."""

    def state(self) -> Params:
        """Server-side optimiser state to checkpoint (empty for stateless fusions)."""
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds {sorted(state)}")

    def options(self) -> dict[str, float]:
        """The constructor arguments, for logs and configs."""
        return {}

    def outer_step(self) -> tuple[float, float] | None:
        """``(lr, momentum)`` where the fusion is an outer SGD step on the averaged update ``δ̄`` that a
        center can replay on its own update (``x' = x + lr((1 + μ) δ̄ − μ² u)``, ``u`` the momentum buffer
        before the step; overlapped fusion's guess of the next model, ``_overlap.guess_next``); None
        for the others (FedAvg and FedProx are ``lr = 1, μ = 0``: the center's own model)."""
        return None

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def _cast_like(new: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> Params:
    return {k: np.asarray(new[k]).astype(like[k].dtype, copy=False) for k in like}


class FedAvg(FusionStrategy):
    """Sample-weighted average of the local models."""

    name = "fedavg"

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        delta = _weighted_delta(global_params, updates)
        return _cast_like({k: global_params[k] + delta[k] for k in global_params}, global_params)


class FedProx(FedAvg):
    """FedAvg on the server; the centers minimise ``loss + mu/2 ||w − x||²``."""

    name = "fedprox"

    def __init__(self, mu: float = 0.01) -> None:
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.proximal_mu = float(mu)

    def options(self) -> dict[str, float]:
        return {"mu": self.proximal_mu}


class _ServerOptimizer(FusionStrategy):
    """A fusion whose state lives in named buffers shaped like the model."""

    _buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._state: dict[str, Params] = {b: {} for b in self._buffers}

    def _buf(self, which: str, name: str, like: np.ndarray) -> np.ndarray:
        buf = self._state[which]
        if name not in buf:
            buf[name] = np.zeros(like.shape, dtype=np.float64)
        return buf[name]

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        """The averaged update through :meth:`_step` per parameter; running statistics (BatchNorm)
        take the plain average, an optimizer step would be meaningless for them."""
        delta = _weighted_delta(global_params, updates)
        out: Params = {k: x + delta[k] if is_statistic(k) else self._step(k, x, delta[k])
                       for k, x in global_params.items()}
        return _cast_like(out, global_params)

    def _step(self, name: str, x: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The new global value of parameter ``name`` from its value ``x`` and the averaged update."""
        raise NotImplementedError

    def state(self) -> Params:
        return {f"{b}/{k}": v for b in self._buffers for k, v in self._state[b].items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._state = {b: {} for b in self._buffers}
        for key, v in state.items():
            b, _, name = key.partition("/")
            if b not in self._state:
                raise ValueError(f"{type(self).__name__}: unknown state buffer {b!r} in checkpoint")
            self._state[b][name] = np.asarray(v, dtype=np.float64)


class FedAdam(_ServerOptimizer):
    """Server-side Adam on the averaged update (no bias correction, as in Reddi et al. and Flower)."""

    name = "fedadam"
    _buffers = ("m", "v")

    def __init__(self, lr: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__()
        self.lr, self.beta1, self.beta2, self.tau = float(lr), float(beta1), float(beta2), float(tau)

    def options(self) -> dict[str, float]:
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "tau": self.tau}

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1.0 - self.beta2) * d2

    def _step(self, name: str, x: np.ndarray, delta: np.ndarray) -> np.ndarray:
        m = self._buf("m", name, x)
        v = self._buf("v", name, x)
        m[...] = self.beta1 * m + (1.0 - self.beta1) * delta
        v[...] = self._second_moment(v, delta**2)
        return x + self.lr * m / (np.sqrt(v) + self.tau)


class FedYogi(FedAdam):
    """Server-side Yogi: the second moment moves additively, so it grows slowly and never explodes."""

    name = "fedyogi"

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta2) * d2 * np.sign(v - d2)


class DiLoCo(_ServerOptimizer):
    """Outer Nesterov momentum on the averaged update (PyTorch SGD ``nesterov=True`` form)."""

    name = "diloco"
    _buffers = ("u",)

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr, self.momentum = float(lr), float(momentum)

    def options(self) -> dict[str, float]:
        return {"lr": self.lr, "momentum": self.momentum}

    def outer_step(self) -> tuple[float, float]:
        return self.lr, self.momentum

    def _step(self, name: str, x: np.ndarray, delta: np.ndarray) -> np.ndarray:
        g = -delta
        u = self._buf("u", name, x)
        u[...] = self.momentum * u + g
        return x - self.lr * (g + self.momentum * u)


class Scaffold(FusionStrategy):
    """SCAFFOLD (Karimireddy et al. 2020, "option II"), sample-weighted, with a server-side mirror of each ``c_i``.

    Centers correct client drift. Center ``i`` keeps a control variate ``c_i`` (an estimate of its own
    gradient ``∇f_i``; zero before its first round) and receives the server's ``c`` (an estimate of the
    global gradient ``∇f = Σ p_i ∇f_i``) with the model. Each local step uses the corrected gradient
    ``g_i(y) − c_i + c`` (in the local optimiser, momentum included), so a center whose data pull its
    model away from the global optimum is pulled back by the difference of the two estimates. After
    the ``K`` local steps the center sets ``c_i⁺ = (1/K) Σ_k g_i(y_k)``, the mean of its *raw*
    mini-batch gradients along the local trajectory: with plain SGD at rate ``η`` this is the paper's
    option II, ``c_i⁺ = c_i − c + (x − y_K)/(K η)``, since ``x − y_K = η Σ_k (g_i(y_k) − c_i + c)``; the
    mean of raw gradients stays the gradient estimate under momentum and a changing rate, where the
    ``(x − y_K)/(K η)`` form would not (momentum ``β`` inflates it by up to ``1/(1 − β)``).

    Server, for the accepted centers ``S``: ``x' = x + η_g Σ_{i∈S} p_i (x_i − x)`` (``p_i`` sample
    weights over ``S``; ``η_g = 1`` is FedAvg's step; running statistics take the plain average) — or,
    with ``momentum = μ > 0``, DiLoCo's outer Nesterov step on that average (``g = −Δ``, ``u = μ u + g``,
    ``x' = x − η_g (g + μ u)``): the control variates remove the drift between centers, the outer
    momentum makes up for the fewer sequential steps that ``K`` parallel centers take per round — and
    ``c = Σ_j n_j c_j / Σ_j n_j`` over every center ``j`` that has reported so far. The paper's server
    keeps only ``c`` and adds ``(1/N) Σ_{i∈S} Δc_i``; the weighted form needs the per-center terms, so
    the server keeps a mirror of each reported ``c_j`` (what the centers sent, nothing more; it is part
    of :meth:`state` and so of the checkpoint) and each center sends its new ``c_i⁺`` itself, not the
    difference. A center that lost its ``c_i`` (a restarted process) then corrects with a zero ``c_i``
    for one round and reports a fresh ``c_i⁺``, and ``c`` is right again from the next round.
    """

    name = "scaffold"
    uses_controls = True

    def __init__(self, lr: float = 1.0, momentum: float = 0.0) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"SCAFFOLD needs server lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = float(lr), float(momentum)
        self._mirror: dict[str, Params] = {}  # center -> its last reported c_i (float64)
        self._n: dict[str, float] = {}  # center -> its sample count when it reported it
        self._u: Params = {}  # outer momentum buffers (momentum > 0)

    def options(self) -> dict[str, float]:
        return {"lr": self.lr, "momentum": self.momentum}

    def outer_step(self) -> tuple[float, float]:
        return self.lr, self.momentum

    def control(self, global_params: Mapping[str, np.ndarray]) -> Params:
        names = trained_names(global_params)
        total = sum(self._n.values())
        out: Params = {}
        for k in names:
            acc = np.zeros(global_params[k].shape, dtype=np.float64)
            for center, ci in self._mirror.items():
                acc += (self._n[center] / total) * ci[k]
            out[k] = acc.astype(np.float32)
        return out

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        names = trained_names(global_params)
        for u in updates:
            if u.controls is None or set(u.controls) != set(names):
                have = None if u.controls is None else sorted(u.controls)
                raise ValueError(f"SCAFFOLD: center {u.center!r} sent control variates for {have}, "
                                 f"expected one per trained tensor {sorted(names)}")
        delta = _weighted_delta(global_params, updates)
        out: Params = {}
        for k, x in global_params.items():
            if is_statistic(k):
                out[k] = x + delta[k]
            elif self.momentum == 0:
                out[k] = x + self.lr * delta[k]
            else:  # DiLoCo's outer Nesterov step on g = -delta
                u = self._u.setdefault(k, np.zeros(x.shape, dtype=np.float64))
                u[...] = self.momentum * u - delta[k]
                out[k] = x - self.lr * (-delta[k] + self.momentum * u)
        for u in updates:
            self._mirror[u.center] = {k: np.asarray(u.controls[k], dtype=np.float64).copy() for k in names}
            self._n[u.center] = float(u.num_samples)
        return _cast_like(out, global_params)

    def state(self) -> Params:
        out: Params = {f"n/{c}": np.array(n, dtype=np.float64) for c, n in self._n.items()}
        out.update({f"c/{c}/{k}": v for c, ci in self._mirror.items() for k, v in ci.items()})
        out.update({f"u/{k}": v for k, v in self._u.items()})
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._mirror, self._n, self._u = {}, {}, {}
        for key, v in state.items():
            kind, _, rest = key.partition("/")
            if kind == "u":
                self._u[rest] = np.asarray(v, dtype=np.float64).copy()
            elif kind == "n":
                self._n[rest] = float(v)
            elif kind == "c":
                center, _, name = rest.partition("/")
                self._mirror.setdefault(center, {})[name] = np.asarray(v, dtype=np.float64)
            else:
                raise ValueError(f"Scaffold: unknown state entry {key!r} in checkpoint")
        if set(self._mirror) != set(self._n):
            raise ValueError(f"Scaffold checkpoint: control variates for {sorted(self._mirror)} but sample "
                             f"counts for {sorted(self._n)}")


class TrimmedMean(FusionStrategy):
    """Coordinate-wise β-trimmed mean of the local models (unweighted)."""

    name = "trimmed_mean"

    def __init__(self, beta: float = 0.2) -> None:
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"trimmed mean beta must be in [0, 0.5), got {beta}")
        self.beta = float(beta)

    def options(self) -> dict[str, float]:
        return {"beta": self.beta}

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        k = len(updates)
        cut = int(np.floor(self.beta * k))
        out: Params = {}
        for name in global_params:
            stack = np.sort(np.stack([np.asarray(u.params[name], dtype=np.float64) for u in updates]), axis=0)
            out[name] = stack[cut:k - cut].mean(axis=0)
        return _cast_like(out, global_params)


class Median(FusionStrategy):
    """Coordinate-wise median of the local models (unweighted); tolerates < K/2 arbitrary centers."""

    name = "median"

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        out = {
            name: np.median(np.stack([np.asarray(u.params[name], dtype=np.float64) for u in updates]), axis=0)
            for name in global_params
        }
        return _cast_like(out, global_params)


def _deltas(global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> np.ndarray:
    """The updates ``x_i − x`` flattened, one row per center (float64)."""
    return np.stack([np.concatenate([(np.asarray(u.params[k], dtype=np.float64) - x).ravel()
                                     for k, x in global_params.items()]) for u in updates])


def _unflatten(global_params: Mapping[str, np.ndarray], flat: np.ndarray) -> Params:
    out: Params = {}
    i = 0
    for k, x in global_params.items():
        out[k] = np.asarray(x, dtype=np.float64) + flat[i:i + x.size].reshape(x.shape)
        i += x.size
    return _cast_like(out, global_params)


class MultiKrum(FusionStrategy):
    """Multi-Krum (Blanchard et al. 2017): the sample-weighted mean of the ``m`` updates closest to the rest.

    ``f``: centers assumed Byzantine; each update's score is the sum of its squared distances to its
    ``max(1, K − f − 2)`` nearest other updates; the ``m`` lowest scores are averaged (``m = 0``: ``K − f``,
    at least 1). With ``K <= f`` nothing is dropped.
    """

    name = "krum"

    def __init__(self, f: float = 1, m: float = 0) -> None:
        if f < 0 or m < 0 or f != int(f) or m != int(m):
            raise ValueError(f"krum needs integers f >= 0 and m >= 0, got f={f}, m={m}")
        self.f, self.m = int(f), int(m)

    def options(self) -> dict[str, float]:
        return {"f": self.f, "m": self.m}

    def select(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> list[int]:
        """Indices of the updates multi-Krum keeps, best first."""
        k = len(updates)
        if k <= 2 or k <= self.f:
            return list(range(k))
        d = _deltas(global_params, updates)
        sq = np.square(d).sum(axis=1)
        dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * d @ d.T, 0.0)
        near = max(1, k - self.f - 2)
        scores = [float(np.sort(np.delete(dist[i], i))[:near].sum()) for i in range(k)]
        m = self.m or max(1, k - self.f)
        return sorted(range(k), key=lambda i: (scores[i], i))[:min(m, k)]

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        keep = [updates[i] for i in sorted(self.select(global_params, updates))]
        return FedAvg().fuse(global_params, keep)


class CenteredClip(FusionStrategy):
    """Centered clipping (Karimireddy, He & Jaggi 2021) around the coordinate-wise median, sample-weighted.

    ``v₀`` = coordinate-wise median of the updates; ``iters`` times ``v ← v + Σ p_i clip_τ(δ_i − v)``;
    ``τ = tau × median_i ‖δ_i − v₀‖``. An update farther than ``τ`` from the centre counts only with
    length ``τ``; with every update within ``τ`` one iteration is exactly FedAvg's ``Σ p_i δ_i``.

    ``min_cos > -1`` (default 0, with ``ref=1``; ``min_cos=-1`` is plain centered clipping): a consensus
    filter, with 3 updates or more. The cosine of each update to a reference (over the trained tensors)
    is its ``cos_consensus``; the updates below ``min_cos`` get no trust (``trust`` 0, 1 for the others)
    and the fusion is run again on the others alone. ``ref=0``: the reference is this round's result
    ``v`` (the robust consensus, which one attacker moves by at most ``τ``); ``ref=1``: the last fused
    step (this round's ``v`` in the first round), which this round's attacker cannot move: with 3
    centers one sign flipper drags ``v`` enough to keep a positive cosine to it, not to the last step;
    ``ref=2``: the smaller of the two cosines. An update pointing against the reference (a sign flip,
    IPM) is then left out instead of pulling by ``τ``; one agreeing with it (a backdoor, ALIE) is not.
    With no update left the model stays. The last step is the fusion's state
    (checkpointed). The default was chosen by measurement (docs/collab.md, benchmarks/collab_attacks.py):
    no honest update was left out of an honest-only label-skewed federation, sign flips and IPM were;
    an attacker that keeps a small positive cosine to the last step is not.
    """

    name = "centered_clip"

    def __init__(self, tau: float = 1.0, iters: float = 3, min_cos: float = 0.0, ref: float = 1) -> None:
        if not tau > 0 or iters < 1 or iters != int(iters):
            raise ValueError(f"centered_clip needs tau > 0 and an integer iters >= 1, got tau={tau}, iters={iters}")
        if not -1.0 <= min_cos < 1.0:
            raise ValueError(f"centered_clip's min_cos is in [-1, 1) (-1: off), got {min_cos}")
        if ref not in (0, 1, 2):
            raise ValueError(f"centered_clip's ref is 0 (this round's result), 1 (the last fused step) or 2 (both), "
                             f"got {ref}")
        self.tau, self.iters, self.min_cos, self.ref = float(tau), int(iters), float(min_cos), int(ref)
        self.last: np.ndarray | None = None  # the last fused step (ref=1)
        #: per center, the numbers the last :meth:`fuse` judged it by (with ``min_cos``; the audit records them)
        self.scores: dict[str, dict[str, float]] = {}

    def options(self) -> dict[str, float]:
        return {"tau": self.tau, "iters": self.iters,
                **({"min_cos": self.min_cos, "ref": self.ref} if self.min_cos > -1 else {})}

    def state(self) -> Params:
        return {} if self.last is None else {"last": self.last}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        extra = sorted(set(state) - {"last"})
        if extra:
            raise ValueError(f"CenteredClip keeps only its last step, but the checkpoint holds {extra}")
        self.last = np.asarray(state["last"], np.float64) if "last" in state else None

    def _clip(self, d: np.ndarray, p: np.ndarray) -> np.ndarray:
        v = np.median(d, axis=0)
        radius = self.tau * float(np.median(np.linalg.norm(d - v, axis=1)))
        for _ in range(self.iters):
            z = d - v
            n = np.linalg.norm(z, axis=1)
            scale = np.where(n > radius, radius / np.maximum(n, 1e-300), 1.0)
            v = v + (p * scale) @ z
        return v

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        d = _deltas(global_params, updates)
        p = _weights(updates)
        v = self._clip(d, p)
        self.scores = {}
        if self.min_cos > -1.0 and len(updates) >= 3:  # of two, either may be the odd one out
            t = _trained_mask(global_params)
            refs = [v]
            if self.ref and self.last is not None and self.last.shape == v.shape:
                refs = [self.last] if self.ref == 1 else [v, self.last]
            cos = np.min([_cos_rows(d[:, t], r[t]) for r in refs], axis=0)
            keep = cos >= self.min_cos
            self.scores = {u.center: {"cos_consensus": float(c), "trust": float(k)}
                           for u, c, k in zip(updates, cos, keep)}
            if not keep.all():
                v = self._clip(d[keep], p[keep] / p[keep].sum()) if keep.any() else np.zeros(d.shape[1])
        if self.min_cos > -1.0 and np.any(v):
            self.last = v
        return _unflatten(global_params, v)


def _cos_rows(rows: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The cosine of every row to ``ref`` (0 where either is zero)."""
    den = np.linalg.norm(rows, axis=1) * float(np.linalg.norm(ref))
    return np.where(den > 0, rows @ ref / np.maximum(den, 1e-300), 0.0)


class FLTrust(FusionStrategy):
    """FLTrust (Cao, Fang, Liu & Gong, NDSS 2021): trust in an update is its agreement with the server's own.

    Each round the server trains the global model on a small labelled *root* set of its own (never a
    center's training data) with the centers' local procedure; its update ``g₀`` is :attr:`reference`.
    Over the trained tensors, ``TS_i = max(0, cos(δ_i, g₀))`` and every update is rescaled to ``‖g₀‖``:
    ``Δ = Σ TS_i (‖g₀‖/‖δ_i‖) δ_i / Σ TS_i``. An update pointing away from the server's (a sign flip)
    gets no say, and no update counts for more than the server's own step length. Running statistics
    take the trust-and-sample-weighted mean of the centers' values. With ``Σ TS_i = 0`` the model stays.
    Sample counts weigh only the statistics: a center cannot buy trust with a claim.

    ``per_layer=1``: the trust is ``max(0, min(cos over everything, cos over each layer))``, tensors
    grouped by module (``conv1.weight`` and ``conv1.bias`` are one layer): an update that agrees
    overall but points away in one layer (a backdoor rewiring the last layer) gets less or no trust.
    """

    name = "fltrust"
    needs_root = True

    def __init__(self, per_layer: float = 0) -> None:
        if per_layer not in (0, 1):
            raise ValueError(f"fltrust's per_layer is 0 or 1, got {per_layer}")
        self.per_layer = int(per_layer)
        self.reference = None
        #: per center, the numbers the last :meth:`fuse` judged it by (the server's audit records them)
        self.scores: dict[str, dict[str, float]] = {}

    def options(self) -> dict[str, float]:
        return {"per_layer": self.per_layer}

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        if self.reference is None:
            raise ValueError("fusion 'fltrust' needs the server's update on its root set (FederationServer(root=...))")
        names = list(global_params)
        trained = _trained_mask(global_params)
        g0 = np.concatenate([np.asarray(self.reference[k], np.float64).ravel() for k in names])[trained]
        d = _deltas(global_params, updates)
        n0 = float(np.linalg.norm(g0))
        norms = np.linalg.norm(d[:, trained], axis=1)
        cos = np.where((norms > 0) & (n0 > 0), d[:, trained] @ g0 / np.maximum(norms * n0, 1e-300), 0.0)
        ts = np.maximum(cos, 0.0)
        if self.per_layer:  # the least agreeing layer (tensors grouped by module) sets the trust
            layer = np.concatenate([np.full(global_params[k].size, k.rpartition(".")[0]) for k in names])[trained]
            for g in np.unique(layer):
                m = layer == g
                a, b = d[:, trained][:, m], g0[m]
                den = np.linalg.norm(a, axis=1) * np.linalg.norm(b)
                ts = np.minimum(ts, np.maximum(np.where(den > 0, a @ b / np.maximum(den, 1e-300), 0.0), 0.0))
        self.scores = {u.center: {"cos_root": float(c), "trust": float(t)} for u, c, t in zip(updates, cos, ts)}
        out = np.zeros(d.shape[1])
        if ts.sum() > 0:
            scale = ts * n0 / np.maximum(norms, 1e-300)
            out[trained] = (scale @ d[:, trained]) / ts.sum()
            w = ts * _weights(updates)
            out[~trained] = (w @ d[:, ~trained]) / w.sum()
        return _unflatten(global_params, out)


def _trained_mask(global_params: Mapping[str, np.ndarray]) -> np.ndarray:
    """Over :func:`_deltas`' columns: True for a trained coordinate, False for a running statistic."""
    return np.concatenate([np.full(x.size, not is_statistic(k)) for k, x in global_params.items()])


def _cosines(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of the rows (a zero row is orthogonal to every row, itself included)."""
    n = np.linalg.norm(rows, axis=1)
    u = rows / np.where(n > 0, n, 1.0)[:, None]
    return np.where((n[:, None] > 0) & (n[None, :] > 0), u @ u.T, 0.0)


def _longest_link(dist: np.ndarray) -> float:
    """The largest edge of a minimum spanning tree of ``dist`` (Prim): where single linkage joins the last two parts."""
    seen = np.zeros(len(dist), dtype=bool)
    seen[0] = True
    reach, longest = dist[0].astype(np.float64), 0.0
    for _ in range(len(dist) - 1):
        j = int(np.argmin(np.where(seen, np.inf, reach)))
        longest = max(longest, float(reach[j]))
        seen[j] = True
        reach = np.minimum(reach, dist[j])
    return longest


def _components(linked: np.ndarray) -> list[list[int]]:
    """Connected components of the boolean adjacency matrix ``linked``."""
    left, parts = set(range(len(linked))), []
    while left:
        stack, part = [min(left)], []
        left.discard(stack[0])
        while stack:
            i = stack.pop()
            part.append(i)
            near = {j for j in left if linked[i, j]}
            left -= near
            stack += sorted(near)
        parts.append(sorted(part))
    return parts


def majority_cluster(dist: np.ndarray) -> list[int]:
    """The members HDBSCAN keeps on the ``K × K`` distance matrix ``dist`` with FLAME's settings
    (``min_cluster_size = K//2 + 1``, ``min_samples = 1``, ``allow_single_cluster``), sorted.

    With ``min_samples = 1`` the mutual reachability distance is the distance itself, so the hierarchy
    is single linkage. A majority minimum admits one cluster only (two would need more than ``K``
    members): the condensed tree is its root. Walking down from all ``K`` members, each split at the
    group's longest single-linkage link drops the pieces smaller than ``K//2 + 1`` as noise and goes on
    with the one that is not; when no piece is that large, the members left fall out together at the
    largest λ (1/distance) and are the cluster. Pieces split off at equal distances go at once. The
    cluster always holds a majority: of 3 centers, the closest pair; of 2, both.
    """
    need = len(dist) // 2 + 1
    group = list(range(len(dist)))
    while len(group) > 1:
        sub = dist[np.ix_(group, group)]
        big = [p for p in _components(sub < _longest_link(sub)) if len(p) >= need]
        if not big:
            break
        group = [group[i] for i in big[0]]
    return group


class FLAME(FusionStrategy):
    """FLAME (Nguyen et al., USENIX Security 2022): cluster the directions, clip to the median norm, add noise.

    Over the trained tensors, with ``K`` accepted updates ``δ_i``:

    1. cosine distances ``d_ij = 1 − cos(δ_i, δ_j)``; the kept set ``S`` is the cluster HDBSCAN finds
       with ``min_cluster_size = K//2 + 1``, ``min_samples = 1`` (:func:`majority_cluster`, computed
       here without scikit-learn); the others are outliers and get no weight;
    2. ``s = median_i ‖δ_i‖`` over all ``K``; every kept update is clipped to it,
       ``γ_i = min(1, s/‖δ_i‖)``;
    3. ``Δ = Σ_{i∈S} p_i γ_i δ_i`` (``p_i`` sample weights renormalised over ``S``; the paper averages
       without weights) plus ``N(0, (noise · s)²)`` in every trained coordinate. The paper's
       ``noise = λ = 0.001`` for image classification; the noise is drawn from ``(seed, fused round)``,
       the round count is :meth:`state` and so checkpointed.

    Running statistics (BatchNorm) take the sample-weighted mean over ``S``, unclipped and without noise.
    The audit gets ``trust = γ_i`` for a kept center (the factor its update enters with) and ``0`` for
    an outlier.

    With few centers the clustering degenerates: the majority cluster has no choice but to be a
    majority, so of 3 centers exactly one (the one farthest, by single linkage, from the closest
    pair) is dropped every round, honest or not, and of 5 one or two; of 2 none. Under label skew the
    dropped center is usually an honest one whose classes differ most, which costs accuracy when nobody
    attacks (``docs/collab.md`` has the numbers).
    """

    name = "flame"

    def __init__(self, noise: float = 0.001, seed: float = 0) -> None:
        if not noise >= 0 or seed != int(seed):
            raise ValueError(f"flame needs noise >= 0 and an integer seed, got noise={noise}, seed={seed}")
        self.noise, self.seed = float(noise), int(seed)
        self._fused = 0
        #: per center, the numbers the last :meth:`fuse` judged it by (the server's audit records them)
        self.scores: dict[str, dict[str, float]] = {}

    def options(self) -> dict[str, float]:
        return {"noise": self.noise, "seed": self.seed}

    def state(self) -> Params:
        return {"fused": np.array(self._fused, dtype=np.float64)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if set(state) - {"fused"}:
            raise ValueError(f"FLAME: unknown state entries {sorted(set(state) - {'fused'})} in checkpoint")
        self._fused = int(state.get("fused", 0))

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        trained = _trained_mask(global_params)
        d = _deltas(global_params, updates)
        kept = majority_cluster(1.0 - _cosines(d[:, trained]))
        norms = np.linalg.norm(d[:, trained], axis=1)
        s = float(np.median(norms))
        gamma = np.where(norms > s, s / np.maximum(norms, 1e-300), 1.0)
        p = np.zeros(len(updates))
        p[kept] = _weights([updates[i] for i in kept])
        out = np.zeros(d.shape[1])
        out[trained] = (p * gamma) @ d[:, trained]
        out[~trained] = p @ d[:, ~trained]
        rng = np.random.default_rng([self.seed, self._fused])
        out[trained] += rng.normal(0.0, self.noise * s, int(trained.sum())) if self.noise > 0 else 0.0
        self._fused += 1
        self.scores = {u.center: {"trust": float(gamma[i]) if p[i] > 0 else 0.0} for i, u in enumerate(updates)}
        return _unflatten(global_params, out)


class FoolsGold(FusionStrategy):
    """FoolsGold (Fung, Yoon & Beschastnikh, RAID 2020): centers whose updates keep pointing alike lose weight.

    The server keeps each center's history ``H_i = Σ_rounds δ_i`` (trained tensors; :meth:`state`).
    For the round's ``K`` centers: ``cs_ij = cos(H_i, H_j)`` (``i ≠ j``), ``v_i = max_j cs_ij``;
    pardoning: ``cs_ij ← cs_ij · v_i / v_j`` where ``v_j > v_i``; ``α_i = clip(1 − max_j cs_ij, 0, 1)``,
    ``α ← α / max α`` (``1 → 0.99``), ``α_i ← clip(κ (ln(α_i / (1 − α_i)) + 0.5), 0, 1)``. Then
    ``Δ = Σ α_i p_i δ_i / Σ α_i p_i`` (sample weights ``p_i``; statistics alike); all ``α = 0``: the
    model stays. The paper's optional feature-importance weighting of the output layer is left out.

    It is a defence against *sybils*: several attacker-held centers sending alike updates. One attacker
    alone is not alike to anybody, and its weight stays at 1 (a sign flipper's cosines are negative):
    it does nothing against a single malicious center (``docs/collab.md``). The audit gets
    ``trust = α_i``.
    """

    name = "foolsgold"

    def __init__(self, kappa: float = 1.0) -> None:
        if not kappa > 0:
            raise ValueError(f"foolsgold needs kappa > 0, got {kappa}")
        self.kappa = float(kappa)
        self._history: Params = {}
        self.scores: dict[str, dict[str, float]] = {}

    def options(self) -> dict[str, float]:
        return {"kappa": self.kappa}

    def state(self) -> Params:
        return dict(self._history)

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._history = {c: np.asarray(h, np.float64).copy() for c, h in state.items()}

    def weights(self, histories: np.ndarray) -> np.ndarray:
        """FoolsGold's ``α`` for the rows of ``histories`` (one summed update per center)."""
        k = len(histories)
        if k < 2:
            return np.ones(k)
        cs = _cosines(histories) - 2.0 * np.eye(k)  # the diagonal never wins a max
        v = cs.max(axis=1)
        cs = np.where(v[None, :] > v[:, None], cs * v[:, None] / np.where(v[None, :] != 0, v[None, :], 1.0), cs)
        alpha = np.clip(1.0 - cs.max(axis=1), 0.0, 1.0)
        if alpha.max() <= 0:
            return np.zeros(k)
        alpha = alpha / alpha.max()
        alpha[alpha == 1.0] = 0.99
        with np.errstate(divide="ignore"):
            logit = self.kappa * (np.log(alpha / (1.0 - alpha)) + 0.5)
        return np.clip(np.nan_to_num(logit, nan=0.0, neginf=0.0, posinf=1.0), 0.0, 1.0)

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        trained = _trained_mask(global_params)
        d = _deltas(global_params, updates)
        for u, row in zip(updates, d):
            self._history[u.center] = self._history.get(u.center, 0.0) + row[trained]
        alpha = self.weights(np.stack([self._history[u.center] for u in updates]))
        self.scores = {u.center: {"trust": float(a)} for u, a in zip(updates, alpha)}
        w = alpha * _weights(updates)
        out = (w @ d) / w.sum() if w.sum() > 0 else np.zeros(d.shape[1])
        return _unflatten(global_params, out)


FUSIONS: dict[str, type[FusionStrategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAdam, FedYogi, DiLoCo, Scaffold, TrimmedMean, Median, MultiKrum,
                              CenteredClip, FLTrust, FLAME, FoolsGold)
}


def make_fusion(name: str, **options: Any) -> FusionStrategy:
    """Build a fusion strategy by name (``fedavg``, ``fedprox``, ``fedadam``, ``fedyogi``, ``diloco``,
    ``scaffold``, ``trimmed_mean``, ``median``, ``krum``, ``centered_clip``, ``fltrust``, ``flame``,
    ``foolsgold``) with its keyword options."""
    try:
        cls = FUSIONS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown fusion strategy {name!r}; choose one of {sorted(FUSIONS)}") from None
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options {options} for fusion {name!r}: {e}") from None
