"""Replica sync through a TLS-only Redis with an ACL user, configured as the router's flags
configure it (``RedisAuth.client_kwargs()``): two routers see each other's picks; without
the client certificate, or with a wrong password, a router cannot join the channel."""

from __future__ import annotations

import asyncio
import random
import ssl

import numpy as np
import pytest
from tls_certs import Pki

from edge.tls import ClientTls, RedisAuth
from router.core.router_core import RouterConfig, RouterCore, RouteRequest
from router.service.redis_wire import RedisTarget, RespConnection, RespError
from router.service.replica_sync import ReplicaSync

B = 16


def _core(seed: int) -> RouterCore:
    core = RouterCore(RouterConfig(block_size=B), clock=lambda: 0.0, rng=random.Random(seed))
    for i in range(3):
        core.add_worker(f"w{i}", block_size=B)
    return core


async def _wait(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_two_routers_sync_over_rediss_with_an_acl_user(pki: Pki, tls_redis: int):
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    auth = RedisAuth(ClientTls(pki.ca, pki.client.cert, pki.client.key), "alice", "pw")
    a, b = _core(1), _core(2)
    syncs = [
        ReplicaSync(core, url, client_options=auth.client_kwargs(), heartbeat_s=0.2)
        for core in (a, b)
    ]
    for sync in syncs:
        await sync.start()
    try:
        await _wait(lambda: all(s.subscribed.is_set() and s._pub is not None for s in syncs))
        d = a.route(RouteRequest("x", np.arange(320, dtype=np.uint32)))
        view = b.worker_view(d.worker_id)
        await _wait(lambda: view.num_active == 1)
        assert view.inflight_prefill_tokens == 320
        a.on_finished("x", 1)
        await _wait(lambda: view.num_active == 0)
    finally:
        for sync in syncs:
            await sync.close()
    assert all(s.counters["events_dropped"] == 0 for s in syncs)


async def test_no_client_certificate_or_a_wrong_password_keeps_a_router_out(
    pki: Pki, tls_redis: int
):
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    no_cert = RedisAuth(ClientTls(pki.ca), "alice", "pw").client_kwargs()
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        conn = await RespConnection.open(RedisTarget.from_url(url, no_cert))
        await conn.call("PING")  # TLS 1.3: the server's refusal may come with the first read
    wrong = RedisAuth(ClientTls(pki.ca, pki.client.cert, pki.client.key), "alice", "nope")
    with pytest.raises(RespError, match="WRONGPASS"):
        await RespConnection.open(RedisTarget.from_url(url, wrong.client_kwargs()))
    # an untrusted server certificate: the CA the client trusts did not sign it
    rogue = RedisAuth(ClientTls(pki.rogue_ca, pki.client.cert, pki.client.key), "alice", "pw")
    with pytest.raises(ssl.SSLCertVerificationError):
        await RespConnection.open(RedisTarget.from_url(url, rogue.client_kwargs()))
