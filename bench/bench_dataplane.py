"""The data plane's cost per token: the same closed-loop streamed load through each front door.

::

    bench/peers/install_peers.sh sglang vllm     # once, for the peer routers' rows (optional)
    python -m bench.bench_dataplane --seconds 12 --json out/dataplane.json

Two ``kvroute worker --executor sim --sim-speedup 1000`` processes (the step cost is near
zero, so the front is the limit), then, one front after another on the same workers: the
load split evenly over the workers' own HTTP APIs (the floor the fronts are compared with);
``kvroute router`` over HTTP / SSE; the same router over gRPC (``Router.Generate``);
``kvroute router --processes 2`` over HTTP; sglang-router 0.3.2 and vllm-router 0.1.17,
each round robin, when ``.peers/sglang`` / ``.peers/vllm`` exist (``--no-peer`` leaves them
out). The load: ``--concurrency`` (64) closed-loop streams, each a fresh ``--prompt-tokens``
(128) character text prompt (one token per byte: the sim workers' byte tokenizer) asking for
``--max-tokens`` (256) tokens with ``ignore_eos``.

Per front: output tokens/s received by the client over the measured window (after a warm-up),
the front's CPU seconds in that window (utime + stime of the front's process and its
children, from /proc), tokens per front CPU-second, TTFT p50 and p99 of the requests started
in the window, and tokens per streamed message (how much the stream coalesced). The client
runs in this process, on the same cores: absolute rates are the box's, the per-CPU-second
figure is the front's own.

``--split-window`` adds, per door of the one-process router, a window with half the streams
through the router and half direct to the workers at once: the router's TTFT against the
direct path's under the same load on the box (``ttft_p50_over_direct_ms``). The direct half
uses the door's own client stack: the workers' HTTP APIs beside the HTTP door, their gRPC
``Worker.Generate`` beside the gRPC door (decision 0049).

``--rounds K`` runs the floor and every front K times in turn on the same workers (each row
says its round): adjacent windows for a front and its floor.

Bench-only placements (decision 0047), for figures the shared cores would otherwise hide:

``--router-cpu-budget B``
    Each router process gets a fixed CPU budget of ``B`` cores, and that budget is the limit:
    a cgroup of its own per router process (cgroup v1 ``cpu``: ``cpu.cfs_quota_us`` = B x
    ``cpu.cfs_period_us``, the kernel's default 100 ms period; cgroup v2: ``cpu.max``). Those
    groups and a ``load`` group without a cap (this process, the client, and the workers it
    starts) share a parent with ``SHARES_FACTOR`` x the default weight, so the box's other
    jobs take neither the budget nor the load's cores away. So ``--processes 1`` runs on B
    cores and ``--processes 2`` on 2 x B, each process on B of its own; the ``--processes``
    supervisor (it only forwards its children's output) shares the first process's group. No
    core is pinned: the kernel places each process on either core. Only the HTTP front is
    measured (one gRPC channel is one connection: one process would serve it all) and no
    peer. Each row adds the budget, each router process's CPU in the window, the share of
    its group's periods that were throttled (the budget was the limit when most were), and
    the client's and the workers' CPU. Needs root and a writable ``cpu`` controller.

``--pin-front CPU``
    The front on core ``CPU`` alone, this process (the client) and the workers on every
    other core (``sched_setaffinity``, inherited by their threads), for every row, the floor
    included: the router as on a host of its own, for its TTFT over the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.cpu_budget import SHARES_FACTOR, CpuBudget, cpu_seconds, own_cpu_seconds
from bench.procs import ROOT, report, start_kvroute
from fleetsim.replay.front import (
    SGLANG_ROUTER,
    VLLM_ROUTER,
    FrontSpec,
    peer_command,
    peer_python,
)
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Load:
    """What the closed-loop clients send."""

    concurrency: int = 64
    prompt_tokens: int = 128
    max_tokens: int = 256
    warmup_s: float = 2.0
    seconds: float = 12.0


@dataclass(slots=True)
class Tally:
    """What the clients saw inside the measured window [t0, t1)."""

    t0: float = 0.0
    t1: float = 0.0
    tokens: float = 0.0
    messages: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0

    def in_window(self, t: float) -> bool:
        return self.t0 <= t < self.t1

    def add_request(self, started: float, first: float, end: float, tokens: int, messages: int):
        """One finished request: its TTFT when it started in the window, and its tokens
        spread evenly over [first, end] (the part inside the window counts)."""
        if self.in_window(started):
            self.ttfts.append(first - started)
        span = max(end - first, 1e-9)
        inside = max(0.0, min(end, self.t1) - max(first, self.t0))
        share = min(1.0, inside / span) if end > first else float(self.in_window(end))
        self.tokens += tokens * share
        self.messages += messages * share


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_letters, k=n))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---- clients -------------------------------------------------------------------------------


async def _http_stream(session: aiohttp.ClientSession, url: str, body: dict, tally: Tally) -> None:
    started = time.perf_counter()
    first = 0.0
    messages = tokens = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            tally.errors += 1
            await resp.read()
            return
        async for line in resp.content:  # one SSE line at a time
            if not line.startswith(b"data: {"):
                continue
            if b'"choices":[]' in line:  # the usage chunk (stream_options.include_usage)
                usage = json.loads(line[6:])["usage"]
                tokens = usage["completion_tokens"]
            elif b'"finish_reason":null' in line:
                messages += 1
                first = first or time.perf_counter()
    if not tokens or not first:
        tally.errors += 1
        return
    tally.add_request(started, first, time.perf_counter(), tokens, messages)


async def run_http(url: str | list[str], load: Load, tally: Tally, seed: int) -> None:
    """Closed-loop streamed completions against an OpenAI HTTP front at ``url`` (a list:
    the streams split evenly over them) until the end of ``tally``'s window."""
    urls = [url] if isinstance(url, str) else url
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def loop(base: str) -> None:
            while time.perf_counter() < tally.t1:
                body = {
                    "model": "kvroute-tiny",
                    "prompt": _prompt(rng, load.prompt_tokens),
                    "max_tokens": load.max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    await _http_stream(session, base + "/v1/completions", body, tally)
                except aiohttp.ClientError:
                    tally.errors += 1

        await asyncio.gather(*(loop(urls[i % len(urls)]) for i in range(load.concurrency)))


async def run_grpc(address: str | list[str], load: Load, tally: Tally, seed: int) -> None:
    """Closed-loop streamed Generate calls until the end of ``tally``'s window: the router's
    (``Router.Generate``) at ``address``, or, given a list, the workers' own
    (``Worker.Generate``), the streams split evenly over them."""
    rng = random.Random(seed)
    addresses = [address] if isinstance(address, str) else address
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        if isinstance(address, str):
            stubs: list[Any] = [pb_grpc.RouterStub(channels[0])]
        else:
            stubs = [pb_grpc.WorkerStub(c) for c in channels]

        async def loop(stub: Any) -> None:
            while time.perf_counter() < tally.t1:
                request = pb.GenerateRequest(
                    request_id=uuid.uuid4().hex,
                    prompt_text=_prompt(rng, load.prompt_tokens),
                    sampling=pb.SamplingParams(max_new_tokens=load.max_tokens, ignore_eos=True),
                )
                started = time.perf_counter()
                first = 0.0
                messages = tokens = 0
                try:
                    async for msg in stub.Generate(request, timeout=120):
                        if msg.HasField("chunk"):
                            messages += 1
                            tokens += len(msg.chunk.token_ids)
                            first = first or time.perf_counter()
                except grpc.aio.AioRpcError:
                    tally.errors += 1
                    continue
                tally.add_request(started, first, time.perf_counter(), tokens, messages)

        await asyncio.gather(*(loop(stubs[i % len(stubs)]) for i in range(load.concurrency)))
    finally:
        for channel in channels:
            await channel.close()


async def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """Until a one-token completion goes through ``url``."""
    deadline = time.monotonic() + timeout_s
    body = {"model": "kvroute-tiny", "prompt": "hello", "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {timeout_s} s")
            await asyncio.sleep(0.2)


# ---- fronts --------------------------------------------------------------------------------


@dataclass(slots=True)
class Placed:
    """A front's processes in their budget groups (``--router-cpu-budget``)."""

    budget: CpuBudget
    pids: list[list[int]]

    def cpu(self) -> list[float]:
        return [sum(own_cpu_seconds(p) for p in pids) for pids in self.pids]

    def throttled(self) -> list[tuple[int, int]]:
        return self.budget.throttled(len(self.pids))


async def measure(
    name: str,
    pid: int | None,
    load: Load,
    client,
    placed: Placed | None = None,
    workers: list[int] | None = None,
) -> dict[str, object]:
    """One front's row: run ``client(tally)`` (a closed loop until the window ends) and read
    the front's CPU (``pid`` and its children) at the window's edges."""
    tally = Tally()
    tally.t0 = time.perf_counter() + load.warmup_s
    tally.t1 = tally.t0 + load.seconds
    task = asyncio.ensure_future(client(tally))
    await asyncio.sleep(max(0.0, tally.t0 - time.perf_counter()))
    cpu0 = cpu_seconds(pid) if pid else 0.0
    others0 = (time.process_time(), sum(cpu_seconds(w) for w in workers or []))
    groups0 = placed.cpu() if placed else []
    throttled0 = placed.throttled() if placed else []
    await asyncio.sleep(max(0.0, tally.t1 - time.perf_counter()))
    cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
    others = (time.process_time() - others0[0], sum(map(cpu_seconds, workers or [])) - others0[1])
    groups = [b - a for a, b in zip(groups0, placed.cpu(), strict=True)] if placed else []
    throttled = placed.throttled() if placed else []
    await task
    window = tally.t1 - tally.t0
    row: dict[str, object] = {
        "front": name,
        "output_tokens_per_s": round(tally.tokens / window),
        "front_cpu_s": round(cpu, 2) if pid else None,
        "window_s": round(window, 2),
        "tokens_per_front_cpu_s": round(tally.tokens / cpu) if pid and cpu else None,
        "ttft_p50_ms": round(percentile(tally.ttfts, 0.5) * 1e3, 2),
        "ttft_p99_ms": round(percentile(tally.ttfts, 0.99) * 1e3, 2),
        "tokens_per_message": round(tally.tokens / max(1, tally.messages), 2),
        "requests_started": len(tally.ttfts),
        "errors": tally.errors,
        "client_cpu_s": round(others[0], 2),
    }
    if workers:
        row["workers_cpu_s"] = round(others[1], 2)
    if placed:
        row["budget_cores_per_process"] = placed.budget.cores
        row["cpu_s_per_process"] = [round(c, 2) for c in groups]
        row["budget_used"] = [round(c / (placed.budget.cores * window), 3) for c in groups]
        row["periods_throttled"] = [
            round((t1 - t0) / max(1, p1 - p0), 3)
            for (p0, t0), (p1, t1) in zip(throttled0, throttled, strict=True)
        ]
    print(row, file=sys.stderr, flush=True)
    return row


async def measure_split(name: str, pid: int, load: Load, client, direct) -> dict[str, object]:
    """``load`` through the front (``client``) and ``load`` direct to the workers in one
    window: the front's row with the direct half's TTFT beside it (``--split-window``)."""
    t0 = time.perf_counter() + load.warmup_s
    front, floor = Tally(t0=t0, t1=t0 + load.seconds), Tally(t0=t0, t1=t0 + load.seconds)
    tasks = [asyncio.ensure_future(client(front)), asyncio.ensure_future(direct(floor))]
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    cpu0 = cpu_seconds(pid)
    await asyncio.sleep(max(0.0, front.t1 - time.perf_counter()))
    cpu = cpu_seconds(pid) - cpu0
    await asyncio.gather(*tasks)
    p50, direct_p50 = percentile(front.ttfts, 0.5) * 1e3, percentile(floor.ttfts, 0.5) * 1e3
    row: dict[str, object] = {
        "front": name,
        "streams_each": load.concurrency,
        "output_tokens_per_s": round(front.tokens / load.seconds),
        "direct_output_tokens_per_s": round(floor.tokens / load.seconds),
        "front_cpu_s": round(cpu, 2),
        "tokens_per_front_cpu_s": round(front.tokens / cpu) if cpu else None,
        "ttft_p50_ms": round(p50, 2),
        "direct_ttft_p50_ms": round(direct_p50, 2),
        "ttft_p50_over_direct_ms": round(p50 - direct_p50, 2),
        "ttft_p99_ms": round(percentile(front.ttfts, 0.99) * 1e3, 2),
        "direct_ttft_p99_ms": round(percentile(floor.ttfts, 0.99) * 1e3, 2),
        "tokens_per_message": round(front.tokens / max(1, front.messages), 2),
        "requests_started": len(front.ttfts),
        "direct_requests_started": len(floor.ttfts),
        "errors": front.errors + floor.errors,
    }
    print(row, file=sys.stderr, flush=True)
    return row


# ---- the run -------------------------------------------------------------------------------


@dataclass(slots=True)
class Fleet:
    """The two sim workers every front shares."""

    grpc_addresses: list[str]
    http_urls: list[str]
    procs: list[subprocess.Popen]


def start_workers(num: int, speedup: float, logs: Path) -> Fleet:
    fleet = Fleet([], [], [])
    for i in range(num):
        http_port = free_port()
        proc, address = start_kvroute(
            [
                "worker",
                "--executor",
                "sim",
                "--sim-speedup",
                str(speedup),
                "--worker-id",
                f"worker-{i}",
                "--http-port",
                str(http_port),
            ],
            logs / f"worker-{i}.log",
        )
        fleet.procs.append(proc)
        fleet.grpc_addresses.append(address)
        fleet.http_urls.append(f"http://127.0.0.1:{http_port}")
    return fleet


def start_router(fleet: Fleet, options: argparse.Namespace, processes: int, logs: Path):
    """``kvroute router`` in front of the fleet: the process, its gRPC address, HTTP URL."""
    http_port = free_port()
    args = ["router", "--port", "0", "--http-port", str(http_port), "--policy", options.policy]
    if processes > 1:
        args += ["--processes", str(processes)]
    for address in fleet.grpc_addresses:
        args += ["--worker", address]
    proc, address = start_kvroute(args, logs / f"router-{processes}.log")
    return proc, address, f"http://127.0.0.1:{http_port}"


# The peer routers measured, each round robin (no routing work: the relay's cost alone),
# with the label of its row; each only when its virtualenv exists (install_peers.sh).
PEERS = (
    (SGLANG_ROUTER, "sglang-router 0.3.2 round robin, HTTP/SSE"),
    (VLLM_ROUTER, "vllm-router 0.1.17 round robin, HTTP/SSE"),
)


def start_peer(kind: str, fleet: Fleet, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = peer_command(
        FrontSpec(kind, "round_robin"),
        port=port,
        metrics_port=free_port(),
        worker_urls=fleet.http_urls,
    )
    with open(logs / f"{kind}.log", "w") as err:
        proc = subprocess.Popen(
            argv, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT
        )
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run_fronts(
    args: argparse.Namespace, fleet: Fleet, logs: Path, budget: CpuBudget | None
) -> list[dict]:
    for url in fleet.http_urls:
        await wait_ready(url)
    rows = []
    for rnd in range(1, args.rounds + 1):
        for row in await one_round(args, fleet, logs, budget):
            rows.append({**row, "round": rnd} if args.rounds > 1 else row)
    return rows


async def one_round(
    args: argparse.Namespace, fleet: Fleet, logs: Path, budget: CpuBudget | None
) -> list[dict]:
    """The floor, then each front in turn."""
    load = Load(args.concurrency, args.prompt_tokens, args.max_tokens, args.warmup_s, args.seconds)
    rows = []
    # the floor: the same streams split evenly over the workers' own HTTP APIs
    label = "direct: the workers' HTTP APIs"
    pids = [p.pid for p in fleet.procs]
    rows.append(await measure(label, None, load, _http(fleet.http_urls, load), workers=pids))
    for processes in args.processes:
        proc, address, url = start_front(args, partial(start_router, fleet, args, processes, logs))
        try:
            placed = Placed(budget, budget.place(proc.pid)) if budget else None
            await wait_ready(url)
            label = f"kvroute router{f' --processes {processes}' if processes > 1 else ''}"
            client = _http(url, load)
            rows.append(await measure(f"{label}, HTTP/SSE", proc.pid, load, client, placed, pids))
            if processes == 1 and not budget:
                client = _grpc(address, load)
                rows.append(await measure(f"{label}, gRPC", proc.pid, load, client, None, pids))
            if processes == 1 and not budget and args.split_window:
                half = dataclasses.replace(load, concurrency=max(1, load.concurrency // 2))
                for door, client, direct in (
                    ("HTTP/SSE", _http(url, half), _http(fleet.http_urls, half)),
                    ("gRPC", _grpc(address, half), _grpc(fleet.grpc_addresses, half)),
                ):
                    name = f"{label}, {door}, half the streams beside half direct"
                    rows.append(await measure_split(name, proc.pid, half, client, direct))
        finally:
            stop(proc)
    for kind, label in PEERS:
        if not args.peer or budget or not peer_python(kind).exists():
            continue
        proc, url = start_front(args, partial(start_peer, kind, fleet, logs))
        try:
            await wait_ready(url)
            rows.append(await measure(label, proc.pid, load, _http(url, load), workers=pids))
        finally:
            stop(proc)
    return rows


def processes_ratio(rows: list[dict]) -> float | None:
    """``--processes 2``'s HTTP tokens/s over one process's (summed over the rounds), when
    both were measured."""
    by: dict[str, int] = {}
    for r in rows:
        by[r["front"]] = by.get(r["front"], 0) + r["output_tokens_per_s"]
    one = by.get("kvroute router, HTTP/SSE")
    two = by.get("kvroute router --processes 2, HTTP/SSE")
    return round(two / one, 3) if one and two else None


def start_front(args: argparse.Namespace, start):
    """``start()`` with ``--pin-front``'s core as this thread's mask, so the front (and the
    threads it starts) inherits it; the client's mask is restored after."""
    if args.pin_front is None:
        return start()
    ours = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.pin_front})
    try:
        return start()
    finally:
        os.sched_setaffinity(0, ours)


def _http(url: str | list[str], load: Load):
    return lambda tally: run_http(url, load, tally, seed=1)


def _grpc(address: str | list[str], load: Load):
    return lambda tally: run_grpc(address, load, tally, seed=1)


def add_load_args(parser: argparse.ArgumentParser, seconds: float, window: str) -> None:
    """The closed-loop load's options (``Load``) and the sim workers' speed-up."""
    parser.add_argument("--seconds", type=float, default=seconds, help=window)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sim-speedup", type=float, default=1000.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(parser, 12.0, "measured window per front")
    parser.add_argument("--policy", default="cache_aware", help="the kvroute router's policy")
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[1],
        help="kvroute router --processes values to measure, one router each (default: 1)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the floor and every front this many times in turn, on the same workers",
    )
    parser.add_argument(
        "--split-window",
        action="store_true",
        help="bench only: also each kvroute door with half the streams through it and half "
        "direct to the workers in one window (TTFT against the floor in the same window)",
    )
    parser.add_argument(
        "--no-peer", dest="peer", action="store_false", help="skip the peer routers"
    )
    parser.add_argument(
        "--router-cpu-budget",
        type=float,
        metavar="CORES",
        help="bench only: each router process capped at CORES cores in a cgroup of its own, "
        "HTTP rows only, no peer (see the module's docstring)",
    )
    parser.add_argument(
        "--pin-front",
        type=int,
        metavar="CPU",
        help="bench only: the front alone on core CPU, the client and workers on the others",
    )
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    placement: dict[str, object] = {"cores": sorted(os.sched_getaffinity(0))}
    if args.pin_front is not None:
        others = os.sched_getaffinity(0) - {args.pin_front}
        if args.pin_front not in os.sched_getaffinity(0) or not others:
            parser.error(f"--pin-front {args.pin_front}: needs that core and another")
        os.sched_setaffinity(0, others)  # the client, and the workers it starts
        placement.update(front_cores=[args.pin_front], client_and_worker_cores=sorted(others))
    if args.router_cpu_budget is not None:
        placement.update(
            router_cpu_budget_per_process=args.router_cpu_budget,
            budget="a cgroup per router process, quota = budget x a 100 ms period; client and "
            "workers in an uncapped group beside them; their parent "
            f"{SHARES_FACTOR}x the default weight; no core pinned unless front_cores says so",
        )
    with (
        tempfile.TemporaryDirectory(prefix="bench_dataplane_") as tmp,
        contextlib.ExitStack() as st,
    ):
        logs = Path(tmp)
        budget = None
        if args.router_cpu_budget is not None:
            budget = st.enter_context(CpuBudget(args.router_cpu_budget, max(args.processes)))
            budget.add_load([os.getpid()])  # the client; the workers inherit it
        fleet = start_workers(2, args.sim_speedup, logs)
        try:
            rows = asyncio.run(run_fronts(args, fleet, logs, budget))
        finally:
            for proc in fleet.procs:
                stop(proc)
    report(
        {
            "bench": "dataplane",
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "sim_speedup": args.sim_speedup,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "cpu_count": os.cpu_count(),
            "placement": placement,
            "rows": rows,
            "processes_2_over_1_tokens_per_s": processes_ratio(rows),
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
