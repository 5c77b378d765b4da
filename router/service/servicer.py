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
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from edge.auth import AUTHENTICATED_TENANT
from edge.frontdoor import CallInfo, ServiceError
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.service import convert
from router.service.frontend import Frontend
from router.service.pool import WorkerPool


def call_info(context: grpc.aio.ServicerContext) -> CallInfo:
    """The protocol-neutral view of a gRPC call: metadata pairs and remaining time."""
    metadata = tuple(
        (k.lower(), v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
        for k, v in (context.invocation_metadata() or ())
    )
    # the tenant the auth interceptor established for this call (edge.auth)
    return CallInfo(metadata, context.time_remaining(), AUTHENTICATED_TENANT.get())


async def abort_with(context: grpc.aio.ServicerContext, exc: ServiceError) -> NoReturn:
    """End the call with the status the error carries (raises, as context.abort does);
    a retry hint goes out as trailing metadata ``retry-after-s``."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-s", f"{exc.retry_after_s:.3f}"),))
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
            await self.frontend.hold_refusal(exc)
            await abort_with(context, exc)
        if AUTHENTICATED_TENANT.get() is not None:
            # a key holder is a tenant, not the operator: worker ids, never the workers'
            # addresses (nor connection errors, which name them)
            return convert.pools_explanation_to_pb(
                expl, address_of=lambda _worker_id: None, ejected=self.frontend.ejector.ejected()
            )
        return convert.pools_explanation_to_pb(
            expl,
            address_of=self._pool.address_of,
            ejected=self.frontend.ejector.ejected(),
            last_error_of=self._last_error_of,
        )

    def _last_error_of(self, worker_id: str) -> str:
        conn = self._pool.by_worker_id(worker_id)
        return conn.last_error if conn is not None else ""
