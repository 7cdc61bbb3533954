"""Centers in a framework other than torch: one mechanism for MindSpore, PaddlePaddle and TensorFlow.

Parameters cross the federation under *torch* names and layouts. A center in another framework
builds the same architecture itself — the built-in kind's model in that framework, or the user's from
the spec's builder for it (``ModelSpec.builder_for``: ``"package.module:function"``) — and exchanges
through a map inferred by :func:`._param_map.infer_map` from the torch model's ``state_dict`` and the
framework model's parameters (aliases, order, shapes, layouts), then checked here on a forward pass
before round 1 (:func:`verify_map`). What differs per framework is only how to build a model, list
and set its parameters, run it, hook a layer's output, read its norms' conventions and take SGD
steps: a :class:`Framework` (``_mindspore.MINDSPORE``, ``_paddle.PADDLE``, ``_keras.TENSORFLOW``).

Import order. MindSpore 2.10, PaddlePaddle 3.3 and TensorFlow 2.21 share one process only when
imported in the order torch → mindspore → paddle → tensorflow (measured: TensorFlow before Paddle
segfaults; Paddle before MindSpore breaks MindSpore's import on a oneDNN symbol).
:func:`import_frameworks` imports a federation's frameworks in that order and refuses, with the fix,
a process where a later one is already loaded.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._center import CenterData, batch_indices
from ._models import MODEL_KINDS, ModelSpec, build_torch_model, load_torch_state, resolve_reference, torch_state
from ._objective import TorchObjective, label_tensor
from ._param_map import DISPLAY, ParamMapping, TensorInfo, apply_map, infer_map, invert_map

__all__ = [
    "FOREIGN",
    "IMPORT_ORDER",
    "VERIFY_RTOL",
    "ForeignTrainer",
    "Framework",
    "build_foreign_model",
    "framework",
    "import_frameworks",
    "load_checked",
    "norm_settings",
    "parameter_map",
    "recording_hooks",
    "torch_tensors",
    "verify_map",
]

#: relative tolerance of the forward-pass check, ``max|other − torch| ≤ VERIFY_RTOL · max|torch|``
VERIFY_RTOL = 1e-4

#: the only order in which the frameworks share one process (see the module docstring)
IMPORT_ORDER = ("torch", "mindspore", "paddle", "tensorflow")

#: framework -> ``"module:object"`` of its :class:`Framework` (imported on first use)
FOREIGN: dict[str, str] = {
    "mindspore": "polyparallel.backends.collab._mindspore:MINDSPORE",
    "paddle": "polyparallel.backends.collab._paddle:PADDLE",
    "tensorflow": "polyparallel.backends.collab._keras:TENSORFLOW",
}

#: framework -> (its module, the pip requirement that installs it, the project's extra)
_PACKAGES = {"torch": ("torch", "torch==2.13.0", ""), "mindspore": ("mindspore", "mindspore==2.10.0", "mindspore"),
             "paddle": ("paddle", "paddlepaddle==3.3.1", "paddle"),
             "tensorflow": ("tensorflow", "tensorflow-cpu==2.21.0", "tensorflow")}


def import_frameworks(names: Iterable[str]) -> None:
    """Import the frameworks ``names`` in :data:`IMPORT_ORDER`; one line naming the fix when one is not
    installed, or when a framework that must come after it is loaded already in this process."""
    wanted = set(names)
    unknown = wanted - set(IMPORT_ORDER)
    if unknown:
        raise ValueError(f"no center trainer for framework(s) {sorted(unknown)}; known: {list(IMPORT_ORDER)}")
    for i, fw in enumerate(IMPORT_ORDER):
        module, req, extra = _PACKAGES[fw]
        if fw not in wanted or module in sys.modules:
            continue
        # torch imports after any of them (measured); the others only in this order
        later = [g for g in IMPORT_ORDER[i + 1:] if fw != "torch" and _PACKAGES[g][0] in sys.modules]
        if later:
            raise ValueError(
                f"{DISPLAY[fw]} must be imported before {', '.join(DISPLAY[g] for g in later)} in one process "
                f"(importing it after them crashes or fails; the safe order is {' -> '.join(IMPORT_ORDER)}), but "
                f"{', '.join(later)} is loaded already: start from a fresh process (polyparallel collab imports its "
                "centers' frameworks in that order), call polyparallel.backends.collab.import_frameworks([...]) "
                f"before importing any of them, or run the {fw} center as its own process (--engine flower)")
        try:
            importlib.import_module(module)
        except ImportError as e:
            how = f"pip install 'polyparallel[{extra}]' ({req})" if extra else f"pip install {req}"
            raise ValueError(f"{DISPLAY[fw]} centers need {req}, which this Python ({sys.executable}) cannot import "
                             f"({e}): {how} -c constraints.txt, or give those centers framework='torch'") from None


class Framework:
    """What a center needs of its framework (one instance per framework, see :data:`FOREIGN`); a framework
    implements every method but :meth:`ready`."""

    name: str       #: as in ``CenterSpec.framework``
    model_type: str  #: what a user's builder must return, for messages ("paddle.nn.Layer")

    def seed(self, seed: int) -> None:
        """Seed the framework's random initialisation."""

    def build(self, spec: ModelSpec) -> Any:
        """The built-in kind's model (the user's comes from :func:`build_foreign_model`)."""

    def check_model(self, model: Any) -> bool:
        """Whether ``model`` is one of this framework's models."""

    def ready(self, model: Any, sample: np.ndarray | None) -> Any:
        """``model`` with its parameters created (a Keras model is built on ``sample``; others have them)."""
        return model

    def tensors(self, model: Any) -> list[TensorInfo]:
        """Every parameter and statistic (name, shape, owning layer type), in registration order."""

    def state(self, model: Any) -> dict[str, np.ndarray]:
        """Every parameter and statistic as float32 numpy, under this framework's names."""

    def load(self, model: Any, params: Mapping[str, np.ndarray]) -> None:
        """Set parameters by this framework's names (shapes checked)."""

    def forward(self, model: Any, x: np.ndarray) -> np.ndarray:
        """Eval-mode output of ``x`` as numpy (the first output when there are several)."""

    def hook_outputs(self, model: Any, paths: Iterable[str], out: dict[str, np.ndarray]) -> AbstractContextManager:
        """A context in which a forward records each layer of ``paths``' first output into ``out``."""

    def norms(self, model: Any) -> dict[str, tuple[float | None, float | None]]:
        """Layer path -> (momentum given as the weight of the old statistic, epsilon) of its norm layers."""

    #: whether its BatchNorm blends the biased batch variance into the running one (torch: unbiased);
    #: :meth:`ForeignTrainer.unbias` then makes it torch's
    biased_running_var: bool

    def train_steps(self, trainer: ForeignTrainer, steps: int, round_idx: int, proximal_mu: float) -> list[float]:
        """``steps`` SGD steps of ``trainer``'s model on its batches; the data loss of each."""


def load_checked(own: Mapping[str, Any], params: Mapping[str, np.ndarray], what: str,
                 assign: Callable[[Any, np.ndarray], None]) -> None:
    """Set the variables ``own`` (name -> the framework's variable) from ``params`` (a subset of the names) with
    ``assign(variable, float32 array)``, after checking every name and shape; ``what`` names the model."""
    unknown = set(params) - set(own)
    if unknown:
        raise KeyError(f"{what} has no parameters {sorted(unknown)}")
    for name, a in params.items():
        if tuple(own[name].shape) != tuple(a.shape):
            raise ValueError(f"{name!r}: shape {tuple(a.shape)} does not fit the {what}'s {tuple(own[name].shape)}")
    for name, a in params.items():
        assign(own[name], np.ascontiguousarray(a, dtype=np.float32))


@contextmanager
def recording_hooks(layers: Mapping[str, Any], paths: Iterable[str], out: dict[str, np.ndarray],
                    register: Callable[[Any, Any], Any]) -> Iterator[None]:
    """:meth:`Framework.hook_outputs` for a framework with forward hooks: ``register(layer, hook)`` attaches
    ``hook(layer, inputs, output)`` and returns a handle with ``remove()``."""
    def hook(path: str) -> Any:
        def record(_layer: Any, _i: Any, o: Any) -> None:  # returns None: a returned value replaces the output
            out.setdefault(path, first_np(o))
        return record

    handles = [register(layers[p], hook(p)) for p in paths if p in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def norm_settings(layers: Iterable[tuple[str, Any]], momentum: str, eps: Sequence[str],
                  old_weight: Callable[[float], float] = float) -> dict[str, tuple[float | None, float | None]]:
    """:meth:`Framework.norms` from attributes: layer path -> (``old_weight(layer.<momentum>)``, the first of
    ``eps`` the layer has) for every layer holding a number in either."""
    out = {}
    for path, layer in layers:
        mom = getattr(layer, momentum, None)
        e = next((getattr(layer, a) for a in eps if isinstance(getattr(layer, a, None), float | int)), None)
        mom = mom if isinstance(mom, float | int) else None
        if mom is not None or e is not None:
            out[path] = (None if mom is None else old_weight(float(mom)), None if e is None else float(e))
    return out


def framework(name: str) -> Framework:
    """The :class:`Framework` of ``name``, its module imported in the safe order."""
    if name not in FOREIGN:
        raise ValueError(f"no center trainer for framework {name!r}; known: {['torch', *FOREIGN]}")
    import_frameworks([name])
    module, _, attr = FOREIGN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _which(spec: ModelSpec, fw: str) -> str:
    d = DISPLAY[fw]
    return f"{d} model {spec.builder_for(fw)!r} for {spec.kind!r}" if spec.user else f"{d} {spec.kind!r}"


def build_foreign_model(spec: ModelSpec, fw: str, seed: int = 0, sample: np.ndarray | None = None) -> Any:
    """The model of ``spec`` in framework ``fw``: the user's (its builder, ``spec.builder_for(fw)``) or the
    built-in kind's, with the torch model's architecture; parameters created (on ``sample`` where needed)."""
    f = framework(fw)
    f.seed(seed)
    if not spec.user:
        return f.ready(f.build(spec), sample)
    ref = spec.builder_for(fw)
    if not ref:
        hint = "ModelSpec(mindspore='package.module:function') (--mindspore-model)" if fw == "mindspore" else \
            f"ModelSpec(builders={{'{fw}': 'package.module:function'}})"
        raise ValueError(f"model {spec.kind!r} is a torch model: a {DISPLAY[fw]} center needs the same architecture "
                         f"as a {f.model_type}: give its builder as {hint} (--builder {fw}=MODULE:FUNCTION), or "
                         f"train it on torch centers (built-in kinds: {MODEL_KINDS})")
    model = resolve_reference(ref, f"{DISPLAY[fw]} model")()
    if not f.check_model(model):
        raise TypeError(f"{DISPLAY[fw]} model {ref!r} returned a {type(model).__name__}; it must return a "
                        f"{f.model_type}")
    return f.ready(model, sample)


def torch_tensors(model: Any) -> list[TensorInfo]:
    """The exchanged tensors of a torch model (floating ``state_dict`` entries) with their layer types."""
    kinds = {name: type(mod).__name__ for name, mod in model.named_modules()}
    return [TensorInfo(k, tuple(v.shape), kinds.get(k.rpartition(".")[0], ""))
            for k, v in model.state_dict().items() if v.is_floating_point()]


def parameter_map(spec: ModelSpec, fw: str, torch_model: Any = None, model: Any = None,
                  sample: np.ndarray | None = None) -> tuple[ParamMapping, ...]:
    """The torch ↔ ``fw`` map of ``spec``, inferred from both models (built when not given).

    Raises ValueError naming the first torch tensor no parameter of the other model fits.
    """
    torch_model = build_torch_model(spec) if torch_model is None else torch_model
    model = build_foreign_model(spec, fw, sample=sample) if model is None else model
    try:
        return infer_map(torch_tensors(torch_model), framework(fw).tensors(model), fw)
    except ValueError as e:
        raise ValueError(f"{_which(spec, fw)}: {e}") from None


def _probe_state(state: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The initial state moved off its defaults, so every tensor shows in the output: positive tensors
    (variances, norm scales of one) scaled by ``exp(0.2 n)``, the rest shifted by a tenth of their spread."""
    rng = np.random.default_rng([seed, 0x5EED])
    out = {}
    for k, a in state.items():
        n = rng.standard_normal(a.shape).astype(np.float32)
        if a.size and a.min() > 0:
            out[k] = (a * np.exp(0.2 * n)).astype(np.float32)
        else:
            out[k] = (a + 0.1 * max(float(a.std()), 0.1) * n).astype(np.float32)
    return out


def first_np(out: Any) -> np.ndarray:
    """The first output of any framework's forward as numpy."""
    out = getattr(out, "logits", out)
    if isinstance(out, tuple | list):
        out = out[0]
    if hasattr(out, "asnumpy"):
        return out.asnumpy()
    if hasattr(out, "detach"):
        return out.detach().cpu().numpy()
    return np.asarray(out.numpy() if hasattr(out, "numpy") else out)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12)) if want.size else 0.0


#: a layer output's rank -> the layouts it may have beside torch's (channels-last images, as Keras keeps them)
ACTIVATION_LAYOUTS = {4: ((0, 3, 1, 2),)}


def _layer_rel(got: np.ndarray | None, want: np.ndarray) -> float | None:
    """Relative difference of a layer's output from torch's in the layout that fits best (None: it never
    ran or no layout has torch's shape)."""
    if got is None:
        return None
    cands = [got, *(got.transpose(p) for p in ACTIVATION_LAYOUTS.get(got.ndim, ()))]
    errs = [_rel(c, want) for c in cands if c.shape == want.shape]
    return min(errs) if errs else None


def _check_conventions(torch_model: Any, f: Framework, model: Any, mapping: tuple[ParamMapping, ...],
                       which: str) -> None:
    """What an eval-mode forward pass cannot see: BatchNorm's momentum and the norms' epsilon."""
    norms = f.norms(model)
    d = DISPLAY[f.name]
    for m in mapping:
        mod, conv = torch_model.get_submodule(m.torch_path), norms.get(m.ms_path)
        if conv is None or not m.layer.startswith(("BatchNorm", "LayerNorm")):
            continue
        old, eps = conv
        if m.layer.startswith("BatchNorm") and old is not None and abs((1 - old) - (mod.momentum or 0.0)) > 1e-6:
            raise ValueError(f"{which}: {d} {m.ms_path!r} is built with momentum={old:g}, the weight "
                             f"{d} gives the old statistic (torch's momentum {1 - old:g}), but torch "
                             f"{m.torch_path!r} has momentum {mod.momentum}: build it with "
                             f"momentum={1 - (mod.momentum or 0.0):g}")
        if eps is not None and abs(eps - mod.eps) > 1e-12:
            raise ValueError(f"{which}: {d} {m.ms_path!r} has epsilon {eps:g}, torch {m.torch_path!r} "
                             f"{mod.eps:g}: give the {d} layer epsilon {mod.eps:g}")


def np_loss(spec: ModelSpec, out: np.ndarray, y: np.ndarray, bias: np.ndarray | None = None) -> tuple[float, int]:
    """A center's loss of an output in float64: MSE, or cross-entropy over the last dimension (-100 ignored);
    with the number of targets it averages over."""
    out = np.asarray(out, dtype=np.float64)
    if spec.loss == "mse":
        return float(((out - np.asarray(y, dtype=np.float64).reshape(out.shape)) ** 2).mean()), int(np.size(y))
    if bias is not None:
        out = out + bias
    logits = out.reshape(-1, out.shape[-1])
    t = np.asarray(y).reshape(-1).astype(np.int64)
    keep = t != -100
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(t)), np.where(keep, t, 0)]
    n = int(keep.sum())
    return float((nll * keep).sum() / max(n, 1)), n


def verify_map(spec: ModelSpec, fw: str, torch_model: Any, model: Any, mapping: tuple[ParamMapping, ...],
               x: np.ndarray, y: np.ndarray, seed: int = 0) -> float:
    """Check ``mapping`` on one batch: the same (perturbed) parameters in both models, eval mode, must give
    outputs within :data:`VERIFY_RTOL` relative and the same loss. Returns the relative output error.

    Raises ValueError naming the first torch layer (in execution order) whose output differs from the
    ``fw`` layer its tensors map to, with those tensors, or the convention or loss that differs.
    """
    import torch

    f = framework(fw)
    d = DISPLAY[fw]
    which = _which(spec, fw)
    state = _probe_state(torch_state(torch_model), seed)
    load_torch_state(torch_model, state)
    f.load(model, apply_map(state, mapping))
    _check_conventions(torch_model, f, model, mapping, which)
    objective = TorchObjective(torch_model, spec.loss)
    if not objective.logits_without_labels:
        raise ValueError(f"{which}: the torch model's forward needs labels, so its output cannot be compared with "
                         f"the {d} model's: give forward's labels a default (None) and return the logits then")
    t_out: dict[str, np.ndarray] = {}
    m_out: dict[str, np.ndarray] = {}
    order: list[str] = []

    def t_hook(path: str) -> Any:
        def hook(_m: Any, _i: Any, o: Any) -> None:
            if path not in t_out:
                t_out[path] = first_np(o)
                order.append(path)
        return hook

    handles = [torch_model.get_submodule(p).register_forward_hook(t_hook(p)) for p in {m.torch_path for m in mapping}]
    torch_model.eval()
    xt = torch.from_numpy(np.ascontiguousarray(x))
    try:
        with torch.no_grad():
            want = first_np(objective.outputs(torch_model, xt))
            t_loss = float(objective(torch_model, xt, label_tensor(y, spec.loss)))
        with f.hook_outputs(model, {m.ms_path for m in mapping}, m_out):
            got = f.forward(model, np.ascontiguousarray(x))
    finally:
        for h in handles:
            h.remove()
        torch_model.train()
    m_loss = np_loss(spec, got, y)[0]
    err = _rel(got, want) if got.shape == want.shape else float("inf")
    if err > VERIFY_RTOL:
        head = (f"{which} does not reproduce the torch model on the center's first batch (eval mode, output "
                f"{tuple(got.shape)} vs {tuple(want.shape)}, relative error {err:.3g} > {VERIFY_RTOL:g})")
        for path in order:
            maps = [m for m in mapping if m.torch_path == path]
            mp = maps[0].ms_path
            b, a = m_out.get(mp), t_out[path]
            rel = _layer_rel(b, a)
            if rel is None or rel > VERIFY_RTOL:
                what = ("never runs" if b is None else f"gives {tuple(b.shape)} for torch's {tuple(a.shape)}"
                        if rel is None else f"differs by {rel:.3g} relative")
                raise ValueError(
                    f"{head}: the first layer whose output differs is torch {path or '<root>'!r} ({maps[0].layer}) "
                    f"vs {d} {mp or '<root>'!r}, which {what}; mapped: {', '.join(m.describe() for m in maps)}. "
                    f"Check that this {d} layer matches (kernel, stride, padding, what runs before it) and that "
                    "the model registers its layers in the torch model's order (same-shape layers are paired by "
                    "order unless their names agree)")
        raise ValueError(f"{head}: every layer with parameters agrees, so what differs runs after torch "
                         f"{order[-1] if order else '<root>'!r} (activation, pooling, reshape, layout) in its forward")
    if abs(m_loss - t_loss) > VERIFY_RTOL * max(abs(t_loss), 1.0):
        kind = "mse" if spec.loss == "mse" else "cross-entropy over the last dimension"
        raise ValueError(f"{which}: the outputs agree but the torch loss {t_loss:.6g} is not the {d} center's "
                         f"{kind} of the output ({m_loss:.6g}); set loss='cross_entropy' or 'mse' so every center "
                         "trains the same objective, or train this model on torch centers")
    return err


@dataclass
class ForeignTrainer(CenterData):
    """Local SGD in ``framework`` (CPU) on one center's data; speaks torch names on the wire.

    Built: the framework's model of the spec, the torch model (for the map only), the inferred map,
    checked on the center's first batch (:func:`verify_map`), so a wrong map fails before round 1.
    Training is the framework's (:meth:`Framework.train_steps`): the torch trainer's SGD (momentum
    fresh each round, FedProx term, logit adjustment) on the same batches (:func:`batch_indices`).
    """

    framework: str = "mindspore"

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.model_spec
        self.fw = framework(self.framework)
        if spec.loss == "model":
            raise ValueError(f"loss='model' is the torch model's own loss, which a {DISPLAY[self.framework]} center "
                             f"cannot run: use loss='auto' (checked to equal cross-entropy) or 'cross_entropy' for "
                             f"{spec.kind!r}")
        first = batch_indices(len(self.x), self.batch_size, 1, self.seed, self.center_index, 1)[0]
        self._model = build_foreign_model(spec, self.framework, self.seed, self.x[first])
        torch_model = build_torch_model(spec, self.seed)
        self.mapping = parameter_map(spec, self.framework, torch_model, self._model)
        self.verify_error = verify_map(spec, self.framework, torch_model, self._model, self.mapping, self.x[first],
                                       self.y[first], self.seed)
        self._unbias = self._running_vars(self.x[first]) if self.fw.biased_running_var else []

    def _running_vars(self, sample: np.ndarray) -> list[tuple[str, float, int]]:
        """``(its name here, momentum as the weight of the old statistic, values per row and channel)`` of
        each BatchNorm running variance, for :meth:`unbias`."""
        norms = self.fw.norms(self._model)
        bns = {m.ms_path: m.ms_name for m in self.mapping if m.torch_name.endswith(".running_var")}
        shapes: dict[str, np.ndarray] = {}
        with self.fw.hook_outputs(self._model, bns, shapes):
            self.fw.forward(self._model, sample)
        state = self.fw.state(self._model)
        out = []
        for path, name in bns.items():
            o, mom, channels = shapes[path], norms[path][0], state[name].size
            out.append((name, 0.0 if mom is None else mom, o.size // (o.shape[0] * channels)))
        return out

    def running_vars(self) -> dict[str, np.ndarray]:
        """The BatchNorm running variances before a step, for :meth:`unbias` (empty: the framework's are torch's)."""
        if not self._unbias:
            return {}
        state = self.fw.state(self._model)
        return {name: state[name] for name, _, _ in self._unbias}

    def unbias(self, before: Mapping[str, np.ndarray], rows: int) -> None:
        """After a step on ``rows`` rows: the running variances as torch updates them, from the *unbiased* batch
        variance. Paddle and Keras blend in the biased one ``b``: ``new = m·old + (1 − m)·b``; torch's is
        ``new + (1 − m)·b/(n − 1) = new + (new − m·old)/(n − 1)`` for ``n`` values per channel."""
        if not before:
            return
        state = self.fw.state(self._model)
        fixed = {}
        for name, mom, per_row in self._unbias:
            n = rows * per_row
            if n > 1:
                fixed[name] = state[name] + (state[name] - mom * before[name]) / (n - 1)
        self.fw.load(self._model, fixed)

    @property
    def model(self) -> Any:
        return self._model

    def batches(self, steps: int, round_idx: int) -> list[np.ndarray]:
        """Row indices of this round's batches: the torch trainer's."""
        return batch_indices(len(self.x), self.batch_size, steps, self.seed, self.center_index, round_idx)

    def labels(self, idx: np.ndarray) -> np.ndarray:
        """The batch's targets as the framework's loss takes them: int64 classes, or float32 for MSE."""
        return np.ascontiguousarray(self.y[idx], dtype=np.float32 if self.model_spec.loss == "mse" else np.int64)

    def train(self, global_params: Mapping[str, np.ndarray], *, steps: int, round_idx: int,
              proximal_mu: float = 0.0) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        self.fw.load(self._model, apply_map(global_params, self.mapping))
        losses = self.fw.train_steps(self, steps, round_idx, proximal_mu)
        return invert_map(self.fw.state(self._model), self.mapping), {"train_loss": float(np.mean(losses))}

    def evaluate(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                 batch: int = 2048) -> dict[str, float]:
        """``loss`` (mean over targets), ``count``, and ``accuracy`` / ``perplexity`` as the torch centers report."""
        self.fw.load(self._model, apply_map(params, self.mapping))
        y = np.asarray(y)
        classify = np.issubdtype(y.dtype, np.integer) and self.model_spec.loss != "mse"
        loss_sum, count, correct = 0.0, 0, 0
        for s in range(0, len(x), batch):
            yb = y[s:s + batch]
            out = self.fw.forward(self._model, np.ascontiguousarray(x[s:s + batch]))
            loss, n = np_loss(self.model_spec, out, yb)
            loss_sum += loss * n
            count += n
            if classify:
                correct += int(((out.argmax(-1) == yb) & (yb != -100)).sum())
        res = {"loss": loss_sum / max(count, 1), "count": float(count)}
        if classify:
            res["accuracy"] = correct / max(count, 1)
            if y.ndim >= 2:
                res["perplexity"] = math.exp(min(res["loss"], 700.0))
        return res
