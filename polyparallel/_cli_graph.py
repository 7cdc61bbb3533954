"""``polyparallel graph MODEL``: capture a model and show its loop-nest IR."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import polyparallel as pp
from polyparallel.cli import UserError, app
from polyparallel.ir import Graph, Role

MODEL_HELP = ("built-in example (see `polyparallel examples`), an .onnx file, or package.module:function "
              "returning (model, args[, kwargs])")


def parse_dims(dims: list[str] | None) -> dict[str, int]:
    """``["batch=8", "seq=128"]`` -> ``{"batch": 8, "seq": 128}`` (dynamic ONNX dims)."""
    out: dict[str, int] = {}
    for d in dims or []:
        name, sep, val = d.partition("=")
        if not sep or not val.strip().isdigit():
            raise UserError(f"--dim {d!r}: write NAME=INTEGER, e.g. --dim batch=8")
        out[name.strip()] = int(val)
    return out


def capture_model(model: str, batch_size: int | None = None, seq_len: int | None = None,
                  method: str = "auto", dims: dict[str, int] | None = None) -> Graph:
    """Resolve a MODEL argument and capture it (shared by the commands that take a MODEL)."""
    from polyparallel.models import load_model

    loaded = load_model(model, batch_size=batch_size, seq_len=seq_len)
    if isinstance(loaded, Path):
        return pp.capture(loaded, dim_values=dims) if dims else pp.capture(loaded)
    m, args, kwargs = loaded
    return pp.capture(m, args, kwargs, method=method)


def _human(n: float, unit: str = "") -> str:
    for div, suf in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suf}{unit}"
    return f"{n:.0f}{unit}"


def _dims(op: Any) -> str:
    if op.nest is None:
        return "-"
    return " ".join(f"{d.name}{d.extent}{'ʳ' if d.role is Role.REDUCTION else ''}"
                    + (f"·{str(d.hint)[:3]}" if d.hint else "") for d in op.nest.dims)


@app.command("graph")
def graph_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", help="batch of the example inputs")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq", "--seq-len", help="sequence length of LM examples")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole graph as JSON")] = False,
    summary: Annotated[bool, typer.Option("--summary", help="only the totals and the op kinds")] = False,
    limit: Annotated[int, typer.Option("--limit", help="show at most this many ops (0: all)")] = 0,
    method: Annotated[str, typer.Option("--method", help="torch capture: auto, export or fx")] = "auto",
    dim: Annotated[list[str] | None, typer.Option("--dim", help="value of a dynamic ONNX dim, NAME=N")] = None,
) -> None:
    """Capture MODEL and print its graph: ops, kinds, loop dims with roles, shapes, FLOPs, params."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if as_json:
            g = capture_model(model, batch_size, seq_len, method, parse_dims(dim))
        else:
            with console.status(f"capturing {model} ..."):
                g = capture_model(model, batch_size, seq_len, method, parse_dims(dim))
    dt = time.perf_counter() - t0
    if as_json:
        d = g.to_dict()
        d["summary"]["capture_s"] = round(dt, 3)
        typer.echo(json.dumps(d, indent=1))
        return
    s = g.summary()
    if not summary:
        t = Table(title=f"{g.name} ({g.source})", show_lines=False)
        for col in ("op", "kind", "loop dims (ʳ = reduction)", "inputs -> output", "FLOPs", "params"):
            t.add_column(col, overflow="fold")
        ops = g.ops if limit <= 0 else g.ops[:limit]
        for op in ops:
            ins = ", ".join(str(list(g.shape(i))) for i in op.inputs)
            outs = ", ".join(str(list(g.shape(o))) for o in op.outputs)
            params = sum(g.tensors[i].numel for i in set(op.inputs) if g.tensors[i].is_param)
            t.add_row(op.name, str(op.kind), _dims(op), f"{ins} -> {outs}", _human(op.flops),
                      _human(params) if params else "")
        console.print(t)
        if limit and len(g.ops) > limit:
            console.print(f"... {len(g.ops) - limit} more ops (use --limit 0 to see all)")
    kinds = ", ".join(f"{k} {v}" for k, v in s["ops_by_kind"].items())
    console.print(f"[bold]{g.name}[/bold] captured by {g.source} in {dt:.2f} s")
    console.print(f"  ops        {s['ops']} ({kinds})")
    console.print(f"  params     {s['params']:,} ({_human(s['param_bytes'], 'B')})")
    console.print(f"  forward    {_human(s['flops'], 'FLOP')}, {_human(s['bytes'], 'B')} moved")
    if s["opaque"]:
        console.print(f"  [yellow]opaque[/yellow]     {', '.join(s['opaque'])} (replicate-only)")
    if caught:
        console.print(f"  {len(caught)} warning(s) during capture; --json lists them under 'warnings'")


@app.command("examples")
def examples_cmd() -> None:
    """List the built-in example models."""
    from polyparallel.models import EXAMPLES

    t = Table(title="built-in models")
    t.add_column("name")
    t.add_column("description")
    t.add_column("default batch")
    for e in EXAMPLES.values():
        t.add_row(e.name, e.description, str(e.default_batch))
    Console().print(t)
