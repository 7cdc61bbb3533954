"""``polyparallel cluster show FILE|PRESET`` and ``polyparallel calibrate``."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from polyparallel._cli_progress import Heartbeat
from polyparallel.cli import UserError, app
from polyparallel.cluster import (
    PRESET_NAMES,
    Cluster,
    ClusterSpecError,
    Link,
    default_calibration_path,
    format_bandwidth,
    format_duration,
)
from polyparallel.cluster.spec import catalog
from polyparallel.cost_models.calibrate import calibrate
from polyparallel.cost_models.calibrate_gpu import calibrate_gpu

cluster_app = typer.Typer(help="Inspect cluster specs and presets.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


def _flops(x: float) -> str:
    for div, suf in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if x >= div:
            return f"{x / div:.4g} {suf}"
    return f"{x:.4g} FLOP/s"


def _gb(x: float) -> str:
    return f"{x / 1e9:.4g} GB"


def _link(lk: Link | None) -> str:
    return "-" if lk is None else str(lk)


def load_cluster(spec: str) -> Cluster:
    """Resolve FILE|PRESET for commands (bad input becomes a one-line UserError)."""
    try:
        return Cluster.resolve(spec)
    except ClusterSpecError as e:
        raise UserError(str(e)) from None


def cluster_tree(c: Cluster) -> Tree:
    t = c.totals
    peak = t["peak_flops"]
    root = Tree(f"[bold]{c.name}[/]: {t['centers']} center(s), {t['nodes']} node(s), {t['devices']} device(s), "
                f"{_gb(t['memory_bytes'])}, peak {_flops(peak['bf16'])} bf16 / {_flops(peak['fp32'])} fp32")
    for center in c.centers:
        devs = c.devices_of(center=center.index)
        residency = ("data stays" if not center.data_may_leave else "data may leave") + ", " + (
            "activations stay" if not center.activations_may_leave else "activations may leave")
        ct = root.add(f"[bold cyan]{center.name}[/]{f' ({center.city})' if center.city else ''}: "
                      f"{center.framework}, {len(devs)} devices, {residency}; uplink {_link(center.wan)}")
        groups: dict[tuple[str, str, str], list[int]] = {}
        for n in center.nodes:
            node = c.nodes[n]
            key = (node.device_type.name, _link(node.intra), _link(node.nic))
            groups.setdefault(key, []).append(n)
        for (dtype, intra, nic), nodes in groups.items():
            node = c.nodes[nodes[0]]
            dt = node.device_type
            per = len(node.devices)
            label = f"{len(nodes)} x node" if len(nodes) > 1 else c.nodes[nodes[0]].name
            nt = ct.add(f"{label}: {per} x {dtype}; intra {intra}; network {nic}")
            mem = f"{_gb(dt.memory)} at {format_bandwidth(dt.memory_bandwidth)}"
            nt.add(f"{dtype} ({dt.kind}, {dt.vendor}): " + ", ".join(f"{k} {_flops(v)}" for k, v in dt.peak)
                   + f"; {mem}; floor {format_duration(dt.launch_overhead)}"
                   + (f" — {dt.source}" if dt.source else ""))
    if c.backbone is not None:
        root.add(f"WAN backbone: {c.backbone}")
    if c.pair_latency:
        root.add("pair latencies: " + ", ".join(f"{a}-{b} {format_duration(s)}" for (a, b), s in c.pair_latency))
    return root


_PRESET_EXAMPLES = {"dgx-a100x<N>": "dgx-a100x8", "dgx-h100x<N>": "dgx-h100x8", "dgx-h200x<N>": "dgx-h200x8",
                    "local-cpu:<P>": "local-cpu:4"}


@cluster_app.command("list")
def list_cmd() -> None:
    """List the cluster presets (N nodes, P processes) with what one of each holds."""
    t = Table(title="cluster presets (or give a YAML/JSON spec: polyparallel cluster show FILE)")
    for col in ("preset", "example", "centers", "devices", "device", "peak bf16 / fp32 per device"):
        t.add_column(col)
    for name in PRESET_NAMES:
        example = _PRESET_EXAMPLES.get(name, name)
        c = Cluster.resolve(example)
        kinds = sorted({d.type.name for d in c.devices})
        d = c.devices[0].type
        t.add_row(name, example, str(len(c.centers)), str(c.num_devices), ", ".join(kinds),
                  f"{_flops(d.peak_flops('bf16'))} / {_flops(d.peak_flops('fp32'))}")
    Console(width=None if sys.stdout.isatty() else 140).print(t)


@cluster_app.command("show")
def show_cmd(
    spec: Annotated[str, typer.Argument(help=f"a YAML/JSON cluster spec, or a preset: {', '.join(PRESET_NAMES)}")],
    as_json: Annotated[bool, typer.Option("--json", help="print the cluster as JSON (SI units)")] = False,
) -> None:
    """Print a cluster as a tree (centers, nodes, devices, links) with totals."""
    c = load_cluster(spec)
    if as_json:
        typer.echo(json.dumps(c.to_dict(), indent=1))
        return
    Console().print(cluster_tree(c))


@cluster_app.command("check")
def check_cmd(
    spec: Annotated[str, typer.Argument(help="a YAML/JSON cluster spec (docs/cluster-spec.md), or a preset")],
) -> None:
    """Validate a cluster spec: exit 2 naming the field and the fix, else say what it describes."""
    c = load_cluster(spec)
    t = c.totals
    kinds = ", ".join(f"{n} x {k}" for k, n in t["devices_by_type"].items())
    typer.echo(f"ok: {c.name}: {t['centers']} center(s), {t['nodes']} node(s), {t['devices']} device(s) ({kinds}), "
               f"{_gb(t['memory_bytes'])}, peak {_flops(t['peak_flops']['bf16'])} bf16")
    used = {d.type.name for d in c.devices}
    for name in sorted(used):
        dt = c.device_types[name]
        if "nominal" in dt.source:
            typer.echo(f"note: {name} is priced from nominal rates ({dt.source})")
        elif name in catalog() and dt != catalog()[name]:
            typer.echo(f"note: {name} is defined in the spec and replaces the catalog's type of that name")
    if len(c.centers) > 1 and not c.pair_latency:
        typer.echo("note: no wan.latency between centers: a message between two centers takes the sum of their "
                   "uplinks' latencies")


@contextlib.contextmanager
def _steps(what: str, heartbeat_s: float = 8.0) -> Iterator[Callable[[str], None]]:
    """Each measurement's line on stderr as it ends; on a terminal, under a spinner saying what runs
    and for how long (a calibration takes minutes, its phases have no common unit to count); piped,
    a line every 8 s of silence saying what runs (a group of measuring workers takes minutes)."""
    console = Console(stderr=True)
    t0 = time.monotonic()
    last = ["starting"]
    beat = Heartbeat(console, lambda t: f"  ... {what} ({t:.0f} s; last done: {last[0]})", heartbeat_s)
    with console.status(what) as status, beat if not console.is_terminal else contextlib.nullcontext():
        def say(line: str) -> None:
            last[0] = line
            beat.write(f"  {line}")
            status.update(f"{what} ({time.monotonic() - t0:.0f} s): {line}")
        yield say


@app.command("calibrate")
def calibrate_cmd(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="calibration JSON to write "
                                             "(default: $POLYPARALLEL_CALIBRATION or ~/.cache/polyparallel/)")] = None,
    group_sizes: Annotated[str, typer.Option("--group-sizes", help="gloo group sizes, comma separated")] = "2,3,4",
    timeout: Annotated[float, typer.Option("--timeout", help="seconds before a group of measuring workers is "
                                           "killed (3 rounds on a loaded machine take minutes)")] = 600.0,
    device: Annotated[str, typer.Option("--device", help="cpu: this machine's processes for local-cpu:<P>; cuda: "
                                        "the GPU(s) torch sees (matmul/attention by dtype, HBM, NCCL)")] = "cpu",
) -> None:
    """Measure this machine for `local-cpu:<P>`: matmul throughput, memory bandwidth, kernel and DTensor
    floors with 1..P processes at once (one thread each, as the torch backend runs them), gloo all-reduce.
    With --device cuda: the GPU, for a cluster spec's `device_types: {NAME: {calibration: FILE}}`."""
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: choose cpu or cuda")
    if device == "cuda":
        if out is None:
            raise UserError("--device cuda needs --out FILE (a GPU calibration is referenced from a cluster spec)")
        try:
            with _steps("calibrating the GPU") as say:
                calibrate_gpu(out, timeout=timeout, progress=say)
        except RuntimeError as e:
            raise UserError(str(e)) from None
        typer.echo(f"wrote {out}")
        return

    try:
        sizes = tuple(int(x) for x in group_sizes.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--group-sizes {group_sizes!r}: give integers like 2,3,4") from None
    if not sizes or any(p < 2 or p > 64 for p in sizes):
        raise UserError(f"--group-sizes {group_sizes!r}: each group size must be between 2 and 64")
    if timeout <= 0:
        raise UserError("--timeout must be > 0 seconds")
    path = out or default_calibration_path()
    if path.exists() and path.is_dir():
        raise UserError(f"--out {path} is a directory: give a file name such as {path / 'calibration.json'}")
    with _steps(f"calibrating local-cpu with {', '.join(map(str, sizes))} processes") as say:
        res = calibrate(path, group_sizes=sizes, timeout=timeout, progress=say)
    fit = res["collectives"].get("fit")
    msg = f"wrote {path}"
    if fit:
        msg += f" (gloo alpha {fit['alpha'] * 1e6:.0f} us, bandwidth {fit['bandwidth'] / 1e9:.2f} GB/s)"
    typer.echo(msg)
    for w in res.get("warnings", ()):
        typer.secho(f"warning: {w}", fg=typer.colors.YELLOW, err=True)
