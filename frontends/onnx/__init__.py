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

Modules, each importing only those before it: :mod:`._model` (step 1, and decoding
protobuf values), :mod:`._registry` (what an op handler reads and returns, and the check
its nest passes), one module of handlers per op family (:mod:`._contraction`,
:mod:`._normalisation`, :mod:`._elementwise`, :mod:`._reduction`, :mod:`._views`), and
:mod:`._capture` (steps 2-4: shapes, constants, the walk over the nodes).

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

from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

from polyparallel.ir import Graph

from ._capture import _Capture
from ._model import _load

__all__ = ["capture_onnx"]


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
