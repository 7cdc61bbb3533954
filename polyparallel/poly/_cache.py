"""Bounded caches keyed by op signature x placement (and layout pairs), with hit rates.

A model with 96 identical decoder layers has 96 ops of each signature; every result of
the polyhedral model depends only on (signature, placement[, operand]) or on a pair of
tensor distributions, so the second and later layers are lookups.
"""

from __future__ import annotations

import gc
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyparallel.ir import Graph, Op

__all__ = ["CACHE", "MISSING", "PolyCache", "cache_stats", "clear_cache", "signature_of"]


_MISSING = object()
MISSING = _MISSING  #: what :meth:`PolyCache.hit` returns for a key not cached


@dataclass
class PolyCache:
    """Named memo tables; ``maxsize`` bounds each table, ``big`` the tables of small values
    (distributions and per-device intersections hold arrays over the devices; reshards and
    op prices are a few integers, and one attention edge alone has ~10^4 of them)."""

    maxsize: int = 4096
    big: int = 1 << 18
    small_values: frozenset[str] = frozenset({"reshard", "op_comm", "legal", "edge", "missing"})
    tables: dict[str, OrderedDict[Hashable, Any]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    clearers: list[Callable[[], None]] = field(default_factory=list)

    def on_clear(self, *fns: Callable[[], None]) -> None:
        """Register memo tables kept outside ``tables`` (``functools.lru_cache``) so ``clear`` empties them."""
        self.clearers.extend(fns)

    def get(self, table: str, key: Hashable, make: Callable[[], Any]) -> Any:
        t = self.tables.get(table)
        if t is None:
            t = self.tables[table] = OrderedDict()
        # one hash of the key per lookup (keys are long tuples); eviction is first-in first-out
        value = t.get(key, _MISSING)
        if value is not _MISSING:
            self.hits[table] = self.hits.get(table, 0) + 1
            return value
        self.misses[table] = self.misses.get(table, 0) + 1
        if gc.isenabled():
            # the work behind a miss allocates many small acyclic objects (tuples, arrays, steps);
            # with a large heap (a captured model, torch) each automatic collection rescans it
            # all, which cost 15-25% of pricing a model; collection resumes afterwards
            gc.disable()
            try:
                value = make()
            finally:
                gc.enable()
        else:
            value = make()
        t[key] = value
        if len(t) > (self.big if table in self.small_values else self.maxsize):
            t.popitem(last=False)
        return value

    def hit(self, table: str, key: Hashable) -> Any:
        """The cached value (a hit is counted), or :data:`MISSING` (nothing counted: ``get`` follows)."""
        t = self.tables.get(table)
        value = _MISSING if t is None else t.get(key, _MISSING)
        if value is not _MISSING:
            self.hits[table] = self.hits.get(table, 0) + 1
        return value

    def stats(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in sorted(set(self.hits) | set(self.misses)):
            h, m = self.hits.get(name, 0), self.misses.get(name, 0)
            out[name] = {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0}
        h, m = sum(self.hits.values()), sum(self.misses.values())
        out["all"] = {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0}
        return out

    def clear(self) -> None:
        self.tables.clear()
        self.hits.clear()
        self.misses.clear()
        for fn in self.clearers:
            fn()


#: The process-wide cache used by :mod:`polyparallel.poly`.
CACHE = PolyCache()


def cache_stats() -> dict[str, dict[str, float]]:
    """Hits, misses and hit rate per table and overall."""
    return CACHE.stats()


def clear_cache() -> None:
    CACHE.clear()


_SIGNATURES: dict[tuple[int, int], tuple[Graph | None, Op, str]] = {}


def signature_of(graph: Graph | None, op: Op) -> str:
    """``graph.signature(op)``, memoised per (graph, op) object (it hashes the whole nest)."""
    key = (id(graph), id(op))
    hit = _SIGNATURES.get(key)
    if hit is not None and hit[0] is graph and hit[1] is op:
        return hit[2]
    sig = graph.signature(op) if graph is not None else \
        hashlib.blake2b(repr(op.nest).encode(), digest_size=12).hexdigest()
    if len(_SIGNATURES) > 100_000:
        _SIGNATURES.clear()
    _SIGNATURES[key] = (graph, op, sig)
    return sig
