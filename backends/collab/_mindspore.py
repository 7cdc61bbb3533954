"""MindSpore centers: the same architectures in ``mindspore.nn`` and the explicit torch ↔ MindSpore map.

Parameters cross the federation under *torch* names as float32 numpy arrays. A MindSpore center
converts with :func:`parameter_map`, a list of :class:`ParamMapping` derived layer by layer from the
model (same attribute path in both frameworks, a per-layer-type rule for the leaf name and layout):

=================  ======================  ==============================  ========
torch layer        torch tensor            MindSpore tensor                layout
=================  ======================  ==============================  ========
Linear / Dense     weight [out, in], bias  weight [out, in], bias          same
Conv2d             weight [o, i, kh, kw]   weight [o, i, kh, kw], bias     same
BatchNorm2d        weight, bias            gamma, beta                     same
                   running_mean/var        moving_mean / moving_variance   same
LayerNorm          weight, bias            gamma, beta                     same
Embedding          weight [vocab, dim]     embedding_table [vocab, dim]    same
=================  ======================  ==============================  ========

The layouts of these layers agree, so every mapping's permutation is the identity; the field is
there (and applied) so a layer whose layout differs is one more rule, not a special case. Conventions
that are *not* layouts are set on the MindSpore side to match torch: BatchNorm ``momentum = 1 − 0.1``
(MindSpore weighs the old statistic, torch the new one), epsilon 1e-5 for BatchNorm and LayerNorm
(MindSpore's LayerNorm default is 1e-7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._center import CenterData, batch_indices
from ._models import MODEL_KINDS, ModelSpec, build_torch_model

__all__ = [
    "MindSporeTrainer",
    "ParamMapping",
    "build_mindspore_model",
    "build_mindspore_seeded",
    "mindspore_state",
    "mindspore_to_torch",
    "parameter_map",
    "torch_to_mindspore",
]

# torch layer type -> {torch leaf name: MindSpore leaf name}
_LEAF_RULES: dict[str, dict[str, str]] = {
    "Linear": {"weight": "weight", "bias": "bias"},
    "Conv2d": {"weight": "weight", "bias": "bias"},
    "BatchNorm2d": {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean",
                    "running_var": "moving_variance"},
    "LayerNorm": {"weight": "gamma", "bias": "beta"},
    "Embedding": {"weight": "embedding_table"},
}


@dataclass(frozen=True)
class ParamMapping:
    """One tensor: its torch name, its MindSpore name, and the axis permutation torch → MindSpore."""

    torch_name: str
    ms_name: str
    layer: str
    perm: tuple[int, ...] | None = None

    def to_ms(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if self.perm is None else a.transpose(self.perm))

    def to_torch(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if self.perm is None else a.transpose(np.argsort(self.perm)))


def parameter_map(spec: ModelSpec) -> tuple[ParamMapping, ...]:
    """The map for ``spec``, read off the torch model's layers (errors name an unmapped layer)."""
    model = build_torch_model(spec)
    out = []
    for mod_name, mod in model.named_modules():
        kind = type(mod).__name__
        direct = dict(mod.named_parameters(recurse=False)) | dict(mod.named_buffers(recurse=False))
        direct = {k: v for k, v in direct.items() if v.is_floating_point()}
        if not direct:
            continue
        if kind not in _LEAF_RULES:
            raise ValueError(f"no MindSpore mapping for torch layer {mod_name!r} of type {kind}")
        for leaf in direct:
            prefix = f"{mod_name}." if mod_name else ""
            out.append(ParamMapping(prefix + leaf, prefix + _LEAF_RULES[kind][leaf], kind))
    return tuple(out)


def torch_to_mindspore(params: Mapping[str, np.ndarray], mapping: tuple[ParamMapping, ...]) -> dict[str, np.ndarray]:
    """Rename and re-lay torch-named arrays for MindSpore."""
    missing = [m.torch_name for m in mapping if m.torch_name not in params]
    if missing:
        raise KeyError(f"torch parameters missing for the MindSpore model: {missing}")
    return {m.ms_name: m.to_ms(np.asarray(params[m.torch_name], dtype=np.float32)) for m in mapping}


def mindspore_to_torch(params: Mapping[str, np.ndarray], mapping: tuple[ParamMapping, ...]) -> dict[str, np.ndarray]:
    """Inverse of :func:`torch_to_mindspore`."""
    missing = [m.ms_name for m in mapping if m.ms_name not in params]
    if missing:
        raise KeyError(f"MindSpore parameters missing: {missing}")
    return {m.torch_name: m.to_torch(np.asarray(params[m.ms_name], dtype=np.float32)) for m in mapping}


def _ms() -> Any:
    import mindspore as ms

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return ms


def build_mindspore_seeded(spec: ModelSpec, seed: int = 0) -> Any:
    """:func:`build_mindspore_model` after ``mindspore.set_seed(seed)`` (the builder in ``MODEL_BUILDERS``)."""
    _ms().set_seed(seed)
    return build_mindspore_model(spec)


def build_mindspore_model(spec: ModelSpec) -> Any:
    """The ``mindspore.nn.Cell`` with the same architecture and attribute names as the torch model."""
    if spec.user:
        raise ValueError(f"model {spec.kind!r} is a torch model: MindSpore centers build the built-in kinds "
                         f"{MODEL_KINDS} only (a user model needs a MindSpore builder and a parameter map, not "
                         "implemented yet); train it on torch centers")
    if spec.norm != "batch":
        raise ValueError(f"MindSpore centers build the {spec.kind} with BatchNorm only (norm={spec.norm!r} has no "
                         "name-and-layout map); use norm='batch' or torch centers")
    ms = _ms()
    from mindspore import nn, ops

    if spec.kind == "mlp":
        in_f = int(np.prod(spec.in_shape))

        class MLP(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = nn.Dense(in_f, spec.hidden)
                self.norm = nn.LayerNorm((spec.hidden,), epsilon=1e-5)
                self.fc2 = nn.Dense(spec.hidden, spec.num_classes)

            def construct(self, x: Any) -> Any:
                return self.fc2(ops.relu(self.norm(self.fc1(x.reshape(x.shape[0], -1)))))

        return MLP()
    if spec.kind == "cnn":
        c, h, w = spec.in_shape
        ch = spec.hidden

        class CNN(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(c, ch, 3, pad_mode="pad", padding=1, has_bias=True)
                self.bn1 = nn.BatchNorm2d(ch, eps=1e-5, momentum=0.9)
                self.conv2 = nn.Conv2d(ch, 2 * ch, 3, pad_mode="pad", padding=1, has_bias=True)
                self.bn2 = nn.BatchNorm2d(2 * ch, eps=1e-5, momentum=0.9)
                self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
                self.fc = nn.Dense(2 * ch * (h // 4) * (w // 4), spec.num_classes)

            def construct(self, x: Any) -> Any:
                x = self.pool(ops.relu(self.bn1(self.conv1(x))))
                x = self.pool(ops.relu(self.bn2(self.conv2(x))))
                return self.fc(x.reshape(x.shape[0], -1))

        return CNN()

    class EmbBag(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(spec.vocab, spec.hidden)
            self.norm = nn.LayerNorm((spec.hidden,), epsilon=1e-5)
            self.fc = nn.Dense(spec.hidden, spec.num_classes)

        def construct(self, x: Any) -> Any:
            return self.fc(self.norm(self.emb(x.astype(ms.int32)).mean(1)))

    return EmbBag()


def mindspore_state(model: Any) -> dict[str, np.ndarray]:
    """Every parameter of a MindSpore cell (trainable and BatchNorm statistics) under MindSpore names."""
    return {p.name: p.asnumpy().astype(np.float32, copy=True) for p in model.get_parameters()}


def load_mindspore_state(model: Any, params: Mapping[str, np.ndarray]) -> None:
    ms = _ms()
    own = {p.name: p for p in model.get_parameters()}
    unknown = set(params) - set(own)
    if unknown:
        raise KeyError(f"MindSpore model has no parameters {sorted(unknown)}")
    for name, a in params.items():
        if tuple(own[name].shape) != tuple(a.shape):
            raise ValueError(f"{name!r}: shape {tuple(a.shape)} does not fit the MindSpore model's "
                             f"{tuple(own[name].shape)}")
        own[name].set_data(ms.Tensor(np.ascontiguousarray(a, dtype=np.float32)))


@dataclass
class MindSporeTrainer(CenterData):
    """Local SGD in MindSpore (CPU, PyNative) on one center's data; speaks torch names on the wire."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mapping = parameter_map(self.model_spec)
        self._model = build_mindspore_model(self.model_spec)

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float = 0.0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        ms = _ms()
        from mindspore import nn

        model = self._model
        load_mindspore_state(model, torch_to_mindspore(global_params, self.mapping))
        model.set_train(True)
        trainable = model.trainable_params()
        anchors = [ms.Tensor(p.asnumpy()) for p in trainable] if proximal_mu > 0 else []
        opt = nn.SGD(trainable, learning_rate=self.lr_at(round_idx), momentum=self.momentum)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        prior = self.logit_bias()
        bias = None if prior is None else ms.Tensor(prior)

        def forward(xb: Any, yb: Any) -> Any:
            out = model(xb)
            ce = loss_fn(out if bias is None else out + bias, yb)
            loss = ce
            if anchors:
                loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(trainable, anchors))
            return loss, ce  # ce is reported, as the torch trainer does, without the proximal term

        grad_fn = ms.value_and_grad(forward, None, opt.parameters, has_aux=True)
        losses = []
        for idx in batch_indices(len(self.x), self.batch_size, steps, self.seed, self.center_index, round_idx):
            xb = ms.Tensor(np.ascontiguousarray(self.x[idx]))
            yb = ms.Tensor(np.ascontiguousarray(self.y[idx]).astype(np.int32))
            (_, ce), grads = grad_fn(xb, yb)
            opt(grads)
            losses.append(float(ce.asnumpy()))
        return mindspore_to_torch(mindspore_state(model), self.mapping), {"train_loss": float(np.mean(losses))}

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        ms = _ms()
        load_mindspore_state(self._model, torch_to_mindspore(params, self.mapping))
        self._model.set_train(False)
        out = self._model(ms.Tensor(np.ascontiguousarray(x))).asnumpy()
        logp = out - np.log(np.exp(out - out.max(1, keepdims=True)).sum(1, keepdims=True)) - out.max(1, keepdims=True)
        return {"loss": float(-logp[np.arange(len(y)), y].mean()), "accuracy": float((out.argmax(1) == y).mean())}
