"""Token-count weighting: the loss of a split batch equal to the loss of the whole batch.

A mean-reduced cross entropy (or NLL) with ignored targets (``ignore_index``, e.g. ``-100`` padding)
or class weights divides by the *count* of the targets it saw, ``c = Σ_valid w[target]`` (``w = 1``
without class weights). When the global batch is split over data-parallel ranks and micro-batches,
each part's mean ``L_p`` has its own count ``c_p``, and single-process training's loss is

    L = Σ_p L_p c_p / Σ_p c_p,

not the mean of the ``L_p`` (they differ whenever the counts differ). Megatron and torchtitan
normalise by the global count; the backends do too, without the model changing: the forward of
every part runs under :class:`TargetCount`, a ``TorchFunctionMode`` that sees the calls to
``F.cross_entropy`` / ``F.nll_loss`` (and their ATen ops, as an exported graph calls them) and
records each mean-reduced one's count from its actual arguments (``target``, ``weight``,
``ignore_index``; label smoothing does not change the count; class-probability targets count the
samples). A Hugging Face causal LM shifting its labels inside ``forward`` is counted on the shifted
labels, the ones its loss saw.

The weighting applies when exactly one mean-reduced cross entropy / NLL ran and the model returned
its output unchanged (:meth:`TargetCount.count_for`); otherwise (an MSE, a custom loss, two losses
added) the backends keep the mean of the parts' means, which is exact for equal shares of a loss
whose mean is over a fixed count, and say so in the step record (``loss_weighting``).

A part whose targets are all ignored has ``c = 0``; its mean would be ``0/0``, so that one call is
computed with ``reduction="sum"`` instead (``0``, with zero gradients), which is its share of the
global sum.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

__all__ = ["TargetCount", "weigh_microbatches", "weigh_replicas", "weighed_forward"]

_FUNCTIONS = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
_ATEN = {torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss.default,
         torch.ops.aten.nll_loss_nd.default, torch.ops.aten.nll_loss2d.default}
_MEAN, _SUM = 1, 2  # ATen's reduction enum


def _local(t: Any) -> Any:
    """The whole tensor of a DTensor (labels are replicated over tensor-parallel ranks)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _count(inp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """What the mean reduction divides by."""
    if target.is_floating_point():  # class probabilities: the mean is over the samples (and extra dims)
        classes = inp.shape[1] if inp.dim() > 1 else inp.shape[0]
        return torch.tensor(float(inp.numel() // classes), dtype=torch.float64)
    target = _local(target)
    valid = target != ignore_index
    if weight is None:
        return valid.sum().double()
    w = _local(weight)
    return (w[torch.where(valid, target, 0)] * valid).sum().double()


class TargetCount(TorchFunctionMode):
    """Records every mean-reduced cross entropy / NLL computed inside the block: its output and count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, float]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FUNCTIONS:
            bound = _FUNCTIONS[func].bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            if a.get("size_average") is not None or a.get("reduce") is not None:
                a["reduction"] = _reduction.legacy_get_string(a["size_average"], a["reduce"], emit_warning=False)
                a["size_average"] = a["reduce"] = None
            if a["reduction"] != "mean":
                return func(*args, **kwargs)
            count = float(_count(a["input"], a["target"], a["weight"], a["ignore_index"]))
            if count == 0:
                a["reduction"] = "sum"
                out = func(**a)
            else:
                out = func(*args, **kwargs)
        elif func in _ATEN:
            schema = func._schema.arguments
            full = [args[i] if i < len(args) else kwargs.get(s.name, s.default_value) for i, s in enumerate(schema)]
            names = [s.name for s in schema]
            r = names.index("reduction")
            if full[r] != _MEAN:
                return func(*args, **kwargs)
            count = float(_count(full[0], full[1], full[names.index("weight")], full[names.index("ignore_index")]))
            if count == 0:
                full[r] = _SUM
                out = func(*full)
            else:
                out = func(*args, **kwargs)
        else:
            return func(*args, **kwargs)
        self.seen.append((out, count))
        return out

    def count_for(self, loss: Any) -> float | None:
        """The count to weight ``loss`` with, or None when the mean of means must be kept: not exactly
        one mean-reduced cross entropy / NLL ran, or ``loss`` is not its output (a sum of losses, a
        scaled loss)."""
        if len(self.seen) != 1:
            return None
        out, count = self.seen[0]
        return count if loss is out else None


def weigh_replicas(loss: Any, count: float | None, group: Any, replicas: int,
                   device: torch.device) -> tuple[float, float, str]:
    """Combine the replicas' losses of one step (one all-reduce over ``group``, ``replicas`` ranks).

    ``count`` is this rank's :meth:`TargetCount.count_for`. Returns ``(scale, loss, weighting)``:
    backpropagating ``scale · loss`` on every rank, with the gradients averaged over the replicas
    as DDP and FSDP do, gives the gradient of the global-batch loss, which is the returned ``loss``.
    With ``weighting == "tokens"`` (every replica counted its targets, ``T = Σ_r c_r``) the scale
    is ``c_r · replicas / T`` and the loss ``Σ_r L_r c_r / T``; with ``"mean_of_means"`` the scale
    is 1 and the loss ``Σ_r L_r / replicas``. A global batch with no target left (``T = 0``) gives
    a NaN loss and no update.
    """
    val = float(_local(loss).detach())
    c = 0.0 if count is None else count
    stats = torch.tensor([c, float(count is not None), val * c, val], dtype=torch.float64, device=device)
    dist.all_reduce(stats, group=group)
    total, counted, weighted_sum, plain_sum = stats.tolist()
    if counted == replicas:
        if total == 0:
            return 0.0, float("nan"), "tokens"
        return c * replicas / total, weighted_sum / total, "tokens"
    return 1.0, plain_sum / replicas, "mean_of_means"


def weighed_forward(forward: Callable[[], Any], group: Any, replicas: int, device: torch.device
                    ) -> tuple[Any, float, str]:
    """One replica's ``forward()`` (its share of the batch), counted (:class:`TargetCount`) and weighed
    over the replicas (:func:`weigh_replicas`): ``(the loss to backpropagate, the whole batch's loss,
    the weighting)``."""
    counter = TargetCount()
    with counter:
        loss = forward()
    scale, whole, weighting = weigh_replicas(loss, counter.count_for(loss), group, replicas, device)
    return (loss if scale == 1.0 else loss * scale), whole, weighting


def weigh_microbatches(losses: list[Any], counts: list[float | None], microbatches: int, replicas: int,
                       device: torch.device, unit: float = 1.0) -> tuple[float, float, str]:
    """Combine the micro-batch losses of one pipeline step (one all-reduce over the whole world).

    On a last-stage rank ``losses`` are what the loss function returned per micro-batch (``L_j c_j``
    where ``counts[j] = c_j`` is known, ``L_j`` where it is None); other ranks pass empty lists. Each
    replica (``replicas`` of them) must contribute once: ranks that hold a copy of another's loss
    (tensor-parallel peers) pass empty lists too. The schedule scaled the gradients by
    ``1/microbatches`` and the replicas average theirs, so the returned ``factor`` multiplies every
    gradient (every stage, before the optimiser step) to give the gradient of the global-batch
    loss, which is the returned ``loss``: ``n / T`` and ``Σ L_j c_j / T`` with ``T = Σ c_j`` over
    the ``n = microbatches · replicas`` micro-batches when every one was counted (``"tokens"``),
    ``1`` and ``Σ L_j / n`` when none was (``"mean_of_means"``).

    A loss function may return ``L_j c_j / unit`` instead, ``unit`` a count typical of a micro-batch
    (its number of labels, the same on every rank): the backpropagated values then stay near the
    mean loss's scale rather than ``c_j`` times it, which fp16 gradients need to stay finite; the
    losses and the factor account for it.
    """
    counted = [c for c in counts if c is not None]
    stats = torch.tensor([sum(counted), len(counted), sum(float(v.detach()) for v in losses)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    total, n_counted, loss_sum = stats.tolist()
    n = microbatches * replicas
    if n_counted == n:
        return (n * unit / total, loss_sum * unit / total, "tokens") if total else (0.0, float("nan"), "tokens")
    if n_counted == 0:
        return 1.0, loss_sum / n, "mean_of_means"
    raise RuntimeError(f"{int(n_counted)} of {n} micro-batch losses were counted: the loss function computed "
                       "different losses for different micro-batches")
