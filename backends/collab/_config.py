"""The federation's configuration as frozen values.

:class:`CollabConfig` is what a Strategy's collaborative section maps onto (centers with their
framework and devices, fusion strategy and its options, local steps per round ``H``, rounds,
compression); until the Strategy lands it is built from explicit arguments. It serialises to one
JSON string, which is how it travels to Flower's ServerApp and ClientApps in the run config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from polyparallel.cluster import FRAMEWORKS
from polyparallel.cost_models.collab_simulator import center_links
from polyparallel.strategy import MAX_STALENESS, Strategy

from ._center_plan import normalize_plan, plan_from_local_strategy
from ._fusion import FUSIONS, FusionStrategy, make_fusion
from ._models import ModelSpec, is_reference
from ._pruning import SCORE_FUSIONS, PruneSpec
from ._records import Pairs, Real, config_record, record_data, record_from_json
from ._wire import COMPRESSIONS

__all__ = ["FRAMEWORKS", "REJOIN_WAIT_S", "CenterSpec", "CollabConfig", "FlowerRun", "check_logit_adjust",
           "config_from_strategy"]



def check_logit_adjust(tau: float) -> None:
    """``τ`` of the logit-adjusted local loss must be a finite number >= 0 (0: plain cross-entropy)."""
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"logit_adjust must be a finite number >= 0, got {tau}")


@config_record
class CenterSpec:
    """One compute center: its name, the framework it trains with, and how many local devices.

    ``data``: where the center loads its ``(x, y)`` itself — ``"package.module:function"`` called with
    the center's name at the center (see ``_center.load_center_data``); only the reference travels in
    the job, never the data. Empty: the data is handed to the engine (``collaborate(config, data)``).

    ``plan``: the synchronous plan the center runs over its devices (``{"dp": 1, "tp": 2}``,
    ``{"dp": 2, "zero_stage": 3}``; keys ``_center_plan.PLAN_KEYS``), kept as sorted ``(key, value)``
    pairs; empty: data parallelism over every device. See ``_dp_center``.

    ``samples``: the center's training sample count declared at enrolment. The server weights the
    center with it and refuses a reply that claims another count; 0: the count the center reports
    first is pinned (capped relative to the other centers, see ``_validation``).

    ``down_Bps``, ``up_Bps``, ``latency_s``: the center's emulated WAN link (0: unlimited). The receiving
    end of each transfer holds it to ``latency + bytes / bandwidth`` (``_link``): the center its download
    of the model, the server the center's update; so a federation on one machine, where transfers
    otherwise run at memory speed, reproduces WAN-like rounds.

    ``slowdown``: an emulated slower site, as the link fields emulate its link: after each round the
    center sleeps ``slowdown − 1`` times that round's training time (``_buffered.SlowTrainer``; 1: none);
    left out of the job's JSON at 1.

    ``joins_after``: an emulated late join, in buffered rounds in-process: the center asks for its first
    model once version ``joins_after + 1`` is out, and starts from the newest one (0: from the start;
    left out of the job's JSON at 0).
    """

    name: str
    framework: str = "torch"
    devices: int = 1
    data: str = ""
    plan: Pairs[Any] = ()
    samples: int = 0
    down_Bps: Real = 0.0
    up_Bps: Real = 0.0
    latency_s: Real = 0.0
    slowdown: Real = Field(1.0, exclude_if=lambda v: v == 1)  # a center of its own speed: the JSON of before
    joins_after: int = Field(0, exclude_if=lambda v: not v)

    def __post_init__(self) -> None:
        if isinstance(self.joins_after, bool) or not isinstance(self.joins_after, int) or self.joins_after < 0:
            raise ValueError(f"center {self.name!r}: joins_after must be a number of versions >= 0 (0: from the "
                             f"start), got {self.joins_after!r}")
        if not (isinstance(self.slowdown, int | float) and math.isfinite(self.slowdown) and self.slowdown >= 1):
            raise ValueError(f"center {self.name!r}: slowdown must be a finite number >= 1 (1: none), "
                             f"got {self.slowdown!r}")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"center name {self.name!r}: use letters, digits, '-' and '_' only")
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"center {self.name!r}: framework {self.framework!r} is not one of {FRAMEWORKS}")
        if self.devices < 1:
            raise ValueError(f"center {self.name!r}: devices must be >= 1")
        if self.samples < 0:
            raise ValueError(f"center {self.name!r}: samples must be >= 0 (0: pinned at its first report)")
        for what in ("down_Bps", "up_Bps", "latency_s"):
            v = getattr(self, what)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"center {self.name!r}: {what} must be a finite number >= 0 (0: unlimited), got {v!r}")
        if self.data and not is_reference(self.data):
            raise ValueError(f"center {self.name!r}: data source {self.data!r} must be 'package.module:function'")
        plan = dict(self.plan)
        if plan:
            # plans no center runs are refused with the job; the per-op placements kept hashable
            checked = normalize_plan(plan, self.devices, self.name)
            if "op_placements" in plan:
                plan["op_placements"] = checked["op_placements"]
        object.__setattr__(self, "plan", tuple(sorted(plan.items())))


@config_record
class CollabConfig:
    """A collaborative training job.

    Args:
        centers: the participating centers (order fixes each center's index and data seed).
        model: the shared architecture.
        fusion: fusion strategy name (see :data:`FUSIONS`); ``fusion_options`` its keyword options.
            Default ``centered_clip``: FedAvg where the updates agree, a bounded pull from any that
            does not (see ``_fusion`` for why, and ``benchmarks/collab_attacks.py`` for the numbers).
        rounds: number of fusion rounds.
        local_steps: ``H``, optimiser steps each center takes per round.
        batch_size, lr, momentum: the centers' local SGD (a fresh optimiser every round, so a
            center keeps no state between rounds and can be restarted at any time).
        lr_schedule: ``constant`` or ``cosine`` (decay per round over ``rounds``, see ``_center.round_lr``).
        logit_adjust: ``τ`` of the logit-adjusted local loss (0: plain cross-entropy): every center trains
            on ``softmax(z + τ log π_i)`` with ``π_i`` its own label frequencies (computed where the data
            is; they never leave the center), which counters label skew (``_center.label_log_prior``).
        compression: update code on the uplink: ``none``, ``fp16`` or ``int8``.
        min_centers: rounds with fewer valid updates keep the previous global model (default: all).
        seed: initial model and data-order seed.
        round_timeout_s: how long the server waits for updates in a deployed round.
        holdout: fraction of every center's rows it keeps out of training; without server-side
            evaluation data, the centers evaluate each fused model on them and the server records the
            count-weighted mean (0: no held-out rows).
        max_abs_update: largest ``|δ|`` of any coordinate of an update (int8: checked on the scales
            before decoding); larger is refused.
        norm_bound: ``k``: an update whose norm exceeds ``k`` × the robust reference of the round's
            and recent rounds' norms is refused (0: no norm bound). See ``_validation``.
        step_bound: a fused model whose step exceeds this × the median recent step is not taken
            (0: only finiteness is checked).
        min_cosine: with at least 3 updates left after the norm check, an update whose cosine (over
            the trained tensors) to the coordinate-wise median of the *other* updates is below this is
            refused (-1: off). See ``_validation``.
        layer_bound: an update one of whose trained tensors has a norm above this × that tensor's upper
            median norm over the round's updates is refused (0: off; a boosted backdoor). See ``_validation``.
        overlap: ``k`` local steps of the next round a center takes while its update travels and the
            server fuses; it merges the fused model after them (0: synchronous rounds). See ``_overlap``.
        buffer: ``K``: asynchronous buffered rounds, the server fuses the first ``K`` updates that are in,
            stale ones weighted by staleness, refused beyond ``max_staleness`` versions (0: synchronous
            rounds; ``rounds`` counts fusions). See ``_buffered``.
        prune: online pruning (:class:`~._pruning.PruneSpec`: ratio, rounds ``K``, score): centers score
            channels on their own rows, the server fuses the scores, soft-masks, and cuts the model
            structurally after round ``K``; None: the job trains the full model (see ``_pruning``).
    """

    centers: tuple[CenterSpec, ...]
    model: ModelSpec
    fusion: str = "centered_clip"
    fusion_options: Pairs[Real] = ()
    rounds: int = 3
    local_steps: int = 10
    batch_size: int = 32
    lr: Real = 0.05
    momentum: Real = 0.0
    lr_schedule: str = "constant"
    logit_adjust: Real = 0.0
    compression: str = "none"
    min_centers: int = 0
    seed: int = 0
    round_timeout_s: Real = 600.0
    holdout: Real = 0.0
    max_abs_update: Real = 1e4
    norm_bound: Real = 4.0
    step_bound: Real = 10.0
    min_cosine: Real = -1.0
    # left out of the job's JSON when off, so a job without them writes the JSON it wrote before they existed
    layer_bound: Real = Field(0.0, exclude_if=lambda v: not v)
    prune: PruneSpec | None = Field(None, exclude_if=lambda v: v is None)
    overlap: int = Field(0, exclude_if=lambda v: not v)
    buffer: int = Field(0, exclude_if=lambda v: not v)
    max_staleness: int = MAX_STALENESS  # and left out with buffer=0 (``to_json``)

    def __post_init__(self) -> None:
        if not self.centers:
            raise ValueError("a federation needs at least one center")
        names = [c.name for c in self.centers]
        if len(set(names)) != len(names):
            raise ValueError(f"center names must be unique, got {names}")
        if self.fusion.lower() not in FUSIONS:
            raise ValueError(f"unknown fusion strategy {self.fusion!r}; choose one of {sorted(FUSIONS)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {self.compression!r}; choose one of {COMPRESSIONS}")
        if self.rounds < 1 or self.local_steps < 1 or self.batch_size < 1:
            raise ValueError("rounds, local_steps and batch_size must be >= 1")
        if not 0 <= self.min_centers <= len(self.centers):
            raise ValueError(f"min_centers must be in [0, {len(self.centers)}] (0 means all)")
        check_logit_adjust(self.logit_adjust)
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; choose 'constant' or 'cosine'")
        if not (0.0 <= self.holdout < 1.0):
            raise ValueError(f"holdout must be a fraction in [0, 1), got {self.holdout}")
        if not (0 < self.max_abs_update < math.inf):
            raise ValueError(f"max_abs_update must be a finite number > 0, got {self.max_abs_update}")
        for knob in ("norm_bound", "step_bound", "layer_bound"):
            v = getattr(self, knob)
            if not (v == 0 or (1 < v < math.inf)):
                raise ValueError(f"{knob} must be 0 (off) or a finite number > 1, got {v}")
        if not -1.0 <= self.min_cosine < 1.0:
            raise ValueError(f"min_cosine must be in [-1, 1) (-1: off), got {self.min_cosine}")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")
        if self.model.user:
            for fw in sorted({c.framework for c in self.centers} - {"torch"}):
                other = [c.name for c in self.centers if c.framework == fw]
                if not self.model.builder_for(fw):
                    how = ("a MindSpore Cell builder, ModelSpec(mindspore='package.module:function') (--mindspore-model"
                           " or --builder mindspore=MODULE:FUNCTION)" if fw == "mindspore" else
                           f"a {fw} model builder, ModelSpec(builders={{'{fw}': 'package.module:function'}}) "
                           f"(--builder {fw}=MODULE:FUNCTION)")
                    raise ValueError(f"centers {other} train in {fw}, but model {self.model.kind!r} is a torch "
                                     f"model: give the same architecture as {how}, or use framework='torch' for them")
            if self.logit_adjust:
                raise ValueError("logit_adjust needs the class count of a built-in classifier; for a user model "
                                 "set logit_adjust=0")
        if self.make_fusion().uses_controls:  # options checked now, not in round 1
            other = [c.name for c in self.centers if c.framework != "torch" or c.devices > 1]
            if other:
                raise ValueError(f"fusion {self.fusion!r} corrects every local gradient with control variates, "
                                 f"which is implemented for single-process torch centers; centers {other} run "
                                 "another framework or several devices: use framework='torch', devices=1 or another "
                                 "fusion")
        if self.prune is not None:
            self._check_prune(self.prune)
        self._check_overlap()

    def _check_overlap(self) -> None:
        """Overlapped fusion (``_overlap``) runs single-process torch centers, without pruning."""
        k = self.overlap
        if not (isinstance(k, int) and 0 <= k <= self.local_steps):
            raise ValueError(f"overlap must be a whole number of local steps in [0, local_steps={self.local_steps}]"
                             f" (0: synchronous rounds), got {k!r}")
        other = [c.name for c in self.centers if c.framework != "torch" or c.devices > 1]
        why = (f"centers {other} run another framework or several devices" if other else
               "online pruning cuts the model under the centers' running steps" if self.prune is not None else "")
        if k and why:
            raise ValueError(f"overlapped fusion (overlap={k}) is implemented for single-process torch centers "
                             f"without pruning: {why}; use overlap=0")
        b = self.buffer
        if not (isinstance(b, int) and 0 <= b <= len(self.centers)) or not (
                isinstance(self.max_staleness, int) and self.max_staleness >= 0):
            raise ValueError(f"buffer must be a whole number of updates in [0, {len(self.centers)} centers] (0: "
                             f"synchronous rounds) and max_staleness >= 0, got {b!r}, {self.max_staleness!r}")
        why = ("it is not combined with overlapped fusion (overlap=0)" if k else
               "SCAFFOLD's control variates assume every update of a round starts from its global model"
               if self.fusion.lower() == "scaffold" else
               "online pruning cuts the model under the centers' running steps" if self.prune is not None else
               f"min_centers={self.min_centers} > buffer={b}" if self.min_centers > b else "")
        if b and why:
            raise ValueError(f"buffered asynchronous rounds (buffer={b}): {why}; use buffer=0 for synchronous "
                             "rounds")
        late = [c.name for c in self.centers if c.joins_after]
        if late and not 1 <= b <= len(self.centers) - len(late):
            raise ValueError(f"centers {late} join after the start (joins_after): that takes buffered rounds whose "
                             f"fusions the others fill meanwhile, buffer in [1, {len(self.centers) - len(late)}], "
                             f"got buffer={b}")

    def _check_prune(self, p: PruneSpec) -> None:
        """A pruning job needs a fusion that can fuse score vectors and centers that can score."""
        if p.rounds > self.rounds:
            raise ValueError(f"pruning rounds K={p.rounds} > rounds={self.rounds}: the cut comes after round K "
                             "(give K < rounds to fine-tune the smaller model in the rounds after it)")
        fusion = self.fusion.lower()
        if fusion == "scaffold":
            raise ValueError("pruning with SCAFFOLD is refused: its control variates are shaped like the model, "
                             "which the structural cut changes, and they mean nothing for channel scores; use "
                             f"one of {', '.join(SCORE_FUSIONS)}")
        if fusion not in SCORE_FUSIONS:
            raise ValueError(f"fusion {self.fusion!r} cannot carry pruning scores (it keeps server state or "
                             f"needs a root set, meaningless for channel scores); use one of "
                             f"{', '.join(SCORE_FUSIONS)}")
        other = [c.name for c in self.centers if c.framework not in ("torch", "mindspore") or c.devices > 1]
        if other:
            raise ValueError(f"pruning is implemented for single-process torch and MindSpore centers; centers "
                             f"{other} run another framework or several devices")
        foreign = [c.name for c in self.centers if c.framework != "torch"]
        if p.distill > 0 and foreign:
            raise ValueError(f"distillation while fine-tuning (distill={p.distill}) is implemented for torch centers "
                             f"only; centers {foreign} are MindSpore (their masked full-size cell has no teacher): "
                             "set distill=0")

    @property
    def required_centers(self) -> int:
        return self.min_centers or self.buffer or len(self.centers)

    def center(self, name: str) -> CenterSpec:
        for c in self.centers:
            if c.name == name:
                return c
        raise KeyError(f"no center named {name!r} in this federation ({[c.name for c in self.centers]})")

    def center_index(self, name: str) -> int:
        return [c.name for c in self.centers].index(self.center(name).name)

    def make_fusion(self) -> FusionStrategy:
        return make_fusion(self.fusion, **dict(self.fusion_options))

    def to_json(self) -> str:
        """The job as one JSON string (keys sorted), which travels to Flower's apps in the run config."""
        d = record_data(self)
        if not self.buffer:  # synchronous rounds: no staleness bound either
            del d["max_staleness"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> CollabConfig:
        """The job :meth:`to_json` wrote; ``ValueError`` (one line) for a text that is not one."""
        return record_from_json(cls, text)


#: default ``rejoin_wait_s``: a restarted center was back 3–11 s after its crash in the fault tests
#: (docs/collab.md, loads 5–16 on 2 cores); the grace is spent once per lost center, not every round
REJOIN_WAIT_S = 30.0


@config_record
class FlowerRun:
    """What a federation's ServerApp is told in Flower's run config (the App's ``[tool.flwr.app.config]``,
    written by ``_flower.LoopbackFederation.submit``; Flower's run config holds scalars, its keys are
    these fields' names with ``-`` for ``_``): the job, where the ServerApp writes, its data files and
    its waits. ``node_names``: JSON of node id -> the center name its registered key belongs to."""

    collab_config: str
    out_dir: str
    eval_data: str = ""
    root_data: str = ""
    poll_s: Real = 0.05
    max_rounds: int = 0  # rounds this ServerApp runs before exiting (0: all)
    pull_backoff_s: Real = 0.0
    pack_arrays: bool = True
    data_channel: str = "flower"
    node_names: str = "{}"
    center_wait_s: Real = 600.0
    rejoin_wait_s: Real = REJOIN_WAIT_S
    superlink_pid: int = 0

    @classmethod
    def of(cls, run_config: Mapping[str, Any]) -> FlowerRun:
        return cls(**{k.replace("-", "_"): v for k, v in run_config.items()})

    def run_config(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in record_data(self).items()}

    def names(self) -> dict[int, str]:
        return {int(k): str(v) for k, v in json.loads(self.node_names or "{}").items()}


def config_from_strategy(strategy: Any, model: ModelSpec, *, emulate_links: bool = False,
                         **training: Any) -> CollabConfig:
    """The job described by a collaborative :class:`polyparallel.strategy.Strategy` (object or JSON path).

    Read from the Strategy: the centers (name, framework, number of devices, and the synchronous plan
    the planner chose for each: its ``local_strategy`` degrees become ``CenterSpec.plan``), fusion,
    local steps per round, rounds, compression, overlapped fusion (``overlap``), buffered rounds (``buffer``,
    ``max_staleness``). The Strategy
    fingerprints the model but does not carry it, so the shared architecture comes as ``model``;
    ``training`` sets the remaining :class:`CollabConfig` fields (``batch_size``, ``lr``,
    ``min_centers``, ``fusion_options``, ...).

    ``emulate_links``: every center holds its transfers to its WAN link in the Strategy's cluster
    (``CenterSpec.down_Bps`` ...; the figures the round simulator prices), for a federation on one
    machine. Off for a real deployment, whose links are the real ones.
    """
    if not isinstance(strategy, Strategy):
        strategy = Strategy.from_json(strategy)
    if strategy.mode != "collaborative" or strategy.collaborative is None:
        raise ValueError(f"strategy for {strategy.model.name!r} is in {strategy.mode!r} mode; "
                         "collaborative training needs mode 'collaborative' with a 'collaborative' section")
    c = strategy.collaborative
    links: dict[str, tuple[float, float, float]] = {}
    if emulate_links:
        links = center_links(strategy)
    try:
        centers = tuple(CenterSpec(cp.name, framework=cp.framework, devices=max(1, len(cp.devices)),
                                   plan=plan_from_local_strategy(cp.local_strategy or {}),
                                   **dict(zip(("down_Bps", "up_Bps", "latency_s"), links.get(cp.name, ()))))
                        for cp in c.centers)
    except ValueError as e:
        raise ValueError(f"{e}. The plan is the Strategy's local_strategy for that center: search the collaborative "
                         "strategy again with constraints={'pp': 1, 'sp': 1, 'microbatches': 1, 'dtype': 'fp32'}, "
                         "which every center's plan then respects") from e
    return CollabConfig(
        centers=centers,
        model=model, fusion=c.fusion, rounds=c.rounds, local_steps=c.local_steps, compression=c.compression,
        **{"overlap": c.overlap, **({"buffer": c.buffer, "max_staleness": c.max_staleness} if c.buffer else {}),
           **training})
