"""What crosses the link: update compression, its exact byte count, and validation of what arrives.

A center sends its *update* ``δ = x_i − x`` (local model minus the global model it received), not the
model itself: updates are small and centred on zero, which is what makes low-precision codes work.
The payload is a flat ``dict[str, ndarray]`` (one Flower ``ArrayRecord``, or one ``.npz``):

- ``none``: ``q/<name>`` float32 ``δ``;
- ``fp16``: ``q/<name>`` float16 ``δ``;
- ``int8``: symmetric per-row quantisation. For a tensor viewed as rows ``r`` (first axis; one row for
  scalars and vectors) ``s_r = max|δ_r| / 127`` (``1`` for an all-zero row), ``q = round(δ / s_r)``
  clipped to ``[-127, 127]`` as int8 in ``q/<name>``, the float32 scales in ``s/<name>``. Decoding is
  ``δ̂ = q · s_r``, so ``|δ − δ̂| <= s_r / 2`` element-wise.

Bytes on the wire are the sum of the payload arrays' ``nbytes`` (framing added by the transport is
not counted here; the benchmark measures the transport separately).

:func:`check_payload` is the gate in front of fusion: a payload with a missing or extra tensor, a
wrong shape, a wrong dtype for the declared compression, or a non-finite value is rejected with the
list of problems — it is never decoded nor fused.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["COMPRESSIONS", "Payload", "check_payload", "decode_update", "encode_update", "payload_nbytes"]

Payload = dict[str, np.ndarray]
COMPRESSIONS = ("none", "fp16", "int8")
_QDTYPE = {"none": np.dtype(np.float32), "fp16": np.dtype(np.float16), "int8": np.dtype(np.int8)}


def _check_method(method: str) -> None:
    if method not in COMPRESSIONS:
        raise ValueError(f"unknown compression {method!r}; choose one of {COMPRESSIONS}")


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1) if a.ndim >= 2 else a.reshape(1, -1)


def encode_update(delta: Mapping[str, np.ndarray], method: str = "none") -> Payload:
    """Encode a float update ``δ`` (name -> array) with ``method`` (``none``, ``fp16``, ``int8``)."""
    _check_method(method)
    out: Payload = {}
    for name, d in delta.items():
        d = np.asarray(d, dtype=np.float32)
        if method == "int8":
            rows = _rows(d)
            scale = np.abs(rows).max(axis=1) / 127.0
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
            q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
            out[f"q/{name}"] = q.reshape(d.shape)
            out[f"s/{name}"] = scale
        else:
            out[f"q/{name}"] = d.astype(_QDTYPE[method])
    return out


def decode_update(payload: Mapping[str, np.ndarray], method: str = "none") -> dict[str, np.ndarray]:
    """Invert :func:`encode_update` (exactly for ``none``, within the code's resolution otherwise)."""
    _check_method(method)
    out: dict[str, np.ndarray] = {}
    for key, q in payload.items():
        if not key.startswith("q/"):
            continue
        name = key[2:]
        if method == "int8":
            s = np.asarray(payload[f"s/{name}"], dtype=np.float32)
            out[name] = (_rows(q).astype(np.float32) * s[:, None]).reshape(q.shape)
        else:
            out[name] = np.asarray(q, dtype=np.float32)
    return out


def payload_nbytes(payload: Mapping[str, np.ndarray]) -> int:
    """Bytes of array data in a payload (what the compression saves)."""
    return int(sum(np.asarray(a).nbytes for a in payload.values()))


def check_payload(payload: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], method: str) -> list[str]:
    """Problems with a received payload against the global model ``reference``; empty when it is sound."""
    _check_method(method)
    problems: list[str] = []
    expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, ref in reference.items():
        expected[f"q/{name}"] = (tuple(ref.shape), _QDTYPE[method])
        if method == "int8":
            expected[f"s/{name}"] = ((_rows(np.empty(ref.shape, dtype=np.int8)).shape[0],), np.dtype(np.float32))
    for key in sorted(set(expected) - set(payload)):
        problems.append(f"missing tensor {key!r}")
    for key in sorted(set(payload) - set(expected)):
        problems.append(f"unexpected tensor {key!r}")
    for key, (shape, dtype) in expected.items():
        if key not in payload:
            continue
        a = payload[key]
        if not isinstance(a, np.ndarray):
            problems.append(f"{key!r} is a {type(a).__name__}, not an ndarray")
            continue
        if tuple(a.shape) != shape:
            problems.append(f"{key!r} has shape {tuple(a.shape)}, expected {shape}")
        if a.dtype != dtype:
            problems.append(f"{key!r} has dtype {a.dtype}, expected {dtype} for compression {method!r}")
        elif a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            problems.append(f"{key!r} holds {int(np.size(a) - np.isfinite(a).sum())} non-finite values")
    return problems
