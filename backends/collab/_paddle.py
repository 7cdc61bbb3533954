"""PaddlePaddle centers (``paddlepaddle``, CPU, dynamic graph): the built-in models and parameter I/O.

The map to the federation's torch names is inferred and checked by :mod:`._foreign`, as for every
framework. What Paddle does differently:

=================  ======================  ==============================  ================
torch layer        torch tensor            Paddle tensor                   layout
=================  ======================  ==============================  ================
Linear             weight [out, in], bias  weight **[in, out]**, bias      transposed (1, 0)
Conv2d             weight [o, i, kh, kw]   weight [o, i, kh, kw], bias     same
BatchNorm2d        weight, bias            weight, bias                    same
                   running_mean/var        ``_mean`` / ``_variance``       same
LayerNorm          weight, bias            weight, bias                    same
Embedding          weight [vocab, dim]     weight [vocab, dim]             same
=================  ======================  ==============================  ================

Paddle's ``BatchNorm2D(momentum=0.9)`` is torch's momentum 0.1 (the weight of the old statistic), its
epsilon defaults to 1e-5 as torch's. It updates its running variance with the *biased* batch variance
(torch: the unbiased one); the center corrects that after every step
(:meth:`._foreign.ForeignTrainer.unbias`), so the statistics it sends are torch's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._foreign import (
    ForeignTrainer,
    Framework,
    build_foreign_model,
    first_np,
    load_checked,
    norm_settings,
    recording_hooks,
)
from ._models import ModelSpec
from ._param_map import TensorInfo

__all__ = ["PADDLE", "build_paddle_model"]


def build_paddle_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The ``paddle.nn.Layer`` of ``spec`` (the builder in ``MODEL_BUILDERS``), initialised from ``seed``."""
    return build_foreign_model(spec, "paddle", seed)


def _built_in(spec: ModelSpec) -> Any:
    import paddle
    from paddle import nn
    from paddle.nn import functional as F

    if spec.norm != "batch":
        raise ValueError(f"Paddle centers build the {spec.kind} with BatchNorm only (norm={spec.norm!r}); use "
                         "norm='batch' or torch centers")
    if spec.kind == "mlp":
        in_f = int(np.prod(spec.in_shape))

        class MLP(nn.Layer):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = nn.Linear(in_f, spec.hidden)
                self.norm = nn.LayerNorm(spec.hidden, epsilon=1e-5)
                self.fc2 = nn.Linear(spec.hidden, spec.num_classes)

            def forward(self, x: Any) -> Any:
                return self.fc2(F.relu(self.norm(self.fc1(x.reshape([x.shape[0], -1])))))

        return MLP()
    if spec.kind == "cnn":
        c, h, w = spec.in_shape
        ch = spec.hidden

        class CNN(nn.Layer):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2D(c, ch, 3, padding=1)
                self.bn1 = nn.BatchNorm2D(ch, momentum=0.9, epsilon=1e-5)
                self.conv2 = nn.Conv2D(ch, 2 * ch, 3, padding=1)
                self.bn2 = nn.BatchNorm2D(2 * ch, momentum=0.9, epsilon=1e-5)
                self.fc = nn.Linear(2 * ch * (h // 4) * (w // 4), spec.num_classes)

            def forward(self, x: Any) -> Any:
                x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
                x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
                return self.fc(x.reshape([x.shape[0], -1]))

        return CNN()

    class EmbBag(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(spec.vocab, spec.hidden)
            self.norm = nn.LayerNorm(spec.hidden, epsilon=1e-5)
            self.fc = nn.Linear(spec.hidden, spec.num_classes)

        def forward(self, x: Any) -> Any:
            return self.fc(self.norm(self.emb(x.astype(paddle.int64)).mean(1)))

    return EmbBag()


def _loss(spec: ModelSpec, out: Any, y: Any, bias: Any = None) -> Any:
    """MSE, or cross-entropy over the last dimension with -100 targets ignored (the torch centers' loss)."""
    import paddle
    from paddle.nn import functional as F

    out = out[0] if isinstance(out, tuple | list) else out
    if spec.loss == "mse":
        return ((out - y.reshape(out.shape)) ** 2).mean()
    if bias is not None:
        out = out + bias
    logits = out.reshape([-1, out.shape[-1]])
    t = y.reshape([-1])
    keep = t != -100
    logp = F.log_softmax(logits, -1)
    nll = -paddle.take_along_axis(logp, paddle.where(keep, t, paddle.zeros_like(t)).unsqueeze(1), 1).squeeze(1)
    w = keep.astype(logp.dtype)
    return (nll * w).sum() / paddle.clip(w.sum(), min=1.0)


class _Paddle(Framework):
    """PaddlePaddle for :mod:`._foreign`: dynamic graph on CPU, ``paddle.nn.Layer``."""

    name = "paddle"
    model_type = "paddle.nn.Layer"

    biased_running_var = True

    def seed(self, seed: int) -> None:
        import paddle

        paddle.set_device("cpu")
        paddle.seed(seed)

    def build(self, spec: ModelSpec) -> Any:
        return _built_in(spec)

    def check_model(self, model: Any) -> bool:
        from paddle import nn

        return isinstance(model, nn.Layer)

    def tensors(self, model: Any) -> list[TensorInfo]:
        import paddle

        kinds = {name: type(layer).__name__ for name, layer in model.named_sublayers(include_self=True)}
        return [TensorInfo(k, tuple(v.shape), kinds.get(k.rpartition(".")[0], ""))
                for k, v in model.state_dict().items() if paddle.is_floating_point(v)]

    def state(self, model: Any) -> dict[str, np.ndarray]:
        return {k: np.array(v.numpy(), dtype=np.float32) for k, v in model.state_dict().items()}

    def load(self, model: Any, params: Mapping[str, np.ndarray]) -> None:
        load_checked(model.state_dict(), params, "Paddle model", lambda v, a: v.set_value(a))

    def forward(self, model: Any, x: np.ndarray) -> np.ndarray:
        import paddle

        model.eval()
        with paddle.no_grad():
            return first_np(model(paddle.to_tensor(np.ascontiguousarray(x))))

    def hook_outputs(self, model: Any, paths: Iterable[str], out: dict[str, np.ndarray]) -> Any:
        return recording_hooks(dict(model.named_sublayers(include_self=True)), paths, out,
                               lambda layer, h: layer.register_forward_post_hook(h))

    def norms(self, model: Any) -> dict[str, tuple[float | None, float | None]]:
        return norm_settings(model.named_sublayers(include_self=True), "_momentum", ("_epsilon",))

    def train_steps(self, trainer: ForeignTrainer, steps: int, round_idx: int, proximal_mu: float) -> list[float]:
        import paddle

        model = trainer.model
        model.train()
        trainable = [p for p in model.parameters() if not p.stop_gradient]
        anchors = [p.detach().clone() for p in trainable] if proximal_mu > 0 else []
        # torch's SGD: buf = momentum * buf + g (buf = g at the first step), p -= lr * buf; fresh each round
        opt = paddle.optimizer.Momentum(learning_rate=trainer.lr_at(round_idx), momentum=trainer.momentum,
                                        parameters=trainable)
        prior = trainer.logit_bias()
        bias = None if prior is None else paddle.to_tensor(prior)
        losses = []
        for idx in trainer.batches(steps, round_idx):
            xb = paddle.to_tensor(np.ascontiguousarray(trainer.x[idx]))
            yb = paddle.to_tensor(trainer.labels(idx))
            before = trainer.running_vars()
            data = _loss(trainer.model_spec, model(xb), yb, bias)
            loss = data
            if anchors:
                loss = loss + 0.5 * proximal_mu * paddle.add_n([((p - a) ** 2).sum()
                                                                 for p, a in zip(trainable, anchors)])
            loss.backward()
            opt.step()
            opt.clear_grad()
            trainer.unbias(before, len(idx))
            losses.append(float(data.numpy()))
        return losses


#: PaddlePaddle's :class:`._foreign.Framework`
PADDLE = _Paddle()
