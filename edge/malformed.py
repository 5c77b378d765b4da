"""A request message that does not parse is INVALID_ARGUMENT, not UNKNOWN.

grpc answers a request whose bytes its deserializer cannot parse with UNKNOWN ("Unexpected
DecodeError ..."), which says "server bug" to a client that sent garbage. This server
interceptor, shared by router and worker, wraps each method's request deserializer so a
parse failure becomes a marker value, and the method's behaviour so the marker ends the call
with INVALID_ARGUMENT naming the message type and the parse error. Well-formed requests go
through untouched (one ``isinstance`` check per call).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["MalformedRequestInterceptor"]


@dataclass(frozen=True, slots=True)
class _Malformed:
    message: str


def _safe(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, and whatever a custom deserializer raises
            return _Malformed(
                f"the request message of {method} does not parse ({len(data)} bytes): {exc}"
            )

    return deserialize


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kw = {
        "request_deserializer": _safe(handler.request_deserializer, method),
        "response_serializer": handler.response_serializer,
    }
    if handler.response_streaming:
        inner_stream = handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            result = inner_stream(request, context)
            if inspect.isasyncgen(result):
                # closed with this one: a cancelled call ends the method's own generator at
                # once (its finally aborts the request), not when the collector finds it
                async with contextlib.aclosing(result) as items:
                    async for item in items:
                        yield item
            else:  # a coroutine that writes with context.write
                await result

        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    inner_unary = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        result = inner_unary(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Unparsable request messages -> INVALID_ARGUMENT (client-streaming methods, which
    neither service has, are passed through unchanged)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        return _wrap(handler, handler_call_details.method)
