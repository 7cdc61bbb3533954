"""Online pruning across centers: importance where the data is, fused scores, soft masks, one structural cut.

A job with ``CollabConfig.prune`` (a :class:`PruneSpec`: target ``ratio``, ``rounds`` ``K``, ``score``)
runs as any other for its first ``K`` rounds, with three additions:

1. **Scores at the centers.** After its local steps a torch center scores every prunable channel /
   neuron of its *local* model on its *own* rows (:func:`center_scores`) and sends one vector per
   channel group with its update, under the update's compression and bound to the round like it
   (keys ``p/q/<root layer>``, :data:`SCORE_PREFIX`). The groups are Torch-Pruning's (DepGraph, Fang
   et al. 2023): the layers that must lose the same channel together (residual adds, BatchNorm,
   grouped / depthwise convs, concatenations, tied parameters). A channel's score is the sum over its
   group of an element-wise saliency ``S``:

   - ``magnitude``: ``S = w²`` (the group L2 norm; needs no data, but is taken on the center's
     locally trained weights),
   - ``taylor``: ``S = |w · ḡ|``, ``ḡ`` the mean gradient over ``score_batches`` of the center's
     batches: the first-order estimate of the loss change when the weight goes (Molchanov et al. 2019),
   - ``fisher``: ``S = ½ w² · mean(g²)``: Optimal Brain Damage with the empirical Fisher diagonal as
     the Hessian (LeCun et al. 1990; Theis et al. 2018). Chosen as the third because near a trained
     point ``ḡ ≈ 0``, so per-batch gradients of opposite sign cancel in ``taylor`` (worse with few
     batches and non-IID centers); ``g²`` does not cancel and estimates the *second*-order loss increase.

   Each vector is divided by its mean, so no center's loss scale outweighs another's. A center sends
   numbers about channels, never data; it never sees another center's scores.
2. **Fusion of the scores.** The server fuses the accepted centers' vectors with a fresh instance of
   the job's own fusion (same options; global value zero), so a robust fusion is robust for the scores
   too (a center refused for its update is left out of the scores as well), and keeps an average over
   the rounds (``ema``). Only memoryless fusions can do that (:data:`SCORE_FUSIONS`): a server
   optimiser's moments, SCAFFOLD's control variates, FLTrust's root update or FoolsGold's history mean
   nothing for scores, so the config refuses them.
3. **Soft masks.** After round ``t <= K`` the server zeroes the channels the fused scores rank lowest,
   for a target sparsity ``ratio_t = ratio · (1 − (1 − t/K)³)`` (the cubic schedule of Zhu & Gupta
   2017): every tensor that *produces* the channel (conv / linear rows and bias, normalisation affine),
   so the channel carries exact zeros. ``ratio`` is a share of the model's *parameters* (``target=
   "params"``, the default, what a user calls target sparsity): the server finds, by bisection over the
   channel ratio (:func:`channel_ratio_for`), the fewest channels whose cut leaves at most
   ``(1 − ratio_t)`` of the parameters, counted on a cut copy (a channel ratio of 0.5 removes about 3/4
   of a CNN's parameters, since a conv's weights shrink with its input and its output channels).
   ``target="channels"`` makes ``ratio`` the share of every group's channels instead. The channels go
   with the same share of every group (``uniform``) or by one ``global`` ranking of the fused scores
   (each group's normalised to mean 1, Torch-Pruning's global pruning) that keeps at least
   :data:`MIN_KEEP` of every group. The centers train on from the masked model, so a channel can
   grow back while ``ratio_t`` is below the target (soft filter pruning, He et al. 2018) where a zero
   passes a gradient: a linear layer before GELU (a transformer's MLP, its q/k/v projections). A
   channel that a ReLU follows does not: its input is exactly 0, where ReLU's gradient is 0, so
   nothing that produces it moves again (a conv-BatchNorm-ReLU network's masks are hard ones; zeroing
   only the BatchNorm's scale and shift, the conv rows kept, trains the same).

After round ``K`` the server removes the channels of the last mask for good: the *plan* (Torch-Pruning's
pruning history: root layer, output or input side, indices) is applied to the server's model with
the DepGraph and, before its next round, to every center's model (:func:`conform_trainer`), the same
list on the same architecture, so every side holds the same smaller model. Since the removed channels
carried zeros, the cut does not change what the model computes (where a removed channel is not read
by a normalisation over channels, e.g. LayerNorm over the pruned dimension). The remaining rounds
fine-tune the smaller model collaboratively.

Which groups are pruned: every group Torch-Pruning forms (the output layer's classes excepted) whose cut
preserves the function, which :func:`kept_whole` checks once per model on a copy (half the group's
channels masked at random, the copy cut, both run on a random input). A group failing it is kept whole
and named in the release: a transformer's residual stream (LayerNorm reads every channel, so zeros do
not leave without changing its statistics), or an attention whose forward hard-codes its widths.
A tied parameter (an embedding and the output projection that reads its weight) stays one parameter
through the cut (:func:`apply_plan` ties it again), so it loses the same channels once and trains as one.
Attention heads: a module with a head count (``num_heads``, :data:`HEAD_ATTRS`) has its query / key /
value projection (:data:`QKV_NAMES`) given to Torch-Pruning with that count (:func:`attention_heads`),
which then removes the *same* dimensions from every head, q, k and v alike, and the output projection's
matching inputs (the group keyed ``<proj>:in``); or, with ``PruneSpec.heads="whole"``, whole heads (the
head width stays): the plan then also says each such module's new head count, which every side sets
with the cut (:func:`apply_plan`), and :func:`kept_whole` checks that the module's forward follows it.

Engines: in-process, and Flower over its messages (the scores in the replies, the plan in the server's
messages after the cut, :mod:`._flower_app`) or over the lean data channel (the plan in the frames'
headers, :mod:`._lean`); the same model bit for bit. Centers: torch, and MindSpore
through the parameter map (scores by its torch twin, the cut model trained as its masked full-size cell,
:mod:`._pruning_foreign`); data-parallel and other frameworks' centers refuse a pruning job with a line
saying so. ``serve`` deployments prune too: the job file names
the input row's shape the server traces on (``PruneSpec.input_shape``, :func:`with_input_of`), and the
server's checkpoint carries the pruning state (:meth:`._pruning_server.ServerPruning.state`), so a
restarted server goes on. The server's side (fused scores, masks, the cut) is :mod:`._pruning_server`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from pydantic import Field

from ._models import build_torch_model
from ._objective import TorchObjective
from ._records import Real, config_record
from ._wire import encode_update

__all__ = ["DISTILL_TEACHERS", "MIN_KEEP", "PRUNE_ALLOCATIONS", "PRUNE_HEADS", "PRUNE_SCORES", "PRUNE_TARGETS",
           "SCORE_FUSIONS", "SCORE_PREFIX", "PruneError", "PruneSpec", "apply_plan", "attention_heads", "center_scores",
           "channel_ratio_for", "channels_of", "conform_trainer", "example_input", "group_scores", "kept_whole",
           "mask_and_plan", "normalised", "output_layers", "param_count", "params_after", "saliency", "scoring_model",
           "with_input_of"]

PRUNE_SCORES = ("magnitude", "taylor", "fisher")
#: what ``PruneSpec.ratio`` is a share of: the model's parameters, or every prunable group's channels
PRUNE_TARGETS = ("params", "channels")
#: how the channels removed are spread over the groups: the same share of each, or one global ranking
PRUNE_ALLOCATIONS = ("uniform", "global")
#: what an attention loses: the same dimensions of every head, or whole heads (its head count drops)
PRUNE_HEADS = ("dims", "whole")
#: with the global allocation, the share of a group's channels that always stays (no layer collapses)
MIN_KEEP = 0.1
SCORE_PREFIX = "p/"
#: the teacher of ``PruneSpec.distill``: the fused model at the cut, or each round's fused model
DISTILL_TEACHERS = ("cut", "round")
#: fusions whose ``fuse`` is a memoryless function of the replies, so it can fuse score vectors too
SCORE_FUSIONS = ("fedavg", "fedprox", "trimmed_mean", "median", "krum", "centered_clip")


class PruneError(ValueError):
    """A pruning job that cannot run (a model the dependency graph cannot trace, a bad option)."""


@config_record
class PruneSpec:
    """Online pruning of a collaborative job (see the module docstring).

    Args:
        ratio: the target sparsity, in (0, 1): with ``target="params"`` (the default) the share of the
            model's parameters the cut removes (at least that: channels are whole), with
            ``target="channels"`` the share of every prunable group's channels.
        rounds: ``K``: soft masks in rounds ``warmup+1..K``, the structural cut after round ``K``.
        score: ``magnitude``, ``taylor`` or ``fisher`` (:data:`PRUNE_SCORES`).
        score_batches: batches of the center's rows its data-dependent scores average over.
        ema: weight of the past rounds in the server's running fused scores (0: the last round only).
        target: ``params`` or ``channels`` (:data:`PRUNE_TARGETS`): what ``ratio`` is a share of.
        allocation: ``uniform`` (every group loses the same share of its channels) or ``global`` (one
            ranking of the fused, group-normalised scores across the groups, Torch-Pruning's global
            pruning, each group keeping at least :data:`MIN_KEEP` of its channels).
        heads: what an attention module with a head count (:func:`attention_heads`) loses: ``dims``, the
            same dimensions of every head (its head count stays), or ``whole`` heads, ranked by their
            channels' mean score (the head width stays, the module's head count drops; the plan says so).
        warmup: rounds ``1..warmup`` train the full model unmasked (the centers score from round 1, so
            the ranking the masks start from has averaged over them), the sparsity then rises over rounds
            ``warmup+1..K`` (Zhu & Gupta's schedule starts after ``t0`` steps of dense training); ``0 <= warmup < K``.
        distill: ``a`` in [0, 1): in the fine-tuning rounds after the cut each torch center's local loss is
            ``(1 − a)·CE + a·T²·KL(softmax(teacher/T) ‖ softmax(student/T))`` on its own rows (Hinton et
            al. 2015), the teacher a frozen model the center keeps in memory (:mod:`._distill`); 0: off
            (the local step is the one without it, bit for bit).
        distill_temperature: ``T`` > 0 of the distillation term.
        distill_teacher: ``cut``: the first fused model the center receives after the cut (the fused
            model at the cut: the masked full-size model computes the same function), kept for the
            remaining rounds; ``round``: the fused model the center receives at the start of each round
            (the global model as teacher of the local steps, as in FedGKD / FedNTD against client drift).
        input_shape, input_dtype: one input row's shape (no batch dimension) and numpy dtype, on whose
            zeros the server traces the model (it reads no row). Empty: taken from the centers' rows by
            the engine (:func:`with_input_of`); a deployment's job file (``serve``) must give them.
    """

    ratio: Real
    rounds: Real = 1  # the counts are checked whole below, with their messages
    score: str = "fisher"
    score_batches: Real = 4
    ema: Real = 0.5
    target: str = "params"
    allocation: str = "global"
    heads: str = Field("dims", exclude_if=lambda v: v == "dims")  # the default: the JSON of before
    warmup: Real = 0
    distill: Real = 0.0
    distill_temperature: Real = 4.0
    distill_teacher: str = "cut"
    input_shape: tuple[int, ...] = Field((), exclude_if=lambda v: not v)  # none: the JSON of before
    input_dtype: str = Field("float32", exclude_if=lambda v: v == "float32")

    def __post_init__(self) -> None:
        if not all(d >= 1 for d in self.input_shape):
            raise PruneError(f"input_shape must be whole numbers >= 1 (one input row's shape), got {self.input_shape}")
        try:
            np.dtype(self.input_dtype)
        except TypeError:
            raise PruneError(f"input_dtype {self.input_dtype!r} is no numpy dtype (float32, int64, ...)") from None
        if not (isinstance(self.ratio, int | float) and 0.0 < self.ratio < 1.0):
            raise PruneError(f"pruning ratio must be in (0, 1) (the share of parameters removed), got {self.ratio}")
        if int(self.rounds) != self.rounds or self.rounds < 1:
            raise PruneError(f"pruning rounds K must be an integer >= 1, got {self.rounds}")
        if self.score not in PRUNE_SCORES:
            raise PruneError(f"unknown pruning score {self.score!r}; choose one of {PRUNE_SCORES}")
        if int(self.score_batches) != self.score_batches or self.score_batches < 1:
            raise PruneError(f"score_batches must be an integer >= 1, got {self.score_batches}")
        if not 0.0 <= self.ema < 1.0:
            raise PruneError(f"ema must be in [0, 1), got {self.ema}")
        if self.target not in PRUNE_TARGETS:
            raise PruneError(f"unknown pruning target {self.target!r}; choose one of {PRUNE_TARGETS}")
        if int(self.warmup) != self.warmup or not 0 <= self.warmup < self.rounds:
            raise PruneError(f"pruning warmup must be an integer in [0, K={self.rounds}), got {self.warmup}")
        if self.allocation not in PRUNE_ALLOCATIONS:
            raise PruneError(f"unknown pruning allocation {self.allocation!r}; choose one of {PRUNE_ALLOCATIONS}")
        if self.heads not in PRUNE_HEADS:
            raise PruneError(f"unknown head pruning {self.heads!r}; choose one of {PRUNE_HEADS}")
        if not (isinstance(self.distill, int | float) and 0.0 <= self.distill < 1.0):
            raise PruneError(f"distillation weight must be in [0, 1) (0: off), got {self.distill}")
        if not (isinstance(self.distill_temperature, int | float) and self.distill_temperature > 0
                and math.isfinite(self.distill_temperature)):
            raise PruneError(f"distillation temperature must be a finite number > 0, got {self.distill_temperature}")
        if self.distill_teacher not in DISTILL_TEACHERS:
            raise PruneError(f"unknown distillation teacher {self.distill_teacher!r}; choose one of {DISTILL_TEACHERS}")

    def sparsity(self, round_idx: int) -> float:
        """The target sparsity after round ``round_idx``: ``ratio · (1 − (1 − t)³)``, ``t = (round − W) /
        (K − W)`` clipped to [0, 1], ``W`` the warmup (a share of the parameters or of the channels, as
        ``target`` says): 0 in the warmup rounds, ``ratio`` at round ``K``."""
        t = min(max(round_idx - self.warmup, 0), self.rounds - self.warmup) / (self.rounds - self.warmup)
        return self.ratio * (1.0 - (1.0 - t) ** 3)


# --------------------------------------------------------------------------- the dependency graph
def example_input(x_like: np.ndarray) -> Any:
    """A tracing input shaped like two rows of ``x_like`` (zeros: the server needs shapes, not data)."""
    import torch

    a = np.asarray(x_like)
    dtype = torch.float32 if a.dtype.kind == "f" else torch.int64
    return torch.zeros((2, *a.shape[1:]), dtype=dtype)


def _logits(out: Any) -> Any:
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple | list) else out


def output_layers(model: Any, example: Any) -> list[Any]:
    """The layer that writes the model's output (its channels are the classes: never pruned): the last
    conv / linear called whose output has the output's shape."""
    import torch
    from torch import nn

    calls: list[tuple[Any, Any]] = []
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append((m, o)))
             for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)]
    try:
        with torch.no_grad():
            out = _logits(model(example))
    finally:
        for h in hooks:
            h.remove()
    for m, o in reversed(calls):
        if torch.is_tensor(o) and tuple(o.shape) == tuple(out.shape):
            return [m]
    return []


def _traced(model: Any, build: Any) -> Any:
    """Run ``build()`` (which traces ``model``) in eval mode, so tracing moves no running statistic; a
    failure names the layer the forward was in."""
    import torch

    names = {m: n for n, m in model.named_modules()}
    entered: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, i: entered.append(names[m])) for m in model.modules()]
    was = model.training
    model.eval()
    try:
        with torch.enable_grad():
            return build()
    except Exception as e:  # any tracing failure is the user's model's: one line naming the layer
        where = f" in layer {entered[-1]!r}" if entered and entered[-1] else ""
        raise PruneError(f"the pruning library (Torch-Pruning's DepGraph) cannot trace the model{where}: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        for h in hooks:
            h.remove()
        model.train(was)


def _check_covered(model: Any, dg: Any) -> None:
    """Every conv / linear layer with weights must be in the traced graph; one that is not (its output
    left the autograd graph: numpy, ``.detach()``, a data-dependent branch) cannot be pruned consistently."""
    from torch import nn

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear | nn.modules.conv._ConvNd) and m not in dg.module2node:
            raise PruneError(f"the pruning library (Torch-Pruning's DepGraph) cannot trace layer {name!r}: its "
                             "output does not reach the model's output through autograd (numpy, .detach(), "
                             "in-place writes); prune without it or make its forward differentiable")


#: attribute names under which an attention module keeps its head count
HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads")
#: names of the linear layers that project into query / key / value heads
QKV_NAMES = ("qkv", "to_qkv", "c_attn", "in_proj", "q", "k", "v", "query", "key", "value",
             "q_proj", "k_proj", "v_proj", "to_q", "to_k", "to_v")


def _attentions(model: Any) -> list[tuple[str, Any, str, list[Any]]]:
    """``(name, module, head-count attribute, its q/k/v projections)`` of the model's attention modules:
    a module with an integer head count (:data:`HEAD_ATTRS`) and linear children named like
    :data:`QKV_NAMES` whose output divides by it."""
    from torch import nn

    out = []
    for mname, m in model.named_modules():
        attr = next((a for a in HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        h = getattr(m, attr) if attr else 0
        qkv = [c for name, c in m.named_children()
               if h >= 1 and name in QKV_NAMES and isinstance(c, nn.Linear) and c.out_features % h == 0]
        if qkv:
            out.append((mname, m, attr, qkv))
    return out


def attention_heads(model: Any) -> dict[Any, int]:
    """The query / key / value projections of the model's attention modules and their head count.
    Torch-Pruning, told these, removes the same dimensions from every head (q, k and v alike) instead
    of any channels of the projection, or whole heads (``heads="whole"``)."""
    return {c: getattr(m, attr) for _, m, attr, qkv in _attentions(model) for c in qkv}


def _pruner(model: Any, example: Any, ratio: float, importance: Any, kept: Sequence[str] | None = None,
            allocation: str = "uniform", heads: str = "dims") -> Any:
    """Torch-Pruning's pruner over the model's channel groups: the output layer, and the groups
    :func:`kept_whole` finds (``kept``, computed when None), left whole; attention heads kept consistent
    (``heads="whole"``: ``ratio`` of the heads go whole, ranked by their channels' mean importance);
    ``allocation="global"``: one ranking across the groups (``global_pruning``)."""
    import torch_pruning as tp

    if kept is None:
        kept_whole(model, example, heads)
        kept = model.__dict__["_pp_kept_whole"][2]
    mods = dict(model.named_modules())

    def build() -> Any:
        return tp.pruner.BasePruner(model, example, importance=importance, pruning_ratio=ratio,
                                    global_pruning=allocation == "global",
                                    ignored_layers=output_layers(model, example) + [mods[n] for n in kept],
                                    num_heads=attention_heads(model), prune_num_heads=heads == "whole",
                                    prune_head_dims=heads != "whole",
                                    head_pruning_ratio=ratio if heads == "whole" else 0.0)

    pruner = _traced(model, build)
    _check_covered(model, pruner.DG)
    return pruner


def _check_input(example: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    if example.is_floating_point():
        return torch.randn(4, *example.shape[1:], generator=g)
    return torch.zeros((4, *example.shape[1:]), dtype=example.dtype)


def kept_whole(model: Any, example: Any, heads: str = "dims") -> tuple[str, ...]:
    """The root layers of the channel groups that are *not* pruned because removing channels that
    carry zeros would change what the model computes: on a copy, half of the group's channels (chosen
    at random) are masked, the copy is cut, and the two must agree on a random input. That keeps
    whole a group whose channels a normalisation over channels reads (LayerNorm / GroupNorm over a
    transformer's residual stream: its statistics change when zeros leave), one whose cut breaks a
    reshape (heads the pruner was not told of), and one it would scramble; with ``heads="whole"`` an
    attention whose forward does not follow its head count. Computed once per model instance and
    ``heads`` (two models with the same layers can differ in their forward)."""
    import copy

    import torch

    key = (heads, *((n, tuple(p.shape)) for n, p in model.named_parameters()))
    cached = model.__dict__.get("_pp_kept_whole")  # (key, roots kept whole, the layers producing them)
    if cached is not None and cached[0] == key:
        return cached[1]
    names = {m: n for n, m in model.named_modules()}
    rec = _Recorded(_magnitude(), names)
    for _ in _pruner(model, example, 0.5, rec, kept=(), heads=heads).step(interactive=True):
        pass
    x, rng, kept = _check_input(example), np.random.default_rng(0), []
    for root, v in rec.out.items():
        masked = copy.deepcopy(model).eval()
        try:
            plan = mask_and_plan(masked, example, 0.5, {root: rng.random(len(v))}, kept=(), heads=heads)
            cut = copy.deepcopy(masked)
            apply_plan(cut, example, plan)
            cut.eval()
            with torch.no_grad():
                want, got = _logits(masked(x)), _logits(cut(x))
            same = want.shape == got.shape and torch.allclose(got, want, rtol=1e-4,
                                                              atol=1e-5 * (1.0 + float(want.abs().max())))
        except Exception:  # the cut model does not run: its forward assumes the width
            same = False
        if not same:
            kept.append(root)
    producers = sorted({n for root in kept for n in rec.producers[root]})
    model.__dict__["_pp_kept_whole"] = (key, tuple(kept), tuple(producers))
    return tuple(kept)


def _magnitude() -> Any:
    import torch_pruning as tp

    return tp.importance.GroupMagnitudeImportance(p=1, group_reduction="sum", normalizer=None, bias=True)


class _Recorded:
    """An importance that records, per group root, the vector ``inner`` gives."""

    def __init__(self, inner: Any, names: Mapping[Any, str]) -> None:
        self.inner, self.names, self.out, self.producers = inner, names, {}, {}

    def __call__(self, group: Any) -> Any:
        imp = self.inner(group)
        if imp is not None:
            root = _root_key(group, self.names)
            self.out[root] = imp.detach().double().numpy().copy()
            # the layers that produce the group's channels: ignoring them keeps the group whole
            self.producers[root] = [self.names[d.target.module] for d, _ in group
                                    if _out_side(d) and d.target.module in self.names]
        return imp


def _root_key(group: Any, names: Mapping[Any, str]) -> str:
    """A group's key: its root layer's name, with ``:in`` where the root loses *input* channels (the
    heads of an attention, rooted at its output projection), so it cannot meet an output group's."""
    dep = group[0].dep
    return names.get(dep.target.module, "") + ("" if _out_side(dep) else ":in")


def _out_side(dep: Any) -> bool:
    fn = getattr(dep.handler, "__self__", None)
    return dep.handler == getattr(fn, "prune_out_channels", None)


class _Fixed:
    """An importance that returns the given (fused) vector of each group root; with ``floor``, the
    top ``ceil(floor · n)`` channels of every group ranked above every other channel (a global ranking
    never empties a group)."""

    def __init__(self, scores: Mapping[str, np.ndarray], names: Mapping[Any, str], floor: float = 0.0) -> None:
        self.scores, self.names, self.floor = scores, names, floor

    def __call__(self, group: Any) -> Any:
        import torch

        v = self.scores.get(_root_key(group, self.names))
        if v is None:
            return None
        v = np.array(v, dtype=np.float64)
        if self.floor > 0 and v.size:  # global ranking: ties broken within the group, the floor on top
            order = np.argsort(-v, kind="stable")
            v[order] += (float(np.abs(v).mean()) + 1e-12) * 1e-6 * np.linspace(1.0, 0.0, v.size)
            v[order[:math.ceil(self.floor * v.size)]] += 1.0 + float(np.abs(v).max()) * 1e6
        return torch.as_tensor(v).float()


# --------------------------------------------------------------------------- scores
def saliency(model: Any, score: str, objective: Any = None, x: Any = None, y: Any = None,
             batches: Sequence[np.ndarray] = ()) -> dict[str, Any]:
    """The element-wise saliency ``S`` of every parameter (see the module docstring), in eval mode
    (no running statistic moves). ``objective(model, xb, yb, None)`` is the loss; ``batches`` row indices."""
    import torch

    named = dict(model.named_parameters())
    if score == "magnitude":
        return {n: p.detach() ** 2 for n, p in named.items()}
    if objective is None or not len(batches):
        raise PruneError(f"the {score!r} score needs the center's rows and batches")
    g1 = {n: torch.zeros_like(p) for n, p in named.items()}
    g2 = {n: torch.zeros_like(p) for n, p in named.items()}
    was = model.training
    model.eval()
    try:
        for idx in batches:
            t = torch.from_numpy(np.asarray(idx))
            model.zero_grad(set_to_none=True)
            objective(model, x[t], y[t], None).backward()
            for n, p in named.items():
                if p.grad is not None:
                    g1[n] += p.grad
                    g2[n] += p.grad ** 2
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    k = float(len(batches))
    if score == "taylor":
        return {n: (p.detach() * g1[n] / k).abs() for n, p in named.items()}
    return {n: 0.5 * p.detach() ** 2 * g2[n] / k for n, p in named.items()}


def group_scores(model: Any, example: Any, sal: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Per channel group (keyed by its root layer's name): the sum over the group of ``sal``, one value
    per channel of the root. The groups are those the pruner ranks (Torch-Pruning's, output layer kept)."""
    import torch

    names = {m: n for n, m in model.named_modules()}
    rec = _Recorded(_magnitude(), names)
    pruner = _pruner(model, example, 0.5, rec)
    params = dict(model.named_parameters())
    saved = {n: p.data for n, p in params.items()}
    try:
        with torch.no_grad():
            for n, p in params.items():
                p.data = sal[n].to(p.dtype)
        for _ in pruner.step(interactive=True):  # importance of every group; nothing is pruned
            pass
    finally:
        for n, p in params.items():
            p.data = saved[n]
    return rec.out


def normalised(scores: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each group's score vector divided by its mean (one where the mean is 0 or not finite: no ranking)."""
    out = {}
    for k, v in scores.items():
        v = np.asarray(v, dtype=np.float64)
        m = float(v.mean()) if v.size else 0.0
        out[k] = (v / m if m > 0 and math.isfinite(m) else np.ones_like(v)).astype(np.float32)
    return out


def center_scores(model: Any, objective: Any, x: Any, y: Any, batches: Sequence[np.ndarray], spec: PruneSpec,
                  compression: str) -> dict[str, np.ndarray]:
    """A center's encoded score vectors for the payload (keys ``p/q/<root>``, plus ``p/s/<root>`` for int8)."""
    ex = example_input(x[:1].numpy() if hasattr(x, "numpy") else x[:1])
    sal = saliency(model, spec.score, objective, x, y, batches)
    scores = normalised(group_scores(model, ex, sal))
    return {SCORE_PREFIX + k: v for k, v in encode_update(scores, compression).items()}


# --------------------------------------------------------------------------- masks and the cut
def _zero(dep: Any, idxs: Sequence[int]) -> None:
    """Zero, in the layer of ``dep``, what produces channels ``idxs`` (nothing for a layer that only
    reads them: its inputs are zero then)."""
    import torch
    from torch import nn
    from torch_pruning.pruner import function as F

    fn = getattr(dep.handler, "__self__", None)
    m = dep.target.module
    out_side = dep.handler == getattr(fn, "prune_out_channels", None)
    i = torch.as_tensor(list(idxs), dtype=torch.long)
    with torch.no_grad():
        if isinstance(fn, F.DepthwiseConvPruner) or (isinstance(fn, F.ConvPruner) and out_side):
            m.weight.data.index_fill_(1 if m.transposed and not isinstance(fn, F.DepthwiseConvPruner) else 0, i, 0.0)
            if m.bias is not None:
                m.bias.data.index_fill_(0, i, 0.0)
        elif isinstance(fn, F.LinearPruner) and out_side:
            m.weight.data.index_fill_(0, i, 0.0)
            if m.bias is not None:
                m.bias.data.index_fill_(0, i, 0.0)
        elif isinstance(fn, F.BatchnormPruner | F.LayernormPruner | F.GroupNormPruner | F.InstanceNormPruner):
            for p in (getattr(m, "weight", None), getattr(m, "bias", None)):
                if isinstance(p, nn.Parameter) and p.dim() >= 1:
                    p.data.index_fill_(0, i, 0.0)
        elif isinstance(fn, F.EmbeddingPruner):
            m.weight.data.index_fill_(1, i, 0.0)
        elif isinstance(fn, F.ParameterPruner) and isinstance(m, nn.Parameter):
            m.data.index_fill_(fn.pruning_dim % m.dim(), i, 0.0)


def mask_and_plan(model: Any, example: Any, ratio: float, scores: Mapping[str, np.ndarray],
                  kept: Sequence[str] | None = None, allocation: str = "uniform",
                  heads: str = "dims") -> list[list[Any]]:
    """Zero (in ``model``, in place) the channels ``scores`` rank lowest, ``ratio`` of every group
    (``allocation="uniform"``) or of all prunable channels in one ranking (``"global"``), and return
    the plan that removes them: ``[[root layer, output side?, indices], ...]`` (Torch-Pruning's pruning
    history, replayed by :func:`apply_plan`), then ``[attention module, "heads", count]`` for each
    attention whose head count the cut lowers (``heads="whole"``). A masked head computes zeros (its
    query and key rows give uniform weights, its value rows zeros), so the cut changes nothing."""
    names = {m: n for n, m in model.named_modules()}
    pruner = _pruner(model, example, ratio, _Fixed(scores, names, MIN_KEEP if allocation == "global" else 0.0),
                     kept, allocation, heads)
    plan: list[list[Any]] = []
    for group in pruner.step(interactive=True):
        for dep, idxs in group:
            _zero(dep, idxs)
        root, idxs = group[0].dep, group[0].idxs
        plan.append([names[root.target.module], bool(pruner.DG.is_out_channel_pruning_fn(root.trigger)),
                     sorted(int(j) for j in idxs)])
    for mname, m, attr, qkv in _attentions(model):
        left = pruner.num_heads.get(qkv[0], getattr(m, attr))
        if left != getattr(m, attr):
            plan.append([mname, "heads", int(left)])
    return plan


def channels_of(plan: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """The plan's channel entries ``[root layer, output side?, indices]`` (not its head counts)."""
    return [e for e in plan if isinstance(e[1], bool)]


def apply_plan(model: Any, example: Any, plan: Sequence[Sequence[Any]]) -> None:
    """Remove the channels of ``plan`` from ``model`` (in place) with Torch-Pruning's DepGraph: every
    dependent layer loses the same channels."""
    import torch_pruning as tp

    def build() -> Any:
        return tp.DependencyGraph().build_dependency(model, example_inputs=example, verbose=False)

    tied = _tied_parameters(model)
    dg = _traced(model, build)
    dg.load_pruning_history([[str(n), bool(o), [int(j) for j in idxs]] for n, o, idxs in channels_of(plan)])
    _retie(tied)
    attentions = {mname: (m, attr) for mname, m, attr, _ in _attentions(model)}
    for mname, _, count in (e for e in plan if e[1] == "heads"):
        if mname not in attentions:
            raise PruneError(f"the plan lowers the head count of {mname!r}, which is no attention module with a "
                             f"head count ({', '.join(HEAD_ATTRS)}) in this model")
        setattr(*attentions[mname], int(count))


def _tied_parameters(model: Any) -> list[list[tuple[Any, str]]]:
    """The places ``(module, attribute)`` that hold one parameter object, for every parameter held in
    more than one (tied weights: an embedding and the output layer reading it)."""
    places: dict[int, list[tuple[Any, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((mod, name))
    return [v for v in places.values() if len(v) > 1]


def _retie(tied: Sequence[Sequence[tuple[Any, str]]]) -> None:
    """Make each group of places hold one parameter again. Torch-Pruning prunes a tied parameter once
    per layer that holds it and gives each layer a new parameter object, which would then train
    apart (and count twice); the dependency graph removed the same channels from each."""
    import torch

    for places in tied:
        first = getattr(*places[0])
        for mod, name in places[1:]:
            other = getattr(mod, name)
            if other.shape != first.shape or not torch.equal(other, first):
                raise PruneError(f"the cut pruned the tied parameter {name!r} of {type(mod).__name__} unlike its "
                                 "other holder: prune without tying it or keep its layers whole")
            setattr(mod, name, first)


def param_count(model: Any) -> int:
    """The model's parameters, a tied one once."""
    return sum(p.numel() for p in model.parameters())


def params_after(model: Any, example: Any, channel_ratio: float, scores: Mapping[str, np.ndarray],
                 kept: Sequence[str] | None = None, allocation: str = "uniform", heads: str = "dims") -> int:
    """The parameters ``model`` keeps when ``mask_and_plan(..., channel_ratio, scores)``'s plan is cut
    (counted on a pruned copy; ``model`` is left as it is)."""
    import copy

    if channel_ratio <= 0:
        return param_count(model)
    cut = copy.deepcopy(model)
    names = {m: n for n, m in cut.named_modules()}
    pruner = _pruner(cut, example, channel_ratio,
                     _Fixed(scores, names, MIN_KEEP if allocation == "global" else 0.0), kept, allocation, heads)
    for group in pruner.step(interactive=True):
        group.prune()
    return param_count(cut)


def channel_ratio_for(model: Any, example: Any, target: float, scores: Mapping[str, np.ndarray],
                      kept: Sequence[str] | None = None, allocation: str = "uniform",
                      steps: int = 8, heads: str = "dims") -> tuple[float, int]:
    """``(channel ratio, parameters kept)``: the smallest channel ratio (bisection, ``steps`` halvings)
    whose cut removes at least ``target`` of ``model``'s parameters (whole channels: a little more).
    A target no channel ratio reaches (the groups kept whole and the output layer hold too many of
    the parameters) is a :class:`PruneError` naming the most that can go."""
    total = param_count(model)
    want = (1.0 - target) * total
    # an upper end that reaches the target, from below (near 1 a group can lose all its channels and
    # Torch-Pruning then leaves it whole, so more channels do not always mean fewer parameters)
    lo, best, fewest = 0.0, None, total
    for hi in (0.5, 0.6, 0.7, 0.8, 0.85):  # below 1 - MIN_KEEP: the floors never make the whole cut
        n = params_after(model, example, hi, scores, kept, allocation, heads)
        fewest = min(fewest, n)
        if n <= want:
            best = (hi, n)
            break
        lo = hi
    if best is None:
        raise PruneError(f"pruning {target:.0%} of the parameters is out of reach: at most {1 - fewest / total:.1%} "
                         f"can go (the output layer and the groups kept whole hold the rest); lower the ratio")
    hi = best[0]
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        n = params_after(model, example, mid, scores, kept, allocation, heads)
        if n <= want:
            hi, best = mid, (mid, n)
        else:
            lo = mid
    return best


def conform_trainer(trainer: Any, plan: Sequence[Sequence[Any]] | None) -> None:
    """Give a center's torch model the pruned architecture of ``plan`` (once: a later call is a no-op)."""
    if not plan or getattr(trainer, "_pruned_by", None) is not None:
        return
    if hasattr(trainer, "fw"):  # a MindSpore center: its full-size cell, the removed channels held at zero
        raise TypeError("a foreign center takes the cut with _pruning_foreign.conform (its masked twin)")

    apply_plan(trainer._model, example_input(trainer.x[:1]), plan)
    trainer._objective = TorchObjective(trainer._model, trainer.model_spec.loss)
    trainer._pruned_by = plan


def scoring_model(trainer: Any) -> tuple[Any, Any]:
    """``(torch model, objective)`` a center scores its channels with: a torch center's own; a foreign
    (MindSpore) center's torch twin, built once: the model its parameter map was checked against."""
    if not hasattr(trainer, "fw"):
        return trainer._model, trainer._objective
    twin = trainer.__dict__.get("_pp_twin")
    if twin is None:
        model = build_torch_model(trainer.model_spec, trainer.seed)
        twin = trainer.__dict__["_pp_twin"] = (model, TorchObjective(model, trainer.model_spec.loss))
    return twin


# --------------------------------------------------------------------------- the server's side
def with_input_of(config: Any, rows: np.ndarray | None, what: str = "the centers' rows") -> Any:
    """``config`` whose pruning spec names the shape and dtype of one input row, which the server
    traces the model on (zeros: it reads no row): the spec's own when it gives them (checked against
    ``rows``), else those of ``rows`` (a center's or the evaluation rows, where the caller has them;
    ``what`` names them in the error). A deployment's server (``serve``) has no row: its job file carries them."""
    spec: PruneSpec = config.prune
    if rows is not None:
        shape, dtype = tuple(int(d) for d in np.shape(rows)[1:]), np.asarray(rows).dtype.name
        if spec.input_shape and spec.input_shape != shape:
            raise PruneError(f"the pruning job traces the model on rows of shape {spec.input_shape} (input_shape), "
                             f"but {what} are {shape}: fix input_shape or the data")
        if not spec.input_shape:
            spec = replace(spec, input_shape=shape, input_dtype=dtype)
    if not spec.input_shape:
        raise PruneError("a pruning job's server traces the model on the shape of one input row, and none is known "
                         "here: give the job's PruneSpec(input_shape=..., input_dtype=...) (`collab --prune ... "
                         "--save-config` takes them from --eval-data or --data)")
    return replace(config, prune=spec)
