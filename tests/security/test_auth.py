"""Authentication: API keys at the router (gRPC metadata and HTTP Authorization), the tenant
from the key, and workers that accept calls only from routers (a shared token).

Real servers on 127.0.0.1 port 0; every refusal is checked for its code and message.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from secure_harness import WAIT_S, secure_worker

from edge.auth import bearer_token, token_authenticator
from edge.frontdoor import Unauthenticated
from edge.http_front import HttpFrontConfig
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli import router as router_cli
from router.cli.client import GenerateOptions, RouterClient
from router.service.auth import ApiKeys, hash_key, keys_main
from router.service.server import RouterServer
from router.service.tenancy import TenancyConfig, tenant_of

HERE = Path(__file__).resolve().parent
OPTS = GenerateOptions(max_new_tokens=2)
ACME_KEY, GLOBEX_KEY = "sk-acme-0123456789", "sk-globex-9876543210"
KEYS = ApiKeys.parse([f"acme:{hash_key(ACME_KEY)}", f"globex:{hash_key(GLOBEX_KEY)}"], "test")
PROMPT = "A shared system prompt that is long enough to fill several blocks. " * 2


def _router_config(workers, **overrides):
    sys.path.insert(0, str(HERE.parent / "router" / "service"))
    from router_harness import router_config

    return router_config(workers, **overrides)


# ---- the key store ----------------------------------------------------------------------


def test_keys_parse_stores_hashes_and_maps_keys_to_tenants():
    assert KEYS.tenant_of(ACME_KEY) == "acme"
    assert KEYS.tenant_of(GLOBEX_KEY) == "globex"
    assert KEYS.tenant_of("sk-nobody") is None
    assert KEYS.tenant_of(ACME_KEY + "x") is None
    assert all(ACME_KEY.encode() not in digest for _, digest in KEYS.entries)
    md = (("authorization", f"Bearer {ACME_KEY}"),)
    assert KEYS.authenticate(md) == "acme"
    with pytest.raises(Unauthenticated, match="missing API key"):
        KEYS.authenticate((("x-tenant-id", "acme"),))
    with pytest.raises(Unauthenticated, match="invalid API key"):
        KEYS.authenticate((("authorization", "Bearer sk-wrong"),))
    with pytest.raises(Unauthenticated, match="missing API key"):
        KEYS.authenticate((("authorization", f"Basic {ACME_KEY}"),))


def test_keys_file_errors_name_the_line(tmp_path):
    with pytest.raises(ValueError, match="line 2: expected tenant_id:sha256hex"):
        ApiKeys.parse(["# c", "nocolon"], "f")
    with pytest.raises(ValueError, match="line 1: the hash must be 64 hex digits"):
        ApiKeys.parse([f"acme:{ACME_KEY}"], "f")  # a raw key, not its hash
    with pytest.raises(ValueError, match="same key is listed for tenants 'a' and 'b'"):
        ApiKeys.parse([f"a:{hash_key('k')}", f"b:{hash_key('k')}"], "f")
    with pytest.raises(ValueError, match=r"--api-keys .*cannot read"):
        ApiKeys.load(str(tmp_path / "missing"), None)
    f = tmp_path / "keys"
    f.write_text(f"# tenants\nacme:{hash_key(ACME_KEY).upper()}\n\n")
    keys = ApiKeys.load(str(f), f"globex:{hash_key(GLOBEX_KEY)},x:{hash_key('kx')}")
    assert keys is not None and keys.tenants == {"acme", "globex", "x"}
    assert ApiKeys.load(None, None) is None


def test_kvroute_keys_hash_prints_the_file_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(ACME_KEY + "\n"))
    assert keys_main(["hash", "--tenant", "acme"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"acme:{hash_key(ACME_KEY)}"
    assert ApiKeys.parse([line], "out").tenant_of(ACME_KEY) == "acme"


def test_bearer_token_parsing():
    assert bearer_token((("Authorization", "Bearer  abc "),)) == "abc"
    assert bearer_token((("authorization", b"bearer xyz"),)) == "xyz"
    assert bearer_token((("authorization", "Bearer"),)) is None
    assert bearer_token(()) is None


# ---- the router: gRPC -------------------------------------------------------------------


async def _expect(client: RouterClient, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.generate(PROMPT, OPTS)
    assert info.value.code() == code
    assert text in (info.value.details() or "")


async def test_router_grpc_requires_an_api_key_and_takes_the_tenant_from_it():
    async with secure_worker("w-auth") as worker:
        router = RouterServer(_router_config([worker.address], api_keys=KEYS))
        await router.start()
        addr = router.address
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            async with RouterClient(addr, timeout_s=WAIT_S) as anon:
                await _expect(anon, grpc.StatusCode.UNAUTHENTICATED, "missing API key")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await anon.explain(PROMPT)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with RouterClient(addr, api_key="sk-wrong", timeout_s=WAIT_S) as wrong:
                await _expect(wrong, grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            # the tenant header is not trusted with API keys: globex naming acme stays globex
            async with RouterClient(addr, api_key=ACME_KEY, timeout_s=WAIT_S) as acme:
                first = await acme.generate(PROMPT, OPTS)
                again = await acme.generate(PROMPT, OPTS)
            assert first.cached_prompt_tokens == 0 and again.cached_prompt_tokens > 0
            async with RouterClient(
                addr, api_key=GLOBEX_KEY, tenant="acme", timeout_s=WAIT_S
            ) as forged:
                r = await forged.generate(PROMPT, OPTS)
            assert r.cached_prompt_tokens == 0  # not acme's partition
            # health and reflection stay open
            async with grpc.aio.insecure_channel(addr) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
                from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                req = reflection_pb2.ServerReflectionRequest(list_services="")
                async for answer in refl.ServerReflectionInfo(iter([req]), timeout=5):
                    names = {s.name for s in answer.list_services_response.service}
                    assert "kvroute.v1.Router" in names
                    break
                # Abort needs a key too
                stub = pb_grpc.RouterStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Abort(pb.AbortRequest(request_id="x"), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await router.stop(grace_s=0.1)


async def test_trusted_tenant_header_names_the_tenant_for_a_key_holder():
    async with secure_worker("w-gw") as worker:
        service = dataclasses.replace(
            _router_config([]).service, tenancy=TenancyConfig(trust_tenant_header=True)
        )
        router = RouterServer(_router_config([worker.address], api_keys=KEYS, service=service))
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            addr = router.address
            async with RouterClient(addr, api_key=ACME_KEY, tenant="u1", timeout_s=WAIT_S) as c:
                await c.generate(PROMPT, OPTS)
            async with RouterClient(addr, api_key=GLOBEX_KEY, tenant="u1", timeout_s=WAIT_S) as c:
                # a gateway naming the same user: the same partition, a cache hit
                assert (await c.generate(PROMPT, OPTS)).cached_prompt_tokens > 0
        finally:
            await router.stop(grace_s=0.1)


# ---- the router: HTTP -------------------------------------------------------------------


async def test_router_http_401_with_openai_error_and_open_paths():
    async with secure_worker("w-http-auth") as worker:
        router = RouterServer(
            _router_config([worker.address], api_keys=KEYS, http=HttpFrontConfig())
        )
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            assert router.http is not None
            base = f"http://127.0.0.1:{router.http.port}"
            body = {"model": "kvroute-tiny", "prompt": "hello", "max_tokens": 2}
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 401
                    err = (await resp.json())["error"]
                    assert err["type"] == "authentication_error"
                    assert "missing API key" in err["message"]
                bad = {"Authorization": "Bearer sk-nope"}
                async with s.post(f"{base}/v1/chat/completions", json=body, headers=bad) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["message"] == "invalid API key"
                good = {"Authorization": f"Bearer {ACME_KEY}"}
                async with s.post(f"{base}/v1/completions", json=body, headers=good) as resp:
                    assert resp.status == 200
                for path in ("/health", "/v1/models"):
                    async with s.get(base + path) as resp:
                        assert resp.status == 200, path
        finally:
            await router.stop(grace_s=0.1)


# ---- workers accept calls only from routers ---------------------------------------------


async def test_worker_token_refuses_every_worker_call_without_it():
    token = "router-secret-token"
    async with secure_worker("w-tok", router_token=token) as worker:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            calls = {
                "GetLoad": lambda md: stub.GetLoad(pb.GetLoadRequest(), metadata=md, timeout=5),
                "Abort": lambda md: stub.Abort(
                    pb.AbortRequest(request_id="r"), metadata=md, timeout=5
                ),
            }
            for name, call in calls.items():
                for md in ((), (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(md)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            for md in ((), (("authorization", "Bearer wrong"),)):
                req = pb.GenerateRequest(prompt_text="hi")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(req, metadata=md, timeout=5):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.SubscribeKvEvents(
                        pb.SubscribeRequest(), metadata=md, timeout=5
                    ):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Relay(iter([pb.RelayRequest(stream_id="s")]), metadata=md):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.GetLoad(
                pb.GetLoadRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=5
            )
            assert ok.worker_id == "w-tok"
            health = health_pb2_grpc.HealthStub(ch)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING

        # a router with the token serves through it; one without never connects
        conn = dataclasses.replace(_router_config([]).connection, token=token)
        router = RouterServer(_router_config([worker.address], connection=conn))
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            (conn_ok,) = router.pool.conns.values()
            await router.pool.wait_for(lambda: conn_ok.relay.ready, WAIT_S)
            async with RouterClient(router.address, timeout_s=WAIT_S) as c:
                assert len((await c.generate("through the router", OPTS)).token_ids) == 2
            assert conn_ok.relay.num_started == 1  # the relay stream carries the token too
        finally:
            await router.stop(grace_s=0.1)
        router = RouterServer(_router_config([worker.address]))
        await router.start()
        try:
            (c,) = router.pool.conns.values()
            await router.pool.wait_for(lambda: c.num_failures >= 2, WAIT_S)
            assert router.pool.num_healthy == 0 and "UNAUTHENTICATED" in c.last_error
        finally:
            await router.stop(grace_s=0.1)


async def test_worker_http_token_is_optional():
    token = "router-secret-token"
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    async with secure_worker(
        "w-http-tok", router_token=token, http=HttpFrontConfig(), http_require_token=True
    ) as worker:
        base = f"http://127.0.0.1:{worker.http_port}"
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/generate", json=body) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["type"] == "authentication_error"
            headers = {"Authorization": f"Bearer {token}"}
            async with s.post(f"{base}/generate", json=body, headers=headers) as resp:
                assert resp.status == 200
            for path in ("/health", "/v1/models", "/model_info", "/server_info"):
                async with s.get(base + path) as resp:
                    assert resp.status == 200, path
    # default: the HTTP routes stay open for peer routers (sglang-router) that cannot send it
    open_worker = secure_worker("w-http-open", router_token=token, http=HttpFrontConfig())
    async with open_worker as worker, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{worker.http_port}/generate"
        async with s.post(url, json=body) as resp:
            assert resp.status == 200
        # ... but not the routes that change state: wiping every tenant's cache needs it
        flush = f"http://127.0.0.1:{worker.http_port}/flush_cache"
        async with s.post(flush) as resp:
            assert resp.status == 401
        async with s.post(flush, headers={"Authorization": f"Bearer {token}"}) as resp:
            assert resp.status == 200


def test_worker_http_require_token_needs_a_token():
    from worker.service.server import WorkerServerConfig

    with pytest.raises(ValueError, match="--http-require-token needs --router-token"):
        WorkerServerConfig(http_require_token=True)


def test_token_authenticator_refuses_an_empty_token():
    with pytest.raises(ValueError):
        token_authenticator("")


# ---- command line -----------------------------------------------------------------------


def _router_args(*extra: str) -> argparse.Namespace:
    return router_cli.build_parser().parse_args(["--worker", "127.0.0.1:7001", *extra])


def test_router_flags_turn_the_header_off_with_api_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("KVROUTE_API_KEYS", raising=False)
    plain = router_cli.config_from_args(_router_args())
    assert plain.api_keys is None  # without keys the header names the tenant, as before
    assert tenant_of(plain.service.tenancy, (("x-tenant-id", "acme"),), None) == "acme"
    f = tmp_path / "keys"
    f.write_text(f"acme:{hash_key(ACME_KEY)}\n")
    keyed = router_cli.config_from_args(_router_args("--api-keys", str(f), "--worker-token", "t"))
    assert keyed.api_keys is not None and keyed.api_keys.tenants == {"acme"}
    assert not keyed.service.tenancy.trust_tenant_header
    assert tenant_of(keyed.service.tenancy, (("x-tenant-id", "evil"),), "acme") == "acme"
    trusted = router_cli.config_from_args(
        _router_args("--api-keys", str(f), "--worker-token", "t", "--trust-tenant-header")
    )
    assert trusted.service.tenancy.trust_tenant_header
    monkeypatch.setenv("KVROUTE_API_KEYS", f"globex:{hash_key(GLOBEX_KEY)}")
    env = router_cli.config_from_args(_router_args("--insecure-workers"))
    assert env.api_keys is not None and env.api_keys.tenants == {"globex"}
    tok = router_cli.config_from_args(_router_args("--worker-token", "t0k"))
    assert tok.connection.token == "t0k"
