"""kvroute up --metrics-port: every process of a live fleet serves /metrics, and the values
move when a request goes through."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from e2e_procs import procs, until

from router.cli.client import GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_up_serves_metrics_on_every_process() -> None:
    with procs() as p:
        up = p.start(
            "up",
            ["up", "--workers", "2", "--executor", "sim", "--port", "0", "--metrics-port", "0"],
            marker="router listening on",
        )

        async def urls():
            found = [m for line in up.lines for m in re.findall(r"metrics on (http://\S+)", line)]
            return found if len(found) == 3 else None

        found = await until(urls, "kvroute up did not print three metrics endpoints")
        router_url = next(
            line.split()[-1] for line in up.lines if line.startswith("router metrics on")
        )
        worker_urls = [u for u in found if u != router_url]
        assert len(worker_urls) == 2
        async with RouterClient(up.address, timeout_s=30) as client:

            async def healthy():
                return sum(w.healthy for w in (await client.explain([1])).workers) == 2

            await until(healthy, "the router never saw both workers")
            result = await client.generate("hello metrics " * 8, GenerateOptions(max_new_tokens=4))
        router_text = await asyncio.to_thread(_get, router_url)
        assert _value(router_text, "kvroute_router_requests_total", outcome="OK") == 1
        assert _value(router_text, "kvroute_router_route_decision_duration_seconds_count") == 1
        assert _value(router_text, "kvroute_router_workers", state="healthy") == 2
        served = [await asyncio.to_thread(_get, u) for u in worker_urls]
        generated = [_value(t, "kvroute_worker_generation_tokens_total") for t in served]
        assert sorted(generated) == [0, 4]
        (text,) = [t for t in served if f'worker="{result.worker_id}"' in t]
        assert _value(text, "kvroute_worker_time_to_first_token_seconds_count") == 1
