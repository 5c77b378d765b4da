"""Harness of the fault suite: worker processes (sim executor) started with ``e2e_procs``,
the router served in this process (so a test can read its index and in-flight table), a
bounded load driver, the index-vs-snapshot comparison, the leak check run after every
fault, and the RELIABILITY.md row each test writes.

Everything binds 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import grpc
from e2e_procs import ROOT, Proc, Procs, _read_until_listening

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.codec import stream_message_from_pb
from kvroute_proto.events import Snapshot
from router.core.router_core import RouterConfig
from router.service.frontend import FrontendConfig
from router.service.resilience import BackoffConfig, EjectionConfig
from router.service.server import RegistryConfig, RouterServer, RouterServerConfig
from router.service.worker_conn import ConnectionConfig

OUT_ENV = "KVROUTE_RELIABILITY_OUT"
BLOCK_SIZE = 4
POLL_S = 0.05
PURGE_AFTER_S = 2.0  # a down worker's index entries are dropped after this

FAST_CONN = ConnectionConfig(
    keepalive_time_s=1.0,
    keepalive_timeout_s=1.0,
    rpc_timeout_s=2.0,
    purge_after_s=PURGE_AFTER_S,
    backoff=BackoffConfig(initial_s=0.05, max_s=0.5),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(check: Callable[[], object], what: str, timeout: float = 20.0) -> float:
    """Poll ``check`` (sync or async) until truthy; the seconds it took. AssertionError
    naming ``what`` after ``timeout``."""
    start = time.perf_counter()
    deadline = start + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.perf_counter() - start
        if time.perf_counter() > deadline:
            raise AssertionError(f"{what} (not within {timeout} s)")
        await asyncio.sleep(POLL_S)


# ---- worker processes ------------------------------------------------------------------


@dataclass
class FaultWorker:
    worker_id: str
    proc: Proc
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    async def metrics(self) -> dict[str, float]:
        """Its Prometheus gauges and counters, by name (labels dropped: one worker)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(5)) as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(kvroute_worker_[a-z_]+)(?:\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    async def snapshot(self) -> Snapshot:
        """The worker's own view: the Snapshot it sends a new subscriber (epoch 0)."""
        options = [("grpc.max_receive_message_length", -1)]  # a big cache: a big snapshot
        async with grpc.aio.insecure_channel(self.address, options=options) as ch:
            call = pb_grpc.WorkerStub(ch).SubscribeKvEvents(
                pb.SubscribeRequest(epoch=0, subscriber_id="faults-test")
            )
            msg = await asyncio.wait_for(call.read(), 20)
            call.cancel()
        item = stream_message_from_pb(msg)
        assert isinstance(item, Snapshot), item
        return item


def snapshot_blocks(snap: Snapshot) -> set[int]:
    return {h for stored in snap.blocks for h in stored.block_hashes}


def start_worker(
    procs: Procs,
    worker_id: str,
    *extra: str,
    port: int = 0,
    env: dict[str, str] | None = None,
    speedup: float = 0.0,
    kv_slots: int = 65536,
) -> FaultWorker:
    """``kvroute worker --executor sim`` as a process (``speedup`` > 0: real-time pacing of
    the modelled step times), with a metrics port for the leak check."""
    port = port or free_port()
    metrics_port = free_port()
    args = [
        "worker",
        "--executor",
        "sim",
        "--port",
        str(port),
        "--worker-id",
        worker_id,
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-slots",
        str(kv_slots),
        "--load-interval-s",
        "0.2",
        "--metrics-port",
        str(metrics_port),
        "--grace-s",
        "1",
        "--log-level",
        "WARNING",
        *(["--sim-speedup", str(speedup)] if speedup > 0 else []),
        *extra,
    ]
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvroute_cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    proc = Proc(worker_id, popen)
    procs.procs.append(proc)
    _read_until_listening(proc, "listening on", 60.0)
    return FaultWorker(worker_id, proc, port, metrics_port)


def kill(procs: Procs, w: FaultWorker, sig: int = signal.SIGKILL) -> None:
    procs.kill(w.proc, sig)


# ---- the router (in this process) ------------------------------------------------------


def router_config(
    workers: list[str], *, port: int = 0, redis_url: str | None = None, **service
) -> RouterServerConfig:
    frontend = FrontendConfig(
        ejection=EjectionConfig(max_consecutive_failures=3, cooldown_s=2.0), **service
    )
    return RouterServerConfig(
        port=port,
        workers=tuple(workers),
        core=RouterConfig(policy="cache_aware"),
        service=frontend,
        connection=FAST_CONN,
        registry=RegistryConfig(redis_url=redis_url, poll_s=0.2, absent_grace_s=3.0)
        if redis_url
        else RegistryConfig(),
        grace_s=0.5,
        seed=0,
    )


async def start_router(config: RouterServerConfig) -> RouterServer:
    server = RouterServer(config)
    await server.start()
    return server


async def wait_synced(router: RouterServer, n: int, timeout: float = 20.0) -> float:
    conns = router.pool.conns.values()
    return await wait_until(
        lambda: sum(1 for c in conns if c.healthy and c.num_messages > 0) >= n,
        f"{n} workers synced",
        timeout,
    )


async def index_matches(router: RouterServer, workers: list[FaultWorker]) -> bool:
    """The router's index holds, for each worker, exactly the blocks of its own snapshot."""
    for w in workers:
        if not router.core.has_worker(w.worker_id):
            return False
        if router.core.worker_blocks(w.worker_id) != snapshot_blocks(await w.snapshot()):
            return False
    return True


async def converge(router: RouterServer, workers: list[FaultWorker], timeout: float = 30.0):
    """Seconds until the router's index equals every worker's snapshot (asserted)."""
    return await wait_until(
        lambda: index_matches(router, workers), "router index == worker snapshots", timeout
    )


# ---- load ------------------------------------------------------------------------------


def prompt(i: int, *, shared: int = 8, length: int = 48, groups: int = 8) -> list[int]:
    """Token ids: ``groups`` shared prefixes of ``shared`` tokens, then a unique tail."""
    rng = random.Random(i)
    head = [(i % groups) * 7 % 250 + 1] * shared
    return head + [rng.randrange(1, 250) for _ in range(length - shared)]


def request(i: int, max_new_tokens: int = 16, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"f{i}",
        prompt_token_ids=pb.TokenIds(ids=prompt(i, **kw)),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


@dataclass
class Outcome:
    code: str
    first_token: bool  # a chunk arrived before the end
    elapsed_s: float
    deadline_s: float
    message: str = ""
    started: float = 0.0  # perf_counter at the call's start


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)

    def codes(self) -> Counter[str]:
        return Counter(o.code for o in self.outcomes)

    def max_overrun_s(self) -> float:
        return max((o.elapsed_s - o.deadline_s for o in self.outcomes), default=0.0)


async def one_call(
    stub: pb_grpc.RouterStub, req: pb.GenerateRequest, deadline_s: float, load: Load
) -> None:
    start = time.perf_counter()
    first = False
    code, message = "OK", ""
    try:
        async for msg in stub.Generate(req, timeout=deadline_s):
            first = first or msg.HasField("chunk")
    except grpc.aio.AioRpcError as exc:
        code, message = exc.code().name, exc.details() or ""
    elapsed = time.perf_counter() - start
    load.outcomes.append(Outcome(code, first, elapsed, deadline_s, message, start))


async def drive(
    address: str,
    *,
    num_requests: int,
    concurrency: int,
    deadline_s: float = 10.0,
    max_new_tokens: int = 16,
    first_id: int = 0,
    stop: asyncio.Event | None = None,
) -> Load:
    """``num_requests`` calls, ``concurrency`` at a time (bounded), each with a deadline;
    stops early (no new calls) when ``stop`` is set."""
    load = Load()
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.RouterStub(ch)

        async def task(i: int) -> None:
            async with sem:
                if stop is not None and stop.is_set():
                    return
                await one_call(stub, request(i, max_new_tokens), deadline_s, load)

        await asyncio.gather(*(task(first_id + i) for i in range(num_requests)))
    return load


# ---- after every fault -----------------------------------------------------------------


async def worker_clean(w: FaultWorker) -> dict[str, float]:
    m = await w.metrics()
    return (
        m
        if (
            m["kvroute_worker_running_requests"] == 0
            and m["kvroute_worker_waiting_requests"] == 0
            and m["kvroute_worker_kv_protected_tokens"] == 0
        )
        else {}
    )


async def assert_no_leak(workers: list[FaultWorker], router: RouterServer | None) -> None:
    """Every live worker idle with free + evictable + protected == total KV slots; the
    router with nothing in flight."""
    for w in workers:
        if not w.alive:
            continue
        holder: dict[str, dict[str, float]] = {}

        async def idle(w: FaultWorker = w, holder: dict = holder) -> bool:
            holder["m"] = await worker_clean(w)
            return bool(holder["m"])

        await wait_until(idle, f"{w.worker_id} idle (no request, no protected slot)", 15.0)
        m = holder["m"]
        total = m["kvroute_worker_kv_total_tokens"]
        parts = (
            m["kvroute_worker_kv_free_tokens"]
            + m["kvroute_worker_kv_evictable_tokens"]
            + m["kvroute_worker_kv_protected_tokens"]
        )
        assert parts == total, (w.worker_id, m)
    if router is not None:
        await wait_until(lambda: router.frontend.num_inflight == 0, "router calls released", 10)


@contextlib.asynccontextmanager
async def no_stray_tasks() -> AsyncIterator[None]:
    """Every asyncio task started inside (router, connections, streams) is gone after."""
    before = set(asyncio.all_tasks())
    yield
    current = asyncio.current_task()

    def stray() -> set[asyncio.Task]:
        return {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}

    with contextlib.suppress(AssertionError):
        await wait_until(lambda: not stray(), "tasks ended", 5.0)
    assert not stray(), sorted(t.get_name() for t in stray())


# ---- the RELIABILITY.md row ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One row of RELIABILITY.md's table, produced by the test named ``test``."""

    test: str
    fault: str
    client_sees: str
    index_after: str
    recovery: str  # what "recovered" means and how long it took
    recover_s: float | None
    details: dict = field(default_factory=dict)


def record(row: Row) -> None:
    """Write ``row`` to ``$KVROUTE_RELIABILITY_OUT/<test>.json`` (nothing when unset)."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(row) | {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
    }
    (folder / f"{row.test}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def codes_text(load: Load) -> str:
    return ", ".join(f"{n} {code}" for code, n in sorted(load.codes().items()))
