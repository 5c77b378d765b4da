"""The bridge process: one engine's KV events and HTTP API as a kvroute Worker service.

Lifecycle (as :class:`worker.service.server.WorkerServer`)::

    server = BridgeServer(config)
    port = await server.start()   # events socket open, gRPC bound, follower and load
                                  # loop running, health SERVING
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()       # NOT_SERVING, new requests refused, event streams end,
                                  # forwarded requests get the grace, then are cancelled
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge.auth import AuthInterceptor, token_authenticator
from edge.grpc_services import (
    HEALTH_SERVICE_NAME,
    HealthServicer,
    enable_reflection,
    worker_server_options,
)
from edge.malformed import MalformedRequestInterceptor
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker.bridge.service.engine_http import EngineHttp
from worker.bridge.service.engine_sglang import parse_sglang_metrics
from worker.bridge.service.engine_state import EngineState
from worker.bridge.service.events import EngineEventFollower, EventHub, EventSourceConfig
from worker.bridge.service.servicer import BridgeServicer
from worker.bridge.translate import EventTranslator, TranslatorConfig

log = logging.getLogger("kvroute.bridge.server")

ENGINES = ("vllm", "sglang")
WORKER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name
_DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    """One bridge: the engine it fronts and where it serves."""

    engine_url: str
    events: EventSourceConfig
    worker_id: str = "bridge-0"
    block_size: int = 16
    host: str = "127.0.0.1"
    port: int = 0
    replay_buffer_size: int = 1024  # our batches kept for routers that resubscribe
    subscriber_queue_size: int = 1024
    load_interval_s: float = 1.0  # engine /metrics read and a load batch this often
    max_running_requests: int = 0  # the engine's --max-num-seqs, if the user says (0: unknown)
    shutdown_grace_s: float = 5.0
    router_token: str | None = None  # Worker-service calls must bear it (None: open)
    engine: str = "vllm"  # the engine's kind: vllm (/v1/completions) or sglang (/generate)

    def __post_init__(self) -> None:
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--engine-url must be the engine's HTTP address such as "
                f"http://127.0.0.1:8000, got {self.engine_url!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.load_interval_s <= 0:
            raise ValueError(f"--load-interval-s must be > 0, got {self.load_interval_s}")
        if not self.worker_id:
            raise ValueError("--worker-id must not be empty")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")


class BridgeServer:
    """The gRPC server, the event follower and the load loop of one bridge."""

    def __init__(self, config: BridgeConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        translator = EventTranslator(
            TranslatorConfig(config.worker_id, config.block_size),
            rng or random.Random(),
        )
        self.hub = EventHub(translator, config.replay_buffer_size, config.subscriber_queue_size)
        self.follower = EngineEventFollower(config.events, self.hub)
        self.engine = EngineHttp(config.engine_url)
        self.state = EngineState(
            self.engine,
            config.worker_id,
            config.block_size,
            max_running_requests=config.max_running_requests,
            parse_metrics=parse_sglang_metrics if config.engine == "sglang" else None,
        )
        self.servicer = BridgeServicer(
            self.engine,
            self.state,
            self.hub,
            config.engine,
        )
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port: int | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def translator(self) -> EventTranslator:
        return self.hub.translator

    async def start(self) -> int:
        """Open the events socket, bind gRPC, start following; returns the bound port
        (ValueError for a bad events endpoint, OSError for a port that cannot be bound)."""
        self.follower.open()
        server = grpc.aio.server(
            options=worker_server_options(),
            # only routers: with a token the Worker service needs it (health stays open)
            interceptors=[MalformedRequestInterceptor()]
            + (
                [AuthInterceptor(token_authenticator(self.config.router_token, who="router"))]
                if self.config.router_token
                else []
            ),
        )
        pb_grpc.add_WorkerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((WORKER_SERVICE_NAME, HEALTH_SERVICE_NAME), server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            self.follower.close()
            raise OSError(f"could not bind {address}: {exc}") from None
        if not port:
            self.follower.close()
            raise OSError(f"could not bind {address}")
        await server.start()
        self._server, self.port = server, port
        self._tasks = [
            asyncio.create_task(self._follow(), name="bridge-events"),
            asyncio.create_task(self._load_loop(), name="bridge-load"),
        ]
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(WORKER_SERVICE_NAME, serving)
        log.info(
            "bridge %s listening on %s for the engine at %s (events %s)",
            self.config.worker_id,
            self.address,
            self.config.engine_url,
            self.follower.bound_endpoint or self.config.events.connect,
        )
        return port

    async def _follow(self) -> None:
        try:
            await self.follower.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # never silently: the stream would freeze
            log.exception("the engine event follower failed; health NOT_SERVING")
            await self.health.enter_graceful_shutdown()

    async def _load_loop(self) -> None:
        while True:  # until cancelled
            await self.state.poll()
            self.hub.publish_load(self.state.load_report(*self.servicer.forwarded_load()))
            await asyncio.sleep(self.config.load_interval_s)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        self.hub.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.servicer.inflight and loop.time() < deadline:  # bounded by the grace
            await asyncio.sleep(_DRAIN_POLL_S)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.stop(min(grace, 0.5))
        self.follower.close()
        await self.engine.close()
        log.info("bridge %s stopped", self.config.worker_id)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
