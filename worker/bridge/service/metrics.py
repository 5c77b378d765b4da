"""The bridge's Prometheus metrics (``kvroute bridge --metrics-port``): kvroute_bridge_*.

Read at scrape time on the bridge's event loop (the only thread that touches the
translator): what came off the engine's sockets, what the translator applied, dropped
(by reason) and lost, and the requests forwarded. Every series has a ``worker`` label (the
bridge's worker id). Names: docs/METRICS.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edge.metrics_http import MetricsEndpoint, call_on_loop, counter_family, gauge_family
from worker.bridge.service.events import FollowerCounters
from worker.bridge.service.server import BridgeServer
from worker.bridge.translate import TranslatorStats

# (metric name, source attribute, help); sources: follower counters, translator stats
COUNTERS = (
    ("kvroute_bridge_events_frames_received", "frames_received", "Live frames from the engine"),
    (
        "kvroute_bridge_events_frames_malformed",
        "frames_malformed",
        "Engine frames that were not the KV-event wire (dropped)",
    ),
    ("kvroute_bridge_events_replay_requests", "replay_requests", "Replays asked of the engine"),
    ("kvroute_bridge_events_replay_frames", "replay_frames", "Frames the engine replayed"),
    (
        "kvroute_bridge_events_replay_timeouts",
        "replay_timeouts",
        "Replays the engine did not answer in time",
    ),
    ("kvroute_bridge_events_batches_applied", "num_batches_applied", "Engine batches applied"),
    (
        "kvroute_bridge_events_batches_duplicate",
        "num_batches_duplicate",
        "Engine batches seen twice (live and replayed): dropped",
    ),
    ("kvroute_bridge_events_gaps", "num_gaps", "Gaps in the engine's seq that asked a replay"),
    (
        "kvroute_bridge_events_batches_lost",
        "num_batches_lost",
        "Engine batches no replay could fill (a new epoch of ours began)",
    ),
    ("kvroute_bridge_events_engine_restarts", "num_restarts", "Engine restarts seen"),
    ("kvroute_bridge_blocks_stored", "num_blocks_stored", "Our blocks announced stored"),
    ("kvroute_bridge_blocks_removed", "num_blocks_removed", "Our blocks announced removed"),
    (
        "kvroute_bridge_events_unknown",
        "num_unknown_events",
        "Engine events of a type the bridge does not know (counted, skipped)",
    ),
)
DROP_REASONS = (
    "medium",
    "group",
    "lora",
    "multimodal",
    "extra_keys",
    "unknown_parent",
    "block_size",
    "malformed",
)


@dataclass(frozen=True, slots=True)
class BridgeSnapshot:
    follower: FollowerCounters
    translator: TranslatorStats
    requests: int
    aborted: int
    engine_errors: int
    inflight: int
    subscribers: int
    engine_up: bool


class BridgeStateCollector(Collector):
    def __init__(self, snapshot: Callable[[], BridgeSnapshot], worker_id: str) -> None:
        self._snapshot = snapshot
        self._worker_id = worker_id

    @classmethod
    def for_server(cls, server: BridgeServer, loop: asyncio.AbstractEventLoop) -> Collector:
        def read() -> BridgeSnapshot:  # on the loop
            s = server.servicer
            return BridgeSnapshot(
                FollowerCounters(**asdict(server.follower.counters)),
                server.translator.stats(),
                s.num_requests,
                s.num_aborted,
                s.num_engine_errors,
                len(s.inflight),
                server.hub.num_subscribers,
                server.state.engine_up,
            )

        return cls(lambda: call_on_loop(loop, read), server.config.worker_id)

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        w = [self._worker_id]
        for name, attr, doc in COUNTERS:
            f = counter_family(name, doc, ("worker",))
            source: object = snap.follower if hasattr(snap.follower, attr) else snap.translator
            f.add_metric(w, getattr(source, attr))
            yield f
        dropped = counter_family(
            "kvroute_bridge_blocks_dropped",
            "Engine blocks not translated, by reason (medium: another storage tier; group: "
            "another KV-cache group; lora, multimodal, extra_keys: keys kvroute cannot name; "
            "unknown_parent; block_size: neither a multiple nor a divisor of ours; malformed)",
            ("worker", "reason"),
        )
        for reason in DROP_REASONS:
            dropped.add_metric([*w, reason], getattr(snap.translator, f"dropped_{reason}"))
        yield dropped
        requests = counter_family(
            "kvroute_bridge_requests",
            "Generate calls forwarded to the engine, by outcome (forwarded: all; aborted; "
            "engine_error: the engine failed or could not be reached)",
            ("worker", "outcome"),
        )
        requests.add_metric([*w, "forwarded"], snap.requests)
        requests.add_metric([*w, "aborted"], snap.aborted)
        requests.add_metric([*w, "engine_error"], snap.engine_errors)
        yield requests
        gauges = (
            ("kvroute_bridge_inflight_requests", "Requests forwarded, not ended", snap.inflight),
            ("kvroute_bridge_subscribers", "Routers following the event stream", snap.subscribers),
            ("kvroute_bridge_engine_up", "1: the engine answered its last poll", snap.engine_up),
            ("kvroute_bridge_blocks", "Our blocks held (as announced)", snap.translator.num_blocks),
            (
                "kvroute_bridge_held_batches",
                "Engine batches held behind a gap",
                snap.translator.num_held_batches,
            ),
        )
        for name, doc, value in gauges:
            g = gauge_family(name, doc, ("worker",))
            g.add_metric(w, float(value))
            yield g


class BridgeMetricsEndpoint(MetricsEndpoint):
    """``/metrics`` of one bridge."""

    def __init__(self, server: BridgeServer, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.server = server

    def _collectors(self, loop: asyncio.AbstractEventLoop) -> list[Collector]:
        return [BridgeStateCollector.for_server(self.server, loop)]

    def _observe(self, on: bool) -> None:
        """No request-path observer: the counters are read at scrape time."""
