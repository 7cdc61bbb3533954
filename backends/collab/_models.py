"""Small models every center can build in its own framework from one frozen :class:`ModelSpec`.

The spec travels in the run configuration instead of pickled code, so a torch center and a
MindSpore center build the *same architecture* and exchange parameters through the explicit name
map in :mod:`._mindspore`. Attribute names are identical in both frameworks on purpose.

Kinds:

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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["MODEL_KINDS", "ModelSpec", "build_torch_model", "load_torch_state", "torch_state"]

MODEL_KINDS = ("mlp", "cnn", "embbag")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of the shared model.

    Args:
        kind: ``mlp``, ``cnn`` or ``embbag``.
        in_shape: one example's shape: ``(features,)`` or ``(C, H, W)`` for ``mlp``, ``(C, H, W)``
            (H, W divisible by 4) for ``cnn``, ``(seq_len,)`` for ``embbag``.
        num_classes: output size.
        hidden: hidden width (``mlp``), channels of the first conv (``cnn``), embedding size (``embbag``).
        vocab: vocabulary size (``embbag`` only).
        norm: ``batch`` (BatchNorm) or ``group`` (GroupNorm, 4 channels per group) in ``cnn``.
    """

    kind: str
    in_shape: tuple[int, ...]
    num_classes: int
    hidden: int = 32
    vocab: int = 0
    norm: str = "batch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_shape", tuple(int(d) for d in self.in_shape))
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"unknown model kind {self.kind!r}; choose one of {MODEL_KINDS}")
        if self.kind == "cnn" and (len(self.in_shape) != 3 or self.in_shape[1] % 4 or self.in_shape[2] % 4):
            raise ValueError(f"cnn needs in_shape (C, H, W) with H, W divisible by 4, got {self.in_shape}")
        if self.kind == "embbag" and (len(self.in_shape) != 1 or self.vocab <= 0):
            raise ValueError("embbag needs in_shape (seq_len,) and vocab > 0")
        if self.norm not in ("batch", "group") or (self.norm == "group" and (self.kind != "cnn" or self.hidden % 4)):
            raise ValueError(f"norm {self.norm!r}: use 'batch', or 'group' for a cnn whose hidden is a multiple of 4")
        if self.num_classes <= 0 or self.hidden <= 0:
            raise ValueError("num_classes and hidden must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        d = json.loads(text)
        return cls(**{**d, "in_shape": tuple(d["in_shape"])})


def build_torch_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The torch ``nn.Module`` for ``spec``, initialised from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

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
