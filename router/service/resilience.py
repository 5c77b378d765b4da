"""Reconnect backoff and per-worker outlier ejection.

Sans-I/O: imports neither asyncio, grpc nor a clock. The clock and the random generator are
injected, so tests (and the simulator) are exact.

Outlier ejection counts only failures that say something about the *worker*: transport
errors (UNAVAILABLE, a broken stream) and internal errors (INTERNAL, UNKNOWN, DATA_LOSS).
Request-level answers -- INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED --
are the worker working as designed and are passed through to the client, uncounted. After
``max_consecutive_failures`` counted failures in a row the worker is ejected (not routed to)
for ``cooldown_s``; any success resets its count. Calls that fail together (they were all
in flight when the first of them failed, as every stream on one connection is when it
resets) count once. When the cooldown ends it is routable again, on probation: one more
failure ejects it again at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    """Exponential backoff with full jitter: delay_k ~ U(0, min(max_s, initial_s * mult**k))."""

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(
                f"backoff initial_s must be in (0, max_s={self.max_s}], got {self.initial_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"backoff multiplier must be >= 1, got {self.multiplier}")


@dataclass(slots=True)
class Backoff:
    """The delay before the next reconnect attempt; ``reset()`` after a success."""

    config: BackoffConfig
    rng: random.Random
    num_failures: int = 0

    def next_delay(self) -> float:
        """Delay for the next attempt (bounded by ``config.max_s``) and count the failure."""
        cap = min(
            self.config.max_s,
            self.config.initial_s * self.config.multiplier ** min(self.num_failures, 64),
        )
        self.num_failures += 1
        # Full jitter, but never below a tenth of the cap: replicas spread out, none spin.
        return cap * (0.1 + 0.9 * self.rng.random())

    def reset(self) -> None:
        self.num_failures = 0


@dataclass(frozen=True, slots=True)
class EjectionConfig:
    """Eject a worker for ``cooldown_s`` after ``max_consecutive_failures`` failures."""

    max_consecutive_failures: int = 3
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be >= 1, got {self.max_consecutive_failures}"
            )
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")


@dataclass(slots=True)
class _WorkerRecord:
    consecutive_failures: int = 0
    ejected_until: float | None = None
    last_failure_at: float | None = None  # when the last counted failure happened


@dataclass(slots=True)
class OutlierEjector:
    """Per-worker consecutive-failure counters and ejection deadlines."""

    config: EjectionConfig
    clock: Callable[[], float]
    _workers: dict[str, _WorkerRecord] = field(default_factory=dict)
    num_ejections: int = 0

    def record_success(self, worker_id: str) -> None:
        rec = self._workers.get(worker_id)
        if rec is not None:
            rec.consecutive_failures = 0
            rec.ejected_until = None

    def record_failure(self, worker_id: str, started_at: float | None = None) -> bool:
        """Count a failure of a call sent at ``started_at``; True when it ejects the worker.

        A call that was already in flight when the last counted failure happened fails with
        it (one connection reset ends every stream on it at once): it is the same incident
        and is not counted again, so one reset cannot eject a healthy worker by itself."""
        rec = self._workers.setdefault(worker_id, _WorkerRecord())
        if (
            started_at is not None
            and rec.last_failure_at is not None
            and started_at <= rec.last_failure_at
        ):
            return False
        rec.last_failure_at = self.clock()
        rec.consecutive_failures += 1
        if rec.consecutive_failures < self.config.max_consecutive_failures:
            return False
        already = self.is_ejected(worker_id)
        rec.ejected_until = self.clock() + self.config.cooldown_s
        # Stay one failure short of the threshold: after the cooldown, the next failure
        # ejects again at once (probation), a success clears everything.
        rec.consecutive_failures = self.config.max_consecutive_failures - 1
        if not already:
            self.num_ejections += 1
        return not already

    def is_ejected(self, worker_id: str) -> bool:
        rec = self._workers.get(worker_id)
        return (
            rec is not None and rec.ejected_until is not None and self.clock() < rec.ejected_until
        )

    def ejected(self) -> frozenset[str]:
        """Workers currently ejected."""
        return frozenset(w for w in self._workers if self.is_ejected(w))

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
