"""Shared test configuration.

Hypothesis explores new random examples on every developer run; under CI (``CI`` set) it
replays a fixed sequence so a submission's result does not depend on the draw. Both still
compare against brute force, so both can fail.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import settings

# runs the tests start without a run directory of their own go to a temporary folder, not the checkout
os.environ.setdefault("POLYPARALLEL_RUNS", tempfile.mkdtemp(prefix="pp-test-runs-"))

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
