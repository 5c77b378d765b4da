"""Security test harness: an in-process sim worker with config overrides (TLS, token), and
the PKI fixture's helpers. Real grpc.aio servers on 127.0.0.1 port 0."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

WAIT_S = 10.0


@contextlib.asynccontextmanager
async def secure_worker(
    worker_id: str, *, block_size: int = 4, paced: bool = False, **overrides: Any
) -> AsyncIterator[Any]:
    """A real worker (Engine + sim executor) with WorkerServerConfig ``overrides`` (tls=,
    router_token=, http=, http_require_token=); yields the WorkerServer. ``paced``: the
    modelled Llama-3-8B step times in real time (requests stay in flight), else zero cost."""
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

    cost = SimCostModel() if paced else SimCostModel.zero()
    engine = Engine(engine_config, SimExecutor(cost, sim), clock=clock)
    config = WorkerServerConfig(
        engine=engine_config,
        executor_kind="sim",
        runner=RunnerConfig(load_interval_s=0.2, pace_speedup=1.0 if paced else 0.0),
        shutdown_grace_s=0.5,
        **overrides,
    )
    server = WorkerServer(engine, ByteTokenizer(), config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=0.2)
