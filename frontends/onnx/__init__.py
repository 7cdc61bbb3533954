"""ONNX frontend: an ``.onnx`` file or ``onnx.ModelProto`` -> the loop-nest :class:`~polyparallel.ir.Graph`."""

from ._capture import capture_onnx

__all__ = ["capture_onnx"]
