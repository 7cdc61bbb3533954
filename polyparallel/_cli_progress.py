"""Progress of long command-line work (training steps, collaborative rounds): one line per finished
unit, plus, on a terminal, a live bar with the count, elapsed time and time left.

Piped or redirected (a log file, CI), only the lines are written, each flushed as its unit ends and
ending with ``eta N s`` while units remain, so a log reads the same as the screen without control
codes. The time left is the mean wall time per unit since the first unit ended, times the units
left: the first unit carries the start-up (process launch, capture, compilation) and would inflate
every later estimate.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _Bar


class LineProgress:
    """``with LineProgress(total, "steps") as p: p.line(text)`` once per finished unit.

    Args:
        total: units expected (steps, rounds).
        label: what a unit is, shown on the bar.
        console: where to write; by default standard output, live only when it is a terminal.
    """

    def __init__(self, total: int, label: str, *, console: Console | None = None) -> None:
        self.total, self.label = total, label
        self.console = console or Console(width=None if sys.stdout.isatty() else 160)
        self.live = self.console.is_terminal
        self.done, self._seen, self._t_first = 0, 0, 0.0
        self._bar: _Bar | None = None
        self._task = 0

    def __enter__(self) -> LineProgress:
        if self.live:
            self._bar = _Bar(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[eta]}"), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, eta="")
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def eta_s(self) -> float | None:
        """Seconds left at the mean pace since the first unit this process saw ended; None before two."""
        left = self.total - self.done
        if self._seen < 2 or left <= 0:
            return None
        return (time.monotonic() - self._t_first) / (self._seen - 1) * left

    def line(self, text: str, *, done: int | None = None) -> None:
        """Record a finished unit (``done``: the units finished so far, when the caller knows it) and
        write ``text`` with the time left."""
        self.done = self.done + 1 if done is None else done
        self._seen += 1
        if self._seen == 1:
            self._t_first = time.monotonic()
        eta = self.eta_s()
        tail = f"  eta {eta:.1f} s" if eta is not None else ""
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
            self._bar.update(self._task, completed=self.done, eta=tail.strip())
        else:
            self.console.print(text + tail, highlight=False, markup=False, soft_wrap=True)
            self.console.file.flush()
