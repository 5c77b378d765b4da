"""No secret in any log line at any level: a worker and a keyed router as processes at
DEBUG, with every secret the product takes (API key, router<->worker token, block-hashing
key, Redis ACL password, the tenant salt secret the router generates), through a full run:
registration, requests over gRPC and HTTP with right and wrong keys, shutdown."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import redis
from e2e_procs import procs, until

from router.cli.client import GenerateOptions, RouterClient
from router.service.auth import hash_key

pytestmark = pytest.mark.e2e

KEY = "sk-acme-" + uuid.uuid4().hex
TOKEN = "tok-" + uuid.uuid4().hex
HASH_KEY = "hk-" + uuid.uuid4().hex
REDIS_PASSWORD = "pw-" + uuid.uuid4().hex


def _http_line(lines: list[str]) -> str:
    deadline = time.monotonic() + 30
    while not any(x.startswith("http listening on ") for x in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)  # another process: nothing to await
    line = next(x for x in lines if x.startswith("http listening on "))
    return line.split()[-1].removeprefix("http://")


def _post(url: str, body: dict, key: str) -> int:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def _served(address: str) -> bool:
    try:
        async with RouterClient(address, api_key=KEY, timeout_s=5) as c:
            await c.generate("hello secret world", GenerateOptions(max_new_tokens=2))
        return True
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # no worker synced yet
            return False
        raise


async def test_no_secret_in_any_log_line(redis_url: str, redis_prefix: str, tmp_path: Path):
    r = redis.Redis.from_url(redis_url)
    user = f"kvroute-test-{uuid.uuid4().hex[:8]}"
    r.execute_command("ACL", "SETUSER", user, "on", f">{REDIS_PASSWORD}", "~*", "&*", "+@all")
    keys = tmp_path / "keys"
    keys.write_text(f"acme:{hash_key(KEY)}\n")
    host = redis_url.split("://", 1)[1]
    authed_url = f"redis://{user}:{REDIS_PASSWORD}@{host}"
    worker_log, router_log = tmp_path / "worker.log", tmp_path / "router.log"
    try:
        with procs() as p:
            worker = p.start(
                "w-sec",
                [
                    "worker", "--executor", "sim", "--port", "0", "--worker-id", "w-sec",
                    "--block-size", "4", "--load-interval-s", "0.2", "--log-level", "DEBUG",
                    "--router-token", TOKEN, "--hash-key", HASH_KEY,
                    "--redis-url", redis_url, "--redis-prefix", redis_prefix,
                    "--redis-username", user, "--redis-password", REDIS_PASSWORD,
                ],
                log=worker_log,
            )  # fmt: skip
            router = p.start(
                "router",
                [
                    "router", "--port", "0", "--http-port", "0", "--log-level", "DEBUG",
                    "--redis-url", authed_url, "--redis-prefix", redis_prefix,
                    "--redis-poll-s", "0.2", "--api-keys", str(keys),
                    "--worker-token", TOKEN, "--hash-key", HASH_KEY,
                ],
                log=router_log,
            )  # fmt: skip
            await until(lambda: _served(router.address), "the router never served", 40)
            http = f"http://{_http_line(router.lines)}/v1/completions"
            body = {"model": "kvroute-tiny", "prompt": "hello secret world", "max_tokens": 2}
            assert _post(http, body, KEY) == 200
            assert _post(http, body, KEY + "-wrong") == 401
            async with RouterClient(router.address, api_key=KEY + "-wrong", timeout_s=5) as c:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await c.generate("hi", GenerateOptions(max_new_tokens=2))
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with RouterClient(router.address, api_key=KEY, timeout_s=5) as c:
                await c.explain("hello secret world")
            for proc in (router, worker):
                proc.popen.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0
        salt_secret = r.get(f"{redis_prefix}:tenant-salt-secret")
    finally:
        r.execute_command("ACL", "DELUSER", user)
    assert salt_secret  # the keyed router generated and kept one
    logs = {"worker": worker_log.read_text(), "router": router_log.read_text()}
    # the logs are real: DEBUG lines of a whole run, registration included
    assert "registered" in logs["worker"] and "DEBUG" in logs["router"], logs
    secrets = {
        "API key": KEY,
        "router token": TOKEN,
        "hash key": HASH_KEY,
        "Redis password": REDIS_PASSWORD,
        "tenant salt secret": salt_secret.decode(),
    }
    for who, text in logs.items():
        for what, secret in secrets.items():
            assert secret not in text, f"the {who}'s log holds the {what}"
