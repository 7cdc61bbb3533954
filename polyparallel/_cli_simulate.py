"""``polyparallel simulate``: the rounds of a collaborative strategy, phase by phase (distribute, compute,
upload, wait, fuse, and the framework's fixed cost), with statistics, a Perfetto trace and a PNG timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from polyparallel.cli import UserError, app
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
) -> None:
    """Simulate N rounds of a collaborative strategy: time to N rounds, utilisation per center, and the
    communication, idle and fusion shares of wall time."""
    from polyparallel.cost_models.collab_simulator import inputs_from_strategy, simulate_rounds

    try:
        s = Strategy.from_json(strategy)
    except StrategyError as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{first}; give a strategy written by `polyparallel search MODEL -c CLUSTER --mode "
                        f"collaborative -o {strategy}`") from None
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
        x = inputs_from_strategy(s, fixed_s=fixed_s, local_steps=local_steps, compression=compression)
    except ValueError as e:
        raise UserError(str(e)) from None
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
