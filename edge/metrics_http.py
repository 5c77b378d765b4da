"""The /metrics endpoint of a router or worker, and reading loop-owned state at scrape time.

Both processes keep their state on one thread (the router's event loop, the worker's engine
thread), which nothing else may touch. prometheus-client serves ``/metrics`` from its own
thread, so a collector that needs that state asks the owning thread for a snapshot of plain
values and waits for it (bounded): scrapes cost the request path nothing between scrapes.

Usage (a service shell): subclass :class:`MetricsEndpoint` with the service's scrape-time
collectors and request-path observer::

    class MyEndpoint(MetricsEndpoint):
        def _collectors(self, loop): return [MyStateCollector(...)]
        def _observe(self, on): service.observer = self.metrics if on else NO_OBSERVER

    endpoint = MyEndpoint("127.0.0.1", 9100)
    port = endpoint.start()   # on the service's event loop; port 0 picks a free one
    ...
    endpoint.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from edge.histogram import HistogramStats
from edge.tls import ServerTls

__all__ = [
    "LATENCY_BUCKETS_S",
    "SNAPSHOT_TIMEOUT_S",
    "MetricsEndpoint",
    "MetricsHttpServer",
    "await_on_loop",
    "call_on_loop",
    "counter_family",
    "gauge_family",
    "histogram_family",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# request latencies (TTFT, e2e) of both services: vLLM's TTFT buckets, up to 10 minutes
LATENCY_BUCKETS_S = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
)
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


def gauge_family(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    """An empty gauge family with these label names (``add_metric`` fills it)."""
    return GaugeMetricFamily(name, doc, labels=list(labels))


def counter_family(name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
    """An empty counter family with these label names (``add_metric`` fills it)."""
    return CounterMetricFamily(name, doc, labels=list(labels))


class MetricsHttpServer:
    """prometheus-client's HTTP exposition server for one registry, stoppable."""

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, tls: ServerTls | None = None
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.registry = registry
        self.tls = tls  # HTTPS with the service's certificate (and client CA: mutual TLS)
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._server: object | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'http' if self.tls is None else 'https'}://{self.address}/metrics"

    def start(self) -> int:
        """Bind and serve ``/metrics`` on a daemon thread; returns the bound port (OSError
        naming the address when it cannot bind)."""
        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {
                "certfile": self.tls.cert_file,
                "keyfile": self.tls.key_file,
                "client_cafile": self.tls.client_ca_file,
                "client_auth_required": self.tls.mutual,
            }
        try:
            server, thread = start_http_server(self.requested_port, self.host, self.registry, **tls)
        except OSError as exc:
            address = f"{self.host}:{self.requested_port}"
            raise OSError(f"could not serve metrics on {address}: {exc.strerror or exc}") from None
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        log.info("metrics on %s", self.url)
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


class MetricsEndpoint:
    """A service's metrics: one registry, served on ``/metrics`` (the router's and the
    worker's endpoints are subclasses).

    ``start()`` (on the service's event loop, after the service started) registers the
    subclass's scrape-time collectors, hooks its observer into the request path and binds the
    HTTP server; ``stop()`` unhooks the observer and stops serving. A service started without
    a metrics port builds none of this.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, tls: ServerTls | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.http = MetricsHttpServer(self.registry, host, port, tls)

    @property
    def port(self) -> int | None:
        return self.http.port

    @property
    def url(self) -> str:
        return self.http.url

    def _collectors(self, loop: asyncio.AbstractEventLoop) -> list[Collector]:
        """The scrape-time collectors, reading state owned by ``loop`` (or its threads)."""
        raise NotImplementedError

    def _observe(self, on: bool) -> None:
        """Hook the request-path observer in (``on``) or put the no-op one back."""
        raise NotImplementedError

    def start(self) -> int:
        """Register the collectors, observe the request path, serve; returns the port."""
        loop = asyncio.get_running_loop()
        for collector in self._collectors(loop):
            self.registry.register(collector)
        self._observe(True)
        return self.http.start()

    def stop(self) -> None:
        self._observe(False)
        self.http.stop()
