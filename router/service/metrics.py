"""The router's Prometheus metrics: request-path instruments and a scrape-time collector.

Two sources, one registry per router (docs/METRICS.md lists every name):

* ``RouterMetrics`` implements the request path's observer hooks (observe.py): requests by
  worker / policy / outcome, route-decision latency, matched / best / forgone cached tokens
  at each decision, realised vs predicted cached tokens of finished requests, TTFT and e2e
  latency as the router sees them, retries.
* ``RouterStateCollector`` reads the router's state at scrape time -- core.stats(),
  core.worker_stats(), the worker connections, the ejector -- as one snapshot of plain
  values taken on the event loop (``edge.metrics_http.call_on_loop``), and turns it
  into gauges and counters: index blocks and bytes, event batches by outcome, event lag,
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from edge.histogram import HistogramCounter, HistogramStats
from edge.metrics_http import MetricsHttpServer, call_on_loop, histogram_family
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import LoadReport
from router.core.router_core import RouteDecision, RouterStats, WorkerStats
from router.service.observe import NO_OBSERVER
from router.service.replica_sync import COUNTER_NAMES
from router.service.token_cache import CachedTokenizer

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

NO_WORKER = "none"  # the worker label of a request refused before a worker was chosen

# route() takes microseconds; the buckets resolve 1 us .. 10 ms
ROUTE_BUCKETS_S = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    1e-2,
)
# request latencies (TTFT, e2e): the buckets vLLM uses for TTFT, up to 10 minutes
LATENCY_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)

# router.core.sync counter -> the outcome label of kvroute_router_event_batches_total
BATCH_OUTCOMES = {
    "applied": "applied",
    "duplicate": "duplicate",
    "out_of_order": "gap",
    "pending_overflow": "overflow",
}


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


# ---- scrape-time state -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionStats:
    """One worker connection's counters (router.service.worker_conn)."""

    address: str
    worker_id: str  # "" before the worker identified itself
    healthy: bool
    num_connects: int
    num_failures: int
    num_messages: int
    num_resubscribes: int
    num_purges: int


@dataclass(frozen=True, slots=True)
class RouterSnapshot:
    """Everything the collector exports, read on the event loop in one go."""

    policy: str
    stats: RouterStats
    workers: tuple[WorkerStats, ...]
    connections: tuple[ConnectionStats, ...]
    ejected: frozenset[str]
    num_ejections: int
    num_retries: int
    num_inflight: int
    # the text tokenizer's chunk cache (token_cache.CachedTokenizer), when the router has one
    chunks: tuple[int, int] = (0, 0)  # chunks taken from the cache, chunks tokenized
    text_prompts: tuple[int, int] = (0, 0)  # tokenized whole, head only (tail to the worker)
    # replica sync (router/service/replica_sync.py): its counters and live peers; None when off
    replica: dict[str, int] | None = None
    replica_peers: int = 0
    # how long an own pick counts --replicas times (RouterCore.replica_sync_window_s; 0 when
    # it always does, without sync) and the sync's last measured delivery time (0: none yet)
    replica_window_s: float = 0.0
    replica_delivery_s: float = 0.0


def take_snapshot(server: RouterServer) -> RouterSnapshot:
    """Read the router's state (call on its event loop)."""
    frontend = server.frontend
    sync = server.replica_sync
    conns = tuple(
        ConnectionStats(
            c.address,
            c.worker_id or "",
            c.healthy,
            c.num_connects,
            c.num_failures,
            c.num_messages,
            c.num_resubscribes,
            c.num_purges,
        )
        for c in server.pool.conns.values()
    )
    return RouterSnapshot(
        policy=server.core.policy_name,
        stats=server.core.stats(),
        workers=tuple(server.core.worker_stats()),
        connections=conns,
        ejected=frontend.ejector.ejected(),
        num_ejections=frontend.ejector.num_ejections,
        num_retries=frontend.num_retries,
        num_inflight=frontend.num_inflight,
        replica=None if sync is None else dict(sync.counters),
        replica_peers=0 if sync is None else len(sync.peers),
        replica_window_s=_finite(server.core.replica_sync_window_s),
        replica_delivery_s=0.0 if sync is None else sync.last_delivery_s or 0.0,
        **_tokenizer_counts(frontend.tokenizer),
    )


def _finite(x: float) -> float:
    return x if x != float("inf") else 0.0


def _tokenizer_counts(tok: object) -> dict[str, tuple[int, int]]:
    if not isinstance(tok, CachedTokenizer):
        return {}
    return {
        "chunks": (tok.num_hits, tok.num_misses),
        "text_prompts": (tok.num_whole, tok.num_split),
    }


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _kv_usage(load: LoadReport) -> float:
    total = load.num_total_kv_tokens
    if total <= 0:
        return 0.0
    busy = total - load.num_free_kv_tokens - load.num_evictable_kv_tokens
    return max(busy, 0) / total


_NO_REPLICA_COUNTERS: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)


class RouterStateCollector(Collector):
    """Gauges and counters read from a snapshot of the router's state at scrape time."""

    def __init__(self, snapshot: Callable[[], RouterSnapshot]) -> None:
        self._snapshot = snapshot

    @classmethod
    def for_server(
        cls, server: RouterServer, loop: asyncio.AbstractEventLoop
    ) -> RouterStateCollector:
        return cls(lambda: call_on_loop(loop, lambda: take_snapshot(server)))

    def describe(self) -> list[object]:
        return []  # names are produced at collect time; no describe-time snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        yield from self._index(snap)
        yield from self._workers(snap)
        yield from self._events(snap)
        yield from self._frontend(snap)
        yield from self._replica(snap)

    def _index(self, snap: RouterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = snap.stats
        blocks = _gauge("kvroute_router_index_blocks", "Distinct blocks in the prefix index")
        blocks.add_metric([], s.num_indexed_blocks)
        entries = _gauge(
            "kvroute_router_index_entries", "Confirmed (block, worker) pairs in the prefix index"
        )
        entries.add_metric([], s.num_index_entries)
        predicted = _gauge(
            "kvroute_router_index_predicted_entries",
            "Predicted (block, worker) pairs (routed, not yet confirmed by an event)",
        )
        predicted.add_metric([], s.num_predicted_entries)
        size = _gauge("kvroute_router_index_bytes", "Estimated memory of the prefix index")
        size.add_metric([], s.index_bytes)
        evicted = _counter(
            "kvroute_router_index_evicted_blocks", "Blocks dropped by the index's size cap"
        )
        evicted.add_metric([], s.num_evicted_blocks)
        errors = _counter(
            "kvroute_router_event_apply_errors",
            "KV events that could not be applied as sent (counted, never fatal), by kind",
            ("kind",),
        )
        for kind, n in sorted(s.apply_errors.items()):
            errors.add_metric([kind], n)
        routed = _counter("kvroute_router_routed_requests", "Requests RouterCore.route placed")
        routed.add_metric([], s.num_routed)
        yield from (blocks, entries, predicted, size, evicted, errors, routed)

    def _workers(self, snap: RouterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ("worker",)
        healthy = _gauge(
            "kvroute_router_worker_healthy",
            "1 while the router's connection to the worker is up and it is not ejected",
            labels,
        )
        ejected = _gauge(
            "kvroute_router_worker_ejected",
            "1 while the worker is ejected after consecutive failures",
            labels,
        )
        inflight = _gauge(
            "kvroute_router_worker_inflight_requests",
            "Requests routed to the worker and not finished",
            labels,
        )
        prefill = _gauge(
            "kvroute_router_worker_inflight_prefill_tokens",
            "Uncached prompt tokens routed to the worker that have not produced a token yet",
            labels,
        )
        blocks = _gauge(
            "kvroute_router_worker_index_blocks",
            "Blocks the index holds for the worker (confirmed by its events)",
            labels,
        )
        running = _gauge(
            "kvroute_router_worker_running_requests",
            "Running requests, from the worker's last load report",
            labels,
        )
        waiting = _gauge(
            "kvroute_router_worker_waiting_requests",
            "Waiting requests, from the worker's last load report",
            labels,
        )
        cap = _gauge(
            "kvroute_router_worker_max_running_requests",
            "The worker's stated cap on running requests (GetLoad; 0: none stated): past it "
            "requests wait for a slot, which the cost charges",
            labels,
        )
        kv_usage = _gauge(
            "kvroute_router_worker_kv_usage_ratio",
            "Fraction of the worker's KV pool held by running requests (last load report)",
            labels,
        )
        for w in snap.workers:
            is_ejected = w.worker_id in snap.ejected
            healthy.add_metric([w.worker_id], float(w.healthy and not is_ejected))
            ejected.add_metric([w.worker_id], float(is_ejected))
            inflight.add_metric([w.worker_id], w.num_active_requests)
            prefill.add_metric([w.worker_id], w.inflight_prefill_tokens)
            blocks.add_metric([w.worker_id], w.num_indexed_blocks)
            cap.add_metric([w.worker_id], w.max_running)
            if w.load is not None:
                running.add_metric([w.worker_id], w.load.num_running)
                waiting.add_metric([w.worker_id], w.load.num_waiting)
                kv_usage.add_metric([w.worker_id], _kv_usage(w.load))
        workers = _gauge("kvroute_router_workers", "Known workers by state", ("state",))
        num_healthy = sum(1 for w in snap.workers if w.healthy and w.worker_id not in snap.ejected)
        workers.add_metric(["healthy"], num_healthy)
        workers.add_metric(["unhealthy"], len(snap.workers) - num_healthy)
        ejections = _counter(
            "kvroute_router_worker_ejections", "Times a worker was ejected after failures"
        )
        ejections.add_metric([], snap.num_ejections)
        yield from (healthy, ejected, inflight, prefill, blocks, running, waiting, cap, kv_usage)
        yield from (workers, ejections)

    def _events(self, snap: RouterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ("worker",)
        batches = _counter(
            "kvroute_router_event_batches",
            "KV event batches received, by worker and outcome (applied, duplicate, gap: "
            "ahead of a missing one and buffered, overflow: the gap buffer overflowed)",
            ("worker", "outcome"),
        )
        epochs = _counter(
            "kvroute_router_event_epoch_changes",
            "Stream messages from another epoch than the one synced (a worker restart or a "
            "stale message from a dead process): the worker's entries are purged",
            labels,
        )
        snapshots = _counter(
            "kvroute_router_event_snapshots",
            "Snapshots received, by outcome (applied, stale: older than the stream position)",
            ("worker", "outcome"),
        )
        resyncs = _counter(
            "kvroute_router_event_resyncs",
            "Resubscriptions the router asked for (a gap, a lost replay, an overflow)",
            labels,
        )
        lag = _gauge(
            "kvroute_router_event_lag_seconds",
            "Seconds since the worker's event stream last delivered a message (workers send "
            "a load report every load interval, so this stays near it while in sync)",
            labels,
        )
        last_seq = _gauge(
            "kvroute_router_event_last_seq", "Seq of the last applied event batch", labels
        )
        for w in snap.workers:
            c = w.sync_counters
            for key, outcome in BATCH_OUTCOMES.items():
                batches.add_metric([w.worker_id, outcome], c.get(key, 0))
            epochs.add_metric([w.worker_id], c.get("new_epoch", 0))
            snapshots.add_metric([w.worker_id, "applied"], c.get("snapshot", 0))
            snapshots.add_metric([w.worker_id, "stale"], c.get("stale_snapshot", 0))
            resyncs.add_metric([w.worker_id], c.get("resubscribe", 0))
            last_seq.add_metric([w.worker_id], w.last_seq)
            if w.seconds_since_message is not None:
                lag.add_metric([w.worker_id], max(w.seconds_since_message, 0.0))
        conn_labels = ("worker", "address")
        connects = _counter(
            "kvroute_router_worker_connects", "Successful (re)connections to a worker", conn_labels
        )
        failures = _counter(
            "kvroute_router_worker_connection_failures",
            "Connection or event-stream failures (each one marks the worker unhealthy)",
            conn_labels,
        )
        purges = _counter(
            "kvroute_router_worker_purges",
            "Times an unreachable worker's index entries were dropped",
            conn_labels,
        )
        for conn in snap.connections:
            conn_key = [conn.worker_id or NO_WORKER, conn.address]
            connects.add_metric(conn_key, conn.num_connects)
            failures.add_metric(conn_key, conn.num_failures)
            purges.add_metric(conn_key, conn.num_purges)
        yield from (batches, epochs, snapshots, resyncs, lag, last_seq, connects, failures, purges)

    def _frontend(self, snap: RouterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        inflight = _gauge(
            "kvroute_router_inflight_requests", "Generate calls admitted and not yet ended"
        )
        inflight.add_metric([], snap.num_inflight)
        info = _gauge("kvroute_router_info", "Router settings (value 1)", ("policy",))
        info.add_metric([snap.policy], 1)
        chunks = _counter(
            "kvroute_router_tokenizer_chunks",
            "Text chunks of prompts: taken from the router's chunk cache (hit) or tokenized (miss)",
            ("result",),
        )
        chunks.add_metric(["hit"], snap.chunks[0])
        chunks.add_metric(["miss"], snap.chunks[1])
        prompts = _counter(
            "kvroute_router_text_prompts",
            "Long text prompts (over two chunks) the router tokenized whole, or only as far "
            "as a cache could match them (the worker tokenized the rest); 0 with "
            "--tokenize-whole",
            ("tokenized",),
        )
        prompts.add_metric(["whole"], snap.text_prompts[0])
        prompts.add_metric(["head"], snap.text_prompts[1])
        yield from (inflight, info, chunks, prompts)

    def _replica(self, snap: RouterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        inflight = _gauge(
            "kvroute_router_replica_inflight_requests",
            "Requests other router replicas placed that this router counts in flight "
            "(replica sync; 0 without it)",
        )
        inflight.add_metric([], snap.stats.num_replica_inflight)
        yield inflight
        # without --replica-sync every family is exported at zero (dashboards stay valid)
        c = snap.replica if snap.replica is not None else _NO_REPLICA_COUNTERS
        peers = _gauge("kvroute_router_replica_peers", "Other router replicas heard from")
        peers.add_metric([], snap.replica_peers)
        events = _counter(
            "kvroute_router_replica_events",
            "Replica sync events: this router's published or dropped (queue full, Redis "
            "down), the others' applied, ignored (unknown worker, already counted) or "
            "over_limit (past max_peer_requests)",
            ("result",),
        )
        for result in ("published", "dropped", "applied", "ignored", "over_limit"):
            events.add_metric([result], c[f"events_{result}"])
        batches = _counter(
            "kvroute_router_replica_batches",
            "Replica sync batches published, received from peers, or refused as malformed",
            ("result",),
        )
        batches.add_metric(["published"], c["batches_published"])
        batches.add_metric(["received"], c["batches_received"])
        batches.add_metric(["malformed"], c["batches_malformed"])
        forgot = _counter(
            "kvroute_router_replica_requests_forgotten",
            "Peers' requests dropped uncounted (a gap in a peer's batches, its silence or "
            "shutdown, this router's broken subscription)",
        )
        forgot.add_metric([], c["requests_dropped"])
        gaps = _counter("kvroute_router_replica_gaps", "Gaps in a peer's batch sequence numbers")
        gaps.add_metric([], c["gaps"])
        window = _gauge(
            "kvroute_router_replica_sync_window_seconds",
            "How long this router counts an own pick --replicas times before counting it once "
            "(--replica-sync-window-s; auto follows the sync's delivery time; 0 without sync)",
        )
        window.add_metric([], snap.replica_window_s)
        delivery = _gauge(
            "kvroute_router_replica_sync_delivery_seconds",
            "The replica sync's last measured delivery time: from queueing a batch to Redis "
            "echoing it back (0 until measured, and without sync)",
        )
        delivery.add_metric([], snap.replica_delivery_s)
        yield from (peers, events, batches, forgot, gaps, window, delivery)


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


class RouterMetricsEndpoint:
    """Metrics for one RouterServer: instruments its request path and serves ``/metrics``.

    ``start()`` (on the router's event loop, after the server started) hooks RouterMetrics
    into the Frontend and binds the HTTP endpoint; ``stop()`` undoes both. Kept outside
    RouterServer so a router without ``--metrics-port`` carries no metrics code at all.
    """

    def __init__(self, server: RouterServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.http = MetricsHttpServer(self.registry, host, port)

    @property
    def port(self) -> int | None:
        return self.http.port

    @property
    def url(self) -> str:
        return f"http://{self.http.address}/metrics"

    def start(self) -> int:
        """Register the state collector, observe the request path, serve; returns the port."""
        loop = asyncio.get_running_loop()
        self.registry.register(RouterStateCollector.for_server(self.server, loop))
        metrics = self.metrics
        self.registry.register(
            DecisionCollector(lambda: call_on_loop(loop, metrics.decision_stats))
        )
        self.server.frontend.observer = metrics
        return self.http.start()

    def stop(self) -> None:
        self.server.frontend.observer = NO_OBSERVER
        self.http.stop()
