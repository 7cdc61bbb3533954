"""Reading an ONNX model: loading and validating the protobuf, and decoding its values.

A model is loaded from a path or taken as a ``ModelProto``; what is not an ONNX model
(missing graph, opset or IR version: not ONNX, or truncated) raises a
:class:`CaptureError` that names the file, and model-local functions are inlined.
Element types, attributes and node names decode to the IR's dtype names, hashable
Python values and module paths (``/transformer/h.0/attn/MatMul`` -> ``transformer.h.0.attn``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, inliner

from .._builder import CaptureError

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


def _attr(n: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in n.attribute:
        if a.name == name:
            return _attr_value(a)
    return default


def _np_dtype_name(dt: np.dtype) -> str:
    name = np.dtype(dt).name
    return {"bool_": "bool", "object": "string", "str": "string"}.get(name, name)


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
