"""When Python's cyclic garbage collector runs during a search.

A search builds millions of short-lived objects next to a big heap that lives through it (the
captured graphs, the model's fake tensors, the price memos), and the collector rescanned that heap
every few thousand allocations: ~20% of llama-8b's search CPU. :func:`collector_paused` pauses it
for the search; those objects go by reference count.

A few steps of a search make cyclic garbage in bulk: a capture (torch.export's fx graphs, fake
tensors, ``inspect``'s closures) and the torch backend's check, which exports the model again to
cut a pipeline. Kept to the end of the search, a capture's cycles were ~50 MB of llama-8b's peak.
Those steps run under :func:`young_collected`: the collector runs with the heap that was there
before frozen, so it frees the step's cycles as they form and scans only what the step allocated
(collecting with the whole heap instead cost the backend's check 0.6 s of its 2.3 s on llama-8b).
Such a step also drops the source-text caches it filled (stack traces' lines, ``inspect``'s maps).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import linecache
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["collector_paused", "drop_source_caches", "young_collected"]

F = TypeVar("F", bound=Callable[..., Any])


def collector_paused(fn: F) -> F:
    """Run ``fn`` with the cyclic garbage collector paused (module docstring)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused  # type: ignore[return-value]


@contextlib.contextmanager
def young_collected() -> Iterator[None]:
    """Inside a paused search, collect the cycles of what the block allocates, and only those;
    with the collector running, a no-op. Objects someone else froze (``gc.freeze``) are left so:
    the block then runs with the whole heap collected, as the collector would."""
    if gc.isenabled():
        yield
        return
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        drop_source_caches()
        if freeze:
            gc.collect()  # the block's last cycles (the frozen heap is not scanned)
        gc.disable()
        if freeze:
            gc.unfreeze()


def drop_source_caches() -> None:
    """Empty the process-wide caches of source text a capture fills and never reads again: the
    lines of every file a stack trace or torch's op registration looked up (``linecache``) and
    ``inspect``'s file-to-module maps. On llama-8b's search they held ~10 MB of its peak."""
    linecache.clearcache()
    for cache in (getattr(inspect, "_filesbymodname", None), getattr(inspect, "modulesbyfile", None)):
        if isinstance(cache, dict):
            cache.clear()
