"""ONNX frontend: an ``.onnx`` file or ``onnx.ModelProto`` -> the loop-nest :class:`~polyparallel.ir.Graph`.

Capture runs in four steps:

1. **Load** without external weight data (only initializer shapes are needed, so a
   model whose weights live in side files is captured without reading them), and
   reject what is not an ONNX model with a :class:`CaptureError` that names the file.
2. **Shapes**: symbolic input dims are bound from ``dim_values`` (``{"batch": 8}``),
   then ``onnx.shape_inference`` (strict, with data propagation; non-strict as a
   fallback) gives every tensor a concrete shape.
3. **Constants**: initializers, ``Constant`` nodes, and nodes whose inputs are all
   small constants (shape plumbing such as ``Shape -> Gather -> Concat -> Reshape``)
   are evaluated at capture time with the ONNX reference implementation. They become
   ``CONST`` tensors, not ops: they cost nothing at run time, as in any ONNX runtime.
4. **Ops**: every other node becomes one op built through the same
   :mod:`polyparallel.ops` builders as the torch frontend. An op without an affine model
   (or whose model disagrees with the inferred output shapes) is kept as an opaque op.

Initializers are classified by what the exporter recorded (torch.onnx's dynamo exporter
tags each one PARAMETER / BUFFER / CONSTANT_TENSOR), else by use: a floating-point
initializer of rank >= 1 read as data (not as a shape, axes, pads or clip bound) is a
trainable ``PARAM``; the running statistics of ``BatchNormalization`` are ``BUFFER`` s;
everything else is ``CONST``.

Examples:
    >>> import onnx
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> import numpy as np
    >>> w = numpy_helper.from_array(np.zeros((4, 8), np.float32), "fc.weight")
    >>> node = helper.make_node("Gemm", ["x", "fc.weight"], ["y"], transB=1, name="/fc/Gemm")
    >>> g = helper.make_graph([node], "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
    ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    >>> graph = capture_onnx(helper.make_model(g))
    >>> graph.param_count(), graph.flops()   # 4*8 weights; 2*2*4*8 multiply-adds
    (32, 128)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from polyparallel import ops
from polyparallel.ir import ANY, Access, AffineExpr, Dim, E, Graph, LoopNest, OpKind, Role, Statement, TensorKind

from .._builder import CaptureError, GraphBuilder

__all__ = ["capture_onnx"]

Shape = tuple[int, ...]
NestFn = Callable[[], LoopNest]
Spec = tuple[OpKind, NestFn | None]

# Constant folding bounds: inputs and outputs larger than this stay run-time ops.
_FOLD_MAX_ELEMS = 4096
# Initializers up to this size have their values read (shape tensors, axes, pads...).
_READ_MAX_ELEMS = 1 << 16
_NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"}
_FLOAT_TYPES = {"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8e4m3fnuz",
                "float8e5m2fnuz", "float4e2m1", "float8e8m0"}

_DTYPES: dict[int, str] = {
    TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64", TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16", TensorProto.INT64: "int64", TensorProto.INT32: "int32",
    TensorProto.INT16: "int16", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16", TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool", TensorProto.STRING: "string", TensorProto.COMPLEX64: "complex64",
    TensorProto.COMPLEX128: "complex128", TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
    TensorProto.FLOAT8E5M2: "float8_e5m2",
}

_ELEM = {v: k for k, v in _DTYPES.items()}
_SEQUENCE_OPS = {"SplitToSequence", "SequenceConstruct", "SequenceAt", "SequenceLength", "ConcatFromSequence"}
# Ops whose outputs all have the shape of their first input.
_SAME_SHAPE = {"Dropout", "Identity", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "LRN",
               "BatchNormalization", "Clip", "Elu", "Selu", "Abs", "Neg", "Exp", "Log", "Sqrt", "Erf"}

# Inputs (by position) that act as attributes: shapes, axes, pads, bounds. A float
# initializer read only through these is a constant, not a trainable parameter.
_ATTR_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 2, 3}), "Clip": frozenset({1, 2}), "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}), "Tile": frozenset({1}), "Split": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), "TopK": frozenset({1}), "ConstantOfShape": frozenset({0}),
    "Range": frozenset({0, 1, 2}), "OneHot": frozenset({1, 2}), "CumSum": frozenset({1}),
    "Dropout": frozenset({1, 2}), "Pow": frozenset({1}), "ReduceSum": frozenset({1}),
    "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}), "ReduceMin": frozenset({1}),
    "ReduceProd": frozenset({1}), "ReduceL1": frozenset({1}), "ReduceL2": frozenset({1}),
    "ReduceLogSum": frozenset({1}), "ReduceLogSumExp": frozenset({1}), "ReduceSumSquare": frozenset({1}),
    "Trilu": frozenset({1}), "CenterCropPad": frozenset({1, 2}), "DFT": frozenset({1, 2}),
}
_BUFFER_INPUTS: dict[str, frozenset[int]] = {"BatchNormalization": frozenset({3, 4})}
_EXPORT_KINDS = {"PARAMETER": TensorKind.PARAM, "BUFFER": TensorKind.BUFFER, "CONSTANT_TENSOR": TensorKind.CONST}


def capture_onnx(model: str | Path | onnx.ModelProto, *, name: str | None = None,
                 dim_values: Mapping[str, int] | None = None,
                 input_shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """Capture an ONNX model into the Graph IR.

    Args:
        model: path to an ``.onnx`` file, or an ``onnx.ModelProto``.
        name: graph name (default: the ONNX graph name, else the file stem).
        dim_values: values of symbolic dims (``dim_param``), e.g. ``{"batch": 8, "seq": 128}``.
            An input dim with neither a value nor a name is addressed as ``"input_name:axis"``.
        input_shapes: full shapes for graph inputs, overriding what the model declares.

    Returns:
        The captured graph (``source="onnx"``).

    Raises:
        CaptureError: the file is not ONNX or is truncated, an input has an unbound
            symbolic dim, or a tensor's shape cannot be inferred.
    """
    where, proto = _load(model)
    return _Capture(proto, where, name, dict(dim_values or {}), dict(input_shapes or {})).run()


# ------------------------------------------------------------------------------------------
# loading


def _load(model: str | Path | onnx.ModelProto) -> tuple[str, onnx.ModelProto]:
    if isinstance(model, onnx.ModelProto):
        where, proto = "<ModelProto>", model
    else:
        path = Path(model)
        where = str(path)
        if not path.is_file():
            raise CaptureError(f"ONNX file {where} does not exist (or is not a file); check the path")
        data = path.read_bytes()
        if not data:
            raise CaptureError(f"{where} is empty; re-export the model")
        try:
            proto = onnx.load_model_from_string(data)
        except Exception as e:  # protobuf DecodeError and friends
            raise CaptureError(f"{where} is not a readable ONNX model ({type(e).__name__}: {e}); the file is "
                               "either not ONNX or truncated — re-export or re-download it") from e
    if not proto.HasField("graph") or not proto.opset_import or proto.ir_version <= 0:
        missing = [w for w, ok in (("graph", proto.HasField("graph")), ("opset_import", bool(proto.opset_import)),
                                   ("ir_version", proto.ir_version > 0)) if not ok]
        raise CaptureError(f"{where} is not a complete ONNX model (missing {', '.join(missing)}); the file is "
                           "either not ONNX or truncated — re-export or re-download it")
    if proto.functions:
        try:
            from onnx import inliner

            proto = inliner.inline_local_functions(proto)
        except Exception as e:  # keep going: function calls then stay opaque
            warnings.warn(f"{where}: could not inline model-local functions ({e})", stacklevel=3)
    return where, proto


def _dtype(elem_type: int) -> str:
    if elem_type in _DTYPES:
        return _DTYPES[elem_type]
    try:
        return TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return "float32"


def _attr_value(a: AttributeProto) -> Any:
    """An attribute as a hashable Python value (tensors and graphs are summarised)."""
    if a.type == AttributeProto.TENSOR:
        return f"tensor{list(a.t.dims)}"
    if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
        return "graph"
    if a.type in (AttributeProto.TENSORS, AttributeProto.SPARSE_TENSOR, AttributeProto.SPARSE_TENSORS,
                  AttributeProto.TYPE_PROTO, AttributeProto.TYPE_PROTOS):
        return str(AttributeProto.AttributeType.Name(a.type)).lower()
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, list):
        return tuple(x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v)
    return v


def _module_of(node: onnx.NodeProto) -> str:
    """Module path of a node: ``/transformer/h.0/attn/MatMul`` -> ``transformer.h.0.attn``."""
    for p in node.metadata_props:
        if p.key == "namespace" and p.value:
            # torch.onnx (dynamo): "name: Class/child.path: Class/.../op: aten.op.default",
            # each name the full dotted path of a module; the last non-op entry is the module
            mods = [name.strip() for name, _, cls in (e.partition(":") for e in p.value.split("/"))
                    if name.strip() and not cls.strip().startswith(("aten.", "prims.", "torch.ops", "<built-in"))]
            return mods[-1] if mods else ""
    if "/" in node.name:
        return ".".join(p for p in node.name.split("/")[:-1] if p)
    return node.name


# ------------------------------------------------------------------------------------------
# the capture


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
            raise ops.Unsupported(f"{self.op_type} with a run-time {what} (input {i}) is not modelled")
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


class _Capture:
    def __init__(self, proto: onnx.ModelProto, where: str, name: str | None, dim_values: dict[str, int],
                 input_shapes: dict[str, Sequence[int]]) -> None:
        self.proto, self.where = proto, where
        self.dim_values, self.input_shapes = dim_values, input_shapes
        self.opsets = {(i.domain or "ai.onnx"): i.version for i in proto.opset_import}
        self.opset = self.opsets.get("ai.onnx", 1)
        gname = name or proto.graph.name or (Path(where).stem if where != "<ModelProto>" else "onnx_model")
        self.b = GraphBuilder(gname, "onnx")
        self.shapes: dict[str, Shape] = {}
        self.values: dict[str, np.ndarray] = {}
        self.inferred: dict[str, tuple[str, list[int | str | None]]] = {}
        self.infer_note = ""
        self.folded: dict[str, int] = {}
        self.nontensor: dict[str, str] = {}  # sequence / map / optional values
        self.seqs: dict[str, list[str]] = {}  # sequence -> its element tensors
        self.copies: dict[str, tuple[str, TensorKind]] = {}  # Identity(initializer) -> (source, kind)

    # -- shapes ----------------------------------------------------------------------------
    def _bind_inputs(self) -> onnx.ModelProto:
        """A skeleton of the model (large initializers without data) with input dims bound."""
        g = self.proto.graph
        sk = onnx.ModelProto()
        sk.ir_version, sk.producer_name = self.proto.ir_version, self.proto.producer_name
        sk.opset_import.extend(self.proto.opset_import)
        sg = sk.graph
        sg.name = g.name
        sg.node.extend(g.node)
        sg.output.extend(g.output)
        sg.value_info.extend(g.value_info)
        init_names = set()
        for t in g.initializer:
            init_names.add(t.name)
            if math.prod(t.dims) <= _READ_MAX_ELEMS and t.data_location != TensorProto.EXTERNAL:
                sg.initializer.append(t)
            else:
                sg.initializer.append(TensorProto(name=t.name, dims=t.dims, data_type=t.data_type))
        for vi in g.input:
            vi2 = onnx.ValueInfoProto()
            vi2.CopyFrom(vi)
            if vi.name not in init_names:
                self._bind_input(vi2)
            sg.input.append(vi2)
        return sk

    def _bind_input(self, vi: onnx.ValueInfoProto) -> None:
        tt = vi.type.tensor_type  # run() has rejected non-tensor inputs
        if vi.name in self.input_shapes:
            shape = [int(x) for x in self.input_shapes[vi.name]]
            tt.shape.Clear()
            for e in shape:
                tt.shape.dim.add().dim_value = e
            return
        if not tt.HasField("shape"):
            raise CaptureError(f"{self.where}: graph input {vi.name!r} has no shape; pass "
                               f"input_shapes={{{vi.name!r}: [...]}} or re-export the model with shapes")
        for axis, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value >= 0:
                continue
            key = d.dim_param if d.HasField("dim_param") and d.dim_param else f"{vi.name}:{axis}"
            alt = f"{vi.name}:{axis}"
            val = self.dim_values.get(key, self.dim_values.get(alt))
            if val is None:
                raise CaptureError(f"{self.where}: graph input {vi.name!r} has a dynamic dim {key!r} (axis "
                                   f"{axis}); pass dim_values={{{key!r}: N}} (CLI: --dim {key}=N) to fix it")
            d.Clear()
            d.dim_value = int(val)

    def _infer(self, sk: onnx.ModelProto) -> onnx.ModelProto:
        from onnx import shape_inference

        errors = []
        for strict in (True, False):
            try:
                return shape_inference.infer_shapes(sk, check_type=False, strict_mode=strict, data_prop=True)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        self.infer_note = "; ".join(errors)
        return sk

    def _infer_contrib(self, sk: onnx.ModelProto) -> None:
        """onnxruntime's symbolic shape inference, which knows its ``com.microsoft`` ops.

        ONNX's inference stops at ops it does not know (an ORT-optimised model's
        ``SkipLayerNormalization``, ``FastGelu``...), leaving everything after them
        without shapes. Shapes already known are kept.
        """
        try:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
        except ImportError:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = SymbolicShapeInference.infer_shapes(sk, auto_merge=True, guess_output_rank=True)
        except Exception as e:
            self.infer_note = (self.infer_note + "; " if self.infer_note else "") + f"onnxruntime: {e}"
            return
        if m is None:
            return
        before = {k: v for k, v in self.inferred.items() if self._known(k)}
        self._read_value_infos(m)
        self.inferred.update(before)

    def _read_value_infos(self, m: onnx.ModelProto) -> None:
        g = m.graph
        for vi in [*g.input, *g.output, *g.value_info]:
            if not vi.type.HasField("tensor_type"):
                kind = vi.type.WhichOneof("value")
                if kind:
                    self.nontensor[vi.name] = kind.replace("_type", "")
                continue
            tt = vi.type.tensor_type
            dims: list[int | str | None] | None = None
            if tt.HasField("shape"):
                dims = []
                for d in tt.shape.dim:
                    if d.HasField("dim_value"):
                        dims.append(int(d.dim_value))
                    elif d.HasField("dim_param") and d.dim_param:
                        dims.append(d.dim_param)
                    else:
                        dims.append(None)
            prev = self.inferred.get(vi.name)
            if dims is not None or prev is None:
                self.inferred[vi.name] = (_dtype(tt.elem_type) if tt.elem_type else "float32", dims)

    def _concrete(self, tensor: str, node: onnx.NodeProto | None) -> Shape:
        if tensor in self.values:
            return tuple(int(x) for x in self.values[tensor].shape)
        dtype_dims = self.inferred.get(tensor)
        dims = dtype_dims[1] if dtype_dims else None
        where = (f"output of node {node.name or node.op_type!r} ({node.op_type})" if node is not None
                 else "graph tensor")
        if dims is None and tensor in self.nontensor:
            raise CaptureError(f"{self.where}: {tensor!r} ({where}) has type {self.nontensor[tensor]}, not tensor; "
                               "polyparallel models tensor programs only — remove sequence/map/optional "
                               "values from the model (e.g. export without them)")
        if dims is None:
            note = f" (shape inference: {self.infer_note})" if self.infer_note else ""
            raise CaptureError(f"{self.where}: cannot determine the shape of tensor {tensor!r}, {where}{note}; "
                               "add value_info for it (e.g. run onnxruntime's symbolic_shape_infer) or pass "
                               "input_shapes/dim_values")
        out = []
        for axis, d in enumerate(dims):
            if isinstance(d, int) and d >= 0:
                out.append(d)
            elif isinstance(d, str) and d in self.dim_values:
                out.append(int(self.dim_values[d]))
            else:
                raise CaptureError(f"{self.where}: tensor {tensor!r} ({where}) has a data-dependent or unknown "
                                   f"dim {d!r} at axis {axis}; pass dim_values={{{d!r}: N}} if it is symbolic")
        return tuple(out)

    def _known(self, tensor: str) -> bool:
        dims = self.inferred.get(tensor, ("", None))[1]
        return dims is not None and all((isinstance(d, int) and d >= 0) or d in self.dim_values for d in dims)

    def _infer_node(self, n: onnx.NodeProto) -> None:
        """Shape inference of one node, its inputs' shapes and capture-time values made concrete.

        Whole-model inference loses shapes where an input is computed by ops it cannot
        evaluate (``axes = Range(...)``); here those inputs are constants we folded.
        """
        from onnx import shape_inference

        names = [x for x in dict.fromkeys(n.input) if x]
        if any(x not in self.values and x not in self.b.graph.tensors for x in names):
            return  # reads a sequence: nothing to infer from here
        ins, inits = [], []
        for x in names:
            if x in self.values:
                inits.append(numpy_helper.from_array(self.values[x], x))
            else:
                ins.append(helper.make_tensor_value_info(x, _ELEM.get(self.b.graph.tensors[x].dtype,
                                                                   TensorProto.FLOAT),
                                                         self.shapes[x]))
        outs = [helper.make_value_info(o, onnx.TypeProto()) for o in n.output if o]
        m = helper.make_model(helper.make_graph([n], "node", ins, outs, inits),
                              opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)
        try:
            m = shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
        except Exception:
            return
        before = dict(self.inferred)
        self._read_value_infos(m)
        for x in names:  # the single-node model must not overwrite what we know of its inputs
            if x in before:
                self.inferred[x] = before[x]

    # -- constants -------------------------------------------------------------------------
    def _init_value(self, t: TensorProto) -> np.ndarray | None:
        if math.prod(t.dims) > _READ_MAX_ELEMS:
            return None
        try:
            if t.data_location == TensorProto.EXTERNAL:
                if self.where == "<ModelProto>":
                    return None
                from onnx.external_data_helper import load_external_data_for_tensor

                t2 = TensorProto()
                t2.CopyFrom(t)
                load_external_data_for_tensor(t2, str(Path(self.where).parent))
                return numpy_helper.to_array(t2)
            return numpy_helper.to_array(t)
        except Exception:
            return None

    def _constant_node(self, n: onnx.NodeProto) -> np.ndarray:
        a = n.attribute[0]
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "sparse_value":
            from onnx.reference import ReferenceEvaluator

            return ReferenceEvaluator(self._single(n, [])).run(None, {})[0]
        v = helper.get_attribute_value(a)
        dt = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
              "value_ints": np.int64}.get(a.name)
        return np.array(v, dtype=dt) if dt is not None else np.array(v)

    def _single(self, n: onnx.NodeProto, names: list[str]) -> onnx.ModelProto:
        ins = [helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(self.values[x].dtype),
                                             self.values[x].shape) for x in names]
        outs = [helper.make_value_info(o, onnx.TypeProto()) for o in n.output if o]
        g = helper.make_graph([n], "fold", ins, outs)
        return helper.make_model(g, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)

    def _try_fold(self, n: onnx.NodeProto, param_inputs: set[str]) -> bool:
        """Evaluate a node whose inputs are all small constants; True if its outputs are now known."""
        if n.domain not in ("", "ai.onnx") or n.op_type in _NONDETERMINISTIC:
            return False
        if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in n.attribute):
            return False
        names = [x for x in n.input if x]
        if n.op_type in ("Shape", "Size") and names and names[0] in self.shapes:
            shape = self.shapes[names[0]]
            if n.op_type == "Size":
                self.values[n.output[0]] = np.array(math.prod(shape), dtype=np.int64)
            else:
                start, end = 0, None
                for a in n.attribute:
                    if a.name == "start":
                        start = a.i
                    elif a.name == "end":
                        end = a.i
                self.values[n.output[0]] = np.array(shape[start:end], dtype=np.int64)
            return True
        if (n.op_type == "CastLike" and len(names) == 2 and names[0] in self.values
                and names[0] not in param_inputs and names[1] in self.b.graph.tensors):
            dt = self.b.graph.tensors[names[1]].dtype
            try:
                self.values[n.output[0]] = self.values[names[0]].astype(dt)
                return True
            except TypeError:
                return False
        if not names or any(x not in self.values or x in param_inputs for x in names):
            return False
        if any(self.values[x].size > _FOLD_MAX_ELEMS for x in names):
            return False
        for o in n.output:
            dims = self.inferred.get(o, ("", None))[1] if o else None
            if dims is not None and all(isinstance(d, int) for d in dims) and math.prod(dims) > _FOLD_MAX_ELEMS:
                return False
        try:
            from onnx.reference import ReferenceEvaluator

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = ReferenceEvaluator(self._single(n, names)).run(None, {x: self.values[x] for x in names})
        except Exception:
            return False
        outs = [o for o in n.output if o]
        if len(res) != len(outs) or any(not isinstance(r, np.ndarray) or r.size > _FOLD_MAX_ELEMS for r in res):
            return False
        for o, r in zip(outs, res):
            self.values[o] = r
        return True

    # -- tensors ---------------------------------------------------------------------------
    def _classify_initializers(self) -> dict[str, TensorKind]:
        """Kind of each initializer, and of each ``Identity`` copy of one, from how it is read.

        torch.onnx (TorchScript) merges parameters that hold equal values (every LayerNorm
        weight starts as ones) into one initializer and re-creates the others as
        ``Identity`` outputs; such a copy is a parameter of its own, as in the source model.
        """
        g = self.proto.graph
        uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in g.node:
            for i, x in enumerate(n.input):
                if x:
                    uses.setdefault(x, []).append((n, i))

        def usage(name: str, depth: int = 0) -> tuple[bool, bool]:
            data = buf = False
            for n, i in uses.get(name, ()):
                if n.op_type == "Identity" and depth < 8:
                    d, b = usage(n.output[0], depth + 1)
                    data, buf = data or d, buf or b
                elif i in _BUFFER_INPUTS.get(n.op_type, frozenset()):
                    buf = True
                elif i not in _ATTR_INPUTS.get(n.op_type, frozenset()):
                    data = True
            return data, buf

        # torch.onnx (dynamo) records what each initializer was in the torch.export signature
        declared: dict[str, TensorKind] = {}
        for vi in [*g.value_info, *g.input]:
            for p in vi.metadata_props:
                if p.key == "pkg.torch.export.graph_signature.InputSpec.kind" and p.value in _EXPORT_KINDS:
                    declared[vi.name] = _EXPORT_KINDS[p.value]

        def kind(name: str, dtype: str, rank: int) -> TensorKind:
            if name in declared:
                return declared[name]
            data, buf = usage(name)
            if buf and not data:
                return TensorKind.BUFFER
            if dtype in _FLOAT_TYPES and rank >= 1 and data:
                return TensorKind.PARAM
            return TensorKind.CONST

        kinds = {}
        for t in g.initializer:
            dtype = _dtype(t.data_type)
            kinds[t.name] = kind(t.name, dtype, len(t.dims))
            for n, _ in uses.get(t.name, ()):
                if n.op_type == "Identity" and n.output and n.output[0]:
                    self.copies[n.output[0]] = (t.name, kind(n.output[0], dtype, len(t.dims)))
        return kinds

    def _add(self, name: str, kind: TensorKind, origin: str | None = None,
             node: onnx.NodeProto | None = None) -> None:
        if name in self.b.graph.tensors:
            return
        shape = self._concrete(name, node)
        self.shapes[name] = shape
        dtype = self.inferred.get(name, ("float32", None))[0]
        if name in self.values:
            dtype = _np_dtype_name(self.values[name].dtype)
        self.b.tensor(name, shape, dtype, kind, origin)

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> Graph:
        g = self.proto.graph
        inits = {t.name: t for t in g.initializer}
        for vi in g.input:  # inputs (not initializers) need types we can read before inference
            if vi.name not in inits and not vi.type.HasField("tensor_type"):
                kind = vi.type.WhichOneof("value") or "untyped"
                raise CaptureError(f"{self.where}: graph input {vi.name!r} has type {kind.replace('_type', '')}; "
                                   "only tensor inputs are supported")
        skeleton = self._bind_inputs()
        inferred = self._infer(skeleton)
        self._read_value_infos(inferred)
        if any(n.domain not in ("", "ai.onnx") for n in g.node) and not all(
                self._known(o) for n in g.node for o in n.output if o and o not in self.nontensor):
            self._infer_contrib(skeleton)
        kinds = self._classify_initializers()
        for t in g.initializer:
            self.inferred[t.name] = (_dtype(t.data_type), list(t.dims))
            v = self._init_value(t) if kinds[t.name] is not TensorKind.PARAM else None
            if v is not None:
                self.values[t.name] = v
            self._add(t.name, kinds[t.name], origin=t.name)
        for vi in g.input:
            if vi.name in inits:
                continue
            self._add(vi.name, TensorKind.INPUT, origin=vi.name)
            self.b.graph.inputs.append(vi.name)
            if 0 in self.shapes[vi.name]:  # an empty input's value is known: no elements (e.g. axes=[])
                with contextlib.suppress(TypeError):  # dtypes numpy lacks (bfloat16) stay unknown
                    self.values[vi.name] = np.zeros(self.shapes[vi.name], self.b.graph.tensors[vi.name].dtype)
        params = {n for n, k in kinds.items() if k is not TensorKind.CONST}
        params |= {o for o, (_, k) in self.copies.items() if k is not TensorKind.CONST}
        self.bias_adds = _bias_adds(g, {n for n, k in kinds.items() if k is TensorKind.PARAM}, inits,
                                    {o.name for o in g.output})
        skip = {id(add) for add in self.bias_adds.values()}
        for node in _toposort(g, set(inits) | {vi.name for vi in g.input}, self.where):
            if id(node) in skip:
                continue
            if node.op_type == "MatMul" and node.output[0] in self.bias_adds:
                node = _fuse_bias(node, self.bias_adds[node.output[0]])
            self._node(node, params)
        for o in g.output:  # a sequence output stands for its elements
            self.b.graph.outputs.extend(self.seqs.get(o.name, [o.name] if o.name else []))
        graph = self.b.finish()
        if self.infer_note:
            graph.warnings.append(f"ONNX shape inference failed ({self.infer_note}); used declared shapes")
        if self.folded:
            graph.warnings.append("constant-folded at capture time: "
                                  + ", ".join(f"{k} x{v}" for k, v in sorted(self.folded.items())))
        return graph

    def _node(self, n: onnx.NodeProto, params: set[str]) -> None:
        outs = [o for o in n.output if o]
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            try:
                self.values[n.output[0]] = self._constant_node(n)
            except Exception as e:
                raise CaptureError(f"{self.where}: Constant node {n.name!r} has no readable value ({e})") from e
            self._add(n.output[0], TensorKind.CONST, origin=n.name or None, node=n)
            return
        if n.op_type == "Identity" and outs and outs[0] in self.copies:
            src, kind = self.copies[outs[0]]
            if src in self.values:
                self.values[outs[0]] = self.values[src]
            self.inferred[outs[0]] = self.inferred[src]
            self._add(outs[0], kind, origin=outs[0], node=n)
            key = "Identity (copy of an initializer)"
            self.folded[key] = self.folded.get(key, 0) + 1
            return
        if n.domain in ("", "ai.onnx") and n.op_type in _SEQUENCE_OPS:
            self._sequence_node(n)
            return
        if self._try_fold(n, params):
            self.folded[n.op_type] = self.folded.get(n.op_type, 0) + 1
            for o in outs:
                self._add(o, TensorKind.CONST, origin=n.name or None, node=n)
            return
        if not all(self._known(o) for o in outs):
            self._infer_node(n)
        if n.op_type in _SAME_SHAPE and n.input and n.input[0] in self.shapes:
            # e.g. the unused mask of an old-opset Dropout, which shape inference leaves out
            src = self.b.graph.tensors[n.input[0]]
            for o in outs:
                if not self._known(o):
                    dtype = "bool" if (n.op_type == "Dropout" and o != n.output[0]) else src.dtype
                    self.inferred[o] = (dtype, list(src.shape))
        for o in outs:
            self._add(o, TensorKind.ACTIVATION, node=n)
        view = _Node(n, list(n.input), self.shapes, self.values, self.opset)
        target = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        handler = (_HANDLERS.get(n.op_type) if n.domain in ("", "ai.onnx")
                   else _HANDLERS.get(n.op_type) if n.domain == "com.microsoft" and n.op_type in _CONTRIB else None)
        if handler is None:
            kind, fn, reason = OpKind.OPAQUE, None, f"no loop-nest model for ONNX op {target}"
        else:
            reason = None
            try:
                kind, fn = handler(view)
            except ops.Unsupported as e:
                kind, fn, reason = OpKind.OPAQUE, None, str(e)
        checked = _checked(fn, view.outs, target) if fn is not None else None
        attrs = {a.name: _attr_value(a) for a in n.attribute}
        ins = [x for x in n.input if x]  # positional: in1 may repeat in0 (Mul(x, x))
        # a control-flow body reads outer tensors by name: they are inputs of the op too
        ins += [x for x in _outer_reads(n) if x in self.b.graph.tensors and x not in ins]
        self.b.op(n.name or n.op_type, kind, target, ins, outs, checked, attrs=attrs,
                  module=_module_of(n), reason=reason)


    # -- sequences of known tensors (SplitToSequence -> SequenceAt, as torch.onnx exports split) --
    def _sequence_node(self, n: onnx.NodeProto) -> None:
        """Sequences whose elements are known tensors: a split, element picks, a concat.

        The sequence itself is no tensor; it is a list of element tensors, and the ops
        on it become ops on those elements (SPLIT, identity VIEW, CONCAT).
        """
        ins = list(n.input)
        out = n.output[0]
        target = n.op_type
        if target == "SequenceConstruct":
            self.seqs[out] = [x for x in ins if x]
            return
        if target == "SplitToSequence":
            x = ins[0]
            shape = self.shapes[x]
            axis = int(_attr(n, "axis", 0)) % len(shape)
            keep = bool(_attr(n, "keepdims", 1))
            split = self.values.get(ins[1]) if len(ins) > 1 and ins[1] else None
            if len(ins) > 1 and ins[1] and split is None:
                raise CaptureError(f"{self.where}: SplitToSequence {n.name!r} splits by a run-time tensor; "
                                   "re-export with constant split sizes")
            if split is None:
                sizes = [1] * shape[axis]
            elif split.ndim == 0:
                step = int(split)
                sizes = [min(step, shape[axis] - i) for i in range(0, shape[axis], step)]
            else:
                sizes = [int(v) for v in split.reshape(-1)]
            elems = []
            for i, sz in enumerate(sizes):
                es = list(shape)
                es[axis] = sz
                if split is None and not keep:
                    del es[axis]
                name = self.b.unique(f"{out}.{i}", "tensor")
                self.b.tensor(name, es, self.b.graph.tensors[x].dtype)
                self.shapes[name] = tuple(es)
                elems.append(name)
            self.seqs[out] = elems
            squeeze = split is None and not keep
            self.b.op(n.name or target, OpKind.SPLIT, target, [x for x in ins if x], elems,
                      None if squeeze else _checked(lambda: ops.split(shape, sizes, axis),
                                                    [self.shapes[e] for e in elems], target),
                      attrs={a.name: _attr_value(a) for a in n.attribute}, module=_module_of(n),
                      reason="split into squeezed elements" if squeeze else None)
            return
        seq = self.seqs.get(ins[0])
        if seq is None:
            raise CaptureError(f"{self.where}: node {n.name or target!r} ({target}) reads the sequence "
                               f"{ins[0]!r}, which is not built from known tensors; polyparallel models "
                               "tensor programs only")
        if target == "SequenceLength":
            self.values[out] = np.array(len(seq), dtype=np.int64)
            self._add(out, TensorKind.CONST, origin=n.name or None, node=n)
            return
        if target == "SequenceAt":
            pos = self.values.get(ins[1])
            if pos is None:
                raise CaptureError(f"{self.where}: SequenceAt {n.name!r} picks a run-time position; "
                                   "re-export with constant indices")
            elem = seq[int(pos)]
            self.inferred[out] = (self.b.graph.tensors[elem].dtype, list(self.shapes[elem]))
            self._add(out, TensorKind.ACTIVATION, node=n)
            shape = self.shapes[elem]
            self.b.op(n.name or target, OpKind.VIEW, target, [elem], [out],
                      _checked(lambda: _identity(shape), [shape], target), module=_module_of(n))
            return
        # ConcatFromSequence
        axis, new_axis = int(_attr(n, "axis", 0)), bool(_attr(n, "new_axis", 0))
        shapes = [self.shapes[e] for e in seq]
        if not self._known(out):
            cat = list(shapes[0])
            if new_axis:
                cat.insert(axis % (len(cat) + 1), len(seq))
            else:
                cat[axis % len(cat)] = sum(sh[axis % len(cat)] for sh in shapes)
            self.inferred[out] = (self.b.graph.tensors[seq[0]].dtype, cat)
        self._add(out, TensorKind.ACTIVATION, node=n)
        fn = None if new_axis else _checked(lambda: ops.concat(shapes, axis), [self.shapes[out]], target)
        self.b.op(n.name or target, OpKind.CONCAT, target, seq, [out], fn, module=_module_of(n),
                  reason="stacking along a new axis" if new_axis else None)


def _outer_reads(n: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the enclosing scope."""
    out: list[str] = []
    for a in n.attribute:
        for sub in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
            local = {x.name for x in [*sub.input, *sub.initializer]} | {o for m in sub.node for o in m.output}
            for m in sub.node:
                out += [x for x in m.input if x and x not in local]
                out += [x for x in _outer_reads(m) if x not in local]
    return list(dict.fromkeys(out))


def _bias_adds(g: onnx.GraphProto, params: set[str], inits: Mapping[str, TensorProto],
               graph_outputs: set[str]) -> dict[str, onnx.NodeProto]:
    """``MatMul(x, W) -> Add(., b)`` pairs that are one linear layer (how nn.Linear exports on 3-D input).

    Fusing them gives the loop nest the torch frontend builds for ``linear``: the bias
    add is a statement of the contraction, not a separate elementwise op.
    """
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    # weights given as Transpose(W) of a [N, K] parameter (TorchScript export without folding)
    transposed = {n.output[0]: n.input[0] for n in g.node
                  if n.op_type == "Transpose" and n.input and n.input[0] in params and n.input[0] in inits
                  and len(inits[n.input[0]].dims) == 2 and list(_attr(n, "perm", (1, 0))) == [1, 0]}
    out = {}
    for n in g.node:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        y = n.output[0]
        if n.input[1] in transposed:
            n_out = inits[transposed[n.input[1]]].dims[0]
        elif n.input[1] in params and len(inits[n.input[1]].dims) == 2:
            n_out = inits[n.input[1]].dims[1]
        else:
            continue
        if y in graph_outputs:
            continue
        r = readers.get(y, [])
        if len(r) != 1 or r[0].op_type != "Add" or r[0].domain not in ("", "ai.onnx"):
            continue
        add = r[0]
        bias = add.input[1] if add.input[0] == y else add.input[0]
        b = inits.get(bias)
        if b is not None and bias in params and list(b.dims) == [n_out] and bias != y:
            out[y] = add
    return out


def _fuse_bias(mm: onnx.NodeProto, add: onnx.NodeProto) -> onnx.NodeProto:
    bias = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
    fused = helper.make_node("MatMul", [mm.input[0], mm.input[1], bias], [add.output[0]], name=mm.name,
                             bias_add=add.name or "Add")
    fused.metadata_props.extend(mm.metadata_props)
    return fused


def _attr(n: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in n.attribute:
        if a.name == name:
            return _attr_value(a)
    return default


def _np_dtype_name(dt: np.dtype) -> str:
    name = np.dtype(dt).name
    return {"bool_": "bool", "object": "string", "str": "string"}.get(name, name)


def _toposort(g: onnx.GraphProto, available: set[str], where: str) -> list[onnx.NodeProto]:
    """Nodes in a valid order (ONNX requires it, but not every exporter complies)."""
    avail = set(available)
    pending = list(g.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for n in pending:
            if all((not x) or x in avail for x in n.input):
                ordered.append(n)
                avail.update(o for o in n.output if o)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            n = rest[0]
            missing = [x for x in n.input if x and x not in avail]
            produced = {o for m in rest for o in m.output}
            why = "a cycle" if any(x in produced for x in missing) else "no node, initializer or input defines it"
            raise CaptureError(f"{where}: node {n.name or n.op_type!r} ({n.op_type}) reads {missing[0]!r} but "
                               f"{why}; the model is invalid or truncated — re-export it")
        pending = rest
    return ordered


# ------------------------------------------------------------------------------------------
# safety check: a nest must write exactly the inferred output shapes


def _checked(fn: NestFn, out_shapes: Sequence[Shape], target: str) -> NestFn:
    def build() -> LoopNest:
        try:
            nest = fn()
        except ops.Unsupported:
            raise
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            raise ops.Unsupported(f"{target}: {type(e).__name__}: {e}") from e
        ext = nest.extents
        # per output and axis, the [lo, hi] index range over all writes must be the inferred extent
        span: dict[int, list[tuple[int, int] | None]] = {}
        for st in nest.statements:
            for w in st.writes:
                if not w.operand.startswith("out"):
                    continue
                k = int(w.operand[3:])
                if k >= len(out_shapes) or len(w.index) != len(out_shapes[k]):
                    raise ops.Unsupported(f"{target}: loop nest writes {w} but the node's outputs have shapes "
                                          f"{[list(s) for s in out_shapes]}")
                cur = span.setdefault(k, [None] * len(w.index))
                for axis, e in enumerate(w.index):
                    if isinstance(e, AffineExpr):
                        hi = e.const + sum(c * (ext[d] - 1) for d, c in e.terms if c > 0)
                        lo = e.const + sum(c * (ext[d] - 1) for d, c in e.terms if c < 0)
                        old = cur[axis]
                        cur[axis] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        for k, axes in span.items():
            for axis, r in enumerate(axes):
                want = (0, max(out_shapes[k][axis], 1) - 1)
                if r is not None and r != want:
                    raise ops.Unsupported(f"{target}: loop nest writes out{k} axis {axis} over {list(r)}, "
                                          f"but the inferred output shape is {list(out_shapes[k])}")
        written = set(span)
        missing = set(range(len(out_shapes))) - written
        if missing:
            raise ops.Unsupported(f"{target}: loop nest does not write output(s) {sorted(missing)}")
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
    raise ops.Unsupported(f"loop nest has no write of {operand}")


# ------------------------------------------------------------------------------------------
# handlers: one per op family, returning (kind, nest builder)

_HANDLERS: dict[str, Callable[[_Node], Spec]] = {}


def _handles(*names: str) -> Callable[[Callable[[_Node], Spec]], Callable[[_Node], Spec]]:
    def deco(f: Callable[[_Node], Spec]) -> Callable[[_Node], Spec]:
        for nm in names:
            _HANDLERS[nm] = f
        return f

    return deco


@_handles("MatMul", "MatMulInteger")
def _matmul(n: _Node) -> Spec:
    a, b, c = n.shape(0), n.shape(1), (n.shape(2) if n.attr("bias_add") else None)  # c: a fused Add
    return OpKind.CONTRACTION, lambda: ops.matmul(a, b, bias=c)


@_handles("Gemm")
def _gemm(n: _Node) -> Spec:
    a, b, c = n.shape(0), n.shape(1), n.shape(2)
    ta, tb = bool(n.attr("transA", 0)), bool(n.attr("transB", 0))
    unit = n.attr("alpha", 1.0) == 1.0 and n.attr("beta", 1.0) == 1.0
    if tb and not ta and unit and len(b) == 2 and (c is None or tuple(c) == (b[0],)):
        # nn.Linear as exported: the same loop nest as the torch frontend's linear
        return OpKind.CONTRACTION, lambda: ops.linear(a, b, c)
    return OpKind.CONTRACTION, lambda: ops.matmul(a, b, bias=c, trans_a=ta, trans_b=tb)


@_handles("Einsum")
def _einsum(n: _Node) -> Spec:
    shapes = n.data_shapes
    eq = _expand_ellipsis(str(n.attr("equation")).replace(" ", ""), shapes)
    return OpKind.CONTRACTION, lambda: ops.einsum(eq, shapes)


def _expand_ellipsis(eq: str, shapes: Sequence[Shape]) -> str:
    """Spell ``...`` out with unused letters (numpy rules: right-aligned, broadcast)."""
    if "..." not in eq:
        return eq
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    ranks = [len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t]
    width = max(ranks, default=0)
    ell = "".join(free[:width])
    terms = [t.replace("...", ell[width - (len(s) - (len(t) - 3)):]) if "..." in t else t
             for t, s in zip(terms, shapes)]
    if arrow:
        rhs = rhs.replace("...", ell)
    else:  # implicit output: the ellipsis dims first, then the letters used once, sorted
        counts: dict[str, int] = {}
        for t in terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return ",".join(terms) + "->" + rhs


def _spatial_pads(n: _Node, x: Shape, kernel: Sequence[int], strides: Sequence[int],
                  dil: Sequence[int]) -> tuple[list[int], list[int]]:
    """Low and high padding per spatial dim, resolving ``auto_pad`` (SAME: out = ceil(in / stride))."""
    k = len(kernel)
    auto = str(n.attr("auto_pad", "NOTSET"))
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = [], []
        for i in range(k):
            size = x[2 + i]
            total = max(0, (-(-size // strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size)
            small = total // 2
            lo.append(small if auto == "SAME_UPPER" else total - small)
            hi.append(total - lo[-1])
        return lo, hi
    if auto == "VALID":
        return [0] * k, [0] * k
    pads = list(n.attr("pads", ())) or [0] * (2 * k)
    return [int(p) for p in pads[:k]], [int(p) for p in pads[k:]]


@_handles("Conv", "ConvInteger")
def _conv(n: _Node) -> Spec:
    x, w = n.shape(0), n.shape(1)
    b = n.shape(2) if n.op_type == "Conv" else None
    k = len(x) - 2
    kernel = list(n.attr("kernel_shape", ())) or list(w[2:])
    strides = list(n.attr("strides", ())) or [1] * k
    dil = list(n.attr("dilations", ())) or [1] * k
    lo, hi = _spatial_pads(n, x, kernel, strides, dil)
    groups = int(n.attr("group", 1))
    return OpKind.CONV, lambda: ops.conv(x, w, b, stride=strides, padding=lo, dilation=dil, groups=groups,
                                         pads_hi=hi)


@_handles("MaxPool", "AveragePool", "LpPool")
def _pool(n: _Node) -> Spec:
    x = n.shape(0)
    kernel = [int(v) for v in n.attr("kernel_shape", ())]
    k = len(kernel)
    strides = list(n.attr("strides", ())) or [1] * k
    dil = list(n.attr("dilations", ())) or [1] * k

    def nest() -> LoopNest:
        lo, hi = _spatial_pads(n, x, kernel, strides, dil)
        if n.attr("ceil_mode", 0):
            # ceil mode drops a last window that would start in the padding; the inferred
            # output extent has that rule, so take it and pad the high side just enough
            out = n.out[len(x) - k:]
            for i in range(k):
                size = x[len(x) - k + i]
                ext = ops.out_extent(size, kernel[i], strides[i], lo[i], hi[i], dil[i], ceil=True)
                if (ext - 1) * strides[i] >= size + lo[i]:
                    ext -= 1  # the last window would start in the high padding: dropped
                if ext != out[i]:
                    raise ops.Unsupported(f"ceil-mode pooling: ONNX shape inference gives extent {out[i]} "
                                          f"but windows starting in the padding are dropped, giving {ext}")
            hi = [(out[i] - 1) * strides[i] + dil[i] * (kernel[i] - 1) + 1 - x[len(x) - k + i] - lo[i]
                  for i in range(k)]
        nt = ops.pool(x, kernel, stride=strides, padding=lo, dilation=dil, pads_hi=hi)
        if len(n.outs) == 2:  # MaxPool's Indices
            nt = _extra_writes(nt, "pool", [Access("out1", _write_of(nt).index)])
        return nt

    return OpKind.POOL, nest


@_handles("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(n: _Node) -> Spec:
    x = n.shape(0)
    # the same nest as the torch frontend's adaptive pooling to 1 x 1
    return OpKind.POOL, lambda: ops.adaptive_pool(x, [1] * (len(x) - 2))


@_handles("BatchNormalization")
def _batch_norm(n: _Node) -> Spec:
    x = n.shape(0)
    training = bool(n.attr("training_mode", 0))
    if len(n.outs) > 1:
        raise ops.Unsupported("BatchNormalization with running-statistics outputs is not modelled")
    return OpKind.NORM, lambda: ops.batch_norm(x, affine=True, training=training)


@_handles("InstanceNormalization")
def _instance_norm(n: _Node) -> Spec:
    x = n.shape(0)
    return OpKind.NORM, lambda: ops.group_norm(x, x[1], affine=True)


@_handles("GroupNormalization")
def _group_norm(n: _Node) -> Spec:
    x, s = n.shape(0), n.shape(1)
    groups = int(n.attr("num_groups"))
    if s is not None and tuple(s) != (x[1],):
        raise ops.Unsupported(f"GroupNormalization with per-group scale {list(s)} (opset 18 form)")
    return OpKind.NORM, lambda: ops.group_norm(x, groups, affine=True)


@_handles("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
def _layer_norm(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", -1)) % len(x)
    normalized = tuple(x[axis:])
    rms = n.op_type != "LayerNormalization"
    scale, bias = n.shape(1), (n.shape(2) if not rms else None)
    for what, s in (("scale", scale), ("bias", bias)):
        if s is not None and tuple(s) != normalized:
            raise ops.Unsupported(f"{n.op_type} with a broadcast {what} {list(s)} over {list(normalized)}")

    def nest() -> LoopNest:
        nt = ops.layer_norm(x, normalized, weight=scale is not None, bias=bias is not None, rms=rms)
        stats = next(w.index for s in nt.statements if s.name == "stats" for w in s.writes)
        keep = tuple(stats) + (AffineExpr((), 0),) * len(normalized)
        return _extra_writes(nt, "stats", [Access(f"out{i}", keep) for i in range(1, len(n.outs))])

    return OpKind.NORM, nest


@_handles("Softmax", "LogSoftmax")
def _softmax(n: _Node) -> Spec:
    x = n.shape(0)
    log = n.op_type == "LogSoftmax"
    r = max(len(x), 1)
    if n.opset >= 13:
        axis = int(n.attr("axis", -1)) % r
        return OpKind.SOFTMAX, lambda: ops.softmax(x, axis, log=log)
    # before opset 13 the input is coerced to 2-D: normalise over all axes from `axis` on
    axis = int(n.attr("axis", 1)) % r
    inner = [i for i in range(axis, len(x)) if x[i] != 1]
    if len(inner) <= 1:
        return OpKind.SOFTMAX, lambda: ops.softmax(x, inner[0] if inner else len(x) - 1, log=log)
    return OpKind.SOFTMAX, lambda: _softmax_trailing(x, axis, log)


def _softmax_trailing(x: Shape, axis: int, log: bool) -> LoopNest:
    """Softmax over axes ``axis..`` together (ONNX < 13): the statistics reduce all of them."""
    dims = [Dim(f"d{i}", e, Role.REDUCTION if i >= axis else Role.PARALLEL) for i, e in enumerate(x)]
    idx = tuple(E(d.name) for d in dims)
    sidx = tuple(E(d.name) for d in dims[:axis])
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", sidx),),
                      flops_per_point=3)
    norm = Statement("normalize", names, reads=(Access("in0", idx), Access("stats", sidx)),
                     writes=(Access("out0", idx),), flops_per_point=1 if log else 2)
    return LoopNest(tuple(dims), (stats, norm))


@_handles("Attention")
def _attention(n: _Node) -> Spec:
    q, k, v, m = n.shape(0), n.shape(1), n.shape(2), n.shape(3)
    if any(n.has(i) for i in (4, 5)) or len(n.outs) > 1:
        raise ops.Unsupported("Attention with a KV cache or extra outputs is not modelled")
    causal = bool(n.attr("is_causal", 0))
    if m is not None and len(m) > 4:
        raise ops.Unsupported(f"Attention mask of shape {list(m)}")
    if len(q) == 4:
        return OpKind.ATTENTION, lambda: ops.attention(q, k, v, m, causal=causal)
    hq, hk = n.attr("q_num_heads"), n.attr("kv_num_heads")
    if len(q) != 3 or not hq or not hk:
        raise ops.Unsupported(f"Attention with q{list(q)} and no head counts")
    hq, hk = int(hq), int(hk)

    def nest() -> LoopNest:
        # 3-D inputs [B, S, H*D]: the 4-D nest with [b, h, s, d] read as [b, s, h*D + d]
        q4, k4 = (q[0], hq, q[1], q[2] // hq), (k[0], hk, k[1], k[2] // hk)
        v4 = (v[0], hk, v[1], v[2] // hk)
        nt = ops.attention(q4, k4, v4, m, causal=causal)
        width = {"in0": q4[3], "in1": k4[3], "in2": v4[3], "out0": v4[3]}

        def fold(a: Access) -> Access:
            if a.operand not in width or len(a.index) != 4:
                return a
            b, h, t, d = a.index
            return Access(a.operand, (b, t, h * width[a.operand] + d))

        return LoopNest(nt.dims, tuple(
            Statement(st.name, st.dims, tuple(map(fold, st.reads)), tuple(map(fold, st.writes)),
                      st.flops_per_point, st.constraints) for st in nt.statements))

    return OpKind.ATTENTION, nest


@_handles("Gather")
def _gather(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    axis = int(n.attr("axis", 0))
    iv = n.const(1)
    if iv is not None and iv.ndim == 0:
        return OpKind.VIEW, lambda: ops.select(x, axis, int(iv))
    if axis % max(len(x), 1) == 0 and len(x) == 2:
        return OpKind.EMBEDDING, lambda: ops.embedding(x, idx)
    return OpKind.GATHER, lambda: ops.gather(x, idx, axis)


@_handles("GatherElements")
def _gather_elements(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    axis = int(n.attr("axis", 0))
    return OpKind.GATHER, lambda: ops.take_along_axis(x, idx, axis)


@_handles("Resize", "Upsample")
def _resize(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    mode = str(n.attr("mode", "nearest"))
    old = n.op_type == "Upsample" or n.opset < 11  # before opset 11: asymmetric coordinates, floor
    coord = str(n.attr("coordinate_transformation_mode", "asymmetric" if old else "half_pixel"))
    rounding = str(n.attr("nearest_mode", "floor" if old else "round_prefer_floor"))
    if mode != "nearest" or len(out) != len(x) or any(o % i for o, i in zip(out, x)):
        raise ops.Unsupported(f"Resize mode={mode!r} from {list(x)} to {list(out)} (only nearest by integer "
                              "factors is affine)")
    scales = [o // i for o, i in zip(out, x)]
    # with an integer factor s, output y reads floor(y / s) under these coordinate rules:
    # asymmetric+floor directly; half-pixel maps y = h*s + r to h + (r + 1/2)/s - 1/2, which
    # lies strictly within (h - 1/2, h + 1/2) and so rounds to h either way
    exact = (coord == "asymmetric" and rounding == "floor") or (
        coord in ("half_pixel", "pytorch_half_pixel") and rounding in ("round_prefer_floor", "round_prefer_ceil"))
    if not exact and any(s > 1 for s in scales):
        raise ops.Unsupported(f"Resize nearest with coordinate mode {coord!r} and rounding {rounding!r}")
    lead = next((i for i, s in enumerate(scales) if s > 1), len(x))
    return OpKind.VIEW, lambda: ops.upsample_nearest(x, scales[lead:])


@_handles("SoftmaxCrossEntropyLoss")
def _sce(n: _Node) -> Spec:
    x, t = n.shape(0), n.shape(1)
    red = str(n.attr("reduction", "mean"))
    if len(n.outs) > 1:
        raise ops.Unsupported("SoftmaxCrossEntropyLoss with the log_prob output is not modelled")
    return OpKind.LOSS, lambda: ops.cross_entropy(x, t, reduction=red)


@_handles("NegativeLogLikelihoodLoss")
def _nll(n: _Node) -> Spec:
    x, t = n.shape(0), n.shape(1)
    red = str(n.attr("reduction", "mean"))
    return OpKind.LOSS, lambda: ops.nll_loss(x, t, reduction=red)


_ELEMENTWISE = (
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "BitwiseAnd",
    "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div",
    "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish",
    "IsInf", "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul",
    "Neg", "Not", "Or", "PRelu", "Pow", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign",
    "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Trilu",
    "Where", "Xor", "Swish", "BiasGelu", "FastGelu", "QuickGelu",
)
# onnxruntime contrib ops (ORT-optimised models) with the same semantics as a handler above
_CONTRIB = {"BiasGelu", "FastGelu", "QuickGelu", "Gelu"}


@_handles(*_ELEMENTWISE)
def _elementwise(n: _Node) -> Spec:
    shapes = n.data_shapes
    if n.op_type in ("Trilu", "CastLike"):  # k / the "like" tensor are not elementwise operands
        shapes = shapes[:1]
    name = n.op_type.lower()
    if n.op_type == "Gelu" and n.attr("approximate", "none") == "tanh":
        name = "gelu_tanh"
    # contrib GELUs: FastGelu is the tanh form; BiasGelu/FastGelu add an optional bias first
    name = {"fastgelu": "gelu_tanh", "biasgelu": "gelu", "quickgelu": "sigmoid"}.get(name, name)
    flops = ops.flops_per_element(name) + (1 if n.op_type in ("BiasGelu", "FastGelu") and len(shapes) > 1 else 0)
    if n.op_type == "QuickGelu":
        flops += 2  # x * sigmoid(alpha * x)
    if n.op_type in ("Sum", "Mean", "Max", "Min"):
        flops = max(1, len(shapes) - 1) + (1 if n.op_type == "Mean" else 0)
    out = n.out
    return OpKind.ELEMENTWISE, lambda: ops.elementwise(out, shapes, flops=flops)


@_handles("Dropout")
def _dropout(n: _Node) -> Spec:
    x = n.shape(0)
    train = n.const(2)
    if train is not None and bool(np.asarray(train).reshape(-1)[0]):
        return OpKind.ELEMENTWISE, lambda: ops.elementwise(x, [x], flops=ops.flops_per_element("dropout"),
                                                           n_outputs=len(n.outs))
    # inference: an identity (mask, if asked for, is all ones)
    return OpKind.VIEW, lambda: _identity(x, len(n.outs))


def _identity(x: Shape, n_outputs: int = 1) -> LoopNest:
    nt = ops.expand(x, x)
    return _extra_writes(nt, nt.statements[0].name,
                         [Access(f"out{i}", _write_of(nt).index) for i in range(1, n_outputs)])


@_handles("Identity")
def _identity_op(n: _Node) -> Spec:
    x = n.shape(0)
    return OpKind.VIEW, lambda: _identity(x)


@_handles("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
def _quant(n: _Node) -> Spec:
    x = n.shape(0)
    scalars = all(s == () or math.prod(s) == 1 for s in n.data_shapes[1:])
    if not scalars or n.op_type == "DynamicQuantizeLinear":
        raise ops.Unsupported(f"{n.op_type} with per-axis or dynamic scales")
    return OpKind.ELEMENTWISE, lambda: ops.elementwise(n.out, [x, *[()] * len(n.data_shapes[1:])], flops=2)


_REDUCE_FLOPS = {"ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2, "ReduceLogSumExp": 3, "ReduceLogSum": 1}


@_handles("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin")
def _reduce(n: _Node) -> Spec:
    x = n.shape(0)
    keep = bool(n.attr("keepdims", 1))
    if n.op_type in ("ArgMax", "ArgMin"):
        axes: list[int] | None = [int(n.attr("axis", 0))]
    elif n.has(1):
        v = n.const(1)
        axes = [int(a) for a in v.reshape(-1)] if v is not None else _axes_from_shapes(x, n.out, keep)
    else:
        a = n.attr("axes")
        axes = [int(v) for v in a] if a is not None else None
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return OpKind.VIEW, lambda: _identity(x)
        axes = None
    flops = _REDUCE_FLOPS.get(n.op_type, 1)
    return OpKind.REDUCE, lambda: ops.reduce(x, axes, keepdim=keep, flops=flops)


def _axes_from_shapes(x: Shape, out: Shape, keep: bool) -> list[int]:
    """Reduced axes read off the shapes when ``axes`` is a run-time tensor (extent-1 axes are moot)."""
    if keep:
        return [i for i, (a, b) in enumerate(zip(x, out)) if a != b]
    for axes in itertools.combinations(range(len(x)), len(x) - len(out)):
        if tuple(e for i, e in enumerate(x) if i not in axes) == tuple(out):
            return list(axes)
    raise ops.Unsupported(f"cannot tell the reduced axes of {list(x)} -> {list(out)}")


@_handles("CumSum", "CumProd")
def _cumsum(n: _Node) -> Spec:
    x = n.shape(0)
    axis = n.ints(1, "axis")[0]
    excl, rev = bool(n.attr("exclusive", 0)), bool(n.attr("reverse", 0))

    def nest() -> LoopNest:
        nt = ops.scan(x, axis)
        if not (excl or rev):
            return nt
        st = nt.statements[0]
        s_name = nt.dims[axis % len(x)].name
        c = (E("t") - E(s_name)) if rev else (E(s_name) - E("t"))
        return LoopNest(nt.dims, (Statement(st.name, st.dims, st.reads, st.writes, st.flops_per_point,
                                            (c - 1 if excl else c,)),))

    return OpKind.REDUCE, nest


# -- views ------------------------------------------------------------------------------------


@_handles("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    return OpKind.VIEW, lambda: ops.reshape(x, out)


@_handles("Transpose")
def _transpose(n: _Node) -> Spec:
    x = n.shape(0)
    perm = n.attr("perm")
    perm = [int(p) for p in perm] if perm else list(range(len(x)))[::-1]
    return OpKind.VIEW, lambda: ops.permute(x, perm)


@_handles("Expand")
def _expand(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    return OpKind.VIEW, lambda: ops.expand(x, out)


@_handles("Concat")
def _concat(n: _Node) -> Spec:
    shapes = n.data_shapes
    axis = int(n.attr("axis", 0))
    nonempty = [s for s in shapes if math.prod(s) > 0]
    if len(nonempty) != len(shapes):
        raise ops.Unsupported("Concat with empty inputs is not modelled")
    return OpKind.CONCAT, lambda: ops.concat(shapes, axis)


@_handles("Split")
def _split(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", 0)) % max(len(x), 1)
    sizes = [s[axis] for s in n.outs]
    return OpKind.SPLIT, lambda: ops.split(x, sizes, axis)


@_handles("Slice")
def _slice(n: _Node) -> Spec:
    x = n.shape(0)
    if n.opset < 10:
        starts, ends = list(n.attr("starts", ())), list(n.attr("ends", ()))
        axes = list(n.attr("axes", ())) or list(range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = n.ints(1, "starts"), n.ints(2, "ends")
        axes = n.ints(3, "axes") if n.has(3) else list(range(len(starts)))
        steps = n.ints(4, "steps") if n.has(4) else [1] * len(starts)
    specs = []
    for a, s, e, st in zip(axes, starts, ends, steps):
        a %= len(x)
        size = x[a]
        # ONNX clamps starts/ends (INT_MAX means "to the end"); Python slices clamp the same way
        lo, hi, step = slice(int(s), int(e), int(st)).indices(size)
        specs.append((a, lo, hi, step))
    if len(specs) == 1:
        a, lo, hi, step = specs[0]
        return OpKind.VIEW, lambda: ops.slice_(x, a, lo, hi if hi >= 0 else None, step)
    return OpKind.VIEW, lambda: _slice_axes(x, specs)


def _slice_axes(x: Shape, specs: Sequence[tuple[int, int, int, int]]) -> LoopNest:
    """A slice along several axes at once: ``out[.., i, ..] = x[.., start + i * step, ..]``."""
    out = list(x)
    start = {a: (lo, step) for a, lo, _, step in specs}
    for a, lo, hi, step in specs:
        out[a] = len(range(lo, hi, step))
    if min(out, default=1) < 1:
        raise ops.Unsupported("empty slice")
    dims = [Dim(f"d{i}", e) for i, e in enumerate(out)]
    idx = tuple(E(d.name) * start[i][1] + start[i][0] if i in start else E(d.name) for i, d in enumerate(dims))
    st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", idx),),
                   writes=(Access("out0", tuple(E(d.name) for d in dims)),), flops_per_point=0)
    return LoopNest(tuple(dims), (st,))


@_handles("Pad")
def _pad(n: _Node) -> Spec:
    x = n.shape(0)
    mode = str(n.attr("mode", "constant"))
    if mode != "constant":
        raise ops.Unsupported(f"Pad mode {mode!r} reads mirrored or wrapped indices (not affine)")
    pads = list(n.attr("pads", ())) if n.opset < 11 else n.ints(1, "pads")
    axes = n.ints(3, "axes") if n.has(3) else list(range(len(x)))
    k = len(axes)
    pairs = [(0, 0)] * len(x)
    for j, a in enumerate(axes):
        pairs[a % len(x)] = (pads[j], pads[j + k])
    return OpKind.VIEW, lambda: ops.pad(x, pairs)


@_handles("Tile")
def _tile(n: _Node) -> Spec:
    x = n.shape(0)
    reps = n.ints(1, "repeats")

    def nest() -> LoopNest:
        # out[r * n + i] = x[i]: one repeat dim and one copy dim per axis keep it affine
        dims, xi, oi = [], [], []
        for a, (e, r) in enumerate(zip(x, reps)):
            dims += [Dim(f"r{a}", max(1, r)), Dim(f"d{a}", max(1, e))]
            xi.append(E(f"d{a}"))
            oi.append(E(f"r{a}") * e + E(f"d{a}"))
        st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", tuple(xi)),),
                       writes=(Access("out0", tuple(oi)),), flops_per_point=0)
        return LoopNest(tuple(dims), (st,))

    return OpKind.VIEW, nest


@_handles("LRN")
def _lrn(n: _Node) -> Spec:
    x = n.shape(0)
    size = int(n.attr("size"))

    def nest() -> LoopNest:
        # y = x / (bias + alpha / size * sum_{j < size} x[c + j - lo]^2) ** beta over a channel window
        lo = (size - 1) // 2
        dims = [Dim(f"d{i}", e) for i, e in enumerate(x)] + [Dim("j", size, Role.REDUCTION)]
        idx = tuple(E(f"d{i}") for i in range(len(x)))
        win = tuple(E("j") + E("d1") - lo if i == 1 else e for i, e in enumerate(idx))
        names = tuple(d.name for d in dims)
        stats = Statement("stats", names, reads=(Access("in0", win),), writes=(Access("stats", idx),),
                          flops_per_point=2)
        norm = Statement("normalize", names[:-1], reads=(Access("in0", idx), Access("stats", idx)),
                         writes=(Access("out0", idx),), flops_per_point=5)
        return LoopNest(tuple(dims), (stats, norm))

    return OpKind.NORM, nest


def _normalise_over(x: Shape, axes: Sequence[int], stats_flops: float, norm_flops: float) -> LoopNest:
    """Statistics reduced over ``axes``, then a per-element normalisation (the norm/softmax shape)."""
    red = {a % len(x) for a in axes}
    dims = [Dim(f"d{i}", max(1, e), Role.REDUCTION if i in red else Role.PARALLEL) for i, e in enumerate(x)]
    idx = tuple(E(d.name) for d in dims)
    sidx = tuple(E(d.name) for i, d in enumerate(dims) if i not in red)
    names = tuple(d.name for d in dims)
    stats = Statement("stats", names, reads=(Access("in0", idx),), writes=(Access("stats", sidx),),
                      flops_per_point=stats_flops)
    norm = Statement("normalize", names, reads=(Access("in0", idx), Access("stats", sidx)),
                     writes=(Access("out0", idx),), flops_per_point=norm_flops)
    return LoopNest(tuple(dims), (stats, norm))


@_handles("LpNormalization", "MeanVarianceNormalization", "Hardmax")
def _axis_norm(n: _Node) -> Spec:
    x = n.shape(0)
    if n.op_type == "MeanVarianceNormalization":
        axes = [int(a) for a in n.attr("axes", (0, 2, 3))]
        return OpKind.NORM, lambda: _normalise_over(x, axes, 3, 2)
    if n.op_type == "LpNormalization":
        axis = int(n.attr("axis", -1))
        return OpKind.NORM, lambda: _normalise_over(x, [axis], 2, 1)
    axis = int(n.attr("axis", -1 if n.opset >= 13 else 1)) % max(len(x), 1)
    axes = [axis] if n.opset >= 13 else list(range(axis, len(x)))
    return OpKind.SOFTMAX, lambda: _normalise_over(x, axes, 1, 1)  # arg-max, then a one-hot compare


@_handles("GatherND")
def _gather_nd(n: _Node) -> Spec:
    x, idx = n.shape(0), n.shape(1)
    bd = int(n.attr("batch_dims", 0))

    def nest() -> LoopNest:
        k = idx[-1]
        out = (*idx[:-1], *x[bd + k:])
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(out)]
        names = [d.name for d in dims]
        lead = len(idx) - 1
        xi = (*[E(nm) for nm in names[:bd]], *[ANY] * k, *[E(nm) for nm in names[lead:]])
        ii = (*[E(nm) for nm in names[:lead]], AffineExpr((), 0))
        # the index tuple is read whole: one access per component
        reads = (Access("in0", xi), *[Access("in1", (*ii[:-1], AffineExpr((), c))) for c in range(k)])
        st = Statement("gather", tuple(names), reads=reads, writes=(Access("out0", tuple(E(nm) for nm in names)),),
                       flops_per_point=0)
        return LoopNest(tuple(dims), (st,))

    return OpKind.GATHER, nest


@_handles("ScatterElements", "ScatterND", "Scatter")
def _scatter(n: _Node) -> Spec:
    x, idx, upd = n.shape(0), n.shape(1), n.shape(2)
    red = str(n.attr("reduction", "none"))

    def nest() -> LoopNest:
        # out = data, then out[data-dependent index] (op)= updates
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(x)]
        xi = tuple(E(d.name) for d in dims)
        copy = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", xi),),
                         writes=(Access("out0", xi),), flops_per_point=0)
        udims = [Dim(f"u{i}", max(1, e)) for i, e in enumerate(upd)]
        ui = tuple(E(d.name) for d in udims)
        if n.op_type == "ScatterND":
            k = idx[-1]
            lead = len(idx) - 1
            wi = (*[ANY] * k, *ui[lead:])
            ii = (*ui[:lead], AffineExpr((), 0))
        else:
            axis = int(n.attr("axis", 0)) % len(x)
            wi = tuple(ANY if i == axis else e for i, e in enumerate(ui))
            ii = ui
        upd_st = Statement("scatter", tuple(d.name for d in udims), reads=(Access("in2", ui), Access("in1", ii)),
                           writes=(Access("out0", wi),), flops_per_point=0 if red == "none" else 1)
        return LoopNest((*dims, *udims), (copy, upd_st))

    return OpKind.GATHER, nest


@_handles("OneHot")
def _one_hot(n: _Node) -> Spec:
    out = n.out
    axis = int(n.attr("axis", -1)) % len(out)

    def nest() -> LoopNest:
        dims = [Dim(f"d{i}", max(1, e)) for i, e in enumerate(out)]
        oi = tuple(E(d.name) for d in dims)
        ii = tuple(e for i, e in enumerate(oi) if i != axis)
        st = Statement("compare", tuple(d.name for d in dims), reads=(Access("in0", ii),),
                       writes=(Access("out0", oi),), flops_per_point=1)
        return LoopNest(tuple(dims), (st,))

    return OpKind.ELEMENTWISE, nest


@_handles("DepthToSpace", "SpaceToDepth")
def _depth_space(n: _Node) -> Spec:
    x, out = n.shape(0), n.out
    bs = int(n.attr("blocksize"))
    crd = str(n.attr("mode", "DCR")) == "CRD"

    def nest() -> LoopNest:
        # depth d = (i*bs + j)*C + c (DCR) or c*bs*bs + i*bs + j (CRD) <-> space (h*bs + i, w*bs + j)
        if len(x) != 4:
            raise ops.Unsupported(f"{n.op_type} of a rank-{len(x)} input")
        to_space = n.op_type == "DepthToSpace"
        B, C, H, W = (x[0], out[1], x[2], x[3]) if to_space else (x[0], x[1], out[2], out[3])
        dims = (Dim("b", B), Dim("c", C), Dim("h", H), Dim("i", bs), Dim("w", W), Dim("j", bs))
        b, c, h, i, w, j = (E(d.name) for d in dims)
        depth = c * (bs * bs) + i * bs + j if crd else (i * bs + j) * C + c
        deep, space = (b, depth, h, w), (b, c, h * bs + i, w * bs + j)
        st = Statement("copy", tuple(d.name for d in dims), reads=(Access("in0", deep if to_space else space),),
                       writes=(Access("out0", space if to_space else deep),), flops_per_point=0)
        return LoopNest(dims, (st,))

    return OpKind.VIEW, nest


@_handles("TopK")
def _topk(n: _Node) -> Spec:
    x = n.shape(0)
    axis = int(n.attr("axis", -1)) % max(len(x), 1)
    k = n.out[axis]

    def nest() -> LoopNest:
        # selection by k passes of max over the axis: k * n comparisons per row
        dims = [Dim(f"d{a}", e) for a, e in enumerate(x) if a != axis]
        names = [d.name for d in dims]
        dims += [Dim("j", max(1, k)), Dim("t", x[axis], Role.REDUCTION)]
        xi = [E(nm) for nm in names]
        oi = list(xi)
        xi.insert(axis, E("t"))
        oi.insert(axis, E("j"))
        st = Statement("select", tuple(d.name for d in dims), reads=(Access("in0", tuple(xi)),),
                       writes=tuple(Access(f"out{i}", tuple(oi)) for i in range(len(n.outs))), flops_per_point=1)
        return LoopNest(tuple(dims), (st,))

    return OpKind.REDUCE, nest


@_handles("ConstantOfShape", "Range", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
          "RandomUniformLike", "Shape", "Size")
def _create(n: _Node) -> Spec:
    out = n.out
    return OpKind.CREATE, lambda: ops.create(out)


def _onnx_ops() -> list[str]:
    """The ONNX op types with a loop-nest model (for coverage reports)."""
    return sorted(_HANDLERS)
