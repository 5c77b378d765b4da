"""deploy/grafana/kvroute.json asks only for metrics a live router and worker export: every
PromQL query's kvroute_* names are checked against real /metrics scrapes taken after
requests went through a real router and sim workers on 127.0.0.1."""

from __future__ import annotations

import json
import re
from pathlib import Path

from metrics_scrape import scrape
from router_harness import router_config, running_router, sim_worker

from router.cli.client import GenerateOptions
from router.service.metrics import RouterMetricsEndpoint

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "kvroute.json"
NAME = re.compile(r"\b(kvroute_[a-z0-9_]+)\b")
# suffixes of the samples a family of each type produces in the text format
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names(text: str) -> set[str]:
    """Every sample name the exposition text can carry: from its TYPE lines, so a labelled
    family with no child yet (no retry so far) still counts as exported."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + s for s in SUFFIXES.get(kind, ("",)))
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_panel_queries_kvroute_metrics() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    for expr in queries:
        assert NAME.search(expr), f"no kvroute metric in {expr!r}"


async def test_every_dashboard_metric_is_exported_by_a_live_fleet() -> None:
    from worker.service.metrics import WorkerMetricsEndpoint

    async with (
        sim_worker("w0") as w0,
        sim_worker("w1") as w1,
        running_router([], router_config([w0.address, w1.address])) as router,
    ):
        endpoints = [RouterMetricsEndpoint(router.server, "127.0.0.1", 0)]
        endpoints += [WorkerMetricsEndpoint(w.server, "127.0.0.1", 0) for w in (w0, w1)]
        for e in endpoints:
            e.start()
        try:
            await router.wait_synced(2)
            for prompt in ("a shared system prompt " * 8 + "q1", "another prompt " * 8):
                await router.client.generate(prompt, GenerateOptions(max_new_tokens=4))
            scrapes = [await scrape(e.url) for e in endpoints]
        finally:
            for e in endpoints:
                e.stop()
    exported = set().union(*(exported_names(s.text) for s in scrapes))
    wanted = {name for expr in dashboard_queries() for name in NAME.findall(expr)}
    missing = sorted(wanted - exported)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
    # and the scrape is not vacuous: the request counters moved
    assert scrapes[0].total("kvroute_router_requests_total") == 2
