"""The op handlers' registry and what they share.

A handler maps one ONNX node to its :class:`~polyparallel.ir.OpKind` and a builder of its
loop nest (a :data:`Spec`); it reads the node through :class:`_Node` (shapes, capture-time
constant inputs, attributes, opset) and registers itself for the op types it models with
:func:`_handles`. Every nest a handler builds passes :func:`_checked`: it must write exactly
the output shapes ONNX shape inference gave, else the op is kept opaque.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from polyparallel import ops
from polyparallel.ir import Access, AffineExpr, LoopNest, OpKind, Statement

from ._model import _attr_value

Shape = tuple[int, ...]
NestFn = Callable[[], LoopNest]
Spec = tuple[OpKind, NestFn | None]


@dataclass
class _Node:
    """A node with what its handler needs: shapes, constant values, attributes, opset."""

    proto: onnx.NodeProto
    ins: list[str]  # raw input names ("" = absent optional input)
    shapes: dict[str, Shape]
    values: dict[str, np.ndarray]
    opset: int

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    def has(self, i: int) -> bool:
        return i < len(self.ins) and bool(self.ins[i])

    def shape(self, i: int) -> Shape | None:
        return self.shapes[self.ins[i]] if self.has(i) else None

    def const(self, i: int) -> np.ndarray | None:
        return self.values.get(self.ins[i]) if self.has(i) else None

    def ints(self, i: int, what: str) -> list[int]:
        v = self.const(i)
        if v is None:
            raise ops.NotModelled(f"{self.op_type} with a run-time {what} (input {i}) is not modelled")
        return [int(x) for x in np.asarray(v).reshape(-1)]

    @property
    def outs(self) -> list[Shape]:
        return [self.shapes[o] for o in self.proto.output if o]

    @property
    def out(self) -> Shape:
        return self.shapes[self.proto.output[0]]

    def attr(self, name: str, default: Any = None) -> Any:
        for a in self.proto.attribute:
            if a.name == name:
                return _attr_value(a)
        return default

    @property
    def data_shapes(self) -> list[Shape]:
        return [self.shapes[n] for n in self.ins if n]


_HANDLERS: dict[str, Callable[[_Node], Spec]] = {}


def _handles(*names: str) -> Callable[[Callable[[_Node], Spec]], Callable[[_Node], Spec]]:
    def deco(f: Callable[[_Node], Spec]) -> Callable[[_Node], Spec]:
        for nm in names:
            _HANDLERS[nm] = f
        return f

    return deco


def _checked(fn: NestFn, out_shapes: Sequence[Shape], target: str) -> NestFn:
    def build() -> LoopNest:
        try:
            nest = fn()
        except ops.NotModelled:
            raise
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            raise ops.NotModelled(f"{target}: {type(e).__name__}: {e}") from e
        ext = nest.extents
        # per output and axis, the [lo, hi] index range over all writes must be the inferred extent
        span: dict[int, list[tuple[int, int] | None]] = {}
        for st in nest.statements:
            for w in st.writes:
                if not w.operand.startswith("out"):
                    continue
                k = int(w.operand[3:])
                if k >= len(out_shapes) or len(w.index) != len(out_shapes[k]):
                    raise ops.NotModelled(f"{target}: loop nest writes {w} but the node's outputs have shapes "
                                          f"{[list(s) for s in out_shapes]}")
                cur = span.setdefault(k, [None] * len(w.index))
                for axis, e in enumerate(w.index):
                    if isinstance(e, AffineExpr):
                        hi = e.const + sum(c * (ext[d] - 1) for d, c in e.terms if c > 0)
                        lo = e.const + sum(c * (ext[d] - 1) for d, c in e.terms if c < 0)
                        if st.constraints:  # the box's range; constraints (a transposed conv's crop) cut it
                            n_out = max(out_shapes[k][axis], 1)
                            lo, hi = min(max(lo, 0), n_out - 1), max(min(hi, n_out - 1), 0)
                        old = cur[axis]
                        cur[axis] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        for k, axes in span.items():
            for axis, r in enumerate(axes):
                want = (0, max(out_shapes[k][axis], 1) - 1)
                if r is not None and r != want:
                    raise ops.NotModelled(f"{target}: loop nest writes out{k} axis {axis} over {list(r)}, "
                                          f"but the inferred output shape is {list(out_shapes[k])}")
        written = set(span)
        missing = set(range(len(out_shapes))) - written
        if missing:
            raise ops.NotModelled(f"{target}: loop nest does not write output(s) {sorted(missing)}")
        return nest

    return build


def _extra_writes(nest: LoopNest, stmt: str, writes: Sequence[Access]) -> LoopNest:
    sts = tuple(Statement(s.name, s.dims, s.reads, s.writes + tuple(writes), s.flops_per_point, s.constraints)
                if s.name == stmt else s for s in nest.statements)
    return LoopNest(nest.dims, sts)


def _write_of(nest: LoopNest, operand: str = "out0") -> Access:
    for s in nest.statements:
        for w in s.writes:
            if w.operand == operand:
                return w
    raise ops.NotModelled(f"loop nest has no write of {operand}")


def _identity(x: Shape, n_outputs: int = 1) -> LoopNest:
    nt = ops.expand(x, x)
    return _extra_writes(nt, nt.statements[0].name,
                         [Access(f"out{i}", _write_of(nt).index) for i in range(1, n_outputs)])
