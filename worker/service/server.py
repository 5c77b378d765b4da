"""The worker's gRPC server: lifecycle, health and reflection around the Worker servicer.

Lifecycle (the route_guide shape)::

    server = WorkerServer(engine, tokenizer, config)
    port = await server.start()          # engine loop + grpc.aio server, health SERVING
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()              # NOT_SERVING, close KV streams, in-flight requests
                                         # get config.shutdown_grace_s, then the engine stops
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import LoadReport
from worker.engine.engine_config import EngineConfig
from worker.engine.tokenizer import Tokenizer
from worker.service.convert import RequestLimits, WorkerInfo
from worker.service.engine_runner import EngineRunner, RunnerConfig
from worker.service.publisher import EventPublisher, PublisherConfig
from worker.service.servicer import WorkerServicer

if TYPE_CHECKING:
    from worker.engine.engine import Engine

log = logging.getLogger("kvroute.worker.server")

WORKER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name  # kvroute.v1.Worker


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
        self.runner = EngineRunner(engine, publisher, config.runner)
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
        )
        self.servicer = WorkerServicer(self.runner, tokenizer, config.limits, self.info)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Bind, start serving and return the bound port."""
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (WORKER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        self.runner.start()
        await server.start()
        self._server, self.port = server, port
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

    async def begin_shutdown(self) -> None:
        """Health NOT_SERVING and end every KV event stream; requests keep running."""
        await self.health.enter_graceful_shutdown()
        self.runner.close_subscriptions()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: in-flight requests get ``grace_s`` (default from the config) to
        finish, then they are cancelled (and aborted) and the engine loop stops. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self.begin_shutdown()
        try:
            if self._server is not None:
                await self._server.stop(grace)
        finally:
            await self.runner.stop()
        log.info("worker %s stopped", self.config.engine.worker_id)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
