"""``"package.module:function"`` references: how a user names the model, data and builders that every
process (the launcher, each rank, each center, the fusion server) imports for itself, instead of
receiving pickled code.

Examples:
    >>> from polyparallel.references import is_reference, resolve
    >>> is_reference("polyparallel.models:GPT"), is_reference("gpt-tiny")
    (True, False)
    >>> resolve("math:sqrt")(16.0)
    4.0
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["UserCodeError", "call_user", "import_path", "is_reference", "resolve"]

_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_reference(text: Any) -> bool:
    """Whether ``text`` has the form ``package.module:function``."""
    return isinstance(text, str) and bool(_REF.match(text))


def resolve(ref: Any, what: str = "function") -> Callable[..., Any]:
    """The callable ``ref`` names (``"package.module:function"``, attributes dotted after the colon),
    imported in this process; a callable is returned as it is. Raises ValueError naming the fix."""
    if callable(ref):
        return ref
    if not is_reference(ref):
        raise ValueError(f"{what} {ref!r}: expected 'package.module:function'")
    mod, _, name = ref.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except SyntaxError as e:
        raise ValueError(f"{what} {ref!r} cannot be loaded: {e.filename}:{e.lineno}: {e.msg}; fix the module's "
                         "syntax") from e
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {ref!r} cannot be loaded here ({type(e).__name__}: {e}): the module must be "
                         "importable in every process that runs it; run from its folder (the CLI puts the current "
                         f"folder on the path) or put its directory on PYTHONPATH (sys.path here: {sys.path[:4]}...)"
                         ) from e
    if not callable(obj):
        raise ValueError(f"{what} {ref!r} is a {type(obj).__name__}, not a function")
    return obj


class UserCodeError(ValueError):
    """The user's model, data or builder function raised: the message names the function, the
    exception and the line of the user's code it came from."""


def call_user(fn: Callable[..., Any], what: str, *args: Any) -> Any:
    """``fn(*args)``; an exception it raises becomes :class:`UserCodeError` in one line: what it
    is (``what``), the exception, and the innermost frame outside polyparallel and torch, where the
    user's code failed (the original is chained as its cause)."""
    try:
        return fn(*args)
    except Exception as e:
        frame = user_frame(e)
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        name = getattr(fn, "__qualname__", repr(fn))
        raise UserCodeError(f"{what} {name}({', '.join(map(repr, args))}) raised {type(e).__name__}: {e}{where}; "
                            "fix it, or run it alone to see the whole traceback") from e


def user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``e``'s traceback in the user's code: outside this project's packages
    (``polyparallel`` and the folders installed under it: backends, frontends, cost models) and
    outside installed packages (torch, transformers, ...)."""
    ours = {os.path.dirname(os.path.abspath(__file__))}  # this module's package, polyparallel
    for sub in ("backends", "frontends", "cost_models"):
        mod = sys.modules.get(f"polyparallel.{sub}")
        if mod is not None and mod.__file__:
            ours.add(os.path.dirname(os.path.abspath(mod.__file__)))
    skip = tuple(d + os.sep for d in ours)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith(skip) and "site-packages" not in f.filename]
    return frames[-1] if frames else None


def import_path() -> str:
    """This process's import path minus the interpreter's own directories, as ``PYTHONPATH``.

    Flower's processes (SuperNodes, their ClientApps, the ServerApp) import the user's model and data
    modules themselves and run in another working directory: they get the directories this process
    imports from (the current directory first, as for ``python -m``), so a module importable here is
    importable there.
    """
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: list[str] = []
    for p in [os.getcwd(), *sys.path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]:
        rp = os.path.realpath(p or os.getcwd())
        if os.path.isdir(rp) and not any(rp == o or rp.startswith(o + os.sep) for o in own) and rp not in out:
            out.append(rp)
    return os.pathsep.join(out)
