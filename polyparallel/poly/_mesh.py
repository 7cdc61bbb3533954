"""Device meshes and block distributions of an extent over mesh axes.

A mesh is a row-major grid of devices with named axes (``dp=4, tp=2``). Splitting an
extent ``N`` over an ordered list of mesh axes ``(a_1, ..., a_k)`` (outermost first)
is a *nested block distribution*: ``a_1`` cuts ``[0, N)`` into ``size(a_1)`` blocks,
``a_2`` cuts each of those, and so on. Along one axis with integer weights
``w_0..w_{n-1}`` (``W_c = w_0 + ... + w_{c-1}``, ``W = W_n``) the block of coordinate
``c`` inside ``[lo, hi)`` is::

    [lo + (hi - lo) * W_c // W,  lo + (hi - lo) * W_{c+1} // W)

Equal weights give balanced blocks (sizes differ by at most one); weights ``3:1`` give
the proportional split a heterogeneous center wants (speeds of its device types).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["DeviceAxis", "DeviceMesh"]


@dataclass(frozen=True, slots=True)
class DeviceAxis:
    """One named axis of a :class:`DeviceMesh`, optionally with integer speed weights per coordinate (the
    Strategy records a mesh axis as :class:`polyparallel.strategy.MeshAxis`: its name, size and level)."""

    name: str
    size: int
    weights: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"mesh axis name {self.name!r} must be an identifier (e.g. 'dp', 'tp')")
        if self.size < 1:
            raise ValueError(f"mesh axis {self.name!r} has size {self.size}; sizes are >= 1")
        if self.weights is not None:
            w = tuple(int(x) for x in self.weights)
            if len(w) != self.size or min(w) < 1:
                raise ValueError(f"mesh axis {self.name!r}: weights {list(self.weights)} must be "
                                 f"{self.size} positive integers (one per coordinate, e.g. 3,1)")
            object.__setattr__(self, "weights", None if len(set(w)) == 1 else w)

    @property
    def even(self) -> bool:
        return self.weights is None

    def cumulative(self) -> np.ndarray:
        """``W_0 .. W_n`` (length ``size + 1``)."""
        w = self.weights or (1,) * self.size
        return np.concatenate([[0], np.cumsum(w)]).astype(np.int64)

    def __str__(self) -> str:
        w = f"[{':'.join(map(str, self.weights))}]" if self.weights else ""
        return f"{self.name}={self.size}{w}"


@dataclass(frozen=True)
class DeviceMesh:
    """A named, row-major grid of devices.

    Args:
        axes: the mesh axes, outermost first.
        device_ids: global device ids in row-major order (default ``0..size-1``).

    Examples:
        >>> m = DeviceMesh.of(dp=2, tp=2, weights={"dp": (3, 1)})
        >>> str(m), m.size
        ('dp=2[3:1],tp=2', 4)
        >>> lo, hi = m.bounds(8, ("dp",))
        >>> lo.tolist(), hi.tolist()
        ([0, 0, 6, 6], [6, 6, 8, 8])
    """

    axes: tuple[DeviceAxis, ...]
    device_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate mesh axis names {names}")
        n = math.prod(a.size for a in self.axes)
        if not self.device_ids:
            object.__setattr__(self, "device_ids", tuple(range(n)))
        elif len(self.device_ids) != n or len(set(self.device_ids)) != n:
            raise ValueError(f"mesh {self} has {n} devices but {len(self.device_ids)} distinct device ids "
                             "were given")

    @classmethod
    def of(cls, weights: Mapping[str, Sequence[int]] | None = None, device_ids: Sequence[int] = (),
           **sizes: int) -> DeviceMesh:
        """``DeviceMesh.of(dp=4, tp=2, weights={"dp": (3, 1, 3, 1)})``."""
        weights = dict(weights or {})
        unknown = set(weights) - set(sizes)
        if unknown:
            raise ValueError(f"weights given for unknown mesh axes {sorted(unknown)}; axes are {list(sizes)}")
        return cls(tuple(DeviceAxis(k, int(v), tuple(weights[k]) if k in weights else None)
                         for k, v in sizes.items()), tuple(device_ids))

    @classmethod
    def parse(cls, text: str) -> DeviceMesh:
        """Inverse of ``str``: ``"dp=2[3:1],tp=2"``."""
        axes = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, rest = part.partition("=")
            size, _, w = rest.partition("[")
            if not size.isdigit():
                raise ValueError(f"mesh {text!r}: expected NAME=SIZE or NAME=SIZE[w0:w1:...], got {part!r}")
            weights = tuple(int(x) for x in w.rstrip("]").split(":")) if w else None
            axes.append(DeviceAxis(name.strip(), int(size), weights))
        return cls(tuple(axes))

    def __hash__(self) -> int:
        # meshes key every cache entry: hash the axes once, not on every lookup
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.axes, self.device_ids))
            object.__setattr__(self, "_hash", h)
        return h

    def factor(self, axis: str, **factors: int) -> DeviceMesh:
        """The same devices with ``axis`` factorised into ``factors`` (outermost first, sizes
        multiplying to its size): coordinate ``c`` of ``axis`` becomes the row-major coordinates of
        ``c`` over the factors, so the device order is unchanged and a dim split over all the factors
        (``Placement.refine``) gets the same blocks as over ``axis`` where the extent divides evenly.
        Two loop dims can then share one axis of the coarse mesh, as Megatron's grouped-query
        attention does on ``tp = 4`` with 2 KV heads: KV heads over the outer factor, the query heads
        of a group over the inner one (``h:tp_kv,g:tp_q``), 2 query heads and 1 KV head per device.

        Examples:
            >>> str(DeviceMesh.of(dp=2, tp=4).factor("tp", tp_kv=2, tp_q=2))
            'dp=2,tp_kv=2,tp_q=2'
        """
        ax = self.axis(axis)
        if not ax.even:
            raise ValueError(f"mesh axis {ax} is weighted; only even axes can be factorised")
        if math.prod(factors.values()) != ax.size or not factors:
            raise ValueError(f"factors {factors} of mesh axis {axis!r} must multiply to its size {ax.size}")
        i = self.index(axis)
        new = (*self.axes[:i], *(DeviceAxis(k, int(v)) for k, v in factors.items()), *self.axes[i + 1:])
        return DeviceMesh(new, self.device_ids)

    # -- queries ----------------------------------------------------------------------------
    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def even(self) -> bool:
        return all(a.even for a in self.axes)

    @cached_property
    def _axis_index(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.axes)}

    def axis(self, name: str) -> DeviceAxis:
        i = self._axis_index.get(name)
        if i is None:
            raise KeyError(f"mesh {self} has no axis {name!r}; axes are {list(self.names)}")
        return self.axes[i]

    def index(self, name: str) -> int:
        self.axis(name)
        return self._axis_index[name]

    @cached_property
    def coords(self) -> np.ndarray:
        """``coords[p, i]``: coordinate of device ``p`` (row-major) along axis ``i``."""
        if not self.axes:
            return np.zeros((1, 0), dtype=np.int64)
        grids = np.meshgrid(*[np.arange(s) for s in self.shape], indexing="ij")
        return np.stack([g.reshape(-1) for g in grids], axis=1).astype(np.int64)

    def bounds(self, extent: int, axes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Per device ``[lo, hi)`` of ``[0, extent)`` split over ``axes`` (outermost first).

        Memoised per mesh; the arrays are read-only because every caller shares them.
        """
        memo = self.__dict__.setdefault("_bounds_memo", {})
        key = (extent, tuple(axes))
        hit = memo.get(key)
        if hit is None:
            hit = self._bounds(extent, key[1])
            for arr in hit:
                arr.setflags(write=False)
            if len(memo) > 65536:
                memo.clear()
            memo[key] = hit
        return hit

    def _bounds(self, extent: int, axes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        lo = np.zeros(self.size, dtype=np.int64)
        hi = np.full(self.size, extent, dtype=np.int64)
        for name in axes:
            ax = self.axis(name)
            if ax.size == 1:
                continue
            cum = ax.cumulative()
            c = self.coords[:, self.index(name)]
            span = hi - lo
            lo, hi = lo + span * cum[c] // cum[-1], lo + span * cum[c + 1] // cum[-1]
        return lo, hi

    @cached_property
    def _sizes(self) -> dict[str, int]:
        return {a.name: a.size for a in self.axes}

    def group_size(self, axes: Sequence[str]) -> int:
        sizes = self._sizes
        try:
            return math.prod(sizes[a] for a in axes)
        except KeyError:
            return math.prod(self.axis(a).size for a in axes)  # raises with the mesh's axes named

    def __str__(self) -> str:
        return ",".join(str(a) for a in self.axes)
