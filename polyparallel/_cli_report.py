"""``polyparallel report``: a strategy (and a run) as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polyparallel.cli import UserError, app, writable_file
from polyparallel.report import read_run, render
from polyparallel.strategy import Strategy, StrategyError


@app.command("report")
def report_cmd(
    strategy: Annotated[Path, typer.Argument(help="a strategy JSON file (polyparallel search ... -o FILE)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the HTML file to write")] = Path("report.html"),
    run: Annotated[Path | None, typer.Option(
        "--run", help="a run folder to draw measured curves from: the --run-dir of `polyparallel train` or the "
                      "--out of `polyparallel collab`")] = None,
) -> None:
    """Write one HTML page (no network needed): cluster diagram, memory and time per device, the pipeline or
    round timeline, and with --run the measured loss, accuracy and phase times."""
    writable_file(out)
    try:
        s = Strategy.from_json(strategy)
    except StrategyError as e:
        first, *fields = str(e).splitlines()
        detail = f" ({'; '.join(f.strip() for f in fields[:3])})" if fields else ""
        raise UserError(f"{first}{detail}; give a strategy written by `polyparallel search MODEL -o {strategy}`") \
            from None
    records = read_run(run) if run is not None else None
    if run is not None and (run / "strategy.json").is_file():
        ran = Strategy.from_json(run / "strategy.json")
        differs = [f"{k} {getattr(ran, k)} there, {getattr(s, k)} here"
                   for k in ("dp", "tp", "pp", "sp", "microbatches", "global_batch", "zero_stage", "dtype")
                   if getattr(ran, k) != getattr(s, k)]
        if ran.model.fingerprint != s.model.fingerprint:
            differs.insert(0, f"another model ({ran.model.name}, fingerprint {ran.model.fingerprint[:12]})")
        if differs:
            raise UserError(f"--run {run} trained another strategy than {strategy}: {'; '.join(differs[:3])}; give the "
                            "run of this strategy, or its own strategy.json")
    out.write_text(render(s, records))
    typer.echo(f"wrote {out}  (open it in a browser)")
