"""Authentication at the edge: one gRPC server interceptor and one aiohttp middleware.

Security lives in the shells, never in the cores: the interceptor (gRPC) and the middleware
(HTTP) call an :data:`Authenticator` with the call's metadata before any handler runs. It
returns the caller's tenant id (or None when the credential names no tenant, e.g. the
router's token at a worker) or raises :class:`~edge.frontdoor.Unauthenticated`,
which leaves as UNAUTHENTICATED / HTTP 401 with OpenAI's error JSON. The tenant travels to
the front end in :data:`AUTHENTICATED_TENANT` (a context variable: the interceptor and the
handler run in the same task), which the shells copy into ``CallInfo.tenant_id``.

Open without a credential: gRPC health and reflection (probes and tools), and the HTTP paths
a deployment lists as open (``/health``, ``/v1/models`` on the router).

Used by the router (API keys, router/service/auth.py) and the worker (the routers' shared
token, :func:`token_authenticator`). :class:`MetadataInterceptor` is the client side: the
router adds its token to every call on its worker channel.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from aiohttp import web

from edge.frontdoor import ServiceError, Unauthenticated

Metadata = Sequence[tuple[str, str | bytes]]
# metadata -> tenant id (None: authenticated, no tenant); raises Unauthenticated
Authenticator = Callable[[Metadata], str | None]

AUTHENTICATED_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvroute_authenticated_tenant", default=None
)

# services every gRPC server keeps open (health probes, grpcurl / reflection clients)
OPEN_GRPC_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
)


def bearer_token(metadata: Metadata | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` entry (None when there is none)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def token_authenticator(token: str, *, who: str = "router") -> Authenticator:
    """Accept only calls bearing ``token`` (constant-time comparison); no tenant."""
    if not token:
        raise ValueError("the shared token must be non-empty")
    expected = token.encode()

    def authenticate(metadata: Metadata) -> str | None:
        given = bearer_token(metadata)
        if given is None:
            raise Unauthenticated(
                f"missing credential: this server accepts calls only from a {who} "
                f"(metadata 'authorization: Bearer <token>')"
            )
        if not hmac.compare_digest(given.encode(), expected):
            raise Unauthenticated(f"invalid {who} token")
        return None

    return authenticate


def _service_of(method: str) -> str:
    # "/package.Service/Method" -> "package.Service"
    return method.lstrip("/").partition("/")[0]


def _refusal(handler: grpc.RpcMethodHandler, exc: ServiceError) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with ``exc``'s status."""
    code = grpc.StatusCode[exc.grpc_code]

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, exc.message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, exc.message)
        yield  # pragma: no cover - an async generator that never yields

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticate every call except those to ``open_services``; the tenant goes into
    :data:`AUTHENTICATED_TENANT` for the handler (same task)."""

    def __init__(
        self, authenticate: Authenticator, open_services: Iterable[str] = OPEN_GRPC_SERVICES
    ) -> None:
        self._authenticate = authenticate
        self._open = frozenset(open_services)
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in self._open:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        try:
            tenant = self._authenticate(metadata)  # type: ignore[arg-type]
        except ServiceError as exc:
            self.num_refused += 1
            return _refusal(handler, exc)
        AUTHENTICATED_TENANT.set(tenant)
        return handler


def auth_middleware(
    authenticate: Authenticator,
    open_paths: Iterable[str],
    only: Iterable[str] | None = None,
) -> Any:
    """aiohttp middleware: authenticate every path but ``open_paths`` (from headers), or
    with ``only`` just those paths; the ``openai_errors`` middleware outside it turns a
    refusal into OpenAI's error JSON."""
    open_set = frozenset(open_paths)
    only_set = None if only is None else frozenset(only)

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        tenant = None  # set for every request: a keep-alive connection's task is reused
        path = request.path
        if path not in open_set and (only_set is None or path in only_set):
            pairs = tuple((k.lower(), v) for k, v in request.headers.items())
            tenant = authenticate(pairs)
        AUTHENTICATED_TENANT.set(tenant)
        return await handler(request)

    return middleware


class _AddMetadata:
    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self._pairs = pairs

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*self._pairs)
        for key, value in details.metadata or ():
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add ``authorization: Bearer TOKEN`` to every call."""
    pairs = (("authorization", f"Bearer {token}"),)
    return [_UnaryUnary(pairs), _UnaryStream(pairs), _StreamStream(pairs)]
