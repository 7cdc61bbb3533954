"""``polyparallel train``: run a Strategy with the torch.distributed backend."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any

import typer

from polyparallel._cli_progress import LineProgress
from polyparallel.cli import UserError, app
from polyparallel.strategy import Strategy


@app.command()
def train(
    strategy: Annotated[Path, typer.Argument(help="strategy JSON written by `polyparallel search`")],
    model: Annotated[str, typer.Option(help="package.module:function building the model, or a trainable "
                                            "built-in example (mlp, cnn, gpt-tiny) the strategy was searched for")],
    data: Annotated[str | None, typer.Option(help="package.module:function; data(step) -> (inputs, labels), the "
                                                  "global batch (default for a built-in example: synthetic "
                                                  "batches of its shape)")] = None,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 10,
    optimizer: Annotated[str, typer.Option(help="sgd, adam or adamw")] = "sgd",
    lr: Annotated[float, typer.Option(help="learning rate")] = 0.1,
    seed: Annotated[int, typer.Option(help="torch seed set on every rank before building the model")] = 0,
    run_dir: Annotated[Path | None, typer.Option(help="folder for job.pkl, launcher.log, train.jsonl, failure "
                                                      "reports and checkpoints/ (default: "
                                                      "runs/<YYYYmmdd-HHMMSS>)")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="older name of --run-dir")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="save here with torch.distributed.checkpoint instead of "
                                                             "RUN_DIR/checkpoints; a rerun with the same folder "
                                                             "resumes")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="steps between checkpoints (saved in "
                                                              "RUN_DIR/checkpoints without --checkpoint-dir; a rerun "
                                                              "with the same --run-dir resumes); default 1 with "
                                                              "--checkpoint-dir, else no checkpoints")] = None,
    keep_checkpoints: Annotated[int, typer.Option(help="newest checkpoints kept (0: all)")] = 2,
    timeout: Annotated[float, typer.Option(
        help="seconds from the command's start (checks and capture included) until the run is stopped (every "
             "process killed)")] = 600.0,
    fingerprint_check: Annotated[bool, typer.Option(
        "--fingerprint-check/--no-fingerprint-check",
        help="refuse a model whose captured graph is not the strategy's (--no-fingerprint-check: run a "
             "stand-in model, matched to the placements by module path)")] = True,
    node_rank: Annotated[int | None, typer.Option(help="for a strategy spanning several nodes: which node this "
                                                       "is (without it, the per-node commands are printed)")] = None,
    master_addr: Annotated[str, typer.Option(help="address of node 0 (multi-node rendezvous)")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(help="port of the rendezvous on node 0")] = 29500,
    profile_comm: Annotated[bool, typer.Option(help="log per step the time torch's profiler records inside "
                                                    "collectives (comm_s, comm_ops); slows small steps")] = False,
    keep_nonfinite: Annotated[bool, typer.Option(help="train on after a NaN or infinite loss (default: stop with "
                                                      "the step and the likely causes)")] = False,
) -> None:
    """Train MODEL on DATA exactly as the strategy says (refused, exit 2, if it cannot be executed)."""
    if run_dir is not None and log_dir is not None and run_dir != log_dir:
        raise UserError("--log-dir is the older name of --run-dir: give one")
    from polyparallel.backends.torch import _agent

    _agent.prestart()  # the launcher's agent imports torch while this process does (and checks the run)
    from polyparallel.backends.torch import MultiNode, TrainError, launch_commands

    model_fn, data_fn = _model_and_data(model, data, strategy)
    typer.echo(f"checking {strategy} against the model, then starting its processes ...")
    made = None
    try:
        from polyparallel.backends.torch import train as run
        from polyparallel.backends.torch._launch import new_run_dir, runs_root

        # a new run directory is created at once: a name only chosen here could be taken by another
        # run of the same second (a test's train() in POLYPARALLEL_RUNS) before train() creates it
        fresh_root = not runs_root().exists()
        made = None if run_dir or log_dir or checkpoint_dir else new_run_dir()
        where = run_dir or log_dir or checkpoint_dir or made
        with LineProgress(steps, "steps") as progress:
            run(strategy, model_fn, data_fn, steps=steps, optimizer=optimizer, lr=lr, seed=seed, run_dir=where,
                checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                keep_checkpoints=keep_checkpoints or None, timeout_s=timeout, progress=_StepPrinter(progress),
                check_fingerprint=fingerprint_check, node_rank=node_rank, master_addr=master_addr,
                master_port=master_port, profile_comm=profile_comm, stop_on_nonfinite=not keep_nonfinite)
    except MultiNode:
        typer.echo("this strategy spans several nodes; run on each node, node 0 first:")
        for cmd in launch_commands(strategy, model, data, steps=steps, master_port=master_port):
            typer.echo(cmd)
        return
    except TrainError as e:
        raise UserError(str(e)) from e
    finally:
        _agent.discard()  # not taken if the run was refused before train() started one
        if made is not None and not any(made.iterdir()):  # refused before launch: no empty run directory
            made.rmdir()
            if fresh_root and not any(made.parent.iterdir()):  # nor the runs/ folder made for it
                made.parent.rmdir()
    typer.echo(f"run directory: {where}")


def _model_and_data(model: str, data: str | None, strategy: Path) -> tuple[Any, Any]:
    """``--model``/``--data`` as train takes them: references, or a built-in example's module and its
    synthetic batches at the strategy's global batch (picklable partials every rank rebuilds)."""
    from polyparallel.models import EXAMPLES, example_batch, example_module, trainable_example

    if model not in EXAMPLES:
        if data is None:
            raise UserError("--data is needed for your own model: package.module:function returning the global "
                            "batch (inputs, labels) of each step")
        return model, data
    trainable_example(model, synthetic=data is None)  # refused here, before anything is built or started
    if data is not None:
        return functools.partial(example_module, model), data
    batch = Strategy.from_json(strategy).global_batch
    return functools.partial(example_module, model), functools.partial(example_batch, model, batch)


class _StepPrinter:
    """One line per step as rank 0 logs it: loss, step time, throughput (and collective time), with
    the time left (:class:`~polyparallel._cli_progress.LineProgress`: a live bar on a terminal)."""

    def __init__(self, progress: LineProgress) -> None:
        self.progress = progress

    def __call__(self, rec: dict) -> None:
        dt = rec["step_time_s"]
        rate = f"  {rec['samples'] / dt:.1f} samples/s" if "samples" in rec and dt > 0 else ""
        rate += f"  {rec['tokens'] / dt:.0f} tokens/s" if "tokens" in rec and dt > 0 else ""
        comm = f"  comm {rec['comm_s'] * 1e3:.1f} ms" if "comm_s" in rec else ""
        self.progress.line(f"step {rec['step']:>4}/{self.progress.total}  loss {rec['loss']:.6f}  {dt * 1e3:.1f} ms"
                           f"{rate}{comm}", done=rec["step"] + 1)
