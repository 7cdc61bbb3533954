"""``python -m polyparallel.backends.torch._agent ARGS -m polyparallel.backends.torch._entry RUN_DIR``:
torch.distributed.run with these ARGS, dying with the ``train()`` process that started it
(:mod:`._procs`), and on Linux forking its ranks instead of starting a Python per rank.

A rank started as ``python -m ..._entry`` imports torch, torch.distributed, DTensor and, at its
first DDP/FSDP wrap, torch._dynamo again in every process (~4-5 s on 2 cores, the largest part of a
tiny run's launch). Here the agent imports them once, then has torch's elastic launcher fork the
ranks (``start_method="fork"``) and call :func:`._entry.main` in each: the agent has run no tensor
op and started no thread pool that a forked child would inherit, and CUDA is initialised only in
the ranks. Rendezvous, restarts, the failure summary and the per-rank environment are
torch.distributed.run's own. ``POLYPARALLEL_WORKER_START=exec`` (and any platform but Linux)
starts each rank with its own interpreter as torch.distributed.run does by default.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from polyparallel.backends.torch._procs import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_parent

WORKER_START_ENV = "POLYPARALLEL_WORKER_START"
# what every rank imports, imported once in the agent (the ranks inherit them through fork);
# DistributedDataParallel and fully_shard import torch._dynamo on first use
PRELOAD = ("polyparallel.backends.torch._worker", "polyparallel.backends.torch._plan",
           "polyparallel.backends.torch._tensor_parallel", "polyparallel.backends.torch._checkpoint",
           "polyparallel.backends.torch._entry", "torch._dynamo")


def _forking(config_from_args: Any) -> Any:
    """torch.distributed.run's ``config_from_args``, with the ranks forked to :func:`._entry.main`."""

    def config(args: Any) -> Any:
        cfg, cmd, cmd_args = config_from_args(args)
        if args.module and args.training_script == "polyparallel.backends.torch._entry":
            from polyparallel.backends.torch._entry import main

            cfg.start_method = "fork"
            return cfg, main, list(args.training_script_args)
        return cfg, cmd, cmd_args

    return config


if __name__ == "__main__":
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if sys.platform.startswith("linux") and os.environ.get(WORKER_START_ENV, "fork") == "fork":
        import importlib

        import torch.distributed.run as tdr

        for name in PRELOAD:
            importlib.import_module(name)
        tdr.config_from_args = _forking(tdr.config_from_args)
        tdr.main(sys.argv[1:])
    else:
        sys.argv = ["torch.distributed.run", *sys.argv[1:]]
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
