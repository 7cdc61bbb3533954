"""Task groups: several algorithms, each trained collaboratively on the datasets of some centers, and
the centers' models fused into one (``polyparallel tasks plan|run|infer``).

A task file (YAML) registers algorithms (a torch model as ``"package.module:function"``) and datasets
(an ``.npz`` or a ``"package.module:function"`` data source, each at one center, never moved), and
says which algorithm trains on which datasets (``groups``; default: every algorithm on every dataset).
Each group is one collaborative job (:class:`~._config.CollabConfig`) run by the existing engine; its
result is one *member*. The members are then fused (:mod:`._tasks_fusion`): parameter fusion where
their architectures agree, weighted ensembling, or ensemble distillation into one architecture.

Every center keeps a seeded ``holdout`` share of each of its datasets out of training
(:func:`~._center.split_holdout`, seeded by the dataset's place in the file, so a center in two groups
holds out the same rows in both); the fusion's choices are validated on those rows (only counts and
sums leave a center), never on the evaluation set.

The file is validated with pydantic; every mistake is one :class:`TaskFileError` line naming the key
and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polyparallel.cluster import Cluster
from polyparallel.cluster.spec import preset_raw
from polyparallel.cluster.units import ClusterSpecError
from polyparallel.cost_models.collab_simulator import SimInputs, center_links, inputs_from_strategy, simulate_rounds
from polyparallel.references import is_reference

from ._center import load_center_data, split_holdout
from ._config import CenterSpec, CollabConfig
from ._fusion import FUSIONS
from ._models import LOSSES, ModelSpec, build_torch_model

__all__ = ["FUSION_METHODS", "GroupPlan", "TaskFile", "TaskFileError", "TaskGroup", "TaskSet", "load_tasks",
           "plan_groups", "run_groups"]

#: how the members are fused into one model (``auto``: chosen on the centers' held-out rows)
FUSION_METHODS = ("auto", "average", "ensemble", "distill")


class TaskFileError(ValueError):
    """A mistake in a task file: one line naming the key and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AlgorithmSpec(_Strict):
    model: str = Field(description="the torch model: 'package.module:function' returning an nn.Module "
                                   "whose forward(x) gives class logits (B, C)")
    framework: str = Field("torch", description="the framework the centers train it in")
    loss: str = Field("auto", description=f"one of {', '.join(LOSSES)}")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not is_reference(v):
            raise ValueError(f"{v!r} is not 'package.module:function': name the function returning the nn.Module, "
                             "e.g. 'mymodels:resnet'")
        return v

    @field_validator("framework")
    @classmethod
    def _framework(cls, v: str) -> str:
        if v != "torch":
            raise ValueError(f"{v!r}: the fused model is exported with torch (pt2, ONNX), so task algorithms are "
                             "torch models; write framework: torch")
        return v

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        if v not in LOSSES:
            raise ValueError(f"{v!r}: use one of {', '.join(LOSSES)}")
        return v


class DatasetSpec(_Strict):
    path: str = Field(description="FILE.npz with x and y (relative to the task file), or 'package.module:function' "
                                  "called at the center with the center's name, returning (x, y)")
    center: str = Field(description="the center that holds the data (a center of the cluster when one is given)")

    @field_validator("center")
    @classmethod
    def _center(cls, v: str) -> str:
        if not v or not v.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{v!r}: a center name uses letters, digits, '-' and '_' only")
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not (v.endswith(".npz") or is_reference(v)):
            raise ValueError(f"{v!r}: give a FILE.npz (arrays x and y) or a data source 'package.module:function'")
        return v


class GroupSpec(_Strict):
    algorithm: str = Field(description="the algorithm this group trains")
    datasets: list[str] = Field(min_length=1, description="the datasets it trains on (their centers join the group)")
    rounds: int | None = Field(None, ge=1, description="rounds of this group (default: training.rounds)")
    local_steps: int | None = Field(None, ge=1, description="local steps per round (default: training.local_steps)")


class TrainingSpec(_Strict):
    rounds: int = Field(5, ge=1)
    local_steps: int = Field(20, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    fusion: str = Field("fedavg", description="the collaborative fusion inside each group")
    seed: int = 0

    @field_validator("fusion")
    @classmethod
    def _fusion(cls, v: str) -> str:
        if v.lower() not in FUSIONS:
            raise ValueError(f"{v!r}: use one of {', '.join(sorted(FUSIONS))}")
        return v


class DistillSpec(_Strict):
    steps: int = Field(600, ge=1, description="optimiser steps of the student")
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0, description="Adam's learning rate")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of teacher and student")
    synthetic: int = Field(2048, ge=16, description="synthetic inputs made without a public set")
    synthesis_steps: int = Field(100, ge=1, description="passes of the synthetic inputs' optimisation")
    check_every: int = Field(100, ge=1, description="steps between validations on the held-out rows "
                                                    "(the best student is kept)")


class TaskFile(_Strict):
    """A task file as written (see the module docstring)."""

    algorithms: dict[str, AlgorithmSpec] = Field(min_length=1)
    datasets: dict[str, DatasetSpec] = Field(min_length=1)
    groups: dict[str, GroupSpec] | None = None
    eval: str = Field(description="FILE.npz (x, y): the held-out evaluation set")
    public: str | None = Field(None, description="FILE.npz with x (labels ignored): the unlabeled transfer set")
    fusion: str = "auto"
    target: str | None = Field(None, description="the algorithm whose architecture a distilled model has "
                                                 "(default: the best member's on the held-out rows)")
    cluster: str | None = Field(None, description="a cluster preset or spec file: which centers, devices, links")
    holdout: float = Field(0.1, gt=0, lt=1, description="share of every dataset's rows its center keeps for "
                                                        "validating the fusion")
    auto_tolerance: float = Field(0.005, ge=0, lt=1, description="auto takes the smallest model within this "
                                                                 "accuracy of the best candidate")
    training: TrainingSpec = TrainingSpec()
    distill: DistillSpec = DistillSpec()

    @field_validator("fusion")
    @classmethod
    def _fusion(cls, v: str) -> str:
        if v not in FUSION_METHODS:
            raise ValueError(f"{v!r}: use one of {', '.join(FUSION_METHODS)}")
        return v

    @field_validator("eval", "public")
    @classmethod
    def _npz(cls, v: str | None) -> str | None:
        if v is not None and not v.endswith(".npz"):
            raise ValueError(f"{v!r}: give a FILE.npz")
        return v


def _explain(source: str, err: ValidationError) -> str:
    """The first bad key as one line: ``SOURCE: KEY: what is wrong and the fix``."""
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "missing":
        msg = "required key is missing: add it"
    elif e["type"] == "extra_forbidden":
        msg = f"unknown key: remove it or check its spelling (known: {_known(loc)})"
    elif e["type"] in ("dict_type", "model_type"):
        msg = f"expected a mapping (KEY: value), got {type(e.get('input')).__name__}"
    elif e["type"] == "too_short":
        msg = "is empty: give at least one entry"
    else:
        msg = f"{msg} (got {e.get('input')!r})" if "got" not in msg else msg
    return f"{source}: {loc or '(top level)'}: {msg}"


def _known(loc: str) -> str:
    parts = loc.split(".")
    model: type[BaseModel] = TaskFile
    nested = {"algorithms": AlgorithmSpec, "datasets": DatasetSpec, "groups": GroupSpec}
    if len(parts) >= 3 and parts[0] in nested:
        model = nested[parts[0]]
    elif len(parts) == 2 and parts[0] in ("training", "distill"):
        model = TrainingSpec if parts[0] == "training" else DistillSpec
    return ", ".join(model.model_fields)


@dataclass(frozen=True)
class TaskGroup:
    """One collaborative job: an algorithm and the datasets (and so the centers) it trains on."""

    name: str
    algorithm: str
    model: ModelSpec
    datasets: tuple[str, ...]
    centers: tuple[str, ...]
    rounds: int
    local_steps: int


@dataclass(frozen=True)
class TaskSet:
    """A validated task file with its paths resolved (relative to the file's folder)."""

    spec: TaskFile
    base: Path
    groups: tuple[TaskGroup, ...]
    source: str = "<tasks>"

    def path(self, p: str) -> str:
        """A file path of the task file resolved against its folder; a data source reference as written."""
        if is_reference(p) and not p.endswith(".npz"):
            return p
        q = Path(p)
        return str(q if q.is_absolute() else self.base / q)

    @property
    def centers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.center for d in self.spec.datasets.values()))

    def architectures(self) -> dict[str, tuple[str, ...]]:
        """Model reference -> the groups that train it."""
        out: dict[str, list[str]] = {}
        for g in self.groups:
            out.setdefault(g.model.kind, []).append(g.name)
        return {k: tuple(v) for k, v in out.items()}

    def config(self, group: TaskGroup) -> CollabConfig:
        """The group's collaborative job: one single-process torch center per center of the group."""
        t = self.spec.training
        return CollabConfig(centers=tuple(CenterSpec(c) for c in group.centers), model=group.model,
                            fusion=t.fusion, rounds=group.rounds, local_steps=group.local_steps,
                            batch_size=t.batch_size, lr=t.lr, momentum=t.momentum, seed=t.seed)


def load_tasks(path: str | Path) -> TaskSet:
    """Read and validate a task file; :class:`TaskFileError` (one line) on any mistake."""
    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"{p}: no such task file; write one (see docs/tasks.md)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0]
        raise TaskFileError(f"{p}: not valid YAML ({first}); fix the syntax") from None
    return tasks_from_dict(raw, p.parent, str(p))


def tasks_from_dict(raw: Any, base: str | Path = ".", source: str = "<tasks>") -> TaskSet:
    """Validate a task file given as plain data; paths resolve against ``base``."""
    if not isinstance(raw, dict):
        raise TaskFileError(f"{source}: a task file is a mapping with algorithms, datasets and eval; "
                            f"got {type(raw).__name__}")
    try:
        spec = TaskFile.model_validate(raw)
    except ValidationError as e:
        raise TaskFileError(_explain(source, e)) from None
    groups = _groups(spec, source)
    ts = TaskSet(spec, Path(base), groups, source)
    _check_cross(ts, source)
    return ts


def _groups(spec: TaskFile, source: str) -> tuple[TaskGroup, ...]:
    t = spec.training
    written = spec.groups if spec.groups is not None else {
        a: GroupSpec(algorithm=a, datasets=list(spec.datasets)) for a in spec.algorithms}
    if not written:
        raise TaskFileError(f"{source}: groups: is empty: give at least one group, or leave groups out "
                            "(every algorithm then trains on every dataset)")
    out = []
    for name, g in written.items():
        if g.algorithm not in spec.algorithms:
            raise TaskFileError(f"{source}: groups.{name}.algorithm: {g.algorithm!r} is not an algorithm of the file; "
                                f"use one of {', '.join(spec.algorithms)}")
        for d in g.datasets:
            if d not in spec.datasets:
                raise TaskFileError(f"{source}: groups.{name}.datasets: {d!r} is not a dataset of the file; "
                                    f"use some of {', '.join(spec.datasets)}")
        if len(set(g.datasets)) != len(g.datasets):
            raise TaskFileError(f"{source}: groups.{name}.datasets: a dataset is listed twice; list each once")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise TaskFileError(f"{source}: groups.{name}: a group name uses letters, digits, '-' and '_' only")
        a = spec.algorithms[g.algorithm]
        centers = tuple(dict.fromkeys(spec.datasets[d].center for d in g.datasets))
        out.append(TaskGroup(name, g.algorithm, ModelSpec(a.model, loss=a.loss), tuple(g.datasets), centers,
                             g.rounds or t.rounds, g.local_steps or t.local_steps))
    return tuple(out)


def _check_cross(ts: TaskSet, source: str) -> None:
    """What one key alone cannot say: sources shared at a center, fusion against the architectures."""
    spec = ts.spec
    seen: dict[tuple[str, str], str] = {}
    for name, d in spec.datasets.items():
        key = (d.center, d.path)
        if is_reference(d.path) and not d.path.endswith(".npz") and key in seen:
            raise TaskFileError(f"{source}: datasets.{name}.path: {d.path!r} at center {d.center!r} is also dataset "
                                f"{seen[key]!r}, and a data source is called with the center's name, so both would "
                                "be the same rows; give each dataset its own source or file")
        seen[key] = name
    archs = ts.architectures()
    if spec.fusion == "average" and len(archs) > 1:
        raise TaskFileError(f"{source}: fusion: average fuses parameters, which needs one architecture, and the "
                            f"groups train {len(archs)} ({', '.join(archs)}); use auto, ensemble or distill")
    if spec.target is not None and spec.target not in spec.algorithms:
        raise TaskFileError(f"{source}: target: {spec.target!r} is not an algorithm of the file; use one of "
                            f"{', '.join(spec.algorithms)}")
    if spec.target is not None and not any(g.algorithm == spec.target for g in ts.groups):
        raise TaskFileError(f"{source}: target: no group trains {spec.target!r}, so there is no member to start the "
                            "distilled model from; name an algorithm a group trains")
    if spec.cluster is not None:
        names = cluster_centers(ts)
        for name, d in spec.datasets.items():
            if d.center not in names:
                raise TaskFileError(f"{source}: datasets.{name}.center: {d.center!r} is not a center of cluster "
                                    f"{spec.cluster!r} ({', '.join(names)}); use one of them or another cluster")


def cluster_raw(ts: TaskSet) -> dict[str, Any]:
    """The task file's cluster as plain spec data (a preset's, or the file's)."""
    name = ts.spec.cluster
    assert name is not None
    p = Path(ts.path(name))
    try:
        if p.is_file():
            raw = yaml.safe_load(p.read_text())
            Cluster.from_dict(raw, str(p))  # validated as a cluster spec
            return dict(raw)
        cl = Cluster.resolve(name)
    except ClusterSpecError as e:
        raise TaskFileError(f"{ts.source}: cluster: {str(e).splitlines()[0]}") from None
    if name != "aisynergy-5":
        raise TaskFileError(f"{ts.source}: cluster: {name!r} has {len(cl.centers)} center(s) and no per-center "
                            "spec to select from; give aisynergy-5 or a spec FILE with one entry per center")
    return preset_raw("aisynergy-5")


def cluster_centers(ts: TaskSet) -> tuple[str, ...]:
    return tuple(c["name"] for c in cluster_raw(ts)["centers"])


def sub_cluster(raw: Mapping[str, Any], centers: tuple[str, ...]) -> Any:
    """The cluster of only ``centers`` (their nodes and links; the WAN latencies among them)."""
    keep = set(centers)
    sub = dict(raw)
    sub["name"] = f"{raw.get('name', 'cluster')}[{','.join(centers)}]"
    sub["centers"] = [c for c in raw["centers"] if c["name"] in keep]
    wan = dict(raw.get("wan") or {})
    if "latency" in wan:
        wan["latency"] = {k: v for k, v in wan["latency"].items() if set(k.split("-")) <= keep}
    sub["wan"] = wan
    return Cluster.from_dict(sub, sub["name"])


# ---------------------------------------------------------------------------------------------- data
Data = tuple[np.ndarray, np.ndarray]


def as_training(x: np.ndarray, y: np.ndarray, what: str) -> Data:
    """Inputs as float32 (a float64 file is cast), labels as int64 class indices."""
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"{what}: x has {len(x)} rows and y {len(y)}; give one label per row")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise ValueError(f"{what}: y must be one integer class label per row (shape (N,)), got {y.dtype} "
                         f"{y.shape}: task fusion is for classifiers")
    return (x.astype(np.float32) if x.dtype.kind == "f" else x), y.astype(np.int64)


def load_npz(path: str, what: str, labels: bool = True) -> Data:
    """``(x, y)`` of an .npz (``y`` may be absent when ``labels`` is False: an empty array then)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: no such file {p}; give an .npz with array x{' and y' if labels else ''}")
    with np.load(p) as z:
        if "x" not in z.files or (labels and "y" not in z.files):
            raise ValueError(f"{what}: {p} needs arrays named x{' and y' if labels else ''}, found {z.files}")
        x = z["x"]
        y = z["y"] if "y" in z.files else np.zeros(0, np.int64)
    if not labels:
        return (x.astype(np.float32) if x.dtype.kind == "f" else x), y
    return as_training(x, y, what)


@dataclass
class Datasets:
    """Every dataset's training rows and held-out rows, at its center."""

    train: dict[str, Data]
    held: dict[str, Data]

    def center_train(self, ts: TaskSet, group: TaskGroup) -> dict[str, Data]:
        """A group's training rows per center: the center's datasets of the group, concatenated there."""
        out: dict[str, Data] = {}
        for c in group.centers:
            parts = [self.train[d] for d in group.datasets if ts.spec.datasets[d].center == c]
            out[c] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        return out


def load_datasets(ts: TaskSet) -> Datasets:
    """Load every dataset where its center is (here: this process) and hold out its validation rows."""
    train, held = {}, {}
    for i, (name, d) in enumerate(ts.spec.datasets.items()):
        x, y = as_training(*load_center_data(ts.path(d.path), d.center), f"datasets.{name}")
        train[name], held[name] = split_holdout(x, y, ts.spec.holdout, ts.spec.training.seed, i)
    shapes = {n: tuple(v[0].shape[1:]) for n, v in train.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"datasets have different row shapes {shapes}: every dataset feeds the same fused model")
    return Datasets(train, held)


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class GroupPlan:
    """A group's per-center plans (from the planner) and its predicted time (from the simulator)."""

    group: TaskGroup
    rows: dict[str, int]
    centers: list[dict[str, Any]] = field(default_factory=list)
    predicted_s: float | None = None
    round_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        g = self.group
        return {"group": g.name, "algorithm": g.algorithm, "model": g.model.kind, "datasets": list(g.datasets),
                "centers": self.centers, "rows": self.rows, "rounds": g.rounds, "local_steps": g.local_steps,
                "predicted_s": self.predicted_s, "round_s": self.round_s, "notes": self.notes}


def plan_groups(ts: TaskSet, data: Datasets, say: Callable[[str], None] = lambda _: None) -> list[GroupPlan]:
    """Each group's centers with their training rows; with a cluster, each center's own plan from the
    planner (a collaborative search over the group's centers) and the group's time from the simulator."""
    plans = []
    raw = cluster_raw(ts) if ts.spec.cluster is not None else None
    for g in ts.groups:
        rows = {c: len(v[1]) for c, v in data.center_train(ts, g).items()}
        gp = GroupPlan(g, rows)
        if raw is None:
            gp.centers = [{"center": c, "rows": rows[c]} for c in g.centers]
            gp.notes.append("no cluster in the task file: every center trains on this machine; give cluster: PRESET|"
                            "FILE for each center's plan and the group's predicted time")
        else:
            say(f"planning group {g.name} over {', '.join(g.centers)}")
            _price(gp, ts, raw, next(iter(data.train.values()))[0][:1])
        plans.append(gp)
    return plans


def _price(gp: GroupPlan, ts: TaskSet, raw: Mapping[str, Any], x1: np.ndarray) -> None:
    """The planner's per-center plans and the simulator's time for ``gp``'s group."""
    import torch

    from polyparallel.planning import search  # islpy: loaded when a group is planned

    g = gp.group
    model = build_torch_model(g.model, ts.spec.training.seed)
    example = (torch.from_numpy(np.ascontiguousarray(x1)),)
    cl = sub_cluster(raw, g.centers)
    cons = {"pp": 1, "sp": 1, "microbatches": 1, "dtype": "fp32"}  # what a collaborative center runs
    if len(g.centers) > 1:
        s = search(model, example, cl, constraints={**cons, "mode": "collaborative"})
        inputs = inputs_from_strategy(s, local_steps=g.local_steps)
        for cp in s.collaborative.centers:
            ls = cp.local_strategy
            gp.centers.append({"center": cp.name, "framework": cp.framework, "devices": len(cp.devices),
                               "rows": gp.rows.get(cp.name, 0),
                               **{k: ls[k] for k in ("dp", "tp", "zero_stage", "recompute", "step_time_s") if k in ls}})
        gp.notes.append(f"the planner's own choice for this cluster: H = {s.collaborative.local_steps}, fusion "
                        f"{s.collaborative.fusion} (the task file's H = {g.local_steps} is simulated)")
    else:
        s = search(model, example, cl, constraints=cons)
        est = s.estimate
        step = float(est.step_time_s) if est is not None else math.nan
        c = g.centers[0]
        d, u, la = center_links(s).get(c, (math.inf, math.inf, 0.0))
        inputs = SimInputs.make([c], step, g.local_steps, int(s.model.params), down_Bps=d, up_Bps=u, latency_s=la)
        gp.centers.append({"center": c, "framework": cl.centers[0].framework, "devices": len(s.mesh.devices),
                           "rows": gp.rows.get(c, 0), "dp": s.dp, "tp": s.tp, "zero_stage": s.zero_stage,
                           "recompute": s.recompute, "step_time_s": step})
        gp.notes.append("one center: local training, no fusion between rounds")
    sim = simulate_rounds(inputs, g.rounds)
    gp.predicted_s, gp.round_s = float(sim.total_s), float(sim.round_s.mean())
    frameworks = {c["center"]: c.get("framework") for c in gp.centers}
    other = sorted(c for c, f in frameworks.items() if f not in (None, "torch"))
    if other:
        gp.notes.append(f"centers {', '.join(other)} run {frameworks[other[0]]} in the cluster; the algorithm is a "
                        "torch model, trained with torch")


# ----------------------------------------------------------------------------------------------- run
@dataclass
class Member:
    """One group's trained model."""

    name: str
    algorithm: str
    spec: ModelSpec
    params: dict[str, np.ndarray]
    samples: int
    result: Any = None
    seconds: float = 0.0


def run_groups(ts: TaskSet, data: Datasets, eval_data: Data, *, engine: str = "inprocess",
               on_round: Callable[[TaskGroup, Any], None] | None = None,
               on_group: Callable[[TaskGroup], None] | None = None, **options: Any) -> list[Member]:
    """Run every group with the collaborative engine (``engine``: ``inprocess`` or ``flower``); the
    members in the file's order. ``on_round(group, record)`` reports each round as it ends."""
    import time

    from . import collaborate

    members = []
    for g in ts.groups:
        if on_group is not None:
            on_group(g)
        cfg = ts.config(g)
        d = data.center_train(ts, g)
        t0 = time.perf_counter()
        opts = dict(options)
        if opts.get("workdir") is not None:  # a Flower run's folder: one per group
            opts["workdir"] = Path(opts["workdir"]) / g.name
        res = collaborate(cfg, d, engine=engine, eval_data=eval_data,
                          on_round=(lambda r, g=g: on_round(g, r)) if on_round else None, **opts)
        if not res.ok:
            raise RuntimeError(f"group {g.name}: {res.problem}")
        members.append(Member(g.name, g.algorithm, g.model, dict(res.params), sum(len(v[1]) for v in d.values()),
                              res, time.perf_counter() - t0))
    return members
