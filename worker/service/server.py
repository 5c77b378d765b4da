"""The worker's gRPC server: lifecycle, health and reflection around the Worker servicer.

Lifecycle (the route_guide shape)::

    server = WorkerServer(engine, tokenizer, config)
    port = await server.start()          # engine loop + grpc.aio server, health SERVING
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()              # NOT_SERVING, new requests refused, KV streams end,
                                         # in-flight requests get config.shutdown_grace_s,
                                         # then the rest is cancelled and the engine stops
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge.auth import AuthInterceptor, auth_middleware, token_authenticator
from edge.grpc_services import (
    HEALTH_SERVICE_NAME,
    HealthServicer,
    enable_reflection,
    worker_server_options,
)
from edge.http_front import HttpFront, HttpFrontConfig
from edge.limits import RequestLimits
from edge.malformed import MalformedRequestInterceptor
from edge.tls import ServerTls, add_port
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import LoadReport
from kvroute_proto.hashing import hash_key_fingerprint
from worker.engine.engine_config import EngineConfig
from worker.engine.tokenizer import Tokenizer
from worker.service.convert import WorkerInfo
from worker.service.engine_runner import EngineRunner, RunnerConfig
from worker.service.generation import WorkerGeneration
from worker.service.publisher import EventPublisher, PublisherConfig
from worker.service.servicer import WorkerServicer

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.service.zmq_events import ZmqEventPublisher, ZmqEventsConfig

log = logging.getLogger("kvroute.worker.server")

_STATUS_TAIL_S = 0.5
DEFAULT_MODEL_NAME = "kvroute-tiny"  # the served name of the tiny default model (and sim)
WORKER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name  # kvroute.v1.Worker
# open on the HTTP front even with --http-require-token (probes, discovery)
HTTP_OPEN_PATHS = ("/health", "/v1/models", "/model_info", "/server_info")
HTTP_STATE_PATHS = ("/flush_cache",)  # they change state: the router token always guards them


def new_epoch() -> int:
    """A fresh stream epoch: random 63 bits, never 0."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True, slots=True)
class WorkerServerConfig:
    """Everything the server needs besides the engine (whose config it also reports)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    executor_kind: str = "sim"
    host: str = "127.0.0.1"
    port: int = 0  # 0 = let the OS pick; start() returns the bound port
    replay_buffer_size: int = 1024
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutdown_grace_s: float = 10.0
    http: HttpFrontConfig | None = None  # the HTTP (OpenAI, SGLang/vLLM compat) front; None: off
    model_name: str = DEFAULT_MODEL_NAME  # the served model name (HTTP "model")
    model_path: str | None = None  # the model directory, reported by GET /model_info
    tls: ServerTls | None = None  # gRPC TLS; with a client CA only routers with a cert get in
    router_token: str | None = None  # Worker-service calls must bear it (None: open)
    # the HTTP generation routes require the router token too (off: peer routers such as
    # sglang-router cannot send it); /health, /v1/models, /model_info, /server_info stay open
    http_require_token: bool = False
    # also publish the KV events in vLLM's ZMQ wire (None: off)
    zmq_events: ZmqEventsConfig | None = None

    def __post_init__(self) -> None:
        if self.http_require_token and not self.router_token:
            raise ValueError("--http-require-token needs --router-token")


def _step_profile_s(engine: Engine) -> tuple[float, float, float, float]:
    """The step profile GetLoad states: the simulated executor's cost model; zeros (not
    stated, the router's default) for an executor without one."""
    cost_model = getattr(engine.executor, "cost_model", None)
    return cost_model.step_profile_s() if cost_model is not None else (0.0, 0.0, 0.0, 0.0)


class WorkerServer:
    """One worker process's gRPC server (Worker, health, reflection) over one Engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer | None,
        config: WorkerServerConfig,
        *,
        epoch: int | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.epoch = new_epoch() if epoch is None else epoch
        ec = config.engine
        publisher = EventPublisher(
            PublisherConfig(ec.worker_id, self.epoch, ec.block_size, config.replay_buffer_size)
        )
        self.runner = EngineRunner(engine, publisher, config.runner, self._on_engine_failure)
        self.info = WorkerInfo(
            worker_id=ec.worker_id,
            epoch=self.epoch,
            block_size=ec.block_size,
            page_size=ec.page_size,
            kv_capacity_tokens=ec.num_kv_slots,
            max_context_tokens=engine.max_context_tokens,
            vocab_size=engine.vocab_size,
            executor=config.executor_kind,
            load=LoadReport(),  # GetLoad reads it fresh on the engine thread
            model_name=config.model_name,
            tokenizer_fingerprint=getattr(tokenizer, "fingerprint", ""),
            hash_key_fingerprint=hash_key_fingerprint(),
            max_running_requests=ec.max_running_requests,
            step_profile_s=_step_profile_s(engine),
        )
        self.generation = WorkerGeneration(
            self.runner, tokenizer, config.limits, self.info, model_name=config.model_name
        )
        self.servicer = WorkerServicer(
            self.runner, tokenizer, config.limits, self.info, generation=self.generation
        )
        self.http: HttpFront | None = None
        self.http_port: int | None = None
        self._engine_failed = False
        self.health = HealthServicer()  # with List
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = False
        self._failure_task: asyncio.Task[None] | None = None
        self._zmq_events: ZmqEventPublisher | None = None

    def _on_engine_failure(self, exc: BaseException) -> None:
        # Routers must stop sending here: report NOT_SERVING (the process keeps running so
        # an operator can look; GetLoad and Generate answer UNAVAILABLE).
        log.error("engine loop failed (%r): health NOT_SERVING", exc)
        self._engine_failed = True
        self._failure_task = asyncio.create_task(self.health.enter_graceful_shutdown())

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def http_health(self) -> str | None:
        """None when this worker serves; else why not (HTTP GET /health answers 503)."""
        if self._engine_failed:
            return "the engine loop failed"
        if self.generation.draining or self._stopped:
            return "the worker is shutting down"
        return None

    def _build_http(self, config: HttpFrontConfig) -> HttpFront:
        from worker.service.http import build_worker_app  # aiohttp only when HTTP is on

        app = build_worker_app(
            self.generation,
            self.runner,
            self.http_health,
            model_path=self.config.model_path,
            executor=self.config.executor_kind,
            max_body_bytes=config.max_body_bytes,
            middlewares=self._http_auth(),
        )
        return HttpFront(app, config)

    def _http_auth(self) -> list[Any]:
        """Every HTTP route but the open ones needs the router token with
        --http-require-token; with only --router-token, the routes that change state do."""
        if self.config.http_require_token:
            return [auth_middleware(self._authenticate(), HTTP_OPEN_PATHS)]
        if self.config.router_token:
            return [auth_middleware(self._authenticate(), (), only=HTTP_STATE_PATHS)]
        return []

    def _authenticate(self):  # type: ignore[no-untyped-def]
        assert self.config.router_token
        return token_authenticator(self.config.router_token, who="router")

    async def start(self) -> int:
        """Bind, start serving and return the bound port."""
        server = grpc.aio.server(
            options=worker_server_options(),
            # only routers: the Worker service needs the router token (health stays open)
            # unparsable requests are INVALID_ARGUMENT (edge.malformed), not UNKNOWN
            interceptors=[MalformedRequestInterceptor()]
            + ([AuthInterceptor(self._authenticate())] if self.config.router_token else []),
        )
        pb_grpc.add_WorkerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((WORKER_SERVICE_NAME, HEALTH_SERVICE_NAME), server)  # v1 and v1alpha
        address = f"{self.config.host}:{self.config.port}"
        port = add_port(server, address, self.config.tls)
        self.runner.start()
        if self.config.zmq_events is not None:
            await self._start_zmq_events(self.config.zmq_events)
        await server.start()
        self._server, self.port = server, port
        if self.config.http is not None:
            http = self._build_http(self.config.http)
            try:
                self.http_port = await http.start()
            except OSError as exc:
                await server.stop(None)
                await self.runner.stop()
                raise OSError(
                    f"could not bind HTTP {self.config.http.host}:{self.config.http.port}: {exc}"
                ) from None
            self.http = http
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(WORKER_SERVICE_NAME, serving)
        ec = self.config.engine
        log.info(
            "worker %s listening on %s epoch=%d executor=%s kv_slots=%d",
            ec.worker_id,
            self.address,
            self.epoch,
            self.config.executor_kind,
            ec.num_kv_slots,
        )
        return port

    async def _start_zmq_events(self, config: ZmqEventsConfig) -> None:
        from worker.service.zmq_events import ZmqEventPublisher  # pyzmq: the worker extra

        publisher = ZmqEventPublisher(self.runner, config, self.config.engine.block_size)
        try:
            publisher.start()
        except OSError:
            await self.runner.stop()
            raise
        self._zmq_events = publisher
        where = ", replay on ".join(publisher.endpoints.values())
        log.info("publishing KV events in vLLM's ZMQ wire on %s (topic %r)", where, config.topic)

    async def begin_shutdown(self) -> None:
        """Health NOT_SERVING, new Generate calls refused (UNAVAILABLE), every KV event
        stream ended; requests already running keep going."""
        await self.health.enter_graceful_shutdown()
        self.servicer.refuse_new_requests()
        self.runner.close_subscriptions()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: in-flight requests get ``grace_s`` (default from the config) to
        finish; then every remaining RPC (stragglers, health watches) is cancelled, their
        requests aborted and the engine loop stopped. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self.begin_shutdown()
        try:
            if not await self.servicer.drain(grace):
                log.warning("requests still running after the %.1fs grace: cancelling", grace)
            if self.http is not None:  # HTTP handlers left are cancelled: aborts their requests
                await self.http.stop()
            if self._server is not None:
                # A short tail lets finished calls send their status; long-lived streams
                # (health watches, stragglers) are cancelled after it.
                await self._server.stop(min(grace, _STATUS_TAIL_S))
        finally:
            if self._zmq_events is not None:
                await self._zmq_events.stop()
            await self.runner.stop()
        log.info("worker %s stopped", self.config.engine.worker_id)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
