"""Shared helpers of the op-family builders."""

from __future__ import annotations

from collections.abc import Sequence

from polyparallel.ir import AffineExpr, Dim, E, Hint, Role, Shape

LEAD_NAMES = ("b", "s", "s1", "s2", "s3", "s4", "s5", "s6")
LEAD_HINTS = (Hint.BATCH, Hint.SEQUENCE)


class NotModelled(ValueError):
    """The op (with these shapes/attributes) has no affine loop nest; keep it opaque."""


def lead_dims(shape: Sequence[int], prefix: str = "") -> list[Dim]:
    """Named dims for the leading (batch-like) axes of an operand."""
    if len(shape) > len(LEAD_NAMES):
        names = [f"{prefix}a{i}" for i in range(len(shape))]
    else:
        names = [prefix + n for n in LEAD_NAMES[: len(shape)]]
    return [Dim(n, max(1, int(e)), Role.PARALLEL, LEAD_HINTS[i] if i < 2 else None)
            for i, (n, e) in enumerate(zip(names, shape))]


def broadcast_shapes(*shapes: Sequence[int]) -> Shape:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        ext = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            e = s[j]
            if e != 1:
                if ext not in (1, e):
                    raise NotModelled(f"shapes {[list(x) for x in shapes]} do not broadcast")
                ext = e
        out.append(ext)
    return tuple(out)


def broadcast_index(shape: Sequence[int], out_dims: Sequence[Dim]) -> tuple[AffineExpr, ...]:
    """Index of an operand broadcast (numpy rules, right-aligned) into the output dims."""
    rank = len(out_dims)
    idx = []
    for j, e in enumerate(shape):
        d = out_dims[j + rank - len(shape)]
        idx.append(AffineExpr((), 0) if (e == 1 and d.extent != 1) else E(d.name))
    return tuple(idx)


def norm_axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise NotModelled(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def generic_dims(shape: Sequence[int], prefix: str = "d") -> list[Dim]:
    return [Dim(f"{prefix}{i}", max(1, int(e))) for i, e in enumerate(shape)]
