"""The replay progress display: a rich progress bar on stderr while a replay runs.

It draws only when its stream is a terminal; piped, redirected or captured (tests, CI logs)
it stays silent, so reports and logs carry no carriage-return clutter. The simulated (or trace)
time is shown beside the wall time and the remaining-time estimate.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as _RichProgress

# The sim calls update() once per event (millions per replay): forwarding every call to rich
# would cost more than the replay step itself, so updates closer than this are dropped.
_MIN_INTERVAL_S = 0.1


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """One replay's progress (``done`` of ``total`` requests) on ``stream``.

    ``stream`` None, or not a terminal: nothing is drawn.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = sys.stderr) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self._last = 0.0
        self._bar: _RichProgress | None = None
        if stream is None or not _is_terminal(stream):
            return
        self._bar = _RichProgress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TextColumn("sim {task.fields[sim_time]:.1f} s"),
            TextColumn("wall"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=stream),
            auto_refresh=False,  # redrawn from update(): no refresh thread
        )
        self._task = self._bar.add_task(label, total=total or None, sim_time=0.0)
        self._bar.start()

    def update(self, done: int, sim_time: float, force: bool = False) -> None:
        """``done`` requests finished at simulated (or trace) time ``sim_time``."""
        if self._bar is None:
            return
        now = time.monotonic()
        if not force and now - self._last < _MIN_INTERVAL_S:
            return
        self._last = now
        self._bar.update(self._task, completed=done, sim_time=sim_time, refresh=True)

    def close(self) -> None:
        """Leave the final bar on screen and release the terminal."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
