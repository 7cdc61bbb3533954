"""Flower's fixed waits that dominate a loopback round, and the two process-local settings that shorten them.

Measured on flwr 1.42 (``benchmarks/collab.py``, HTTP request and ``sleep`` tracing of every process):
a round of a 1M-parameter model spent ~4 s quiet (11–13 s under load) with ~0.02 s of compute. Most
of it was not moving bytes but waiting:

1. **Object pull back-off.** A message travels as a tree of content-addressed objects (message,
   records, one object per array, 5 MB chunks). A receiver is told about a message before all of its
   objects have arrived at the sender's store (the SuperNode creates the ClientApp task *before* it
   pulls the objects from the SuperLink; the ServerApp sees a reply while its SuperNode is still
   pushing it), and then retries each missing object after ``PULL_INITIAL_BACKOFF`` = 1 s, doubling up
   to ``PULL_BACKOFF_CAP`` = 10 s. One miss costs ~1 s; under load, 1 + 2 + 4 s. This happens twice a
   round (center pulls the model, server pulls the updates). :func:`set_object_pull_backoff` lowers
   the start and the cap in the calling process (the defaults of Flower's ``pull_objects`` and
   ``pull_and_inflate_object_from_tree``; keyword-only defaults, so every caller in the process sees them).
2. **SuperNode waits.** Its loop sleeps a fixed 3 s after an empty pull from the SuperLink and 0.5 s
   between checks for the ClientApp's reply (and for reply objects). :func:`capped_time` makes a
   ``time`` module whose ``sleep`` caps those two separately: the idle pull goes to the SuperLink
   (a request each time), the reply check reads the SuperNode's own memory (cheap, can be short).

Neither is a Flower setting; both are pinned to flwr 1.42's internals (names checked on use).
"""

from __future__ import annotations

import time
import types

__all__ = ["capped_time", "set_object_pull_backoff"]


def set_object_pull_backoff(initial_s: float, cap_s: float | None = None) -> None:
    """Retry a not-yet-available object after ``initial_s``, doubling to at most ``cap_s`` (Flower: 1 s, 10 s).

    ``cap_s`` defaults to ``max(initial_s, 0.2)``: each retry is one HTTP request, so a waiting
    receiver costs at most ~5 requests a second per pull thread (Flower pulls 2 objects at once).

    The number of tries is left to Flower's time limit (``PULL_MAX_TIME``, 2 h) instead of its 500
    tries, which at a short cap would give up on a slow upload after a minute or two.
    """
    cap_s = max(initial_s, 0.2) if cap_s is None else cap_s
    if not 0 < initial_s <= cap_s:
        raise ValueError(f"object pull back-off: need 0 < initial_s <= cap_s, got {initial_s}, {cap_s}")
    from flwr.supercore.inflatable import inflatable_utils as u

    for fn in (u.pull_objects, u.pull_and_inflate_object_from_tree):
        kw = fn.__kwdefaults__ or {}
        missing = {"initial_backoff", "backoff_cap", "max_tries_per_object"} - set(kw)
        if missing:
            raise RuntimeError(f"flwr {fn.__module__}.{fn.__name__} has no keyword defaults {sorted(missing)}; "
                               "this patch is written for flwr 1.42")
        kw.update(initial_backoff=initial_s, backoff_cap=cap_s, max_tries_per_object=None)


def capped_time(idle_cap_s: float, wait_cap_s: float) -> types.SimpleNamespace:
    """A stand-in for the ``time`` module whose ``sleep(s)`` sleeps ``min(s, cap)``.

    ``cap`` is ``idle_cap_s`` for sleeps of 1 s or more (the SuperNode's 3 s idle poll) and
    ``wait_cap_s`` for shorter ones (its 0.5 s checks for a reply and for reply objects).
    """
    fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    fast.sleep = lambda s: time.sleep(min(s, idle_cap_s if s >= 1 else wait_cap_s))
    return fast
