"""Frontends: turn a PyTorch module or an ONNX model into the loop-nest Graph IR."""

from ._builder import CaptureError, GraphBuilder, OpaqueOpWarning

__all__ = ["CaptureError", "GraphBuilder", "OpaqueOpWarning"]
