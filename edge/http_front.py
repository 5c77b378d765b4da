"""The OpenAI-compatible HTTP front door (aiohttp) over a ``GenerationBackend``.

Shared by the router (over its ``Frontend``) and the worker (over ``WorkerGeneration``):
each route parses with :mod:`edge.openai_api`, calls ``backend.generate`` and turns
what comes back (messages, or a ``ServiceError``) into HTTP. It runs on the process's event
loop next to the gRPC server (``HttpFront.start`` / ``stop``).

Routes::

    POST /v1/completions        POST /v1/chat/completions    (stream: server-sent events)
    GET  /v1/models             GET  /health                 (200 ready, 503 not)

Headers: ``X-Request-Id`` (1..128 of [A-Za-z0-9-_.:]) becomes the request id and is echoed
(one is made up when absent); ``X-Kvroute-Worker-Id`` names the worker that served a
non-streamed request (streamed: the last chunk's ``kvroute.worker_id``, as headers leave
before the request is routed).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: a ServiceError
with its own HTTP status (and ``Retry-After`` when it has a hint), bad JSON 400, unknown path
404, wrong method 405, a body over ``max_body_bytes`` 413. A streamed request that fails
after its headers went out gets an ``error`` event, then ``[DONE]``.

Disconnects: the server cancels a handler whose client went away (aiohttp's
``handler_cancellation``); the handler closes the backend iterator, which aborts the request
where it runs (no KV slot leaks).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from edge import openai_api as oa
from edge.auth import AUTHENTICATED_TENANT
from edge.frontdoor import CallInfo, GenerationBackend, Internal, ServiceError
from edge.http_n import serve_n, start_sse
from edge.openai_params import in_public_terms
from edge.tls import ServerTls
from kvroute_proto import kvroute_pb2 as pb

log = logging.getLogger("kvroute.http")

REQUEST_ID_HEADER = "X-Request-Id"
WORKER_ID_HEADER = "X-Kvroute-Worker-Id"
DEFAULT_MAX_BODY_BYTES = 8 << 20

# None when the process can serve; else why not (GET /health answers 503 with it)
HealthCheck = Callable[[], str | None]

BACKEND_KEY: web.AppKey[GenerationBackend] = web.AppKey("backend", GenerationBackend)  # type: ignore[type-abstract]
HEALTH_KEY: web.AppKey[HealthCheck] = web.AppKey("health", object)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class HttpFrontConfig:
    """Where the HTTP front listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = let the OS pick; start() returns the bound port
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 1.0  # handlers still running at stop get this long
    tls: ServerTls | None = None  # HTTPS (and client certificates with a client CA)
    # SO_REUSEPORT: only for sibling processes of one `kvroute router --processes N`, whose
    # supervisor holds the port against everyone else (router/cli/processes.py)
    reuse_port: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"HTTP port (--http-port) must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


# ---- helpers shared with the worker's compat routes --------------------------------------


def error_response(exc: ServiceError, request_id: str | None = None) -> web.Response:
    """OpenAI error JSON with the error's HTTP status (and Retry-After when hinted)."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return web.Response(
        body=oa.dumps(oa.error_body(exc)),
        status=exc.http_status,
        content_type="application/json",
        headers=headers,
    )


def json_response(obj: object, *, status: int = 200, headers: dict[str, str] | None = None):
    return web.Response(
        body=oa.dumps(obj), status=status, content_type="application/json", headers=headers
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (400 otherwise; 413 past the app's client_max_size)."""
    return oa.parse_json_body(await request.read())


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id (validated), or a fresh one."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return oa.check_request_id(given) if given is not None else uuid.uuid4().hex


def call_info(request: web.Request) -> CallInfo:
    # the tenant the auth middleware established for this request (edge.auth)
    return CallInfo.from_mapping(request.headers, tenant_id=AUTHENTICATED_TENANT.get())


def backend_of(request: web.Request) -> GenerationBackend:
    return request.app[BACKEND_KEY]


@contextlib.asynccontextmanager
async def closing(it: AsyncIterator[pb.GenerateResponse]):
    """Close the backend iterator however the handler ends (a cancelled handler included):
    that is what aborts the request on the worker."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


# ---- the OpenAI routes -------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: oa.Kind) -> web.StreamResponse:
    backend = backend_of(request)
    rid = request_id_of(request)
    body = await read_json(request)
    parse = oa.parse_chat if kind == "chat" else oa.parse_completion
    served = served_models(backend)
    tokenizer = tokenizer_of(backend, body.get("model"))
    api = parse(body, model_name=served, request_id=rid, tokenizer=tokenizer)
    model = api.request.model or backend.model_name
    created = int(time.time())
    if api.n > 1:  # one request per choice, merged (edge/http_n.py)
        return await serve_n(request, backend, api, call_info(request), {REQUEST_ID_HEADER: rid})
    out = oa.ApiOutput(api)
    async with closing(backend.generate(api.request, call_info(request))) as messages:
        if not api.stream:
            async for msg in messages:
                out.push(msg)
            if out.finished is None:
                raise Internal("the backend's stream ended without a Finished message")
            headers = {REQUEST_ID_HEADER: rid}
            if out.finished.worker_id:
                headers[WORKER_ID_HEADER] = out.finished.worker_id
            return json_response(oa.full_response(out, model, created), headers=headers)
        # Wait for the first message before the headers go out: a refusal (bad input,
        # overload, no worker) is then a plain HTTP error, not an error event.
        first = await anext(messages, None)
        resp = await start_sse(request, {REQUEST_ID_HEADER: rid})
        # One socket write per relayed message: its events joined; the last ones leave
        # with the end of the stream.
        events: list[bytes] = []
        if kind == "chat":
            events.append(oa.sse_event(oa.delta_chunk(out, model, created, "", first=True)))
        try:
            deltas = oa.DeltaEvents(out, model, created)
            msg = first
            while msg is not None:
                text = out.push(msg)
                if text:
                    events.append(deltas.event(text))
                elif text is None:
                    events.append(oa.sse_event(oa.finish_chunk(out, model, created)))
                    if api.include_usage:
                        events.append(oa.sse_event(oa.usage_chunk(out, model, created)))
                if events and out.finished is None:
                    await resp.write(b"".join(events))
                    events.clear()
                msg = await anext(messages, None)
            if out.finished is None:
                raise Internal("the backend's stream ended without a Finished message")
        except ServiceError as exc:
            log.info("request %s failed mid-stream: %s", rid, exc.message)
            events.append(oa.sse_event(oa.error_body(exc)))
        events.append(oa.SSE_DONE)
        await resp.write_eof(b"".join(events))
        return resp


def served_models(backend: GenerationBackend) -> list[str]:
    """The models ``backend`` serves: a router's pools' (``served_models``), else its one."""
    served = getattr(backend, "served_models", None)
    return list(served()) if served is not None else [backend.model_name]


def tokenizer_of(backend: GenerationBackend, model: object) -> Any:
    """The tokenizer (chat template) of ``model``'s pool, or the backend's one."""
    tokenizer_for = getattr(backend, "tokenizer_for", None)
    if tokenizer_for is not None and isinstance(model, str) and model:
        return tokenizer_for(model)
    return getattr(backend, "tokenizer", None)


async def models(request: web.Request) -> web.Response:
    backend = backend_of(request)
    return json_response(oa.models_list(served_models(backend), request.app[STARTED_KEY]))


async def health(request: web.Request) -> web.Response:
    problem = request.app[HEALTH_KEY]()
    if problem is not None:
        return json_response(
            oa.plain_error_body(problem, "service_unavailable"),
            status=503,
        )
    return json_response({"status": "ok"})


STARTED_KEY: web.AppKey[int] = web.AppKey("started", int)


_OPENAI_ROUTES: dict[str, oa.Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
}


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """One mapping from errors to OpenAI's error JSON, for every route."""
    try:
        return await handler(request)
    except ServiceError as exc:
        if request.path in _OPENAI_ROUTES:  # the OpenAI API's field names, not the wire's
            exc = in_public_terms(exc, _OPENAI_ROUTES[request.path])
        return error_response(exc, _valid_request_id(request))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(exc, request)


def _valid_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id to echo on an error, when it is a valid one."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return None
    try:
        return oa.check_request_id(given)
    except ServiceError:
        return None


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    if status == 404:
        message, code = f"no route {request.method} {request.path}", "not_found"
    elif status == 405:
        allowed = exc.headers.get("Allow", "")
        message, code = (
            f"{request.method} is not allowed on {request.path} (allowed: {allowed})",
            ("method_not_allowed"),
        )
    elif status == 413:
        limit = request.app._client_max_size
        message, code = (
            f"the request body is larger than the limit of {limit} bytes",
            ("request_too_large"),
        )
    else:
        message, code = exc.reason or exc.text or "HTTP error", None
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    error_type = "invalid_request_error" if status < 500 else "internal_error"
    return json_response(
        oa.plain_error_body(message, error_type, code=code), status=status, headers=headers
    )


def build_app(
    backend: GenerationBackend,
    health_check: HealthCheck,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    extra_routes: Iterable[web.AbstractRouteDef] = (),
    middlewares: Iterable[Any] = (),
) -> web.Application:
    """The aiohttp application: the OpenAI routes, plus ``extra_routes`` (the worker's
    SGLang/vLLM compat routes), all behind the error middleware (``middlewares``, e.g.
    authentication, run inside it, so their refusals are OpenAI error JSON too)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[openai_errors, *middlewares])
    app[BACKEND_KEY] = backend
    app[HEALTH_KEY] = health_check
    app[STARTED_KEY] = int(time.time())
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", chat_completions),
            web.get("/v1/models", models),
            web.get("/health", health),
            *extra_routes,
        ]
    )
    return app


class HttpFront:
    """An aiohttp server for one app, on the running event loop."""

    def __init__(self, app: web.Application, config: HttpFrontConfig) -> None:
        self.app = app
        self.config = config
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the bound port (OSError when the bind fails)."""
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,  # a client disconnect cancels its handler
            shutdown_timeout=self.config.shutdown_timeout_s,
            access_log=None,
        )
        await runner.setup()
        tls = self.config.tls
        site = web.TCPSite(
            runner,
            self.config.host,
            self.config.port,
            reuse_port=self.config.reuse_port,
            ssl_context=None if tls is None else tls.ssl_context(),
        )
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._runner = runner
        scheme = "http" if self.config.tls is None else "https"
        log.info("HTTP (OpenAI API) listening on %s://%s", scheme, self.address)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop listening; handlers still running get ``grace_s`` (default: the config's
        ``shutdown_timeout_s``), then are cancelled, which closes their backend iterators
        (their requests are aborted). Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            if grace_s is not None:
                runner._shutdown_timeout = grace_s  # aiohttp reads it in cleanup()
            await runner.cleanup()
