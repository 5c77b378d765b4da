"""One request is one trace: the router's span is the parent of the worker's span."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from router_harness import running_router, sim_worker

from router.cli.client import GenerateOptions


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The global provider can be set once per process; the tracers in router/worker modules
    # are proxies that follow it.
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another test installed a global tracer provider first")
    return exporter


async def test_router_and_worker_spans_share_the_trace(spans: InMemorySpanExporter):
    spans.clear()
    async with sim_worker("w0") as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        result = await router.client.generate(list(range(1, 30)), GenerateOptions(max_new_tokens=2))
    by_name = {s.name: s for s in spans.get_finished_spans()}
    router_span = by_name["kvroute.router.Generate"]
    worker_span = by_name["kvroute.worker.Generate"]
    assert worker_span.context.trace_id == router_span.context.trace_id
    assert worker_span.parent is not None
    assert worker_span.parent.span_id == router_span.context.span_id
    assert router_span.attributes["kvroute.worker_id"] == result.worker_id == "w0"
    assert worker_span.attributes["kvroute.prompt_tokens"] == 29
