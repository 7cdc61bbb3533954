"""The MindSpore backend: a Strategy exported as MindSpore's parallel configuration
(:func:`export_mindspore`), and MindSpore centers with several devices (:mod:`._center`)."""

from __future__ import annotations

from ._api import TARGETS, export
from ._export import ExportResult, export_mindspore

__all__ = ["TARGETS", "ExportResult", "export", "export_mindspore"]
