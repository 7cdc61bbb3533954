"""Execute a synchronous :class:`~polyparallel.strategy.Strategy` with torch.distributed.

:func:`train` checks that the plan is one this backend can run exactly (refusing it before any
process starts otherwise), launches ``dp * sp * tp * pp`` worker processes on this machine with torch's
elastic launcher, and returns the per-step loss and step time that rank 0 logged.

The names are loaded on first use: the agent and worker processes import this package on their
way to :mod:`._agent` / :mod:`._entry` and should not pay for the planner's checks (~3 s on 2 cores).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyparallel.backends.torch._launch import MultiNode, TrainError, launch_commands, node_layout, train
    from polyparallel.backends.torch._plan import ExecPlan, Unsupported, plan_for
    from polyparallel.backends.torch._tensor_parallel import FingerprintMismatch

_WHERE = {"MultiNode": "_launch", "TrainError": "_launch", "launch_commands": "_launch", "node_layout": "_launch",
          "train": "_launch", "ExecPlan": "_plan", "Unsupported": "_plan", "plan_for": "_plan",
          "FingerprintMismatch": "_tensor_parallel"}
__all__ = ["ExecPlan", "FingerprintMismatch", "MultiNode", "TrainError", "Unsupported", "launch_commands",
           "node_layout", "plan_for", "train"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
