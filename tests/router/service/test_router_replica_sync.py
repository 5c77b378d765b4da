"""Two router replicas (real gRPC servers, real in-process workers) with --replica-sync on
the real Redis: a request one router serves is counted by the other while it runs."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from metrics_scrape import scrape
from router_harness import router_config, running_router, sim_worker

from router.cli.client import GenerateOptions
from router.core.core_types import ReplicaConfig
from router.core.router_core import RouterConfig
from router.service.metrics import RouterMetricsEndpoint
from router.service.server import RegistryConfig

OPTS = GenerateOptions(max_new_tokens=2)


async def _scrape(server):
    """One scrape of ``server``'s /metrics endpoint (started and stopped around it)."""
    endpoint = RouterMetricsEndpoint(server, "127.0.0.1", 0)
    endpoint.start()
    try:
        return await scrape(endpoint.url)
    finally:
        endpoint.stop()


async def test_a_request_served_by_one_replica_is_seen_by_the_other(redis_url):
    prefix = f"kvroute-test-{uuid.uuid4().hex[:8]}:"
    registry = RegistryConfig(redis_url, prefix, poll_s=0.05, replica_sync=True)
    async with sim_worker("w0") as w0, sim_worker("w1") as w1:
        workers = [w0.address, w1.address]
        core = RouterConfig(policy="cache_aware", replica=ReplicaConfig(count=2, sync=True))
        config = router_config(workers, registry=registry, core=core)
        # bounded: a cancel swallowed inside a Redis call once hung the routers' shutdown
        async with asyncio.timeout(60):
            async with running_router(workers, config) as ra, running_router(workers, config) as rb:
                await ra.wait_synced(2)
                await rb.wait_synced(2)
                sa, sb = ra.server.replica_sync, rb.server.replica_sync
                assert sa is not None and sb is not None and sa.router_id != sb.router_id
                await ra.wait_for(lambda: sa.subscribed.is_set() and sb.subscribed.is_set())
                result = await ra.client.generate(list(range(10, 50)), OPTS)
                # routed, first token, finished: all three reached b, and nothing stays counted
                await rb.wait_for(lambda: sb.counters["events_applied"] >= 3)
                assert rb.server.core.stats().num_replica_inflight == 0
                assert result.worker_id in ("w0", "w1")
                assert sb.peers == [sa.router_id]
                metrics = await _scrape(rb.server)
                assert metrics.get("kvroute_router_replica_peers") == 1
                assert metrics.get("kvroute_router_replica_inflight_requests") == 0
                assert metrics.get("kvroute_router_replica_events_total", result="applied") >= 3
                assert metrics.get("kvroute_router_replica_batches_total", result="malformed") == 0
                # a published its picks: Redis echoed them back, timing the sync; its window
                # follows (auto), starting from 5 ms and falling toward the loopback's delay
                async with asyncio.timeout(10):  # nothing in the pool changes when it comes
                    while sa.last_delivery_s is None:
                        await asyncio.sleep(0.01)
                metrics = await _scrape(ra.server)
                delivery = metrics.get("kvroute_router_replica_sync_delivery_seconds")
                window = metrics.get("kvroute_router_replica_sync_window_seconds")
                assert 0 < delivery < 1.0 and 0 < window < 1.0
                assert window == ra.server.core.replica_sync_window_s
        # the routers stopped: their sync tasks and connections are gone with them
        assert sa.counters["batches_malformed"] == 0 and sa.counters["gaps"] == 0


def test_replica_sync_needs_the_registrys_redis():
    with pytest.raises(ValueError, match="--replica-sync needs --redis-url"):
        RegistryConfig(None, replica_sync=True)
