"""Tracing setup: off unless asked, console export prints spans with the service name."""

import subprocess
import sys

CODE = """
import sys
from opentelemetry import trace
from edge.telemetry import configure_tracing
shutdown = configure_tracing("kvroute-test", console={console})
with trace.get_tracer("t").start_as_current_span("hello-span"):
    pass
shutdown()
print(type(trace.get_tracer_provider()).__name__)
"""


def _run(console: bool, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", CODE.format(console=console)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )


def test_no_provider_without_endpoint_or_console():
    out = _run(console=False)
    assert out.stdout.strip() == "ProxyTracerProvider"
    assert "hello-span" not in out.stderr


def test_console_export_prints_spans_with_the_service_name():
    out = _run(console=True, env_extra={"OTEL_SERVICE_NAME": "svc-from-env"})
    assert out.stdout.strip() == "TracerProvider"
    assert '"name": "hello-span"' in out.stderr
    assert "svc-from-env" in out.stderr
