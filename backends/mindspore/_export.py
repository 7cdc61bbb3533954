"""A synchronous Strategy as MindSpore's parallel configuration, with a report of what does not map.

``export_mindspore(strategy, out, model=..., cell=...)`` writes to the folder ``out``:

* ``mindspore_parallel.json`` — ``context``: the keyword arguments of
  ``mindspore.set_auto_parallel_context`` (parallel mode, ``device_num``, ``pipeline_stages`` and
  ``pipeline_config``, ``enable_parallel_optimizer`` with ``optimizer_level`` for the ZeRO stage,
  ``gradients_mean``, the strategy checkpoint to save); ``micro_batches``: the wrapper that runs them
  (``nn.PipelineCell(net, micro_size)`` with stages, ``nn.GradAccumulationCell`` without);
  ``pipeline``: the ``pipeline_stage`` (and ``pipeline_segment`` of an interleaved schedule) of every
  cell, by module path; ``shards``: per group of ops, the MindSpore primitives and their
  ``in_strategy`` (:mod:`._shards`); ``unexpressed``: each thing MindSpore's configuration cannot
  say, with the reason; with a user ``Cell``, ``cell_map``: which cell's primitives each torch op sets.
* ``report.md`` — the same as a human reads it.

Which MindSpore settings a plan field becomes (and what is lost):

============================  ========================================================================
plan                           MindSpore
============================  ========================================================================
dp, tp, pp, sp (world)         ``device_num = dp·tp·pp·sp``; ``semi_auto_parallel`` when anything but
                               dp splits, else ``data_parallel``
pp, microbatches, schedule     ``pipeline_stages``; ``pipeline_config`` (``1f1b``/``gpipe``,
                               ``pipeline_interleave`` for ``interleaved:K``); ``PipelineCell(micro_size)``;
                               another schedule (``looped_bfs``) as 1F1B: reported
microbatches (pp = 1)          ``GradAccumulationCell(micro_size)``
zero_stage 1/2/3               ``enable_parallel_optimizer`` + ``optimizer_level`` level1/2/3 (MindSpore's
                               level1 also shards the weights: more than ZeRO-1)
per-op placements              ``Primitive.shard(in_strategy)``
sp (Ulysses)                   not expressible (its all-to-all around attention has no setting): reported
sequence_parallel (Megatron)   the norms' shards along the sequence, when the placements split it
recompute full / selective     ``Cell.recompute()`` on each block / on the attention: listed, applied
                               by :func:`.apply.apply_config`
dtype bf16 / fp16              ``amp_level = "O2"`` with that type: listed
============================  ========================================================================
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyparallel.ir import Graph
from polyparallel.poly import Placement
from polyparallel.strategy import Strategy, fingerprint

from ._shards import op_shards

__all__ = ["ExportResult", "context_of", "export_mindspore", "pipeline_cells"]

CONFIG_FILE = "mindspore_parallel.json"
REPORT_FILE = "report.md"

_OPTIMIZER_LEVEL = {1: "level1", 2: "level2", 3: "level3"}
#: the MindSpore pipeline scheduler that runs each schedule of the plan record (the chunks go to pipeline_interleave)
_SCHEDULERS = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "1f1b"}


@dataclass
class ExportResult:
    """What :func:`export_mindspore` wrote: the configuration (as written) and the files."""

    config: dict[str, Any]
    files: list[Path] = field(default_factory=list)

    @property
    def unexpressed(self) -> list[dict[str, str]]:
        return self.config["unexpressed"]


def context_of(s: Strategy) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, str]]]:
    """``(set_auto_parallel_context kwargs, micro-batch wrapper, unexpressed)`` of a synchronous plan."""
    plan = s.plan
    world = plan.world
    lost: list[dict[str, str]] = []
    semi = plan.tp > 1 or plan.pp > 1 or plan.seq > 1 or bool(s.placements and any(p.placement for p in s.placements
                                                                                if "tp" in p.placement))
    ctx: dict[str, Any] = {"parallel_mode": "semi_auto_parallel" if semi else "data_parallel", "device_num": world,
                           "gradients_mean": True, "dataset_strategy": "data_parallel",
                           "strategy_ckpt_config": {"save_file": "strategy.ckpt", "only_trainable_params": False}}
    if plan.zero_stage:
        ctx["enable_parallel_optimizer"] = True
        ctx["parallel_optimizer_config"] = {"optimizer_level": _OPTIMIZER_LEVEL[plan.zero_stage]}
        if plan.zero_stage == 1:
            lost.append({"what": "zero_stage=1", "why": "MindSpore's parallel optimizer at level1 shards the weights "
                         "as well as the optimizer state (ZeRO-1 shards the optimizer state only): the memory is "
                         "lower and the communication higher than the plan priced"})
    wrapper: dict[str, Any] = {}
    if plan.pp > 1:
        schedule = _SCHEDULERS.get(plan.schedule)
        if schedule is None:
            schedule = "1f1b"
            lost.append({"what": f"schedule={plan.schedule_label}", "why": f"MindSpore has no {plan.schedule} pipeline "
                         "scheduler: exported as its 1F1B (interleaved where the plan has several chunks per "
                         "stage), whose activation memory and bubble differ from what the plan priced"})
        ctx["pipeline_stages"] = plan.pp
        ctx["pipeline_config"] = {"pipeline_interleave": plan.chunks > 1, "pipeline_scheduler": schedule}
        wrapper = {"cell": "nn.PipelineCell", "micro_size": plan.microbatches}
    elif plan.microbatches > 1:
        wrapper = {"cell": "nn.GradAccumulationCell", "micro_size": plan.microbatches}
    if plan.sp > 1:
        lost.append({"what": f"sp={plan.sp}", "why": "Ulysses sequence parallelism (an all-to-all from sequence "
                     "shards to head shards around attention) has no MindSpore setting; the shards below split the "
                     "sequence where the placements do and MindSpore chooses its own redistribution"})
    if plan.cp > 1:
        lost.append({"what": f"cp={plan.cp}", "why": "context parallelism (ring attention: K/V blocks passed around "
                     "load-balanced sequence shards) has no MindSpore auto-parallel setting; the devices are counted "
                     "in device_num, but nothing here splits the sequence or passes K/V between them"})
    if plan.ep > 1:
        lost.append({"what": f"ep={plan.ep}", "why": "expert parallelism is MindSpore's MoE layer's own "
                     "configuration (MoEConfig.expert_parallel), not a context setting"})
    extra: dict[str, Any] = {}
    if plan.recompute != "none":
        extra["recompute"] = {"full": "every repeated block: Cell.recompute()",
                              "selective": "attention: Cell.recompute() on the attention cells",
                              "op": "the recomputed ops: Primitive.recompute()"}[plan.recompute]
    if plan.dtype != "fp32":
        extra["amp"] = {"amp_level": "O2", "dtype": plan.dtype}
    return ctx, {**wrapper, **extra}, lost


def _chunk_ops(graph: Graph, first: str, last: str) -> list[str]:
    names = [op.name for op in graph.ops]
    i, j = names.index(first), names.index(last)
    return names[i:j + 1]


def pipeline_cells(s: Strategy, graph: Graph) -> list[dict[str, Any]]:
    """``[{"cell": module path, "pipeline_stage": i, "pipeline_segment": chunk}]``: the shortest module
    paths whose ops all sit in one stage's chunk (MindSpore sets the stage of a cell and its children)."""
    where: dict[str, tuple[int, int]] = {}
    for st in s.stages:
        for c in range(0, len(st.ops), 2):
            for name in _chunk_ops(graph, st.ops[c], st.ops[c + 1]):
                where[name] = (st.index, c // 2)
    by_module: dict[str, set[tuple[int, int]]] = {}
    for op in graph.ops:
        if op.module and op.name in where:
            parts = op.module.split(".")
            for k in range(1, len(parts) + 1):
                by_module.setdefault(".".join(parts[:k]), set()).add(where[op.name])
    out: dict[str, tuple[int, int]] = {}
    for op in graph.ops:
        if not op.module or op.name not in where:
            continue
        parts = op.module.split(".")
        for k in range(1, len(parts) + 1):
            p = ".".join(parts[:k])
            if len(by_module[p]) == 1:
                out.setdefault(p, where[op.name])
                break
    return [{"cell": p, "pipeline_stage": st, "pipeline_segment": seg} for p, (st, seg) in out.items()]


def _splits(placement: str, mesh: dict[str, int]) -> dict[str, int]:
    return {d: math.prod(mesh.get(a, 1) for a in axes) for d, axes in Placement.parse(placement).splits}


def shard_groups(s: Strategy, graph: Graph) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Per placement group and op signature: the ops, their modules and the MindSpore primitives."""
    ops = {op.name: op for op in graph.ops}
    mesh = s.mesh.shape()
    groups: list[dict[str, Any]] = []
    lost: list[dict[str, str]] = []
    for entry in s.placements:
        splits = _splits(entry.placement, mesh)
        implicit_dp = s.dp > 1 and "dp" not in entry.placement  # the torch backend's DDP splits the batch anyway
        mods = dict(zip(entry.ops, entry.modules or [""] * len(entry.ops)))
        by_sig: dict[str, dict[str, Any]] = {}
        for name in entry.ops:
            op = ops.get(name)
            if op is None:
                raise ValueError(f"the strategy places op {name!r}, which the model's graph does not have: export "
                                 "with the model the strategy was searched for")
            sig = graph.signature(op)
            if sig not in by_sig:
                own = dict(splits)
                batch = [d.name for d in op.nest.dims if d.hint == "batch"] if op.nest is not None else []
                if implicit_dp and batch and batch[0] not in own:
                    own[batch[0]] = s.dp
                prims, notes = op_shards(graph, op, own)
                by_sig[sig] = {"ops": [], "modules": [], "target": op.target, "placement": entry.placement,
                               "primitives": [p.to_dict() for p in prims]}
                lost += [{"what": f"{entry.placement} on {op.target}", "why": n} for n in notes]
            by_sig[sig]["ops"].append(name)
            by_sig[sig]["modules"].append(mods.get(name, op.module))
        groups += [g for g in by_sig.values() if g["primitives"]]
    placed = {n for e in s.placements for n in e.ops}
    rest = [op.name for op in graph.ops if op.name not in placed and op.nest is not None and op.kind != "view"]
    if rest:
        more = ", ..." if len(rest) > 4 else ""
        lost.append({"what": f"{len(rest)} ops without a placement ({', '.join(rest[:4])}{more})",
                     "why": "the strategy leaves them to the backend's default; MindSpore's default strategy splits "
                            "their first (batch) dim over the stage's devices"})
    return groups, lost


def export_mindspore(strategy: Strategy | str | Path, out: str | Path, *, graph: Graph | None = None,
                     cell_map: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None
                     ) -> ExportResult:
    """Write MindSpore's parallel configuration of a synchronous ``strategy`` to the folder ``out``.

    ``graph``: the model's captured graph (fused as the search prices it) — needed for the per-op shards
    and the pipeline cells; its fingerprint must be the strategy's. ``cell_map``: the torch op -> user
    Cell map (:func:`.cell_map.infer_cell_map`), recorded with the shards; ``extra``: more keys to record.
    """
    s = strategy if isinstance(strategy, Strategy) else Strategy.from_json(strategy)
    if s.mode != "synchronous":
        raise ValueError(f"strategy of {s.model.name!r} is collaborative: export a center's synchronous plan "
                         "(a MindSpore center runs its plan itself, see docs/mindspore.md), or search with --mode "
                         "synchronous")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder (it is created)")
    ctx, wrapper, lost = context_of(s)
    config: dict[str, Any] = {"framework": "mindspore", "mindspore_version": "2.10", "model": s.model.name,
                              "plan": s.plan.record_fields(),
                              "context": ctx, "micro_batches": wrapper, "pipeline": [], "shards": []}
    if graph is not None:
        fp = fingerprint(graph)
        if fp != s.model.fingerprint:
            raise ValueError(f"the model's graph (fingerprint {fp}) is not the one the strategy was searched for "
                             f"({s.model.fingerprint}): give the same model, and --seq/--layers as the search had them")
        if s.pp > 1:
            config["pipeline"] = pipeline_cells(s, graph)
        config["shards"], more = shard_groups(s, graph)
        lost += more
    else:
        lost.append({"what": "per-op shards and pipeline cells", "why": "no model was given: pass the model the "
                     "strategy was searched for (--model) to derive them from its graph"})
    if cell_map is not None:
        config["cell_map"] = cell_map
    config.update(extra or {})
    config["unexpressed"] = lost
    out.mkdir(parents=True, exist_ok=True)
    files = [out / CONFIG_FILE, out / REPORT_FILE]
    files[0].write_text(json.dumps(config, indent=1) + "\n")
    files[1].write_text(report_markdown(config))
    return ExportResult(config, files)


def _rows(items: Iterable[Any]) -> str:
    return "\n".join(items)


def report_markdown(config: dict[str, Any]) -> str:
    """The mapping report: the context, the micro-batch wrapper, the shards and what did not map."""
    lines = [f"# MindSpore parallel configuration of {config['model']}", "",
             f"plan: {json.dumps(config['plan'])}", "", "## set_auto_parallel_context", "", "```python",
             "mindspore.set_auto_parallel_context(" + ", ".join(f"{k}={v!r}" for k, v in config["context"].items())
             + ")", "```", ""]
    if config["micro_batches"]:
        lines += ["## micro-batches, recomputation, precision", "", f"{json.dumps(config['micro_batches'])}", ""]
    if config["pipeline"]:
        lines += ["## pipeline stages (cell.pipeline_stage / pipeline_segment)", "", "| cell | stage | segment |",
                  "|---|---|---|"]
        lines += [f"| {c['cell']} | {c['pipeline_stage']} | {c['pipeline_segment']} |" for c in config["pipeline"]]
        lines.append("")
    if config["shards"]:
        lines += ["## shard strategies", "", "| ops | torch op | placement | MindSpore primitive: in_strategy |",
                  "|---|---|---|---|"]
        for g in config["shards"]:
            prims = "; ".join(f"{p['primitive']}{tuple(tuple(t) for t in p['in_strategy'])}" for p in g["primitives"])
            ops = ", ".join(g["ops"][:3]) + (f" (+{len(g['ops']) - 3})" if len(g["ops"]) > 3 else "")
            lines.append(f"| {ops} | {g['target']} | {g['placement']} | {prims} |")
        lines.append("")
    if config.get("cell_map"):
        lines += ["## torch op -> MindSpore cell", "", "| torch module | MindSpore cell | layer |", "|---|---|---|"]
        lines += [f"| {m['torch_module']} | {m['cell']} | {m['layer']} |" for m in config["cell_map"]]
        lines.append("")
    lines += ["## not expressed in MindSpore", ""]
    lines += [f"- **{u['what']}**: {u['why']}" for u in config["unexpressed"]] or ["- nothing"]
    if config.get("validation"):
        lines += ["", "## validation by MindSpore", ""]
        lines += [f"- {k}: {v}" for k, v in config["validation"].items()]
    return _rows(lines) + "\n"
