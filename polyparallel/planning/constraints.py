"""What a user pins of a plan (:class:`Constraints`), and the search's error when no plan fits
(:class:`DoesNotFit`).

A pinned value of the plan record is checked as the record checks it
(:func:`polyparallel.plan.value_problem`); the other fields say where and how to search (devices,
centers, memory cap, mode, placements, how the framework executes the plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyparallel.cost_models.parallel_config import execution_options
from polyparallel.plan import CHUNKED_SCHEDULES, PLAN_FIELDS, parse_schedule, value_problem
from polyparallel.planning.place_plan import MODES

__all__ = ["Constraints", "DoesNotFit"]


class DoesNotFit(ValueError):
    """No plan fits the cluster's memory; the message names the smallest shortfall."""


@dataclass(frozen=True)
class Constraints:
    """Choices an expert pins; the search optimises the rest.

    Args:
        dp / tp / pp / sp / cp / microbatches / schedule / zero_stage / recompute: fixed values
            (``sp``: Ulysses sequence parallelism, ``cp``: context parallelism, ring attention).
        compile: ``regional`` compiles each repeated block with ``torch.compile`` and prices the
            plans as fused kernels (:class:`~polyparallel.plan.Plan`); unset or ``none``: eager.
        ep: the expert-parallel degree (MoE models; carved from ``dp·sp·cp``). Unset, the search
            tries 1 and every divisor of ``dp·sp·cp`` that divides the experts of each MoE layer.
        devices: use only this many devices (the first ones in the cluster's order).
        centers: use only these centers (by name).
        memory_cap: bytes per device the plan may use (below the device capacity).
        dtype: training precision (default: bf16 on accelerators, fp32 on CPUs).
        allow_wan: allow data/tensor-parallel collectives across centers.
        mode: force ``synchronous`` or ``collaborative``.
        comm_fraction: target communication share of a collaborative round.
        max_local_steps: fuse at least every this many local steps (label-skewed centers drift
            apart between fusions), even when the communication share then exceeds the target.
        overlap: allow overlapped fusion (``Collaborative.overlap``): where synchronous rounds cannot meet
            ``comm_fraction`` within ``max_local_steps``, the search keeps ``H`` at that cap and overlaps
            each round with the fewest of the next round's steps that then meets it (single-process torch
            centers; every step ahead is one round stale). False: synchronous rounds only.
        buffer: asynchronous buffered rounds (``Collaborative.buffer``): ``True`` lets the search fuse the
            first ``K`` updates that are in where a straggler holds synchronous rounds back (``K`` the centers
            whose round alone takes at most 1.5x the median center's), a whole number pins ``K``, ``False``
            (default) keeps synchronous rounds: a center left out of most fusions is under-represented in
            the model, which costs accuracy under label skew (measured in docs/collab.md).
        cross_node_tp: allow tensor parallelism across nodes.
        placements: per-op placements of the chosen plan: ``torch`` (the exact per-stage solver,
            restricted to what the torch backend executes), ``any`` (the solver over every legal
            placement; the torch backend may refuse the strategy) or ``rule`` (Megatron's rule).
        chunks: model chunks per pipeline stage of a chunked schedule (alone: the interleaved one).
        sequence_parallel: Megatron's sequence parallelism inside tensor parallelism (norms,
            dropouts and residuals split along the sequence; all-gather / reduce-scatter in place of
            all-reduce), on every plan with ``tp > 1``.
        partition: how layers are cut into pipeline stages: ``flops`` (balanced) or ``layers``
            (equal layer counts, Megatron / DeepSpeed).
        execution: how the training framework runs the plan
            (:data:`~polyparallel.cost_models.parallel_config.EXECUTION_FIELDS`: fused kernels, gradient
            overlap, pipeline p2p, gradient reduction and accumulation, optimizer); unset, what the torch
            backend does. A dict, kept as sorted pairs.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    sp: int | None = None
    cp: int | None = None
    ep: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    zero_stage: int | None = None
    recompute: str | None = None
    compile: str | None = None
    devices: int | None = None
    centers: tuple[str, ...] | None = None
    memory_cap: float | None = None
    dtype: str | None = None
    allow_wan: bool = False
    mode: str | None = None
    comm_fraction: float = 0.2
    max_local_steps: int | None = None
    overlap: bool = True
    buffer: bool | int = False
    cross_node_tp: bool = False
    placements: str = "torch"
    chunks: int | None = None
    sequence_parallel: bool = False
    partition: str | None = None
    execution: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.execution, dict):
            object.__setattr__(self, "execution", execution_options(self.execution))
        bad = self.problems()
        if bad:
            raise ValueError("bad constraint: " + "; ".join(bad))

    def problems(self) -> list[str]:
        """Each pinned value that no plan can have, with the values it can take."""
        why = []
        for name in PLAN_FIELDS:  # each pinned value of the plan record, checked as the record checks it
            v = getattr(self, name)
            if v is not None and (p := value_problem(name, v)):
                why.append(f"{p} (or leave it unset to let the search choose)")
        for name in ("devices", "max_local_steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                why.append(f"{name}={v!r}: give a whole number >= 1 (or leave it unset to let the search choose)")
        if not isinstance(self.buffer, bool) and (not isinstance(self.buffer, int) or self.buffer < 1):
            why.append(f"buffer={self.buffer!r}: give True (the search chooses how many updates a fusion waits for), "
                       "a whole number K >= 1, or False (synchronous rounds)")
        if self.mode is not None and self.mode not in ("synchronous", "collaborative"):
            why.append(f"mode={self.mode!r}: give one of synchronous, collaborative")
        if (self.chunks is not None and self.chunks > 1 and self.schedule is not None
                and parse_schedule(self.schedule)[0] not in CHUNKED_SCHEDULES):
            why.append(f"chunks={self.chunks} needs a chunked schedule ({', '.join(CHUNKED_SCHEDULES)}), not "
                       f"schedule={self.schedule!r}")
        if (pinned := self.pinned_schedule())[0] in CHUNKED_SCHEDULES and pinned[1] == 1:
            why.append(f"chunks=1 with schedule={self.schedule!r}: a chunked schedule runs at least 2 model chunks per "
                       "stage; pin chunks >= 2 or leave chunks unset")
        if self.partition is not None and self.partition not in ("flops", "layers"):
            why.append(f"partition={self.partition!r}: give flops or layers")
        if (self.sp or 1) > 1 and (self.cp or 1) > 1:
            why.append(f"sp={self.sp} and cp={self.cp} both split the sequence: pin Ulysses (sp) or ring attention "
                       "(cp), not both")
        if self.sequence_parallel and self.tp is not None and self.tp == 1:
            why.append("sequence_parallel splits inside tensor parallelism: pin tp > 1 with it")
        try:
            execution_options(dict(self.execution))
        except ValueError as e:
            why.append(str(e))
        if self.memory_cap is not None and not self.memory_cap > 0:
            why.append(f"memory_cap={self.memory_cap!r}: give bytes per device > 0")
        if not 0 < self.comm_fraction < 1:
            why.append(f"comm_fraction={self.comm_fraction!r}: give a share of the round between 0 and 1")
        return why

    def pricing_options(self) -> dict[str, Any]:
        """What every plan of the search is priced with (``ParallelConfig`` keyword arguments): the
        pinned partition, whether the blocks are compiled, and how the framework executes
        (:data:`~polyparallel.cost_models.parallel_config.EXECUTION_FIELDS`; disjoint keys)."""
        return {**({"partition": self.partition} if self.partition else {}), **dict(self.execution),
                "compile": self.compile or "none"}

    def pinned_schedule(self) -> tuple[str | None, int | None]:
        """The pinned schedule and its chunks per stage: ``schedule="interleaved:4"`` (as a Strategy
        writes it) and ``schedule="interleaved", chunks=4`` both give ``("interleaved", 4)``; ``chunks``
        alone leaves the schedule to the search."""
        if self.schedule is None:
            return None, self.chunks
        name, depth = parse_schedule(self.schedule)
        return name, depth if depth > 1 else self.chunks

    @classmethod
    def of(cls, value: Constraints | dict[str, Any] | None) -> Constraints:
        if value is None:
            return cls()
        if isinstance(value, Constraints):
            return value
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(value) - known)
        if bad:
            raise ValueError(f"unknown constraint(s) {bad}; known: {', '.join(sorted(known))}")
        v = dict(value)
        if v.get("centers") is not None:
            v["centers"] = tuple(v["centers"])
        out = cls(**v)
        if out.placements not in MODES:
            raise ValueError(f"constraints.placements must be one of {', '.join(MODES)}, not {out.placements!r}")
        return out
