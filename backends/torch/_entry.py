"""``python -m polyparallel.backends.torch._entry RUN_DIR``: what torch.distributed.run starts per rank.

Kept apart from :mod:`._worker` so that the package import does not pre-load the module run as main.
"""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

from polyparallel.backends.torch._worker import run_worker

if __name__ == "__main__":
    faulthandler.enable()  # a native abort still leaves a Python stack in the launcher output
    run_worker(Path(sys.argv[1]))
