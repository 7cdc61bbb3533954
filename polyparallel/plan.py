"""The plan record: parallel degrees keyed by one axis enum, micro-batching, schedule, memory knobs
and precision, defined once.

Every layer that holds a plan holds (or derives) this record:

- the cost model's :class:`~polyparallel.cost_models.parallel_config.ParallelConfig` *is* a
  :class:`Plan` with pricing options added (how the training framework runs it, per-op placements);
- the torch backend's ``ExecPlan`` is a :class:`Plan` with what each worker applies added
  (module-level tensor-parallel styles, the pipeline's stages);
- the :class:`~polyparallel.strategy.Strategy` serialises it as its top-level fields
  (:meth:`Plan.record_fields`; the JSON schema is unchanged) and reads it back as ``strategy.plan``;
- a collaborative center's plan (``local_strategy`` in a Strategy, ``CenterSpec.plan``) is the same
  fields as a dict (:meth:`Plan.from_record`);
- the search's ``Constraints`` pin any subset of :data:`PLAN_FIELDS` and check each pinned value
  with :func:`value_problem`.

A new parallelism adds its axis to :class:`Axis`, its degree to :class:`Plan` (and, where it has
a consistency rule, to :meth:`Plan.problems`); the records above pick it up from here.

Rank order: a device's rank is ``((pp·dp + dp)·seq + s)·tp + tp`` (:meth:`Plan.rank`): tensor
parallelism innermost (the fastest links), then the sequence split, data, pipeline outermost. The
sequence is split by Ulysses (``sp``) or by ring attention (``cp``, context parallelism), not both:
``seq = sp·cp`` is the one that is not 1 and ``s`` its coordinate. Expert parallelism adds no
devices: it is carved from the ``dp·seq`` ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from polyparallel.ir import TRAINING_DTYPE_BYTES

__all__ = ["CENTER_FIELDS", "CHUNKED_SCHEDULES", "COMPILE", "MESH_AXES", "PIPELINE_SCHEDULES", "PLAN_FIELDS",
           "RECOMPUTE", "SCHEDULES", "Axis", "PipelineSchedule", "Plan", "chunks_per_stage", "parse_schedule",
           "value_problem"]


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule the plan record knows.

    Each layer registers what it does with a schedule under its name: the cost model its task order
    and peak activations (``cost_models.pipeline.PRICED``), the torch backend the class of
    ``torch.distributed.pipelining`` that runs it (``backends.torch.capabilities.EXECUTED_SCHEDULES``);
    the search tries the ``searched`` ones. A new schedule is an entry here and one in each of those
    two tables.

    ``chunked``: the schedule runs ``chunks`` model chunks per stage (chunk ``c`` of stage ``s``
    is the model's ``c·p + s``-th piece); a Strategy writes it ``NAME:K``, and a bare name means 2.
    """

    name: str
    chunked: bool
    searched: bool


#: the pipeline schedules, by name, in the order the search tries them (``cost_models/pipeline.py`` describes
#: each one's task order)
PIPELINE_SCHEDULES: Mapping[str, PipelineSchedule] = {s.name: s for s in (
    PipelineSchedule("1f1b", chunked=False, searched=True),  # PipeDream-flush
    PipelineSchedule("gpipe", chunked=False, searched=True),
    PipelineSchedule("interleaved", chunked=True, searched=True),  # Megatron's interleaved 1F1B
    # looped breadth-first (Lamy-Poirier 2023): the interleaved schedule's bubble with every micro-batch of every
    # chunk in flight (GPipe's memory); it takes micro-batch counts the interleaved one refuses. Not searched: the
    # cost model prices the same step as interleaved 1F1B at more memory wherever both run (what breadth-first
    # order gains with ZeRO-3, a chunk's weights gathered once for all its micro-batches, is not priced)
    PipelineSchedule("looped_bfs", chunked=True, searched=False),
)}
SCHEDULES = tuple(PIPELINE_SCHEDULES)
CHUNKED_SCHEDULES = tuple(s.name for s in PIPELINE_SCHEDULES.values() if s.chunked)


def chunks_per_stage(schedule: str, chunks: int) -> int:
    """Model chunks each pipeline stage runs under ``schedule``: ``chunks`` if it is chunked, else 1."""
    return chunks if schedule in CHUNKED_SCHEDULES else 1


RECOMPUTE = ("none", "selective", "op", "full")
COMPILE = ("none", "regional")


class Axis(StrEnum):
    """A parallel axis; its value is the field of :class:`Plan` that holds its degree."""

    DP = "dp"  # data parallelism (ZeRO / FSDP shard over it)
    TP = "tp"  # tensor parallelism
    PP = "pp"  # pipeline parallelism
    SP = "sp"  # sequence parallelism (Ulysses: all-to-all to whole sequences of some heads)
    CP = "cp"  # context parallelism (ring attention: K/V blocks passed around the sequence shards)
    EP = "ep"  # expert parallelism, carved from dp·sp·cp


#: the axes whose degrees multiply to the plan's devices, outermost first (:meth:`Plan.rank`)
MESH_AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.SP, Axis.TP)
_COUNTS = frozenset({*(a.value for a in Axis), "microbatches", "chunks"})  # fields that are whole numbers >= 1

P = TypeVar("P", bound="Plan")


def parse_schedule(label: str) -> tuple[str, int]:
    """``"interleaved:4"`` (as a Strategy writes an interleaved schedule) -> ``("interleaved", 4)``;
    ``"1f1b"`` -> ``("1f1b", 1)``."""
    name, _, depth = str(label).partition(":")
    return name, int(depth) if depth.isdigit() else 1


def value_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is no plan's ``name`` (a field of :data:`PLAN_FIELDS`), in words naming what it
    can take; ``None`` when some plan has it. A schedule may be written ``interleaved:K``."""
    if name in _COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r}: give a whole number >= 1"
        return None
    choices: dict[str, tuple[Any, ...]] = {"zero_stage": (0, 1, 2, 3), "schedule": SCHEDULES,
                                           "recompute": RECOMPUTE, "dtype": tuple(TRAINING_DTYPE_BYTES),
                                           "sequence_parallel": (False, True), "compile": COMPILE}
    if name not in choices:
        raise KeyError(f"{name!r} is not a plan field: {', '.join(PLAN_FIELDS)}")
    v = parse_schedule(value)[0] if name == "schedule" and isinstance(value, str) else value
    if v in choices[name] and not (name == "zero_stage" and isinstance(v, bool)):
        return None
    return f"{name}={value!r}: give one of {', '.join(map(str, choices[name]))}"


@dataclass(frozen=True)
class Plan:
    """One training plan's choices. Defaults are the plan of one device.

    Args:
        dp / tp / pp / sp / cp: data, tensor, pipeline, sequence (Ulysses) and context (ring
            attention) parallel degrees; they multiply to the plan's devices (:attr:`world`). ``sp``
            and ``cp`` both split the sequence: at most one of them is above 1.
        ep: expert parallelism, carved from the ``dp·sp·cp`` ranks (it adds no devices): each group of
            ``ep`` consecutive members of a data-parallel group holds ``1/ep`` of every MoE layer's
            experts.
        microbatches: micro-batches per step per pipeline (gradient accumulation without pp).
        schedule: a name of :data:`PIPELINE_SCHEDULES` (``1f1b``, ``gpipe``, ``interleaved``, ``looped_bfs``);
            ``chunks``: model chunks per stage (a ``chunked`` schedule only).
        zero_stage: 0 (plain DP), 1 (optimizer), 2 (+gradients), 3 (+weights, FSDP).
        recompute: ``none``, ``selective``, ``op`` or ``full`` (see ``ParallelConfig``).
        sequence_parallel: Megatron sequence parallelism alongside ``tp``.
        dtype: compute precision (``fp32``, ``bf16``, ``fp16``).
        compile: ``none`` (eager PyTorch) or ``regional``: each repeated block (numbered layer) is
            compiled with ``torch.compile`` on its own (torchtitan's per-block compilation: one
            compiled graph serves every identical block, and the collectives between blocks stay
            eager), so its elementwise ops run fused into their producers' kernels; priced so
            (``ParallelConfig.fused_elementwise``). Opt-in: the search does not choose it.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    cp: int = 1
    ep: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    dtype: str = "fp32"
    compile: str = "none"

    @property
    def world(self) -> int:
        """Devices the plan uses: the product of the mesh degrees."""
        return self.dp * self.tp * self.pp * self.sp * self.cp

    @property
    def seq(self) -> int:
        """How many shards the sequence is split into (by Ulysses ``sp`` or ring ``cp``)."""
        return self.sp * self.cp

    @property
    def seq_axis(self) -> str:
        """The axis that splits the sequence, by its name: ``cp`` (ring attention) or ``sp``."""
        return "cp" if self.cp > 1 else "sp"

    @property
    def seq_chunks(self) -> int:
        """How many equal pieces a sequence is cut into: ``sp`` blocks (Ulysses), ``2·cp`` chunks
        (ring attention's load balancing gives each shard two); its length must divide by this."""
        return 2 * self.cp if self.cp > 1 else self.sp

    @property
    def split_key(self) -> tuple[int, int, int, bool]:
        """What decides how each op is split and what it communicates (``tp``, ``sp``, ``cp``,
        Megatron sequence parallelism): the part of the plan every per-op price is memoised on. A
        parallelism that changes per-op work or collectives adds its degree here."""
        return (self.tp, self.sp, self.cp, self.sequence_parallel)

    def degrees_label(self) -> str:
        """The degrees as plans are named in notes and reports: ``dp= tp= pp= sp=`` always, ``cp=`` and
        ``ep=`` where above 1 (``dp=2 tp=4 pp=2 sp=1 cp=2``)."""
        extra = "".join(f" {a}={self.degree(a)}" for a in (Axis.CP, Axis.EP) if self.degree(a) > 1)
        return f"dp={self.dp} tp={self.tp} pp={self.pp} sp={self.sp}{extra}"

    def degree(self, axis: Axis | str) -> int:
        return int(getattr(self, Axis(axis).value))

    def rank(self, pp: int, dp: int, s: int, tp: int) -> int:
        """The rank of the device at these coordinates of the mesh (:data:`MESH_AXES` order; ``s``
        the sequence shard, of ``sp`` or ``cp``)."""
        return ((pp * self.dp + dp) * self.seq + s) * self.tp + tp

    @property
    def virtual(self) -> int:
        """Model chunks each pipeline stage runs: ``chunks`` under a chunked schedule, else 1."""
        return chunks_per_stage(self.schedule, self.chunks)

    @property
    def schedule_label(self) -> str:
        """The schedule as a Strategy writes it: ``NAME:K`` with ``K`` chunks per stage (``interleaved:4``)."""
        return f"{self.schedule}:{self.chunks}" if self.chunks > 1 else self.schedule

    def plan(self) -> Plan:
        """The plan part of a record that extends :class:`Plan`."""
        return Plan(**{f: getattr(self, f) for f in PLAN_FIELDS})

    def record_fields(self, names: tuple[str, ...] | None = None) -> dict[str, Any]:
        """The plan as a Strategy's fields (``chunks`` folded into the schedule label), or only
        ``names`` of them (:data:`CENTER_FIELDS`: a collaborative center's plan)."""
        names = names or tuple(f for f in PLAN_FIELDS if f != "chunks")
        return {f: self.schedule_label if f == "schedule" else getattr(self, f) for f in names}

    @classmethod
    def from_record(cls: type[P], record: Mapping[str, Any] | Any, **extra: Any) -> P:
        """The plan a Strategy, a center's plan dict or any record with the plan's fields holds
        (missing fields take their defaults; ``schedule="interleaved:K"`` sets ``chunks``)."""
        get = record.get if isinstance(record, Mapping) else (lambda k, d=None: getattr(record, k, d))
        values = {f: get(f) for f in PLAN_FIELDS if get(f) is not None}
        if isinstance(values.get("schedule"), str) and ":" in values["schedule"]:
            values["schedule"], values["chunks"] = parse_schedule(values["schedule"])
        return cls(**values, **extra)

    def replace(self: P, **changes: Any) -> P:
        return dataclasses.replace(self, **changes)

    def problems(self, who: str = "") -> list[str]:
        """Each value no plan has and each inconsistency between values, in words naming the fix;
        empty for a well-formed plan. ``who`` prefixes each (``"ParallelConfig."``)."""
        why = [f"{who}{p}" for f in PLAN_FIELDS if (p := value_problem(f, getattr(self, f)))]
        if why:
            return why
        if self.sp > 1 and self.cp > 1:
            why.append(f"{who}sp={self.sp} and cp={self.cp} both split the sequence: choose Ulysses (sp) or ring "
                       "attention (cp)")
        if (self.dp * self.seq) % self.ep:
            why.append(f"{who}ep={self.ep} must divide dp*{'cp' if self.cp > 1 else 'sp'} = {self.dp * self.seq}: "
                       "expert parallelism splits the experts over data/sequence-parallel ranks")
        if self.chunks > 1 and self.virtual == 1:
            why.append(f"{who}chunks={self.chunks} needs a chunked schedule ({', '.join(CHUNKED_SCHEDULES)}), not "
                       f"schedule={self.schedule!r}")
        if self.sequence_parallel and self.tp == 1:
            why.append(f"{who}sequence_parallel splits inside tensor parallelism: it needs tp > 1")
        return why


#: the plan's fields, in the order they are declared
PLAN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Plan))
#: what a collaborative center's plan sets (its ``local_strategy``): a center's round is local steps on
#: its whole model, so it has no pipeline schedule, no expert parallelism and no Megatron sequence
#: parallelism to record
CENTER_FIELDS = ("dp", "tp", "pp", "sp", "microbatches", "zero_stage", "recompute", "dtype")
