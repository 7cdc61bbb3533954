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
shape decide then, and the mapping carries the transpose. Before round 1 a MindSpore center checks
the map on a forward pass (:func:`verify_mindspore_map`, the center's first batch, eval mode): the
same parameters in both models must give the same output within 1e-4 relative, and the same loss;
otherwise the error names the first layer whose output differs and the tensors mapped to it.
Conventions that are *not* layouts are checked too: BatchNorm's momentum (MindSpore's argument is
``1 − torch's``, so torch's 0.1 is ``momentum=0.9``) and the epsilon of BatchNorm and LayerNorm
(MindSpore's LayerNorm defaults to 1e-7, torch to 1e-5).

A MindSpore center trains cross-entropy over the last dimension of the cell's output (``-100``
targets ignored), or MSE with ``loss="mse"``; a torch model's own loss (``loss="model"``) cannot be
shared with a cell, and under ``loss="auto"`` the check above requires it to equal that cross-entropy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._center import CenterData, batch_indices
from ._models import MODEL_KINDS, ModelSpec, build_torch_model, load_torch_state, resolve_reference, torch_state
from ._objective import TorchObjective, label_tensor
from ._param_map import ParamMapping, TensorInfo, apply_map, infer_map, invert_map

__all__ = [
    "MindSporeTrainer",
    "ParamMapping",
    "build_mindspore_model",
    "build_mindspore_seeded",
    "mindspore_state",
    "mindspore_to_torch",
    "parameter_map",
    "torch_to_mindspore",
    "verify_mindspore_map",
]

#: relative tolerance of the forward-pass check, ``max|ms − torch| ≤ VERIFY_RTOL · max|torch|``
VERIFY_RTOL = 1e-4


def torch_tensors(model: Any) -> list[TensorInfo]:
    """The exchanged tensors of a torch model (floating ``state_dict`` entries) with their layer types."""
    kinds = {name: type(mod).__name__ for name, mod in model.named_modules()}
    return [TensorInfo(k, tuple(v.shape), kinds.get(k.rpartition(".")[0], ""))
            for k, v in model.state_dict().items() if v.is_floating_point()]


def mindspore_tensors(cell: Any) -> list[TensorInfo]:
    kinds = {name: type(c).__name__ for name, c in cell.cells_and_names()}
    return [TensorInfo(p.name, tuple(p.shape), kinds.get(p.name.rpartition(".")[0], ""))
            for _, p in cell.parameters_and_names()]


def parameter_map(spec: ModelSpec, torch_model: Any = None, cell: Any = None) -> tuple[ParamMapping, ...]:
    """The torch ↔ MindSpore map of ``spec``, inferred from both models (built when not given).

    Raises ValueError naming the first torch tensor no MindSpore parameter fits.
    """
    torch_model = build_torch_model(spec) if torch_model is None else torch_model
    cell = build_mindspore_model(spec) if cell is None else cell
    try:
        return infer_map(torch_tensors(torch_model), mindspore_tensors(cell), "mindspore")
    except ValueError as e:
        raise ValueError(f"{_which(spec)}: {e}") from None


def _which(spec: ModelSpec) -> str:
    return f"MindSpore model {spec.mindspore!r} for {spec.kind!r}" if spec.user else f"MindSpore {spec.kind!r}"


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
    _ms().set_seed(seed)
    return build_mindspore_model(spec)


def build_mindspore_model(spec: ModelSpec) -> Any:
    """The ``mindspore.nn.Cell`` of ``spec``: the user's (``spec.mindspore``), or the built-in kind's, with
    the same architecture and attribute names as the torch model."""
    if spec.user:
        if not spec.mindspore:
            raise ValueError(f"model {spec.kind!r} is a torch model: a MindSpore center needs the same architecture "
                             "as a MindSpore Cell: give its builder as ModelSpec(mindspore='package.module:function') "
                             f"(--mindspore-model), or train it on torch centers (built-in kinds: {MODEL_KINDS})")
        from mindspore import nn

        _ms()
        cell = resolve_reference(spec.mindspore, "MindSpore model")()
        if not isinstance(cell, nn.Cell):
            raise TypeError(f"MindSpore model {spec.mindspore!r} returned a {type(cell).__name__}; it must return a "
                            "mindspore.nn.Cell")
        return cell
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


def _probe_state(state: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The initial state moved off its defaults, so every tensor shows in the output: positive tensors
    (variances, norm scales of one) scaled by ``exp(0.2 n)``, the rest shifted by a tenth of their spread."""
    rng = np.random.default_rng([seed, 0x5EED])
    out = {}
    for k, a in state.items():
        n = rng.standard_normal(a.shape).astype(np.float32)
        if a.size and a.min() > 0:
            out[k] = (a * np.exp(0.2 * n)).astype(np.float32)
        else:
            out[k] = (a + 0.1 * max(float(a.std()), 0.1) * n).astype(np.float32)
    return out


def _first_np(out: Any) -> np.ndarray:
    out = getattr(out, "logits", out)
    if isinstance(out, tuple | list):
        out = out[0]
    return out.asnumpy() if hasattr(out, "asnumpy") else out.detach().numpy()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12)) if want.size else 0.0


def _check_conventions(torch_model: Any, cell: Any, mapping: tuple[ParamMapping, ...], which: str) -> None:
    """What an eval-mode forward pass cannot see: BatchNorm's momentum and the norms' epsilon."""
    cells = dict(cell.cells_and_names())
    for m in mapping:
        mod, c = torch_model.get_submodule(m.torch_path), cells.get(m.ms_path)
        if c is None or not m.layer.startswith(("BatchNorm", "LayerNorm")):
            continue
        mom = getattr(c, "momentum", None)
        if m.layer.startswith("BatchNorm") and mom is not None and abs(mom - (mod.momentum or 0.0)) > 1e-6:
            raise ValueError(f"{which}: MindSpore {m.ms_path!r} is built with momentum={1 - mom:g}, the weight "
                             f"MindSpore gives the old statistic (torch's momentum {mom:g}), but torch "
                             f"{m.torch_path!r} has momentum {mod.momentum}: build it with "
                             f"momentum={1 - (mod.momentum or 0.0):g}")
        eps = getattr(c, "eps", getattr(c, "epsilon", None))
        if eps is not None and abs(eps - mod.eps) > 1e-12:
            raise ValueError(f"{which}: MindSpore {m.ms_path!r} has epsilon {eps:g}, torch {m.torch_path!r} "
                             f"{mod.eps:g}: give the MindSpore layer epsilon {mod.eps:g}")


def verify_mindspore_map(spec: ModelSpec, torch_model: Any, cell: Any, mapping: tuple[ParamMapping, ...],
                         x: np.ndarray, y: np.ndarray, seed: int = 0) -> float:
    """Check ``mapping`` on one batch: the same (perturbed) parameters in both models, eval mode, must give
    outputs within :data:`VERIFY_RTOL` relative and the same loss. Returns the relative output error.

    Raises ValueError naming the first torch layer (in execution order) whose output differs from the
    MindSpore cell its tensors map to, with those tensors, or the convention or loss that differs.
    """
    import torch

    ms = _ms()
    which = _which(spec)
    state = _probe_state(torch_state(torch_model), seed)
    load_torch_state(torch_model, state)
    load_mindspore_state(cell, torch_to_mindspore(state, mapping))
    _check_conventions(torch_model, cell, mapping, which)
    objective = TorchObjective(torch_model, spec.loss)
    if not objective.logits_without_labels:
        raise ValueError(f"{which}: the torch model's forward needs labels, so its output cannot be compared with "
                         "the MindSpore cell's: give forward's labels a default (None) and return the logits then")
    t_out: dict[str, np.ndarray] = {}
    m_out: dict[str, np.ndarray] = {}
    order: list[str] = []

    def t_hook(path: str) -> Any:
        def hook(_m: Any, _i: Any, o: Any) -> None:
            if path not in t_out:
                t_out[path] = _first_np(o)
                order.append(path)
        return hook

    def m_hook(path: str) -> Any:
        def hook(_c: Any, _i: Any, o: Any) -> None:
            m_out.setdefault(path, _first_np(o))
        return hook

    cells = dict(cell.cells_and_names())
    handles = [torch_model.get_submodule(p).register_forward_hook(t_hook(p)) for p in {m.torch_path for m in mapping}]
    handles += [cells[p].register_forward_hook(m_hook(p)) for p in {m.ms_path for m in mapping} if p in cells]
    torch_model.eval()
    cell.set_train(False)
    xt, xm = torch.from_numpy(np.ascontiguousarray(x)), ms.Tensor(np.ascontiguousarray(x))
    try:
        with torch.no_grad():
            want = _first_np(objective.outputs(torch_model, xt))
            got = _first_np(cell(xm))
            t_loss = float(objective(torch_model, xt, label_tensor(y, spec.loss)))
        m_loss = float(_ms_loss(spec, cell(xm), ms.Tensor(_ms_labels(spec, y))).asnumpy())
    finally:
        for h in handles:
            h.remove()
        torch_model.train()
    err = _rel(got, want) if got.shape == want.shape else float("inf")
    if err > VERIFY_RTOL:
        head = (f"{which} does not reproduce the torch model on the center's first batch (eval mode, output "
                f"{tuple(got.shape)} vs {tuple(want.shape)}, relative error {err:.3g} > {VERIFY_RTOL:g})")
        for path in order:
            maps = [m for m in mapping if m.torch_path == path]
            mp = maps[0].ms_path
            b = m_out.get(mp)
            a = t_out[path]
            if b is None or b.shape != a.shape or _rel(b, a) > VERIFY_RTOL:
                what = ("never runs" if b is None else f"gives {tuple(b.shape)} for torch's {tuple(a.shape)}"
                        if b.shape != a.shape else f"differs by {_rel(b, a):.3g} relative")
                layer = maps[0].layer
                raise ValueError(
                    f"{head}: the first layer whose output differs is torch {path or '<root>'!r} ({layer}) vs "
                    f"MindSpore {mp or '<root>'!r}, which {what}; mapped: {', '.join(m.describe() for m in maps)}. "
                    "Check that this MindSpore layer matches (kernel, stride, padding, what runs before it) and that "
                    "the cell registers its layers in the torch model's order (same-shape layers are paired by order "
                    "unless their names agree)")
        raise ValueError(f"{head}: every layer with parameters agrees, so what differs runs after torch "
                         f"{order[-1] if order else '<root>'!r} (activation, pooling, reshape) in the construct")
    if abs(m_loss - t_loss) > VERIFY_RTOL * max(abs(t_loss), 1.0):
        kind = "mse" if spec.loss == "mse" else "cross-entropy over the last dimension"
        raise ValueError(f"{which}: the outputs agree but the torch loss {t_loss:.6g} is not the MindSpore center's "
                         f"{kind} of the output ({m_loss:.6g}); set loss='cross_entropy' or 'mse' so every center "
                         "trains the same objective, or train this model on torch centers")
    return err


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
class MindSporeTrainer(CenterData):
    """Local SGD in MindSpore (CPU, PyNative) on one center's data; speaks torch names on the wire.

    Built: the cell of the spec, the torch model (for the map only), the inferred map, checked on the
    center's first batch (:func:`verify_mindspore_map`), so a wrong map fails before round 1.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.model_spec
        if spec.loss == "model":
            raise ValueError(f"loss='model' is the torch model's own loss, which a MindSpore center cannot run: use "
                             f"loss='auto' (checked to equal cross-entropy) or 'cross_entropy' for {spec.kind!r}")
        self._model = build_mindspore_model(spec)
        torch_model = build_torch_model(spec, self.seed)
        self.mapping = parameter_map(spec, torch_model, self._model)
        first = batch_indices(len(self.x), self.batch_size, 1, self.seed, self.center_index, 1)[0]
        self.verify_error = verify_mindspore_map(spec, torch_model, self._model, self.mapping, self.x[first],
                                                 self.y[first], self.seed)

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
        prior = self.logit_bias()
        bias = None if prior is None else ms.Tensor(prior)

        def forward(xb: Any, yb: Any) -> Any:
            data = _ms_loss(self.model_spec, model(xb), yb, bias)
            loss = data
            if anchors:
                loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(trainable, anchors))
            return loss, data  # the data loss is reported, as the torch trainer does, without the proximal term

        grad_fn = ms.value_and_grad(forward, None, opt.parameters, has_aux=True)
        losses = []
        for idx in batch_indices(len(self.x), self.batch_size, steps, self.seed, self.center_index, round_idx):
            xb = ms.Tensor(np.ascontiguousarray(self.x[idx]))
            yb = ms.Tensor(_ms_labels(self.model_spec, self.y[idx]))
            (_, data), grads = grad_fn(xb, yb)
            opt(grads)
            losses.append(float(data.asnumpy()))
        return mindspore_to_torch(mindspore_state(model), self.mapping), {"train_loss": float(np.mean(losses))}

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                 batch: int = 2048) -> dict[str, float]:
        """``loss`` (mean over targets), ``count``, and ``accuracy`` / ``perplexity`` as the torch centers report."""
        ms = _ms()
        load_mindspore_state(self._model, torch_to_mindspore(params, self.mapping))
        self._model.set_train(False)
        y = np.asarray(y)
        classify = np.issubdtype(y.dtype, np.integer) and self.model_spec.loss != "mse"
        loss_sum, count, correct = 0.0, 0, 0
        for s in range(0, len(x), batch):
            yb = y[s:s + batch]
            out = self._model(ms.Tensor(np.ascontiguousarray(x[s:s + batch])))
            n = int((yb != -100).sum()) if classify else int(yb.size)
            loss_sum += float(_ms_loss(self.model_spec, out, ms.Tensor(_ms_labels(self.model_spec, yb))).asnumpy()) * n
            count += n
            if classify:
                correct += int(((_first_np(out).argmax(-1) == yb) & (yb != -100)).sum())
        res = {"loss": loss_sum / max(count, 1), "count": float(count)}
        if classify:
            res["accuracy"] = correct / max(count, 1)
            if y.ndim >= 2:
                res["perplexity"] = math.exp(min(res["loss"], 700.0))
        return res
