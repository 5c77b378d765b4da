"""Model pools in the router service (decision 0036): real in-process workers announcing
different models, one RouterServer. A router given no model forms a pool per announced name;
requests go to their model's pool; Explain, metrics and replica sync carry the pool."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from router_harness import router_config, running_router, sim_worker

from router.cli.client import GenerateOptions
from router.core.core_types import ReplicaRouted
from router.service.metrics_state import RouterStateCollector, take_snapshot
from router.service.replica_sync import decode_batch, encode_batch

PROMPT = list(range(1, 41))  # 10 blocks of 4


async def test_an_open_router_forms_a_pool_per_announced_model() -> None:
    async with contextlib.AsyncExitStack() as stack:
        workers = {}
        for wid, model in (("x0", "x"), ("x1", "x"), ("y0", "y")):
            w = await stack.enter_async_context(sim_worker(wid, model_name=model))
            workers[wid] = w.address
        r = await stack.enter_async_context(running_router(list(workers.values())))
        await r.wait_synced(3)
        server = r.server
        assert server.frontend.served_models() == ["x", "y"]
        assert server.frontend.model_name == "kvroute-tiny"  # several: none is implied
        assert set(server.pools.pools) == {"kvroute-tiny", "x", "y"}  # the default stays
        assert server.pools.model_of("y0") == "y"
        first = await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2, model="x"))
        assert first.worker_id in ("x0", "x1")
        only_y = await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2, model="y"))
        assert only_y.worker_id == "y0"
        # the x pool's index holds the prompt on the first worker: the repeat goes there
        await r.wait_for(lambda: len(server.pools.worker_blocks(first.worker_id)) >= 10)
        again = await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2, model="x"))
        assert again.worker_id == first.worker_id
        assert again.cached_prompt_tokens >= 36
        expl = await r.client.explain(PROMPT, GenerateOptions(model="x"))
        assert expl.model == "x" and expl.chosen_worker_id == first.worker_id
        assert {w.worker_id for w in expl.workers} == {"x0", "x1"}
        assert {w.model for w in expl.workers} == {"x"}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "this server serves 'x', 'y'" in (err.value.details() or "")
        # metrics: the index families per pool
        snap = take_snapshot(server)
        registry = CollectorRegistry()
        registry.register(RouterStateCollector(lambda: snap))
        text = generate_latest(registry).decode()
        assert 'kvroute_router_pool_workers{model="x"} 2.0' in text
        assert 'kvroute_router_pool_workers{model="y"} 1.0' in text
        assert 'kvroute_router_routed_requests_total{model="x"} 2.0' in text
        assert 'kvroute_router_routed_requests_total{model="y"} 1.0' in text


async def test_a_single_model_router_serves_every_worker_as_before() -> None:
    """A router told its model (--served-model-name) takes workers announcing another name
    into its one pool, as before pools, and answers requests without a model."""
    from router.core.pools import PoolsConfig

    async with contextlib.AsyncExitStack() as stack:
        w = await stack.enter_async_context(sim_worker("w0", model_name="what-it-calls-it"))
        config = router_config([w.address], pools=PoolsConfig(("served",)))
        r = await stack.enter_async_context(running_router([w.address], config))
        await r.wait_synced(1)
        assert r.server.frontend.served_models() == ["served"]
        assert r.server.frontend.model_name == "served"
        out = await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2))
        assert out.worker_id == "w0"
        named = await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2, model="served"))
        assert named.worker_id == "w0"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.client.generate(PROMPT, GenerateOptions(max_new_tokens=2, model="other"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_replica_pick_carries_its_pool_over_the_wire() -> None:
    pick = ReplicaRouted("r1", "w0", 40, 8, (1, 2), model="beta")
    (decoded,) = decode_batch(encode_batch("me", 1, [pick])).events
    assert isinstance(decoded, ReplicaRouted) and decoded.model == "beta"
    plain = ReplicaRouted("r2", "w0", 40, 8)
    (decoded,) = decode_batch(encode_batch("me", 2, [plain])).events
    assert isinstance(decoded, ReplicaRouted) and decoded.model == ""
