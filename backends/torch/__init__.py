"""Execute a synchronous :class:`~polyparallel.strategy.Strategy` with torch.distributed.

:func:`train` checks that the plan is one this backend can run exactly (refusing it before any
process starts otherwise), launches ``dp * sp * tp * pp`` worker processes on this machine with torch's
elastic launcher, and returns the per-step loss and step time that rank 0 logged.
"""

from __future__ import annotations

from polyparallel.backends.torch._launch import MultiNode, TrainError, launch_commands, node_layout, train
from polyparallel.backends.torch._plan import ExecPlan, Unsupported, plan_for
from polyparallel.backends.torch._tensor_parallel import FingerprintMismatch

__all__ = ["ExecPlan", "FingerprintMismatch", "MultiNode", "TrainError", "Unsupported", "launch_commands",
           "node_layout", "plan_for", "train"]
