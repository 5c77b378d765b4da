"""WorkerConnection retry timing, with an injected clock (no waiting on real time)."""

from __future__ import annotations

import asyncio
import random

from router.core.pools import PoolsConfig, RouterPools
from router.core.router_core import RouterConfig, RouterCore
from router.service.resilience import BackoffConfig
from router.service.worker_conn import ConnectionConfig, ConnectionHooks, WorkerConnection


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_conn(clock: FakeClock) -> WorkerConnection:
    core = RouterCore(RouterConfig(), clock=clock, rng=random.Random(0))
    hooks = ConnectionHooks(
        claim=lambda conn, wid, bs, model: True,
        release=lambda conn, wid: None,
        on_health=lambda conn, healthy: None,
        changed=asyncio.Condition(),
    )
    config = ConnectionConfig(purge_after_s=3.0, backoff=BackoffConfig(initial_s=1.0, max_s=2.0))
    pools = RouterPools(PoolsConfig(("m",)), lambda: core)
    return WorkerConnection("127.0.0.1:1", pools, config, hooks, rng=random.Random(1), clock=clock)


async def test_never_reached_worker_backs_off_instead_of_spinning():
    clock = FakeClock()
    conn = make_conn(clock)
    try:
        clock.now += 60  # long past purge_after_s, but there is nothing to purge
        delays = [conn.next_retry_delay() for _ in range(10)]
        assert all(0.1 <= d <= 2.0 for d in delays)
        assert delays[-1] >= 0.2  # the cap grew to max_s=2.0; jitter keeps >= 10 %
    finally:
        await conn.channel.close()


async def test_known_worker_wakes_up_for_its_purge():
    clock = FakeClock()
    conn = make_conn(clock)
    try:
        conn.worker_id = "w0"
        conn._on_failure("gone")  # down since now
        clock.now += 2.95
        assert conn.next_retry_delay() <= 0.05 + 1e-9  # purge falls due in 0.05 s
        clock.now += 1.0
        assert conn.next_retry_delay() == 0.0
    finally:
        await conn.channel.close()
