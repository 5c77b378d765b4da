"""kvroute status --once against a live router (with /metrics) and two sim workers."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from kvroute_proto import kvroute_pb2 as pb
from router.cli import status
from router.cli.client import GenerateOptions
from router.service.metrics import RouterMetricsEndpoint
from tests.router.service.router_harness import router_config, running_router, sim_worker

PROMPT = "a long shared system prompt for every request " * 4


async def test_once_shows_every_worker_and_the_cache_figures(capsys) -> None:
    async with (
        sim_worker("w0") as w0,
        sim_worker("w1") as w1,
        running_router([], router_config([w0.address, w1.address])) as router,
    ):
        endpoint = RouterMetricsEndpoint(router.server, "127.0.0.1", 0)
        endpoint.start()
        try:
            await router.wait_synced(2)
            for _ in range(2):
                await router.client.generate(PROMPT, GenerateOptions(max_new_tokens=2))
            argv = ["--router", router.address, "--metrics", f"127.0.0.1:{endpoint.port}"]
            code = await asyncio.to_thread(status.main, [*argv, "--once"])
        finally:
            endpoint.stop()
    out = capsys.readouterr().out
    assert code == 0
    assert f"kvroute fleet behind {router.address} (policy cache_aware)" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ w")}
    assert set(lines) == {"w0", "w1"}
    assert all("healthy" in line for line in lines.values())
    assert "fleet hit rate: realised" in out
    assert "requests ok 2, failed 0" in out
    assert "cache left on the table (forgone for load):" in out


async def test_without_metrics_the_explain_columns_still_show(capsys) -> None:
    async with sim_worker("w0") as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        code = await asyncio.to_thread(status.main, ["--router", router.address, "--once"])
    out = capsys.readouterr().out
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("│ w0")]
    assert "healthy" in line
    assert "fleet hit rate" not in out


async def test_an_unreachable_metrics_endpoint_is_reported_not_fatal(capsys) -> None:
    async with sim_worker("w0") as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        argv = ["--router", router.address, "--metrics", "127.0.0.1:1", "--once"]
        code = await asyncio.to_thread(status.main, argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "metrics: could not scrape 127.0.0.1:1" in out


def test_an_unreachable_router_exits_1(capsys) -> None:
    code = status.main(["--router", "127.0.0.1:1", "--once", "--timeout-s", "0.5"])
    assert code == 1
    assert "kvroute status: router 127.0.0.1:1: " in capsys.readouterr().err


def test_collect_joins_explain_and_metrics() -> None:
    explain = pb.ExplainResponse(policy="cache_aware")
    w = explain.workers.add(worker_id="w0", address="a:1", healthy=True)
    w.load.num_running, w.load.num_waiting = 3, 1
    w.slot_queue = 2  # past a cap of 2: two ahead of a new request
    w.load.num_total_kv_tokens, w.load.num_free_kv_tokens = 1000, 500
    w.load.num_evictable_kv_tokens = 250
    explain.workers.add(worker_id="w1", address="b:1", healthy=False)
    samples = {
        "kvroute_router_prompt_tokens_total": [({"worker": "w0"}, 400.0)],
        "kvroute_router_cached_prompt_tokens_total": [({"worker": "w0"}, 100.0)],
        "kvroute_router_predicted_cached_tokens_total": [({"worker": "w0"}, 120.0)],
        "kvroute_router_worker_index_blocks": [({"worker": "w0"}, 7.0), ({"worker": "w1"}, 0.0)],
        "kvroute_router_event_lag_seconds": [({"worker": "w0"}, 0.5)],
        "kvroute_router_forgone_cached_tokens_total": [({}, 30.0)],
        "kvroute_router_decision_best_matched_tokens_total": [({}, 150.0)],
        "kvroute_router_requests_total": [
            ({"worker": "w0", "outcome": "OK"}, 2.0),
            ({"worker": "none", "outcome": "UNAVAILABLE"}, 1.0),
        ],
    }
    s = status.collect(explain, samples, "r:1")
    w0, w1 = s.workers
    assert (w0.running, w0.waiting, w0.kv_usage, w0.slot_queue) == (3, 1, 0.25, 2)
    assert w0.hit_rate == 0.25
    assert (w0.index_blocks, w0.event_lag_s) == (7.0, 0.5)
    assert not w1.healthy and w1.running is None and w1.hit_rate is None
    assert (s.forgone_tokens, s.best_tokens) == (30.0, 150.0)
    assert (s.requests_ok, s.requests_failed) == (2.0, 1.0)


@pytest.mark.parametrize("bad", [["--interval-s", "0"], ["--timeout-s", "-1"]])
def test_bad_intervals_are_refused(bad, capsys) -> None:
    assert status.main(["--once", *bad]) == 2
    assert "must be > 0" in capsys.readouterr().err


async def test_an_unreachable_worker_address_is_shown_logged_and_counted(capsys, caplog) -> None:
    """`--worker 127.0.0.1:1`: nothing answers there. The router logs it at WARNING once,
    /metrics counts it as unreachable, and status says so below an empty table."""
    async with running_router(["127.0.0.1:1"]) as router:
        endpoint = RouterMetricsEndpoint(router.server, "127.0.0.1", 0)
        endpoint.start()
        try:
            conn = router.server.pool.conns["127.0.0.1:1"]
            await router.wait_for(lambda: conn.num_failures >= 1)
            assert conn.state == "unreachable"
            argv = ["--router", router.address, "--metrics", f"127.0.0.1:{endpoint.port}"]
            code = await asyncio.to_thread(status.main, [*argv, "--once"])
            url = f"http://127.0.0.1:{endpoint.port}/metrics"
            samples = await asyncio.to_thread(status.scrape_metrics, url)
        finally:
            endpoint.stop()
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "not in the table: 1 worker address(es) unreachable, 0 refused" in out
    states = {labels["state"]: v for labels, v in samples["kvroute_router_workers"]}
    assert states == {"healthy": 0, "unhealthy": 0, "unreachable": 1, "refused": 0}
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "127.0.0.1:1 unreachable" in r.getMessage()
    ]
    assert len(warned) == 1


def test_a_router_serving_several_models_shows_a_model_column() -> None:
    explain = pb.ExplainResponse(policy="cache_aware", models=["alpha", "beta"])
    explain.workers.add(worker_id="a0", address="a:1", healthy=True, model="alpha")
    explain.workers.add(worker_id="b0", address="b:1", healthy=True, model="beta")
    s = status.collect(explain, None, "r:1")
    assert s.models == ["alpha", "beta"]
    assert [(w.model, w.worker_id) for w in s.workers] == [("alpha", "a0"), ("beta", "b0")]
    console = Console(width=200, record=True)
    console.print(status.render(s))
    text = console.export_text()
    assert "models alpha, beta" in text
    assert any(line.split("│")[1].strip() == "alpha" for line in text.splitlines() if "a0" in line)
    single = status.collect(pb.ExplainResponse(policy="p", models=["m"]), None, "r:1")
    console = Console(width=200, record=True)
    console.print(status.render(single))
    assert "model" not in console.export_text()  # one model: the table as before
