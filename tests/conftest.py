"""Shared test configuration.

Hypothesis explores new random examples on every developer run; under CI (``CI`` set) it
replays a fixed sequence so a submission's result does not depend on the draw. Both still
compare against brute force, so both can fail.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import settings

# runs the tests start without a run directory of their own go to a temporary folder, not the checkout
os.environ.setdefault("POLYPARALLEL_RUNS", tempfile.mkdtemp(prefix="pp-test-runs-"))
# prices on `local-cpu` come from this machine's calibration when there is one
# (~/.cache/polyparallel/calibration.json): the tests price with the nominal figures a fresh clone
# has, so a developer's calibration changes no result; a test wanting one sets its own file
os.environ["POLYPARALLEL_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="pp-test-cal-"), "none.json")

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


#: files whose tests start Flower federations (a SuperLink, SuperNodes, center processes on loopback
#: ports). ``make test`` runs the suite on several pytest-xdist workers with ``--dist loadgroup``:
#: these run one after another on one worker, so two federations never race for a port picked
#: free a moment before it is bound, and the heartbeat and round-timeout tests keep the machine
#: share they were written for; every other test is scheduled on its own.
FEDERATION_FILES = frozenset({
    "test_collab_adversarial.py", "test_collab_center_plans.py", "test_collab_faults.py", "test_docs_examples.py",
    "test_collab_flower.py", "test_collab_fusion.py", "test_collab_mindspore_user_model.py",
    "test_collab_scaffold.py", "test_collab_security.py", "test_collab_user_model.py", "test_report.py",
})

#: files whose module-scoped fixture starts processes (gloo ranks): all their tests go to one worker, so the
#: fixture runs once instead of once on each worker, beside itself
ONE_WORKER_FILES = frozenset({"test_fsdp_as_priced.py"})


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """The ``loadgroup`` scheduler with the federation files as one group. xdist 3.8 marks a group
    by rewriting ``item._nodeid``, which pytest 9 no longer reads (a test's id is ``item._id``), so
    ``xdist_group`` marks are ignored; the scope is given here from the test's file instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _FederationsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0].rsplit("/", 1)[-1]
            if file in FEDERATION_FILES:
                return "federations"
            return file if file in ONE_WORKER_FILES else nodeid

    return _FederationsTogether(config, log)
