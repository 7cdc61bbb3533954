"""``polyparallel tasks plan|run|infer``: task groups (algorithms × the centers' datasets) trained
collaboratively, and their models fused into one (``backends/collab/_tasks.py``, ``_tasks_fusion.py``)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from polyparallel._cli_collab import _eval_text, _exit_on_sigterm
from polyparallel._cli_progress import LineProgress
from polyparallel.backends.collab._tasks import load_datasets, load_npz, load_tasks, plan_groups, run_groups
from polyparallel.cli import UserError, app

tasks_app = typer.Typer(help="Task groups: several algorithms trained across the centers' data, fused into one model.",
                        no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")

_FILE = typer.Argument(help="the task file (YAML: algorithms, datasets, groups, eval, public, fusion, cluster)")


def _load(path: Path) -> tuple[Any, Any]:
    """The validated task set and its datasets (loaded where each center is, held-out rows split off)."""
    ts = load_tasks(path)
    try:
        return ts, load_datasets(ts)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        raise UserError(f"{ts.source}: {e}") from None


def _plan_lines(plans: list[Any]) -> list[str]:
    lines = []
    for p in plans:
        d = p.to_dict()
        pred = (f", predicted {d['predicted_s']:.3g} s ({d['round_s']:.3g} s per round, simulated)"
                if d["predicted_s"] is not None else "")
        lines.append(f"group {d['group']}: algorithm {d['algorithm']} ({d['model']}) on {', '.join(d['datasets'])}; "
                     f"{d['rounds']} rounds x {d['local_steps']} local steps{pred}")
        for c in d["centers"]:
            plan = " ".join(f"{k}={c[k]}" for k in ("framework", "devices", "dp", "tp", "zero_stage", "recompute")
                            if c.get(k) is not None)
            step = f", step {c['step_time_s'] * 1e3:.3g} ms" if c.get("step_time_s") else ""
            lines.append(f"  center {c['center']}: {c['rows']} rows{'; ' + plan if plan else ''}{step}")
        lines += [f"  note: {n}" for n in d["notes"]]
    return lines


@tasks_app.command("plan")
def plan_cmd(tasks: Annotated[Path, _FILE],
             as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False) -> None:
    """Form the task groups: which algorithm trains on which centers' data, each center's plan from the
    planner and each group's predicted time from the simulator (with a cluster in the task file)."""
    ts, data = _load(tasks)
    plans = plan_groups(ts, data, say=lambda s: typer.echo(s, err=True))
    if as_json:
        typer.echo(json.dumps([p.to_dict() for p in plans], indent=1))
        return
    for line in _plan_lines(plans):
        typer.echo(line)
    timed = [p.predicted_s for p in plans if p.predicted_s is not None]
    if timed:
        typer.echo(f"all groups: {max(timed):.3g} s side by side, {sum(timed):.3g} s one after another (simulated)")


@tasks_app.command("run")
def run_cmd(tasks: Annotated[Path, _FILE],
            out: Annotated[Path, typer.Option("--out", help="write result.json, fused.pt2, fused.onnx and "
                                                            "members/NAME.npz here")],
            engine: Annotated[str, typer.Option("--engine", help="inprocess, or flower (processes on 127.0.0.1)")]
            = "inprocess",
            force: Annotated[bool, typer.Option("--force", help="overwrite the files of an existing --out")] = False,
            ) -> None:
    """Run every group with the collaborative engine (progress per group and round), fuse the members
    and write the fused model."""
    from polyparallel.backends.collab._tasks_fusion import fuse_members, write_outputs

    if engine not in ("inprocess", "flower"):
        raise UserError(f"--engine {engine!r}: use inprocess or flower")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        raise UserError(f"--out {out} exists: give another folder, or --force to overwrite its result files")
    ts, data = _load(tasks)
    ev = load_npz(ts.path(ts.spec.eval), "eval")
    public = load_npz(ts.path(ts.spec.public), "public", labels=False)[0] if ts.spec.public else None
    row = next(iter(data.train.values()))[0]
    for what, x in (("eval", ev[0]), ("public", public)):
        if x is not None and tuple(x.shape[1:]) != tuple(row.shape[1:]):
            raise UserError(f"{ts.source}: {what}: rows of shape {tuple(x.shape[1:])}, the datasets' "
                            f"{tuple(row.shape[1:])}; give rows with the datasets' features")
    _exit_on_sigterm()
    with LineProgress(sum(g.rounds for g in ts.groups), "rounds") as progress:
        done = [0]

        def on_round(g: Any, r: Any) -> None:
            done[0] += 1
            train = f"train loss {r.train_loss:.4f}" if r.train_loss is not None else "no update"
            progress.line(f"{g.name}: round {r.round}/{g.rounds}  accepted {','.join(r.accepted) or '-'}  {train}  "
                          f"eval {_eval_text(r.eval)}  {r.seconds:.2f} s", done=done[0])

        def on_group(g: Any) -> None:
            progress.line(f"group {g.name}: {g.algorithm} ({g.model.kind}) on {', '.join(g.centers)}")

        kw: dict[str, Any] = {"workdir": out / "flower"} if engine == "flower" else {}
        try:
            members = run_groups(ts, data, ev, engine=engine, on_round=on_round, on_group=on_group, **kw)
        except RuntimeError as e:
            raise UserError(str(e)) from None
    t0 = time.time()
    outcome = fuse_members(ts, members, data.train, data.held, public, say=typer.echo)
    if out.exists() and force:
        for f in ("fused.pt2", "fused.onnx", "result.json"):
            (out / f).unlink(missing_ok=True)
        shutil.rmtree(out / "members", ignore_errors=True)
    res = write_outputs(out, ts, members, outcome, ev, sum(len(v[1]) for v in data.held.values()))
    typer.echo(f"fusion in {time.time() - t0:.1f} s")
    for line in result_lines(res):
        typer.echo(line)
    typer.echo(f"wrote {out / 'result.json'}, {out / 'fused.pt2'} and {out / 'fused.onnx'}")


def result_lines(res: dict[str, Any]) -> list[str]:
    """The accuracies on the evaluation set: every member, the ensemble, averages, the fused model."""
    lines = [f"{'model':<24} {'eval acc':>9} {'held-out acc':>13} {'params':>9}"]
    for n, m in res["members"].items():
        lines.append(f"{'member ' + n:<24} {m['accuracy']:>9.4f} {m['val_accuracy']:>13.4f} {m['params']:>9}")
    e = res["ensemble"]
    lines.append(f"{'ensemble (weighted)':<24} {e['accuracy']:>9.4f} {e['val_accuracy']:>13.4f} {e['params']:>9}")
    for kind, a in res["average"].items():
        lines.append(f"{'average ' + kind:<24.24} {a['accuracy']:>9.4f} {a['val_accuracy']:>13.4f}")
    if "distill" in res:
        d = res["distill"]
        lines.append(f"{'distilled':<24} {d['accuracy']:>9.4f} {d['val_accuracy']:>13.4f} {d['params']:>9}")
    f = res["fused"]
    lines.append(f"{'fused (' + f['method'] + ')':<24} {f['accuracy']:>9.4f} {f['val_accuracy']:>13.4f} "
                 f"{f['params']:>9}   onnxruntime max |diff| {f['onnx_check']['max_abs_diff']:.2g}")
    return lines


@tasks_app.command("infer")
def infer_cmd(run_dir: Annotated[Path, typer.Argument(help="the --out folder of `polyparallel tasks run`")],
              data: Annotated[Path, typer.Argument(help=".npz with x (and y to report accuracy)")],
              use: Annotated[str, typer.Option("--use", help="fused (the fused model) or ensemble (the members, "
                                                             "weighted)")] = "fused",
              runtime: Annotated[str, typer.Option("--runtime", help="torch (fused.pt2) or onnx (fused.onnx under "
                                                                     "onnxruntime)")] = "torch",
              out: Annotated[Path | None, typer.Option("--out", help="write logits and predictions (.npz)")] = None,
              ) -> None:
    """Run the fused model (or the members' weighted ensemble) on new data."""
    from polyparallel.backends.collab._tasks_fusion import infer

    if use not in ("fused", "ensemble") or runtime not in ("torch", "onnx"):
        raise UserError(f"--use {use} --runtime {runtime}: use is fused or ensemble, runtime torch or onnx")
    need = "result.json" if use == "ensemble" else f"fused.{'pt2' if runtime == 'torch' else 'onnx'}"
    if not (run_dir / need).is_file():
        raise UserError(f"{run_dir}: no {need}; give the --out folder of `polyparallel tasks run`")
    x, y = load_npz(str(data), "data", labels=False)
    logits = infer(run_dir, x, use=use, runtime=runtime)
    pred = logits.argmax(-1)
    acc = f", accuracy {float((pred == y).mean()):.4f}" if len(y) == len(x) else ""
    typer.echo(f"{len(x)} rows through the {use} model ({runtime if use == 'fused' else 'torch'}){acc}")
    if out is not None:
        np.savez(out, logits=logits, pred=pred)
        typer.echo(f"wrote {out}")
