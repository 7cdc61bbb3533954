"""Random block layouts for hypothesis tests of resharding, and a numpy count of what a device lacks."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from polyparallel.poly import DeviceMesh, TensorLayout


def draw_layout(data, mesh: DeviceMesh, shape: tuple[int, ...], partial_ok: bool,
                any_order: bool = False) -> TensorLayout:
    """Each mesh axis splits a random tensor axis, none, or (``partial_ok``) holds partial sums;
    ``any_order``: an axis is inserted at a random place in its tensor axis's list, else appended."""
    shards: list[list[str]] = [[] for _ in shape]
    partial = []
    for a in mesh.names:
        j = data.draw(st.integers(-2 if partial_ok else -1, len(shape) - 1))
        if j >= 0:
            shards[j].insert(data.draw(st.integers(0, len(shards[j]))) if any_order else len(shards[j]), a)
        elif j == -2:
            partial.append(a)
    return TensorLayout(shape, tuple(tuple(s) for s in shards), tuple(partial))


def layout_touched(layout: TensorLayout, mesh: DeviceMesh, p: int) -> np.ndarray:
    """Brute force: the elements device ``p`` holds under a block ``layout``, as a boolean mask."""
    t = np.zeros(layout.shape, dtype=bool)
    sl = []
    for n, s in zip(layout.shape, layout.shards):
        lo, hi = mesh.bounds(n, s)
        sl.append(slice(int(lo[p]), int(hi[p])))
    t[tuple(sl)] = True
    return t


def most_lacked(have: TensorLayout, need: TensorLayout, mesh: DeviceMesh) -> int:
    """Brute force: the most elements any device needs under ``need`` and does not hold under ``have``."""
    return max(int((layout_touched(need, mesh, p) & ~layout_touched(have, mesh, p)).sum()) for p in range(mesh.size))
