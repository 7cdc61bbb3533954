"""``python -m polyparallel.backends.torch._agent ARGS``: ``python -m torch.distributed.run ARGS``,
made to die with the ``train()`` process that started it (see :mod:`._procs`).

The elastic agent's workers inherit ``POLYPARALLEL_AGENT_PID`` and set the same death signal
(:mod:`._entry`), so a killed ``train()`` takes agent and workers with it.
"""

from __future__ import annotations

import os
import runpy
import sys

from polyparallel.backends.torch._procs import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_parent

if __name__ == "__main__":
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    sys.argv = ["torch.distributed.run", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
