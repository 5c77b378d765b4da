"""The router's state at scrape time: ``take_snapshot`` reads core.stats(),
core.worker_stats(), the worker connections, the ejector, the tokenizer's chunk cache and the
replica sync as one snapshot of plain values on the event loop
(``edge.metrics_http.call_on_loop``), and ``RouterStateCollector`` turns it into gauges and
counters: index blocks and bytes, event batches by outcome, event lag, resyncs and snapshots,
worker health and ejections, in-flight per worker, replica sync. Between scrapes it costs the
request path nothing. Names: docs/METRICS.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edge.metrics_http import call_on_loop
from edge.metrics_http import counter_family as _counter
from edge.metrics_http import gauge_family as _gauge
from kvroute_proto.events import LoadReport
from router.core.router_core import RouterStats, WorkerStats
from router.service.replica_sync import COUNTER_NAMES
from router.service.token_cache import CachedTokenizer

if TYPE_CHECKING:
    from router.service.server import RouterServer

__all__ = [
    "NO_WORKER",
    "ConnectionStats",
    "RouterSnapshot",
    "RouterStateCollector",
    "take_snapshot",
]

NO_WORKER = "none"  # the worker label of a request refused before a worker was chosen
# router.core.sync counter -> the outcome label of kvroute_router_event_batches_total
BATCH_OUTCOMES = {
    "applied": "applied",
    "duplicate": "duplicate",
    "out_of_order": "gap",
    "pending_overflow": "overflow",
}


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
    num_runs: int  # event stream messages that carried a run (decision 0056)
    state: str = "healthy"  # WorkerConnection.state


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
    # each model pool's stats (router.core.pools), by model; empty: ``stats`` is the one pool
    # and its metrics carry model="" (a snapshot built by hand)
    pools: dict[str, RouterStats] = field(default_factory=dict)

    def by_model(self) -> dict[str, RouterStats]:
        return self.pools or {"": self.stats}


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
            c.num_runs,
            c.state,
        )
        for c in server.pool.conns.values()
    )
    pools = server.pools.stats()
    return RouterSnapshot(
        policy=server.pools.policy_name,
        stats=pools[server.pools.default],
        pools=pools,
        workers=tuple(server.pools.worker_stats()),
        connections=conns,
        ejected=frontend.ejector.ejected(),
        num_ejections=frontend.ejector.num_ejections,
        num_retries=frontend.num_retries,
        num_inflight=frontend.num_inflight,
        replica=None if sync is None else dict(sync.counters),
        replica_peers=0 if sync is None else len(sync.peers),
        replica_window_s=_finite(server.pools.replica_sync_window_s),
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
        """Each model pool's index and routing (label ``model``: router.core.pools)."""
        m = ("model",)
        blocks = _gauge("kvroute_router_index_blocks", "Distinct blocks in the prefix index", m)
        entries = _gauge(
            "kvroute_router_index_entries", "Confirmed (block, worker) pairs in the prefix index", m
        )
        predicted = _gauge(
            "kvroute_router_index_predicted_entries",
            "Predicted (block, worker) pairs (routed, not yet confirmed by an event)",
            m,
        )
        size = _gauge("kvroute_router_index_bytes", "Estimated memory of the prefix index", m)
        evicted = _counter(
            "kvroute_router_index_evicted_blocks", "Blocks dropped by the index's size cap", m
        )
        errors = _counter(
            "kvroute_router_event_apply_errors",
            "KV events that could not be applied as sent (counted, never fatal), by kind",
            ("model", "kind"),
        )
        routed = _counter("kvroute_router_routed_requests", "Requests RouterCore.route placed", m)
        workers = _gauge("kvroute_router_pool_workers", "Workers in each model's pool", m)
        for model, s in snap.by_model().items():
            blocks.add_metric([model], s.num_indexed_blocks)
            entries.add_metric([model], s.num_index_entries)
            predicted.add_metric([model], s.num_predicted_entries)
            size.add_metric([model], s.index_bytes)
            evicted.add_metric([model], s.num_evicted_blocks)
            for kind, n in sorted(s.apply_errors.items()):
                errors.add_metric([model, kind], n)
            routed.add_metric([model], s.num_routed)
            workers.add_metric([model], s.num_workers)
        yield from (blocks, entries, predicted, size, evicted, errors, routed, workers)

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
        # addresses given (or registered) that never answered, or answered and were refused
        for state in ("unreachable", "refused"):
            workers.add_metric([state], sum(1 for c in snap.connections if c.state == state))
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
        runs = _counter(
            "kvroute_router_event_runs",
            "Event stream messages that carried several batches: what the worker queued while "
            "the router had not read its last message (the router reads behind the stream)",
            conn_labels,
        )
        for conn in snap.connections:
            conn_key = [conn.worker_id or NO_WORKER, conn.address]
            connects.add_metric(conn_key, conn.num_connects)
            failures.add_metric(conn_key, conn.num_failures)
            purges.add_metric(conn_key, conn.num_purges)
            runs.add_metric(conn_key, conn.num_runs)
        yield from (batches, epochs, snapshots, resyncs, lag, last_seq)
        yield from (connects, failures, purges, runs)

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
        inflight.add_metric([], sum(s.num_replica_inflight for s in snap.by_model().values()))
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
