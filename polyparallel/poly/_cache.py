"""Bounded caches keyed by op signature x placement (and layout pairs), with hit rates.

A model with 96 identical decoder layers has 96 ops of each signature; every result of
the polyhedral model depends only on (signature, placement[, operand]) or on a pair of
tensor distributions, so the second and later layers are lookups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CACHE", "PolyCache", "cache_stats", "clear_cache"]


@dataclass
class PolyCache:
    """Named LRU tables; ``maxsize`` bounds each table (distributions hold per-device arrays)."""

    maxsize: int = 4096
    tables: dict[str, OrderedDict[Hashable, Any]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)

    def get(self, table: str, key: Hashable, make: Callable[[], Any]) -> Any:
        t = self.tables.setdefault(table, OrderedDict())
        if key in t:
            t.move_to_end(key)
            self.hits[table] = self.hits.get(table, 0) + 1
            return t[key]
        self.misses[table] = self.misses.get(table, 0) + 1
        value = make()
        t[key] = value
        if len(t) > self.maxsize:
            t.popitem(last=False)
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


#: The process-wide cache used by :mod:`polyparallel.poly`.
CACHE = PolyCache()


def cache_stats() -> dict[str, dict[str, float]]:
    """Hits, misses and hit rate per table and overall."""
    return CACHE.stats()


def clear_cache() -> None:
    CACHE.clear()
