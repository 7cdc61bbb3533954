"""``polyparallel search``, ``explain`` and ``evaluate``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import polyparallel as pp
from polyparallel._cli_graph import MODEL_HELP, parse_dims
from polyparallel.cli import UserError, app, writable_file
from polyparallel.cost_models.parallel_config import parse_execution
from polyparallel.plan import CHUNKED_SCHEDULES, SCHEDULES
from polyparallel.strategy import Strategy

PLACEMENTS_HELP = ("per-op placements: torch (the exact per-stage solver, restricted to what the torch backend "
                   "runs), any (every legal placement) or rule (Megatron's)")
CLUSTER_HELP = "cluster preset (dgx-a100x8, aisynergy-5, local-cpu:4, ...) or a YAML/JSON spec"


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)


COMPILE_HELP = ("regional: compile each repeated block with torch.compile (priced as fused kernels); "
                "none: eager (default)")
EXECUTION_HELP = ("how the framework runs the plan, KEY=VALUE, repeatable (fused_elementwise, fused_attention, "
                  "fused_dropout, fused_optimizer, grad_overlap, optimizer, pipeline_p2p, grad_reduce, "
                  "grad_accumulation, zero3_gather, attention_kernel, fused_loss; README: what a plan's price assumes)")
CHUNKS_HELP = ("model chunks per pipeline stage of a chunked schedule (" + ", ".join(CHUNKED_SCHEDULES)
               + "; > 1 alone implies the interleaved one)")
BUFFER_HELP = ("collaborative: asynchronous buffered rounds. auto: where a straggler holds synchronous rounds back, "
               "fuse the first K updates that are in (K the centers that keep pace); K: fuse the first K; "
               "off (default): synchronous rounds")
SEQ_PAR_HELP = ("Megatron-style sequence parallelism: norms and dropouts split along the sequence inside tensor "
                "parallelism")
PARTITION_HELP = "how layers are cut into pipeline stages: flops (balanced by priced time) or layers (equal counts)"
SEQ_HELP = "sequence length of a built-in LM example (default: its own)"
LAYERS_HELP = "number of blocks of a built-in LM example (default: its own)"
DIM_HELP = "value of a dynamic dim of an .onnx MODEL, NAME=N (repeatable), e.g. --dim batch=8"


def _load(model: str, seq: int | None = None, layers: int | None = None,
          dims: list[str] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """MODEL as ``(model, args, kwargs)``; an ONNX file with ``--dim NAME=N`` values for its dynamic dims
    is captured with them (the planner takes the graph)."""
    from polyparallel.models import load_model

    loaded = load_model(model, batch_size=None, seq_len=seq, layers=layers)
    if isinstance(loaded, Path):
        values = parse_dims(dims)
        return (pp.capture(loaded, dim_values=values) if values else loaded), None, {}
    if dims:
        raise UserError(f"--dim sets a dynamic dim of an .onnx model; {model} is not one (its example sets its shapes)")
    return loaded


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _summary(s: Strategy) -> list[str]:
    e = s.estimate
    lines = [f"{s.model.name}: {s.mode} plan on {s.cluster.get('name', '?')} ({len(s.mesh.devices)} devices), "
             f"global batch {s.global_batch}"]
    if s.mode == "synchronous":
        ep = f" ep={s.ep}" if s.ep > 1 else ""
        cp = f" cp={s.cp} (ring attention)" if s.cp > 1 else ""
        seq = " with Megatron sequence parallelism" if s.sequence_parallel else ""
        lines.append(f"  dp={s.dp} tp={s.tp}{seq} pp={s.pp} sp={s.sp}{cp}{ep}, {s.microbatches} micro-batches "
                     f"({s.schedule}), ZeRO-{s.zero_stage}, recompute {s.recompute}, {s.dtype}"
                     + (", blocks compiled" if s.compile == "regional" else ""))
    elif s.collaborative:
        c = s.collaborative
        rounds = (f"buffered: each fusion takes the first {c.buffer} updates in, at most {c.max_staleness} versions "
                  "stale, every " if c.buffer else f"{c.overlap} steps of the next round overlapped, " if c.overlap
                  else "")
        lines.append(f"  {len(c.centers)} centers, fusion {c.fusion} every H={c.local_steps} local steps, "
                     f"{rounds}round {_ms(c.round_time_s)}, communication {100 * c.comm_fraction:.1f}% of the round")
    if e:
        lines.append(f"  step {_ms(e.step_time_s)}, {e.samples_per_s:,.1f} samples/s, "
                     f"{e.model_flops_per_s_per_device / 1e12:.2f} model TFLOP/s per device, "
                     f"peak memory {_gb(e.memory_bytes_max)}, "
                     f"exposed communication {100 * e.comm_fraction:.1f}% of the step")
    r = s.search
    lines.append(f"  searched {r.candidates} candidates in {r.search_s:.2f} s (+{r.capture_s:.2f} s capture), "
                 f"solver {r.solver}")
    # which figures priced the plan: data sheets, nominal CPU figures or a calibration (file, host, date)
    for name, dt in (s.cluster.get("device_types") or {}).items():
        if isinstance(dt, dict) and dt.get("source"):
            lines.append(f"  {name} priced from: {dt['source']}")
    return lines


def _buffer(text: str) -> bool | int:
    if text in ("auto", "off"):
        return text == "auto"
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--buffer {text}: give auto, off or a number of updates K >= 1")
    return int(text)


@app.command("search")
def search_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help=CLUSTER_HELP)] = "local-cpu:2",
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", help="global batch per step")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write the strategy JSON here")] = None,
    objective: Annotated[str, typer.Option(help="throughput or memory")] = "throughput",
    exhaustive: Annotated[bool, typer.Option(help="price every candidate (small problems)")] = False,
    profile: Annotated[bool, typer.Option(help="measure the model's ops on this machine first (a calibrated "
                                               "local-cpu:<P> cluster; seconds for a small model)")] = False,
    dp: Annotated[int | None, typer.Option(help="pin the data-parallel degree")] = None,
    tp: Annotated[int | None, typer.Option(help="pin the tensor-parallel degree")] = None,
    pp: Annotated[int | None, typer.Option(help="pin the number of pipeline stages")] = None,
    sp: Annotated[int | None, typer.Option(help="pin the sequence-parallel (Ulysses) degree")] = None,
    cp: Annotated[int | None, typer.Option(help="pin the context-parallel (ring attention) degree")] = None,
    ep: Annotated[int | None, typer.Option(help="pin the expert-parallel degree (MoE models; divides dp*sp*cp)")]
    = None,
    microbatches: Annotated[int | None, typer.Option(help="pin the micro-batches per step")] = None,
    schedule: Annotated[str | None, typer.Option(help=f"pin the pipeline schedule: {', '.join(SCHEDULES)}")] = None,
    zero: Annotated[int | None, typer.Option(help="pin the ZeRO stage 0-3")] = None,
    recompute: Annotated[str | None, typer.Option(help="pin recomputation: none, selective, op or full")] = None,
    compile: Annotated[str | None, typer.Option("--compile", help=COMPILE_HELP)] = None,
    dtype: Annotated[str | None, typer.Option(help="training precision: fp32, bf16 or fp16 (default: bf16 on "
                                                   "accelerators, fp32 on CPUs)")] = None,
    devices: Annotated[int | None, typer.Option(help="use only the first N devices of the cluster")] = None,
    memory_cap: Annotated[float | None, typer.Option(help="GB per device the plan may use")] = None,
    mode: Annotated[str | None, typer.Option(help="synchronous or collaborative")] = None,
    comm_fraction: Annotated[float | None, typer.Option(help="collaborative: target communication share of a "
                                                              "round (default 0.2)")] = None,
    max_local_steps: Annotated[int | None, typer.Option(help="collaborative: fuse at least every N local steps "
                                                              "(label-skewed data wants frequent fusion)")] = None,
    buffer: Annotated[str | None, typer.Option("--buffer", help=BUFFER_HELP)] = None,
    placements: Annotated[str, typer.Option(help=PLACEMENTS_HELP)] = "torch",
    chunks: Annotated[int | None, typer.Option(help=CHUNKS_HELP)] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help=SEQ_PAR_HELP)] = False,
    partition: Annotated[str | None, typer.Option(help=PARTITION_HELP)] = None,
    execution: Annotated[list[str] | None, typer.Option("--execution", "-x", help=EXECUTION_HELP)] = None,
    seq: Annotated[int | None, typer.Option(help=SEQ_HELP)] = None,
    layers: Annotated[int | None, typer.Option(help=LAYERS_HELP)] = None,
    dim: Annotated[list[str] | None, typer.Option("--dim", help=DIM_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the strategy JSON")] = False,
) -> None:
    """Find the fastest parallel plan of MODEL that fits CLUSTER."""
    from polyparallel.planning.plan_search import Constraints, search

    console = _console()
    pinned = {"dp": dp, "tp": tp, "pp": pp, "sp": sp, "cp": cp, "ep": ep, "microbatches": microbatches,
              "schedule": schedule, "zero_stage": zero, "recompute": recompute, "compile": compile, "dtype": dtype,
              "devices": devices,
              "mode": mode,
              "memory_cap": None if memory_cap is None else memory_cap * 1e9, "comm_fraction": comm_fraction,
              "max_local_steps": max_local_steps, "chunks": chunks, "partition": partition,
              "buffer": None if buffer is None else _buffer(buffer),
              "sequence_parallel": sequence_parallel or None,
              "execution": parse_execution(execution) if execution else None}
    constraints = {k: v for k, v in pinned.items() if v is not None}
    constraints["placements"] = placements
    Constraints.of(constraints)  # a bad pin fails before the capture
    if out is not None:
        writable_file(out)
    m, args, kwargs = _load(model, seq, layers, dim)
    with console.status(f"searching {model} on {cluster} ...") as status:
        s = search(m, args, cluster, example_kwargs=kwargs, batch_size=batch_size, objective=objective,
                   constraints=constraints, exhaustive=exhaustive, profile=profile,
                   progress=None if as_json else (lambda msg: status.update(f"{model} on {cluster}: {msg}")))
    if out is not None:
        s.to_json(out)
    if as_json:
        typer.echo(s.to_json())
        return
    for line in _summary(s):
        console.print(line)
    for n in s.search.notes:
        console.print(f"[yellow]note[/yellow] {n}", highlight=False)
    if out is not None:
        console.print(f"wrote {out}  (inspect with: polyparallel explain {out})")


@app.command("explain")
def explain_cmd(
    strategy: Annotated[Path, typer.Argument(help="a strategy JSON file")],
    diff: Annotated[Path | None, typer.Option("--diff", help="compare with another strategy")] = None,
) -> None:
    """Show a strategy as tables: mesh, stages, placements, cost breakdown, memory per device."""
    s = Strategy.from_json(strategy)
    console = _console()
    if diff is not None:
        _diff(console, s, Strategy.from_json(diff), strategy, diff)
        return
    for line in _summary(s):
        console.print(line)
    t = Table(title="device mesh")
    for col in ("axis", "size", "spans"):
        t.add_column(col)
    for a in s.mesh.axes:
        t.add_row(a.name, str(a.size), a.level)
    console.print(t)
    # the search's "why <axis>=<n>: ..." notes: what each axis splits and what the plan without it costs
    why = [n for n in s.search.notes if n.startswith("why ")]
    for n in why:
        console.print(n, highlight=False)
    if s.ep > 1:
        console.print(f"expert parallelism: ep={s.ep} — each group of {s.ep} data/sequence-parallel ranks splits "
                      f"every MoE layer's experts ({s.ep} shards), dispatches the routed tokens to them and "
                      "combines the outputs by all-to-all; "
                      + (f"the experts' gradients are reduced over the {s.dp * s.plan.seq // s.ep} ranks holding the "
                         "same experts" if s.dp * s.plan.seq > s.ep else "no other rank holds the same experts, so "
                         "their gradients need no reduction"))
    if s.stages:
        t = Table(title="pipeline stages")
        for col in ("stage", "ops (first .. last)", "layers", "devices", "device type", "compute", "placed by",
                    "objective / rule (per micro-batch)"):
            t.add_column(col)
        for st in s.stages:
            pairs = [f"{a} .. {b}" for a, b in zip(st.ops[::2], st.ops[1::2])]
            layers = f"{st.layers[0]}..{st.layers[-1]}" if st.layers else ""
            devs = f"{st.devices[0]}..{st.devices[-1]}" if len(st.devices) > 1 else str(st.devices[0])
            rule = _ms(st.rule_objective_s) if st.rule_objective_s else "n/a"
            obj = f"{_ms(st.objective_s)} / {rule}" if st.objective_s else ""
            t.add_row(str(st.index), "; ".join(pairs), layers, devs, st.device_type, _ms(st.compute_s),
                      st.placed_by or "rule", obj)
        console.print(t)
        for st in s.stages:
            if st.placement_note:
                console.print(f"stage {st.index} placements: {st.placed_by or 'rule'} ({st.placement_note})")
    if s.placements:
        # an op with no tp split: batch-split over dp (and sp) like every op, or whole on one device
        whole = "replicated over tp" if s.tp > 1 else "batch split over dp" if s.dp * s.plan.seq > 1 else "whole"
        t = Table(title="placements (loop dim : mesh axis)")
        t.add_column("placement")
        t.add_column("ops")
        t.add_column("examples")
        for p in s.placements:
            t.add_row(p.placement or whole, str(len(p.ops)), ", ".join(p.ops[:4]) + (" ..." if len(p.ops) > 4
                                                                                          else ""))
        console.print(t)
    if s.collaborative:
        t = Table(title="centers")
        for col in ("center", "framework", "devices", "data share", "local plan"):
            t.add_column(col)
        for c in s.collaborative.centers:
            lp = c.local_strategy
            t.add_row(c.name, c.framework, str(len(c.devices)), f"{100 * c.share:.1f}%",
                      f"dp={lp.get('dp')} tp={lp.get('tp')} pp={lp.get('pp')}")
        console.print(t)
    if s.estimate:
        t = Table(title="step time breakdown (critical stage)")
        t.add_column("part")
        t.add_column("time", justify="right")
        t.add_column("share", justify="right")
        total = sum(s.estimate.breakdown.values()) or 1.0
        for k, v in s.estimate.breakdown.items():
            if v:
                t.add_row(k, _ms(v), f"{100 * v / total:.1f}%")
        console.print(t)
        if s.estimate.memory_by_device:
            t = Table(title="memory per device")
            t.add_column("where")
            t.add_column("peak", justify="right")
            for k, v in s.estimate.memory_by_device.items():
                t.add_row(k, _gb(v))
            console.print(t)
    for n in [n for n in s.search.notes if not n.startswith("why ")][:5]:
        console.print(f"[yellow]note[/yellow] {n}")


def _diff(console: Console, a: Strategy, b: Strategy, pa: Path, pb: Path) -> None:
    t = Table(title=f"{pa.name} vs {pb.name}")
    t.add_column("field")
    t.add_column(pa.name)
    t.add_column(pb.name)
    fields = ["mode", "global_batch", "dp", "tp", "pp", "sp", "ep", "microbatches", "schedule", "zero_stage",
              "recompute", "dtype", "compile"]
    for f in fields:
        va, vb = getattr(a, f), getattr(b, f)
        style = "" if va == vb else "bold"
        t.add_row(f, f"[{style}]{va}[/{style}]" if style else str(va), f"[{style}]{vb}[/{style}]" if style else str(vb))
    if a.estimate and b.estimate:
        for f in ("step_time_s", "samples_per_s", "memory_bytes_max", "comm_fraction"):
            va, vb = getattr(a.estimate, f), getattr(b.estimate, f)
            t.add_row(f, f"{va:.4g}", f"{vb:.4g} ({(vb / va - 1) * 100 if va else 0:+.1f}%)")
    console.print(t)


@app.command("evaluate")
def evaluate_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help=CLUSTER_HELP)] = "local-cpu:2",
    dp: Annotated[int | None, typer.Option(help="data-parallel degree (default: what the devices leave)")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline stages")] = 1,
    sp: Annotated[int, typer.Option(help="sequence-parallel (Ulysses) degree")] = 1,
    cp: Annotated[int, typer.Option(help="context-parallel (ring attention) degree")] = 1,
    ep: Annotated[int, typer.Option(help="expert-parallel degree (MoE models; divides dp*sp*cp)")] = 1,
    microbatches: Annotated[int | None, typer.Option(help="micro-batches per step")] = None,
    schedule: Annotated[str | None, typer.Option(help=", ".join(SCHEDULES))] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage 0-3")] = None,
    recompute: Annotated[str | None, typer.Option(help="none, selective, op or full")] = None,
    compile: Annotated[str, typer.Option("--compile", help=COMPILE_HELP)] = "none",
    dtype: Annotated[str | None, typer.Option(help="training precision: fp32, bf16 or fp16")] = None,
    seq: Annotated[int | None, typer.Option(help=SEQ_HELP)] = None,
    layers: Annotated[int | None, typer.Option(help=LAYERS_HELP)] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", help="global batch per step")] = None,
    placements: Annotated[str, typer.Option(help=PLACEMENTS_HELP + "; a recipe's default is rule")] = "rule",
    chunks: Annotated[int | None, typer.Option(help=CHUNKS_HELP)] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help=SEQ_PAR_HELP)] = False,
    partition: Annotated[str | None, typer.Option(help=PARTITION_HELP)] = None,
    execution: Annotated[list[str] | None, typer.Option("--execution", "-x", help=EXECUTION_HELP)] = None,
    dim: Annotated[list[str] | None, typer.Option("--dim", help=DIM_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON")] = False,
) -> None:
    """Price a hand-made recipe with the search's cost model; unset choices are made as the search would."""
    from polyparallel.planning.evaluate_recipe import evaluate

    options = parse_execution(execution or [])  # a bad option fails before the capture
    m, args, kwargs = _load(model, seq, layers, dim)
    s = evaluate(m, args, cluster, example_kwargs=kwargs, dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, ep=ep,
                 microbatches=microbatches,
                 schedule=schedule, zero_stage=zero, recompute=recompute, batch_size=batch_size, dtype=dtype,
                 compile=compile, placements=placements, chunks=chunks, sequence_parallel=sequence_parallel,
                 partition=partition, execution=options)
    if as_json:
        d = s.estimate.model_dump() if s.estimate else {}
        d.update({"dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp, "cp": s.cp, "ep": s.ep,
                  "microbatches": s.microbatches, "schedule": s.schedule, "notes": s.search.notes,
                  # evaluate's notes: what does not fit, and first, when train would refuse the recipe
                  "fits": not [n for n in s.search.notes if not n.startswith("planning only")],
                  "planning_only": any(n.startswith("planning only") for n in s.search.notes)})
        typer.echo(json.dumps(d, indent=1))
        return
    console = _console()
    for line in _summary(s):
        console.print(line)
    for n in s.search.notes:
        console.print(f"[red]does not fit[/red] {n}")
