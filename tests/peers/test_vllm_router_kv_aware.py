"""vllm-router's ``kv_aware`` policy in front of kvroute workers, fed by their ZMQ events.

Two real ``kvroute worker`` processes publish their KV events in vLLM's wire
(``--kv-events-zmq``, ``--kv-events-zmq-replay``, the default empty topic); a real
vllm-router 0.1.17 (its own virtualenv, bench/peers/install_peers.sh vllm) subscribes to
them as static event sources. Each prompt is first served by one worker directly, so only
that worker's events name its blocks; sent again through vllm-router, it must land on that
worker and be a cache hit there. The holders alternate, so a router that credited nothing
(it falls back to the least loaded worker, the same one for every prompt when all are idle)
sends at least one prompt to the wrong worker.

Marked ``peer``: deselected from the default run; ``.ci/run`` runs ``pytest -m peer`` after
installing the peer. A missing virtualenv is a failure that says how to make it, never a skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.e2e_procs import ROOT, procs
from tests.peers import free_port, stop

pytestmark = [pytest.mark.peer, pytest.mark.timeout(300)]

VENV = Path(os.environ.get("KVROUTE_VLLM_ROUTER_VENV", ROOT / ".peers" / "vllm"))
BLOCK = 16
MODEL = "kvroute-tiny"  # the sim worker's served model name
PROMPT_TOKENS = 4 * BLOCK
START_S = 60.0


def _post(url: str, body: dict) -> dict:  # type: ignore[type-arg]
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _complete(base: str, prompt: list[int]) -> tuple[str, int]:
    """(serving worker, cached prompt tokens) of one token-id completion."""
    out = _post(f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    return out["kvroute"]["worker_id"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_ok(url: str, proc: subprocess.Popen, log: Path) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:  # bounded by the deadline
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _prompt(k: int) -> list[int]:
    return [(37 * k + 7 * j) % 250 + 3 for j in range(PROMPT_TOKENS)]


def test_vllm_router_kv_aware_routes_to_the_kvroute_worker_holding_the_prefix(tmp_path: Path):
    python = VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"vllm-router's virtualenv is missing ({VENV}): make it with "
            "bench/peers/install_peers.sh vllm (or point KVROUTE_VLLM_ROUTER_VENV at one)",
            pytrace=False,
        )
    http = [free_port(), free_port()]
    pub = [free_port(), free_port()]
    replay = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in http]
    with procs() as p:
        for i in range(2):
            p.start(
                f"w{i}",
                [
                    "worker", "--executor", "sim", "--port", "0", "--http-port", str(http[i]),
                    "--worker-id", f"w{i}", "--block-size", str(BLOCK), "--log-level", "WARNING",
                    "--kv-events-zmq", f"tcp://127.0.0.1:{pub[i]}",
                    "--kv-events-zmq-replay", f"tcp://127.0.0.1:{replay[i]}",
                ],
            )  # fmt: skip
        port = free_port()
        argv = [
            str(python), "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--policy", "kv_aware",
            "--worker-urls", *urls, "--kv-event-block-size", str(BLOCK),
            "--kv-event-model", MODEL, "--worker-startup-check-interval", "1",
            "--log-level", "debug",
        ]  # fmt: skip
        for i in range(2):
            argv += ["--kv-event-source", f"{urls[i]}=tcp://127.0.0.1:{pub[i]}"]
            argv += ["--kv-event-replay-source", f"{urls[i]}=tcp://127.0.0.1:{replay[i]}"]
        log = tmp_path / "vllm-router.log"
        with log.open("w") as out:
            router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            front = f"http://127.0.0.1:{port}"
            _wait_ok(f"{front}/health", router, log)
            time.sleep(1.0)  # the router's SUB sockets join after it reports healthy
            for k in range(4):  # prime: each prompt cached on one worker only
                assert _complete(urls[k % 2], _prompt(k)) == (f"w{k % 2}", 0)
            time.sleep(0.5)  # the events reach the router's index
            routed = [_complete(front, _prompt(k)) for k in range(4)]
            # the last block is never credited (the engine recomputes the last token)
            want = [(f"w{k % 2}", PROMPT_TOKENS - 1) for k in range(4)]
            plain = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # its log's colours
            credits = [ln for ln in plain.splitlines() if "credited_prefix" in ln]
            assert routed == want, (routed, credits[-4:])
        finally:
            stop(router, timeout=20)
