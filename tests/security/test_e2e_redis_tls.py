"""Worker and router processes find each other through a TLS-only Redis with an ACL user,
configured by the command-line flags (--redis-tls-*, --redis-username, the password from
$KVROUTE_REDIS_PASSWORD); a router without the client certificate finds nobody."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc
import pytest
from tls_certs import Pki

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_procs import procs, until

from router.cli.client import GenerateOptions, RouterClient

pytestmark = pytest.mark.e2e


async def _serves(address: str) -> bool:
    try:
        async with RouterClient(address, timeout_s=5) as c:
            r = await c.generate("hello", GenerateOptions(max_new_tokens=2))
        return len(r.token_ids) == 2
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return False
        raise


async def test_membership_over_rediss_with_acl_user(pki: Pki, tls_redis: int, monkeypatch):
    monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", "pw")  # inherited by the processes
    assert os.environ["KVROUTE_REDIS_PASSWORD"] == "pw"
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    redis_flags = [
        "--redis-url", url,
        "--redis-tls-ca", pki.ca,
        "--redis-tls-cert", pki.client.cert,
        "--redis-tls-key", pki.client.key,
        "--redis-username", "alice",
    ]  # fmt: skip
    router_args = ["router", "--port", "0", "--log-level", "WARNING", "--redis-poll-s", "0.2"]
    with procs() as p:
        p.worker("w-rediss", *redis_flags)
        router = p.start("router", [*router_args, *redis_flags])
        await until(lambda: _serves(router.address), "router never found the worker", 30)
        # without a client certificate the registry is out of reach: over 10 polls (2 s)
        # the router finds no worker although the registry holds one
        blind_flags = redis_flags[:4] + redis_flags[8:]  # no --redis-tls-cert / -key
        assert "--redis-tls-cert" not in blind_flags and "--redis-tls-ca" in blind_flags
        blind = p.start("router", [*router_args, *blind_flags])
        async with RouterClient(blind.address, timeout_s=5) as c:
            for _ in range(10):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await c.generate("hello", GenerateOptions(max_new_tokens=2))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "0 registered" in (info.value.details() or "")
                await asyncio.sleep(0.2)
