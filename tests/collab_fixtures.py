"""Small federations shared by the collaborative-training tests: random center data and a job config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec

# the tests' model: an MLP over 6 features into 3 classes
SPEC = ModelSpec("mlp", (6,), 3, hidden=8)


def random_data(names: Sequence[str], n: int = 48, *, seed: int, grow: int) -> dict[str, tuple[Any, Any]]:
    """Per center, ``n + grow·i`` random rows and labels (center ``i``): unequal sample counts."""
    rng = np.random.default_rng(seed)
    return {c: (rng.normal(size=(n + grow * i, 6)).astype(np.float32), rng.integers(0, 3, n + grow * i))
            for i, c in enumerate(names)}


def mlp_config(names: Sequence[str], **kw: Any) -> CollabConfig:
    """A two-round job over ``names`` training :data:`SPEC` (3 local steps of 16, lr 0.1); ``kw`` overrides."""
    return CollabConfig(centers=tuple(CenterSpec(n) for n in names), model=SPEC,
                        **{"rounds": 2, "local_steps": 3, "batch_size": 16, "lr": 0.1, "round_timeout_s": 90, **kw})


def perturbed_state(spec: ModelSpec, seed: int = 0) -> dict[str, Any]:
    """A torch state of ``spec`` with non-default values everywhere (BatchNorm statistics, norm scales), so a
    parameter map that swaps or drops a tensor shows."""
    from polyparallel.backends.collab import build_torch_model, torch_state

    rng = np.random.default_rng(seed)
    sd = {k: v + rng.normal(scale=0.2, size=v.shape).astype(np.float32)
          for k, v in torch_state(build_torch_model(spec, seed=1)).items()}
    return {k: (np.abs(v) + 0.5 if "running_var" in k else v) for k, v in sd.items()}
