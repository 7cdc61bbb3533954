"""What a torch center minimises and reports: the model's own loss, or cross-entropy / MSE on its output.

Detection rule (``loss="auto"``, the default; ``loss="model"`` requires the own loss), read once from
the signature of the model's ``forward``:

1. ``forward`` has a parameter named ``labels`` (Hugging Face style): the step calls
   ``model(x, labels=y)``;
2. otherwise ``forward`` takes a second parameter after the input (``forward(x, y)``): the step
   calls ``model(x, y)``;
3. otherwise the model has no loss of its own and ``auto`` uses ``cross_entropy``.

In cases 1 and 2 the return value is the loss: its ``.loss`` (an HF ``ModelOutput``), its ``"loss"``
entry (a dict), or the value itself when it is a scalar tensor. Anything else is an error naming
the fix (``loss="cross_entropy"`` computes the loss from ``model(x)`` instead).

``cross_entropy`` is taken over the last dimension of ``model(x)`` (the output's ``.logits`` for an
HF output, the first element of a tuple): ``(B, C)`` logits with ``(B,)`` labels, or next-token
``(B, S, V)`` logits with ``(B, S)`` labels; targets equal to ``-100`` are ignored. ``mse`` is
``mean((model(x) − y)²)``.

Evaluation (:func:`evaluate`) reports ``loss`` — the mean over batches weighted by each batch's
number of targets (labels other than ``-100``; rows for a classifier, elements for MSE), which is the
exact dataset mean for the built-in losses — and ``count``, that number. With integer labels of one
per example it adds ``accuracy`` (argmax of the last dimension), with integer labels per token
``perplexity = exp(loss)`` (and token ``accuracy``), whenever the model's output can be had without
labels (always, except for a ``forward(x, y)`` whose ``y`` has no default).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["TorchObjective", "evaluate", "label_tensor"]

IGNORE = -100


def label_tensor(y: np.ndarray, loss: str = "auto") -> Any:
    """The labels as torch: integers as int64 (class indices, token ids, ``-100``), else float32."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(y))
    if loss == "mse" or t.is_floating_point():
        return t.float()
    return t.long()


def _output(out: Any) -> Any:
    """The prediction tensor in what ``model(x)`` returned."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list):
        return out[0]
    return out


class TorchObjective:
    """The training loss of one model (see the module docstring for the detection rule).

    Args:
        model: the unwrapped module (its ``forward`` signature decides).
        loss: ``auto``, ``model``, ``cross_entropy`` or ``mse``.
    """

    def __init__(self, model: Any, loss: str = "auto") -> None:
        self.loss_name = loss
        self.own: str | None = None  # "labels": model(x, labels=y); "positional": model(x, y)
        self.logits_without_labels = True
        if loss in ("auto", "model"):
            try:
                params = list(inspect.signature(model.forward).parameters.values())
            except (TypeError, ValueError):
                params = []
            named = {p.name: p for p in params}
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if "labels" in named:
                self.own = "labels"
                self.logits_without_labels = named["labels"].default is not inspect.Parameter.empty
            elif len(positional) >= 2:
                self.own = "positional"
                self.logits_without_labels = positional[1].default is not inspect.Parameter.empty
            elif loss == "model":
                raise ValueError(f"loss='model': {type(model).__name__}.forward takes no labels, so it has no loss "
                                 "of its own; add a 'labels' parameter or use loss='cross_entropy' or 'mse'")
        self.kind = "own" if self.own else ("mse" if loss == "mse" else "cross_entropy")

    def __call__(self, net: Any, x: Any, y: Any, logit_bias: Any = None) -> Any:
        """The scalar loss of ``net`` (the model or its DDP wrapper) on one batch.

        ``logit_bias`` (the logit-adjusted loss) is added to the logits of ``cross_entropy``.
        """
        if self.own is not None:
            if logit_bias is not None:
                raise ValueError("logit_adjust adds to the logits inside cross-entropy; a model computing its own "
                                 "loss cannot take it: use loss='cross_entropy' or logit_adjust=0")
            out = net(x, labels=y) if self.own == "labels" else net(x, y)
            return self._own_loss(out)
        out = _output(net(x))
        return self.from_output(out, y, logit_bias)

    def from_output(self, out: Any, y: Any, logit_bias: Any = None) -> Any:
        """``cross_entropy`` or ``mse`` of the prediction tensor ``out`` against ``y``."""
        import torch.nn.functional as F

        if self.kind == "mse":
            if out.shape != y.shape:
                if out.numel() != y.numel():
                    raise ValueError(f"mse: the model's output {tuple(out.shape)} and the targets {tuple(y.shape)} "
                                     "differ in size")
                y = y.reshape(out.shape)
            return F.mse_loss(out, y.to(out.dtype))
        if logit_bias is not None:
            out = out + logit_bias
        if out.dim() > 2:  # per-token logits: one class dimension, last
            return F.cross_entropy(out.flatten(0, -2), y.flatten(), ignore_index=IGNORE)
        return F.cross_entropy(out, y, ignore_index=IGNORE)

    def _own_loss(self, out: Any) -> Any:
        import torch

        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            loss = out
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            what = f"a {tuple(loss.shape)} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"the model's forward took labels but returned {what}, not a scalar loss: return the "
                             "loss (or an object with .loss) when labels are given, or set loss='cross_entropy' "
                             "(or 'mse') to compute it from model(x)")
        return loss

    def outputs(self, net: Any, x: Any) -> Any:
        """The prediction tensor ``model(x)``, or None when the model needs labels to run."""
        if not self.logits_without_labels:
            return None
        return _output(net(x))


def target_count(y: Any) -> int:
    """How many targets a batch's mean loss is over: labels other than -100, or every element of float targets."""
    if y.is_floating_point():
        return int(y.numel())
    return int((y != IGNORE).sum())


def evaluate(model: Any, objective: TorchObjective, x: np.ndarray, y: np.ndarray,
             batch: int = 2048) -> dict[str, float]:
    """Loss (target-weighted mean), ``count``, and ``accuracy`` / ``perplexity`` where they apply."""
    import torch

    y_np = np.asarray(y)
    classify = np.issubdtype(y_np.dtype, np.integer) and objective.kind != "mse"
    tokens = classify and y_np.ndim >= 2
    loss_sum, count, correct = 0.0, 0, 0
    with torch.no_grad():
        for s in range(0, len(x), batch):
            xb = torch.from_numpy(np.ascontiguousarray(x[s:s + batch]))
            yb = label_tensor(y_np[s:s + batch], objective.loss_name)
            n = target_count(yb)
            out = objective.outputs(model, xb) if classify else None
            if objective.own is None and out is not None:
                loss = objective.from_output(out, yb)  # one forward for loss and accuracy
            else:
                loss = objective(model, xb, yb)
            loss_sum += float(loss) * n
            count += n
            if out is not None:
                keep = yb != IGNORE
                correct += int(((out.argmax(-1) == yb) & keep).sum())
    res = {"loss": loss_sum / max(count, 1), "count": float(count)}
    if classify and objective.logits_without_labels:
        res["accuracy"] = correct / max(count, 1)
    if tokens:
        res["perplexity"] = math.exp(min(res["loss"], 700.0))
    return res
