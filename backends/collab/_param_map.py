"""The map between the torch model's exchanged tensors and another framework's parameters, inferred.

Parameters cross the federation under *torch* names (the model's ``state_dict``: floating parameters
and buffers). A center in another framework builds the same architecture itself and needs, for every
torch tensor, the parameter that holds it and the axis permutation between the two layouts. Nothing
here imports a framework: the caller lists both sides as :class:`TensorInfo` (name, shape, owning layer
type) in their registration order, and :func:`infer_map` pairs them.

Rules, applied in this order:

1. **Leaf names are read through the framework's aliases** (:data:`LEAF_ALIASES`; MindSpore:
   ``gamma/beta`` → ``weight/bias``, ``moving_mean/moving_variance`` → ``running_mean/running_var``,
   ``embedding_table`` → ``weight``), and inside one layer the tensors are put in one canonical
   order (weight, bias, running mean, running variance), because frameworks register them
   differently (MindSpore's BatchNorm creates its moving statistics first).
2. **Names, where they agree**: a torch tensor whose layer path and canonical leaf equal a target
   parameter's is paired with it when the shapes fit and the layers are of one kind (a torch
   ``BatchNorm2d`` never takes a Keras ``Conv2D``'s bias because both sit at index 1 of a ``Sequential``).
   This decides what shapes cannot (two layers of the same shape registered in another order).
3. **Order for the rest**: the remaining tensors of both sides are paired position by position; each
   pair must fit by shape. A torch tensor that does not fit is an error naming it, what stands at its
   place, and which target parameter would fit (a missing layer, another order, another kernel size).

"Fits": for a layer type whose layout the framework fixes (:data:`KNOWN_LAYOUTS`: Paddle's ``Linear``
``[in, out]``, Keras' ``Dense`` ``[in, out]`` and ``Conv2D`` ``[kh, kw, i, o]``), equal after that
permutation only; otherwise equal shapes (the layout of Linear/Dense ``[out, in]``, Conv2d
``[o, i, kh, kw]``, norms and embeddings agrees between torch and MindSpore), or equal after one of
the layout permutations of :data:`LAYOUTS` (a matrix kept ``[in, out]`` for ``x @ W``, a kernel kept
``[kh, kw, i, o]``); the mapping then carries that permutation and says so. A square matrix of a
layer of unknown layout fits without transposing, so a transposed square weight is not detected
here: the forward-pass check that follows (:func:`._foreign.verify_map`) finds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DISPLAY", "KNOWN_LAYOUTS", "LAYOUTS", "LEAF_ALIASES", "ParamMapping", "TensorInfo", "apply_map",
           "infer_map", "invert_map"]

#: framework -> {its leaf name: the torch leaf name}
LEAF_ALIASES: dict[str, dict[str, str]] = {
    "mindspore": {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
                  "moving_variance": "running_var", "embedding_table": "weight"},
    "paddle": {"_mean": "running_mean", "_variance": "running_var"},
    "tensorflow": {"kernel": "weight", "gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
                   "moving_variance": "running_var", "embeddings": "weight"},
}

#: framework -> {(its layer type, canonical leaf): the permutation torch -> its layout}: layers whose
#: layout is known are laid out through it even where the shapes would also fit as they are (a square
#: Paddle ``Linear`` is ``[in, out]`` all the same)
KNOWN_LAYOUTS: dict[str, dict[tuple[str, str], tuple[int, ...]]] = {
    "paddle": {("Linear", "weight"): (1, 0)},
    "tensorflow": {("Dense", "weight"): (1, 0), ("Conv2D", "weight"): (2, 3, 1, 0)},
}

#: rank of a tensor -> the layout permutations (torch -> target) tried when the shapes differ
LAYOUTS: dict[int, tuple[tuple[int, ...], ...]] = {2: ((1, 0),), 4: ((2, 3, 1, 0),)}

#: how a framework is named in messages
DISPLAY = {"torch": "PyTorch", "mindspore": "MindSpore", "paddle": "PaddlePaddle", "tensorflow": "TensorFlow"}

_LEAF_RANK = {"weight": 0, "bias": 1, "running_mean": 2, "running_var": 3}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one side: its full name, shape, and the type name of the layer that owns it."""

    name: str
    shape: tuple[int, ...]
    layer: str = ""


@dataclass(frozen=True)
class ParamMapping:
    """One tensor: its torch name, its name in the other framework, and the axis permutation torch → other."""

    torch_name: str
    ms_name: str
    layer: str
    perm: tuple[int, ...] | None = None

    @property
    def torch_path(self) -> str:
        return self.torch_name.rpartition(".")[0]

    @property
    def ms_path(self) -> str:
        return self.ms_name.rpartition(".")[0]

    def to_ms(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if self.perm is None else a.transpose(self.perm))

    def to_torch(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if self.perm is None else a.transpose(np.argsort(self.perm)))

    def describe(self) -> str:
        how = "" if self.perm is None else f" (transposed {self.perm})"
        return f"{self.torch_name} -> {self.ms_name}{how}"


def _fit(src: tuple[int, ...], dst: tuple[int, ...], known: tuple[int, ...] | None = None
         ) -> tuple[int, ...] | bool | None:
    """None: same layout; a permutation: fits through it; False: does not fit. ``known``: the target
    layer's own layout (:data:`KNOWN_LAYOUTS`), the only one tried."""
    if known is not None:
        return known if len(src) == len(known) and tuple(src[p] for p in known) == dst else False
    if src == dst:
        return None
    for perm in LAYOUTS.get(len(src), ()):
        if tuple(src[p] for p in perm) == dst:
            return perm
    return False


#: a layer type's kind, read from its name in any framework (Conv2d / Conv2D, Linear / Dense, ...)
_KINDS = (("batchnorm", "batchnorm"), ("layernorm", "layernorm"), ("groupnorm", "groupnorm"), ("conv", "conv"),
          ("linear", "linear"), ("dense", "linear"), ("embedding", "embedding"))


def _kind(layer: str) -> str:
    low = layer.lower()
    return next((k for key, k in _KINDS if key in low), "")


def _same_kind(a: str, b: str) -> bool:
    """Whether two layer types can hold the same tensor (unknown kinds are not told apart)."""
    ka, kb = _kind(a), _kind(b)
    return not ka or not kb or ka == kb


def _canonical(entries: Sequence[TensorInfo], aliases: Mapping[str, str]) -> list[tuple[str, TensorInfo]]:
    """``(layer path + canonical leaf, entry)`` in registration order, canonical order inside each layer."""
    groups: dict[str, list[tuple[str, TensorInfo]]] = {}
    for e in entries:
        path, _, leaf = e.name.rpartition(".")
        groups.setdefault(path, []).append((f"{path}.{aliases.get(leaf, leaf)}" if path else aliases.get(leaf, leaf),
                                            e))
    out: list[tuple[str, TensorInfo]] = []
    for members in groups.values():
        out += sorted(members, key=lambda ce: _LEAF_RANK.get(ce[0].rpartition(".")[2], len(_LEAF_RANK)))
    return out


def _shape(e: TensorInfo) -> str:
    return str(tuple(e.shape))


def infer_map(torch_tensors: Sequence[TensorInfo], other: Sequence[TensorInfo],
              framework: str = "mindspore") -> tuple[ParamMapping, ...]:
    """Pair every torch tensor with one parameter of ``other`` (see the module docstring), in torch order.

    Raises ValueError naming the first torch tensor that nothing fits, or the first parameter of
    ``other`` left over.
    """
    src = _canonical(torch_tensors, {})
    dst = _canonical(other, LEAF_ALIASES.get(framework, {}))
    layouts = KNOWN_LAYOUTS.get(framework, {})
    known = {t.name: layouts.get((t.layer, key.rpartition(".")[2])) for key, t in dst}
    framework = DISPLAY.get(framework, framework)
    by_name = {key: e for key, e in dst}
    pairs: dict[str, tuple[TensorInfo, tuple[int, ...] | None]] = {}
    for key, s in src:  # rule 2: names where they agree
        t = by_name.get(key)
        if (t is not None and _same_kind(s.layer, t.layer)
                and (fit := _fit(s.shape, t.shape, known[t.name])) is not False):
            pairs[s.name] = (t, fit)
    used = {t.name for t, _ in pairs.values()}
    rest_s = [s for _, s in src if s.name not in pairs]
    rest_t = [t for _, t in dst if t.name not in used]
    for i, s in enumerate(rest_s):  # rule 3: order
        if i >= len(rest_t):
            raise ValueError(f"torch {s.name!r} {_shape(s)} has no {framework} parameter: the {framework} model has "
                             f"{len(other)} tensors, the torch model {len(torch_tensors)} — a layer missing from the "
                             f"{framework} model?")
        t = rest_t[i]
        fit = _fit(s.shape, t.shape, known[t.name])
        if fit is False:
            raise ValueError(_no_fit(s, t, rest_t[i + 1:], framework, known))
        pairs[s.name] = (t, fit)
    if len(rest_t) > len(rest_s):
        t = rest_t[len(rest_s)]
        raise ValueError(f"{framework} {t.name!r} {_shape(t)} has no torch tensor: the {framework} model has "
                         f"{len(other)} tensors, the torch model {len(torch_tensors)} — a layer the torch model lacks?")
    return tuple(ParamMapping(s.name, pairs[s.name][0].name, s.layer, pairs[s.name][1]) for s in torch_tensors)


def _no_fit(s: TensorInfo, t: TensorInfo, later: Sequence[TensorInfo], framework: str,
            known: Mapping[str, tuple[int, ...] | None]) -> str:
    head = (f"torch {s.name!r} {_shape(s)} has no {framework} parameter of that shape at its place, where the "
            f"{framework} model has {t.name!r} {_shape(t)}")
    for u in later:
        fit = _fit(s.shape, u.shape, known.get(u.name))
        if fit is not False:
            how = "would fit" if fit is None else f"would fit transposed {fit}"
            return (f"{head}; {framework} {u.name!r} {_shape(u)} {how} further on: a layer missing from the "
                    f"{framework} model before it, or its layers registered in another order")
    if (perm := known.get(t.name)) is not None and len(perm) == len(s.shape) == len(t.shape):
        laid = tuple(s.shape[p] for p in perm)
        diff = [i for i, (a, b) in enumerate(zip(laid, t.shape)) if a != b]
        return (f"{head} (torch's laid out as {framework}'s {t.layer} {laid}); they differ in dimension {diff} "
                "(another width or kernel size?)")
    if len(t.shape) == len(s.shape):
        diff = [i for i, (a, b) in enumerate(zip(s.shape, t.shape)) if a != b]
        return f"{head}; they differ in dimension {diff} (another width or kernel size?)"
    return f"{head}: a layer missing from the {framework} model, or another one in its place?"


def apply_map(params: Mapping[str, np.ndarray], mapping: Sequence[ParamMapping]) -> dict[str, np.ndarray]:
    """Torch-named arrays renamed and re-laid for the other framework."""
    missing = [m.torch_name for m in mapping if m.torch_name not in params]
    if missing:
        raise KeyError(f"torch parameters missing for the other framework's model: {missing}")
    return {m.ms_name: m.to_ms(np.asarray(params[m.torch_name], dtype=np.float32)) for m in mapping}


def invert_map(params: Mapping[str, np.ndarray], mapping: Sequence[ParamMapping]) -> dict[str, np.ndarray]:
    """Inverse of :func:`apply_map`: the other framework's arrays under torch names and layouts."""
    missing = [m.ms_name for m in mapping if m.ms_name not in params]
    if missing:
        raise KeyError(f"parameters missing from the other framework's model: {missing}")
    return {m.torch_name: m.to_torch(np.asarray(params[m.ms_name], dtype=np.float32)) for m in mapping}
