"""``polyparallel export``: a strategy as another framework's parallel configuration (MindSpore)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polyparallel._cli_search import LAYERS_HELP, SEQ_HELP
from polyparallel.cli import UserError, app
from polyparallel.strategy import Strategy, StrategyError


@app.command("export")
def export_cmd(
    strategy: Annotated[Path, typer.Argument(help="a synchronous strategy JSON (search -o FILE)")],
    to: Annotated[str, typer.Option("--to", help="the framework: mindspore")] = "mindspore",
    out: Annotated[Path, typer.Option("--out", "-o", help="the folder to write (created)")] = Path("mindspore_config"),
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="the model the strategy was searched for (built-in name, .onnx, MODULE:FUNCTION): "
                              "gives the per-op shard strategies and pipeline cells")] = None,
    mindspore_model: Annotated[str | None, typer.Option(
        "--mindspore-model", help="MODULE:FUNCTION returning the same network as a mindspore.nn.Cell: the torch op "
                                  "-> cell map is inferred, checked and the shards set on it")] = None,
    seq: Annotated[int | None, typer.Option("--seq", help=SEQ_HELP)] = None,
    layers: Annotated[int | None, typer.Option("--layers", help=LAYERS_HELP)] = None,
    validate: Annotated[bool, typer.Option("--validate/--no-validate",
                                           help="check the configuration with MindSpore (docs/mindspore.md)")] = True,
) -> None:
    """Write the strategy as MindSpore's parallel configuration: set_auto_parallel_context settings, per-operator
    shard strategies, pipeline stages, and a report of what MindSpore cannot express."""
    from polyparallel.backends.mindspore import TARGETS, export

    if to not in TARGETS:
        raise UserError(f"--to {to!r}: export targets are {', '.join(TARGETS)}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder (it is created)")
    try:
        s = Strategy.from_json(strategy)
    except StrategyError as e:
        raise UserError(f"{str(e).splitlines()[0]}; give a strategy written by `polyparallel search MODEL -o FILE`") \
            from None
    result = export(s, to, out, model=model, mindspore_model=mindspore_model, validate=validate, seq=seq,
                    layers=layers)
    c = result.config
    typer.echo(f"parallel_mode={c['context']['parallel_mode']} device_num={c['context']['device_num']} "
               f"pipeline_stages={c['context'].get('pipeline_stages', 1)}; {len(c['shards'])} shard groups, "
               f"{len(c['unexpressed'])} thing(s) not expressed in MindSpore (see the report)")
    for k, v in (c.get("validation") or {}).items():
        typer.echo(f"  mindspore check {k}: {v}")
    typer.echo(f"wrote {', '.join(str(f) for f in result.files)}")
