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

A center of a fusion with control variates (SCAFFOLD) adds its new control variate ``c_i⁺`` over the
trained tensors under the same code, each key prefixed ``c/`` (``c/q/<name>``, and ``c/s/<name>`` for
int8): :func:`encode_controls` / :func:`decode_controls`.

Bytes on the wire are the sum of the payload arrays' ``nbytes`` (framing added by the transport is
not counted here; the benchmark measures the transport separately).

:func:`check_payload` is the gate in front of fusion: a payload with a missing or extra tensor, a
wrong shape, a wrong dtype for the declared compression, or a non-finite value is rejected with the
list of problems — it is never decoded nor fused.

:func:`pack_arrays` lays a payload (or a model) out as one flat buffer per dtype plus a layout
(names, dtypes, shapes) for the Flower messages: Flower moves every array as its own content-addressed
object with one HTTP request each way per hop, and on loopback those requests, not the bytes, were
most of a round. :func:`unpack_arrays` gives back the same arrays bit for bit, and refuses a layout
that does not match its buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["COMPRESSIONS", "CONTROL_PREFIX", "Payload", "check_payload", "decode_controls", "decode_update",
           "encode_controls", "encode_update", "pack_arrays", "payload_nbytes", "unpack_arrays"]

Payload = dict[str, np.ndarray]
COMPRESSIONS = ("none", "fp16", "int8")
CONTROL_PREFIX = "c/"
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


def encode_controls(controls: Mapping[str, np.ndarray], method: str = "none") -> Payload:
    """A center's control variate ``c_i⁺`` under ``method``, keys prefixed :data:`CONTROL_PREFIX`."""
    return {CONTROL_PREFIX + k: v for k, v in encode_update(controls, method).items()}


def decode_controls(payload: Mapping[str, np.ndarray], method: str = "none") -> dict[str, np.ndarray]:
    """The control variate inside a payload (empty when it carries none)."""
    n = len(CONTROL_PREFIX)
    return decode_update({k[n:]: v for k, v in payload.items() if k.startswith(CONTROL_PREFIX)}, method)


def payload_nbytes(payload: Mapping[str, np.ndarray]) -> int:
    """Bytes of array data in a payload (what the compression saves)."""
    return int(sum(np.asarray(a).nbytes for a in payload.values()))


def check_payload(payload: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], method: str,
                  controls: Sequence[str] = ()) -> list[str]:
    """Problems with a received payload against the global model ``reference``; empty when it is sound.

    ``controls``: the tensors the payload must also carry a control variate for (SCAFFOLD).
    """
    _check_method(method)
    problems: list[str] = []
    expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for prefix, names in (("", list(reference)), (CONTROL_PREFIX, list(controls))):
        for name in names:
            ref = reference[name]
            expected[f"{prefix}q/{name}"] = (tuple(ref.shape), _QDTYPE[method])
            if method == "int8":
                expected[f"{prefix}s/{name}"] = ((_rows(np.empty(ref.shape, dtype=np.int8)).shape[0],),
                                                 np.dtype(np.float32))
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


_PACKABLE_KINDS = "biuf"  # numbers only: no objects, strings or void records ever cross


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, list]]:
    """Concatenate ``arrays`` into one 1-D buffer per dtype, in order; return ``(buffers, layout)``.

    ``buffers`` maps ``np.dtype.str`` (e.g. ``<f4``) to the buffer; ``layout`` holds ``names``,
    ``dtypes`` (``np.dtype.str`` per array), ``ranks`` and ``shapes`` (all dimensions, concatenated):
    lists of str and int, so it fits a Flower ``ConfigRecord``.
    """
    layout: dict[str, list] = {"names": [], "dtypes": [], "ranks": [], "shapes": []}
    parts: dict[str, list[np.ndarray]] = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind not in _PACKABLE_KINDS:
            raise ValueError(f"array {name!r} has dtype {a.dtype}; only numeric arrays can be packed")
        layout["names"].append(str(name))
        layout["dtypes"].append(a.dtype.str)
        layout["ranks"].append(a.ndim)
        layout["shapes"].extend(int(d) for d in a.shape)
        parts.setdefault(a.dtype.str, []).append(a.reshape(-1))
    return {k: np.concatenate(v) for k, v in parts.items()}, layout


def unpack_arrays(buffers: Mapping[str, np.ndarray], layout: Mapping[str, list]) -> dict[str, np.ndarray]:
    """Invert :func:`pack_arrays`; ``ValueError`` naming the inconsistency for a layout that does not fit."""
    try:
        names, dtypes = [str(x) for x in layout["names"]], [str(x) for x in layout["dtypes"]]
        ranks, shapes = [int(x) for x in layout["ranks"]], [int(x) for x in layout["shapes"]]
    except KeyError as e:
        raise ValueError(f"packed arrays: layout lacks {e}") from None
    if not len(names) == len(dtypes) == len(ranks) or len(set(names)) != len(names):
        raise ValueError(f"packed arrays: {len(names)} names ({len(set(names))} distinct), {len(dtypes)} dtypes, "
                         f"{len(ranks)} ranks")
    if min(ranks, default=0) < 0 or sum(ranks) != len(shapes) or min(shapes, default=0) < 0:
        raise ValueError(f"packed arrays: ranks {ranks} do not fit {len(shapes)} dimensions {shapes[:8]}...")
    if set(dtypes) != set(buffers):
        raise ValueError(f"packed arrays: layout dtypes {sorted(set(dtypes))}, buffers {sorted(buffers)}")
    for key, buf in buffers.items():
        if (not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype.str != key
                or buf.dtype.kind not in _PACKABLE_KINDS):
            raise ValueError(f"packed arrays: buffer {key!r} is not a 1-D numeric array of that dtype")
    out: dict[str, np.ndarray] = {}
    offset = dict.fromkeys(buffers, 0)
    dim = 0
    for name, dt, rank in zip(names, dtypes, ranks):
        shape = tuple(shapes[dim:dim + rank])
        dim += rank
        n = int(np.prod(shape, dtype=np.int64))
        start = offset[dt]
        if start + n > buffers[dt].size:
            raise ValueError(f"packed arrays: {name!r} {shape} runs past the end of the {dt} buffer "
                             f"({buffers[dt].size} elements)")
        out[name] = buffers[dt][start:start + n].reshape(shape)
        offset[dt] = start + n
    for dt, used in offset.items():
        if used != buffers[dt].size:
            raise ValueError(f"packed arrays: the {dt} buffer has {buffers[dt].size} elements, the layout uses {used}")
    return out
