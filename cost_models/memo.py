"""The cost layer's memo of what depends on one graph or on one cluster only.

Pricing the plans of one search repeats work that depends only on the graph (op prices, layer
segments, Megatron-rule placements, activation sizes) or only on the cluster (collective times,
rank layouts). The models keep it in :data:`PRICES`, one dictionary per object, keyed inside by
tuples that start with a tag. An object's dictionary lives as long as the object; a graph's is
dropped when the graph changes (:attr:`polyparallel.ir.Graph.version`), so a graph built op by op
is never priced from a stale entry.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["PRICES", "PriceMemo"]


class PriceMemo:
    """Per-object memo dictionaries (objects must accept weak references)."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[int, dict[Any, Any]]] = {}

    def of(self, obj: Any) -> dict[Any, Any]:
        """The memo of ``obj`` (a graph or a cluster), empty again after the object changed."""
        key, version = id(obj), getattr(obj, "version", 0)
        hit = self._memo.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        if hit is None:  # the entry leaves with the object, before its id can be reused
            weakref.finalize(obj, self._memo.pop, key, None)
        memo: dict[Any, Any] = {}
        self._memo[key] = (version, memo)
        return memo

    def __len__(self) -> int:
        return len(self._memo)


PRICES = PriceMemo()
