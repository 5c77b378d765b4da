"""Span attributes and phase spans of the worker's request path (OpenTelemetry; GenAI
semantic conventions). Called only while the request's span is recording.

Spans (children of ``kvroute.worker.Generate``, continued from the router's trace)::

    kvroute.worker.Generate        gen_ai.* request and usage attributes
      kvroute.worker.queue         arrival -> the engine's first prefill step of the request
      kvroute.worker.prefill       -> its first token: prompt, cached and computed tokens
      kvroute.worker.decode        -> the end: output tokens

The phases are recorded when the request ends, with the times measured on the way (the
queue wait comes from the engine, on the request's first output).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span

from worker.engine.types import EngineRequest, RequestOutput

__all__ = ["Phases", "record_phases", "record_request"]

tracer = trace.get_tracer("kvroute.worker")


@dataclass(slots=True)
class Phases:
    """Wall-clock marks of one request (time.time_ns), filled while it streams."""

    start_ns: int
    queue_wait_s: float | None = None
    first_token_ns: int | None = None


def record_request(span: Span, req: EngineRequest, model: str) -> None:
    span.set_attributes(
        {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.temperature": req.sampling.temperature,
        }
    )
    if req.sampling.max_new_tokens is not None:  # None: what is left of the context
        span.set_attribute("gen_ai.request.max_tokens", req.sampling.max_new_tokens)


def record_phases(span: Span, phases: Phases, out: RequestOutput, end_ns: int) -> None:
    """The queue / prefill / decode child spans and the usage attributes of ``span``."""
    assert out.finish_reason is not None
    span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason.value])
    usage = out.usage
    if usage is not None:
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
            }
        )
    ctx = trace.set_span_in_context(span)
    start = phases.start_ns
    first = phases.first_token_ns if phases.first_token_ns is not None else end_ns
    admitted = start
    if phases.queue_wait_s is not None:
        admitted = min(start + int(phases.queue_wait_s * 1e9), first)
        queue = tracer.start_span("kvroute.worker.queue", context=ctx, start_time=start)
        queue.end(end_time=admitted)
    prefill = tracer.start_span("kvroute.worker.prefill", context=ctx, start_time=admitted)
    if usage is not None:
        prefill.set_attributes(
            {
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "kvroute.cached_prompt_tokens": usage.cached_prompt_tokens,
                "kvroute.computed_prompt_tokens": usage.prompt_tokens - usage.cached_prompt_tokens,
            }
        )
    prefill.end(end_time=first)
    if phases.first_token_ns is not None:
        decode = tracer.start_span("kvroute.worker.decode", context=ctx, start_time=first)
        if usage is not None:
            decode.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        decode.end(end_time=end_ns)
