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
- :class:`TrimmedMean` per coordinate: sort the ``K`` values, drop ``⌊βK⌋`` at each end, average the rest
- :class:`Median`      per coordinate median of the ``K`` values

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
    "FUSIONS",
    "CenterUpdate",
    "DiLoCo",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FusionStrategy",
    "Median",
    "Params",
    "TrimmedMean",
    "is_statistic",
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
    """One center's contribution to a round: its local model after local training."""

    center: str
    params: Mapping[str, np.ndarray]
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


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

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        delta = _weighted_delta(global_params, updates)
        out: Params = {}
        for k, x in global_params.items():
            if is_statistic(k):
                out[k] = x + delta[k]
                continue
            m = self._buf("m", k, x)
            v = self._buf("v", k, x)
            m[...] = self.beta1 * m + (1.0 - self.beta1) * delta[k]
            v[...] = self._second_moment(v, delta[k] ** 2)
            out[k] = x + self.lr * m / (np.sqrt(v) + self.tau)
        return _cast_like(out, global_params)


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

    def fuse(self, global_params: Mapping[str, np.ndarray], updates: Sequence[CenterUpdate]) -> Params:
        delta = _weighted_delta(global_params, updates)
        out: Params = {}
        for k, x in global_params.items():
            if is_statistic(k):
                out[k] = x + delta[k]
                continue
            g = -delta[k]
            u = self._buf("u", k, x)
            u[...] = self.momentum * u + g
            out[k] = x - self.lr * (g + self.momentum * u)
        return _cast_like(out, global_params)


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


FUSIONS: dict[str, type[FusionStrategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAdam, FedYogi, DiLoCo, TrimmedMean, Median)
}


def make_fusion(name: str, **options: Any) -> FusionStrategy:
    """Build a fusion strategy by name (``fedavg``, ``fedprox``, ``fedadam``, ``fedyogi``, ``diloco``,
    ``trimmed_mean``, ``median``) with its keyword options."""
    try:
        cls = FUSIONS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown fusion strategy {name!r}; choose one of {sorted(FUSIONS)}") from None
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options {options} for fusion {name!r}: {e}") from None
