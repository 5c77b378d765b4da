"""Router-side faults: Redis down and back, router restart under load, a slow client,
overload."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections import Counter

import grpc
import pytest
import redis.asyncio as aioredis
from e2e_procs import procs
from faults_harness import (
    Load,
    Row,
    assert_no_leak,
    codes_text,
    converge,
    drive,
    free_port,
    no_stray_tasks,
    one_call,
    record,
    request,
    router_config,
    start_router,
    start_worker,
    wait_synced,
    wait_until,
)

from bench.bench_overload import OverloadConfig, capacity_rps
from edge.frontdoor import Overloaded
from edge.registry import DEFAULT_PREFIX
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.core.admission import AdmissionConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@contextlib.contextmanager
def redis_server(port: int):
    """A redis-server of this test's own on ``port`` (no persistence), killed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        popen = subprocess.Popen(
            [
                *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield popen
        finally:
            popen.kill()
            popen.wait(timeout=10)


async def registered(url: str) -> set[str]:
    client = aioredis.from_url(url, socket_connect_timeout=0.5)
    try:
        return {k.decode() async for k in client.scan_iter(match=f"{DEFAULT_PREFIX}worker:*")}
    except Exception:
        return set()
    finally:
        await client.aclose()


async def test_redis_down_and_back() -> None:
    try:
        subprocess.run(["redis-server", "--version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("redis-server is not installed")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with procs() as p, redis_server(port) as first_redis:
        await wait_until(lambda: _pings(url), "our redis-server answers")
        reg = ("--redis-url", url, "--registry-ttl-s", "1.5")
        workers = [start_worker(p, f"w{i}", *reg) for i in range(2)]
        async with no_stray_tasks():
            router = await start_router(router_config([], redis_url=url))
            try:
                await wait_synced(router, 2)
                first_redis.kill()
                first_redis.wait(timeout=10)
                healthy_seen = []
                during = await drive(router.address, num_requests=40, concurrency=8)
                healthy_seen.append(router.pool.num_healthy)
                await asyncio.sleep(2.0)  # several polls and heartbeats fail meanwhile
                healthy_seen.append(router.pool.num_healthy)
                with redis_server(port):
                    back = time.perf_counter()
                    reg_s = await wait_until(
                        lambda: _count(url, 2), "both workers registered again", 20
                    )
                    del back
                    after = await drive(router.address, num_requests=40, concurrency=8, first_id=99)
                    healthy_seen.append(router.pool.num_healthy)
                    await assert_no_leak(workers, router)
                    await converge(router, workers)
            finally:
                await router.stop(0)
    assert during.codes() == {"OK": 40} and after.codes() == {"OK": 40}
    assert healthy_seen == [2, 2, 2]  # membership never collapsed
    record(
        Row(
            test="redis_down",
            fault="Redis (the registry) SIGKILLed under load, restarted empty 2 s later",
            client_sees=f"while down: {codes_text(during)}; after: {codes_text(after)}",
            index_after="both workers kept (last membership), index == snapshots",
            recovery="Redis back (empty) -> both workers registered again",
            recover_s=round(reg_s, 2),
            details={"healthy_seen": healthy_seen, "registry_ttl_s": 1.5},
        )
    )


async def _pings(url: str) -> bool:
    client = aioredis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


async def _count(url: str, n: int) -> bool:
    return len(await registered(url)) >= n


async def test_router_restart_under_load() -> None:
    port = free_port()
    with procs() as p:
        workers = [start_worker(p, f"w{i}", speedup=4.0) for i in range(2)]
        addresses = [w.address for w in workers]
        async with no_stray_tasks():
            router = await start_router(router_config(addresses, port=port))
            stop = asyncio.Event()
            load = Load()
            try:
                await wait_synced(router, 2)
                load_task = asyncio.create_task(_steady(f"127.0.0.1:{port}", load, stop))
                await wait_until(lambda: len(load.outcomes) >= 20, "load flowing")
                stopped = time.perf_counter()
                await router.stop(0)
                router = await start_router(router_config(addresses, port=port))
                first_ok_s = await wait_until(
                    lambda: any(o.code == "OK" and o.started > stopped for o in load.outcomes),
                    "a request succeeds through the new router",
                )
                recovered = stopped + first_ok_s
                await wait_synced(router, 2)
                await asyncio.sleep(1.0)
                stop.set()
                await load_task
                await assert_no_leak(workers, router)
                converge_s = await converge(router, workers)
            finally:
                stop.set()
                await router.stop(0)
    codes = load.codes()
    assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, codes
    in_flight = Counter(o.code for o in load.outcomes if o.started < stopped and o.code != "OK")
    while_down = Counter(
        o.code for o in load.outcomes if stopped <= o.started < recovered and o.code != "OK"
    )
    after = Counter(o.code for o in load.outcomes if o.started >= recovered)
    assert set(after) == {"OK"}, after  # once it serves again, everything succeeds
    assert sum(in_flight.values()) <= 8  # at most the calls in flight at the stop
    record(
        Row(
            test="router_restart",
            fault="router stopped abruptly (grace 0) under load and started again on its port",
            client_sees=f"calls in flight at the stop (8 loops): {_text(in_flight)}; calls "
            f"sent while it was down (each loop retries every 50 ms): {_text(while_down)}; "
            f"after it serves again: {_text(after)}",
            index_after="rebuilt from snapshots; == each worker's snapshot",
            recovery="new router started -> first request served",
            recover_s=round(first_ok_s, 2),
            details={"converge_s": round(converge_s, 2)},
        )
    )


def _text(counts: Counter[str]) -> str:
    return ", ".join(f"{n} {code}" for code, n in sorted(counts.items())) or "none"


async def _steady(address: str, load: Load, stop: asyncio.Event, concurrency: int = 8) -> None:
    """Calls back to back (``concurrency`` at a time) until ``stop``; bounded at 2,000."""
    counter = iter(range(2000))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.RouterStub(ch)

        async def loop() -> None:
            for i in counter:
                if stop.is_set():
                    return
                await one_call(stub, request(i, max_new_tokens=24), 5.0, load)
                if load.outcomes[-1].code != "OK":
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop() for _ in range(concurrency)))


async def test_slow_client_is_bounded_and_its_worker_call_cancelled() -> None:
    with procs() as p:
        w = start_worker(p, "w0", speedup=1.0)
        # admission off: it would (rightly) refuse 600 tokens in a 1 s deadline up front
        config = router_config([w.address], admission=AdmissionConfig(enabled=False))
        async with no_stray_tasks():
            router = await start_router(config)
            try:
                await wait_synced(router, 1)
                async with grpc.aio.insecure_channel(router.address) as ch:
                    stub = pb_grpc.RouterStub(ch)
                    # 1: reads one message, then stalls; cancels after 1.5 s
                    call = stub.Generate(request(1, max_new_tokens=600), timeout=30)
                    await call.read()
                    await asyncio.sleep(1.5)
                    running = (await w.metrics())["kvroute_worker_running_requests"]
                    cancelled = time.perf_counter()
                    call.cancel()
                    freed_s = await wait_until(
                        lambda: _idle(w), "worker call cancelled after the client's", 10
                    )
                    del cancelled
                    # 2: never reads past the first message; its deadline passes
                    call = stub.Generate(request(2, max_new_tokens=600), timeout=1.0)
                    await call.read()
                    code = await call.code()
                    deadline_freed_s = await wait_until(lambda: _idle(w), "worker freed", 10)
                await assert_no_leak([w], router)
            finally:
                await router.stop(0)
    assert running == 1
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    record(
        Row(
            test="slow_client",
            fault="slow client: reads one message then stops reading (cancels after 1.5 s; "
            "a second one lets its 1 s deadline pass)",
            client_sees="CANCELLED (its own cancel); DEADLINE_EXCEEDED at its deadline",
            index_after="unchanged; the worker's request aborted and its KV freed",
            recovery="client cancel -> worker request gone (deadline case: "
            f"{deadline_freed_s:.2f} s after the status)",
            recover_s=round(freed_s, 2),
            details={"deadline_freed_s": round(deadline_freed_s, 2)},
        )
    )


async def _idle(w) -> bool:
    m = await w.metrics()
    return m["kvroute_worker_running_requests"] == 0 and m["kvroute_worker_waiting_requests"] == 0


async def test_overload_is_refused_fast_and_bounded() -> None:
    max_inflight = 8
    with procs() as p:
        w = start_worker(p, "w0", speedup=1.0)
        async with no_stray_tasks():
            router = await start_router(router_config([w.address], max_inflight=max_inflight))
            peak = 0
            sampling = True
            # how long each refused call spent inside the router, from the handler's entry to
            # its refusal: the client's own round trip also waits for this process's loop,
            # which 120 streaming calls keep busy on a loaded box
            refused_in_router = _time_refusals(router)

            async def sample() -> None:
                nonlocal peak
                while sampling:
                    peak = max(peak, router.frontend.num_inflight)
                    await asyncio.sleep(0.005)

            try:
                await wait_synced(router, 1)
                sampler = asyncio.create_task(sample())
                load = await drive(
                    router.address, num_requests=120, concurrency=120, max_new_tokens=60
                )
                sampling = False
                await sampler
                await assert_no_leak([w], router)
            finally:
                sampling = False
                await router.stop(0)
    codes = load.codes()
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["OK"] >= max_inflight and codes["RESOURCE_EXHAUSTED"] > 0
    refused = sorted(o.elapsed_s for o in load.outcomes if o.code == "RESOURCE_EXHAUSTED")
    served = [o.elapsed_s for o in load.outcomes if o.code == "OK"]
    p99 = refused[min(len(refused) - 1, int(0.99 * len(refused)))]
    # refused at admission, not after waiting for room: inside the router every refusal is
    # done before the first admitted call completes (no await lies between the handler's
    # entry and the refusal, so this holds however loaded the box is)
    assert len(refused_in_router) == codes["RESOURCE_EXHAUSTED"], (refused_in_router, codes)
    slowest = max(refused_in_router)
    assert peak <= max_inflight and slowest < min(served), (peak, slowest, min(served))
    record(
        Row(
            test="overload",
            fault=f"overload: 120 simultaneous calls, router --max-inflight {max_inflight}, "
            "1 paced worker",
            client_sees=f"{codes_text(load)}; refusals median "
            f"{1000 * statistics.median(refused):.0f} ms, p99 {1000 * p99:.0f} ms",
            index_after="unchanged",
            recovery=f"router in flight never above {max_inflight} (peak {peak}); refusal p99 in",
            recover_s=round(p99, 3),
            details={"codes": dict(codes), "peak_inflight": peak},
        )
    )


async def test_long_prompt_overload_admits_only_what_finishes() -> None:
    """8,000-token prompts offered at ~3x one paced worker's prefill capacity with 4 s
    deadlines, on the router's default admission: the calls it admits finish in time (at
    most as many miss as finish; without admission 78 of 82 missed), the rest are refused
    inside the router before any admitted call completes."""
    speedup, deadline_s, new_tokens, length = 0.25, 4.0, 4, 8_000
    capacity, _ = capacity_rps(
        OverloadConfig(
            num_workers=1,
            deadline_s=deadline_s,
            new_tokens=new_tokens,
            prompt_tokens=length,
            sim_speedup=speedup,
        )
    )
    rate, window_s = 3 * capacity, 12.0
    with procs() as p:
        w = start_worker(p, "w0", speedup=speedup)
        async with no_stray_tasks():
            router = await start_router(router_config([w.address]))
            refused_in_router = _time_refusals(router)
            load = Load()
            try:
                await wait_synced(router, 1)
                async with grpc.aio.insecure_channel(router.address) as ch:
                    stub = pb_grpc.RouterStub(ch)
                    calls = []
                    t0 = time.perf_counter()
                    for i in range(int(rate * window_s)):
                        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                        req = request(i, new_tokens, shared=0, length=length)
                        calls.append(asyncio.create_task(one_call(stub, req, deadline_s, load)))
                    await asyncio.gather(*calls)
                await assert_no_leak([w], router)
            finally:
                await router.stop(0)
    codes = load.codes()
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, codes
    ok, late, refused = codes["OK"], codes["DEADLINE_EXCEEDED"], codes["RESOURCE_EXHAUSTED"]
    assert ok >= 3 and refused > 0 and late <= ok, codes
    served = [o.elapsed_s for o in load.outcomes if o.code == "OK"]
    assert len(refused_in_router) == refused and max(refused_in_router) < min(served)
    times = sorted(o.elapsed_s for o in load.outcomes if o.code == "RESOURCE_EXHAUSTED")
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    goodput = ok / window_s / capacity
    record(
        Row(
            test="long_prompt_overload",
            fault=f"long-prompt overload: {length:,}-token prompts, {new_tokens} new tokens, "
            f"{deadline_s:g} s deadlines, offered at 3x 1 paced worker's prefill capacity "
            f"for {window_s:g} s (router defaults)",
            client_sees=f"{codes_text(load)}; goodput {100 * goodput:.0f}% of capacity; "
            f"refusals p99 {1000 * p99:.0f} ms",
            index_after="unchanged",
            recovery="refusal p99 in",
            recover_s=round(p99, 3),
            details={"codes": dict(codes), "goodput_of_capacity": round(goodput, 3)},
        )
    )


def _time_refusals(router) -> list[float]:
    """Wrap the router's Generate handler to time each refusal from the handler's entry;
    the list fills as calls are refused."""
    refused: list[float] = []
    handler = router.frontend.generate

    async def timed_generate(request, call):
        t0 = time.perf_counter()
        try:
            async for msg in handler(request, call):
                yield msg
        except Overloaded:
            refused.append(time.perf_counter() - t0)
            raise

    router.frontend.generate = timed_generate
    return refused
