"""The router's gRPC server: RouterCore + worker pool + membership + the Router service.

Lifecycle (the route_guide shape)::

    server = RouterServer(RouterServerConfig(workers=("127.0.0.1:7001",)))
    port = await server.start()    # connect to workers, watch Redis, serve Router/health
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()        # NOT_SERVING, in-flight requests get grace_s, then
                                   # subscriptions and channels close

Health (grpc.health.v1): "" is SERVING while the server runs; "kvroute.v1.Router" is
SERVING only while at least one worker is healthy (a readiness probe for load balancers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge.auth import AuthInterceptor, auth_middleware
from edge.grpc_services import HEALTH_SERVICE_NAME, HealthServicer, enable_reflection
from edge.h2_server import H2GrpcServer
from edge.http_front import HttpFront, HttpFrontConfig, build_app
from edge.malformed import MalformedRequestInterceptor
from edge.registry import (
    DEFAULT_PREFIX,
    DEFAULT_TTL_S,
    RedisMembershipWatcher,
    WorkerRecord,
    redacted_url,
)
from edge.tls import RedisAuth, ServerTls
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.core.pools import PoolsConfig, RouterPools
from router.core.router_core import RouterConfig, RouterCore
from router.service.auth import ApiKeys
from router.service.frontend import DEFAULT_MODEL_NAME, Frontend, FrontendConfig
from router.service.pool import WorkerPool
from router.service.replica_sync import ReplicaSync
from router.service.servicer import RouterServicer
from router.service.validation import TextTokenizer
from router.service.worker_conn import ConnectionConfig

log = logging.getLogger(__name__)

ROUTER_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name  # kvroute.v1.Router
HTTP_OPEN_PATHS = ("/health", "/v1/models")  # open without an API key (probes, discovery)


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Redis membership (None url: static workers only)."""

    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX
    poll_s: float = 2.0
    absent_grace_s: float = DEFAULT_TTL_S  # a worker missing from the registry is kept this long
    auth: RedisAuth = field(default_factory=RedisAuth)  # rediss:// TLS and an ACL user
    # replica sync (router/service/replica_sync.py) on this Redis: the router replicas publish their
    # picks to each other
    replica_sync: bool = False

    def __post_init__(self) -> None:
        if self.replica_sync and not self.redis_url:
            raise ValueError("--replica-sync needs --redis-url (the replicas meet on its Redis)")
        if not self.poll_s > 0:  # NaN too
            raise ValueError(f"registry poll_s (--redis-poll-s) must be > 0, got {self.poll_s}")
        if not self.absent_grace_s >= 0:
            raise ValueError(
                f"registry absent_grace_s (--registry-grace-s) must be >= 0, "
                f"got {self.absent_grace_s}"
            )


@dataclass(frozen=True, slots=True)
class RouterServerConfig:
    """Everything the router process needs."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = let the OS pick; start() returns the bound port
    workers: tuple[str, ...] = ()  # static HOST:PORT addresses
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    core: RouterConfig = field(default_factory=RouterConfig)
    service: FrontendConfig = field(default_factory=FrontendConfig)
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    grace_s: float = 5.0
    seed: int | None = None  # tie-breaks and jitter; None = from the OS
    http: HttpFrontConfig | None = None  # the OpenAI-compatible HTTP front; None: off
    tls: ServerTls | None = None  # the gRPC port's TLS (mTLS with a client CA); None: plaintext
    api_keys: ApiKeys | None = None  # bearer keys -> tenants (router/service/auth.py); None: open
    # SO_REUSEPORT on the gRPC port: only for the sibling processes of one `kvroute router
    # --processes N`, whose supervisor holds the port against everyone else
    reuse_port: bool = False
    # the model pools (router.core.pools, decision 0036); None: one pool named
    # service.model_name, open to the names workers announce while that is the default name
    pools: PoolsConfig | None = None

    def __post_init__(self) -> None:
        for address in self.workers:
            check_address(address)

    def pools_config(self) -> PoolsConfig:
        if self.pools is not None:
            return self.pools
        name = self.service.model_name
        return PoolsConfig((name,), open=name == DEFAULT_MODEL_NAME)


def check_address(address: str) -> str:
    """Validate HOST:PORT; raises ValueError naming the problem."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"worker address must be HOST:PORT with a port in 1..65535, got {address!r}"
        )
    return address


class RouterServer:
    """One router replica."""

    def __init__(
        self,
        config: RouterServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        tokenizer: TextTokenizer | None = None,
        pool_tokenizers: Mapping[str, TextTokenizer] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        rng = random.Random(config.seed)
        # the first pool's generator is drawn first, then the worker pool's (as with one
        # core before pools); later pools' come from a third
        seeds = [rng.getrandbits(64)]
        pool_rng = random.Random(rng.getrandbits(64))
        more = random.Random(rng.getrandbits(64))

        def make_core() -> RouterCore:
            seed = seeds.pop() if seeds else more.getrandbits(64)
            return RouterCore(config.core, clock=clock, rng=random.Random(seed))

        # one RouterCore per served model (router.core.pools)
        self.pools = RouterPools(config.pools_config(), make_core)
        self.pool = WorkerPool(
            self.pools,
            config.connection,
            rng=pool_rng,
            clock=clock,
            on_health_change=self._on_health_change,
        )
        # one request path (validate, tokenize, route, relay) under every front door
        self.frontend = Frontend(
            self.pools,
            self.pool,
            config.service,
            clock=clock,
            tokenizer=tokenizer,
            pool_tokenizers=pool_tokenizers,
        )
        self.servicer = RouterServicer(self.frontend, self.pool)
        self.health = HealthServicer()  # with List
        self.watcher: RedisMembershipWatcher | None = None
        self.replica_sync: ReplicaSync | None = None
        self._server: H2GrpcServer | None = None
        self.port: int | None = None
        self.http: HttpFront | None = None  # over the same Frontend as the gRPC servicer
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def core(self) -> RouterCore:
        """The default pool's core (the only one of a single-model router)."""
        return self.pools.core

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Connect to workers, start membership watching, bind and serve; returns the port."""
        keys = self.config.api_keys
        # security at the edge: the interceptor authenticates, the Frontend gets the tenant
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if keys is not None:
            interceptors.append(AuthInterceptor(keys.authenticate))
        server = H2GrpcServer(interceptors=interceptors, reuse_port=self.config.reuse_port)
        pb_grpc.add_RouterServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((ROUTER_SERVICE_NAME, HEALTH_SERVICE_NAME), server)  # v1 and v1alpha
        tls = self.config.tls.ssl_context() if self.config.tls is not None else None
        port = server.add_port(f"{self.config.host}:{self.config.port}", tls)
        try:
            for address in self.config.workers:
                self.pool.add(address, static=True)
            if self.config.registry.redis_url:
                self.watcher = RedisMembershipWatcher(
                    self.config.registry.redis_url,
                    self._on_members,
                    prefix=self.config.registry.prefix,
                    poll_s=self.config.registry.poll_s,
                    absent_grace_s=self.config.registry.absent_grace_s,
                    client_options=self.config.registry.auth.client_kwargs(),
                )
                await self.watcher.start()
            if self.config.registry.replica_sync:
                assert self.config.registry.redis_url is not None  # RegistryConfig checks it
                self.replica_sync = ReplicaSync(
                    self.pools,
                    self.config.registry.redis_url,
                    prefix=self.config.registry.prefix,
                    client_options=self.config.registry.auth.client_kwargs(),
                )
                await self.replica_sync.start()
            await server.start()
            await self._start_http()
        except BaseException:  # a bad Redis URL, a failed bind: leave no task or channel behind
            await server.stop(None)  # the port was bound, whether or not it served yet
            if self.replica_sync is not None:
                await self.replica_sync.close()
                self.replica_sync = None
            if self.watcher is not None:
                await self.watcher.stop()
                self.watcher = None
            await self.pool.close()
            raise
        self._server, self.port = server, port
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready(self.pool.num_healthy > 0)
        log.info(
            "router listening on %s policy=%s models=%s workers=%s redis=%s replica_sync=%s",
            self.address,
            self.pools.policy_name,
            ",".join(self.pools.config.names) + ("+announced" if self.pools.config.open else ""),
            ",".join(self.config.workers) or "-",
            redacted_url(self.config.registry.redis_url or "-"),
            self.replica_sync.router_id if self.replica_sync is not None else "off",
        )
        return port

    async def _start_http(self) -> None:
        """The OpenAI HTTP front, if configured (OSError naming the address on a failed bind)."""
        if self.config.http is None:
            return
        keys = self.config.api_keys
        middlewares = [] if keys is None else [auth_middleware(keys.authenticate, HTTP_OPEN_PATHS)]
        app = build_app(
            self.frontend,
            self.http_health,
            max_body_bytes=self.config.http.max_body_bytes,
            middlewares=middlewares,
        )
        http = HttpFront(app, self.config.http)
        try:
            await http.start()
        except OSError as exc:
            where = f"{self.config.http.host}:{self.config.http.port}"
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(f"could not bind HTTP {where}: {why}") from None
        self.http = http

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, let in-flight requests finish for ``grace_s``, close everything."""
        self._stopping = True
        grace = self.config.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        try:
            # both front doors stop accepting; their in-flight requests share the grace
            http_stopped = self.http.stop(grace) if self.http is not None else asyncio.sleep(0)
            grpc_stopped = (
                self._server.stop(grace) if self._server is not None else asyncio.sleep(0)
            )
            await asyncio.gather(http_stopped, grpc_stopped)
        finally:
            if self.replica_sync is not None:  # after the in-flight requests' finishes
                await self.replica_sync.close()
            if self.watcher is not None:
                await self.watcher.stop()
            await self.pool.close()
        log.info("router stopped")

    def http_health(self) -> str | None:
        """None while the router can serve; else why not (HTTP GET /health answers 503)."""
        if self._stopping:
            return "the router is shutting down"
        if self.pool.num_healthy == 0:
            return "no healthy worker to route to"
        return None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # ---- membership and readiness --------------------------------------------------------

    async def _on_members(self, members: dict[str, WorkerRecord]) -> None:
        await self.pool.set_dynamic(r.address for r in members.values())

    async def _set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(ROUTER_SERVICE_NAME, status)

    def _on_health_change(self, num_healthy: int) -> None:
        if self._stopping or self._server is None:
            return
        # the pool calls back synchronously; the health update is async
        task = asyncio.get_running_loop().create_task(self._set_ready(num_healthy > 0))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
