"""TLS and mutual TLS on every hop, with certificates made at test time.

client -> router (gRPC, HTTP), router -> worker (Generate and the KV event stream share one
channel), worker/router -> Redis (rediss:// with a client certificate and an ACL user). Each
hop is shown to work with the right certificates and to refuse: a plaintext client, a
client that trusts another CA, a client without a certificate where mTLS is required, and a
client certificate from another CA.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from pathlib import Path

import aiohttp
import grpc
import pytest
from secure_harness import WAIT_S, secure_worker
from tls_certs import Pki

from edge.http_front import HttpFrontConfig
from edge.registry import RedisMembershipWatcher, RedisRegistration, WorkerRecord
from edge.tls import (
    ClientTls,
    RedisAuth,
    ServerTls,
    TlsConfigError,
    channel,
    client_tls_from_flags,
    server_tls_from_flags,
)
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli import router as router_cli
from router.cli.client import GenerateOptions, RouterClient
from router.service.server import RouterServer

HERE = Path(__file__).resolve().parent
OPTS = GenerateOptions(max_new_tokens=4)


def _router_config(workers: list[str], **overrides):
    import sys

    sys.path.insert(0, str(HERE.parent / "router" / "service"))
    from router_harness import router_config  # the router tests' fast-reconnect config

    return router_config(workers, **overrides)


def _mtls_server(pki: Pki) -> ServerTls:
    return ServerTls(pki.server.cert, pki.server.key, client_ca_file=pki.ca)


def _client(pki: Pki) -> ClientTls:
    return ClientTls(pki.ca, pki.client.cert, pki.client.key)


async def _refused(address: str, tls: ClientTls | None) -> grpc.StatusCode:
    async with RouterClient(address, tls=tls, timeout_s=3.0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate("hello", OPTS)
    return info.value.code()


async def test_grpc_hops_mutual_tls_serve_and_refuse(pki: Pki):
    async with secure_worker("w-tls", tls=_mtls_server(pki)) as worker:
        conn = dataclasses.replace(_router_config([]).connection, tls=_client(pki))
        config = _router_config([worker.address], tls=_mtls_server(pki), connection=conn)
        router = RouterServer(config)
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            # the event stream runs over the TLS channel: the snapshot arrived
            (wconn,) = router.pool.conns.values()
            await router.pool.wait_for(lambda: wconn.num_messages > 0, WAIT_S)
            async with RouterClient(router.address, tls=_client(pki), timeout_s=WAIT_S) as c:
                result = await c.generate("hello over mutual TLS", OPTS)
            assert result.worker_id == "w-tls" and len(result.token_ids) == 4

            # client -> router: every client without a valid certificate is refused
            assert await _refused(router.address, None) == grpc.StatusCode.UNAVAILABLE
            wrong_ca = ClientTls(pki.rogue_ca, pki.client.cert, pki.client.key)
            assert await _refused(router.address, wrong_ca) == grpc.StatusCode.UNAVAILABLE
            no_cert = ClientTls(pki.ca)
            assert await _refused(router.address, no_cert) == grpc.StatusCode.UNAVAILABLE
            rogue_cert = ClientTls(pki.ca, pki.rogue_client.cert, pki.rogue_client.key)
            assert await _refused(router.address, rogue_cert) == grpc.StatusCode.UNAVAILABLE
        finally:
            await router.stop(grace_s=0.1)

        # router -> worker: a router without the right client certificate never connects
        for tls in (None, ClientTls(pki.ca), ClientTls(pki.ca, *_rogue(pki))):
            conn = dataclasses.replace(_router_config([]).connection, tls=tls)
            bad = RouterServer(_router_config([worker.address], connection=conn))
            await bad.start()
            try:
                (c,) = bad.pool.conns.values()
                await bad.pool.wait_for(lambda c=c: c.num_failures >= 2, WAIT_S)
                assert bad.pool.num_healthy == 0 and c.num_connects == 0
            finally:
                await bad.stop(grace_s=0.1)

        # and directly: GetLoad without a client certificate fails, with one it answers
        async with channel(worker.address, ClientTls(pki.ca)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with channel(worker.address, _client(pki)) as ch:
            info_ok = await pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=3)
            assert info_ok.worker_id == "w-tls"


def _rogue(pki: Pki) -> tuple[str, str]:
    return pki.rogue_client.cert, pki.rogue_client.key


async def test_server_tls_without_client_ca_accepts_any_tls_client_but_not_plaintext(pki: Pki):
    async with secure_worker("w-1way") as worker:
        config = _router_config([worker.address], tls=ServerTls(pki.server.cert, pki.server.key))
        router = RouterServer(config)
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            async with RouterClient(router.address, tls=ClientTls(pki.ca), timeout_s=WAIT_S) as c:
                assert len((await c.generate("one-way TLS", OPTS)).token_ids) == 4
            assert await _refused(router.address, None) == grpc.StatusCode.UNAVAILABLE
            wrong_ca = ClientTls(pki.rogue_ca)
            assert await _refused(router.address, wrong_ca) == grpc.StatusCode.UNAVAILABLE
        finally:
            await router.stop(grace_s=0.1)


async def test_http_front_mutual_tls(pki: Pki):
    async with secure_worker("w-http") as worker:
        http = HttpFrontConfig(tls=_mtls_server(pki))
        router = RouterServer(_router_config([worker.address], http=http))
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            assert router.http is not None
            url = f"https://127.0.0.1:{router.http.port}/v1/completions"
            body = {"model": "kvroute-tiny", "prompt": "hi there", "max_tokens": 3}
            async with aiohttp.ClientSession() as session:
                ctx = _client(pki).ssl_context()
                async with session.post(url, json=body, ssl=ctx) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["usage"]["completion_tokens"] == 3
                # no client certificate: the handshake is refused
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(url, json=body, ssl=ClientTls(pki.ca).ssl_context()):
                        pass
                # a certificate from another CA
                rogue = ClientTls(pki.ca, *_rogue(pki)).ssl_context()
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(url, json=body, ssl=rogue):
                        pass
                # a client trusting another CA refuses the server
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(
                        url, json=body, ssl=ClientTls(pki.rogue_ca).ssl_context()
                    ):
                        pass
                # plaintext HTTP to the TLS port gets no HTTP answer
                plain = f"http://127.0.0.1:{router.http.port}/v1/completions"
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(plain, json=body):
                        pass
        finally:
            await router.stop(grace_s=0.1)


# ---- Redis ------------------------------------------------------------------------------


async def _beat(url: str, auth: RedisAuth) -> bool:
    reg = RedisRegistration(
        url,
        WorkerRecord("w-redis", "127.0.0.1:1"),
        prefix="kvtest:",
        ttl_s=3.0,
        client_options=auth.client_kwargs(),
    )
    try:
        return await reg.beat()
    finally:
        await reg._redis.aclose()


async def test_redis_tls_with_acl_user(pki: Pki, tls_redis: int):
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    good = RedisAuth(_client(pki), "alice", "pw")
    assert await _beat(url, good)
    seen: list[dict] = []

    async def on_members(members):
        seen.append(members)

    watcher = RedisMembershipWatcher(
        url, on_members, prefix="kvtest:", poll_s=0.5, client_options=good.client_kwargs()
    )
    try:
        members = await watcher.read_members()
        assert set(members) == {"w-redis"}
    finally:
        await watcher._redis.aclose()
    # refused: no client certificate, a certificate from another CA, a wrong password,
    # no user at all (default user is off), a client that trusts another CA, plaintext
    assert not await _beat(url, RedisAuth(ClientTls(pki.ca), "alice", "pw"))
    assert not await _beat(url, RedisAuth(ClientTls(pki.ca, *_rogue(pki)), "alice", "pw"))
    assert not await _beat(url, RedisAuth(_client(pki), "alice", "wrong"))
    assert not await _beat(url, RedisAuth(_client(pki)))
    assert not await _beat(
        url, RedisAuth(ClientTls(pki.rogue_ca, pki.client.cert, pki.client.key), "alice", "pw")
    )
    assert not await _beat(f"redis://127.0.0.1:{tls_redis}/0", RedisAuth(None, "alice", "pw"))


# ---- configuration errors ---------------------------------------------------------------


def test_flags_name_the_missing_partner_and_the_unreadable_file(pki: Pki, tmp_path: Path):
    with pytest.raises(TlsConfigError, match="--tls-cert and --tls-key must be given together"):
        server_tls_from_flags(pki.server.cert, None, None)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs --tls-cert"):
        server_tls_from_flags(None, None, pki.ca)
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TlsConfigError, match=f"--tls-key {missing}: cannot read"):
        server_tls_from_flags(pki.server.cert, missing, None)
    text = tmp_path / "text.pem"
    text.write_text("hello")
    with pytest.raises(TlsConfigError, match=r"--worker-tls-ca .*not a PEM file"):
        client_tls_from_flags(str(text), None, None, flag="--worker-tls")
    with pytest.raises(TlsConfigError, match="--redis-tls-\\* options need a rediss:// URL"):
        RedisAuth(ClientTls(pki.ca)).check_url("redis://127.0.0.1:6379")


def test_router_cli_refuses_to_start_on_an_unreadable_certificate(tmp_path, capsys):
    missing = str(tmp_path / "missing.pem")
    argv = ["--worker", "127.0.0.1:7001", "--tls-cert", missing, "--tls-key", missing]
    assert router_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--tls-cert {missing}: cannot read" in err and "Traceback" not in err


def test_ssl_context_rejects_key_that_does_not_match(pki: Pki):
    tls = ServerTls(pki.server.cert, pki.client.key)
    with pytest.raises(TlsConfigError, match="--tls-cert/--tls-key"):
        tls.ssl_context()
    assert isinstance(ServerTls(pki.server.cert, pki.server.key).ssl_context(), ssl.SSLContext)


async def test_worker_http_front_tls(pki: Pki):
    http = HttpFrontConfig(tls=ServerTls(pki.server.cert, pki.server.key))
    async with secure_worker("w-https", http=http, tls=_mtls_server(pki)) as worker:
        url = f"https://127.0.0.1:{worker.http_port}/health"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=ClientTls(pki.ca).ssl_context()) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{worker.http_port}/health"):
                    pass
        await asyncio.sleep(0)


async def test_metrics_are_served_behind_the_routers_tls(pki: Pki):
    """With --tls-cert the router's /metrics is HTTPS with the same certificate (and with a
    client CA, only clients holding a certificate it signed are answered)."""
    from router.service.metrics import RouterMetricsEndpoint

    router = RouterServer(_router_config([], tls=_mtls_server(pki)))
    await router.start()
    endpoint = RouterMetricsEndpoint(router, "127.0.0.1", 0)
    endpoint.start()
    try:
        assert endpoint.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=pki.ca)
        trusted.load_cert_chain(pki.client.cert, pki.client.key)
        anonymous = ssl.create_default_context(cafile=pki.ca)
        async with aiohttp.ClientSession() as s:
            async with s.get(endpoint.url, ssl=trusted) as resp:
                assert resp.status == 200
                assert "kvroute_router_" in await resp.text()
            with pytest.raises(aiohttp.ClientError):  # no client certificate: refused
                async with s.get(endpoint.url, ssl=anonymous) as resp:
                    await resp.read()
            with pytest.raises(aiohttp.ClientError):  # plaintext: no answer
                async with s.get(endpoint.url.replace("https://", "http://")) as resp:
                    await resp.read()
    finally:
        endpoint.stop()
        await router.stop(grace_s=0.1)
