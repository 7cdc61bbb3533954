"""``python -m polyparallel.backends.torch._entry RUN_DIR``: what torch.distributed.run starts per rank.

Kept apart from :mod:`._worker` so that the package import does not pre-load the module run as main.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

from polyparallel.backends.torch._worker import run_worker

if __name__ == "__main__":
    faulthandler.enable()  # a native abort still leaves a Python stack in the launcher output
    run_worker(Path(sys.argv[1]))
    # Done: the log and checkpoints are on disk, the process group is destroyed. Leave without the
    # interpreter's and C++'s exit-time teardown, where a native thread torch/gloo left joinable
    # intermittently aborts a finished rank ("terminate called without an active exception", no
    # Python frame: ~1 launch in 30 here, seen in CI). A failing rank raised above and exits normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
