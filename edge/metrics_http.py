"""The /metrics endpoint of a router or worker, and reading loop-owned state at scrape time.

Both processes keep their state on one thread (the router's event loop, the worker's engine
thread), which nothing else may touch. prometheus-client serves ``/metrics`` from its own
thread, so a collector that needs that state asks the owning thread for a snapshot of plain
values and waits for it (bounded): scrapes cost the request path nothing between scrapes.

Usage (a service shell)::

    registry = CollectorRegistry()
    ... instruments and collectors registered on it ...
    server = MetricsHttpServer(registry, "127.0.0.1", 9100)
    port = server.start()     # port 0 picks a free one
    ...
    server.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import HistogramMetricFamily

from edge.histogram import HistogramStats

__all__ = [
    "SNAPSHOT_TIMEOUT_S",
    "MetricsHttpServer",
    "await_on_loop",
    "call_on_loop",
    "histogram_family",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

SNAPSHOT_TIMEOUT_S = 2.0  # a scrape waits this long for the owning thread's snapshot


def call_on_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout_s: float = SNAPSHOT_TIMEOUT_S
) -> T:
    """Run ``fn`` on ``loop``'s thread and return its result (directly when called there).

    Raises TimeoutError when the loop does not run it within ``timeout_s`` (a blocked loop:
    the scrape fails rather than hanging the metrics thread)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return fn()
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no state snapshot within {timeout_s} s (event loop busy)") from None


def await_on_loop(
    loop: asyncio.AbstractEventLoop,
    make: Callable[[], Coroutine[object, object, T]],
    timeout_s: float = SNAPSHOT_TIMEOUT_S,
) -> T:
    """Run the coroutine ``make()`` on ``loop`` from another thread and wait for its result
    (TimeoutError after ``timeout_s``; RuntimeError when called on the loop's own thread,
    where waiting would deadlock)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("await_on_loop called on the loop's own thread")
    future = asyncio.run_coroutine_threadsafe(make(), loop)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no state snapshot within {timeout_s} s (engine busy)") from None


def histogram_family(
    name: str, doc: str, labels: list[str], values: list[str], h: HistogramStats
) -> HistogramMetricFamily:
    """A Prometheus histogram from plain bucket counts (cumulative, with +Inf)."""
    family = HistogramMetricFamily(name, doc, labels=labels)
    buckets = []
    total = 0
    for bound, n in zip((*h.bounds, float("inf")), h.counts, strict=True):
        total += n
        buckets.append((str(bound) if bound != float("inf") else "+Inf", total))
    family.add_metric(values, buckets, h.total)
    return family


class MetricsHttpServer:
    """prometheus-client's HTTP exposition server for one registry, stoppable."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.registry = registry
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._server: object | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        """Bind and serve ``/metrics`` on a daemon thread; returns the bound port (OSError
        naming the address when it cannot bind)."""
        try:
            server, thread = start_http_server(self.requested_port, self.host, self.registry)
        except OSError as exc:
            address = f"{self.host}:{self.requested_port}"
            raise OSError(f"could not serve metrics on {address}: {exc.strerror or exc}") from None
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        log.info("metrics on http://%s/metrics", self.address)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # type: ignore[attr-defined]
        server.server_close()  # type: ignore[attr-defined]
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
