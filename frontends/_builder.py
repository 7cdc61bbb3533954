"""What both frontends share: building a Graph op by op, and opaque-op bookkeeping."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from polyparallel.ir import Graph, LoopNest, Op, OpKind, TensorKind, TensorSpec
from polyparallel.ops import NotModelled


class CaptureError(RuntimeError):
    """A model could not be captured; the message names the construct and a way out."""


class OpaqueOpWarning(UserWarning):
    """Some ops were kept as opaque (replicate-only) ops."""


class GraphBuilder:
    """Appends ops to a :class:`Graph`, turning unmodelled ops into opaque ones.

    An opaque op keeps its operands and output shapes, gets one FLOP per output element
    as its estimate, is replicate-only for the planner, and is reported in one warning
    per capture (:meth:`finish`).
    """

    def __init__(self, name: str, source: str) -> None:
        self.graph = Graph(name=name, source=source)
        self._names: dict[tuple[str, str], int] = {}
        self.opaque: dict[str, list[str]] = {}

    def unique(self, base: str, space: str = "op") -> str:
        """A fresh name in a namespace ("op" or "tensor")."""
        base = base or space
        n = self._names.get((space, base), 0)
        self._names[(space, base)] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def tensor(self, name: str, shape: Sequence[int], dtype: str = "float32",
               kind: TensorKind = TensorKind.ACTIVATION, origin: str | None = None) -> str:
        self.graph.add_tensor(TensorSpec(name, tuple(int(s) for s in shape), dtype, kind, origin))
        return name

    def op(self, name: str, kind: OpKind, target: str, inputs: Sequence[str], outputs: Sequence[str],
           nest_fn: Callable[[], LoopNest] | None, *, attrs: dict[str, Any] | None = None,
           module: str = "", reason: str | None = None, source_node: str = "") -> Op:
        """Add an op; ``nest_fn`` builds its loop nest, or raises NotModelled -> opaque."""
        nest, why = None, reason
        if nest_fn is not None:
            try:
                nest = nest_fn()
            except NotModelled as e:
                why = str(e)
        if nest is None:
            why = why or f"no loop-nest model for {target}"
            self.opaque.setdefault(target, []).append(why)
            kind = OpKind.OPAQUE
        out_elems = sum(math.prod(self.graph.tensors[t].shape) for t in outputs)
        op = Op(name=self.unique(name), kind=kind, target=target, inputs=tuple(inputs), outputs=tuple(outputs),
                nest=nest, attrs=tuple(sorted((attrs or {}).items())), module=module,
                opaque_reason=why if nest is None else None, flops_estimate=out_elems if nest is None else 0,
                source_node=source_node)
        return self.graph.add_op(op)

    def finish(self) -> Graph:
        g = self.graph
        if self.opaque:
            items = ", ".join(f"{t} x{len(v)} ({v[0]})" for t, v in sorted(self.opaque.items()))
            msg = (f"{g.name}: {sum(len(v) for v in self.opaque.values())} op(s) kept opaque "
                   f"(replicate-only, FLOPs estimated as one per output element): {items}")
            g.warnings.append(msg)
            warnings.warn(msg, OpaqueOpWarning, stacklevel=3)
        g.validate()
        return g
