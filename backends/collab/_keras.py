"""TensorFlow centers (``tensorflow-cpu``, Keras 3, eager): the built-in models and parameter I/O.

The map to the federation's torch names is inferred and checked by :mod:`._foreign`, as for every
framework. A Keras model's tensors are named by the attribute path of their layer (``conv1.kernel``;
``0.kernel`` ... inside a ``Sequential``), as torch names its modules. What Keras does differently:

=================  ======================  ==================================  ==================
torch layer        torch tensor            Keras variable                      layout
=================  ======================  ==================================  ==================
Linear             weight [out, in], bias  Dense ``kernel`` **[in, out]**       transposed (1, 0)
Conv2d             weight [o, i, kh, kw]   Conv2D ``kernel`` **[kh, kw, i, o]** (2, 3, 1, 0)
BatchNorm2d        weight, bias            ``gamma``, ``beta``                 same
                   running_mean/var        ``moving_mean``/``moving_variance`` same
LayerNorm          weight, bias            ``gamma``, ``beta``                 same
Embedding          weight [vocab, dim]     ``embeddings`` [vocab, dim]         same
=================  ======================  ==================================  ==================

Keras convolves channels-last: the built-in CNN takes the federation's NCHW rows, transposes them to
NHWC for its convolutions and back to NCHW before flattening, so the dense layer after it sees torch's
feature order (a user model must do the same, or the check before round 1 names the dense layer).
``BatchNormalization(momentum=0.9, epsilon=1e-5)`` is torch's BatchNorm2d (Keras: 0.99, 1e-3), and
``LayerNormalization(epsilon=1e-5)`` torch's LayerNorm. It updates its moving variance with the biased
batch variance (torch: unbiased), as Paddle does; the center corrects it after every step (see :mod:`._paddle`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from ._foreign import ForeignTrainer, Framework, build_foreign_model, first_np, load_checked, norm_settings
from ._models import ModelSpec
from ._param_map import TensorInfo

__all__ = ["TENSORFLOW", "build_keras_model", "keras_variables"]


def _keras() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow  # noqa: F401  (the backend, imported in its place in the safe order)

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"TensorFlow centers need Keras on its TensorFlow backend; KERAS_BACKEND is "
                         f"{keras.backend.backend()!r}: unset it or set KERAS_BACKEND=tensorflow")
    return keras


def build_keras_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The ``keras.Model`` of ``spec`` (the builder in ``MODEL_BUILDERS``), initialised from ``seed`` and
    built on a zero row of ``spec.in_shape`` (when the spec gives one)."""
    sample = np.zeros((1, *spec.in_shape), dtype=np.float32) if spec.in_shape else None
    return build_foreign_model(spec, "tensorflow", seed, sample)


def _built_in(spec: ModelSpec) -> Any:
    keras = _keras()
    from keras import layers, ops

    if spec.norm != "batch":
        raise ValueError(f"TensorFlow centers build the {spec.kind} with BatchNorm only (norm={spec.norm!r}); use "
                         "norm='batch' or torch centers")
    if spec.kind == "mlp":
        class MLP(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = layers.Dense(spec.hidden)
                self.norm = layers.LayerNormalization(epsilon=1e-5)
                self.fc2 = layers.Dense(spec.num_classes)

            def call(self, x: Any, training: bool = False) -> Any:
                x = ops.reshape(x, (ops.shape(x)[0], -1))
                return self.fc2(ops.relu(self.norm(self.fc1(x))))

        return MLP()
    if spec.kind == "cnn":
        ch = spec.hidden

        class CNN(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = layers.Conv2D(ch, 3, padding="same")
                self.bn1 = layers.BatchNormalization(momentum=0.9, epsilon=1e-5)
                self.conv2 = layers.Conv2D(2 * ch, 3, padding="same")
                self.bn2 = layers.BatchNormalization(momentum=0.9, epsilon=1e-5)
                self.pool = layers.MaxPooling2D(2)
                self.fc = layers.Dense(spec.num_classes)

            def call(self, x: Any, training: bool = False) -> Any:
                x = ops.transpose(x, (0, 2, 3, 1))  # the federation's NCHW rows, convolved channels-last
                x = self.pool(ops.relu(self.bn1(self.conv1(x), training=training)))
                x = self.pool(ops.relu(self.bn2(self.conv2(x), training=training)))
                x = ops.transpose(x, (0, 3, 1, 2))  # back to NCHW: the dense layer sees torch's feature order
                return self.fc(ops.reshape(x, (ops.shape(x)[0], -1)))

        return CNN()

    class EmbBag(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.emb = layers.Embedding(spec.vocab, spec.hidden)
            self.norm = layers.LayerNormalization(epsilon=1e-5)
            self.fc = layers.Dense(spec.num_classes)

        def call(self, x: Any, training: bool = False) -> Any:
            return self.fc(self.norm(ops.mean(self.emb(ops.cast(x, "int32")), axis=1)))

    return EmbBag()


def _named_layers(layer: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(attribute path, layer)`` of ``layer`` and every layer inside it, in assignment order (a
    ``Sequential``'s layers, and a list attribute's, by their index)."""
    import keras

    out = [(prefix, layer)]
    if isinstance(layer, keras.Sequential):
        children = [(str(i), c) for i, c in enumerate(layer.layers)]
    else:
        children = []
        for k, v in vars(layer).items():
            if k.startswith("_"):
                continue
            if isinstance(v, keras.layers.Layer):
                children.append((k, v))
            elif isinstance(v, list | tuple):
                children += [(f"{k}.{i}", c) for i, c in enumerate(v) if isinstance(c, keras.layers.Layer)]
    for name, child in children:
        out += _named_layers(child, f"{prefix}.{name}" if prefix else name)
    return out


def keras_variables(model: Any) -> list[tuple[str, Any, str]]:
    """``(name, variable, owning layer type)`` of every variable of ``model``, named ``<layer path>.<leaf>``
    (each variable under the innermost layer that holds it)."""
    named = _named_layers(model)
    seen: set[int] = set()
    out: list[tuple[str, Any, str]] = []
    for path, layer in reversed(named):  # innermost first, so a variable belongs to its own layer
        own = [v for v in layer.weights if id(v) not in seen]
        seen.update(id(v) for v in own)
        out = [(f"{path}.{v.name}" if path else v.name, v, type(layer).__name__) for v in own] + out
    return out  # a layer's own variables, then its children's, in assignment order


class _TensorFlow(Framework):
    """TensorFlow / Keras 3 for :mod:`._foreign`: eager, ``keras.Model``."""

    name = "tensorflow"
    model_type = "keras.Model (or keras.layers.Layer)"

    biased_running_var = True

    def seed(self, seed: int) -> None:
        _keras().utils.set_random_seed(seed)

    def build(self, spec: ModelSpec) -> Any:
        return _built_in(spec)

    def check_model(self, model: Any) -> bool:
        return isinstance(model, _keras().layers.Layer)

    def ready(self, model: Any, sample: np.ndarray | None) -> Any:
        if not model.built or not model.weights:
            if sample is None:
                raise ValueError("a Keras model must be built before its parameters can be mapped: build it in its "
                                 "builder (model.build(shape) or a call on a sample) or give the spec its in_shape")
            model(np.ascontiguousarray(sample[:1]), training=False)
        return model

    def tensors(self, model: Any) -> list[TensorInfo]:
        return [TensorInfo(n, tuple(int(d) for d in v.shape), kind) for n, v, kind in keras_variables(model)
                if "float" in str(v.dtype)]

    def state(self, model: Any) -> dict[str, np.ndarray]:
        return {n: np.array(v.numpy(), dtype=np.float32) for n, v, _ in keras_variables(model)}

    def load(self, model: Any, params: Mapping[str, np.ndarray]) -> None:
        load_checked({n: v for n, v, _ in keras_variables(model)}, params, "Keras model", lambda v, a: v.assign(a))

    def forward(self, model: Any, x: np.ndarray) -> np.ndarray:
        return first_np(model(np.ascontiguousarray(x), training=False))

    @contextmanager
    def hook_outputs(self, model: Any, paths: Iterable[str], out: dict[str, np.ndarray]) -> Iterator[None]:
        layers = dict(_named_layers(model))
        wrapped = []
        for p in paths:
            layer = layers.get(p)
            if layer is None or layer is model:
                continue
            call = layer.call

            def record(*args: Any, _call: Any = call, _p: str = p, **kwargs: Any) -> Any:
                o = _call(*args, **kwargs)
                out.setdefault(_p, first_np(o))
                return o

            object.__setattr__(layer, "call", record)  # an instance attribute over the class's call
            wrapped.append(layer)
        try:
            yield
        finally:
            for layer in wrapped:
                object.__delattr__(layer, "call")

    def norms(self, model: Any) -> dict[str, tuple[float | None, float | None]]:
        return norm_settings(_named_layers(model), "momentum", ("epsilon",))

    def train_steps(self, trainer: ForeignTrainer, steps: int, round_idx: int, proximal_mu: float) -> list[float]:
        import tensorflow as tf

        model = trainer.model
        spec = trainer.model_spec
        trainable = model.trainable_variables
        anchors = [tf.identity(v) for v in trainable] if proximal_mu > 0 else []
        lr, mom = trainer.lr_at(round_idx), trainer.momentum
        bufs: list[Any] = [None] * len(trainable)  # torch's SGD: buf = mom * buf + g (g first), p -= lr * buf
        prior = trainer.logit_bias()
        bias = None if prior is None else tf.constant(prior, dtype=tf.float32)
        losses = []
        for idx in trainer.batches(steps, round_idx):
            xb = tf.constant(np.ascontiguousarray(trainer.x[idx]))
            yb = tf.constant(trainer.labels(idx))
            before = trainer.running_vars()
            with tf.GradientTape() as tape:
                data = _loss(spec, model(xb, training=True), yb, bias)
                loss = data
                if anchors:
                    loss = loss + 0.5 * proximal_mu * tf.add_n([tf.reduce_sum((v - a) ** 2)
                                                                for v, a in zip(trainable, anchors)])
            grads = tape.gradient(loss, trainable)
            for i, (v, g) in enumerate(zip(trainable, grads)):
                if g is None:
                    continue
                bufs[i] = g if bufs[i] is None or not mom else mom * bufs[i] + g
                v.assign_sub(lr * bufs[i])
            trainer.unbias(before, len(idx))
            losses.append(float(data.numpy()))
        return losses


def _loss(spec: ModelSpec, out: Any, y: Any, bias: Any = None) -> Any:
    """MSE, or cross-entropy over the last dimension with -100 targets ignored (the torch centers' loss)."""
    import tensorflow as tf

    out = out[0] if isinstance(out, tuple | list) else out
    if spec.loss == "mse":
        return tf.reduce_mean((out - tf.reshape(y, tf.shape(out))) ** 2)
    if bias is not None:
        out = out + bias
    logits = tf.reshape(out, (-1, out.shape[-1]))
    t = tf.reshape(y, (-1,))
    keep = t != -100
    logp = tf.nn.log_softmax(logits, -1)
    nll = -tf.gather(logp, tf.where(keep, t, tf.zeros_like(t)), axis=1, batch_dims=1)
    w = tf.cast(keep, logp.dtype)
    return tf.reduce_sum(nll * w) / tf.maximum(tf.reduce_sum(w), 1.0)


#: TensorFlow's :class:`._foreign.Framework`
TENSORFLOW = _TensorFlow()
