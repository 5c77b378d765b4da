"""The client-facing Router gRPC service: a thin adapter over the Frontend.

Each method decodes the call (metadata, remaining time) into a ``CallInfo``, calls the
protocol-agnostic ``Frontend`` (frontend.py: validate, tokenize, route, retry, relay) and
encodes what it returns. A ``ServiceError`` leaves through ``context.abort`` with the gRPC
code the error class carries: one mapping for every method.

A client cancelling its call cancels the handler task; the Frontend's stream is closed with
it, which cancels the worker call (the worker aborts the request and frees its KV).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.frontdoor import CallInfo, ServiceError
from router.service.frontend import Frontend
from router.service.pool import WorkerPool


def call_info(context: grpc.aio.ServicerContext) -> CallInfo:
    """The protocol-neutral view of a gRPC call: metadata pairs and remaining time."""
    metadata = tuple(
        (k.lower(), v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
        for k, v in (context.invocation_metadata() or ())
    )
    return CallInfo(metadata, context.time_remaining())


async def abort_with(context: grpc.aio.ServicerContext, exc: ServiceError) -> NoReturn:
    """End the call with the status the error carries (raises, as context.abort does)."""
    await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
    raise AssertionError("unreachable: context.abort raises")


class RouterServicer(pb_grpc.RouterServicer):
    """Decode, call the Frontend, encode."""

    def __init__(self, frontend: Frontend, pool: WorkerPool) -> None:
        self.frontend = frontend
        self._pool = pool

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async with contextlib.aclosing(
                self.frontend.generate(request, call_info(context))
            ) as stream:
                async for msg in stream:
                    yield msg
        except ServiceError as exc:
            await abort_with(context, exc)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            found = await self.frontend.abort(request.request_id, call_info(context))
        except ServiceError as exc:
            await abort_with(context, exc)
        return pb.AbortResponse(found=found)

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        try:
            expl = self.frontend.explain(request.request, call_info(context))
        except ServiceError as exc:
            await abort_with(context, exc)
        ejected = self.frontend.ejector.ejected()
        resp = pb.ExplainResponse(
            policy=expl.policy,
            prompt_tokens=expl.prompt_tokens,
            chosen_worker_id=expl.chosen_worker_id or "",
        )
        for w in expl.workers:
            score = resp.workers.add(
                worker_id=w.worker_id,
                address=w.address or self._pool.address_of(w.worker_id),
                healthy=w.healthy and w.worker_id not in ejected,
                matched_tokens=w.matched_tokens,
                inflight_prefill_tokens=w.inflight_prefill_tokens,
                cost=math.nan if w.cost is None else w.cost,
                recent_prefill_tokens=w.recent_prefill_tokens,
            )
            if w.load is not None:
                score.load.CopyFrom(codec.load_to_pb(w.load))
        return resp
