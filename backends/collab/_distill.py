"""Knowledge distillation in the fine-tuning rounds after a pruning job's structural cut
(``PruneSpec.distill``, :mod:`._pruning`).

After the cut each torch center trains the smaller model on its own rows with the local loss

    ``(1 − a) · CE(student, y) + a · T² · KL(softmax(teacher / T) ‖ softmax(student / T))``

(Hinton et al. 2015: the ``T²`` keeps the soft term's gradient on the scale of the hard one's), the
KL averaged over the batch's rows. The teacher is a frozen copy of a fused model the center received,
kept in the center's memory (:func:`distill_teacher`): the first one after the cut (``cut``: the fused
model at the cut, which the masked full-size model before it computes too) or each round's
(``round``). Nothing leaves the center for it: no data, no logits, no scores. Classifiers only (the
model's output one row of class logits per input, the loss cross-entropy).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._models import load_torch_state
from ._objective import TorchObjective, _output

__all__ = ["Distill", "distill_loss", "distill_teacher"]


@dataclass(frozen=True)
class Distill:
    """A center's teacher for one round's local steps: the frozen ``model``, the weight ``a`` and ``T``."""

    model: Any
    weight: float
    temperature: float

    def loss(self, objective: TorchObjective, net: Any, x: Any, y: Any, bias: Any = None) -> tuple[Any, Any]:
        """``(the loss to backpropagate, the cross-entropy alone)`` of ``net`` on one batch."""
        import torch

        out = objective.outputs(net, x) if objective.kind == "cross_entropy" else None
        if out is None or out.dim() != 2:
            raise ValueError("distillation while fine-tuning (PruneSpec.distill) needs a classifier whose forward "
                             "returns (batch, classes) logits under cross_entropy; this model's loss is "
                             f"{objective.kind!r}" + ("" if out is None else f", its output {tuple(out.shape)}")
                             + ": set distill=0")
        ce = objective.from_output(out, y, bias)
        with torch.no_grad():
            teacher = _output(self.model(x))
        return distill_loss(out, teacher, ce, self.weight, self.temperature), ce


def distill_loss(student: Any, teacher: Any, ce: Any, weight: float, temperature: float) -> Any:
    """``(1 − a)·ce + a·T²·KL(softmax(teacher/T) ‖ softmax(student/T))``, the KL summed over the classes
    and averaged over the rows."""
    import torch.nn.functional as F

    t = temperature
    kl = F.kl_div(F.log_softmax(student / t, dim=-1), F.log_softmax(teacher.detach() / t, dim=-1),
                  reduction="batchmean", log_target=True)
    return (1.0 - weight) * ce + weight * t * t * kl


def distill_teacher(trainer: Any, global_params: Mapping[str, np.ndarray], spec: Any) -> Distill:
    """The center's teacher for this round (``spec`` a :class:`~._pruning.PruneSpec`), called once the
    center holds the cut model: a frozen copy of it, loaded with ``global_params`` the first time
    (``cut``: kept from then on) or every round (``round``), in eval mode (BatchNorm reads its running
    statistics). Kept in ``trainer.__dict__`` (the center's memory)."""
    teacher = trainer.__dict__.get("_pp_teacher")
    if teacher is None or spec.distill_teacher == "round":
        if teacher is None:
            teacher = copy.deepcopy(trainer._model)
            teacher.requires_grad_(False)
        load_torch_state(teacher, dict(global_params))
        teacher.eval()
        trainer.__dict__["_pp_teacher"] = teacher
    return Distill(teacher, float(spec.distill), float(spec.distill_temperature))
