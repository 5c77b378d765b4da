"""OpenTelemetry setup shared by the worker and router processes.

Both sides configure tracing the same way, from the standard OTel environment variables:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set: spans are
  batched and exported over OTLP/gRPC (Jaeger, Tempo, an OTel collector).
- ``--trace-console``: spans are printed to stderr (debugging without a collector).
- neither: no SDK provider is installed; the API's no-op tracer makes spans nearly free.

``OTEL_SERVICE_NAME`` overrides the service name. The router continues the caller's W3C
``traceparent`` and passes its own to the worker, so one request is one trace.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def configure_tracing(service_name: str, *, console: bool = False) -> Callable[[], None]:
    """Install a tracer provider if the environment (or ``console``) asks for one.

    Returns a function that flushes and shuts the provider down (a no-op when none was
    installed); call it on exit so buffered spans are not lost.
    """
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None)
    if endpoint is None and not console:
        return lambda: None

    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing: exporting spans of %s over OTLP to %s", name, endpoint)
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        log.info("tracing: printing spans of %s to stderr", name)
    trace.set_tracer_provider(provider)
    return provider.shutdown
