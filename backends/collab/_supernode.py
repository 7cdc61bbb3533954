"""``flower-supernode`` with a shorter idle poll (an opt-in patch, not a Flower setting).

flwr 1.42's SuperNode loop sleeps a fixed 3 s whenever a pull from the SuperLink returns nothing, and
0.5 s between checks for the ClientApp's reply; neither is configurable. On a loopback federation
that is most of a round's latency: a model sent just after a pull waits up to 3 s before a center
sees it. This launcher runs Flower's own ``flower_supernode`` entry point after replacing the
``time`` module *seen by* ``flwr.supernode.start_client_internal`` with one whose ``sleep`` is capped
at ``--poll-s``; nothing else changes. The cost is more pull requests on an idle link
(``1 / poll_s`` per second per center).

Usage: ``python -m polyparallel.backends.collab._supernode --poll-s 0.1 -- <flower-supernode args>``
"""

from __future__ import annotations

import sys
import time
import types

__all__ = ["main"]


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--poll-s" or args[2] != "--":
        raise SystemExit("usage: python -m polyparallel.backends.collab._supernode --poll-s SECONDS -- ARGS...")
    cap = float(args[1])
    import flwr.supernode.start_client_internal as sci
    from flwr.supernode.cli import flower_supernode

    fast_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    fast_time.sleep = lambda s: time.sleep(min(s, cap))
    sci.time = fast_time
    sys.argv = ["flower-supernode", *args[3:]]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
