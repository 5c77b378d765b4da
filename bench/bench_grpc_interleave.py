"""Does a router's event loop apply the peers' batches between a burst's RPCs, or after them?

The replay's ``--replica-apply-s`` charges each router for applying the other routers'
picks; whether that work waits for the router's whole queue of a burst's calls or goes
between two of them decides how late a peer's pick counts during a burst. This measures it
on the stack the router runs: a ``grpc.aio`` server on ``edge.runtime``'s loop
(uvloop where installed), whose unary handler spins ``--route-us`` like ``route()``, and a
subscription through ``router/service/redis_wire.py`` whose read callback spins ``--apply-us`` like
``apply_replica``. The first call of the burst blocks the loop ``--block-ms`` (so the rest of
the burst's calls pile up) and starts a publisher process that sends ``--messages`` to the
channel every ``--gap-us``. The server logs the order in which the handlers and the
callbacks ran: ``R`` a call routed, ``a`` a peer's batch applied.

    python -m bench.bench_grpc_interleave [--calls 32] [--messages 120] [--json OUT]

Prints the sequence, and how many batches were applied while calls of the burst were still
waiting to be routed (between the first and the last route): with none, a burst's peer picks
wait for the whole burst; with most, they go between calls. 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
import uuid
from typing import Any

import grpc

from edge.runtime import run_event_loop
from router.service.redis_wire import RedisTarget, RespConnection

SERVICE = "kvroute.bench.Interleave"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _server(args: dict[str, Any], port_q: Any, go: Any, out: Any) -> None:
    log: list[tuple[float, str]] = []

    async def route(request: bytes, context: Any) -> bytes:
        if request != b"warmup":
            log.append((time.perf_counter(), "R"))
            if not go.value:
                go.value = 1  # the publisher starts; the loop is blocked a while
                _spin(args["block_ms"] / 1e3)
        _spin(args["route_us"] / 1e6)
        return b"ok"

    def on_message(channel: bytes, data: bytes) -> None:
        log.append((time.perf_counter(), "a"))
        _spin(args["apply_us"] / 1e6)

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Route": grpc.unary_unary_rpc_method_handler(route)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sub = await RespConnection.open(RedisTarget.from_url(args["redis_url"]), on_message=on_message)
    try:
        await sub.call("SUBSCRIBE", args["channel"])
        port_q.put(port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            routed = sum(1 for _, k in log if k == "R")
            applied = sum(1 for _, k in log if k == "a")
            if routed >= args["calls"] and applied >= args["messages"]:
                break
            await asyncio.sleep(0.01)
    finally:
        sub.close()
        await server.stop(0)
    out.put(log)


def _server_proc(args: dict[str, Any], port_q: Any, go: Any, out: Any) -> None:
    try:
        run_event_loop(_server(args, port_q, go, out))
    except BaseException as exc:  # the parent reports it
        port_q.put(f"{type(exc).__name__}: {exc}")


def _publisher_proc(args: dict[str, Any], go: Any, ready: Any) -> None:
    async def main() -> None:
        pub = await RespConnection.open(RedisTarget.from_url(args["redis_url"]))
        ready.put("ready")
        try:
            deadline = time.monotonic() + 30
            while not go.value and time.monotonic() < deadline:
                await asyncio.sleep(0)
            for i in range(args["messages"]):
                pub.send("PUBLISH", args["channel"], b"peer%d" % i)
                _spin(args["gap_us"] / 1e6)
            await pub.call("PING")
        finally:
            pub.close()

    run_event_loop(main())


async def _client(port: int, calls: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/Route")
        await call(b"warmup")

        async def one(i: int) -> bytes:
            return await call(b"req%d" % i)

        await asyncio.gather(*(one(i) for i in range(calls)))


def run(args: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port_q, out, ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go = ctx.Value("i", 0)
    server = ctx.Process(target=_server_proc, args=(args, port_q, go, out))
    publisher = ctx.Process(target=_publisher_proc, args=(args, go, ready))
    server.start()
    publisher.start()
    try:
        port = port_q.get(timeout=60)
        if isinstance(port, str):
            raise RuntimeError(port)
        ready.get(timeout=60)  # the publisher is connected, waiting for the burst
        run_event_loop(_client(port, args["calls"]))
        log = out.get(timeout=60)
    finally:
        for p in (server, publisher):
            if p.pid is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    order = "".join(k for _, k in log)
    first, last = order.index("R"), order.rindex("R")
    between = order[first:last].count("a")
    return {
        "calls": args["calls"],
        "messages": args["messages"],
        "order": order,
        "routed": order.count("R"),
        "applied": order.count("a"),
        "applied_between_routes": between,
        "route_gaps_with_a_batch": sum(
            1 for i in range(first, last) if order[i] == "R" and order[i + 1] == "a"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_grpc_interleave",
        description="Whether a grpc.aio router loop applies the peers' batches between a "
        "burst's calls (module docstring).",
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--calls", type=int, default=32, help="the burst's calls (default 32)")
    p.add_argument("--messages", type=int, default=120, help="peer batches (default 120)")
    p.add_argument("--gap-us", type=float, default=500.0, help="between batches (default 500)")
    p.add_argument("--route-us", type=float, default=200.0, help="each call's work (default 200)")
    p.add_argument("--apply-us", type=float, default=100.0, help="each batch's (default 100)")
    p.add_argument("--block-ms", type=float, default=30.0, help="default 30")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    if a.calls < 2 or a.messages < 1:
        p.error("--calls must be >= 2 and --messages >= 1")
    if min(a.gap_us, a.route_us, a.apply_us, a.block_ms) < 0:
        p.error("--gap-us, --route-us, --apply-us and --block-ms must be >= 0")
    args = {k: getattr(a, k) for k in ("redis_url", "calls", "messages", "gap_us")}
    args.update(route_us=a.route_us, apply_us=a.apply_us, block_ms=a.block_ms)
    args["channel"] = f"kvroute-bench-interleave-{uuid.uuid4().hex[:8]}"
    try:
        result = run(args)
    except (RuntimeError, OSError) as exc:
        print(f"bench_grpc_interleave: {exc}", file=sys.stderr)
        return 1
    print(result["order"])
    print(
        f"{result['routed']} calls routed, {result['applied']} batches applied; "
        f"{result['applied_between_routes']} applied between the burst's first and last call, "
        f"after {result['route_gaps_with_a_batch']} of its {result['routed'] - 1} calls"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
