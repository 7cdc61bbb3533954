"""The walk over an FX graph, torch.export's or symbolic_trace's, into a :class:`GraphBuilder`.

:class:`_Walker` keeps what each FX node evaluates to (a graph tensor, a list of them, or a
Python value), binds an op's arguments to names with its ATen schema or Python signature
(:func:`_named_args`), and turns each call into one op: built by the handler registered for its
base name (:mod:`._registry`), elementwise or a creation where no handler names it
(:mod:`._elementwise`), opaque where nothing applies. :func:`_walk_export` is the walk of an
exported program; the symbolic_trace fallback's is in :mod:`._fx_fallback`.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx

from polyparallel.ir import Graph, OpKind, TensorKind

from .._builder import CaptureError, GraphBuilder
from . import _contraction, _normalisation, _reduction, _views  # noqa: F401  (importing a family registers its handlers)
from ._elementwise import _CREATE, _create, _pointwise, is_pointwise
from ._registry import HANDLERS, Call, TRef, _flat_args

_SKIP_PREFIXES = ("_assert", "sym_", "_set_grad_enabled", "_enter_", "_exit_", "_record_function")
_ALIAS_NO_OUTPUT = {"getitem"}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _tensor_meta(val: Any) -> tuple[tuple[int, ...], str] | None:
    if isinstance(val, _FakeVal):
        return tuple(int(s) for s in val.shape), _dtype_name(val.dtype)
    if isinstance(val, torch.Tensor):
        try:
            shape = tuple(int(s) for s in val.shape)
        except (TypeError, RuntimeError) as e:  # symbolic shapes
            raise CaptureError(f"tensor with a symbolic shape {tuple(val.shape)}: pass concrete example "
                               "inputs (dynamic shapes are not needed for planning)") from e
        return shape, _dtype_name(val.dtype)
    return None


def _base_name(target: Any) -> tuple[str, str]:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.removesuffix("_") if target.overloadpacket.__name__ not in (
            "__and__", "__or__") else target.overloadpacket.__name__, str(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__.removesuffix("_"), str(target)
    name = getattr(target, "__name__", str(target))
    return name.removesuffix("_") if not name.startswith("__") else name, f"{getattr(target, '__module__', '')}.{name}"


def _named_args(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Bind positional args to names with the op's schema (ATen) or signature (Python)."""
    schema = getattr(target, "_schema", None)
    out: dict[str, Any] = {}
    if schema is not None:
        for a, v in zip(schema.arguments, args):
            out[a.name] = v
        out.update(kwargs)
        return out
    try:
        sig = inspect.signature(target)
        if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
            # a dispatch wrapper such as F.max_pool2d: bind with the ATen schema of the same name
            aten = _aten_for(_base_name(target)[0])
            if aten is not None and hasattr(aten, "default"):
                return _named_args(aten.default, args, kwargs)
        bound = sig.bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        out = {f"arg{i}": v for i, v in enumerate(args)}
        if args:
            out["self"] = args[0]
        if len(args) > 1:
            out["other"] = args[1]
        out.update(kwargs)
        return out


def _aten_for(name: str) -> Any:
    return getattr(torch.ops.aten, name, None)


class _FakeVal:
    """Adapts fx ShapeProp's TensorMetadata to the tensor-meta reader."""

    def __init__(self, tm: Any) -> None:
        self.shape, self.dtype = tuple(tm.shape), tm.dtype


class _Walker:
    """Walks an FX graph (from torch.export or symbolic_trace) into a GraphBuilder."""

    def __init__(self, gb: GraphBuilder) -> None:
        self.gb = gb
        self.env: dict[torch.fx.Node, Any] = {}  # fx node -> TRef | list[TRef|None] | python value

    def tensor_for(self, node: torch.fx.Node, val: Any, kind: TensorKind, origin: str | None = None) -> Any:
        meta = _tensor_meta(val)
        if meta is not None:
            name = self.gb.unique(node.name, "tensor")
            self.gb.tensor(name, meta[0], meta[1], kind, origin)
            return TRef(name)
        if isinstance(val, list | tuple):
            outs = []
            for i, v in enumerate(val):
                m = _tensor_meta(v)
                if m is None:
                    outs.append(v if not isinstance(v, torch.Tensor) else None)
                    continue
                name = self.gb.unique(f"{node.name}_{i}", "tensor")
                self.gb.tensor(name, m[0], m[1], kind, origin)
                outs.append(TRef(name))
            return outs
        return val

    def resolve(self, v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return self.env.get(v)
        if isinstance(v, list | tuple):
            items = [self.resolve(x) for x in v]
            return tuple(items) if type(v) is tuple else items
        if isinstance(v, dict):
            return {k: self.resolve(x) for k, x in v.items()}
        return v

    def call(self, node: torch.fx.Node, name: str, target_str: str, target: Any, args: dict[str, Any],
             module: str) -> None:
        val = node.meta.get("val", node.meta.get("tensor_meta_val"))
        if name in _ALIAS_NO_OUTPUT or target is operator.getitem:
            src = args.get("a", args.get("arg0"))
            idx = args.get("b", args.get("arg1"))
            if isinstance(src, list | tuple) and isinstance(idx, int):
                self.env[node] = src[idx]
                return
            if isinstance(src, TRef):
                # tensor indexing through Python's getitem (fx path): opaque gather
                args = {"self": src, "index": idx}
                name, target_str = "getitem", "operator.getitem"
            else:
                self.env[node] = None
                return
        if val is None or name.startswith(_SKIP_PREFIXES):
            self.env[node] = None
            return
        out = self.tensor_for(node, val, TensorKind.ACTIVATION)
        outputs = [out] if isinstance(out, TRef) else [o for o in out if isinstance(o, TRef)] \
            if isinstance(out, list) else []
        self.env[node] = out
        if not outputs:
            return
        c = Call(name, target_str, args, outputs, module, _ShapeView(self.gb.graph))
        if name in HANDLERS:
            kind, ins, nest_fn = HANDLERS[name](c)
        elif name in _CREATE or name.startswith("_tensor_constant"):
            kind, ins, nest_fn = _create(c)
        elif is_pointwise(name, target):
            kind, ins, nest_fn = _pointwise(c)
        else:
            ins = list(dict.fromkeys(v for v in _flat_args(args) if isinstance(v, TRef)))
            kind, nest_fn = OpKind.OPAQUE, None
        ins = [t for t in ins if t is not None]
        self.gb.op(name, kind, target_str, ins, outputs, nest_fn,
                   attrs=_attrs(args), module=module, source_node=node.name)


class _ShapeView(dict):
    """Lazy name -> shape mapping over the graph's tensors."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self._g = graph

    def __getitem__(self, k: str) -> tuple[int, ...]:
        return self._g.tensors[k].shape

    def __contains__(self, k: object) -> bool:
        return k in self._g.tensors


def _attrs(args: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in args.items():
        if isinstance(v, TRef) or v is None:
            continue
        if isinstance(v, list | tuple):
            if any(isinstance(x, TRef) for x in _flat_args(v)):
                continue
            v = tuple(x if isinstance(x, int | float | bool | str) or x is None else str(x) for x in v)
        elif not isinstance(v, int | float | bool | str):
            v = str(v)
        out[k] = v
    return out


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export prefixes paths like "L__self__.h.0"; keep the user-facing dotted path
    return str(path).removeprefix("L['self'].").removeprefix("L__self__.")


def _walk_export(model: torch.nn.Module, nodes: Any, inputs: dict[str, tuple[str, str | None]],
                 graph_module: torch.fx.GraphModule, name: str) -> Graph:
    """The Graph IR of an exported node sequence; ``inputs`` as :func:`.._fold.input_kinds` gives them."""
    gb = GraphBuilder(name, "torch.export")
    w = _Walker(gb)
    kind_map = {"PARAMETER": TensorKind.PARAM, "BUFFER": TensorKind.BUFFER, "CONSTANT_TENSOR": TensorKind.CONST,
                "USER_INPUT": TensorKind.INPUT, "CUSTOM_OBJ": TensorKind.CONST, "TOKEN": TensorKind.CONST}
    graph = gb.graph
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    by_identity: dict[int, TRef] = {}  # tied weights (lm_head = wte) are one tensor
    for node in nodes:
        if node.op == "placeholder":
            spec = inputs.get(node.name)
            kind = kind_map.get(spec[0], TensorKind.INPUT) if spec else TensorKind.INPUT
            origin = spec[1] if spec is not None and spec[1] else None
            obj = state.get(origin) if origin else None
            if obj is not None and id(obj) in by_identity:
                w.env[node] = by_identity[id(obj)]
                continue
            ref = w.tensor_for(node, node.meta.get("val"), kind, origin)
            if obj is not None and isinstance(ref, TRef):
                by_identity[id(obj)] = ref
            w.env[node] = ref
            if kind is TensorKind.INPUT and isinstance(ref, TRef):
                graph.inputs.append(ref)
        elif node.op == "call_function":
            bname, tstr = _base_name(node.target)
            args = _named_args(node.target, w.resolve(node.args), w.resolve(dict(node.kwargs)))
            if node.target is operator.getitem:
                args = {"a": w.resolve(node.args[0]), "b": node.args[1]}
            w.call(node, bname, tstr, node.target, args, _module_path(node))
        elif node.op == "output":
            for v in _flat_args(w.resolve(node.args[0])):
                if isinstance(v, TRef):
                    graph.outputs.append(v)
        elif node.op == "get_attr":
            w.env[node] = w.tensor_for(node, getattr(graph_module, node.target, None), TensorKind.CONST,
                                       str(node.target))
    # parameters the export lifted but no op uses still count (they are trained)
    return gb.finish()
