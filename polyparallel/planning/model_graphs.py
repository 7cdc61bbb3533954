"""The graphs a search prices: one captured graph per micro-batch size, derived where it can be.

A search needs the model's graph at every micro-batch size ``b`` it tries. :class:`ModelGraphs`
captures a module at the two ``ANCHORS`` batch sizes only (captured, canonicalised, elementwise ops
fused) and derives every other size from them (:func:`rebatch_graph`): two captures of one model
differ only in integers affine in the batch (extents, shapes, attribute values), so the graph at
``b`` is the anchors' graph with those integers evaluated at ``b``. Should the captures differ in
anything else, each size is captured instead. ONNX models and graphs have one fixed batch.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from polyparallel.frontends import capture
from polyparallel.ir import Graph, _Any
from polyparallel.planning.collector import young_collected
from polyparallel.transforms import canonicalize, fuse_elementwise

__all__ = ["ANCHORS", "MAX_MICRO", "ModelGraphs", "NotAffine", "Rebatcher", "divisors", "graph_batch", "rebatch",
           "rebatch_graph"]

MAX_MICRO = 8  # the largest micro-batch the default enumeration tries (besides the whole batch)
ANCHORS = (2, 4)  # batch sizes a module is captured at; the others are re-batched from these


class ModelGraphs:
    """Captures the model at a given micro-batch size, on demand, with a cache."""

    def __init__(self, model: Any, example_inputs: Any, example_kwargs: dict[str, Any] | None) -> None:
        self.model, self.args, self.kwargs = model, example_inputs, example_kwargs or {}
        # the model's graph as given (a Graph, or an ONNX model's capture); a module's captures are
        # not kept once transformed (3 MB each for llama-8b): none is captured twice
        self.graphs: dict[int, Graph] = {}
        self.captured: list[int] = []  # the sizes captured, in order
        self.priced: dict[int, Graph] = {}
        self.capture_s = 0.0
        self.capture_cpu_s = 0.0  # the same, in this process's CPU time (independent of the machine's load)
        self.rebatch_failed = ""  # why re-batching was given up, if it was
        self.derived: set[int] = set()  # sizes whose graph was re-batched, not captured
        self._rebatcher: Rebatcher | None = None
        if isinstance(model, Graph):
            self.b0 = graph_batch(model)
            self.graphs[self.b0] = model
            self.name = model.name
            self.resizable = False
            return
        import torch

        if isinstance(model, torch.nn.Module):
            args = example_inputs if isinstance(example_inputs, tuple) else (
                tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,))
            self.args = args
            tensors = [t for t in [*args, *self.kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() > 0]
            if not tensors:
                raise ValueError("example inputs need at least one tensor with a batch dimension")
            self.b0 = int(tensors[0].shape[0])
            self.name = type(model).__name__
            self.resizable = True
        else:  # ONNX path or ModelProto: fixed shapes
            self.resizable = False
            g = self._capture_raw(None)
            self.b0 = graph_batch(g)
            self.graphs[self.b0] = g
            self.name = g.name

    def _capture_raw(self, b: int | None) -> Graph:
        t, c = time.perf_counter(), time.process_time()
        with warnings.catch_warnings(), young_collected():  # export's cycles go as they form
            warnings.simplefilter("ignore")
            if b is None:
                g = capture(self.model)
            else:
                args = tuple(rebatch(a, self.b0, b) for a in self.args)
                kwargs = {k: rebatch(v, self.b0, b) for k, v in self.kwargs.items()}
                g = capture(self.model, args, kwargs)
        self.capture_s += time.perf_counter() - t
        self.capture_cpu_s += time.process_time() - c
        return g

    def graph(self, b: int) -> Graph:
        """The graph priced for micro-batch ``b``: captured, canonicalised, elementwise ops fused.

        Canonicalisation folds views into accesses and fusion merges elementwise chains, so
        the cost model prices one memory pass per fused op (FLOPs and parameters unchanged).
        A module is captured (and transformed) at the two ``ANCHORS`` batch sizes only; every
        other size is re-batched from them (:func:`rebatch_graph`), which on a big model
        replaces a capture of seconds by milliseconds. Should the two captures not differ by
        batch-affine integers alone, each size is captured instead.
        """
        if b not in self.priced:
            derived = self._derive(b)
            if derived is None:
                derived = self._captured(b)
            else:
                self.derived.add(b)
            self.priced[b] = derived
        return self.priced[b]

    def exact(self, b: int) -> Graph:
        """The graph of micro-batch ``b`` exactly as a capture at ``b`` gives it.

        Re-batched graphs equal direct captures for ``b ≥ 2``; at batch 1 a capture names
        extent-1 dims differently (views drop them), with the same prices. A strategy is
        fingerprinted and placed on this graph, which the torch backend re-captures to check.
        """
        if b in self.derived and b < min(ANCHORS):
            self.priced[b] = self._captured(b)
            self.derived.discard(b)
        return self.graph(b)

    def drop_rebatcher(self) -> None:
        """Free the anchors' comparison (2.4 MB for llama-8b) once every size the search needs is
        priced; a size asked for later builds it again."""
        self._rebatcher = None

    def affine_of(self, g: Graph) -> tuple[Graph, Graph, float] | None:
        """For a graph this re-batched from the anchors: ``(anchor lo, anchor hi, t)`` with ``g`` the
        anchors' graph at batch ``lo + t (hi - lo)``; None for a captured graph."""
        b = graph_batch(g)
        if b not in self.derived or self.priced.get(b) is not g:
            return None
        lo, hi = ANCHORS
        return self.graph(lo), self.graph(hi), (b - lo) / (hi - lo)

    def _captured(self, b: int) -> Graph:
        if b in self.graphs:
            raw = self.graphs[b]
        elif not self.resizable:
            raise ValueError(f"the model has a fixed batch of {self.b0}; micro-batch {b} is not available")
        else:
            raw = self._capture_raw(b)
            self.captured.append(b)
        return fuse_elementwise(canonicalize(raw))

    def _derive(self, b: int) -> Graph | None:
        lo, hi = ANCHORS
        if not self.resizable or self.rebatch_failed or b in (lo, hi):
            return None
        try:
            if self._rebatcher is None:
                self._rebatcher = Rebatcher(self.graph(lo), self.graph(hi), lo, hi)
            return self._rebatcher.at(b)
        except (NotAffine, ValueError, RuntimeError, TypeError) as e:  # capture each size instead
            self.rebatch_failed = f"{type(e).__name__}: {e}"
            return None

    def micro_sizes(self, per_replica: int, exhaustive: bool, whole: bool = False,
                    pinned: int | None = None) -> list[int]:
        """Micro-batch sizes to try for ``per_replica`` samples per replica.

        Every divisor of ``per_replica`` up to ``MAX_MICRO`` (3, 5, 6, 7 as well as powers of two:
        a published recipe's micro-batch must be a choice); ``exhaustive`` tries every divisor;
        ``whole`` adds ``per_replica`` itself (one micro-batch: no gradient accumulation);
        ``pinned`` (a micro-batch count the user fixed) gives exactly that size whenever it
        divides, however large. A model captured at a fixed batch has only that size.
        """
        if not self.resizable:
            return [self.b0] if per_replica % self.b0 == 0 else []
        if pinned is not None:
            return [per_replica // pinned] if pinned >= 1 and per_replica % pinned == 0 else []
        # larger micro-batches gain little GEMM efficiency and each size is priced on every rung
        sizes = [d for d in divisors(per_replica) if exhaustive or d <= MAX_MICRO]
        return sorted({*sizes, per_replica}) if whole else sizes


def rebatch(v: Any, b0: int, b: int) -> Any:
    import torch

    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b0:
        return torch.zeros((b, *v.shape[1:]), dtype=v.dtype, device=v.device)
    return v


class NotAffine(ValueError):
    """Two captures of a model differ in more than batch-affine integers."""


def rebatch_graph(lo: Graph, hi: Graph, b_lo: int, b_hi: int, b: int) -> Graph:
    r"""The graph of micro-batch ``b`` from the graphs of the same model captured at ``b_lo < b_hi``.

    Both captures must have the same structure (ops, tensors, dims, statements and accesses in
    the same order, the same names and kinds); every integer ``x`` that differs between them
    (an extent, a shape entry, an access coefficient or offset) is taken to be affine in the
    batch, ``x(b) = x_lo + (x_hi − x_lo)(b − b_lo)/(b_hi − b_lo)``, which must be an exact
    integer. This holds for the models a frontend produces: batch sizes enter shapes as
    ``b`` or ``b·k`` and strides of dims outside the batch. (A capture at batch 1 may
    index an extent-1 batch dim as the constant 0 where the re-batched graph keeps ``b``:
    the same points, the same prices.)

    Raises:
        NotAffine: naming the first difference that is not batch-affine (then capture instead).
    """
    return Rebatcher(lo, hi, b_lo, b_hi).at(b)


class Rebatcher:
    """:func:`rebatch_graph` for many batch sizes: the two anchors are compared once.

    The comparison yields, for each part of the graph, either "the same in both captures" (the
    re-batched graph shares the anchor's immutable value) or a builder that re-evaluates the
    integers that differ, so a size costs one pass over the batch-dependent parts only.
    """

    def __init__(self, lo: Graph, hi: Graph, b_lo: int, b_hi: int) -> None:
        for name, t in lo.tensors.items():
            if t.is_param and hi.tensors.get(name) != t:
                raise NotAffine(f"parameter {name} differs between the batch {b_lo} and {b_hi} captures")
        self.lo, self.b_lo, self.b_hi = lo, b_lo, b_hi
        self._tensors = _diff(lo.tensors, hi.tensors, self, "tensors") or _copy
        # ops are rebuilt at every size even where unchanged: each graph owns its Op objects
        self._ops = _diff(lo.ops, hi.ops, self, "ops", rebuild=True) or _copy

    def at(self, b: int) -> Graph:
        lo = self.lo
        g = Graph(name=lo.name, tensors=self._tensors(lo.tensors, b), ops=self._ops(lo.ops, b), inputs=list(lo.inputs),
                  outputs=list(lo.outputs), source=lo.source, warnings=list(lo.warnings))
        g.__dict__["_transform_history"] = lo.__dict__.get("_transform_history", ())
        return g


Builder = Any  # (anchor value at b_lo, b) -> value at b


def _copy(x: Any, b: int) -> Any:
    return type(x)(x)


def _diff(x: Any, y: Any, rb: Rebatcher, where: str, rebuild: bool = False) -> Builder | None:
    """None where ``x`` and ``y`` are the same value (reused as is), else a builder of the value at ``b``."""
    if type(x) is not type(y):
        raise NotAffine(f"{where}: {type(x).__name__} vs {type(y).__name__}")
    if isinstance(x, bool) or x is None or isinstance(x, str | float | Enum | _Any):
        if x != y:
            raise NotAffine(f"{where}: {x!r} vs {y!r}")
        return None
    if isinstance(x, int):
        if x == y:
            return None
        slope, rem = divmod(y - x, rb.b_hi - rb.b_lo)
        if rem:
            raise NotAffine(f"{where}: {x} at batch {rb.b_lo}, {y} at batch {rb.b_hi} is not affine in the batch")
        b_lo = rb.b_lo
        return lambda v, b: v + slope * (b - b_lo)
    if isinstance(x, tuple | list):
        if len(x) != len(y):
            raise NotAffine(f"{where}: {len(x)} vs {len(y)} entries")
        subs = [(i, f) for i, (u, v) in enumerate(zip(x, y))
                if (f := _diff(u, v, rb, f"{where}[{i}]", rebuild)) is not None]
        if not subs:
            return None
        kind = type(x)

        def seq(v: Any, b: int) -> Any:
            out = list(v)
            for i, f in subs:
                out[i] = f(v[i], b)
            return out if kind is list else kind(out)
        return seq
    if isinstance(x, dict):
        if list(x) != list(y):
            raise NotAffine(f"{where}: different keys")
        items = [(k, f) for k in x if (f := _diff(x[k], y[k], rb, f"{where}.{k}")) is not None]
        if not items:
            return None

        def dct(v: Any, b: int) -> Any:
            out = dict(v)
            for k, f in items:
                out[k] = f(v[k], b)
            return out
        return dct
    if is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in fields(x)]
        fsubs = [(n, sub) for n in names
                 if (sub := _diff(getattr(x, n), getattr(y, n), rb, f"{where}.{n}")) is not None]
        if not fsubs and not rebuild:
            return None
        cls = type(x)

        def obj(v: Any, b: int) -> Any:
            kw = {n: getattr(v, n) for n in names}
            for n, sub in fsubs:
                kw[n] = sub(kw[n], b)
            return cls(**kw)
        return obj
    if x == y:  # an attribute value of another type (a dtype, a device...)
        return None
    raise NotAffine(f"{where}: {x!r} vs {y!r}")


def graph_batch(g: Graph) -> int:
    for name in g.inputs:
        shape = g.tensors[name].shape
        if shape:
            return int(shape[0])
    return 1


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to its square root (a batch
    of 10^12 samples has 169 of them, found in a million trials rather than 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
