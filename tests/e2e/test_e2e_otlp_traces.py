"""Traces over real OTLP/gRPC: a router and a worker process export to a TraceService this
test serves on 127.0.0.1; one request is one trace across both, with the route decision,
the worker's queue / prefill / decode phases and GenAI attributes."""

from __future__ import annotations

import signal
import threading
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from e2e_procs import procs, until
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from router.cli.client import GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans as (service name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = (
            [x.string_value for x in v.array_value.values]
            if kind == "array_value"
            else (getattr(v, kind))
        )
    return out


async def test_one_trace_across_router_and_worker(monkeypatch) -> None:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    try:
        with procs() as p:
            worker = p.worker("w0")
            router = p.router([worker.address])
            async with RouterClient(router.address, timeout_s=30) as client:

                async def healthy():
                    return any(w.healthy for w in (await client.explain([1])).workers)

                await until(healthy, "router never saw the worker")
                prompt = "the same long prefix, " * 6
                for _ in range(2):  # the second one is served from the cache
                    result = await client.generate(prompt, GenerateOptions(max_new_tokens=3))
            for proc in (router, worker):  # a clean stop flushes the span batches
                p.kill(proc, signal.SIGTERM)
    finally:
        server.stop(grace=None)

    by_trace: dict[bytes, list[tuple[str, object]]] = defaultdict(list)
    for service, span in receiver.spans:
        by_trace[span.trace_id].append((service, span))
    generate_traces = [
        spans
        for spans in by_trace.values()
        if any(s.name == "kvroute.router.Generate" for _, s in spans)
    ]
    assert len(generate_traces) == 2, "each request is one trace"
    spans = generate_traces[-1]
    names = {(service, s.name) for service, s in spans}
    assert {
        ("kvroute-router", "kvroute.router.Generate"),
        ("kvroute-router", "kvroute.route"),
        ("kvroute-worker", "kvroute.worker.Generate"),
        ("kvroute-worker", "kvroute.worker.queue"),
        ("kvroute-worker", "kvroute.worker.prefill"),
        ("kvroute-worker", "kvroute.worker.decode"),
    } <= names
    by_name = {s.name: s for _, s in spans}
    router_span = by_name["kvroute.router.Generate"]
    worker_span = by_name["kvroute.worker.Generate"]
    assert worker_span.parent_span_id == router_span.span_id
    assert by_name["kvroute.route"].parent_span_id == router_span.span_id
    for phase in ("queue", "prefill", "decode"):
        assert by_name[f"kvroute.worker.{phase}"].parent_span_id == worker_span.span_id
    route = _attrs(by_name["kvroute.route"])
    assert route["kvroute.worker_id"] == "w0"
    assert route["kvroute.route.candidates"] == 1
    assert route["kvroute.matched_tokens"] > 0  # the first request's blocks
    assert route["kvroute.best_matched_tokens"] == route["kvroute.matched_tokens"]
    assert route["kvroute.route.top_costs"][0].startswith("w0=")
    by_source = (route["kvroute.event_matched_tokens"], route["kvroute.predicted_matched_tokens"])
    assert 0 < max(by_source) <= route["kvroute.matched_tokens"]
    prefill = _attrs(by_name["kvroute.worker.prefill"])
    assert prefill["kvroute.cached_prompt_tokens"] == result.cached_prompt_tokens > 0
    assert (
        prefill["kvroute.computed_prompt_tokens"]
        == result.prompt_tokens - result.cached_prompt_tokens
    )
    gen = _attrs(router_span)
    assert gen["gen_ai.operation.name"] == "text_completion"
    assert gen["gen_ai.usage.input_tokens"] == result.prompt_tokens
    assert gen["gen_ai.usage.output_tokens"] == 3
    assert gen["gen_ai.response.finish_reasons"] == ["length"]
    worker_attrs = _attrs(worker_span)
    assert worker_attrs["gen_ai.request.max_tokens"] == 3
    assert _attrs(by_name["kvroute.worker.decode"])["gen_ai.usage.output_tokens"] == 3
