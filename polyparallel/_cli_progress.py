"""Progress of long command-line work (training steps, collaborative rounds): one line per finished
unit, plus, on a terminal, a live bar with the count, elapsed time and time left.

Piped or redirected (a log file, CI), only the lines are written, each flushed as its unit ends and
ending with ``eta N s`` while units remain, so a log reads the same as the screen without control
codes; a unit that takes long (a Flower federation starting, a round of thousands of local steps)
gets a line every ``heartbeat_s`` (8 s) saying it is under way, so no log falls silent for longer.
The time left is the mean wall time per unit since the first unit ended, times the units left: the
first unit carries the start-up (process launch, capture, compilation) and would inflate every
later estimate.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _Bar

_since = time.monotonic  # the heartbeat's clock, apart from the time-left estimate's


class Heartbeat:
    """Lines on ``console`` (not a terminal), and one more whenever it has been silent for
    ``every_s`` seconds: ``what(seconds since the start)`` says what is under way (None: nothing now).

    ``with Heartbeat(console, what) as beat: beat.write(line)``; the thread stops with the block.
    """

    def __init__(self, console: Console, what: Callable[[float], str | None], every_s: float = 8.0) -> None:
        self.console, self.what, self.every_s = console, what, every_s
        self._said = _since()  # when the last line was written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self._said = _since()
        self._thread = threading.Thread(target=self._run, name="progress-heartbeat", daemon=True)
        self._thread.start()
        return self

    def write(self, text: str) -> None:
        with self._lock:
            self._print(text)

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        self.console.file.flush()
        self._said = _since()

    def _run(self) -> None:
        started = _since()
        while not self._stop.wait(min(1.0, self.every_s / 4)):
            with self._lock:
                if _since() - self._said >= self.every_s:
                    text = self.what(_since() - started)
                    if text:
                        self._print(text)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class LineProgress:
    """``with LineProgress(total, "steps") as p: p.line(text)`` once per finished unit.

    Args:
        total: units expected (steps, rounds).
        label: what a unit is, shown on the bar.
        console: where to write; by default standard output, live only when it is a terminal.
        heartbeat_s: without a live bar, the longest silence before a line saying the unit is under way.
    """

    def __init__(self, total: int, label: str, *, console: Console | None = None, heartbeat_s: float = 8.0) -> None:
        self.total, self.label = total, label
        self.console = console or Console(width=None if sys.stdout.isatty() else 160)
        self.live = self.console.is_terminal
        self.done, self._seen, self._t_first = 0, 0, 0.0
        self._bar: _Bar | None = None
        self._task = 0
        self._beat = Heartbeat(self.console, self._under_way, heartbeat_s)

    def __enter__(self) -> LineProgress:
        if self.live:
            self._bar = _Bar(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[eta]}"), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, eta="")
        else:
            self._beat.__enter__()
        return self

    def _under_way(self, elapsed: float) -> str | None:
        if self.done >= self.total:
            return None
        unit = self.label[:-1] if self.label.endswith("s") else self.label
        return f"  ... {unit} {self.done + 1}/{self.total} under way ({elapsed:.0f} s since the start)"

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._beat.__exit__(et, e, tb)
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
            self._beat.write(text + tail)
