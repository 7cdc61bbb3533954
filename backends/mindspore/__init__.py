"""The MindSpore backend: a Strategy exported as MindSpore's parallel configuration
(:func:`export_mindspore`) and checked by MindSpore (:mod:`._validate`). A MindSpore center with
several devices is a collaborative center (:mod:`polyparallel.backends.collab._mindspore_dp`)."""

from __future__ import annotations

from ._api import TARGETS, export
from ._export import ExportResult, export_mindspore

__all__ = ["TARGETS", "ExportResult", "export", "export_mindspore"]
