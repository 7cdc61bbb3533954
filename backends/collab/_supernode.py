"""``flower-supernode`` with shorter fixed waits and a quick rejoin (opt-in patches, not Flower settings).

flwr 1.42's SuperNode loop sleeps a fixed 3 s whenever a pull from the SuperLink returns nothing,
0.5 s between checks for the ClientApp's reply, and retries an object that has not reached the
SuperLink yet after 1 s (doubling to 10 s); none is configurable. On a loopback federation these
are most of a round (see :mod:`._flwr_timing`). This launcher runs Flower's own ``flower_supernode``
entry point after replacing the ``time`` module *seen by* ``flwr.supernode.start_client_internal``
with one whose ``sleep`` is capped (``--poll-s`` for the idle pull, ``--wait-s`` for the reply
checks) and, with ``--pull-backoff-s``, shortening the object-pull back-off; nothing else changes.
The cost is more pull requests on an idle link (``1 / poll_s`` per second per center).

Rejoining after a crash (node authentication: a key is one node id at the SuperLink). A SuperNode
that dies without a goodbye stays "online" until ``HEARTBEAT_PATIENCE`` (2) heartbeat intervals pass
(Flower: a fixed 30 s interval, so 60 s), and until then the SuperLink refuses to activate the node
again — the restarted SuperNode exits with ``Failed to activate SuperNode``. ``--heartbeat-s`` sets
the interval this SuperNode announces and keeps (the SuperLink must accept it: see :mod:`._superlink`),
and ``--activate-wait-s`` retries that refusal (and only that one) for so many seconds instead of
exiting: a center restarted after a crash is back ``2 × heartbeat-s`` after its last heartbeat at most.

Usage: ``python -m polyparallel.backends.collab._supernode`` (or ``python PATH/_supernode.py``)
``--poll-s 0.25 [--wait-s 0.02] [--pull-backoff-s 0.02] [--heartbeat-s 2 --activate-wait-s 30] --
<flower-supernode args>``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

try:
    from ._flwr_timing import capped_time, set_object_pull_backoff
except ImportError:  # run as a file (what LoopbackFederation does: a faster start without the package)
    from _flwr_timing import capped_time, set_object_pull_backoff  # type: ignore[no-redef]

__all__ = ["main", "retry_activation", "set_node_heartbeat"]

_ACTIVATION_FAILED = 2004  # flwr.supercore.error.ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED (node still online)


def set_node_heartbeat(interval_s: float) -> None:
    """Announce and send node heartbeats every ``interval_s`` (Flower: 30 s) in this process."""
    import flwr.supercore.heartbeat as hb
    import flwr.supernode.fleet_http_connection as fhc

    for mod, names in ((fhc, ("HEARTBEAT_DEFAULT_INTERVAL",)), (hb, ("HEARTBEAT_DEFAULT_INTERVAL",
                                                                       "HEARTBEAT_CALL_TIMEOUT"))):
        if any(not hasattr(mod, n) for n in names):
            raise RuntimeError(f"{mod.__name__} lacks {names}; this patch is written for flwr 1.42")
    fhc.HEARTBEAT_DEFAULT_INTERVAL = hb.HEARTBEAT_DEFAULT_INTERVAL = interval_s
    # the sender waits (interval - call timeout) x ~0.8 between heartbeats: keep that positive
    hb.HEARTBEAT_CALL_TIMEOUT = min(hb.HEARTBEAT_CALL_TIMEOUT, interval_s / 4)


def retry_activation(wait_s: float, every_s: float = 0.25) -> None:
    """Retry ``ActivateNode`` for ``wait_s`` seconds while the SuperLink still holds this key's node
    online (a crashed predecessor whose heartbeats have not expired yet); any other error is raised."""
    import httpx
    from flwr.supercore.error import FlowerError
    from flwr.supernode.fleet_http_client import FleetHttpClient

    activate = FleetHttpClient.ActivateNode

    def patient(self: Any, request: Any) -> Any:
        end = time.monotonic() + wait_s
        while True:
            try:
                return activate(self, request)
            except httpx.HTTPStatusError as e:
                err = FlowerError.from_json(e.response.text)
                if err is None or int(err.code) != _ACTIVATION_FAILED or time.monotonic() > end:
                    raise
                print(f"node still online at the SuperLink; activation retried in {every_s} s", flush=True)
                time.sleep(every_s)

    FleetHttpClient.ActivateNode = patient  # type: ignore[method-assign]


def split_argv(module: str, usage: str) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """``sys.argv`` of a launcher ``python -m MODULE OURS -- FLOWERS``: a parser named after it, OURS, FLOWERS."""
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit(f"usage: python -m {module} {usage} -- ARGS...")
    cut = args.index("--")
    return argparse.ArgumentParser(prog=module), args[:cut], args[cut + 1:]


def main() -> None:
    p, ours, theirs = split_argv("polyparallel.backends.collab._supernode",
                                 "--poll-s SECONDS [--wait-s SECONDS] [--pull-backoff-s SECONDS]")
    p.add_argument("--poll-s", type=float, required=True, help="cap on the 3 s idle poll")
    p.add_argument("--wait-s", type=float, default=None, help="cap on the 0.5 s reply checks (default: --poll-s)")
    p.add_argument("--pull-backoff-s", type=float, default=None, help="first object-pull retry (Flower: 1 s)")
    p.add_argument("--heartbeat-s", type=float, default=None, help="node heartbeat interval (Flower: 30 s)")
    p.add_argument("--activate-wait-s", type=float, default=0.0,
                   help="retry activation this long while the node is still online at the SuperLink")
    a = p.parse_args(ours)
    import flwr.supernode.start_client_internal as sci
    from flwr.supernode.cli import flower_supernode

    if getattr(sci, "time", None) is not time:
        raise RuntimeError("flwr.supernode.start_client_internal no longer uses the time module; this patch "
                           "is written for flwr 1.42")
    sci.time = capped_time(a.poll_s, a.poll_s if a.wait_s is None else a.wait_s)
    if a.pull_backoff_s:
        set_object_pull_backoff(a.pull_backoff_s)
    if a.heartbeat_s:
        set_node_heartbeat(a.heartbeat_s)
    if a.activate_wait_s > 0:
        retry_activation(a.activate_wait_s)
    sys.argv = ["flower-supernode", *theirs]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
