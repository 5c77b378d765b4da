"""A one-line ``\\r`` progress display for replays (stderr by default; no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A one-line ``\\r`` progress display on a text stream (no dependency)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = sys.stderr) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, done: int, sim_time: float, force: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.25:
            return
        self._last = now
        pct = 100.0 * done / self.total if self.total else 100.0
        self.stream.write(
            f"\r{self.label:<16} {done:>6}/{self.total} ({pct:5.1f}%)  "
            f"sim {sim_time:8.1f}s  wall {now - self._start:6.1f}s "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
