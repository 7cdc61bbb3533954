"""Collaborative-training commands: ``collab`` (a whole federation here), ``serve`` and ``center``.

``polyparallel collab`` runs the server and every center on this machine (in-process, or Flower
processes on 127.0.0.1). ``polyparallel serve`` and ``polyparallel center`` start the two sides of a
real deployment on different machines: the server reads a job file (``collab --save-config``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from polyparallel._cli_progress import LineProgress
from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, collaborate, config_from_strategy
from polyparallel.backends.collab._center_plan import scaled_plan
from polyparallel.backends.collab._flower import FlowerError, LoopbackFederation, read_outputs
from polyparallel.backends.collab._foreign import import_frameworks
from polyparallel.backends.collab._models import FOREIGN_FRAMEWORKS, build_torch_model, is_reference, resolve_reference
from polyparallel.backends.collab._pruning import PruneError, PruneSpec, with_input_of
from polyparallel.backends.collab._release import check_release_dir, write_release
from polyparallel.backends.collab._security import (
    Credentials,
    check_node_credentials,
    load_credentials,
    make_credentials,
)
from polyparallel.cli import UserError, app
from polyparallel.cluster.units import parse_quantity
from polyparallel.strategy import Strategy

_FW_HELP = ("framework per center, comma separated (torch, mindspore, paddle, tensorflow); default all torch. Several "
            "in one process are imported in the one order they share it: torch, mindspore, paddle, tensorflow")


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise UserError(f"--in-shape {text!r}: give integers separated by commas, e.g. 1,28,28") from None


def _parse_builders(items: list[str]) -> dict[str, str]:
    """``--builder FRAMEWORK=MODULE:FUNCTION`` (and ``--mindspore-model``) → framework → reference."""
    out: dict[str, str] = {}
    for it in items:
        fw, sep, ref = (x.strip() for x in it.partition("="))
        if not sep or fw not in FOREIGN_FRAMEWORKS or ":" not in ref:
            raise UserError(f"--builder {it!r}: use FRAMEWORK=MODULE:FUNCTION with FRAMEWORK one of "
                            f"{', '.join(FOREIGN_FRAMEWORKS)} (the torch model is --model)")
        if out.get(fw, ref) != ref:
            raise UserError(f"two builders for {fw}: {out[fw]!r} and {ref!r} (--builder / --mindspore-model)")
        out[fw] = ref
    return out


def _parse_options(items: list[str]) -> dict[str, float]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        try:
            if not sep:
                raise ValueError
            out[k.strip()] = float(v)
        except ValueError:
            raise UserError(f"--fusion-opt {it!r}: use NAME=NUMBER, e.g. mu=0.01") from None
    return out


def _parse_links(items: list[str], names: list[str]) -> dict[str, tuple[float, float, float]]:
    """``--link [NAME=]DOWN[,UP[,LATENCY]]`` → center → (down B/s, up B/s, latency s); no NAME: every center."""
    out: dict[str, tuple[float, float, float]] = {}
    for it in items:
        who, sep, spec = it.rpartition("=") if "=" in it.split(",")[0] else ("", "", it)
        if sep and who not in names:
            raise UserError(f"--link {it!r}: no center {who!r} in {names}")
        parts = [p.strip() for p in spec.split(",")]
        try:
            if not 1 <= len(parts) <= 3:
                raise ValueError
            down = parse_quantity(parts[0], "bandwidth")
            up = parse_quantity(parts[1], "bandwidth") if len(parts) > 1 else down
            lat = parse_quantity(parts[2], "time") if len(parts) > 2 else 0.0
            if not (down > 0 and up > 0 and lat >= 0):
                raise ValueError
        except ValueError:
            raise UserError(f"--link {it!r}: use [CENTER=]DOWN[,UP[,LATENCY]] with units, e.g. "
                            "'a=5 MB/s,2 MB/s,20 ms' (no CENTER: every center)") from None
        for n in [who] if sep else names:
            out[n] = (down, up, lat)
    return out


def _arrays(z: Any) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of an .npz as training takes them: float64 inputs as float32, integer labels as int64
    (class indices, token ids and -100), integer inputs (token ids) kept."""
    x, y = z["x"], z["y"]
    return (x.astype(np.float32) if x.dtype == np.float64 else x,
            y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32))


def _load_npz(p: Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    if not p.exists():
        raise UserError(f"{what}: expected {p} holding arrays x and y")
    with np.load(p) as z:
        if "x" not in z.files or "y" not in z.files:
            raise UserError(f"{p}: needs arrays named x and y, found {z.files}")
        return _arrays(z)


def _load_data(config: Any, data_dir: Path | None, synthetic: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    names = [c.name for c in config.centers if not c.data]  # a center with a data source loads its own
    if not names:
        return {}
    if data_dir is not None:
        if data_dir.is_file():
            raise UserError(f"--data {data_dir} is a file: give the folder holding one CENTER.npz per center "
                            f"({', '.join(f'{n}.npz' for n in names)}), or MODULE:FUNCTION")
        return {n: _load_npz(data_dir / f"{n}.npz", f"no data for center {n!r}") for n in names}
    spec = config.model
    if spec.user:
        raise UserError(f"model {spec.kind!r} needs real data: give --data DIR (CENTER.npz with x, y) or "
                        "--data MODULE:FUNCTION (called with each center's name, returns x, y)")
    # synthetic, for demos: one random prototype per class, each example its class's prototype plus
    # noise of the prototype's scale, inputs shifted per center (a mild non-IID); every model kind
    # learns it within a few rounds, so a demo shows the loss fall and accuracy rise above chance
    rng = np.random.default_rng(config.seed)
    protos = 0.5 * rng.normal(size=(spec.num_classes, *spec.in_shape))
    out = {}
    for i, n in enumerate(names):
        if spec.kind == "embbag":
            x = rng.integers(0, spec.vocab, size=(synthetic, *spec.in_shape)).astype(np.float32)
            y = (x.sum(1) % spec.num_classes).astype(np.int64)
        else:
            y = rng.integers(0, spec.num_classes, size=synthetic).astype(np.int64)
            x = (protos[y] + 0.5 * rng.normal(loc=0.1 * i, size=(synthetic, *spec.in_shape))).astype(np.float32)
        out[n] = (x, y)
    return out


def _exit_on_sigterm() -> None:
    # SIGTERM (a scheduler, `timeout`, `kill`) must unwind through the `with` that stops Flower's processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _eval_text(ev: Any) -> str:
    parts = [f"{k} {ev[k]:.4f}" for k in ("loss", "accuracy", "perplexity") if k in ev]
    return " ".join(p.replace("accuracy", "acc").replace("perplexity", "ppl") for p in parts) or "-"


def _progress(progress: LineProgress, after: int = 0) -> Any:
    """One line per round as it ends (round, accepted centers, losses, seconds) with the time left; the
    rounds up to ``after`` (a resumed server's, recorded by its predecessor) are not shown again."""
    def show(r: Any) -> None:
        if r.round <= after:
            return
        train = f"train loss {r.train_loss:.4f}" if r.train_loss is not None else "no update"
        missing = ",".join([*r.rejected, *r.missing])
        progress.line(f"round {r.round}/{progress.total}  accepted {','.join(r.accepted) or '-'}"
                      f"{f'  rejected/missing {missing}' if missing else ''}  {train}  eval {_eval_text(r.eval)}  "
                      f"{r.seconds:.2f} s{_comm_text(r)}", done=r.round)
    return show


def _comm_text(r: Any) -> str:
    """Overlapped rounds: the centers' mean communication time, exposed (waited for) and hidden behind steps."""
    m = [v for v in r.metrics.values() if "exposed_s" in v and "comm_s" in v]
    if not m or r.round == 1:
        return ""
    exposed, comm = (sum(v[k] for v in m) / len(m) for k in ("exposed_s", "comm_s"))
    return f"  comm exposed {exposed:.2f} s hidden {max(0.0, comm - exposed):.2f} s"


def _round_table(result: Any) -> Table:
    t = Table(title="rounds")
    for col in ("round", "fused", "accepted", "rejected/missing", "bytes up", "bytes down", "eval", "s"):
        t.add_column(col)
    for r in result.rounds:
        t.add_row(str(r.round), "yes" if r.fused else "no", ",".join(r.accepted),
                  ",".join([*r.rejected, *r.missing]) or "-", str(sum(r.bytes_up.values())), str(r.bytes_down),
                  _eval_text(r.eval), f"{r.seconds:.2f}")
    return t


def _flagged_lines(result: Any) -> list[str]:
    """One line per center flagged in some round (refused, no trust, against the fused step): the audit's summary."""
    return [f"flagged: {c} in {len(f['rounds'])} of {len(result.rounds)} rounds "
            f"({','.join(map(str, f['rounds']))}): {f['why'][-1]}" for c, f in result.flagged().items()]


def _data_option(data: str | None) -> tuple[Path | None, str]:
    """``--data``: a directory of CENTER.npz, or a MODULE:FUNCTION data source."""
    if data is None:
        return None, ""
    if is_reference(data) and not Path(data).exists():
        return None, data
    return Path(data), ""


#: the longer help texts of ``collab``'s options
_HELP = {
    "norm_bound": "refuse an update whose norm exceeds K x the median norm of the round's and recent rounds' updates",
    "max_abs_update": "refuse an update with a coordinate larger than this (int8: checked on the scales, before "
                      "decoding)",
    "step_bound": "keep the old model when the fused step exceeds this x the median recent step (0: only finiteness)",
    "link": "emulate a WAN link: [CENTER=]DOWN[,UP[,LATENCY]], e.g. 'a=5 MB/s,2 MB/s,20 ms' (no CENTER: every center); "
            "the center holds its download and upload to it (loopback is otherwise ~GB/s). Repeatable",
    "root_data": ".npz (x, y): the server's own small root set, never a center's rows; the fusion is then fltrust "
                 "unless --fusion says otherwise",
    "prune": "prune RATIO (0..1) of the model's parameters while training (whole channels, Torch-Pruning's "
             "DepGraph); --prune-target channels: of every channel group's channels",
    "rounds": "K: soft masks in rounds 1..K, the structural cut after K (default rounds // 6)",
    "score": "channel importance on each center's rows: magnitude, taylor or fisher",
    "target": "what --prune RATIO is a share of: params or channels",
    "allocation": "uniform (each group loses the same share) or global (one ranking across the groups); default: "
                  "PruneSpec's",
    "heads": "what an attention module (a head count attribute such as num_heads) loses: dims (the same "
             "dimensions of every head) or whole heads",
    "distill": "with --prune: distillation weight A in [0, 1) of the fine-tuning rounds after the cut, each "
               "center's teacher the fused model at the cut, on its own rows (torch centers; 0: off)",
    "release": "with --prune: write model.pt2, model.onnx and release.json here",
    "force": "overwrite the release files in an existing --release",
    "devices": "devices per center, comma separated (torch and MindSpore centers with > 1 train data parallel)",
    "builder": ("for a MODULE:FUNCTION --model on centers of another framework: FRAMEWORK=MODULE:FUNCTION "
                "returning the same architecture there (mindspore: an nn.Cell, paddle: a paddle.nn.Layer, "
                "tensorflow: a keras.Model); the parameter map is inferred and checked before round 1. Repeatable"),
    "loss": ("auto (the model's own loss if its forward takes labels, else cross_entropy), model, cross_entropy "
             "(over the last dim, -100 ignored) or mse"),
    "min_cosine": ("refuse an update whose cosine to the median of the others is below this (3+ updates; -1: off, "
                   "the default: under label skew it refuses honest centers)"),
    "samples": ("each center's training sample count, comma separated, declared at enrolment: the server weights "
                "with it and refuses a reply claiming another (default: the first claim, capped)"),
    "holdout": ("fraction of each center's rows kept out of training; the centers evaluate every fused model on "
                "them (used when --eval-data is not given)"),
    "overlap": ("K: each center takes K local steps of the next round while its update travels and the server "
                "fuses, then merges the fused model (0: synchronous rounds; K <= H; default: a --strategy's, else 0; "
                "in-process, or --engine flower --data-channel socket)"),
    "buffer": ("K: asynchronous buffered rounds, the server fuses the first K updates in, stale ones weighted by "
               "staleness (0: synchronous rounds; default: a --strategy's, else 0; in-process, or --engine flower "
               "--data-channel socket)"),
    "data_channel": ("with --engine flower: flower (every round's arrays in Flower messages) or socket (Flower enrols "
                     "the centers, one TCP connection per center carries the rounds; plain TCP)"),
    "data": ("directory with CENTER.npz (x, y) per center, or MODULE:FUNCTION called at each center with its "
             "name, returning its (x, y)"),
    "emulate_wan": ("with --strategy: every center emulates its WAN link of the strategy's cluster (the figures "
                    "`polyparallel simulate` prices)"),
    "scale_devices": ("with --strategy: run each center on at most N of its devices (its plan's dp shrinks; tp/pp/sp "
                      "kept), to try a big plan on this machine"),
}


@app.command("collab")
def collab_cmd(
    centers: Annotated[str, typer.Option("--centers", help="center names, comma separated")] = "a,b,c",
    frameworks: Annotated[str, typer.Option("--frameworks", help=_FW_HELP)] = "",
    devices: Annotated[str, typer.Option("--devices", help=_HELP["devices"])] = "",
    model: Annotated[str, typer.Option(
        "--model", help="mlp, cnn, embbag, or your model as MODULE:FUNCTION (returns an nn.Module)")] = "mlp",
    builder: Annotated[list[str] | None, typer.Option("--builder", help=_HELP["builder"])] = None,
    mindspore_model: Annotated[str, typer.Option(
        "--mindspore-model", help="the same as --builder mindspore=MODULE:FUNCTION")] = "",
    loss: Annotated[str, typer.Option("--loss", help=_HELP["loss"])] = "auto",
    norm: Annotated[str, typer.Option("--norm", help="the built-in cnn's normalisation: batch or group")]
    = "batch",
    in_shape: Annotated[str, typer.Option("--in-shape", help="one example's shape, e.g. 1,28,28")] = "16",
    classes: Annotated[int, typer.Option("--classes")] = 4,
    hidden: Annotated[int, typer.Option("--hidden", help="width / first conv channels / embedding size")] = 32,
    vocab: Annotated[int, typer.Option("--vocab", help="embbag vocabulary")] = 0,
    fusion: Annotated[str | None, typer.Option("--fusion", help="centered_clip (robust FedAvg, the default) fedavg "
                                               "fedprox fedadam fedyogi diloco scaffold trimmed_mean median krum "
                                               "fltrust (with --root-data) flame foolsgold")]
    = None,
    fusion_opt: Annotated[list[str] | None, typer.Option("--fusion-opt", help="NAME=NUMBER, repeatable")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="rounds of fusion (default 3)")] = None,
    local_steps: Annotated[int | None, typer.Option("--local-steps", "-H", help="local steps per round (default 10)")]
    = None,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 32,
    lr: Annotated[float, typer.Option("--lr")] = 0.05,
    momentum: Annotated[float, typer.Option("--momentum", help="local SGD momentum (fresh each round)")] = 0.0,
    lr_schedule: Annotated[str, typer.Option("--lr-schedule", help="constant, or cosine decay per round")]
    = "constant",
    logit_adjust: Annotated[float, typer.Option(
        "--logit-adjust", help="tau of the logit-adjusted local loss against label skew (0: plain; 1: theory)")]
    = 0.0,
    compression: Annotated[str | None, typer.Option("--compression", help="none (the default), fp16 or int8")] = None,
    min_centers: Annotated[int, typer.Option("--min-centers", help="0: all")] = 0,
    norm_bound: Annotated[float, typer.Option("--norm-bound", help=_HELP["norm_bound"])] = 4.0,
    no_norm_bound: Annotated[bool, typer.Option("--no-norm-bound", help="no norm bound (--norm-bound 0)")] = False,
    max_abs_update: Annotated[float, typer.Option("--max-abs-update", help=_HELP["max_abs_update"])] = 1e4,
    step_bound: Annotated[float, typer.Option("--step-bound", help=_HELP["step_bound"])] = 10.0,
    min_cosine: Annotated[float, typer.Option("--min-cosine", help=_HELP["min_cosine"])] = -1.0,
    samples: Annotated[str | None, typer.Option("--samples", help=_HELP["samples"])] = None,
    round_timeout: Annotated[float, typer.Option(
        "--round-timeout", help="seconds the server waits for a round's updates (Flower)")] = 600.0,
    holdout: Annotated[float, typer.Option("--holdout", help=_HELP["holdout"])] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    overlap: Annotated[int | None, typer.Option("--overlap", help=_HELP["overlap"])] = None,
    buffer: Annotated[int | None, typer.Option("--buffer", help=_HELP["buffer"])] = None,
    max_staleness: Annotated[int | None, typer.Option(
        "--max-staleness", help="with --buffer: refuse updates trained from a model more versions old (default: a "
                                "--strategy's, else 4)")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="job JSON (overrides the options above)")] = None,
    strategy: Annotated[Path | None, typer.Option(
        "--strategy", help="collaborative Strategy JSON: centers, fusion, H, rounds, compression from it")] = None,
    save_config: Annotated[Path | None, typer.Option("--save-config", help="write the job JSON and exit")] = None,
    engine: Annotated[str, typer.Option("--engine", help="inprocess or flower (processes on 127.0.0.1)")]
    = "inprocess",
    data_channel: Annotated[str, typer.Option("--data-channel", help=_HELP["data_channel"])] = "flower",
    data: Annotated[str | None, typer.Option("--data", help=_HELP["data"])] = None,
    eval_data: Annotated[Path | None, typer.Option(
        "--eval-data", help=".npz (x, y) the server evaluates every fused model on")] = None,
    root_data: Annotated[Path | None, typer.Option("--root-data", help=_HELP["root_data"])] = None,
    synthetic: Annotated[int, typer.Option("--synthetic", help="samples per center when --data is not given")] = 256,
    out: Annotated[Path | None, typer.Option("--out", help="write result.json, final.npz, timing.jsonl here")]
    = None,
    link: Annotated[list[str] | None, typer.Option("--link", help=_HELP["link"])] = None,
    emulate_wan: Annotated[bool, typer.Option("--emulate-wan", help=_HELP["emulate_wan"])] = False,
    scale_devices: Annotated[int | None, typer.Option("--scale-devices", help=_HELP["scale_devices"])] = None,
    prune: Annotated[float | None, typer.Option("--prune", help=_HELP["prune"])] = None,
    prune_rounds: Annotated[int | None, typer.Option("--prune-rounds", help=_HELP["rounds"])] = None,
    prune_score: Annotated[str, typer.Option("--prune-score", help=_HELP["score"])] = "fisher",
    prune_target: Annotated[str, typer.Option("--prune-target", help=_HELP["target"])] = "params",
    prune_allocation: Annotated[str | None, typer.Option("--prune-allocation", help=_HELP["allocation"])]
    = None,
    prune_heads: Annotated[str, typer.Option("--prune-heads", help=_HELP["heads"])] = "dims",
    prune_distill: Annotated[float, typer.Option("--prune-distill", help=_HELP["distill"])] = 0.0,
    prune_distill_temperature: Annotated[float | None, typer.Option(
        "--prune-distill-temperature", help="T of --prune-distill (default: PruneSpec's)")] = None,
    release: Annotated[Path | None, typer.Option("--release", help=_HELP["release"])] = None,
    force: Annotated[bool, typer.Option("--force", help=_HELP["force"])] = False,
) -> None:
    """Run a whole federation on this machine: every center trains on its own data, the server fuses."""
    data_dir, source = _data_option(data)
    # what the options set beside the centers, fusion, H, rounds and compression (a Strategy fixes those)
    training = dict(batch_size=batch_size, lr=lr, momentum=momentum, lr_schedule=lr_schedule,
                    logit_adjust=logit_adjust, min_centers=min_centers, seed=seed, round_timeout_s=round_timeout,
                    holdout=holdout, norm_bound=0.0 if no_norm_bound else norm_bound, max_abs_update=max_abs_update,
                    step_bound=step_bound, min_cosine=min_cosine,
                    # unset: a Strategy's, else CollabConfig's (synchronous rounds)
                    **{k: v for k, v in (("overlap", overlap), ("buffer", buffer), ("max_staleness", max_staleness))
                       if v is not None})
    fixed = dict(rounds=rounds, local_steps=local_steps, fusion=fusion, compression=compression)  # or the Strategy's
    with _user_errors(ValueError, KeyError, json.JSONDecodeError):
        builders = _parse_builders([*(builder or []), *([f"mindspore={mindspore_model}"] if mindspore_model else [])])
        if builders and ":" not in model:
            raise UserError(f"--builder is for your own --model MODULE:FUNCTION; the built-in {model!r} has its model "
                            "in every framework already")
        spec = (ModelSpec(model, loss=loss, builders=builders) if ":" in model else
                ModelSpec(model, _parse_shape(in_shape), classes, hidden=hidden, vocab=vocab, norm=norm, loss=loss))
        cfg = _job_config(config, strategy, (centers, frameworks, devices), spec, training, fixed, fusion_opt or [],
                          emulate_wan, root_data is not None)
        cfg = _center_options(cfg, source, link or [], samples, emulate_wan and strategy is None)
        if scale_devices is not None:
            cfg = _scaled(cfg, scale_devices, strategy is not None)
        cfg = _prune_options(cfg, prune, prune_rounds, (prune_score, prune_target, prune_allocation, prune_heads),
                             release, force, eval_data, (prune_distill, prune_distill_temperature))
    if save_config is not None:
        if cfg.prune is not None:  # a deployment's server reads no row: the job file names the input's shape
            cfg = _with_pruning_input(cfg, eval_data, data_dir)
        save_config.write_text(cfg.to_json() + "\n")
        typer.echo(f"wrote {save_config}")
        return
    _run_federation(cfg, engine, data_dir, synthetic, eval_data, root_data, out, lr=lr, momentum=momentum,
                    release=release, force=force, data_channel=data_channel)


def _with_pruning_input(cfg: Any, eval_data: Path | None, data_dir: Path | None) -> Any:
    """``cfg`` whose pruning spec names one input row's shape and dtype, which ``serve``'s server traces
    the model on: those of --eval-data's rows, else of a center's file under --data, else a built-in
    model's ``in_shape``."""
    rows = None
    files = sorted(data_dir.glob("*.npz")) if data_dir is not None and data_dir.is_dir() else []
    if eval_data is not None or files:
        rows = _load_npz(eval_data or files[0], "--eval-data" if eval_data else "--data")[0][:1]
    elif not cfg.model.user and not cfg.prune.input_shape:
        rows = np.zeros((1, *cfg.model.in_shape), np.float32)
    with _user_errors(PruneError):
        return with_input_of(cfg, rows, f"the rows of {eval_data or (files[0] if files else '--in-shape')}")


def _job_config(config: Path | None, strategy: Path | None, options: tuple[str, str, str], spec: Any,
                training: dict[str, Any], fixed: dict[str, Any], fusion_opt: list[str], emulate_wan: bool,
                root_set: bool) -> Any:
    """The job: a saved configuration, a collaborative Strategy's, or the one ``--centers``,
    ``--frameworks`` and ``--devices`` (``options``) describe."""
    if config is not None:
        try:
            return CollabConfig.from_json(config.read_text())
        except ValueError as e:
            raise UserError(f"{config}: not a collab job file: {e}") from None
    if strategy is not None:
        return _strategy_config(strategy, spec, training, fixed, fusion_opt, emulate_wan)
    return _options_config(*options, spec, training, fixed, fusion_opt, root_set=root_set)


def _prune_options(cfg: Any, ratio: float | None, rounds: int | None, how: tuple[str, str, str | None, str],
                   release: Path | None, force: bool, eval_data: Path | None,
                   distill: tuple[float, float | None] = (0.0, None)) -> Any:
    """``cfg`` with the pruning the options ask for; a release directory is refused here, before training.
    ``distill``: ``(A, T)`` of ``--prune-distill`` and its temperature (None: PruneSpec's)."""
    if ratio is None:  # a --config job file may carry the pruning already: its --release is checked as well
        if rounds is not None or distill != (0.0, None) or (release is not None and cfg.prune is None):
            kept = "" if cfg.prune is None else " (the job file's pruning is used as it is)"
            raise UserError("--prune-rounds, --prune-distill, --prune-distill-temperature and --release go with "
                            "--prune RATIO" + kept)
        if release is not None:
            _check_release(release, force, eval_data)
        return cfg
    score, target, allocation, heads = how
    spec = PruneSpec(ratio, max(1, cfg.rounds // 6) if rounds is None else rounds, score, target=target, heads=heads,
                     distill=distill[0], **({} if allocation is None else {"allocation": allocation}),
                     **({} if distill[1] is None else {"distill_temperature": distill[1]}))
    if release is not None:
        _check_release(release, force, eval_data)
    return replace(cfg, prune=spec)


def _check_release(release: Path, force: bool, eval_data: Path | None) -> None:
    """Refuse a --release that cannot be written, before training."""
    if eval_data is None:
        raise UserError("--release measures accuracy before and after the cut on --eval-data FILE.npz: give it")
    with _user_errors(PruneError):
        check_release_dir(release, force)


@contextlib.contextmanager
def _user_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """Report an error of ``kinds`` raised in the block as the user's (one line, exit status 2)."""
    try:
        yield
    except kinds as e:
        raise UserError(str(e)) from None


def _strategy_config(strategy: Path, spec: Any, training: dict[str, Any], fixed: dict[str, Any],
                     fusion_opt: list[str], emulate_wan: bool) -> Any:
    """The job of a collaborative Strategy: a flag of ``fixed`` given beside it wins over the
    strategy's value, and says so; a strategy priced for accelerators says so before round 1."""
    st = Strategy.from_json(strategy)
    cfg = config_from_strategy(st, spec, emulate_links=emulate_wan,
                               fusion_options=_parse_options(fusion_opt), **training)
    given = {k: v for k, v in fixed.items() if v is not None}
    for k, v in given.items():
        if getattr(cfg, k) != v:
            typer.echo(f"--{k.replace('_', '-')} {v} replaces the strategy's {getattr(cfg, k)}")
    line = _priced_elsewhere(st, "local_steps" in given)
    if line:
        typer.echo(line)
    return replace(cfg, **given)


def _scaled(cfg: Any, max_devices: int, from_strategy: bool) -> Any:
    """``cfg`` with every center on at most ``max_devices`` devices (:func:`scaled_plan`), said per center."""
    if not from_strategy or max_devices < 1:
        raise UserError("--scale-devices N (N >= 1) scales the centers of --strategy: give --strategy")
    centers = []
    for c in cfg.centers:
        devices, plan = scaled_plan(dict(c.plan), c.devices, max_devices, c.name)
        if devices != c.devices:
            typer.echo(f"center {c.name} ({c.framework}): {c.devices} devices -> {devices} (dp={plan.get('dp')})")
        centers.append(replace(c, devices=devices, plan=tuple(sorted(plan.items()))))
    return replace(cfg, centers=tuple(centers))


def _priced_elsewhere(st: Any, local_steps_given: bool) -> str:
    """One line when the strategy's centers were priced on accelerators: this command trains every
    center on this machine's CPUs, where the strategy's rounds (H local steps each) take longer."""
    types = st.cluster.get("device_types", {})
    used = {n["device_type"] for c in st.cluster.get("centers", []) for n in c.get("nodes", [])
            if c["name"] in {cp.name for cp in st.collaborative.centers}}
    accel = sorted(t for t in used if types.get(t, {}).get("kind", "cpu") != "cpu")
    if not accel:
        return ""
    c = st.collaborative
    return (f"note: this strategy was priced for centers of {', '.join(accel)}, where a round of {c.local_steps} "
            f"local steps takes {c.round_time_s:.3g} s; here every center trains on this machine's CPUs, so a round "
            "takes longer" + ("" if local_steps_given else " (--local-steps sets fewer steps per round)"))


def _options_config(centers: str, frameworks: str, devices: str, spec: Any, training: dict[str, Any],
                    fixed: dict[str, Any], fusion_opt: list[str], root_set: bool) -> Any:
    """The job the options describe: one center per name, their frameworks and devices."""
    names = [n.strip() for n in centers.split(",") if n.strip()]
    fws = [f.strip() for f in frameworks.split(",")] if frameworks else ["torch"] * len(names)
    if len(fws) != len(names):
        raise UserError(f"--frameworks has {len(fws)} entries for {len(names)} centers")
    devs = [int(d) for d in devices.split(",")] if devices else [1] * len(names)
    if len(devs) != len(names):
        raise UserError(f"--devices has {len(devs)} entries for {len(names)} centers")
    return CollabConfig(
        centers=tuple(CenterSpec(n, framework=f, devices=d) for n, f, d in zip(names, fws, devs)),
        # with a root set the server judges direction itself: FLTrust (collab_attacks.py --part bn)
        model=spec, fusion=fixed["fusion"] or ("fltrust" if root_set else "centered_clip"),
        fusion_options=_parse_options(fusion_opt),
        rounds=3 if fixed["rounds"] is None else fixed["rounds"],
        local_steps=10 if fixed["local_steps"] is None else fixed["local_steps"],
        compression=fixed["compression"] or "none", **training)


def _center_options(cfg: Any, source: str, link: list[str], samples: str | None, wan_without_strategy: bool) -> Any:
    """``cfg`` with what the options say of every center: its data source, WAN link and sample count."""
    if source:  # every center calls the source itself; only the reference goes in the job
        cfg = replace(cfg, centers=tuple(replace(c, data=source) for c in cfg.centers))
    if wan_without_strategy:
        raise UserError("--emulate-wan reads the links from --strategy's cluster: give --strategy, or --link")
    if link:
        links = _parse_links(link, [c.name for c in cfg.centers])
        cfg = replace(cfg, centers=tuple(replace(c, **dict(zip(("down_Bps", "up_Bps", "latency_s"), links[c.name])))
                                         if c.name in links else c for c in cfg.centers))
    if samples:  # enrolment: the server weights each center with its declared count
        counts = [int(n) for n in samples.split(",")]
        if len(counts) != len(cfg.centers):
            raise UserError(f"--samples has {len(counts)} entries for {len(cfg.centers)} centers")
        cfg = replace(cfg, centers=tuple(replace(c, samples=n) for c, n in zip(cfg.centers, counts)))
    return cfg


def _server_sets(cfg: Any, eval_data: Path | None, root_data: Path | None) -> tuple[Any, dict[str, Any]]:
    """The server's evaluation set (or None) and, in ``collaborate``'s keywords, its root set."""
    ev = _load_npz(eval_data, "--eval-data") if eval_data is not None else None
    kw: dict[str, Any] = {}
    if root_data is not None:
        kw["root_data"] = _load_npz(root_data, "--root-data")
    elif cfg.make_fusion().needs_root:
        raise UserError(f"--fusion {cfg.fusion}: give --root-data FILE.npz, a small labelled set the server holds "
                        "(never a center's training rows)")
    return ev, kw


def _centers_data(cfg: Any, data_dir: Path | None, synthetic: int,
                  inprocess: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The centers' data, their user code (model, other frameworks' builders, data sources) checked first here:
    the centers import it themselves, and an error here is one line."""
    with _user_errors(ValueError, TypeError):
        if cfg.model.user:
            build_torch_model(cfg.model)
        foreign = {c.framework for c in cfg.centers} - {"torch"}
        if inprocess:  # one process: its frameworks in the order they share it, before any user module imports one
            import_frameworks(foreign)
        for fw in sorted(foreign) if inprocess else ():  # a Flower center checks its own builder, in its process
            if cfg.model.builder_for(fw):
                resolve_reference(cfg.model.builder_for(fw), f"{fw} model")
        for c in cfg.centers:
            if c.data:
                resolve_reference(c.data, "data source")
        return _load_data(cfg, data_dir, synthetic)


def _run_federation(cfg: Any, engine: str, data_dir: Path | None, synthetic: int, eval_data: Path | None,
                    root_data: Path | None, out: Path | None, *, lr: float, momentum: float,
                    release: Path | None = None, force: bool = False, data_channel: str = "flower") -> None:
    """Check the run's inputs, run the federation on ``engine``, print (and with ``out`` write) the result."""
    if data_channel not in ("flower", "socket") or (data_channel == "socket" and engine != "flower"):
        raise UserError(f"--data-channel {data_channel!r}: use flower or socket, the latter with --engine flower")

    if engine not in ("inprocess", "flower"):
        raise UserError(f"--engine {engine!r}: use inprocess or flower")
    if not (np.isfinite(lr) and lr > 0) or not (np.isfinite(momentum) and 0 <= momentum < 1):
        raise UserError(f"--lr {lr} --momentum {momentum}: the learning rate must be a positive finite number "
                        "(e.g. 0.05) and the momentum in [0, 1)")
    ev, kw = _server_sets(cfg, eval_data, root_data)
    d = _centers_data(cfg, data_dir, synthetic, inprocess=engine == "inprocess")
    rows = next(iter(d.values()), None)  # a center's (x, y): the server's sets must have its features
    for flag, arrays in (("--eval-data", ev), ("--root-data", kw.get("root_data"))):
        if arrays is not None and rows is not None and tuple(arrays[0].shape[1:]) != tuple(rows[0].shape[1:]):
            raise UserError(f"{flag}: its rows x have shape {tuple(arrays[0].shape[1:])}, the centers' "
                            f"{tuple(rows[0].shape[1:])}; give rows with the same features as the centers' data")
    if ev is None and not cfg.holdout:
        typer.echo("no evaluation: give --eval-data FILE.npz, or --holdout FRACTION for the centers' held-out rows")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if engine == "inprocess":
            kw["timing_path"] = out / "timing.jsonl"
        else:
            kw["workdir"] = out / "flower"
    if engine == "flower":
        kw["data_channel"] = data_channel
    t0 = time.time()
    # a ValueError here: e.g. a data source returning the wrong thing, found at the center
    with _user_errors(ValueError), LineProgress(cfg.rounds, "rounds") as progress:
        result = collaborate(cfg, d, engine=engine, eval_data=ev, on_round=_progress(progress), **kw)
    typer.echo(f"{cfg.rounds} rounds in {time.time() - t0:.1f} s")
    _print_result(result, out)
    if release is not None and ev is not None:
        _write_release(release, cfg, result, ev, force)


def _write_release(release: Path, cfg: Any, result: Any, ev: Any, force: bool) -> None:
    """The pruned model's release files and one line of its numbers."""
    with _user_errors(ValueError):
        rel = write_release(release, cfg, result.params, result.pruning or {}, ev, force=force)
    acc = " ".join(f"{k.removeprefix('accuracy_')} {rel[k]:.4f}" for k in ("accuracy_before", "accuracy_at_cut",
                                                                           "accuracy_after") if rel[k] is not None)
    typer.echo(f"release {release}: params {rel['params_before']} -> {rel['params_after']}, FLOPs "
               f"{rel['flops_before']} -> {rel['flops_after']}, accuracy {acc}, latency b32 "
               f"{rel['latency_s']['before']['32'] * 1e3:.3g} -> {rel['latency_s']['after']['32'] * 1e3:.3g} ms, "
               f"onnxruntime max |diff| {rel['onnx_check']['max_abs_diff']:.2g}")


def _print_result(result: Any, out: Path | None) -> None:
    """The rounds' table and the flagged centers; with ``out``, result.json and final.npz written there.
    Raises :class:`UserError` when no round fused (the model is the initial one)."""
    Console().print(_round_table(result))
    for line in _flagged_lines(result):
        typer.echo(line)
    if out is not None:
        (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1))
        np.savez(out / "final.npz", **result.params)
        typer.echo(f"wrote {out / 'result.json'} and {out / 'final.npz'}")
    if not result.ok:  # the model is the initial one: not a success, whatever else went right
        raise UserError(result.problem)


@app.command("serve")
def serve_cmd(
    config: Annotated[Path, typer.Option("--config", help="job JSON (polyparallel collab --save-config)")],
    port: Annotated[int, typer.Option("--port", help="the SuperLink's port (Fleet, Control, Runtime APIs)")] = 9092,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "0.0.0.0",
    out: Annotated[Path, typer.Option("--out", help="fused model, rounds, timing and checkpoints")]
    = Path("collab-out"),
    workdir: Annotated[Path | None, typer.Option("--workdir", help="FLWR_HOME and logs (default: a temp dir)")]
    = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds before giving up")] = 24 * 3600,
    credentials: Annotated[Path | None, typer.Option(
        "--credentials", help="directory from `collab-certs`: TLS, and only the centers' keys may join")] = None,
    round_timeout: Annotated[float | None, typer.Option(
        "--round-timeout", help="seconds to wait for a round's updates (default: the job file's)")] = None,
    center_wait: Annotated[float, typer.Option(
        "--center-wait", help="seconds to wait for enough centers to connect before a round, then fail")] = 600.0,
    rejoin_wait: Annotated[float, typer.Option(
        "--rejoin-wait", help="before a later round, seconds to wait for a lost center to be back (once per "
        "lost center; a restarted one was back in 3-11 s; 0: no wait)")] = 30.0,
    root_data: Annotated[Path | None, typer.Option(
        "--root-data", help=".npz (x, y): the server's own root set for a job with fusion fltrust")] = None,
    eval_data: Annotated[Path | None, typer.Option(
        "--eval-data", help=".npz (x, y): held-out rows the server evaluates every fused model on (never a "
        "center's training rows)")] = None,
    release: Annotated[Path | None, typer.Option("--release", help=_HELP["release"] + " (needs --eval-data)")]
    = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite an existing --release directory")] = False,
) -> None:
    """Start the server side of a deployment: a SuperLink, then the federation's ServerApp; wait for it.

    Centers join with `polyparallel center --name NAME --superlink THIS_HOST:PORT --data FILE.npz`.
    A restarted server with the same --out resumes from its last checkpoint (no round lost or repeated).
    The ServerApp's log (rejected updates, refused identities) is printed here and kept in OUT/server.log.
    """
    if not config.is_file():
        raise UserError(f"--config {config}: no such file; write one with `polyparallel collab ... "
                        f"--save-config {config}`")
    try:
        cfg = CollabConfig.from_json(config.read_text())
        if round_timeout is not None:
            cfg = replace(cfg, round_timeout_s=round_timeout)
    except ValueError as e:  # one line: a field, or the job's own check
        raise UserError(f"{config}: not a collab job file: {e}") from None
    if cfg.make_fusion().needs_root and root_data is None:
        raise UserError(f"the job's fusion {cfg.fusion!r} needs the server's root set: give --root-data FILE.npz")
    if root_data is not None:
        _load_npz(root_data, "--root-data")  # checked here, read by the ServerApp
    ev = _load_npz(eval_data, "--eval-data") if eval_data is not None else None
    if cfg.prune is not None:
        if not cfg.prune.input_shape and ev is None:
            raise UserError(f"{config}: a pruning job's server traces the model on the shape of one input row, which "
                            "the job file does not give: give --eval-data FILE.npz, or write the job with "
                            "`polyparallel collab ... --prune RATIO --eval-data FILE.npz --save-config`")
        with _user_errors(PruneError):  # the shape of --eval-data's rows, checked against the job's
            cfg = with_input_of(cfg, None if ev is None else ev[0][:1], f"the rows of --eval-data {eval_data}")
    if release is not None:
        if cfg.prune is None or ev is None:
            raise UserError("--release writes a pruning job's smaller model and measures it on --eval-data: give "
                            "both a job file with prune and --eval-data FILE.npz")
        _check_release(release, force, eval_data)
    try:
        creds = load_credentials(credentials, [c.name for c in cfg.centers]) if credentials else None
    except OSError as e:
        raise UserError(str(e)) from None
    _exit_on_sigterm()
    wd = (workdir or Path(tempfile.mkdtemp(prefix="ppcollab-serve-"))).resolve()
    res = out.resolve()
    earlier = len((res / "rounds.jsonl").read_text().splitlines()) if (res / "rounds.jsonl").exists() else 0
    try:
        with LoopbackFederation(wd, {}, autostart=False, credentials=creds) as fed:
            fed.kill_strays()  # a killed predecessor's ServerApp or SuperExec (same workdir) still going
            fed.start_superlink(host=host, port=port)
            if creds:
                fed.register_centers((name, pub) for name, _, pub in creds.node_keys)
            fed.submit(cfg, res, center_wait_s=center_wait, rejoin_wait_s=rejoin_wait,
                       root_data=root_data.resolve() if root_data else None,
                       eval_data=eval_data.resolve() if eval_data else None)
            typer.echo(f"SuperLink on {host}:{port}; waiting for {len(cfg.centers)} centers "
                       f"({', '.join(c.name for c in cfg.centers)}); logs in {wd / 'logs'}")
            if earlier:
                typer.echo(f"resuming: {earlier} rounds recorded in {res} already")
            with LineProgress(cfg.rounds, "rounds") as progress:
                fed.wait(res, timeout, on_round=_progress(progress, earlier),
                         on_log=lambda line: progress.console.print(f"server: {line}", markup=False, highlight=False,
                                                                   soft_wrap=True))
    except FlowerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    result = read_outputs(res)
    Console().print(_round_table(result))
    for line in _flagged_lines(result):
        typer.echo(line)
    if not result.ok:  # a run in which no round fused is not a success
        typer.echo(f"error: {result.problem}", err=True)
        raise typer.Exit(1)
    if release is not None and ev is not None:
        _write_release(release, cfg, result, ev, force)


@app.command("center")
def center_cmd(
    name: Annotated[str, typer.Option("--name", help="this center's name in the job")],
    superlink: Annotated[str, typer.Option("--superlink", help="the server's HOST:PORT")],
    data: Annotated[str, typer.Option(
        "--data", help=".npz with this center's x and y, or MODULE:FUNCTION called with --name (never leaves it)")],
    workdir: Annotated[Path | None, typer.Option("--workdir", help="FLWR_HOME and logs (default: a temp dir)")]
    = None,
    ca: Annotated[Path | None, typer.Option("--ca", help="CA certificate of the server (enables TLS)")] = None,
    key: Annotated[Path | None, typer.Option("--key", help="this center's private key (node authentication)")]
    = None,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", help="seconds to wait for the first connection before giving up with the reason")]
    = 60.0,
    reconnect: Annotated[float, typer.Option(
        "--reconnect", help="seconds to keep reconnecting after the server went away (e.g. restarted)")] = 600.0,
    framework: Annotated[str | None, typer.Option(
        "--framework", help="the framework the job trains this center in (torch, mindspore, paddle, tensorflow): "
        "checked importable here before joining; the center trains with this command's Python, so start it with "
        "the Python of the environment that has the framework")] = None,
) -> None:
    """Start one center of a deployment: a SuperNode and a long-lived trainer; runs until stopped.

    Killing this command (Ctrl-C, SIGTERM, even SIGKILL) stops its SuperNode and trainer; a center
    restarted after a crash rejoins within seconds; when the server goes away it reconnects for --reconnect s.
    """
    d_path, source = _data_option(data)
    if d_path is not None and not d_path.exists():
        raise UserError(f"--data {data}: no such file (an .npz with arrays x and y) and not a MODULE:FUNCTION")
    if framework is not None:
        with _user_errors(ValueError):
            import_frameworks([framework])
    if (ca is None) != (key is None):
        raise UserError("--ca and --key go together (TLS and node authentication)")
    creds = None
    if ca is not None and key is not None:
        try:
            check_node_credentials(ca, key)
        except ValueError as e:
            raise UserError(str(e)) from None
        creds = Credentials(ca.parent, ca.resolve(), ca, ca, ((name, key.resolve(), key),))
    _exit_on_sigterm()
    wd = workdir or Path(tempfile.mkdtemp(prefix=f"ppcollab-{name}-"))
    where = source or (d_path.resolve() if d_path is not None else "")
    # a SuperNode gives up on an unreachable SuperLink after 10 s; supervise() then starts a new one
    with LoopbackFederation(wd.resolve(), {name: where}, autostart=False, credentials=creds,
                            connect_wait_s=10.0) as fed:
        try:
            fed.start_center(name, superlink=superlink)
            node = fed.wait_connected(name, connect_timeout)
        except FlowerError as e:
            hint = "" if creds else " (no --ca/--key given: does the server use TLS and node keys?)"
            raise UserError(f"center {name} could not join {superlink}: {e}{hint}") from None
        typer.echo(f"center {name} connected to {superlink} as node {node}; logs in {wd / 'logs'} (Ctrl-C to stop)")
        with contextlib.suppress(KeyboardInterrupt):
            try:
                fed.supervise(name, superlink=superlink, reconnect_s=reconnect, on_event=typer.echo)
            except FlowerError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(1) from None


@app.command("collab-certs")
def certs_cmd(
    out: Annotated[Path, typer.Option("--out", help="directory to write into")],
    centers: Annotated[str, typer.Option("--centers", help="center names, comma separated")],
    hosts: Annotated[str, typer.Option("--hosts", help="server names/IPs the certificate is valid for")]
    = "127.0.0.1,localhost",
) -> None:
    """Create test credentials: a CA, the server's TLS certificate, and one key pair per center."""
    names = [c.strip() for c in centers.split(",") if c.strip()]
    if not names:
        raise UserError("--centers: give at least one center name")
    cr = make_credentials(out, names, [h.strip() for h in hosts.split(",") if h.strip()])
    typer.echo(f"wrote {cr.ca}, {cr.server_cert}, {cr.server_key} and {len(names)} key pairs in {out}\n"
               f"server: polyparallel serve --credentials {out} ...\n"
               f"center: polyparallel center --ca {cr.ca} --key {out}/NAME.key ...")
