"""``flower-superlink`` that accepts short node heartbeat intervals (an opt-in patch, not a Flower setting).

flwr 1.42's Fleet API refuses a heartbeat interval under ``HEARTBEAT_MIN_INTERVAL`` (10 s), and keeps
a node "online" for ``HEARTBEAT_PATIENCE`` (2) intervals after its last heartbeat; while it is online
the node's key cannot activate it again. So with Flower's limits a crashed center can rejoin 20 s
after its last heartbeat at the earliest (60 s at the SuperNodes' default 30 s). This launcher lowers
the floor to ``--min-heartbeat-s`` so that SuperNodes started with a short ``--heartbeat-s`` (see
:mod:`._supernode`) are accepted; nothing else changes.

Usage: ``python -m polyparallel.backends.collab._superlink --min-heartbeat-s 1 -- <flower-superlink args>``
"""

from __future__ import annotations

import sys

from ._supernode import split_argv

__all__ = ["main"]


def main() -> None:
    p, ours, theirs = split_argv("polyparallel.backends.collab._superlink", "--min-heartbeat-s SECONDS")
    p.add_argument("--min-heartbeat-s", type=float, required=True, help="lowest node heartbeat interval accepted")
    a = p.parse_args(ours)
    import flwr.superlink.servicer.fleet.fleet_handlers as fh
    from flwr.superlink.cli import flower_superlink

    if not hasattr(fh, "HEARTBEAT_MIN_INTERVAL"):
        raise RuntimeError("flwr's fleet handlers have no HEARTBEAT_MIN_INTERVAL; this patch is written for flwr 1.42")
    fh.HEARTBEAT_MIN_INTERVAL = a.min_heartbeat_s
    sys.argv = ["flower-superlink", *theirs]
    sys.exit(flower_superlink())


if __name__ == "__main__":
    main()
