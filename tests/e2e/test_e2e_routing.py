"""End to end with real processes: sim workers and a router, each `python -m kvroute_cli`.

A shared prefix lands on the worker that holds it; when that worker is killed requests
still succeed elsewhere and its index entries are gone; a restarted worker (new epoch) is
resynced. Everything is bounded by timeouts and every child is killed in ``finally``.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from e2e_procs import ROOT, procs, until

from router.cli.client import ExplainResult, GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PREFIX = list(range(20, 60))  # 40 tokens = 10 blocks of 4
OPTS = GenerateOptions(max_new_tokens=2)


def scores(expl: ExplainResult) -> dict[str, tuple[bool, int]]:
    return {w.worker_id: (w.healthy, w.matched_tokens) for w in expl.workers}


async def test_prefix_affinity_worker_death_and_restart():
    with procs() as p:
        w0, w1 = p.worker("w0"), p.worker("w1")
        by_id = {"w0": w0, "w1": w1}
        router = p.router([w0.address, w1.address])
        async with RouterClient(router.address, timeout_s=20) as client:

            async def both_healthy():
                expl = await client.explain([1, 2, 3, 4])
                return len(expl.workers) == 2 and all(w.healthy for w in expl.workers)

            await until(both_healthy, "router never saw both workers healthy")
            first = await client.generate([*PREFIX, 1], OPTS)
            holder = first.worker_id
            other = "w1" if holder == "w0" else "w0"

            async def holder_indexed():
                s = scores(await client.explain([*PREFIX, 9]))
                return s[holder][1] >= len(PREFIX) and s[other][1] == 0

            await until(holder_indexed, "the holder's KV events never reached the router")
            for i in range(3):
                r = await client.generate([*PREFIX, 100 + i], OPTS)
                assert r.worker_id == holder and r.cached_prompt_tokens >= len(PREFIX)

            # kill the holder: requests still succeed on the other worker
            port = by_id[holder].address.rsplit(":", 1)[1]
            p.kill(by_id[holder])
            for i in range(3):
                r = await client.generate([*PREFIX, 200 + i], OPTS)
                assert r.worker_id == other

            async def holder_purged():
                s = scores(await client.explain([*PREFIX, 9]))
                return s[holder] == (False, 0)

            await until(holder_purged, "the dead worker's index entries were not dropped")

            # restart it on the same port (a new epoch): healthy again and resynced
            p.worker(holder, port=int(port))

            async def holder_back():
                return scores(await client.explain([*PREFIX, 9]))[holder][0]

            await until(holder_back, "the restarted worker never became healthy")
            for i in range(40):  # ties between the workers are broken at random
                fresh = [200 + i, *range(100, 140)]  # ids < 256: the sim vocab
                r = await client.generate(fresh, OPTS)
                if r.worker_id == holder:
                    break
            else:
                raise AssertionError("no request reached the restarted worker")

            async def new_epoch_events():
                return scores(await client.explain([*fresh, 5]))[holder][1] >= 40

            await until(new_epoch_events, "events of the new epoch never reached the router")


async def test_cli_generate_and_explain_against_a_router():
    with procs() as p:
        w0 = p.worker("w0")
        router = p.router([w0.address])
        async with RouterClient(router.address, timeout_s=20) as client:

            async def healthy():
                return any(w.healthy for w in (await client.explain([1])).workers)

            await until(healthy, "router never saw the worker")
        base = [sys.executable, "-m", "kvroute_cli"]
        gen = subprocess.run(
            [*base, "generate", "--router", router.address, "-v", "--max-new-tokens", "3", "hi"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gen.returncode == 0, gen.stderr
        assert "worker=w0" in gen.stderr and "cached_prompt_tokens=" in gen.stderr
        assert "completion_tokens=3" in gen.stderr
        expl = subprocess.run(
            [*base, "explain", "--router", router.address, "hello world"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert expl.returncode == 0, expl.stderr
        assert "policy=cache_aware" in expl.stdout and "chosen=w0" in expl.stdout
        # SIGTERM stops the router gracefully
        router.popen.send_signal(signal.SIGTERM)
        assert router.wait(timeout=30) == 0
