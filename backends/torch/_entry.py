"""One rank of a run: :func:`main`, or ``python -m polyparallel.backends.torch._entry RUN_DIR``.

:mod:`._agent` forks the ranks from the elastic agent and calls :func:`main` (torch and the
worker's modules are imported once, in the agent); the module form is for a plain
``torchrun -m polyparallel.backends.torch._entry RUN_DIR``. Kept apart from :mod:`._worker` so
that the package import does not pre-load the module run as main. Before anything else, the rank
asks to be killed with its agent and records its PID in ``RUN_DIR/pids/`` (:mod:`._procs`), so
that no exit path of ``train()`` leaves it running.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

from polyparallel.backends.torch._procs import AGENT_PID_ENV, die_with_parent, record_pid


def main(run_dir: str) -> None:
    """Train this rank (``RANK`` and the rendezvous come from the environment, as torch's agent
    sets them) on ``RUN_DIR/job.pkl``."""
    agent = os.environ.get(AGENT_PID_ENV)
    die_with_parent(int(agent) if agent else None)
    record_pid(Path(run_dir), f"rank{os.environ.get('RANK', os.getpid())}")

    import torch

    from polyparallel.backends.torch._worker import run_worker

    # x86 float math on subnormal operands takes a microcode path 10-100x slower; a small GPT at
    # initialisation spends 4x longer in its backward for it. Flushed to zero, as XLA does on CPUs
    # (values under 1.2e-38 carry no training signal); the single-process reference does the same.
    torch.set_flush_denormal(True)
    faulthandler.enable()  # a native abort still leaves a Python stack in the launcher output
    run_worker(Path(run_dir))


if __name__ == "__main__":
    main(sys.argv[1])
    # Done: the log and checkpoints are on disk, the process group is destroyed. Leave without the
    # interpreter's and C++'s exit-time teardown, where a native thread torch/gloo left joinable
    # intermittently aborts a finished rank ("terminate called without an active exception", no
    # Python frame: ~1 launch in 30 here, seen in CI). A failing rank raised above and exits normally.
    # (A forked rank leaves through os._exit anyway: multiprocessing ends fork children that way.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
