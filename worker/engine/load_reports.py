"""When a worker sends a load report between its periodic ones (``kvroute worker
--step-reports``).

Router replicas that do not share their picks learn a worker's queue only from its load
reports. A periodic report can be a whole interval late, and the worker service builds every
report on its engine thread, behind the step in flight -- a long prefill delays it further.
With step reports the worker also reports

- at the start of a step (the batch scheduled, before the forward pass) when requests arrived
  since its last report or the step starts prefilling a request: the report then counts the
  step's own prefill as still to compute, so every router hears of a long prompt while it
  runs, not after;
- after a step that left the queue at most half of what the last report said (and at least
  ``DRAIN_MIN_TOKENS`` less): routers stop steering around a queue that has drained.

Pure: imports neither asyncio, grpc, torch nor a clock. The caller publishes what the methods
return and tells :meth:`StepReports.published` of every load report it sends (periodic ones
too), on the engine's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvroute_proto.events import LoadReport
    from worker.engine.engine import Engine

# A drop smaller than this (tokens) is not news: about one chunk of a short prompt.
DRAIN_MIN_TOKENS = 1024


class StepReports:
    """Decides the reports around one engine's steps (see the module docstring)."""

    __slots__ = ("_engine", "_queued", "_requests")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._requests = 0  # the engine's request count at the last report sent
        self._queued = 0  # the queued prefill tokens that report said

    def published(self, report: LoadReport) -> None:
        """A load report of this engine was sent (a step report or a periodic one)."""
        self._requests = self._engine.scheduler.counters.num_requests
        self._queued = report.num_queued_prefill_tokens

    def at_step_start(self) -> LoadReport | None:
        """Call between scheduling and the forward pass (``Engine.step(before_forward=)``):
        the report to send now, or None."""
        engine = self._engine
        arrived = engine.scheduler.counters.num_requests != self._requests
        if not (arrived or engine.step_prefill_tokens):
            return None
        return engine.load_report()

    def after_step(self) -> LoadReport | None:
        """Call once a step is done: the report to send with its events, or None."""
        if self._queued <= 0:
            return None
        report = self._engine.load_report()
        drop = self._queued - report.num_queued_prefill_tokens
        return report if drop >= max(DRAIN_MIN_TOKENS, self._queued / 2) else None
