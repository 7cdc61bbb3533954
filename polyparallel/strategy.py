"""Strategy: the plan the search returns and the backends execute, as versioned JSON.

A strategy is self-describing and validated on load. Two parts are a contract read by
outside tools and must keep their keys: ``estimate`` (``step_time_s``, ``samples_per_s``,
``model_flops_per_s_per_device``, ``memory_bytes_max``, ``comm_fraction``, ``breakdown``)
and ``search`` (``capture_s``, ``search_s``, ``candidates``, ``solver``); the plan
(:class:`polyparallel.plan.Plan`: ``dp``, ``tp``, ``pp``, ``sp``, ``ep``, ``microbatches``,
``schedule``, ``zero_stage``, ``recompute``, ``sequence_parallel``, ``dtype``) sits at the top
level, and ``strategy.plan`` reads it back as one record.

The JSON Schema of the format ships as ``polyparallel/strategy.schema.json``
(:func:`json_schema` regenerates it; a test keeps the two equal).

Examples:
    >>> from polyparallel.strategy import Mesh, MeshAxis, ModelInfo, Strategy
    >>> s = Strategy(model=ModelInfo(name="mlp", fingerprint="0" * 24),
    ...              mesh=Mesh(axes=[MeshAxis(name="dp", size=2, level="intra_node")], devices=[0, 1]),
    ...              dp=2)
    >>> Strategy.from_json(s.to_json()).dp
    2
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polyparallel.ir import TRAINING_DTYPE_BYTES
from polyparallel.plan import Plan

__all__ = [
    "SCHEMA_VERSION",
    "CenterPlan",
    "Collaborative",
    "Estimate",
    "Mesh",
    "MeshAxis",
    "ModelInfo",
    "OpPlacement",
    "SearchRecord",
    "Stage",
    "Strategy",
    "StrategyError",
    "center_placements",
    "fingerprint",
    "json_schema",
    "op_placements_of",
]

SCHEMA_VERSION: Literal[1] = 1
SCHEMA_FILE = Path(__file__).with_name("strategy.schema.json")


class StrategyError(ValueError):
    """A strategy file or object is invalid; the message says where and what to do."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Model):
    """The model the strategy was made for."""

    name: str
    fingerprint: str = Field(description="hash of the captured graph's op signatures and tensor shapes")
    params: int = 0
    flops_per_step: float = Field(0.0, description="useful model FLOPs of one optimizer step (fwd + bwd)")
    source: str = ""


class MeshAxis(_Model):
    name: str = Field(description="dp, fsdp, tp, sp, cp, pp, or a center axis")
    size: int = Field(ge=1)
    level: Literal["intra_node", "inter_node", "inter_center"] = Field(
        "intra_node", description="the highest topology level a group of this axis spans")


class Mesh(_Model):
    axes: list[MeshAxis]
    devices: list[int] = Field(description="cluster device ids in row-major mesh order")

    @model_validator(mode="after")
    def _size(self) -> Mesh:
        n = 1
        for a in self.axes:
            n *= a.size
        if n != len(self.devices):
            raise ValueError(f"mesh axes multiply to {n} but {len(self.devices)} device ids are listed")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("a device id appears twice in the mesh")
        return self

    def shape(self) -> dict[str, int]:
        return {a.name: a.size for a in self.axes}


class Stage(_Model):
    index: int = Field(ge=0)
    ops: list[str] = Field(description="first and last op name of each contiguous op range (chunk) of the stage")
    layers: list[int] = Field(default_factory=list, description="indices of repeated blocks in the stage")
    devices: list[int]
    device_type: str = ""
    compute_s: float = 0.0
    placed_by: Literal["", "solver", "rule", "replicated"] = Field(
        "", description="what chose the stage's per-op placements: the exact per-stage solver, Megatron's rule, or "
                        "neither (every op replicated over tp: neither placement is executed by the torch backend)")
    placement_note: str = Field("", description="why the solver's placements were not kept, where they were not")
    objective_s: float = Field(0.0, description="per micro-batch: forward + backward compute and tensor-parallel "
                                                "communication of the solver's placements, under the placement cost "
                                                "(kept where placed_by is 'solver')")
    rule_objective_s: float = Field(0.0, description="the same for Megatron's rule's placements (0: not priced, "
                                                     "the rule holds a layout pair the solver's edge model forbids)")


class OpPlacement(_Model):
    """Placement of a group of ops (a block's ops share one entry)."""

    ops: list[str]
    placement: str = Field(description="loop dim -> mesh axes, e.g. 'b:dp,n:tp' ('' = replicated)")
    comm: str = ""
    modules: list[str] = Field(default_factory=list, description="module path of each op (same order as ops; "
                                                                 "'' where unknown), for executors")


class CenterPlan(_Model):
    name: str
    framework: Literal["torch", "mindspore", "paddle", "tensorflow"] = "torch"
    devices: list[int]
    share: float = Field(gt=0, le=1, description="fraction of the global batch / data the center trains on")
    local_strategy: dict[str, Any] = Field(default_factory=dict, description=(
        "the center's synchronous plan: the plan record's center fields, the placement mode it was searched with "
        "and, with tp > 1, its per-op placements (op_placements: [ops, placement, modules] per group), which the "
        "center runs as priced; step_time_s, samples_per_s"))


def center_placements(s: Strategy) -> dict[str, Any]:
    """What a center's ``local_strategy`` records of its synchronous Strategy's placements: with
    ``tp > 1``, every group's per-op placement (``op_placements``), so the center runs the placements
    the search priced on the center's hardware rather than ones it would derive on its own
    (:func:`op_placements_of` reads them back); nothing without tensor parallelism."""
    if s.tp == 1:
        return {}
    return {"op_placements": [[list(p.ops), p.placement, list(p.modules)] for p in s.placements]}


def op_placements_of(record: Any) -> list[OpPlacement]:
    """The :class:`OpPlacement` groups of a center plan's ``op_placements`` (:func:`center_placements`)."""
    return [OpPlacement(ops=list(ops), placement=str(pl), modules=list(mods)) for ops, pl, mods in record]


#: the staleness (versions) beyond which a buffered round refuses an update unless a job sets another: the
#: default of ``collaborative.max_staleness``, of ``CollabConfig.max_staleness`` and of the search's pricing
MAX_STALENESS = 4


class Collaborative(_Model):
    centers: list[CenterPlan]
    fusion: str = "fedavg"
    local_steps: int = Field(ge=1, description="H: local optimizer steps between two fusions")
    rounds: int = Field(1, ge=1)
    compression: Literal["none", "fp16", "int8"] = "none"
    round_time_s: float = 0.0
    comm_fraction: float = 0.0
    overlap: int = Field(0, ge=0, description="K: local steps of the next round a center takes while its update "
                         "travels and the server fuses (overlapped fusion; 0: synchronous rounds)")
    buffer: int = Field(0, ge=0, description="K: asynchronous buffered rounds, the server fuses the first K updates "
                        "that are in (0: synchronous rounds); round_time_s is then the time between fusions")
    max_staleness: int = Field(MAX_STALENESS, ge=0, description="with buffer: updates more versions old than this "
                               "are refused")


class Estimate(_Model):
    # a price is a finite, non-negative number: a hand-edited NaN or negative figure is refused on load
    step_time_s: float = Field(ge=0, allow_inf_nan=False)
    samples_per_s: float = Field(ge=0, allow_inf_nan=False)
    model_flops_per_s_per_device: float = Field(ge=0, allow_inf_nan=False)
    memory_bytes_max: float = Field(ge=0, allow_inf_nan=False)
    comm_fraction: float = Field(ge=0, le=1, allow_inf_nan=False)
    breakdown: dict[str, float] = Field(default_factory=dict)
    memory_by_device: dict[str, float] = Field(default_factory=dict)


class SearchRecord(_Model):
    capture_s: float = 0.0
    search_s: float = 0.0
    candidates: int = 0
    solver: str = ""
    notes: list[str] = Field(default_factory=list)


class Strategy(_Model):
    """A parallel training plan. See the module docstring for the stable keys."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model: ModelInfo
    cluster: dict[str, Any] = Field(default_factory=dict, description="echo of the cluster (name, devices, ...)")
    mode: Literal["synchronous", "collaborative"] = "synchronous"
    global_batch: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    sp: int = Field(1, ge=1, description="sequence parallelism (Ulysses): all-to-all around each attention")
    cp: int = Field(1, ge=1, description="context parallelism (ring attention with causal load balancing): K/V "
                    "blocks passed around the sequence shards; at most one of sp and cp is above 1")
    ep: int = Field(1, ge=1, description="expert-parallel degree: each group of ep data/sequence-parallel ranks "
                    "splits every MoE layer's experts (1: experts replicated like the other weights)")
    microbatches: int = Field(1, ge=1)
    schedule: str = "1f1b"
    zero_stage: int = Field(0, ge=0, le=3)
    recompute: Literal["none", "selective", "op", "full"] = "none"
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism inside tensor parallelism: "
                                    "norms, dropouts and residuals split along the sequence over the tp ranks")
    dtype: str = "fp32"
    compile: Literal["none", "regional"] = Field(
        "none", description="regional: each repeated block compiled with torch.compile on its own (elementwise ops "
                            "fused into their producers' kernels); none: eager PyTorch")
    mesh: Mesh
    stages: list[Stage] = Field(default_factory=list)
    placements: list[OpPlacement] = Field(default_factory=list)
    collaborative: Collaborative | None = None
    estimate: Estimate | None = None
    search: SearchRecord = Field(default_factory=SearchRecord)

    @model_validator(mode="after")
    def _consistent(self) -> Strategy:
        if self.dtype not in TRAINING_DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not a training precision: use one of "
                             f"{', '.join(TRAINING_DTYPE_BYTES)}")
        if self.mode == "collaborative" and self.collaborative is None:
            raise ValueError("mode is 'collaborative' but the 'collaborative' section is missing")
        if self.mode == "synchronous":
            if not self.stages:
                raise ValueError("a synchronous strategy lists its pipeline stages ('stages' is missing or empty)")
            world = self.plan.world
            if world != len(self.mesh.devices):
                raise ValueError(f"dp*tp*pp*sp*cp = {world} but the mesh has {len(self.mesh.devices)} devices")
            why = self.plan.problems()
            if why:
                raise ValueError(why[0])
        return self

    @property
    def plan(self) -> Plan:
        """The plan this strategy records (``schedule="interleaved:K"`` read as ``chunks=K``)."""
        return Plan.from_record(self)

    # -- I/O ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        c = d.get("collaborative")
        if c:  # synchronous rounds are written as before the overlapped and buffered ones' fields existed
            unused = ["overlap"] if not c["overlap"] else []
            for name in unused + (["buffer", "max_staleness"] if not c["buffer"] else []):
                del c[name]
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 1) -> str:
        """Serialise; with ``path``, also write the file."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:  # written whole, then renamed: an interrupted write leaves the old file
            tmp = Path(path).with_name(f".{Path(path).name}.tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Strategy:
        """Load from a JSON file path or a JSON string; errors name the file and the field."""
        where = "<string>"
        text = str(source)
        if isinstance(source, os.PathLike) or (isinstance(source, str) and not source.lstrip().startswith("{")):
            where = str(source)
            try:
                text = Path(source).read_text()
            except OSError as e:
                raise StrategyError(f"cannot read strategy file {where}: {e.strerror}") from e
            except UnicodeDecodeError as e:
                hint = (f"; to plan this model run `polyparallel search {where} -o strategy.json` first"
                        if where.endswith(".onnx") else "")
                raise StrategyError(f"{where} is a binary file, not a strategy JSON{hint}") from e
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrategyError(f"{where}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        return cls.from_dict(raw, where)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "<dict>") -> Strategy:
        if not isinstance(raw, dict):
            raise StrategyError(f"{where}: a strategy is a JSON object, got {type(raw).__name__}")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StrategyError(
                f"{where}: schema_version {version!r} is not supported (this polyparallel reads version "
                f"{SCHEMA_VERSION}); re-run `polyparallel search` with this version to regenerate the strategy")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
                lines.append(f"  {loc}: {err['msg']}")
            raise StrategyError(f"{where}: invalid strategy\n" + "\n".join(lines)) from None

    # -- deeper checks --------------------------------------------------------------------
    def validate_against(self, cluster: Any = None, graph: Any = None) -> None:
        """Check device ids against a cluster and placements against a graph's ops.

        Raises :class:`StrategyError` naming the first problem found.
        """
        if cluster is not None:
            n = cluster.num_devices
            used = set(self.mesh.devices) | {d for s in self.stages for d in s.devices}
            if self.collaborative:
                used |= {d for c in self.collaborative.centers for d in c.devices}
            bad = sorted(d for d in used if not 0 <= d < n)
            if bad:
                raise StrategyError(f"device ids {bad} are not in cluster {getattr(cluster, 'name', '')!r} "
                                    f"(it has devices 0..{n - 1})")
        if graph is not None:
            from polyparallel.poly import DeviceMesh, Placement, legal_placements

            mesh = DeviceMesh.of(None, (), **self.mesh.shape()) if self.mesh.axes else None
            names = {op.name: op for op in graph.ops}
            for entry in self.placements:
                try:
                    pl = Placement.parse(entry.placement)
                except ValueError as e:
                    raise StrategyError(
                        f"placement {entry.placement!r} of ops {entry.ops[:3]} is not legal: {e}") from e
                for name in entry.ops:
                    op = names.get(name)
                    if op is None:
                        raise StrategyError(f"placement names op {name!r}, which is not in model "
                                            f"{self.model.name!r}")
                    if mesh is not None and pl not in legal_placements(graph, op, mesh):
                        raise StrategyError(f"placement {entry.placement!r} is not legal for op {name!r} "
                                            f"({op.kind}) on mesh {self.mesh.shape()}")


def fingerprint(graph: Any) -> str:
    """A stable hash of a graph: its ops' signatures in order and its parameter shapes.

    The device an op creates tensors on (``arange(device=...)``) is left out: the same model
    captured on the meta device, the CPU or a GPU is the same model.
    """
    h = hashlib.blake2b(digest_size=12)
    for op in graph.ops:
        if any(k == "device" for k, _ in op.attrs):
            op = replace(op, attrs=tuple((k, v) for k, v in op.attrs if k != "device"))
        h.update(graph.signature(op).encode())
    for t in graph.params:
        h.update(repr(t.shape).encode())
    return h.hexdigest()


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the strategy format (shipped as ``strategy.schema.json``)."""
    schema = Strategy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"polyparallel.strategy/{SCHEMA_VERSION}"
    return schema


def write_schema(path: Path = SCHEMA_FILE) -> None:
    path.write_text(json.dumps(json_schema(), indent=1, sort_keys=True) + "\n")
