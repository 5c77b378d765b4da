"""A fixed-bucket histogram as plain values: what cores count, what shells export.

Pure: no clock, no metrics library. A core (the worker engine, the router's request-path
observer) bumps a :class:`HistogramCounter` from its own thread; the service shell reads the
frozen :class:`HistogramStats` at scrape time and turns it into a Prometheus histogram
(``edge.metrics_http.histogram_family``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

__all__ = ["HistogramCounter", "HistogramStats"]


@dataclass(frozen=True, slots=True)
class HistogramStats:
    """A histogram as plain values: ``counts[i]`` observations <= ``bounds[i]`` and above
    ``bounds[i-1]``; ``counts[-1]`` those above the last bound (len(bounds) + 1 counts)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    num: int


class HistogramCounter:
    """Fixed-bucket counts of observations (mutable; ``stats()`` is the frozen view)."""

    __slots__ = ("_counts", "_total", "bounds", "num")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.bounds, value)] += 1
        self._total += value
        self.num += 1

    def stats(self) -> HistogramStats:
        return HistogramStats(self.bounds, tuple(self._counts), self._total, self.num)
