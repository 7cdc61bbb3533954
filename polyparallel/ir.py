"""Graph IR: a DAG of operators, each described by a loop nest over named dimensions.

Every op that polyparallel understands carries a :class:`LoopNest`: a set of named
iteration dimensions (extent, role, hint) and one or more :class:`Statement` s. A
statement iterates over a subset of the nest's dimensions (optionally cut by affine
constraints ``expr >= 0``, e.g. a causal mask) and reads and writes operands through
affine :class:`Access` es. This is the polyhedral description that
``polyparallel.poly`` turns into isl sets and maps.

Operands are named by position, never by graph tensor name, so that two ops that
compute the same thing on the same shapes have the same :meth:`Op.signature`:

* ``in0, in1, ...`` are the op's inputs, ``out0, out1, ...`` its outputs;
* any other name (``scores``, ``stats``) is a temporary that lives inside the op.

Semantics of an access: each index is an affine expression of the statement's dims.
An index may also be :data:`ANY` (a data-dependent index such as a gather), which is
treated as "any element along that axis". Accesses that fall outside a tensor's
bounds (convolution padding) are clipped: they read zero-padding and move no data.

A dim that appears in no write access of a statement is a *reduction* of that
statement; splitting it over devices leaves partial results that must be reduced.
A dim that is reduced by one statement and indexes the output of another (softmax,
layer norm) is a *normalised* dim: splitting it needs only the small statistics
reduced, which the polyhedral model reads off the temporaries.

Examples:
    >>> from polyparallel.ir import Dim, Statement, LoopNest, Access, E
    >>> b, n, k = E("b"), E("n"), E("k")
    >>> nest = LoopNest(
    ...     dims=(Dim("b", 8, hint="batch"), Dim("n", 16), Dim("k", 32)),
    ...     statements=(Statement("mac", ("b", "n", "k"),
    ...         reads=(Access("in0", (b, k)), Access("in1", (n, k))),
    ...         writes=(Access("out0", (b, n)),), flops_per_point=2),))
    >>> nest.flops(), nest.role("k")
    (8192, 'reduction')
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

__all__ = [
    "ANY",
    "DTYPE_BYTES",
    "FLOAT_DTYPES",
    "TRAINING_DTYPE_BYTES",
    "Access",
    "AffineExpr",
    "Dim",
    "E",
    "Graph",
    "Hint",
    "LoopNest",
    "Op",
    "OpKind",
    "Role",
    "Shape",
    "Statement",
    "TensorKind",
    "TensorSpec",
    "element_bytes",
    "target_base",
]

Shape = tuple[int, ...]

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

# training precisions by their short name (a Strategy's ``dtype``): bytes per element of the floating-point
# tensors trained in them; integer tensors (token ids, masks) keep their own width
TRAINING_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def element_bytes(tensor_dtype: str, precision: str) -> int:
    """Bytes per element of a tensor of ``tensor_dtype`` (``float32``, ``int64``) when the model
    trains in ``precision`` (``bf16``): floats take the precision's width, other tensors their own."""
    if tensor_dtype in FLOAT_DTYPES:
        return TRAINING_DTYPE_BYTES.get(precision, 4)
    return DTYPE_BYTES.get(tensor_dtype, 4)


class TensorKind(enum.StrEnum):
    INPUT = "input"  # fed by the user per step (data, labels)
    PARAM = "param"  # trainable parameter: has a gradient and optimizer state
    BUFFER = "buffer"  # persistent non-trainable state (BN running stats)
    CONST = "const"  # constant folded into the graph
    ACTIVATION = "activation"  # produced by an op


class Role(enum.StrEnum):
    PARALLEL = "parallel"
    REDUCTION = "reduction"


class Hint(enum.StrEnum):
    BATCH = "batch"
    SEQUENCE = "sequence"
    SPATIAL = "spatial"
    CHANNEL = "channel"
    HEAD = "head"
    FEATURE = "feature"
    VOCAB = "vocab"
    KERNEL = "kernel"
    EXPERT = "expert"  # the expert index of a mixture-of-experts layer (expert parallelism splits it)


class OpKind(enum.StrEnum):
    CONTRACTION = "contraction"  # linear, mm, bmm, matmul, einsum
    CONV = "conv"
    POOL = "pool"
    NORM = "norm"  # batch / layer / group / RMS norm
    SOFTMAX = "softmax"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    LOSS = "loss"
    ELEMENTWISE = "elementwise"
    REDUCE = "reduce"
    VIEW = "view"  # reshape / permute / expand / slice / squeeze: moves no data
    CONCAT = "concat"
    SPLIT = "split"
    GATHER = "gather"
    CREATE = "create"  # arange, zeros, full: produce a tensor from nothing
    RECURRENT = "recurrent"  # LSTM / GRU / RNN layers: a recurrence over the time steps
    OPAQUE = "opaque"


def _dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A typed tensor of the graph.

    Args:
        name: unique name in the graph.
        shape: concrete extents.
        dtype: torch-style dtype name (``float32``, ``bfloat16``, ``int64``...).
        kind: input, parameter, buffer, constant or activation.
        origin: where it comes from: module path of a parameter, initializer name, ...
    """

    name: str
    shape: Shape
    dtype: str = "float32"
    kind: TensorKind = TensorKind.ACTIVATION
    origin: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype_bytes(self.dtype)

    @property
    def is_param(self) -> bool:
        return self.kind is TensorKind.PARAM

    def __str__(self) -> str:
        return f"{self.name}:{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class AffineExpr:
    """``sum(coef * dim) + const`` over named dims; a value, hashable.

    Build with :func:`E` and ordinary arithmetic: ``E("h") * 2 + E("r") - 1``.
    """

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def _norm(terms: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
        acc: dict[str, int] = {}
        for d, c in terms:
            acc[d] = acc.get(d, 0) + c
        return tuple(sorted((d, c) for d, c in acc.items() if c != 0))

    def __add__(self, other: AffineExpr | int) -> AffineExpr:
        if isinstance(other, int):
            return AffineExpr(self.terms, self.const + other)
        return AffineExpr(self._norm(self.terms + other.terms), self.const + other.const)

    __radd__ = __add__

    def __sub__(self, other: AffineExpr | int) -> AffineExpr:
        return self + (-1 * other if isinstance(other, AffineExpr) else -other)

    def __rsub__(self, other: int) -> AffineExpr:
        return (-1 * self) + other

    def __mul__(self, k: int) -> AffineExpr:
        if not isinstance(k, int):
            raise TypeError("affine expressions scale by integers only")
        return AffineExpr(self._norm((d, c * k) for d, c in self.terms), self.const * k)

    __rmul__ = __mul__

    def __neg__(self) -> AffineExpr:
        return -1 * self

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.terms)

    def coef(self, dim: str) -> int:
        for d, c in self.terms:
            if d == dim:
                return c
        return 0

    def eval(self, env: Mapping[str, int]) -> int:
        return sum(c * env[d] for d, c in self.terms) + self.const

    def rename(self, mapping: Mapping[str, AffineExpr]) -> AffineExpr:
        """Substitute dims by expressions (used to compose accesses)."""
        out = AffineExpr((), self.const)
        for d, c in self.terms:
            out = out + c * mapping.get(d, E(d))
        return out

    def __str__(self) -> str:
        parts = []
        for d, c in self.terms:
            parts.append(d if c == 1 else f"-{d}" if c == -1 else f"{c}*{d}")
        if self.const or not parts:
            parts.append(str(self.const))
        s = " + ".join(parts)
        return s.replace("+ -", "- ")


def E(dim: str) -> AffineExpr:
    """The affine expression of a single dim."""
    return AffineExpr(((dim, 1),))


class _Any:
    """A data-dependent index (gather/scatter): any element along that axis."""

    _inst: _Any | None = None

    def __new__(cls) -> _Any:
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "ANY"

    __str__ = __repr__

    def __reduce__(self) -> str:
        return "ANY"

    @property
    def dims(self) -> tuple[str, ...]:
        return ()


ANY = _Any()
Index = AffineExpr | _Any


@dataclass(frozen=True, slots=True)
class Dim:
    """A named iteration dimension of a loop nest."""

    name: str
    extent: int
    role: Role = Role.PARALLEL
    hint: Hint | None = None

    def __post_init__(self) -> None:
        if self.extent < 1:
            raise ValueError(f"dim {self.name!r} has extent {self.extent}; extents are >= 1")
        object.__setattr__(self, "role", Role(self.role))
        if self.hint is not None:
            object.__setattr__(self, "hint", Hint(self.hint))

    def __str__(self) -> str:
        tag = "r" if self.role is Role.REDUCTION else "p"
        h = f":{self.hint}" if self.hint else ""
        return f"{self.name}{self.extent}{tag}{h}"


@dataclass(frozen=True, slots=True)
class Access:
    """An affine access ``operand[index_0, ..., index_{r-1}]``."""

    operand: str
    index: tuple[Index, ...]

    @property
    def dims(self) -> frozenset[str]:
        return frozenset(d for e in self.index for d in e.dims)

    def __str__(self) -> str:
        return f"{self.operand}[{', '.join(str(e) for e in self.index)}]"


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of a loop nest: ``writes op= f(reads)`` over ``dims``.

    ``constraints`` are affine expressions that must be >= 0 (e.g. ``s - t`` for a
    causal mask); without them the domain is the box of the dims' extents.
    ``flops_per_point`` counts floating-point operations per domain point (2 for a
    multiply-accumulate).
    """

    name: str
    dims: tuple[str, ...]
    reads: tuple[Access, ...]
    writes: tuple[Access, ...]
    flops_per_point: float = 1.0
    constraints: tuple[AffineExpr, ...] = ()

    def reduction_dims(self) -> tuple[str, ...]:
        written = frozenset().union(*(w.dims for w in self.writes)) if self.writes else frozenset()
        return tuple(d for d in self.dims if d not in written)


@dataclass(frozen=True)
class LoopNest:
    """The iteration space of an op: shared named dims and the statements over them."""

    dims: tuple[Dim, ...]
    statements: tuple[Statement, ...]

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate dim names in loop nest: {names}")
        known = set(names)
        for st in self.statements:
            for d in st.dims:
                if d not in known:
                    raise ValueError(f"statement {st.name!r} uses unknown dim {d!r}")
            for acc in st.reads + st.writes:
                bad = acc.dims - set(st.dims)
                if bad:
                    raise ValueError(f"access {acc} of statement {st.name!r} uses dims {sorted(bad)} "
                                     f"outside the statement's dims {st.dims}")

    @cached_property
    def _dim_map(self) -> dict[str, Dim]:
        return {d.name: d for d in self.dims}

    def dim(self, name: str) -> Dim:
        return self._dim_map[name]

    @property
    def extents(self) -> dict[str, int]:
        return {d.name: d.extent for d in self.dims}

    def role(self, name: str) -> str:
        return str(self.dim(name).role)

    def points(self, st: Statement) -> int:
        """Number of integer points of a statement's domain (exact, constraints included)."""
        return _domain_points(tuple((d, self.dim(d).extent) for d in st.dims), st.constraints)

    def flops(self) -> int:
        return self._flops

    @cached_property
    def _flops(self) -> int:  # a nest is an immutable value: count its points once
        return int(sum(self.points(st) * st.flops_per_point for st in self.statements))

    def operands(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for st in self.statements:
            for a in st.reads + st.writes:
                seen.setdefault(a.operand, None)
        return tuple(seen)

    def accesses(self, operand: str) -> Iterator[tuple[Statement, Access, bool]]:
        """All (statement, access, is_write) touching an operand."""
        for st in self.statements:
            for a in st.reads:
                if a.operand == operand:
                    yield st, a, False
            for a in st.writes:
                if a.operand == operand:
                    yield st, a, True

    def __str__(self) -> str:
        return " ".join(str(d) for d in self.dims)

    def describe(self) -> str:
        lines = [f"dims: {self}"]
        for st in self.statements:
            cons = "".join(f" | {c} >= 0" for c in st.constraints)
            lines.append(f"  {st.name}({', '.join(st.dims)}{cons}): "
                         f"{', '.join(map(str, st.writes))} <- {', '.join(map(str, st.reads))}")
        return "\n".join(lines)


def _domain_points(dims: tuple[tuple[str, int], ...], constraints: tuple[AffineExpr, ...]) -> int:
    box = math.prod(e for _, e in dims)
    if not constraints:
        return box
    return _constrained_points(dims, constraints)


_POINTS_CACHE: dict[tuple, int] = {}


def _constrained_points(dims: tuple[tuple[str, int], ...], constraints: tuple[AffineExpr, ...]) -> int:
    involved = sorted({d for c in constraints for d in c.dims})
    ext = dict(dims)
    free = math.prod(e for d, e in dims if d not in involved)
    # dims outside the constraints only multiply the count: key the cache by the rest
    key = (tuple((d, ext[d]) for d in involved), constraints)
    if key not in _POINTS_CACHE:
        _POINTS_CACHE[key] = _count_constrained(involved, ext, constraints)
    return _POINTS_CACHE[key] * free


def _count_constrained(involved: list[str], ext: dict[str, int], constraints: tuple[AffineExpr, ...]) -> int:
    """Integer points of the box over ``involved`` where every constraint is ``>= 0``.

    The last dim ``y`` is counted in closed form over a grid of the others: each constraint
    ``a·y + r >= 0`` (``r`` the rest, an integer) bounds ``y`` below by ``⌈−r/a⌉`` when
    ``a > 0``, above by ``⌊−r/a⌋`` when ``a < 0``, and filters the grid point when ``a = 0``;
    the count is ``max(0, min(upper) − max(lower) + 1)`` within ``[0, extent)``. So a causal
    mask over ``s, t`` costs ``O(s)``, not ``O(s·t)``.
    """
    if not involved:
        return int(all(c.const >= 0 for c in constraints))
    *rest, y = involved
    grids = np.meshgrid(*[np.arange(ext[d], dtype=np.int64) for d in rest], indexing="ij", sparse=True)
    env = dict(zip(rest, grids))
    shape = [ext[d] for d in rest]
    lo = np.zeros(shape, dtype=np.int64)
    hi = np.full(shape, ext[y] - 1, dtype=np.int64)
    ok = np.ones(shape, dtype=bool)
    for c in constraints:
        r = np.broadcast_to(np.asarray(sum((coef * env[d] for d, coef in c.terms if d != y), np.int64(c.const))),
                            shape)
        a = c.coef(y)
        if a > 0:
            lo = np.maximum(lo, -(r // a))  # ceil(-r / a)
        elif a < 0:
            hi = np.minimum(hi, r // -a)  # floor(r / -a)
        else:
            ok &= r >= 0
    return int(np.where(ok, np.clip(hi - lo + 1, 0, None), 0).sum())


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v


@lru_cache(maxsize=256)
def target_base(target: str) -> str:
    """An op target's base name, as rules that name kernels match it: ``aten.linear.default`` ->
    ``linear``; a synthetic graph's ``dropout`` and ONNX targets (``Gemm``, ``Dropout``) lower-cased."""
    parts = target.split(".")
    return (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1 if len(parts) == 1 else 0]).lower()


@dataclass(frozen=True, slots=True)
class Op:
    """One operator of the graph.

    Args:
        name: unique in the graph.
        kind: the op family (:class:`OpKind`).
        target: the source operator (``aten.addmm.default``, ``Gemm``).
        inputs / outputs: graph tensor names, positionally ``in0..`` / ``out0..``.
        nest: the loop nest, or ``None`` for an opaque op.
        attrs: source attributes that change the computation (stride, eps, ...).
        module: module path the op came from (``transformer.h.3.attn``), if known.
        opaque_reason: why the op has no loop nest (opaque ops only).
        flops_estimate: FLOP estimate of an opaque op (one per output element).
        source_node: the node of the source graph the op came from (the ``torch.export`` / fx node
            name, the ONNX node name): how an executor finds the op in its own capture of the model,
            whose node names need not be the op names. Not part of the signature.
    """

    name: str
    kind: OpKind
    target: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nest: LoopNest | None = None
    attrs: tuple[tuple[str, Any], ...] = ()
    module: str = ""
    opaque_reason: str | None = None
    flops_estimate: int = 0
    source_node: str = ""

    @property
    def is_opaque(self) -> bool:
        return self.nest is None

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def flops(self) -> int:
        return self.nest.flops() if self.nest is not None else self.flops_estimate

    def operand_name(self, operand: str) -> str | None:
        """Graph tensor name of a positional operand (``in1`` -> tensor name)."""
        if operand.startswith("in") and operand[2:].isdigit():
            i = int(operand[2:])
            return self.inputs[i] if i < len(self.inputs) else None
        if operand.startswith("out") and operand[3:].isdigit():
            i = int(operand[3:])
            return self.outputs[i] if i < len(self.outputs) else None
        return None


@dataclass
class Graph:
    """A DAG of ops in topological order, with the tensors they read and write."""

    name: str
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    source: str = ""  # "torch.export", "torch.fx", "onnx"
    warnings: list[str] = field(default_factory=list)
    # bumped by every change of the op list, so memos of derived values (the cost models') can
    # tell a graph built further from the one they priced
    version: int = field(default=0, compare=False, repr=False)

    # -- construction -------------------------------------------------------------------
    def add_tensor(self, spec: TensorSpec) -> TensorSpec:
        if spec.name in self.tensors and self.tensors[spec.name] != spec:
            raise ValueError(f"tensor {spec.name!r} defined twice with different specs")
        self.tensors[spec.name] = spec
        return spec

    def add_op(self, op: Op) -> Op:
        for t in op.inputs + op.outputs:
            if t not in self.tensors:
                raise ValueError(f"op {op.name!r} refers to unknown tensor {t!r}")
        self.ops.append(op)
        for cached in ("_producer", "_consumers"):
            self.__dict__.pop(cached, None)
        self.version += 1
        return op

    # -- queries ------------------------------------------------------------------------
    def shape(self, name: str) -> Shape:
        return self.tensors[name].shape

    @property
    def params(self) -> list[TensorSpec]:
        return [t for t in self.tensors.values() if t.kind is TensorKind.PARAM]

    def param_count(self) -> int:
        return sum(t.numel for t in self.params)

    def param_bytes(self) -> int:
        return sum(t.nbytes for t in self.params)

    def flops(self) -> int:
        """Forward FLOPs of one step on the example inputs."""
        return sum(op.flops for op in self.ops)

    def op_bytes(self, op: Op) -> int:
        """Bytes an op reads and writes from memory, counted once per tensor."""
        return sum(self.tensors[t].nbytes for t in dict.fromkeys(op.inputs + op.outputs))

    def bytes_moved(self) -> int:
        return sum(self.op_bytes(op) for op in self.ops)

    def producer(self, tensor: str) -> Op | None:
        return self._producer.get(tensor)

    def consumers(self, tensor: str) -> list[Op]:
        return self._consumers.get(tensor, [])

    @cached_property
    def _producer(self) -> dict[str, Op]:
        return {t: op for op in self.ops for t in op.outputs}

    @cached_property
    def _consumers(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                out.setdefault(t, []).append(op)
        return out

    def opaque_ops(self) -> list[Op]:
        return [op for op in self.ops if op.is_opaque]

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    def validate(self) -> None:
        """Check the DAG: every input defined before use, names unique."""
        defined = {n for n, t in self.tensors.items() if t.kind is not TensorKind.ACTIVATION}
        names: set[str] = set()
        for op in self.ops:
            if op.name in names:
                raise ValueError(f"duplicate op name {op.name!r}")
            names.add(op.name)
            for t in op.inputs:
                if t not in defined:
                    raise ValueError(f"op {op.name!r} reads {t!r} before it is produced")
            defined.update(op.outputs)
        for t in self.outputs:
            if t not in defined:
                raise ValueError(f"graph output {t!r} is never produced")

    def signature(self, op: Op) -> str:
        """Cache key of an op: kind, target, operand shapes/dtypes/kinds, attrs, loop nest.

        Two ops with the same signature compute the same thing and split the same way,
        so every later stage can price one and reuse it for the other.
        """
        payload = (
            str(op.kind),
            op.target,
            tuple((self.tensors[t].shape, self.tensors[t].dtype, str(self.tensors[t].kind)) for t in op.inputs),
            tuple((self.tensors[t].shape, self.tensors[t].dtype) for t in op.outputs),
            _freeze(op.attrs),
            repr(op.nest),
        )
        return hashlib.blake2b(repr(payload).encode(), digest_size=12).hexdigest()

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for op in self.ops:
            kinds[str(op.kind)] = kinds.get(str(op.kind), 0) + 1
        return {
            "name": self.name,
            "source": self.source,
            "ops": len(self.ops),
            "tensors": len(self.tensors),
            "params": self.param_count(),
            "param_bytes": self.param_bytes(),
            "flops": self.flops(),
            "bytes": self.bytes_moved(),
            "ops_by_kind": dict(sorted(kinds.items())),
            "opaque": sorted({op.target for op in self.opaque_ops()}),
        }

    # -- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def nest_dict(n: LoopNest | None) -> dict[str, Any] | None:
            if n is None:
                return None
            return {
                "dims": [{"name": d.name, "extent": d.extent, "role": str(d.role),
                          "hint": str(d.hint) if d.hint else None} for d in n.dims],
                "statements": [{"name": s.name, "dims": list(s.dims),
                                "reads": [str(a) for a in s.reads], "writes": [str(a) for a in s.writes],
                                "constraints": [f"{c} >= 0" for c in s.constraints],
                                "flops_per_point": s.flops_per_point} for s in n.statements],
            }

        return {
            "summary": self.summary(),
            "inputs": self.inputs,
            "outputs": self.outputs,
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "kind": str(t.kind),
                         "origin": t.origin} for t in self.tensors.values()],
            "ops": [{"name": op.name, "kind": str(op.kind), "target": op.target, "module": op.module,
                     "inputs": list(op.inputs), "outputs": list(op.outputs),
                     "attrs": {k: _jsonable(v) for k, v in op.attrs}, "flops": op.flops,
                     "signature": self.signature(op), "opaque_reason": op.opaque_reason,
                     "nest": nest_dict(op.nest)} for op in self.ops],
            "warnings": self.warnings,
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


def _jsonable(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float | int | str | bool) or v is None:
        return v
    return str(v)
