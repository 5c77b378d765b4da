"""``kvroute up`` end to end: the README's main job (torch), and clean shutdown (no orphans)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from e2e_procs import ROOT, procs, until

from router.cli.client import GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_up_demo_with_the_torch_tiny_model():
    pytest.importorskip("torch")
    cmd = ["up", "--workers", "2", "--port", "0", "--demo", "--exit"]
    result = subprocess.run(
        [sys.executable, "-m", "kvroute_cli", *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert len(re.findall(r"worker worker-\d listening on 127\.0\.0\.1:\d+", out)) == 2
    assert re.search(r"router listening on 127\.0\.0\.1:\d+", out)
    served = re.findall(r"served by (worker-\d): (\d+)/(\d+) prompt tokens cached", out)
    assert len(served) == 2
    # the second request shares the first one's prefix: same worker, prefix cached
    assert served[0][0] == served[1][0]
    assert int(served[1][1]) > 0
    assert out.rstrip().endswith("stopped")


def _start_sim_fleet(p, num_workers: int, *extra: str):
    """``kvroute up`` with sim workers; returns the process and its workers' pids."""
    up = p.start(
        "up",
        ["up", "--workers", str(num_workers), "--port", "0", "--executor", "sim", *extra],
        marker="router listening on",
    )
    pids = [
        int(m)
        for line in up.lines
        for m in re.findall(r"worker worker-\d listening on \S+ \(pid (\d+)\)", line)
    ]
    return up, pids


def test_up_stops_every_worker_on_sigterm():
    with procs() as p:
        up, pids = _start_sim_fleet(p, 2)
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        up.popen.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_workers_do_not_outlive_a_killed_up():
    with procs() as p:
        up, pids = _start_sim_fleet(p, 1)
        assert len(pids) == 1
        p.kill(up)  # SIGKILL: no cleanup code runs in `kvroute up`
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # another process: nothing to await
        assert not any(_alive(pid) for pid in pids)


async def test_up_on_sigterm_lets_in_flight_requests_finish():
    """SIGTERM drains in order: a request already streaming completes (the router keeps
    relaying for up to --stop-timeout-s before the workers are stopped)."""
    with procs() as p:
        # paced at half real time: the request below takes seconds, more than the old 1 s
        up, _ = _start_sim_fleet(p, 1, "--worker-arg=--sim-speedup=0.5")
        address = re.search(r"router listening on (\S+)", "\n".join(up.lines)).group(1)
        async with RouterClient(address, timeout_s=60) as client:

            async def ready() -> bool:
                return any(w.healthy for w in (await client.explain([1, 2])).workers)

            await until(ready, "the router never saw its worker healthy")
            opts = GenerateOptions(max_new_tokens=300, ignore_eos=True)
            stream = client.stream([1, 2, 3, 4, 5, 6, 7, 8], opts)
            first = await anext(stream)
            assert first.HasField("chunk")
            up.popen.send_signal(signal.SIGTERM)
            tokens = list(first.chunk.token_ids)
            finished = None
            async for msg in stream:
                if msg.HasField("finished"):
                    finished = msg.finished
                else:
                    tokens.extend(msg.chunk.token_ids)
            assert finished is not None and finished.usage.completion_tokens == 300
            assert len(tokens) == 300
        assert up.wait(timeout=60) == 0
