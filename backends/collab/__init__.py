"""Cross-center collaborative training: centers train locally, a server fuses, round after round.

Two engines run the same round logic (:mod:`._center`, :mod:`._server`): an in-process one for
tests and as the reference, and a Flower deployment (SuperLink + one SuperNode per center) in
:mod:`._flower`. Centers train in PyTorch, MindSpore, PaddlePaddle or TensorFlow; parameters cross as
numpy arrays under torch names (:mod:`._foreign` infers and checks each framework's name-and-layout
map; :func:`import_frameworks` imports several in the one order they share a process).

Examples:
    >>> import numpy as np
    >>> from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, collaborate
    >>> cfg = CollabConfig(centers=(CenterSpec("a"), CenterSpec("b")),
    ...                    model=ModelSpec("mlp", (4,), 2, hidden=8), rounds=2, local_steps=3)
    >>> rng = np.random.default_rng(0)
    >>> data = {c: (rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 2, 40)) for c in "ab"}
    >>> res = collaborate(cfg, data)
    >>> [r.accepted for r in res.rounds]
    [('a', 'b'), ('a', 'b')]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._center import (
    LocalTrainer,
    TorchTrainer,
    batch_indices,
    center_evaluate,
    center_round,
    evaluate_torch,
    label_log_prior,
    load_center_data,
    split_holdout,
)
from ._config import FRAMEWORKS, CenterSpec, CollabConfig, config_from_strategy
from ._engine import CollabResult, initial_params, run_inprocess
from ._flower import run_flower
from ._foreign import IMPORT_ORDER, ForeignTrainer, import_frameworks
from ._fusion import (
    FUSIONS,
    CenteredClip,
    CenterUpdate,
    DiLoCo,
    FedAdam,
    FedAvg,
    FedProx,
    FedYogi,
    FusionStrategy,
    Median,
    MultiKrum,
    Scaffold,
    TrimmedMean,
    is_statistic,
    make_fusion,
)
from ._models import (
    LOSSES,
    MODEL_BUILDERS,
    MODEL_KINDS,
    ModelSpec,
    build_model,
    build_torch_model,
    load_torch_state,
    torch_state,
)
from ._objective import TorchObjective
from ._server import CenterReply, FederationServer, RoundRecord, TimingLog, aggregate_evaluations
from ._trainers import TRAINERS, make_trainer
from ._wire import COMPRESSIONS, check_payload, decode_update, encode_update, payload_nbytes

__all__ = [
    "COMPRESSIONS",
    "FRAMEWORKS",
    "FUSIONS",
    "IMPORT_ORDER",
    "LOSSES",
    "MODEL_BUILDERS",
    "MODEL_KINDS",
    "TRAINERS",
    "CenterReply",
    "CenterSpec",
    "CenterUpdate",
    "CenteredClip",
    "CollabConfig",
    "CollabResult",
    "DiLoCo",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FederationServer",
    "ForeignTrainer",
    "FusionStrategy",
    "LocalTrainer",
    "Median",
    "ModelSpec",
    "MultiKrum",
    "RoundRecord",
    "Scaffold",
    "TimingLog",
    "TorchObjective",
    "TorchTrainer",
    "TrimmedMean",
    "aggregate_evaluations",
    "batch_indices",
    "build_model",
    "build_torch_model",
    "center_evaluate",
    "center_round",
    "check_payload",
    "collaborate",
    "config_from_strategy",
    "decode_update",
    "encode_update",
    "evaluate_torch",
    "import_frameworks",
    "initial_params",
    "is_statistic",
    "label_log_prior",
    "load_center_data",
    "load_torch_state",
    "make_fusion",
    "make_trainer",
    "payload_nbytes",
    "run_inprocess",
    "split_holdout",
    "torch_state",
]


def collaborate(config: CollabConfig, data: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None, *,
                engine: str = "inprocess", **options: Any) -> CollabResult:
    """Train ``config.model`` collaboratively over ``config.centers``.

    Args:
        config: the job (centers, model and loss, fusion, rounds, local steps, compression, holdout).
        data: center name -> ``(x, y)``; each center only ever sees its own pair. A center with a data
            source (``CenterSpec(data="package.module:function")``) loads its own and is left out here.
        engine: ``inprocess`` (no networking) or ``flower`` (SuperLink and one SuperNode process per
            center on 127.0.0.1).
        options: passed to :func:`run_inprocess` or :func:`~._flower.run_flower`.
    """
    if engine == "inprocess":
        return run_inprocess(config, data, **options)
    if engine == "flower":
        return run_flower(config, data, **options)
    raise ValueError(f"unknown engine {engine!r}; use 'inprocess' or 'flower'")
