"""MindSpore centers: the built-in architectures in ``mindspore.nn``, the user's own ``Cell``, and the map.

Parameters cross the federation under *torch* names as float32 numpy arrays. A MindSpore center
builds its ``Cell`` — the built-in kind's (below) or the user's, from ``ModelSpec.mindspore``
(``"package.module:function"`` returning an ``nn.Cell`` of the same architecture as the torch model)
— and converts with :func:`parameter_map`, inferred by :func:`._param_map.infer_map` from the torch
model's ``state_dict`` and the cell's ``parameters_and_names()`` (aliases, order, shapes, layouts):

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

A user cell may name its layers differently and keep a matrix ``[in, out]`` (``x @ W``): order and
shape decide then, and the mapping carries the transpose. The map is inferred and checked by the
framework-neutral mechanism of :mod:`._foreign` (the same for Paddle and TensorFlow centers): before
round 1 a MindSpore center checks the map on a forward pass (the center's first batch, eval mode):
the same parameters in both models must give the same output within 1e-4 relative, and the same
loss; otherwise the error names the first layer whose output differs and the tensors mapped to it.
Conventions that are *not* layouts are checked too: BatchNorm's momentum (MindSpore's argument is
``1 − torch's``, so torch's 0.1 is ``momentum=0.9``) and the epsilon of BatchNorm and LayerNorm
(MindSpore's LayerNorm defaults to 1e-7, torch to 1e-5).

A MindSpore center trains cross-entropy over the last dimension of the cell's output (``-100``
targets ignored), or MSE with ``loss="mse"``; a torch model's own loss (``loss="model"``) cannot be
shared with a cell, and under ``loss="auto"`` the check above requires it to equal that cross-entropy.
This module holds what is MindSpore's own: the built-in cells, parameter I/O, hooks and the SGD step
(:data:`MINDSPORE`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _foreign
from ._foreign import (
    VERIFY_RTOL,
    ForeignTrainer,
    Framework,
    first_np,
    load_checked,
    norm_settings,
    recording_hooks,
    torch_tensors,
)
from ._models import ModelSpec
from ._param_map import ParamMapping, TensorInfo, apply_map, invert_map

__all__ = [
    "MINDSPORE",
    "VERIFY_RTOL",
    "MindSporeTrainer",
    "ParamMapping",
    "build_mindspore_model",
    "build_mindspore_seeded",
    "mindspore_state",
    "mindspore_to_torch",
    "parameter_map",
    "torch_tensors",
    "torch_to_mindspore",
    "verify_mindspore_map",
]


def mindspore_tensors(cell: Any) -> list[TensorInfo]:
    kinds = {name: type(c).__name__ for name, c in cell.cells_and_names()}
    return [TensorInfo(p.name, tuple(p.shape), kinds.get(p.name.rpartition(".")[0], ""))
            for _, p in cell.parameters_and_names()]


def parameter_map(spec: ModelSpec, torch_model: Any = None, cell: Any = None) -> tuple[ParamMapping, ...]:
    """The torch ↔ MindSpore map of ``spec``, inferred from both models (built when not given).

    Raises ValueError naming the first torch tensor no MindSpore parameter fits.
    """
    return _foreign.parameter_map(spec, "mindspore", torch_model, cell)


def torch_to_mindspore(params: Mapping[str, np.ndarray], mapping: tuple[ParamMapping, ...]) -> dict[str, np.ndarray]:
    """Rename and re-lay torch-named arrays for MindSpore."""
    return apply_map(params, mapping)


def mindspore_to_torch(params: Mapping[str, np.ndarray], mapping: tuple[ParamMapping, ...]) -> dict[str, np.ndarray]:
    """Inverse of :func:`torch_to_mindspore`."""
    return invert_map(params, mapping)


def _ms() -> Any:
    import mindspore as ms

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return ms


def build_mindspore_seeded(spec: ModelSpec, seed: int = 0) -> Any:
    """:func:`build_mindspore_model` after ``mindspore.set_seed(seed)`` (the builder in ``MODEL_BUILDERS``)."""
    return _foreign.build_foreign_model(spec, "mindspore", seed)


def build_mindspore_model(spec: ModelSpec) -> Any:
    """The ``mindspore.nn.Cell`` of ``spec``: the user's (``spec.mindspore``), or the built-in kind's, with
    the same architecture and attribute names as the torch model."""
    _foreign.import_frameworks(["mindspore"])
    if spec.user:
        return _foreign.build_foreign_model(spec, "mindspore")
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
    load_checked({p.name: p for p in model.get_parameters()}, params, "MindSpore model",
                 lambda p, a: p.set_data(ms.Tensor(a)))


def verify_mindspore_map(spec: ModelSpec, torch_model: Any, cell: Any, mapping: tuple[ParamMapping, ...],
                         x: np.ndarray, y: np.ndarray, seed: int = 0) -> float:
    """:func:`._foreign.verify_map` for a MindSpore cell (the relative output error; ValueError naming the
    first layer, convention or loss that differs)."""
    return _foreign.verify_map(spec, "mindspore", torch_model, cell, mapping, x, y, seed)


def _ms_labels(spec: ModelSpec, y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y, dtype=np.float32 if spec.loss == "mse" else np.int32)


def _ms_loss(spec: ModelSpec, out: Any, y: Any, bias: Any = None) -> Any:
    """The center's loss of the cell's output: MSE, or cross-entropy over the last dimension (-100 ignored)."""
    from mindspore import ops

    out = out[0] if isinstance(out, tuple | list) else out
    if spec.loss == "mse":
        return ((out - y.reshape(out.shape)) ** 2).mean()
    if bias is not None:
        out = out + bias
    logits = out.reshape(-1, out.shape[-1])
    t = y.reshape(-1)
    keep = t != -100
    logp = ops.log_softmax(logits, -1)
    nll = -ops.gather_elements(logp, 1, ops.where(keep, t, ops.zeros_like(t)).expand_dims(1)).squeeze(1)
    w = keep.astype(logp.dtype)
    return (nll * w).sum() / ops.maximum(w.sum(), ops.ones_like(w.sum()))


@dataclass
class MindSporeTrainer(ForeignTrainer):
    """Local SGD in MindSpore (CPU, PyNative) on one center's data; speaks torch names on the wire
    (:class:`._foreign.ForeignTrainer` with ``framework="mindspore"``)."""

    framework: str = "mindspore"


class _MindSpore(Framework):
    """MindSpore for :mod:`._foreign`: PyNative mode, ``nn.Cell``."""

    name = "mindspore"
    model_type = "mindspore.nn.Cell"

    biased_running_var = False

    def seed(self, seed: int) -> None:
        _ms().set_seed(seed)

    def build(self, spec: ModelSpec) -> Any:
        return build_mindspore_model(spec)

    def check_model(self, model: Any) -> bool:
        from mindspore import nn

        return isinstance(model, nn.Cell)

    def tensors(self, model: Any) -> list[TensorInfo]:
        return mindspore_tensors(model)

    def state(self, model: Any) -> dict[str, np.ndarray]:
        return mindspore_state(model)

    def load(self, model: Any, params: Mapping[str, np.ndarray]) -> None:
        load_mindspore_state(model, params)

    def forward(self, model: Any, x: np.ndarray) -> np.ndarray:
        model.set_train(False)
        return first_np(model(_ms().Tensor(np.ascontiguousarray(x))))

    def hook_outputs(self, model: Any, paths: Iterable[str], out: dict[str, np.ndarray]) -> Any:
        return recording_hooks(dict(model.cells_and_names()), paths, out, lambda c, h: c.register_forward_hook(h))

    def norms(self, model: Any) -> dict[str, tuple[float | None, float | None]]:
        # MindSpore keeps 1 - its momentum argument as .momentum (torch's convention)
        return norm_settings(model.cells_and_names(), "momentum", ("eps", "epsilon"), lambda m: 1 - m)

    def train_steps(self, trainer: ForeignTrainer, steps: int, round_idx: int, proximal_mu: float) -> list[float]:
        ms = _ms()
        from mindspore import nn

        model = trainer.model
        model.set_train(True)
        trainable = model.trainable_params()
        anchors = [ms.Tensor(p.asnumpy()) for p in trainable] if proximal_mu > 0 else []
        opt = nn.SGD(trainable, learning_rate=trainer.lr_at(round_idx), momentum=trainer.momentum)
        prior = trainer.logit_bias()
        bias = None if prior is None else ms.Tensor(prior)
        spec = trainer.model_spec

        def forward(xb: Any, yb: Any) -> Any:
            data = _ms_loss(spec, model(xb), yb, bias)
            loss = data
            if anchors:
                loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(trainable, anchors))
            return loss, data  # the data loss is reported, as the torch trainer does, without the proximal term

        grad_fn = ms.value_and_grad(forward, None, opt.parameters, has_aux=True)
        reduce = self.grad_reducer(opt.parameters)
        after_step = getattr(trainer, "after_step", None)  # a pruned job's masked twin: removed entries back to 0
        losses = []
        for batch in trainer.batches(steps, round_idx):
            idx = self.share(batch)
            xb = ms.Tensor(np.ascontiguousarray(trainer.x[idx]))
            yb = ms.Tensor(_ms_labels(spec, trainer.y[idx]))
            (_, data), grads = grad_fn(xb, yb)
            opt(reduce(grads))
            if after_step is not None:
                after_step()
            losses.append(float(data.asnumpy()))
        return losses

    def share(self, batch: np.ndarray) -> np.ndarray:
        """The rows of a global batch this process trains on: all of them (a data-parallel rank: its share)."""
        return batch

    def grad_reducer(self, parameters: Any) -> Any:
        """What turns this process's gradients into the step's (one process: themselves; data parallel: their
        mean over the ranks)."""
        return lambda grads: grads


#: MindSpore's :class:`._foreign.Framework`
MINDSPORE = _MindSpore()
