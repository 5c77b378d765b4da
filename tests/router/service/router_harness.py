"""Router test harness: real grpc.aio servers on 127.0.0.1 port 0.

``running_router`` starts a RouterServer over given worker addresses with fast reconnects;
``sim_worker`` starts a real in-process worker (Engine + sim executor + WorkerServer).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from router.cli.client import RouterClient
from router.core.router_core import RouterConfig
from router.service.frontend import FrontendConfig
from router.service.resilience import BackoffConfig, EjectionConfig
from router.service.server import RegistryConfig, RouterServer, RouterServerConfig
from router.service.worker_conn import ConnectionConfig

WAIT_S = 10.0  # upper bound for any awaited condition

FAST_CONN = ConnectionConfig(
    keepalive_time_s=5.0,
    keepalive_timeout_s=2.0,
    rpc_timeout_s=2.0,
    purge_after_s=0.5,
    backoff=BackoffConfig(initial_s=0.02, max_s=0.2),
)


def router_config(workers: list[str], **overrides) -> RouterServerConfig:
    base = RouterServerConfig(
        workers=tuple(workers),
        core=RouterConfig(policy="cache_aware"),
        service=FrontendConfig(ejection=EjectionConfig(max_consecutive_failures=3, cooldown_s=60)),
        connection=FAST_CONN,
        registry=RegistryConfig(),
        grace_s=0.5,
        seed=0,
    )
    return dataclasses.replace(base, **overrides)


@dataclass
class RunningRouter:
    server: RouterServer
    client: RouterClient

    @property
    def address(self) -> str:
        return self.server.address

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        await self.server.pool.wait_for(predicate, timeout)

    async def wait_healthy(self, n: int, timeout: float = WAIT_S) -> None:
        await self.wait_for(lambda: self.server.pool.num_healthy == n, timeout)

    async def wait_synced(self, n: int, timeout: float = WAIT_S) -> None:
        """n workers healthy, each with its first event message (the snapshot) applied."""
        conns = self.server.pool.conns.values()
        await self.wait_for(
            lambda: sum(1 for c in conns if c.healthy and c.num_messages > 0) == n, timeout
        )


@contextlib.asynccontextmanager
async def running_router(
    workers: list[str],
    config: RouterServerConfig | None = None,
    *,
    tenant: str | None = None,
    tokenizer: object | None = None,
    pool_tokenizers: dict | None = None,
) -> AsyncIterator[RunningRouter]:
    server = RouterServer(
        config or router_config(workers),
        tokenizer=tokenizer,  # type: ignore[arg-type]
        pool_tokenizers=pool_tokenizers,
    )
    await server.start()
    client = RouterClient(server.address, tenant=tenant, timeout_s=WAIT_S)
    try:
        yield RunningRouter(server, client)
    finally:
        await client.close()
        await server.stop(grace_s=0.1)


@dataclass
class SimWorker:
    server: object  # worker.service.server.WorkerServer
    address: str
    worker_id: str


@contextlib.asynccontextmanager
async def sim_worker(
    worker_id: str,
    *,
    block_size: int = 4,
    port: int = 0,
    epoch: int | None = None,
    load_interval_s: float = 0.2,
    pace_speedup: float = 0.0,
    tokenizer: object | None = None,
    model_name: str | None = None,
) -> AsyncIterator[SimWorker]:
    """A real worker (Engine + sim executor) served in this process; with ``pace_speedup``
    > 0 it runs the modelled Llama-3-8B step times (1 = real time) instead of zero cost;
    ``model_name``: the model it announces (default: the worker's default name)."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sim_executor import SimCostModel, SimExecutor, SimExecutorConfig
    from worker.engine.tokenizer import ByteTokenizer
    from worker.service.engine_runner import RunnerConfig
    from worker.service.server import WorkerServer, WorkerServerConfig

    engine_config = EngineConfig(worker_id=worker_id, num_kv_slots=4096, block_size=block_size)
    sim = SimExecutorConfig(
        vocab_size=ByteTokenizer().vocab_size, max_context_tokens=1024, eos_token_id=None
    )
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1e-3
        return ticks[0]

    cost = SimCostModel() if pace_speedup > 0 else SimCostModel.zero()
    engine = Engine(engine_config, SimExecutor(cost, sim), clock=clock)
    config = WorkerServerConfig(
        engine=engine_config,
        executor_kind="sim",
        port=port,
        runner=RunnerConfig(load_interval_s=load_interval_s, pace_speedup=pace_speedup),
        shutdown_grace_s=0.5,
    )
    if model_name is not None:
        config = dataclasses.replace(config, model_name=model_name)
    tok = ByteTokenizer() if tokenizer is None else tokenizer  # its fingerprint is reported
    server = WorkerServer(engine, tok, config, epoch=epoch)  # type: ignore[arg-type]
    bound = await server.start()
    try:
        yield SimWorker(server, f"127.0.0.1:{bound}", worker_id)
    finally:
        await server.stop(grace_s=0.2)
