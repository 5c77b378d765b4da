"""bench_dataplane's accounting: a request's tokens spread over its stream in the window,
TTFT only for requests started in it, and the CPU of a process with its children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.bench_dataplane import Tally, percentile
from bench.cpu_budget import cpu_seconds


def test_tokens_are_spread_over_the_stream_and_cut_at_the_window() -> None:
    tally = Tally(t0=10.0, t1=20.0)
    tally.add_request(started=9.0, first=9.5, end=10.5, tokens=100, messages=10)  # half in
    tally.add_request(started=12.0, first=12.1, end=13.1, tokens=256, messages=64)  # all in
    tally.add_request(started=19.0, first=19.5, end=21.5, tokens=40, messages=8)  # a quarter
    assert tally.tokens == pytest.approx(50 + 256 + 10)
    assert tally.messages == pytest.approx(5 + 64 + 2)
    assert tally.ttfts == pytest.approx([0.1, 0.5])  # the first started before the window


def test_a_one_message_request_counts_where_it_ended() -> None:
    tally = Tally(t0=0.0, t1=1.0)
    tally.add_request(started=0.2, first=0.5, end=0.5, tokens=3, messages=1)
    tally.add_request(started=0.9, first=1.5, end=1.5, tokens=7, messages=1)
    assert tally.tokens == 3 and tally.messages == 1


def test_percentile_of_nothing_is_nan_and_of_values_a_member() -> None:
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_cpu_seconds_include_the_children() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
            "time.sleep(0.3); p.wait(); time.sleep(30)",
        ]
    )
    try:
        time.sleep(0.05)
        before = cpu_seconds(parent.pid)
        deadline = time.monotonic() + 20
        # the child's CPU counts while it runs (then it is reaped, and counted in the parent's
        # cutime, which /proc/PID/stat's utime + stime leave out)
        seen = before
        while time.monotonic() < deadline and seen - before < 0.2:
            seen = cpu_seconds(parent.pid)
            time.sleep(0.02)
        assert seen - before >= 0.2
    finally:
        parent.kill()
        parent.wait()


def test_the_ab_line_reports_each_routers_excess_over_the_direct_path():
    from bench.bench_dataplane_ab import _line

    rows = [
        {"ttft_p50_ms": 2.0, "tokens_per_front_cpu_s": None},
        {"ttft_p50_ms": 4.5, "tokens_per_front_cpu_s": 900, "concurrency": 1},
        {"ttft_p50_ms": 3.0, "tokens_per_front_cpu_s": 1200},
    ]
    rows[1].update(round=2, door="gRPC")
    line = _line(rows)
    assert line.startswith("c=1 r2 gRPC: tokens/CPU-s base 900 this 1200")
    assert line.endswith("direct 2.0 base +2.50 this +1.00 ms")


def test_the_ab_bench_names_a_checkouts_commit(tmp_path):
    import subprocess

    from bench.bench_dataplane_ab import _commit

    git = ["git", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True)
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", *ident, "-C", str(tmp_path), "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert _commit(tmp_path) == head.stdout.strip()
    (tmp_path / "f").write_text("b")
    assert _commit(tmp_path) == head.stdout.strip() + "+"


def test_the_direct_floor_splits_the_streams_over_the_workers() -> None:
    """run_http given several URLs sends each closed-loop stream to one of them, evenly."""
    import asyncio

    from aiohttp import web

    from bench.bench_dataplane import Load, run_http

    async def scenario() -> list[int]:
        counts = [0, 0]
        runners = []
        for i in range(2):

            async def completions(request: web.Request, i: int = i) -> web.StreamResponse:
                counts[i] += 1
                resp = web.StreamResponse()
                await resp.prepare(request)
                await resp.write(b'data: {"choices":[{"finish_reason":null}]}\n\n')
                usage = b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
                await resp.write_eof(usage)
                return resp

            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
        urls = [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
        tally = Tally(t0=time.perf_counter(), t1=time.perf_counter() + 0.3)
        try:
            await run_http(urls, Load(concurrency=4, max_tokens=1), tally, seed=1)
        finally:
            for runner in runners:
                await runner.cleanup()
        assert tally.errors == 0
        return counts

    counts = asyncio.run(scenario())
    assert min(counts) > 0 and max(counts) <= 2 * min(counts) + 2


def test_the_processes_ratio_sums_the_rounds() -> None:
    from bench.bench_dataplane import processes_ratio

    one, two = "kvroute router, HTTP/SSE", "kvroute router --processes 2, HTTP/SSE"
    rows = [
        {"front": "direct: the workers' HTTP APIs", "output_tokens_per_s": 50},
        {"front": one, "output_tokens_per_s": 10},
        {"front": two, "output_tokens_per_s": 15},
        {"front": one, "output_tokens_per_s": 30},
        {"front": two, "output_tokens_per_s": 65},
    ]
    assert processes_ratio(rows) == 2.0
    assert processes_ratio(rows[:2]) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_front_starts_the_front_on_its_core_and_keeps_the_clients() -> None:
    import argparse

    from bench.bench_dataplane import start_front

    ours = os.sched_getaffinity(0)
    core = max(ours)

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    proc = start_front(argparse.Namespace(pin_front=core), start)
    try:
        assert os.sched_getaffinity(proc.pid) == {core}
        assert os.sched_getaffinity(0) == ours
    finally:
        proc.kill()
        proc.wait()


def _cgroup_writable() -> bool:
    import os

    from bench.cpu_budget import CGROUP_V1_CPU, CGROUP_V2

    if os.geteuid() != 0:
        return False
    if CGROUP_V1_CPU.joinpath("cpu.cfs_quota_us").exists():
        return os.access(CGROUP_V1_CPU, os.W_OK)
    controllers = CGROUP_V2 / "cgroup.controllers"
    return controllers.exists() and "cpu" in controllers.read_text().split()


@pytest.mark.skipif(
    not _cgroup_writable(), reason="needs root and a writable cgroup cpu controller"
)
def test_the_cpu_budget_caps_each_router_process_and_goes_away() -> None:
    from bench.cpu_budget import CpuBudget, own_cpu_seconds

    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with CpuBudget(0.2, 2) as budget:
            placed = budget.place(proc.pid)
            assert placed == [[proc.pid]]
            assert str(proc.pid) in (budget.groups[0] / "cgroup.procs").read_text().split()
            cpu0, t0 = own_cpu_seconds(proc.pid), time.monotonic()
            time.sleep(1.0)
            used = (own_cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
            assert used < 0.4  # capped near 0.2 cores (ticks of 10 ms)
            ((periods, throttled),) = budget.throttled(1)
            assert periods > 0 and throttled > 0
            proc.kill()
            proc.wait()
        assert not budget.parent.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
