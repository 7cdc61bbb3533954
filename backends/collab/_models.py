"""The shared model as one frozen :class:`ModelSpec` that every center builds itself.

The spec travels in the run configuration (JSON) instead of pickled code. It names either a
built-in kind or the user's own model as a ``"package.module:function"`` reference, the form
``polyparallel search`` and ``train`` take: the function returns an ``nn.Module`` (or
``(model, args, kwargs)``, whose first element is used), and is called right after
``torch.manual_seed(seed)``, so the server's initial model and every center's copy are the same.
Every process that trains or evaluates — the in-process engine, a Flower SuperNode's executor, a
data-parallel center's workers, the Flower ServerApp — imports the module itself, so it must be
importable there (the Flower engine passes ``PYTHONPATH`` down). The exchanged tensors are the
module's ``state_dict`` entries (floating parameters and buffers) under their own names.

Builders are looked up per framework (:data:`MODEL_BUILDERS`, :func:`build_model`): a torch center
builds with :func:`build_torch_model`, a MindSpore, PaddlePaddle or TensorFlow center with its
framework's builder (a user model's comes from ``ModelSpec.builder_for``: ``mindspore=`` or
``builders=``). Another framework is one more entry.

Built-in kinds — torch, MindSpore, Paddle and Keras centers build the *same architecture* and exchange
parameters through the map inferred in :mod:`._foreign` (attribute names are identical in every
framework on purpose):

- ``mlp``:    flatten → ``fc1`` Linear → ``norm`` LayerNorm → ReLU → ``fc2`` Linear
- ``cnn``:    ``conv1`` 3×3 → ``bn1`` → ReLU → maxpool 2 → ``conv2`` 3×3 → ``bn2`` → ReLU → maxpool 2
              → flatten → ``fc`` Linear  (the Fashion-MNIST model); with ``norm="group"`` the two
              normalisations are GroupNorm over groups of 4 channels (same names; no running
              statistics, so nothing depends on how skewed one center's batches are — the remedy
              for BatchNorm under label skew in Hsieh et al. 2020; torch centers only)
- ``embbag``: ``emb`` Embedding → mean over the sequence → ``norm`` LayerNorm → ``fc`` Linear
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field

from polyparallel.references import is_reference, resolve

from ._records import Pairs, config_record, record_data, record_from_json

__all__ = ["FOREIGN_FRAMEWORKS", "LOSSES", "MODEL_BUILDERS", "MODEL_KINDS", "ModelSpec", "build_model",
           "build_torch_model", "is_reference", "load_torch_state", "resolve_reference", "torch_state"]

MODEL_KINDS = ("mlp", "cnn", "embbag")

#: the frameworks a center may train in besides torch (each builds the model itself, ``_foreign``)
FOREIGN_FRAMEWORKS = ("mindspore", "paddle", "tensorflow")

#: ``auto``: the model's own loss when its forward takes labels (see :mod:`._objective`), else
#: ``cross_entropy``; ``model``: the model's own loss, required; ``cross_entropy`` over the last
#: dimension of the output (``-100`` targets ignored); ``mse``.
LOSSES = ("auto", "model", "cross_entropy", "mse")



def resolve_reference(ref: str, what: str = "model") -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (a string: it travels in the job), imported here."""
    if not is_reference(ref):
        raise ValueError(f"{what} {ref!r}: expected 'package.module:function'")
    return resolve(ref, what)


@config_record
class ModelSpec:
    """The shared model and its training loss.

    Args:
        kind: ``mlp``, ``cnn`` or ``embbag``, or the user's model as ``"package.module:function"``
            (see the module docstring; the remaining shape fields are then unused).
        in_shape: one example's shape: ``(features,)`` or ``(C, H, W)`` for ``mlp``, ``(C, H, W)``
            (H, W divisible by 4) for ``cnn``, ``(seq_len,)`` for ``embbag``.
        num_classes: output size.
        hidden: hidden width (``mlp``), channels of the first conv (``cnn``), embedding size (``embbag``).
        vocab: vocabulary size (``embbag`` only).
        norm: ``batch`` (BatchNorm) or ``group`` (GroupNorm, 4 channels per group) in ``cnn``.
        loss: one of :data:`LOSSES` (the built-in kinds are classifiers: ``auto`` or ``cross_entropy``).
        mindspore: for a user model, the same architecture as a ``mindspore.nn.Cell``:
            ``"package.module:function"`` returning the cell, which MindSpore centers build and map to
            the torch tensors (``_foreign``); empty: no MindSpore center can train it.
        builders: for a user model, its builder in other frameworks: ``(framework, "package.module:function")``
            pairs (a dict is accepted), e.g. ``{"paddle": "m:paddle_cnn", "tensorflow": "m:keras_cnn"}``
            returning a ``paddle.nn.Layer`` / ``keras.Model`` of the same architecture; a ``mindspore``
            entry is the same as ``mindspore=``. A framework without one cannot train the model.
    """

    kind: str
    in_shape: tuple[int, ...] = ()
    num_classes: int = 0
    hidden: int = 32
    vocab: int = 0
    norm: str = "batch"
    loss: str = "auto"
    mindspore: str = ""
    builders: Pairs[str] = Field((), exclude_if=lambda v: not v)  # none: the JSON of before they existed

    def builder_for(self, framework: str) -> str:
        """The user's builder of the model in ``framework`` (``""``: none given)."""
        return self.mindspore if framework == "mindspore" else dict(self.builders).get(framework, "")

    def _normalize_builders(self) -> None:
        b = dict(self.builders)
        ms = b.pop("mindspore", "")
        if ms and self.mindspore and ms != self.mindspore:
            raise ValueError(f"two MindSpore builders: mindspore={self.mindspore!r} and builders['mindspore']={ms!r}")
        if ms:
            object.__setattr__(self, "mindspore", ms)
        for fw, ref in b.items():
            if fw not in FOREIGN_FRAMEWORKS:
                raise ValueError(f"builder for framework {fw!r}: give one of {FOREIGN_FRAMEWORKS} (the torch model is "
                                 "the model itself)")
            if not is_reference(ref):
                raise ValueError(f"{fw} model {ref!r}: expected 'package.module:function' (a function returning the "
                                 "same architecture in that framework)")
        object.__setattr__(self, "builders", tuple(sorted(b.items())))

    @property
    def user(self) -> bool:
        """Whether this is the user's own model (a reference) rather than a built-in kind."""
        return self.kind not in MODEL_KINDS

    def __post_init__(self) -> None:
        self._normalize_builders()
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {LOSSES}")
        if self.user:
            if not is_reference(self.kind):
                raise ValueError(f"model {self.kind!r}: give one of {MODEL_KINDS} or the user's model as "
                                 "'package.module:function' (a function returning an nn.Module)")
            if self.norm != "batch":
                raise ValueError(f"norm {self.norm!r} applies to the built-in cnn; a user model "
                                 f"({self.kind!r}) chooses its own normalisation")
            if self.mindspore and not is_reference(self.mindspore):
                raise ValueError(f"MindSpore model {self.mindspore!r}: expected 'package.module:function' (a function "
                                 "returning a mindspore.nn.Cell)")
            return
        if self.mindspore:
            raise ValueError(f"the built-in {self.kind!r} has its MindSpore model already; mindspore="
                             f"{self.mindspore!r} is for a user model ('package.module:function')")
        if self.builders:
            raise ValueError(f"the built-in {self.kind!r} has its model in every framework already; builders "
                             f"{dict(self.builders)} are for a user model ('package.module:function')")
        if self.loss not in ("auto", "cross_entropy"):
            raise ValueError(f"the built-in {self.kind!r} is a classifier: loss 'auto' or 'cross_entropy' "
                             f"(loss {self.loss!r} needs a user model, 'package.module:function')")
        if self.kind == "cnn" and (len(self.in_shape) != 3 or self.in_shape[1] % 4 or self.in_shape[2] % 4):
            raise ValueError(f"cnn needs in_shape (C, H, W) with H, W divisible by 4, got {self.in_shape}")
        if self.kind == "embbag" and (len(self.in_shape) != 1 or self.vocab <= 0):
            raise ValueError("embbag needs in_shape (seq_len,) and vocab > 0")
        if self.norm not in ("batch", "group") or (self.norm == "group" and (self.kind != "cnn" or self.hidden % 4)):
            raise ValueError(f"norm {self.norm!r}: use 'batch', or 'group' for a cnn whose hidden is a multiple of 4")
        if self.num_classes <= 0 or self.hidden <= 0:
            raise ValueError("num_classes and hidden must be positive")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them (``builders`` left out when there are none, as before they existed)."""
        return record_data(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelSpec:
        return record_from_json(cls, text)


#: framework -> ``"module:function"`` of its builder ``(spec, seed) -> model`` (imported on first use,
#: so a torch-only process never imports MindSpore)
MODEL_BUILDERS: dict[str, str] = {
    "torch": "polyparallel.backends.collab._models:build_torch_model",
    "mindspore": "polyparallel.backends.collab._mindspore:build_mindspore_seeded",
    "paddle": "polyparallel.backends.collab._paddle:build_paddle_model",
    "tensorflow": "polyparallel.backends.collab._keras:build_keras_model",
}


def build_model(spec: ModelSpec, framework: str = "torch", seed: int = 0) -> Any:
    """The model of ``spec`` in ``framework``, initialised from ``seed`` (see :data:`MODEL_BUILDERS`)."""
    if framework not in MODEL_BUILDERS:
        raise ValueError(f"no model builder for framework {framework!r}; known: {sorted(MODEL_BUILDERS)}")
    return resolve_reference(MODEL_BUILDERS[framework], f"{framework} builder")(spec, seed)


def build_torch_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The torch ``nn.Module`` for ``spec``, initialised from ``seed``.

    A user model is the return value of its function called after ``torch.manual_seed(seed)`` (the
    first element when it returns ``(model, args, kwargs)``), in training mode.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if spec.user:
        out = resolve_reference(spec.kind)()
        model = out[0] if isinstance(out, tuple | list) and out else out
        if not isinstance(model, nn.Module):
            raise TypeError(f"model {spec.kind!r} returned a {type(model).__name__}; it must return a "
                            "torch.nn.Module or (module, args, kwargs)")
        return model.train()

    if spec.kind == "mlp":
        in_f = int(np.prod(spec.in_shape))

        class MLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = nn.Linear(in_f, spec.hidden)
                self.norm = nn.LayerNorm(spec.hidden)
                self.fc2 = nn.Linear(spec.hidden, spec.num_classes)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))

        return MLP()
    if spec.kind == "cnn":
        c, h, w = spec.in_shape
        ch = spec.hidden

        class CNN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(c, ch, 3, padding=1)
                self.bn1 = nn.BatchNorm2d(ch) if spec.norm == "batch" else nn.GroupNorm(ch // 4, ch)
                self.conv2 = nn.Conv2d(ch, 2 * ch, 3, padding=1)
                self.bn2 = nn.BatchNorm2d(2 * ch) if spec.norm == "batch" else nn.GroupNorm(ch // 2, 2 * ch)
                self.fc = nn.Linear(2 * ch * (h // 4) * (w // 4), spec.num_classes)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
                x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
                return self.fc(x.flatten(1))

        return CNN()

    class EmbBag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(spec.vocab, spec.hidden)
            self.norm = nn.LayerNorm(spec.hidden)
            self.fc = nn.Linear(spec.hidden, spec.num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(self.emb(x.long()).mean(1)))

    return EmbBag()


def torch_state(model: Any) -> dict[str, np.ndarray]:
    """The exchanged state of a torch model: every floating parameter and buffer, as float32 numpy.

    Integer buffers (BatchNorm's ``num_batches_tracked``) stay local: they count steps, they are not
    model state that fusion could average.
    """
    return {
        k: v.detach().cpu().numpy().astype(np.float32, copy=True)
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }


def load_torch_state(model: Any, params: dict[str, np.ndarray]) -> None:
    """Copy ``params`` (torch names) into ``model``; every exchanged tensor must be present."""
    import torch

    sd = model.state_dict()
    missing = [k for k, v in sd.items() if v.is_floating_point() and k not in params]
    if missing:
        raise KeyError(f"parameters missing for the torch model: {missing}")
    with torch.no_grad():
        for k, a in params.items():
            if k not in sd:
                raise KeyError(f"torch model has no tensor {k!r}")
            if tuple(sd[k].shape) != tuple(a.shape):
                raise ValueError(f"{k!r}: shape {tuple(a.shape)} does not fit the model's {tuple(sd[k].shape)}")
            sd[k].copy_(torch.from_numpy(np.ascontiguousarray(a)))
