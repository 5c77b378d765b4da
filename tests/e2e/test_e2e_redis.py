"""End to end with Redis membership: workers register themselves, the router finds them.

Real processes (`python -m kvroute_cli worker --redis-url ...` and `router --redis-url ...`)
against the real Redis on 127.0.0.1:6379, under a key prefix of their own.
"""

from __future__ import annotations

import signal

import pytest
import redis
from e2e_procs import procs, until

from router.cli.client import GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_workers_join_and_leave_through_redis(redis_url, redis_prefix):
    r = redis.Redis.from_url(redis_url)
    prefix = redis_prefix
    common = ["--redis-url", redis_url, "--redis-prefix", prefix]
    try:
        with procs() as p:
            w0 = p.worker("w0", *common)
            w1 = p.worker("w1", *common)
            assert sorted(k.decode() for k in r.keys(prefix + "*")) == [
                f"{prefix}worker:w0",
                f"{prefix}worker:w1",
            ]
            router = p.start(
                "router",
                [
                    "router",
                    "--port",
                    "0",
                    *common,
                    "--redis-poll-s",
                    "0.2",
                    "--log-level",
                    "WARNING",
                ],
            )
            async with RouterClient(router.address, timeout_s=20) as client:

                async def healthy_ids():
                    expl = await client.explain([1, 2, 3, 4])
                    return {w.worker_id for w in expl.workers if w.healthy}

                async def both_found():
                    return await healthy_ids() == {"w0", "w1"}

                async def w1_dropped():
                    return await healthy_ids() == {"w0"}

                await until(both_found, "router never found both workers")
                result = await client.generate([5, 6, 7, 8, 9], GenerateOptions(max_new_tokens=3))
                assert result.worker_id in {"w0", "w1"}
                assert len(result.token_ids) == 3

                # a clean stop deregisters at once; the router drops the worker
                p.kill(w1, signal.SIGTERM)
                assert r.exists(f"{prefix}worker:w1") == 0
                await until(w1_dropped, "router kept the stopped worker")
                for i in range(3):
                    result = await client.generate([i, 1, 2, 3], GenerateOptions(max_new_tokens=1))
                    assert result.worker_id == "w0"
            assert w0.popen.poll() is None
    finally:
        r.close()
