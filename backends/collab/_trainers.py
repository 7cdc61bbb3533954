"""Which trainer a center runs: its framework's (:data:`TRAINERS`), one process or, for a torch center
with several devices, its plan over long-lived worker processes. Kept apart from :mod:`._center`
(the round logic every trainer shares), which the trainers build on."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._buffered import SlowTrainer
from ._center import LocalTrainer, TorchTrainer, split_holdout
from ._config import CollabConfig
from ._dp_center import PlannedTrainer
from ._foreign import ForeignTrainer
from ._param_map import DISPLAY

__all__ = ["TRAINERS", "make_trainer"]


def _torch_trainer(config: CollabConfig, center: str, x: np.ndarray, y: np.ndarray, kw: dict[str, Any]) -> Any:
    spec = config.center(center)
    if spec.devices > 1:
        return PlannedTrainer(config.model, x, y, devices=spec.devices, plan=dict(spec.plan),
                              timeout_s=config.round_timeout_s, **kw)
    return TorchTrainer(config.model, x, y, **kw)


def _foreign_trainer(config: CollabConfig, center: str, x: np.ndarray, y: np.ndarray, kw: dict[str, Any]) -> Any:
    """A MindSpore, Paddle or TensorFlow center (:class:`._foreign.ForeignTrainer`); a MindSpore center with
    several devices runs data parallelism over msrun ranks (:mod:`polyparallel.backends.collab._mindspore_dp`)."""
    spec = config.center(center)
    if spec.devices > 1 and spec.framework == "mindspore":  # data parallel over msrun ranks
        from polyparallel.backends.collab._mindspore_dp import MindSporeDataParallelTrainer

        return MindSporeDataParallelTrainer(config.model, x, y, devices=spec.devices, plan=dict(spec.plan),
                                            timeout_s=config.round_timeout_s, **kw)
    if spec.devices > 1:
        raise ValueError(f"center {center!r}: {DISPLAY[spec.framework]} centers train in one process; data "
                         f"parallelism inside a center ({spec.devices} devices) is implemented for torch and "
                         "MindSpore centers — set devices=1 or framework='torch'")
    return ForeignTrainer(config.model, x, y, framework=spec.framework, **kw)


#: framework -> its trainer factory ``(config, center, x, y, common options) -> LocalTrainer``
TRAINERS: dict[str, Any] = {"torch": _torch_trainer, "mindspore": _foreign_trainer, "paddle": _foreign_trainer,
                            "tensorflow": _foreign_trainer}


def make_trainer(config: CollabConfig, center: str, x: np.ndarray, y: np.ndarray) -> LocalTrainer:
    """The trainer for ``center`` in its declared framework (:data:`TRAINERS`), on its training rows.

    With ``config.holdout > 0`` the center's held-out rows (:func:`split_holdout`) go to
    ``trainer.holdout`` and are never trained on. A torch center with ``devices > 1`` runs its plan
    (``CenterSpec.plan``: DDP, FSDP2 or tensor parallelism; DDP when none is given) over that many
    long-lived worker processes (:class:`~._dp_center.PlannedTrainer`, same updates as one process up
    to rounding); close it with ``trainer.close()`` when done (the engines do).
    """
    spec = config.center(center)
    index = config.center_index(center)
    (x, y), held = split_holdout(x, y, config.holdout, config.seed, index)
    kw = dict(center_index=index, batch_size=config.batch_size, lr=config.lr,
              momentum=config.momentum, seed=config.seed, lr_schedule=config.lr_schedule, rounds=config.rounds,
              logit_adjust=config.logit_adjust)
    if spec.framework not in TRAINERS:
        raise ValueError(f"center {center!r}: no trainer for framework {spec.framework!r}; known: {sorted(TRAINERS)}")
    trainer = TRAINERS[spec.framework](config, center, x, y, kw)
    trainer.holdout = held
    if spec.slowdown > 1:  # an emulated slower site (CenterSpec.slowdown)
        return SlowTrainer(trainer, spec.slowdown)
    return trainer
