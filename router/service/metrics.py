"""The router's Prometheus metrics: request-path instruments and a scrape-time collector.

Two sources, one registry per router (docs/METRICS.md lists every name):

* ``RouterMetrics`` implements the request path's observer hooks (observe.py): requests by
  worker / policy / outcome, route-decision latency, matched / best / forgone cached tokens
  at each decision, realised vs predicted cached tokens of finished requests, TTFT and e2e
  latency as the router sees them, retries.
* ``RouterStateCollector`` (``metrics_state.py``) reads the router's state at scrape time
  -- core.stats(), core.worker_stats(), the worker connections, the ejector -- as one
  snapshot of plain values taken on the event loop (``edge.metrics_http.call_on_loop``), and
  turns it into gauges and counters: index blocks and bytes, event batches by outcome, event lag,
  resyncs and snapshots, worker health and ejections, in-flight per worker.

"Cache left on the table": each decision knows the longest match on any worker it could have
picked (RouteDecision.best_matched_tokens). When the policy picks a worker with a shorter
match -- because the best one is loaded -- the difference is counted in
``kvroute_router_forgone_cached_tokens_total``. Next to it, for finished requests,
``kvroute_router_predicted_cached_tokens_total`` (what the router expected to be cached)
and ``kvroute_router_cached_prompt_tokens_total`` (what the worker reported: realised).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from edge.histogram import HistogramCounter, HistogramStats
from edge.metrics_http import (
    LATENCY_BUCKETS_S,
    MetricsEndpoint,
    call_on_loop,
    histogram_family,
)
from edge.metrics_http import counter_family as _counter
from kvroute_proto import kvroute_pb2 as pb
from router.core.router_core import RouteDecision
from router.service.metrics_state import (
    NO_WORKER,
    ConnectionStats,
    RouterSnapshot,
    RouterStateCollector,
    take_snapshot,
)
from router.service.observe import NO_OBSERVER

if TYPE_CHECKING:
    from router.service.server import RouterServer

__all__ = [
    "LATENCY_BUCKETS_S",
    "ROUTE_BUCKETS_S",
    "ConnectionStats",
    "DecisionCollector",
    "DecisionStats",
    "RouterMetrics",
    "RouterMetricsEndpoint",
    "RouterSnapshot",
    "RouterStateCollector",
    "take_snapshot",
]

# route() takes microseconds; the buckets resolve 1 us .. 10 ms
ROUTE_BUCKETS_S = (
    *(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5),
    *(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
)


@dataclass(slots=True)
class _Decisions:
    """One worker's route decisions as plain ints (the event loop adds, a scrape copies)."""

    num: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    event_matched_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DecisionStats:
    """The route decisions so far, as plain values (RouterMetrics.decision_stats)."""

    # worker -> (decisions, prompt, matched, of which event-confirmed)
    per_worker: dict[str, tuple[int, int, int, int]]
    best_matched_tokens: int
    forgone_tokens: int
    forgone_decisions: int
    route_seconds: HistogramStats


@dataclass(frozen=True, slots=True)
class _WorkerSeries:
    """One worker's children of RouterMetrics' per-worker families."""

    prompt_tokens: Counter
    cached_tokens: Counter
    predicted_tokens: Counter
    completion_tokens: Counter
    ttft: Histogram
    e2e: Histogram


class RouterMetrics:
    """The request path's observer (observe.RequestObserver), as Prometheus instruments."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # worker id -> its labelled children (workers come and go rarely; a few dozen)
        self._series: dict[str, _WorkerSeries] = {}
        # The route decision is the hot path: it counts into plain values, exported at
        # scrape time (DecisionCollector), with no lock and no prometheus call per request.
        self._decisions: dict[str, _Decisions] = {}
        self._route_seconds = HistogramCounter(ROUTE_BUCKETS_S)
        self._best_matched = 0
        self._forgone = 0
        self._forgone_decisions = 0
        self.requests = Counter(
            "kvroute_router_requests",
            "Generate requests by the last worker tried, policy and outcome (gRPC code name)",
            ("worker", "policy", "outcome"),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvroute_router_prompt_tokens",
            "Prompt tokens of finished requests (the worker's usage)",
            ("worker",),
            registry=registry,
        )
        self.cached_tokens = Counter(
            "kvroute_router_cached_prompt_tokens",
            "Prompt tokens of finished requests served from the worker's cache (realised)",
            ("worker",),
            registry=registry,
        )
        self.predicted_tokens = Counter(
            "kvroute_router_predicted_cached_tokens",
            "Of finished requests, the tokens the router expected cached when it routed them",
            ("worker",),
            registry=registry,
        )
        self.completion_tokens = Counter(
            "kvroute_router_completion_tokens",
            "Generated tokens of finished requests",
            ("worker",),
            registry=registry,
        )
        self.ttft = Histogram(
            "kvroute_router_time_to_first_token_seconds",
            "From the request's arrival at the router to the first relayed message",
            ("worker",),
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "kvroute_router_e2e_request_latency_seconds",
            "From the request's arrival at the router to the worker's Finished",
            ("worker",),
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.retries = Counter(
            "kvroute_router_retries",
            "Attempts that failed on a worker and were retried on another, by failing worker "
            "and code",
            ("worker", "code"),
            registry=registry,
        )

    # ---- observe.RequestObserver ---------------------------------------------------------

    def on_route(self, decision: RouteDecision, seconds: float) -> None:
        self._route_seconds.observe(seconds)
        d = self._decisions.get(decision.worker_id)
        if d is None:
            d = self._decisions[decision.worker_id] = _Decisions()
        d.num += 1
        d.prompt_tokens += decision.prompt_tokens
        d.matched_tokens += decision.matched_tokens
        d.event_matched_tokens += decision.event_matched_tokens
        self._best_matched += decision.best_matched_tokens
        forgone = decision.best_matched_tokens - decision.matched_tokens
        if forgone > 0:
            self._forgone += forgone
            self._forgone_decisions += 1

    def decision_stats(self) -> DecisionStats:
        """A copy of the decision counts (call on the event loop that routes)."""
        return DecisionStats(
            {
                w: (d.num, d.prompt_tokens, d.matched_tokens, d.event_matched_tokens)
                for w, d in self._decisions.items()
            },
            self._best_matched,
            self._forgone,
            self._forgone_decisions,
            self._route_seconds.stats(),
        )

    def on_first_message(self, worker_id: str, seconds: float) -> None:
        self._worker(worker_id).ttft.observe(seconds)

    def on_finished(self, decision: RouteDecision, finished: pb.Finished, seconds: float) -> None:
        w = self._worker(decision.worker_id)
        usage = finished.usage
        w.prompt_tokens.inc(usage.prompt_tokens)
        w.cached_tokens.inc(usage.cached_prompt_tokens)
        w.predicted_tokens.inc(decision.matched_tokens)
        w.completion_tokens.inc(usage.completion_tokens)
        w.e2e.observe(seconds)

    def _worker(self, worker_id: str) -> _WorkerSeries:
        """The worker's labelled children, made once (``labels()`` costs a lock and a
        tuple per call; this is a dict lookup on the request path)."""
        series = self._series.get(worker_id)
        if series is None:
            series = self._series[worker_id] = _WorkerSeries(
                self.prompt_tokens.labels(worker_id),
                self.cached_tokens.labels(worker_id),
                self.predicted_tokens.labels(worker_id),
                self.completion_tokens.labels(worker_id),
                self.ttft.labels(worker_id),
                self.e2e.labels(worker_id),
            )
        return series

    def on_retry(self, worker_id: str, code: str) -> None:
        self.retries.labels(worker_id, code).inc()

    def on_end(self, worker_id: str, policy: str, outcome: str) -> None:
        self.requests.labels(worker_id or NO_WORKER, policy, outcome).inc()


class DecisionCollector(Collector):
    """The route-decision counters and latency histogram, from RouterMetrics' plain values."""

    def __init__(self, stats: Callable[[], DecisionStats]) -> None:
        self._stats = stats

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        s = self._stats()
        labels = ("worker",)
        num = _counter(
            "kvroute_router_decisions",
            "Route decisions (a retry makes a second one), by chosen worker",
            labels,
        )
        prompt = _counter(
            "kvroute_router_decision_prompt_tokens",
            "Prompt tokens of routed requests, at the decision",
            labels,
        )
        matched = _counter(
            "kvroute_router_decision_matched_tokens",
            "Tokens the router expected cached on the chosen worker, at the decision "
            "(event-confirmed and predicted entries together)",
            labels,
        )
        by_source = _counter(
            "kvroute_router_decision_matched_tokens_by_source",
            "The same tokens by where the router learnt of them: the worker's own KV events "
            "(source=events) or the router's predictions for requests it routed there and "
            "whose events have not arrived (source=predicted)",
            ("worker", "source"),
        )
        for worker, (n, p, m, e) in sorted(s.per_worker.items()):
            num.add_metric([worker], n)
            prompt.add_metric([worker], p)
            matched.add_metric([worker], m)
            by_source.add_metric([worker, "events"], e)
            by_source.add_metric([worker, "predicted"], m - e)
        best = _counter(
            "kvroute_router_decision_best_matched_tokens",
            "Longest match on any worker the decision could have picked",
        )
        best.add_metric([], s.best_matched_tokens)
        forgone = _counter(
            "kvroute_router_forgone_cached_tokens",
            "Cached tokens left on the table: best match anywhere minus the chosen worker's, "
            "summed over decisions (the policy traded them for load balance)",
        )
        forgone.add_metric([], s.forgone_tokens)
        forgone_n = _counter(
            "kvroute_router_forgone_decisions",
            "Decisions that picked a worker with a shorter match than the best one",
        )
        forgone_n.add_metric([], s.forgone_decisions)
        yield from (num, prompt, matched, by_source, best, forgone, forgone_n)
        yield histogram_family(
            "kvroute_router_route_decision_duration_seconds",
            "Time the route decision takes (the front end's admission filter and "
            "RouterCore.route: index walk, cost, accounting)",
            [],
            [],
            s.route_seconds,
        )


class RouterMetricsEndpoint(MetricsEndpoint):
    """Metrics for one RouterServer: RouterMetrics hooked into the Frontend, the router's
    state and the decision counters read at scrape time, served on ``/metrics``. Kept outside
    RouterServer so a router without ``--metrics-port`` carries no metrics code at all.
    """

    def __init__(self, server: RouterServer, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port, server.config.tls)  # behind the router's own TLS
        self.server = server
        self.metrics = RouterMetrics(self.registry)

    def _collectors(self, loop: asyncio.AbstractEventLoop) -> list[Collector]:
        metrics = self.metrics
        return [
            RouterStateCollector.for_server(self.server, loop),
            DecisionCollector(lambda: call_on_loop(loop, metrics.decision_stats)),
        ]

    def _observe(self, on: bool) -> None:
        self.server.frontend.observer = self.metrics if on else NO_OBSERVER
