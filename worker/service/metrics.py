"""The worker's Prometheus metrics: request-path instruments and a scrape-time collector.

* ``WorkerMetrics`` implements the request path's observer hooks (observe.py): TTFT,
  inter-token latency and end-to-end latency histograms, requests by outcome.
* ``WorkerStateCollector`` reads, at scrape time and on the engine thread (the only thread
  that may touch the engine), ``engine.stats()``, the engine's queue-wait histogram and the
  event publisher's counters, and exports them: running / waiting requests, KV use, the
  cache's evictable / protected tokens, prefix-cache queried and hit tokens, prompt and
  generation tokens, queue wait, evictions, retractions, aborts, event batches published,
  replay-buffer misses. Between scrapes it costs the engine nothing.

Every series has a ``worker`` label (the worker id), so a dashboard can tell workers apart
whatever the scrape config calls the target. Names: docs/METRICS.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from edge.metrics_http import (
    LATENCY_BUCKETS_S,
    MetricsEndpoint,
    await_on_loop,
    counter_family,
    gauge_family,
    histogram_family,
)
from worker.engine.stats import EngineStats, HistogramStats
from worker.service.observe import NO_OBSERVER

if TYPE_CHECKING:
    from worker.service.server import WorkerServer

__all__ = [
    "WorkerMetrics",
    "WorkerMetricsEndpoint",
    "WorkerSnapshot",
    "WorkerStateCollector",
]

# inter-token latency: vLLM's time-per-output-token buckets
INTER_TOKEN_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075),
    *(0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
)


# (metric name, EngineStats attribute, help)
ENGINE_GAUGES = (
    ("kvroute_worker_running_requests", "num_running", "Requests admitted (prefill or decode)"),
    ("kvroute_worker_waiting_requests", "num_waiting", "Requests queued, not admitted yet"),
    ("kvroute_worker_kv_total_tokens", "num_total_kv_tokens", "KV slots (tokens) in the pool"),
    ("kvroute_worker_kv_used_tokens", "num_used_kv_tokens", "KV slots not free (owned or cached)"),
    ("kvroute_worker_kv_free_tokens", "num_free_kv_tokens", "KV slots free to allocate"),
    (
        "kvroute_worker_kv_evictable_tokens",
        "num_evictable_kv_tokens",
        "Cached tokens no running request uses (evictable)",
    ),
    (
        "kvroute_worker_kv_protected_tokens",
        "num_protected_kv_tokens",
        "Cached tokens protected from eviction (used by running requests)",
    ),
    (
        "kvroute_worker_kv_usage_ratio",
        "kv_usage",
        "Fraction of the KV pool held by running requests (evictable cache excluded)",
    ),
)
ENGINE_COUNTERS = (
    (
        "kvroute_worker_prefix_cache_queried_tokens",
        "prompt_tokens",
        "Prompt tokens looked up in the prefix cache (every accepted request)",
    ),
    (
        "kvroute_worker_prefix_cache_hit_tokens",
        "cached_prompt_tokens",
        "Prompt tokens found in the prefix cache at first admission",
    ),
    ("kvroute_worker_prompt_tokens", "prompt_tokens", "Prompt tokens of accepted requests"),
    (
        "kvroute_worker_computed_prefill_tokens",
        "computed_prefill_tokens",
        "Tokens prefilled (recomputation after retraction included)",
    ),
    ("kvroute_worker_generation_tokens", "generated_tokens", "Tokens generated"),
    ("kvroute_worker_accepted_requests", "num_requests", "Requests the engine accepted"),
    (
        "kvroute_worker_finished_requests",
        "num_finished",
        "Requests that finished (stop, length, max_context)",
    ),
    (
        "kvroute_worker_aborted_requests",
        "num_aborted",
        "Requests aborted (a client, a router, a cancelled call)",
    ),
    (
        "kvroute_worker_retractions",
        "num_retractions",
        "Running requests retracted to free KV (recomputed later)",
    ),
    (
        "kvroute_worker_evicted_tokens",
        "num_evicted_tokens",
        "Cached tokens evicted from the prefix cache",
    ),
    ("kvroute_worker_engine_steps", "num_steps", "Engine steps (scheduling iterations)"),
)
# (metric name, WorkerSnapshot attribute, help)
PUBLISHER_COUNTERS = (
    (
        "kvroute_worker_event_batches_published",
        "num_published",
        "KV event batches published (events or load reports)",
    ),
    (
        "kvroute_worker_event_replays",
        "num_replays",
        "Resubscriptions answered from the replay buffer",
    ),
    (
        "kvroute_worker_event_replay_misses",
        "num_replay_misses",
        "Resubscriptions of this epoch the replay buffer no longer covered (snapshot sent)",
    ),
)


class WorkerMetrics:
    """The request path's observer (observe.GenerationObserver) for one worker."""

    def __init__(self, registry: CollectorRegistry, worker_id: str) -> None:
        labels = ("worker",)
        self.ttft = Histogram(
            "kvroute_worker_time_to_first_token_seconds",
            "From the request's arrival at the worker to its first generated tokens",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ).labels(worker_id)
        self.inter_token = Histogram(
            "kvroute_worker_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request (a chunk of n tokens "
            "counts n observations of its gap / n)",
            labels,
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=registry,
        ).labels(worker_id)
        self.e2e = Histogram(
            "kvroute_worker_e2e_request_latency_seconds",
            "From the request's arrival at the worker to its end",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ).labels(worker_id)
        self._requests = Counter(
            "kvroute_worker_requests",
            "Generate requests that ended, by outcome (stop, length, max_context, abort: "
            "finish reasons; cancelled: the caller went away; error)",
            ("worker", "outcome"),
            registry=registry,
        )
        self._worker_id = worker_id

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, num_tokens: int, seconds: float) -> None:
        per_token = seconds / num_tokens
        for _ in range(num_tokens):
            self.inter_token.observe(per_token)

    def on_end(self, outcome: str, seconds: float) -> None:
        self._requests.labels(self._worker_id, outcome).inc()
        self.e2e.observe(seconds)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What the collector exports, read on the engine thread in one go."""

    engine: EngineStats
    queue_wait: HistogramStats
    num_published: int
    num_replays: int
    num_replay_misses: int
    last_seq: int


_WORKER = ("worker",)


class WorkerStateCollector(Collector):
    """Engine, cache and event-stream state read at scrape time."""

    def __init__(self, snapshot: Callable[[], WorkerSnapshot], worker_id: str) -> None:
        self._snapshot = snapshot
        self._worker_id = worker_id

    @classmethod
    def for_server(
        cls, server: WorkerServer, loop: asyncio.AbstractEventLoop
    ) -> WorkerStateCollector:
        engine = server.engine
        publisher = server.runner.publisher

        def read() -> WorkerSnapshot:  # runs on the engine thread
            return WorkerSnapshot(
                engine.stats(),
                engine.queue_wait_stats(),
                publisher.num_published,
                publisher.num_replays,
                publisher.num_replay_misses,
                publisher.last_seq,
            )

        worker_id = server.config.engine.worker_id
        return cls(lambda: await_on_loop(loop, lambda: server.runner.call(read)), worker_id)

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        snap = self._snapshot()
        s = snap.engine
        w = [self._worker_id]
        tables = (
            (gauge_family, ENGINE_GAUGES, s),
            (counter_family, ENGINE_COUNTERS, s),
            (counter_family, PUBLISHER_COUNTERS, snap),
        )
        for family, table, source in tables:
            for name, attr, doc in table:
                f = family(name, doc, _WORKER)
                f.add_metric(w, getattr(source, attr))
                yield f
        last_seq = gauge_family(
            "kvroute_worker_event_last_seq", "Seq of the last published batch", _WORKER
        )
        last_seq.add_metric(w, snap.last_seq)
        yield last_seq
        yield histogram_family(
            "kvroute_worker_queue_wait_seconds",
            "From the engine accepting a request to its first prefill step",
            ["worker"],
            w,
            snap.queue_wait,
        )


class WorkerMetricsEndpoint(MetricsEndpoint):
    """Metrics for one WorkerServer: WorkerMetrics hooked into its WorkerGeneration (every
    front door) and the engine state read at scrape time, served on ``/metrics``."""

    def __init__(self, server: WorkerServer, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port, server.config.tls)  # behind the worker's own TLS
        self.server = server
        self.metrics = WorkerMetrics(self.registry, server.config.engine.worker_id)

    def _collectors(self, loop: asyncio.AbstractEventLoop) -> list[Collector]:
        return [WorkerStateCollector.for_server(self.server, loop)]

    def _observe(self, on: bool) -> None:
        self.server.servicer.generation.observer = self.metrics if on else NO_OBSERVER
