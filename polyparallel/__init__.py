"""polyparallel: find how to parallelise deep-learning training, and run it.

Examples:
    >>> import torch, polyparallel as pp
    >>> g = pp.capture(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
    >>> g.param_count(), g.flops()
    (36, 136)
"""

from __future__ import annotations

import importlib
from typing import Any

from .backends.torch import executor as _torch_executor  # noqa: F401  (registers the planner's default executor)
from .cluster import Cluster
from .frontends import capture
from .ir import Graph, Op, OpKind, TensorSpec
from .strategy import Strategy

__version__ = "0.1.0"

__all__ = ["Cluster", "Constraints", "DoesNotFit", "Graph", "Op", "OpKind", "Strategy", "TensorSpec", "__version__",
           "capture", "collaborate", "evaluate", "export", "search", "simulate", "train"]


# The executors and the search import torch and the solvers; they load on first use, and
# ``pp.train`` / ``pp.collaborate`` / ``pp.search`` are then the functions themselves (real
# signatures and docstrings in ``help``).
_LAZY = {
    "search": ("polyparallel.planning", "search"),
    "evaluate": ("polyparallel.planning", "evaluate"),
    "Constraints": ("polyparallel.planning", "Constraints"),
    "DoesNotFit": ("polyparallel.planning", "DoesNotFit"),
    "train": ("polyparallel.backends.torch", "train"),
    "collaborate": ("polyparallel.backends.collab", "collaborate"),
    "export": ("polyparallel.backends.mindspore", "export"),
    "simulate": ("polyparallel.cost_models.collab_simulator", "simulate"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'polyparallel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
