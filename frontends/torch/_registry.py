"""The op handlers' registry and what they share.

A handler maps one ATen call, normalised to a :class:`Call` (arguments by schema name, tensors
as :class:`TRef` graph tensor names), to its :class:`~polyparallel.ir.OpKind`, its input tensors
and a builder of its loop nest (a :data:`Spec`); it registers itself for the base names of the ops
it models with :func:`handles`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polyparallel.ir import LoopNest, OpKind


@dataclass
class Call:
    """An op call with its arguments by name; tensors are replaced by graph tensor names."""

    name: str  # base op name, e.g. "addmm", "conv2d", "relu"
    target: str  # full source name for messages, e.g. "aten.addmm.default"
    args: dict[str, Any]
    outputs: list[str]
    module: str
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape

    def get(self, *names: str, default: Any = None) -> Any:
        for n in names:
            if n in self.args and self.args[n] is not None:
                return self.args[n]
        return default

    def tensor(self, *names: str) -> str | None:
        v = self.get(*names)
        return v if isinstance(v, TRef) else None

    def shape(self, t: str | None) -> tuple[int, ...] | None:
        return None if t is None else self.shapes[t]

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return self.shapes[self.outputs[i]]


class TRef(str):
    """A graph tensor name appearing as an argument."""


Spec = tuple[OpKind, list[str], Callable[[], LoopNest] | None]
Handler = Callable[[Call], Spec]
HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn

    return deco


def _ints(v: Any, default: Sequence[int] = ()) -> list[int]:
    if v is None:
        return list(default)
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def _flat_args(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for k in v for x in _flat_args(v[k])]
    if isinstance(v, list | tuple):
        return [x for e in v for x in _flat_args(e)]
    return [v]
