"""How late the bridge's events reach a router when an engine publishes 100k blocks/s.

    python -m bench.bench_bridge_events [--blocks-per-s 100000] [--seconds 5] [--json OUT]

A `kvroute bridge` (its own process) in front of a stand-in engine in this process: a ZMQ
PUB speaking vLLM's KV-event wire (``[topic, seq, msgpack KVEventBatch]``, tagged-map
events, the encoder the worker's own vLLM publisher uses) and the two HTTP routes the bridge
reads at start (``/v1/models``, ``/metrics``). The engine stores ``--blocks-per-s`` blocks a
second (``--blocks-per-batch`` a batch, each batch a new chain of 16-token blocks, paced
every 10 ms) and, as a full cache does, removes as many: the chain stored
``--keep-batches`` batches earlier. A subscriber made as the router makes it
(``SubscribeKvEvents``, raw bytes, the router's decoder) timestamps every stored chain when
it arrives, matched to its publish time by its first kvroute block hash (computed here from
its tokens, as the bridge computes it).

Reported: the event latency p50 / p99 / max (publish -> the subscriber holds the decoded
batch), the rate achieved, blocks lost (sent but never seen), and the bridge's CPU seconds
(from /proc). Everything runs on 127.0.0.1 and is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import msgspec
import numpy as np
import zmq
import zmq.asyncio
from aiohttp import web

from bench.procs import report, start_kvroute
from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import DEFAULT_PARTITION, BlockStored
from kvroute_proto.hashing import block_hashes

BLOCK = 16
TOPIC = b"kv@bench@tiny"
TICK_S = 0.01
CLK_TCK = os.sysconf("SC_CLK_TCK")
_encode = msgspec.msgpack.Encoder().encode


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def _engine_http() -> tuple[web.AppRunner, str]:
    """The two routes the bridge reads: the model (its name and context) and the load."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 4096}]})

    async def metrics(_: web.Request) -> web.Response:
        labels = '{model_name="tiny"}'
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} 0\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} 0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} 0.5\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="100000"}} 1\n'
        )
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class Engine:
    """Publishes chains made beforehand (so that publishing is a socket write, not this
    process's CPU); remembers when each was sent, by its first kvroute block hash."""

    def __init__(self, pub: zmq.asyncio.Socket, blocks_per_batch: int, keep: int) -> None:
        self.pub = pub
        self.blocks_per_batch = blocks_per_batch
        self.keep = keep
        self.seq = 0
        self.rng = np.random.default_rng(1)
        self.live: list[list[int]] = []  # engine hashes of the chains held, oldest first
        self.made: list[tuple[int, bytes]] = []  # (our first block hash, payload), in order
        self.sent_at: dict[int, float] = {}  # our first block hash -> publish time
        self.stored = 0

    def make(self, num_batches: int) -> None:
        n = self.blocks_per_batch
        for _ in range(num_batches):
            tokens = self.rng.integers(1, 32000, size=n * BLOCK, dtype=np.uint32)
            ours = block_hashes(tokens, BLOCK, DEFAULT_PARTITION.seed, validate=False)
            engine = [random.getrandbits(63) for _ in range(n)]
            events: list[dict[str, object]] = [
                {
                    "type": "BlockStored",
                    "block_hashes": engine,
                    "parent_block_hash": None,
                    "token_ids": tokens.tolist(),
                    "block_size": BLOCK,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": None,
                    "group_idx": 0,
                }
            ]
            self.live.append(engine)
            if len(self.live) > self.keep:
                gone = self.live.pop(0)
                events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
            self.made.append((int(ours[0]), _encode([time.time(), events, 0])))

    async def publish(self, measured: bool) -> None:
        first, payload = self.made[self.seq]
        if measured:
            self.sent_at[first] = time.perf_counter()
            self.stored += self.blocks_per_batch
        await self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


async def subscribe(address: str, engine: Engine, seen: list[float], stop: asyncio.Event) -> None:
    """Follow the bridge's event stream as the router does; a latency per measured chain."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/kvroute.v1.Worker/SubscribeKvEvents",
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=None,
        )(pb.SubscribeRequest(subscriber_id="bench"))
        stopper = asyncio.create_task(stop.wait())
        try:
            while True:
                read = asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait({read, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    read.cancel()
                    return
                raw = read.result()
                if raw is grpc.aio.EOF:
                    return
                now = time.perf_counter()
                msg = codec.decode_stream_message(raw)
                for ev in getattr(msg, "events", ()):
                    if isinstance(ev, BlockStored) and ev.parent_hash is None:
                        sent = engine.sent_at.pop(int(ev.block_hashes[0]), None)
                        if sent is not None:
                            seen.append(now - sent)
        finally:
            stopper.cancel()
            call.cancel()


async def run(args: argparse.Namespace, logs: Path) -> dict[str, object]:
    runner, url = await _engine_http()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    bridge, address = start_kvroute(
        [
            "bridge",
            "--engine-url",
            url,
            "--events",
            f"tcp://127.0.0.1:{port}",
            "--block-size",
            str(BLOCK),
            "--port",
            "0",
        ],
        logs / "bridge.log",
    )
    engine = Engine(pub, args.blocks_per_batch, args.keep_batches)
    total_s = args.warmup_s + args.seconds
    engine.make(int(total_s * args.blocks_per_s / args.blocks_per_batch) + 700)
    seen: list[float] = []
    stop = asyncio.Event()
    try:
        sub = asyncio.create_task(subscribe(address, engine, seen, stop))
        # ZMQ's slow joiner: unmeasured chains until one comes through (bounded)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            engine.sent_at.clear()
            await engine.publish(measured=True)
            await asyncio.sleep(0.05)
        if not seen:
            raise RuntimeError(f"no event came through; bridge log: {logs / 'bridge.log'}")
        seen.clear()
        engine.stored = 0
        per_tick = args.blocks_per_s * TICK_S / args.blocks_per_batch
        start = time.perf_counter()
        cpu0 = 0.0
        owed = 0.0
        tick = 0
        while (elapsed := time.perf_counter() - start) < total_s:
            measured = elapsed >= args.warmup_s
            if measured and not cpu0:
                cpu0 = _cpu_seconds(bridge.pid)
                seen.clear()
                engine.sent_at.clear()
                engine.stored = 0
            owed += per_tick
            while owed >= 1 and engine.seq < len(engine.made):
                await engine.publish(measured)
                owed -= 1
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * TICK_S - time.perf_counter()))
        cpu = _cpu_seconds(bridge.pid) - cpu0
        await asyncio.sleep(args.drain_s)  # what is still on its way
        stop.set()
        await sub
    finally:
        bridge.terminate()
        bridge.wait(10)
        pub.close(0)
        ctx.term()
        await runner.cleanup()
    lost = len(engine.sent_at)
    return {
        "bench": "bridge_events",
        "blocks_per_s_target": args.blocks_per_s,
        "blocks_per_batch": args.blocks_per_batch,
        "seconds": args.seconds,
        "stored_blocks_per_s": round(engine.stored / args.seconds),
        "chains_seen": len(seen),
        "chains_lost": lost,
        "latency_p50_ms": round(percentile(seen, 0.5) * 1e3, 2),
        "latency_p99_ms": round(percentile(seen, 0.99) * 1e3, 2),
        "latency_max_ms": round(max(seen) * 1e3, 2) if seen else None,
        "bridge_cpu_s": round(cpu, 2),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks-per-s", type=int, default=100_000)
    parser.add_argument("--blocks-per-batch", type=int, default=64, help="one chain a batch")
    parser.add_argument("--keep-batches", type=int, default=200, help="chains held at once")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--drain-s", type=float, default=1.0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_bridge_events_") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
