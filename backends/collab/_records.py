"""The collaborative job's configuration records: frozen pydantic dataclasses whose errors are one line.

:class:`~._config.CenterSpec`, :class:`~._config.CollabConfig`, :class:`~._models.ModelSpec` and
:class:`~._pruning.PruneSpec` are declared with :func:`config_record`, as the rest of the project
declares its records with pydantic (``polyparallel.strategy``): pydantic checks the fields' types and
builds the nested records, from keywords or from the job's JSON (:func:`record_from_json`), and
writes them back (:func:`record_data`); a field left out of the JSON at its default says so with
``Field(exclude_if=...)``. Each record's ``__post_init__`` keeps the checks of values (ranges, names,
combinations) and their messages.

Errors stay one line: the record's own check raises its own exception (pydantic would wrap it in a
multi-line ``ValidationError``; it is raised as it was), a wrong type or a JSON that is not a job reads
``CollabConfig: centers.0.devices: input should be a valid integer (got 'two')``, and a keyword the
record does not have is a ``TypeError``, as with any call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

__all__ = ["Pairs", "Real", "config_record", "record_data", "record_from_json"]

#: a number as typing's ``float`` means it: an int stays an int. pydantic's ``float`` would turn ``1``
#: into ``1.0`` (the job's JSON would change), and a count the record checks itself ("an integer >= 1",
#: with its message) would not reach the check
Real = int | float

V = TypeVar("V")


def _sorted_items(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else value


#: ``(name, value)`` pairs, kept hashable; a dict is accepted and taken in sorted order
Pairs = Annotated[tuple[tuple[str, V], ...], BeforeValidator(_sorted_items)]

#: pydantic's errors about the call itself rather than a value: a ``TypeError``, as a dataclass's would be
_CALL_ERRORS = frozenset({"unexpected_keyword_argument", "unexpected_positional_argument", "missing_argument",
                          "missing_positional_only_argument", "missing_keyword_only_argument",
                          "multiple_argument_values"})


def config_record(cls: type) -> Any:
    """``cls`` as a frozen pydantic dataclass (unknown fields refused) whose errors are one line."""
    rec = dataclass(frozen=True, config=ConfigDict(extra="forbid"))(cls)
    validate = rec.__init__

    @functools.wraps(validate)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except ValidationError as e:
            raise _one_line(rec, e, call=True) from None

    rec.__init__ = __init__
    return rec


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def record_from_json(cls: type[V], text: str | bytes) -> V:
    """The record of type ``cls`` in the JSON ``text``; ``ValueError`` (one line) when it is not one."""
    try:
        return _adapter(cls).validate_json(text)
    except ValidationError as e:
        raise _one_line(cls, e, call=False) from None


def record_data(record: Any) -> dict[str, Any]:
    """The record's fields as ``json.dumps`` takes them (nested records as dicts; tuples stay tuples,
    which it writes as lists), without the fields left out at their defaults."""
    return _adapter(type(record)).dump_python(record)


def _one_line(cls: type, e: ValidationError, *, call: bool) -> Exception:
    errors = e.errors()
    for err in errors:
        own = (err.get("ctx") or {}).get("error")
        if isinstance(own, Exception):  # a record's own check, raised as it was
            return own
    names = [f.name for f in dataclasses.fields(cls)]
    parts: dict[str, str] = {}
    for err in errors:
        loc = [names[p] if call and i == 0 and isinstance(p, int) and p < len(names) else str(p)
               for i, p in enumerate(err["loc"])]
        msg = err["msg"][:1].lower() + err["msg"][1:]
        if loc[-1:] in (["int"], ["float"]):  # a Real: one error for its two types
            loc, msg = loc[:-1], "input should be a number"
        elif err["type"] == "unexpected_keyword_argument" and not call:
            msg = "unknown field"
        got = "" if err["type"] in _CALL_ERRORS or err["type"] in ("missing", "json_invalid") else (
            f" (got {_short(err['input'])})")
        where = ".".join(loc)
        parts.setdefault(where, f"{where}: {msg}{got}" if loc else f"{msg}{got}")
    kind = TypeError if call and all(err["type"] in _CALL_ERRORS for err in errors) else ValueError
    return kind(f"{cls.__name__}: " + "; ".join(parts.values()))


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
