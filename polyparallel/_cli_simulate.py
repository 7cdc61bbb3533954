"""``polyparallel simulate``: the rounds of a collaborative strategy, phase by phase (distribute, compute,
upload, wait, fuse, and the framework's fixed cost), with statistics, a Perfetto trace and a PNG timeline;
for a synchronous strategy with pipeline stages, one step's timeline per stage with its bubbles (the
task-by-task simulation the HTML report draws, :func:`polyparallel.report.pipeline_tasks`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from polyparallel.cli import UserError, app
from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_buffered, simulate_rounds
from polyparallel.report import pipeline_tasks
from polyparallel.strategy import Strategy, StrategyError


@app.command("simulate")
def simulate_cmd(
    strategy: Annotated[Path, typer.Argument(help="a collaborative strategy JSON (polyparallel search MODEL -c "
                                                  "CLUSTER --mode collaborative -o FILE)")],
    rounds: Annotated[int, typer.Option("--rounds", "-n", help="rounds to simulate")] = 100,
    trace: Annotated[Path | None, typer.Option("--trace", help="write a Chrome-trace / Perfetto JSON here "
                                                               "(one track per center and phase)")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write a PNG timeline here (needs matplotlib)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the statistics as JSON, not a table")] = False,
    jitter: Annotated[float, typer.Option("--jitter", help="log-sd of the compute and link time factors "
                                                           "(mean 1); 0: deterministic")] = 0.0,
    dropout: Annotated[float, typer.Option("--dropout", help="probability that a center misses a round")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="seed of the jitter and dropouts")] = 0,
    local_steps: Annotated[int | None, typer.Option("--local-steps", "-H", help="override the strategy's H")] = None,
    compression: Annotated[str | None, typer.Option("--compression", help="override: none, fp16 or int8")] = None,
    fixed_s: Annotated[float | None, typer.Option(
        "--fixed-s", help="the framework's fixed cost per round in s (default: Flower on loopback, 0.9 s "
                          "measured, see cost_models/collab_simulator.py FIXED_ROUND_S)")] = None,
    sequential: Annotated[bool, typer.Option("--sequential", help="centers one after another (the in-process "
                                                                  "engine), not concurrently")] = False,
    overlap: Annotated[int | None, typer.Option(
        "--overlap", help="K: overlapped rounds, each center takes K steps of the next round while its update "
                          "travels (0: synchronous; default: the strategy's)")] = None,
    buffer: Annotated[int | None, typer.Option(
        "--buffer", help="K: asynchronous buffered rounds, the server fuses the first K updates that are in "
                         "(--rounds counts fusions; 1..centers; 0: synchronous; default: the strategy's)")] = None,
    max_staleness: Annotated[int | None, typer.Option(
        "--max-staleness", help="with --buffer: refuse updates more versions old than this (default: none)")] = None,
) -> None:
    """Simulate N rounds of a collaborative strategy: time to N rounds, utilisation per center, and the
    communication, idle and fusion shares of wall time. A synchronous strategy with pipeline stages: one
    step per stage, with its bubbles."""
    try:
        s = Strategy.from_json(strategy)
    except StrategyError as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{first}; give a strategy written by `polyparallel search MODEL -c CLUSTER --mode "
                        f"collaborative -o {strategy}`") from None
    if s.collaborative is None:
        if not s.stages or not any(st.compute_s for st in s.stages):
            raise UserError(f"{strategy}: a synchronous strategy without pipeline stage times has nothing to "
                            "simulate; give a collaborative strategy (`polyparallel search MODEL -c CLUSTER --mode "
                            "collaborative`) or one with pp > 1")
        summary, trace_doc = pipeline_timeline(s)
        typer.echo(json.dumps(summary, indent=1) if as_json else pipeline_table(summary))
        if trace is not None:
            trace.write_text(json.dumps(trace_doc))
            typer.echo(f"wrote {trace}  (open it in https://ui.perfetto.dev or chrome://tracing)", err=as_json)
        if plot is not None:
            typer.echo(f"no PNG for a pipeline step: `polyparallel report {strategy}` draws it", err=True)
        return
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: give at least 1 round")
    if local_steps is not None and local_steps < 1:
        raise UserError(f"--local-steps {local_steps}: H must be >= 1")
    if compression not in (None, "none", "fp16", "int8"):
        raise UserError(f"--compression {compression!r}: choose none, fp16 or int8")
    if not 0 <= dropout < 1:
        raise UserError(f"--dropout {dropout}: give a probability in [0, 1)")
    if jitter < 0 or (fixed_s is not None and fixed_s < 0):
        raise UserError("--jitter and --fixed-s must be >= 0")
    try:
        x = inputs_from_strategy(s, fixed_s=fixed_s, local_steps=local_steps, compression=compression,
                                 overlap=overlap)
    except ValueError as e:
        raise UserError(str(e)) from None
    if x.overlap and sequential:
        raise UserError("--overlap with --sequential: overlapped rounds are simulated for concurrent centers")
    if buffer is None and s.collaborative.buffer:  # the strategy's buffered rounds
        buffer = s.collaborative.buffer
        max_staleness = s.collaborative.max_staleness if max_staleness is None else max_staleness
    if max_staleness is not None and not buffer:
        raise UserError("--max-staleness goes with --buffer K (the staleness of buffered rounds' updates)")
    if buffer:
        _buffered(x, rounds, buffer, max_staleness, as_json,
                  [n for n, v in (("--overlap", overlap), ("--sequential", sequential), ("--jitter", jitter),
                                  ("--dropout", dropout), ("--trace", trace), ("--plot", plot)) if v])
        return
    res = simulate_rounds(x, rounds, compute_jitter=jitter, link_jitter=jitter, dropout=dropout, seed=seed,
                          concurrent=not sequential)
    typer.echo(json.dumps(res.summary(), indent=1) if as_json else res.table())
    if trace is not None:
        res.write_trace(trace)
        typer.echo(f"wrote {trace}  (open it in https://ui.perfetto.dev or chrome://tracing)", err=as_json)
    if plot is not None:
        if res.plot(plot) is None:
            typer.echo(f"no PNG written to {plot}: matplotlib is not installed (pip install matplotlib)", err=True)
        else:
            typer.echo(f"wrote {plot}", err=as_json)


def _buffered(x: Any, fusions: int, buffer: int, max_staleness: int | None, as_json: bool, other: list[str]) -> None:
    """Print the buffered rounds' simulation (``collab_simulator.simulate_buffered``)."""
    if other:
        raise UserError(f"buffered rounds (--buffer {buffer}, or the strategy's) with {', '.join(other)}: buffered "
                        "rounds are simulated for concurrent centers, "
                        "synchronous steps, without jitter, dropouts or a timeline")
    if not 1 <= buffer <= x.n:
        raise UserError(f"--buffer {buffer}: give K in [1, {x.n}] (the strategy's centers)")
    if max_staleness is not None and max_staleness < 0:
        raise UserError(f"--max-staleness {max_staleness}: give a number of versions >= 0")
    res = simulate_buffered(x, fusions, buffer, max_staleness)
    typer.echo(json.dumps(res.summary(), indent=1) if as_json else res.table())


def pipeline_timeline(s: Strategy) -> tuple[dict[str, Any], dict[str, Any]]:
    """One pipeline step of a synchronous strategy: per stage its busy and idle (bubble) time, and a
    Chrome-trace with one track per stage. The tasks are the report's (:func:`~polyparallel.report.
    pipeline_tasks`, the schedule order of :mod:`polyparallel.cost_models.pipeline`; forward 1/3 and
    backward 2/3 of a stage's compute per micro-batch), its makespan the cost model's."""
    tasks, sim = pipeline_tasks(s)
    span = sim.makespan
    stages = []
    for st in s.stages:
        mine = [(a, z, k) for r, a, z, k, _ in tasks if r == st.index]
        busy = sum(z - a for a, z, _ in mine)
        first, last = min(a for a, _, _ in mine), max(z for _, z, _ in mine)
        stages.append({"stage": st.index, "devices": list(st.devices), "forward_s": sum(z - a for a, z, k in mine
                                                                                       if k == "F"),
                       "backward_s": sum(z - a for a, z, k in mine if k == "B"), "busy_s": busy,
                       "bubble_s": span - busy, "bubble_share": (span - busy) / span if span else 0.0,
                       "warmup_s": first, "cooldown_s": span - last})
    summary = {"schedule": s.schedule, "stages": len(s.stages), "microbatches": s.microbatches,
               "chunks": sim.chunks, "makespan_s": span, "bubble_fraction": sim.bubble_fraction,
               "estimated_step_s": s.estimate.step_time_s if s.estimate else None, "per_stage": stages}
    ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    ev += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": st.index, "args": {"name": f"stage {st.index}"}}
           for st in s.stages]
    ev += [{"ph": "X", "name": label, "cat": "forward" if k == "F" else "backward", "pid": 0, "tid": r,
            "ts": a * 1e6, "dur": (z - a) * 1e6} for r, a, z, k, label in tasks]
    return summary, {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"summary": summary}}


def pipeline_table(summary: dict[str, Any]) -> str:
    lines = [f"one step of {summary['schedule']}: {summary['stages']} stages × {summary['microbatches']} micro-batches"
             + (f" ({summary['chunks']} chunks per stage)" if summary["chunks"] > 1 else "")
             + f", makespan {1e3 * summary['makespan_s']:.3f} ms, bubble {100 * summary['bubble_fraction']:.1f}% "
             "(cost_models.pipeline; forward 1/3, backward 2/3 of each stage's compute; no point-to-point time)",
             f"  {'stage':>5} {'forward ms':>11} {'backward ms':>12} {'busy ms':>9} {'bubble ms':>10} {'bubble %':>9} "
             f"{'warm-up ms':>11} {'cool-down ms':>13}"]
    for r in summary["per_stage"]:
        lines.append(f"  {r['stage']:>5} {1e3 * r['forward_s']:>11.3f} {1e3 * r['backward_s']:>12.3f} "
                     f"{1e3 * r['busy_s']:>9.3f} {1e3 * r['bubble_s']:>10.3f} {100 * r['bubble_share']:>9.1f} "
                     f"{1e3 * r['warmup_s']:>11.3f} {1e3 * r['cooldown_s']:>13.3f}")
    if summary["estimated_step_s"]:
        lines.append(f"the strategy's estimated step ({1e3 * summary['estimated_step_s']:.3f} ms) adds "
                     "point-to-point, data-parallel and optimizer time")
    return "\n".join(lines)
