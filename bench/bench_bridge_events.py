"""How late the bridge's events reach a router when an engine publishes 100k blocks/s.

    python -m bench.bench_bridge_events [--blocks-per-s 100000] [--seconds 5] [--json OUT]

A `kvroute bridge` (its own process) in front of a stand-in engine: a publisher process
speaking vLLM's KV-event wire (ZMQ PUB, ``[topic, seq, msgpack KVEventBatch]``, tagged-map
events) and, in this process, the two HTTP routes the bridge reads at start (``/v1/models``,
``/metrics``). The engine takes a step every 10 ms and publishes one batch a step, as vLLM
does: ``--chains-per-batch`` requests' prompts stored (each a new chain of
``--blocks-per-chain`` 16-token blocks), and, as a full cache does, as many blocks removed
(the chains stored ``--keep-chains`` chains earlier), at ``--blocks-per-s`` stored blocks a
second. A subscriber made as the router makes it (``SubscribeKvEvents``, raw bytes, the
router's decoder) notes when each chain arrives, matched to its publish time by its first
kvroute block hash (computed from its tokens, as the bridge computes it).

Reported: the event latency p50 / p99 / max (publish -> the subscriber holds the decoded
batch), the rate achieved, chains lost (sent but never seen), the bridge's CPU seconds
(from /proc) and its warnings. Everything runs on 127.0.0.1 and is bounded in time.

``--bridge-cpu N`` gives the bridge core N of its own (the publisher, the subscriber and the
stand-in's HTTP routes on the other cores), as a bridge started beside its engine has: with
everything on the same cores, the tail measures the scheduler's sharing, not the bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np
import zmq
from aiohttp import web

from bench.cpu_budget import own_cpu_seconds
from bench.procs import report, start_kvroute
from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import DEFAULT_PARTITION, BlockStored
from kvroute_proto.hashing import block_hashes

BLOCK = 16
TOPIC = b"kv@bench@tiny"
TICK_S = 0.01
_encode = msgspec.msgpack.Encoder().encode


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
    """The stand-in engine's publisher, in a process of its own (so that the subscriber's
    work does not slow the publishing, nor the other way round). Chains are made
    beforehand, so publishing is a socket write; it remembers when each was sent, by its
    first kvroute block hash."""

    def __init__(self, pub: zmq.Socket, chains: int, blocks: int, keep: int) -> None:
        self.pub = pub
        self.chains_per_batch = chains
        self.blocks_per_chain = blocks
        self.keep = keep
        self.seq = 0
        self.rng = np.random.default_rng(1)
        self.live: list[list[int]] = []  # engine hashes of the chains held, oldest first
        self.made: list[tuple[list[int], bytes]] = []  # (chains' first hashes, payload)
        self.sent_at: dict[int, float] = {}  # our first block hash -> publish time
        self.stored = 0

    def make(self, num_batches: int) -> None:
        """Each batch an engine step: its chains stored, the oldest held chains removed."""
        n = self.blocks_per_chain
        for _ in range(num_batches):
            events: list[dict[str, object]] = []
            firsts = []
            for _ in range(self.chains_per_batch):
                tokens = self.rng.integers(1, 32000, size=n * BLOCK, dtype=np.uint32)
                firsts.append(int(block_hashes(tokens[:BLOCK], BLOCK, DEFAULT_PARTITION.seed)[0]))
                engine = [random.getrandbits(63) for _ in range(n)]
                events.append(
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
                )
                self.live.append(engine)
                if len(self.live) > self.keep:
                    gone = self.live.pop(0)
                    events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
            self.made.append((firsts, _encode([time.time(), events, 0])))

    def publish(self, measured: bool) -> None:
        firsts, payload = self.made[self.seq]
        if measured:
            now = time.perf_counter()  # CLOCK_MONOTONIC: one clock for the host's processes
            self.sent_at.update(dict.fromkeys(firsts, now))
            self.stored += len(firsts) * self.blocks_per_chain
        self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


def _publish(conn: Connection, args: argparse.Namespace) -> None:
    """The publisher process: bind, say the port, publish unmeasured chains until told
    ``go`` (ZMQ's slow joiner), then the paced run; send back what was sent when."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    conn.send(pub.bind_to_random_port("tcp://127.0.0.1"))
    total_s = args.warmup_s + args.seconds
    engine = Engine(pub, args.chains_per_batch, args.blocks_per_chain, args.keep_chains)
    per_batch = args.chains_per_batch * args.blocks_per_chain
    engine.make(int(total_s * args.blocks_per_s / per_batch) + 700)
    while not conn.poll(0.05) and engine.seq < 600:  # bounded: 30 s
        engine.publish(measured=True)
    conn.recv()
    engine.sent_at.clear()
    engine.stored = 0
    per_tick = args.blocks_per_s * TICK_S / per_batch
    start = time.perf_counter()
    owed = 0.0
    tick = 0
    measuring = False
    while (elapsed := time.perf_counter() - start) < total_s:
        if not measuring and elapsed >= args.warmup_s:
            measuring = True
            conn.send("measuring")
        owed += per_tick
        while owed >= 1 and engine.seq < len(engine.made):
            engine.publish(measuring)
            owed -= 1
        tick += 1
        time.sleep(max(0.0, start + tick * TICK_S - time.perf_counter()))
    conn.send((engine.sent_at, engine.stored))
    conn.recv()  # bye: the socket stays open until the subscriber is done
    pub.close(0)
    ctx.term()


async def subscribe(address: str, arrived: dict[int, float], stop: asyncio.Event) -> None:
    """Follow the bridge's event stream as the router does (its compiled decode when
    numba is installed); the arrival time of every chain's first block."""
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
                for ev in getattr(codec.decode_stream_message(raw), "events", ()):
                    if isinstance(ev, BlockStored) and ev.parent_hash is None:
                        arrived[int(ev.block_hashes[0])] = now
        finally:
            stopper.cancel()
            call.cancel()


async def _recv(conn: Connection, timeout_s: float = 120.0) -> Any:
    """The publisher's next message (EOFError when it died, TimeoutError past the bound)."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll():
        if time.monotonic() > deadline:
            raise TimeoutError("the publisher process did not answer")
        await asyncio.sleep(0.01)
    return conn.recv()


async def run(args: argparse.Namespace, logs: Path) -> dict[str, object]:
    codec.enable_compiled_decode()  # as the router decodes (False without numba)
    cores = os.sched_getaffinity(0)
    if args.bridge_cpu is not None:  # the rest (and every child but the bridge) elsewhere
        os.sched_setaffinity(0, cores - {args.bridge_cpu})
    runner, url = await _engine_http()
    conn, child_conn = multiprocessing.get_context("spawn").Pipe()
    publisher = multiprocessing.get_context("spawn").Process(
        target=_publish, args=(child_conn, args), daemon=True
    )
    publisher.start()
    child_conn.close()  # the child's end: EOF here if it dies
    bridge = None
    try:
        port = await _recv(conn)
        if args.bridge_cpu is not None:  # the bridge inherits this thread's mask at fork
            os.sched_setaffinity(0, {args.bridge_cpu})
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
        if args.bridge_cpu is not None:
            os.sched_setaffinity(0, cores - {args.bridge_cpu})
        arrived: dict[int, float] = {}
        stop = asyncio.Event()
        sub = asyncio.create_task(subscribe(address, arrived, stop))
        deadline = time.monotonic() + 30
        while not arrived and time.monotonic() < deadline and not sub.done():
            await asyncio.sleep(0.02)
        if not arrived:
            raise RuntimeError(f"no event came through; bridge log: {logs / 'bridge.log'}")
        conn.send("go")
        await _recv(conn)  # measuring
        cpu0 = own_cpu_seconds(bridge.pid)
        sent_at, stored = await _recv(conn)
        cpu = own_cpu_seconds(bridge.pid) - cpu0
        await asyncio.sleep(args.drain_s)  # what is still on its way
        stop.set()
        await sub
        conn.send("bye")
    finally:
        os.sched_setaffinity(0, cores)
        if bridge is not None:
            bridge.terminate()
            bridge.wait(10)
        publisher.join(10)
        if publisher.is_alive():
            publisher.kill()
        await runner.cleanup()
    seen = [arrived[h] - t for h, t in sent_at.items() if h in arrived]
    log_lines = (logs / "bridge.log").read_text().splitlines()
    warnings = [line for line in log_lines if " INFO " not in line]
    return {
        "bench": "bridge_events",
        "blocks_per_s_target": args.blocks_per_s,
        "chains_per_batch": args.chains_per_batch,
        "blocks_per_chain": args.blocks_per_chain,
        "seconds": args.seconds,
        "stored_blocks_per_s": round(stored / args.seconds),
        "chains_seen": len(seen),
        "chains_lost": len(sent_at) - len(seen),
        "latency_p50_ms": round(percentile(seen, 0.5) * 1e3, 2),
        "latency_p99_ms": round(percentile(seen, 0.99) * 1e3, 2),
        "latency_max_ms": round(max(seen) * 1e3, 2) if seen else None,
        "bridge_cpu_s": round(cpu, 2),
        "cpu_count": os.cpu_count(),
        "bridge_cpu": args.bridge_cpu,
        "bridge_warnings": warnings[:5],  # why chains were lost, if they were
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks-per-s", type=int, default=100_000)
    parser.add_argument(
        "--chains-per-batch", type=int, default=16, help="requests prefilled in a step"
    )
    parser.add_argument("--blocks-per-chain", type=int, default=64, help="a request's blocks")
    parser.add_argument("--keep-chains", type=int, default=2000, help="chains held at once")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--drain-s", type=float, default=1.0)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument(
        "--bridge-cpu", type=int, help="pin the bridge to this core, everything else off it"
    )
    args = parser.parse_args(argv)
    if args.bridge_cpu is not None and args.bridge_cpu not in os.sched_getaffinity(0):
        parser.error(f"--bridge-cpu {args.bridge_cpu}: not a core this process may use")
    if args.bridge_cpu is not None and len(os.sched_getaffinity(0)) < 2:
        parser.error("--bridge-cpu needs two cores or more")
    with tempfile.TemporaryDirectory(prefix="bench_bridge_events_") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
