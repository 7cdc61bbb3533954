"""``flower-supernode`` with shorter fixed waits (an opt-in patch, not a Flower setting).

flwr 1.42's SuperNode loop sleeps a fixed 3 s whenever a pull from the SuperLink returns nothing,
0.5 s between checks for the ClientApp's reply, and retries an object that has not reached the
SuperLink yet after 1 s (doubling to 10 s); none is configurable. On a loopback federation these
are most of a round (see :mod:`._flwr_timing`). This launcher runs Flower's own ``flower_supernode``
entry point after replacing the ``time`` module *seen by* ``flwr.supernode.start_client_internal``
with one whose ``sleep`` is capped (``--poll-s`` for the idle pull, ``--wait-s`` for the reply
checks) and, with ``--pull-backoff-s``, shortening the object-pull back-off; nothing else changes.
The cost is more pull requests on an idle link (``1 / poll_s`` per second per center).

Usage: ``python -m polyparallel.backends.collab._supernode --poll-s 0.25 [--wait-s 0.02]
[--pull-backoff-s 0.02] -- <flower-supernode args>``
"""

from __future__ import annotations

import argparse
import sys
import time

from ._flwr_timing import capped_time, set_object_pull_backoff

__all__ = ["main"]


def main() -> None:
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit("usage: python -m polyparallel.backends.collab._supernode --poll-s SECONDS "
                         "[--wait-s SECONDS] [--pull-backoff-s SECONDS] -- ARGS...")
    cut = args.index("--")
    p = argparse.ArgumentParser(prog="polyparallel.backends.collab._supernode")
    p.add_argument("--poll-s", type=float, required=True, help="cap on the 3 s idle poll")
    p.add_argument("--wait-s", type=float, default=None, help="cap on the 0.5 s reply checks (default: --poll-s)")
    p.add_argument("--pull-backoff-s", type=float, default=None, help="first object-pull retry (Flower: 1 s)")
    a = p.parse_args(args[:cut])
    import flwr.supernode.start_client_internal as sci
    from flwr.supernode.cli import flower_supernode

    if getattr(sci, "time", None) is not time:
        raise RuntimeError("flwr.supernode.start_client_internal no longer uses the time module; this patch "
                           "is written for flwr 1.42")
    sci.time = capped_time(a.poll_s, a.poll_s if a.wait_s is None else a.wait_s)
    if a.pull_backoff_s:
        set_object_pull_backoff(a.pull_backoff_s)
    sys.argv = ["flower-supernode", *args[cut + 1:]]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
