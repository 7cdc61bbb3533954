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
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["is_reference", "resolve"]

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
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {ref!r} cannot be loaded here ({type(e).__name__}: {e}): the module must be "
                         "importable in every process that runs it; run from its folder (the CLI puts the current "
                         f"folder on the path) or put its directory on PYTHONPATH (sys.path here: {sys.path[:4]}...)"
                         ) from e
    if not callable(obj):
        raise ValueError(f"{what} {ref!r} is a {type(obj).__name__}, not a function")
    return obj
