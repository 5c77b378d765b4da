"""Span attributes of the router's request path (OpenTelemetry; GenAI semantic conventions).

The Frontend calls these only when its span is recording (a tracer provider is installed:
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``--trace-console``); with tracing off they cost one
``is_recording()`` check. They read the decision the core already made and never change it.

Spans::

    kvroute.router.Generate          gen_ai.* request/usage attributes, kvroute.worker_id, ...
      kvroute.route                  one per attempt: candidates, the chosen worker, matched
                                     and best tokens (and the chosen one's by source:
                                     event-confirmed vs predicted), forgone tokens, the top
                                     costs
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span

from kvroute_proto import kvroute_pb2 as pb
from router.core.router_core import (
    InvalidRouteRequestError,
    RouteDecision,
    RouterCore,
    RouteRequest,
)

__all__ = [
    "TOP_COSTS",
    "RouteContext",
    "record_finish",
    "record_request",
    "record_route",
    "top_costs",
]

tracer = trace.get_tracer("kvroute.router")

TOP_COSTS = 3  # how many of the cheapest workers a route span lists


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What the route span reports beyond the decision, read before it (tracing only)."""

    num_candidates: int
    top_costs: list[str]  # "worker=cost" of the cheapest few
    # per worker: (tokens matched by event-confirmed entries, by predicted entries)
    sources: dict[str, tuple[int, int]]


def top_costs(core: RouterCore, route: RouteRequest, exclude: frozenset[str]) -> RouteContext:
    """The candidates, their cheapest costs and each worker's match by source, for ``route``
    as the fleet stands before it is routed (RouterCore.explain: changes nothing)."""
    req = RouteRequest(route.request_id, route.token_ids, route.partition, exclude=exclude)
    try:
        explanation = core.explain(req)
    except InvalidRouteRequestError:
        return RouteContext(0, [], {})
    scored = [
        (w.cost, w.worker_id)
        for w in explanation.workers
        if w.cost is not None and w.worker_id not in exclude and math.isfinite(w.cost)
    ]
    candidates = sum(1 for w in explanation.workers if w.healthy and w.worker_id not in exclude)
    return RouteContext(
        candidates,
        [f"{wid}={cost:.1f}" for cost, wid in sorted(scored)[:TOP_COSTS]],
        {
            w.worker_id: (
                w.event_matched_tokens,
                w.predicted_matched_tokens,
            )
            for w in explanation.workers
        },
    )


def record_route(
    parent: Span,
    decision: RouteDecision,
    seconds: float,
    attempt: int,
    context: RouteContext,
) -> None:
    """A ``kvroute.route`` child span of ``parent`` covering the decision just made."""
    end = time.time_ns()
    span = tracer.start_span(
        "kvroute.route",
        context=trace.set_span_in_context(parent),
        start_time=end - int(seconds * 1e9),
    )
    event, predicted = context.sources.get(decision.worker_id, (0, 0))
    span.set_attributes(
        {
            "kvroute.policy": decision.policy,
            "kvroute.attempt": attempt,
            "kvroute.route.candidates": context.num_candidates,
            "kvroute.worker_id": decision.worker_id,
            "kvroute.prompt_tokens": decision.prompt_tokens,
            "kvroute.matched_tokens": decision.matched_tokens,
            "kvroute.best_matched_tokens": decision.best_matched_tokens,
            "kvroute.forgone_tokens": decision.best_matched_tokens - decision.matched_tokens,
            "kvroute.cost": decision.cost,
            "kvroute.route.top_costs": context.top_costs,
            "kvroute.event_matched_tokens": event,
            "kvroute.predicted_matched_tokens": predicted,
        }
    )
    span.end(end_time=end)


def record_request(span: Span, request: pb.GenerateRequest, model: str) -> None:
    """GenAI request attributes of the router's Generate span."""
    span.set_attributes(
        {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": request.sampling.max_new_tokens,
            "gen_ai.request.temperature": request.sampling.temperature,
        }
    )


def record_finish(span: Span, finished: pb.Finished) -> None:
    """GenAI usage and kvroute cache attributes from the worker's Finished."""
    usage = finished.usage
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "kvroute.cached_prompt_tokens": usage.cached_prompt_tokens,
            "gen_ai.response.finish_reasons": [_finish_reason(finished.reason)],
        }
    )


def _finish_reason(reason: int) -> str:
    """FINISH_REASON_LENGTH -> "length" (the OpenAI-style names GenAI conventions use)."""
    name = pb.FinishReason.Name(reason) if reason in pb.FinishReason.values() else "unspecified"
    return name.removeprefix("FINISH_REASON_").lower()
