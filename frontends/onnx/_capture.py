"""The capture of one ONNX graph: shapes, capture-time constants, initializer kinds, then one op per node.

:class:`_Capture` binds the symbolic input dims, runs ONNX shape inference (strict, with
data propagation; non-strict as a fallback; onnxruntime's symbolic inference for
``com.microsoft`` ops; one node at a time where whole-model inference lost a shape),
folds nodes whose inputs are all small constants with the ONNX reference
implementation, classifies initializers (PARAM / BUFFER / CONST), and walks the nodes in
topological order: each becomes one op built by its handler (:mod:`._registry`), an
opaque op where none applies. ``MatMul -> Add(bias)`` pairs are fused into one linear
layer first, and sequences of known tensors become ops on their elements.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper, shape_inference
from onnx.external_data_helper import load_external_data_for_tensor
from onnx.reference import ReferenceEvaluator

from polyparallel import ops
from polyparallel.ir import Graph, OpKind, TensorKind

from .._builder import CaptureError, GraphBuilder
from . import _contraction, _normalisation, _reduction, _views  # noqa: F401  (importing a family registers its handlers)
from ._elementwise import _CONTRIB
from ._model import _ELEM, _attr, _attr_value, _dtype, _module_of, _np_dtype_name
from ._registry import _HANDLERS, Shape, _checked, _identity, _Node

# Constant folding bounds: inputs and outputs larger than this stay run-time ops.
_FOLD_MAX_ELEMS = 4096
# Initializers up to this size have their values read (shape tensors, axes, pads...).
_READ_MAX_ELEMS = 1 << 16
_NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"}
_FLOAT_TYPES = {"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8e4m3fnuz",
                "float8e5m2fnuz", "float4e2m1", "float8e8m0"}

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
            except ops.NotModelled as e:
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
        fn = _checked(lambda: ops.stack(shapes, axis) if new_axis else ops.concat(shapes, axis), [self.shapes[out]],
                      target)
        self.b.op(n.name or target, OpKind.CONCAT, target, seq, [out], fn, module=_module_of(n))


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
