"""The ``polyparallel`` command line.

Each command group lives in its own ``_cli_*.py`` module that registers on :data:`app`;
this module only assembles them and turns user errors into one readable line.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import typer

from polyparallel import __version__
from polyparallel.frontends import CaptureError

app = typer.Typer(
    name="polyparallel",
    help="Find how to parallelise deep-learning training, and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules that add commands to `app` when imported. Keep the list explicit.
_COMMAND_MODULES = ("polyparallel._cli_graph", "polyparallel._cli_cluster", "polyparallel._cli_search",
                    "polyparallel._cli_collab", "polyparallel._cli_train", "polyparallel._cli_report",
                    "polyparallel._cli_simulate", "polyparallel._cli_tasks", "polyparallel._cli_export")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"polyparallel {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")) -> None:
    """Find how to parallelise deep-learning training, and run it."""


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def writable_file(path: Path, flag: str = "--out") -> Path:
    """``path`` when a file can be written there, checked before any long work: its folder exists
    and it is not a folder itself; else :class:`UserError` naming the fix."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name inside it, e.g. {path / 'strategy.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a folder; write elsewhere")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: the folder {parent} does not exist; create it (mkdir -p {parent}) or write "
                        "elsewhere")
    return path


#: optional dependency (top-level module) -> the pyproject extra that installs it
OPTIONAL_EXTRAS = {"flwr": "collab", "sklearn": "collab", "mindspore": "mindspore", "onnxruntime": "onnx",
                   "onnxscript": "onnx", "transformers": "hf", "paddle": "paddle", "tensorflow": "tensorflow"}


def _load_commands() -> None:
    for name in _COMMAND_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def main(argv: list[str] | None = None) -> None:
    # MODULE:FUNCTION arguments (models, data, sources) resolve from the current folder, as with
    # `python -m`; the processes a command starts inherit this path
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        os.environ["COLUMNS"] = "160"  # piped help: rich would wrap at 80 and cut option names
    _load_commands()
    try:
        app(args=argv, standalone_mode=True)
    except (UserError, CaptureError, FileNotFoundError, ValueError, OSError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except ModuleNotFoundError as e:
        extra = OPTIONAL_EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        typer.secho(f"error: this command needs {e.name!r}, which is not installed: "
                    f"pip install 'polyparallel[{extra}]' (or the package itself)", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit as e:
        if e.code == 130:  # click turns Ctrl-C into a silent exit 130
            _interrupted()
        raise


def _interrupted() -> None:
    typer.secho("interrupted (Ctrl-C): the command stopped before finishing; the processes it started are stopped "
                "(a train run resumes from its last checkpoint with the same --run-dir)", err=True)
    sys.exit(130)


if __name__ == "__main__":  # pragma: no cover - run as `python -m polyparallel`
    from polyparallel.cli import main as _main  # the registered module, not this __main__ copy

    _main()
