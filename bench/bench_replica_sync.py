"""How long replica sync takes through a real Redis: a pick at one router to its count at another.

``python -m bench.bench_replica_sync --redis-url redis://127.0.0.1:6379/0 --routers 2``
starts R router processes, each a :class:`RouterCore` with :class:`ReplicaSync` on a channel
of its own (a random prefix, so nothing else on the Redis is touched), the way ``kvroute
router --replica-sync`` runs them. Every router routes its share of a steady stream
(``--rate`` requests/s over all routers) and, every ``--burst-interval-s``, its share of a
burst of ``--burst`` requests placed at one instant (each router's share back to back, as a
router serves a burst's RPCs one after another); each request's first token and finish
follow ``--first-token-s`` and ``--finish-s`` after its pick, and are synced too.

Measured, per router and pooled (seconds):

* ``peer_delay``: from a pick at one router (``route()`` returned) to the moment another
  router applies it (``RouterCore.apply_replica``), steady and burst picks apart. This is
  what ``kvroute replay --replica-sync-delay-s`` models as one constant.
* ``echo_delay``: what each router measures of its own batches (queued to echoed back by
  Redis), the figure its auto ``--replica-sync-window-s`` follows.
* ``route``: each ``route()`` call, with the publish of its pick (written to the socket
  inside the call).
* ``cpu_per_request_s``: the router processes' CPU time over the run (routing, publishing,
  applying the peers' batches) per request placed at any router: the sync's whole cost.

The routers share the machine's monotonic clock (Linux CLOCK_MONOTONIC is system-wide), so a
pick's time travels in its request id. Counts check that nothing was lost: every peer pick
sent is applied at every other router. Load and fault tests in this project only target
127.0.0.1; so does this one unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import queue
import random
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from edge.runtime import run_event_loop
from router.core.core_types import ReplicaEvent, ReplicaRouted
from router.core.replicas import ReplicaConfig
from router.core.router_core import RouterConfig, RouterCore, RouteRequest
from router.service.replica_sync import ReplicaSync

BLOCK = 16


@dataclass(frozen=True)
class Plan:
    redis_url: str
    prefix: str
    routers: int
    workers: int
    duration_s: float
    rate: float
    burst: int
    burst_interval_s: float
    prompt_tokens: int
    first_token_s: float
    finish_s: float


def _request_id(kind: str, router: int, n: int) -> str:
    return f"{kind}-{router}-{n}-{time.monotonic_ns()}"


def _parse(request_id: str) -> tuple[str, int]:
    kind, _, _, t_ns = request_id.split("-")
    return kind, int(t_ns)


def _quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {
        "n": len(values),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


async def _router(k: int, plan: Plan, ready: Any, start: Any) -> dict[str, Any]:
    core = RouterCore(
        RouterConfig(block_size=BLOCK, replica=ReplicaConfig(count=plan.routers, sync=True)),
        clock=time.monotonic,
        rng=random.Random(k),
    )
    for i in range(plan.workers):
        core.add_worker(f"w{i}", block_size=BLOCK)
    peer: dict[str, list[float]] = {"steady": [], "burst": []}
    echo: list[float] = []
    apply = core.apply_replica
    observe = core.observe_replica_sync_delay

    def timed_apply(router_id: str, event: ReplicaEvent) -> bool:
        if isinstance(event, ReplicaRouted):
            kind, t_ns = _parse(event.request_id)
            peer[kind].append((time.monotonic_ns() - t_ns) / 1e9)
        return apply(router_id, event)

    def timed_observe(delay_s: float) -> None:
        echo.append(delay_s)
        observe(delay_s)

    core.apply_replica = timed_apply  # type: ignore[method-assign]
    core.observe_replica_sync_delay = timed_observe  # type: ignore[method-assign]
    sync = ReplicaSync(core, plan.redis_url, prefix=plan.prefix, router_id=f"bench-{k}")
    rng = np.random.default_rng(k)
    loop = asyncio.get_running_loop()
    sent = {"steady": 0, "burst": 0}
    route_s: list[float] = []

    def place(kind: str) -> None:
        tokens = rng.integers(0, 50_000, plan.prompt_tokens, dtype=np.uint32)
        request_id = _request_id(kind, k, sent[kind])
        t0 = time.perf_counter()
        core.route(RouteRequest(request_id, tokens))
        route_s.append(time.perf_counter() - t0)
        sent[kind] += 1
        loop.call_later(plan.first_token_s, core.on_first_token, request_id)
        loop.call_later(plan.finish_s, core.on_finished, request_id, 1)

    start_at = 0.0  # set once every router has subscribed

    async def steady() -> None:
        if plan.rate <= 0:
            return
        gap = plan.routers / plan.rate
        t = start_at + k * gap / plan.routers
        while t < start_at + plan.duration_s:
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            place("steady")
            t += gap

    async def bursts() -> None:
        if plan.burst <= 0:
            return
        share = plan.burst // plan.routers + (k < plan.burst % plan.routers)
        t = start_at + plan.burst_interval_s / 2
        while t < start_at + plan.duration_s:
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            for _ in range(share):
                place("burst")
                await asyncio.sleep(0)  # the next RPC of the burst: the loop runs between
            t += plan.burst_interval_s

    probe = aioredis.Redis.from_url(plan.redis_url, socket_connect_timeout=5)
    try:  # a Redis that is not there is an error here, not a subscription retried forever
        await probe.ping()
    finally:
        await probe.aclose()
    await sync.start()
    try:
        await asyncio.wait_for(sync.subscribed.wait(), timeout=30)
        ready.put(k)
        # the parent sets the common start once every router has subscribed
        while not start.value:
            await asyncio.sleep(0.01)
        if start.value < 0:
            raise RuntimeError("stopped before the start: another router failed")
        start_at = start.value
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu0 = time.process_time()
        await asyncio.gather(steady(), bursts())
        await asyncio.sleep(max(plan.finish_s, 0.5) + 0.5)  # the last picks and ends arrive
        cpu_s = time.process_time() - cpu0  # routing, publishing, applying the peers' events
    finally:
        await sync.close()
    return {
        "router": k,
        "sent": sent,
        "peer_delay": peer,
        "echo_delay": echo,
        "route_s": route_s,
        "cpu_s": cpu_s,
        "counters": dict(sync.counters),
    }


def _child(k: int, plan: Plan, out: Any, ready: Any, start: Any) -> None:
    try:  # on uvloop, as the router runs
        out.put(run_event_loop(_router(k, plan, ready, start)))
    except BaseException as exc:  # the parent reports it
        out.put({"router": k, "error": f"{type(exc).__name__}: {exc}"})


def run(plan: Plan) -> dict[str, Any]:
    """Run the routers of ``plan`` in their own processes; their pooled and per-router
    figures (module docstring). RuntimeError when a router failed or a pick was lost."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Queue()
    start = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=_child, args=(k, plan, out, ready, start)) for k in range(plan.routers)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        subscribed = 0
        give_up = time.monotonic() + 60
        while subscribed < len(procs):  # every router subscribed, or one failed
            try:
                ready.get(timeout=0.05)
                subscribed += 1
            except queue.Empty:
                failed = None
                with contextlib.suppress(queue.Empty):
                    failed = out.get_nowait()
                if failed is not None:
                    raise RuntimeError(
                        failed.get("error", "a router ended before starting")
                    ) from None
                if time.monotonic() > give_up:
                    raise RuntimeError("a router did not subscribe within 60 s") from None
        # a margin for Redis to register the last subscription
        start.value = time.monotonic() + 0.5
        deadline = start.value + plan.duration_s + plan.finish_s + 60
        for _ in procs:
            results.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        if not start.value:
            start.value = -1.0  # the routers still waiting for the start stop
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    results.sort(key=lambda r: r["router"])
    pooled: dict[str, list[float]] = {"steady": [], "burst": []}
    for r in results:
        for kind in pooled:
            pooled[kind] += r["peer_delay"][kind]
    lost = {}
    for r in results:
        for kind in ("steady", "burst"):
            expected = sum(o["sent"][kind] for o in results if o["router"] != r["router"])
            got = len(r["peer_delay"][kind])
            if got != expected:
                lost[f"router {r['router']} {kind}"] = expected - got
    if lost:
        raise RuntimeError(f"picks not applied at a peer: {lost}")
    return {
        "routers": plan.routers,
        "workers": plan.workers,
        "rate": plan.rate,
        "burst": plan.burst,
        "burst_interval_s": plan.burst_interval_s,
        "prompt_tokens": plan.prompt_tokens,
        "duration_s": plan.duration_s,
        "peer_delay_steady": _quantiles(pooled["steady"]),
        "peer_delay_burst": _quantiles(pooled["burst"]),
        "echo_delay": _quantiles([d for r in results for d in r["echo_delay"]]),
        "route": _quantiles([d for r in results for d in r["route_s"]]),
        # the router processes' CPU time over the run, per request any router placed: the
        # sync's whole cost (its publishes, the peers' batches applied) next to routing's
        "cpu_per_request_s": sum(r["cpu_s"] for r in results)
        / max(1, sum(sum(r["sent"].values()) for r in results)),
        "per_router": [
            {
                "router": r["router"],
                "sent": r["sent"],
                "peer_delay_steady": _quantiles(r["peer_delay"]["steady"]),
                "peer_delay_burst": _quantiles(r["peer_delay"]["burst"]),
                "echo_delay": _quantiles(r["echo_delay"]),
                "counters": r["counters"],
            }
            for r in results
        ],
    }


def _raw_subscriber(url: str, channel: str, n: int, out: Any) -> None:
    async def main() -> list[float]:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                await pubsub.get_message(timeout=5)  # the subscription's confirmation
                out.put("ready")
                delays: list[float] = []
                while len(delays) < n:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
                    if msg is None:
                        break  # the publisher stopped early; the parent counts what came
                    delays.append((time.monotonic_ns() - int(msg["data"])) / 1e9)
                return delays
        finally:
            await client.aclose()

    try:
        out.put(run_event_loop(main()))
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")


def run_raw(url: str, messages: int, rate: float) -> dict[str, float | int]:
    """The floor under the sync: plain Redis pub/sub from this process to another, each
    message its publish time, ``rate`` a second (no kvroute code on either side)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    channel = f"kvroute-bench-raw-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_raw_subscriber, args=(url, channel, messages, out))
    proc.start()
    try:
        first = out.get(timeout=60)
        if first != "ready":
            raise RuntimeError(str(first))

        async def publish() -> None:
            client = aioredis.Redis.from_url(url, socket_connect_timeout=5)
            try:
                for _ in range(messages):
                    await client.publish(channel, str(time.monotonic_ns()))
                    await asyncio.sleep(1.0 / rate)
            finally:
                await client.aclose()

        run_event_loop(publish())
        delays = out.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if isinstance(delays, str):
        raise RuntimeError(delays)
    if len(delays) != messages:
        raise RuntimeError(f"raw pub/sub: {messages - len(delays)} of {messages} messages lost")
    return _quantiles(delays)


def _ms(q: dict[str, float | int]) -> str:
    if not q.get("n"):
        return "-"
    return (
        f"{q['p50'] * 1e3:.3f} / {q['p90'] * 1e3:.3f} / {q['p99'] * 1e3:.3f} / "
        f"{q['max'] * 1e3:.3f} ms (n={q['n']})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_replica_sync",
        description=__doc__.split("\n\n")[0],
        epilog="Figures: p50 / p90 / p99 / max (decision 0025).",
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="default %(default)s")
    p.add_argument("--routers", type=int, default=2, help="router processes (default 2)")
    p.add_argument("--workers", type=int, default=8, help="workers each router knows (default 8)")
    p.add_argument("--duration-s", type=float, default=10.0, help="default %(default)s")
    p.add_argument(
        "--rate", type=float, default=200.0, help="steady requests/s, all routers (default 200)"
    )
    p.add_argument("--burst", type=int, default=64, help="requests per burst (default 64; 0: none)")
    p.add_argument("--burst-interval-s", type=float, default=1.0, help="default %(default)s")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="default %(default)s")
    p.add_argument("--first-token-s", type=float, default=0.05, help="default %(default)s")
    p.add_argument("--finish-s", type=float, default=0.5, help="default %(default)s")
    p.add_argument(
        "--raw",
        action="store_true",
        help="also time plain Redis pub/sub between two processes (no kvroute code): the "
        "floor under the sync on this machine",
    )
    p.add_argument(
        "--raw-messages", type=int, default=1000, help="with --raw, at 200/s (default 1000)"
    )
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.routers < 2:
        p.error(f"--routers must be >= 2 (sync is between routers), got {args.routers}")
    for name in ("workers", "prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.raw_messages < 1:
        p.error(f"--raw-messages must be >= 1, got {args.raw_messages}")
    if args.burst < 0 or args.rate < 0:
        p.error("--burst and --rate must be >= 0")
    if not args.duration_s > 0 or not args.burst_interval_s > 0:
        p.error("--duration-s and --burst-interval-s must be > 0")
    if not 0 <= args.first_token_s <= args.finish_s:
        p.error("need 0 <= --first-token-s <= --finish-s")
    plan = Plan(
        redis_url=args.redis_url,
        prefix=f"kvroute-bench-{uuid.uuid4().hex[:8]}:",
        routers=args.routers,
        workers=args.workers,
        duration_s=args.duration_s,
        rate=args.rate,
        burst=args.burst,
        burst_interval_s=args.burst_interval_s,
        prompt_tokens=args.prompt_tokens,
        first_token_s=args.first_token_s,
        finish_s=args.finish_s,
    )
    try:
        result = run(plan)
        if args.raw:
            result["raw_pubsub"] = run_raw(args.redis_url, args.raw_messages, 200.0)
    except RuntimeError as exc:
        print(f"bench_replica_sync: {exc}", file=sys.stderr)
        return 1
    print(
        f"{plan.routers} routers, {plan.workers} workers, {plan.rate:g} req/s steady, bursts of "
        f"{plan.burst} every {plan.burst_interval_s:g} s, {plan.prompt_tokens} prompt tokens"
    )
    print(f"  pick -> applied at a peer, steady: {_ms(result['peer_delay_steady'])}")
    print(f"  pick -> applied at a peer, burst:  {_ms(result['peer_delay_burst'])}")
    print(f"  own batch -> Redis echo:           {_ms(result['echo_delay'])}")
    print(f"  route() (with its publish):        {_ms(result['route'])}")
    cpu_ms = result["cpu_per_request_s"] * 1e3
    print(f"  router CPU per request placed:     {cpu_ms:.3f} ms (all routers' processes)")
    if "raw_pubsub" in result:
        print(f"  plain pub/sub, process to process: {_ms(result['raw_pubsub'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
