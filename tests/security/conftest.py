"""Fixtures of the security tests: a PKI made once per module at test time."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tls_certs import Pki, make_pki

WAIT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(Path(tmp_path_factory.mktemp("pki")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_redis(pki: Pki, tmp_path: Path):
    """A redis-server of this test's own: TLS only (client certificates required), ACL
    user alice/pw, the default user off."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port", "0",
            "--tls-port", str(port),
            "--bind", "127.0.0.1",
            "--tls-cert-file", pki.server.cert,
            "--tls-key-file", pki.server.key,
            "--tls-ca-cert-file", pki.ca,
            "--tls-auth-clients", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(tmp_path),
            "--user", "alice", "on", ">pw", "~*", "&*", "+@all",
            "--user", "default", "off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
