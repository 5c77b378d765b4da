"""Security end to end with real processes and the command-line flags: mutual TLS on every
gRPC hop, API keys, the router<->worker token and the block-hashing key, through
``kvroute worker`` + ``kvroute router`` and through ``kvroute up``; ``kvroute generate`` with
--tls-ca/--tls-cert/--tls-key/--api-key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from e2e_procs import ROOT, procs, until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from tls_certs import Pki, make_pki

from edge.tls import ClientTls
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli.client import GenerateOptions, RouterClient
from router.service.auth import hash_key

pytestmark = pytest.mark.e2e
KEY = "sk-e2e-tenant-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(Path(tmp_path_factory.mktemp("pki")))


def _client_tls(pki: Pki) -> ClientTls:
    return ClientTls(pki.ca, pki.client.cert, pki.client.key)


async def _serves(address: str, pki: Pki) -> bool:
    try:
        async with RouterClient(address, tls=_client_tls(pki), api_key=KEY, timeout_s=5) as c:
            result = await c.generate("hello", GenerateOptions(max_new_tokens=2))
        return len(result.token_ids) == 2
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # not connected to its workers yet
            return False
        raise


def _generate_cli(address: str, pki: Pki, *extra: str) -> subprocess.CompletedProcess:
    tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client.cert, "--tls-key", pki.client.key]
    return subprocess.run(
        [sys.executable, "-m", "kvroute_cli", "generate", "--router", address, *tls, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _mtls_server_flags(pki: Pki) -> list[str]:
    return [
        "--tls-cert", pki.server.cert,
        "--tls-key", pki.server.key,
        "--tls-client-ca", pki.ca,
    ]  # fmt: skip


async def test_router_and_worker_processes_with_every_option(pki: Pki, tmp_path: Path):
    keys = tmp_path / "keys"
    keys.write_text(f"acme:{hash_key(KEY)}\n")
    with procs() as p:
        worker = p.worker(
            "w-sec", *_mtls_server_flags(pki), "--router-token", "tok", "--hash-key", "k1"
        )
        router = p.router(
            [worker.address],
            *_mtls_server_flags(pki),
            "--worker-tls-ca", pki.ca,
            "--worker-tls-cert", pki.client.cert,
            "--worker-tls-key", pki.client.key,
            "--worker-token", "tok",
            "--hash-key", "k1",
            "--api-keys", str(keys),
        )  # fmt: skip
        await until(lambda: _serves(router.address, pki), "the router never served", 30)
        ok = _generate_cli(router.address, pki, "--api-key", KEY, "--max-new-tokens", "3", "hi")
        assert ok.returncode == 0, ok.stderr
        denied = _generate_cli(router.address, pki, "hi")
        assert denied.returncode == 1
        assert "UNAUTHENTICATED: missing API key" in denied.stderr
        assert "Traceback" not in denied.stderr
        # the worker answers only with the token, over mutual TLS
        async with grpc.aio.secure_channel(
            worker.address, _client_tls(pki).grpc_credentials()
        ) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_router_refuses_a_worker_process_with_another_hash_key(pki: Pki):
    with procs() as p:
        worker = p.worker("w-k2", "--hash-key", "other-key")
        router = p.router([worker.address], "--hash-key", "k1")
        async with RouterClient(router.address, timeout_s=5) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.generate("hello", GenerateOptions(max_new_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_kvroute_up_with_tls_api_keys_and_hash_key(pki: Pki, tmp_path: Path):
    keys = tmp_path / "keys"
    keys.write_text(f"acme:{hash_key(KEY)}\n")
    with procs() as p:
        up = p.start(
            "up",
            [
                "up", "--workers", "2", "--port", "0", "--executor", "sim",
                *_mtls_server_flags(pki),
                "--api-keys", str(keys),
                "--hash-key", "fleet-key",
                "--tenant-max-inflight", "8",
            ],
            marker="router listening on",
        )  # fmt: skip
        await until(lambda: _serves(up.address, pki), "kvroute up never served", 30)
        # its workers accept only this router (a token of the run, over loopback)
        workers = [m for line in up.lines for m in re.findall(r"listening on (\S+) \(pid", line)]
        assert len(workers) == 2
        async with grpc.aio.insecure_channel(workers[0]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # and the router takes no client without a certificate
        async with RouterClient(up.address, tls=ClientTls(pki.ca), api_key=KEY, timeout_s=5) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.generate("hello", GenerateOptions(max_new_tokens=2))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
