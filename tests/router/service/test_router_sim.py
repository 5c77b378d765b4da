"""The router over real in-process workers (Engine + sim executor): event intake, prefix
affinity, worker loss and restart (new epoch), two replicas, Redis membership, health."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_harness import router_config, running_router, sim_worker

from edge.registry import RedisRegistration, WorkerRecord
from kvroute_proto.events import Partition
from kvroute_proto.hashing import block_hash_list
from router.cli.client import GenerateOptions
from router.service.server import RegistryConfig, RouterServer

BLOCK = 4
PREFIX = list(range(10, 42))  # 32 tokens = 8 blocks
OPTS = GenerateOptions(max_new_tokens=2)


def prefix_blocks(tokens: list[int]) -> set[int]:
    return set(block_hash_list(tokens, BLOCK, Partition().seed))


async def test_events_reach_the_index_and_a_shared_prefix_lands_on_its_holder():
    async with (
        sim_worker("w0") as w0,
        sim_worker("w1") as w1,
        running_router([w0.address, w1.address]) as router,
    ):
        await router.wait_synced(2)
        core = router.server.core
        first = await router.client.generate([*PREFIX, 1, 2], OPTS)
        holder = first.worker_id
        # the holder's KV events arrive: its confirmed blocks cover the prefix
        await router.wait_for(lambda: prefix_blocks(PREFIX) <= core.worker_blocks(holder))
        other = "w1" if holder == "w0" else "w0"
        assert core.worker_blocks(other) == set()
        for i in range(3):
            r = await router.client.generate([*PREFIX, 100 + i, 7], OPTS)
            assert r.worker_id == holder
            assert r.cached_prompt_tokens >= len(PREFIX)
        expl = await router.client.explain([*PREFIX, 5, 5])
        scores = {w.worker_id: w for w in expl.workers}
        assert expl.chosen_worker_id == holder
        assert scores[holder].matched_tokens >= len(PREFIX)
        assert scores[other].matched_tokens == 0


async def test_text_prompts_route_on_utf8_bytes():
    text = "The quick brown fox jumps over the lazy dog. " * 2
    async with (
        sim_worker("w0") as w0,
        sim_worker("w1") as w1,
        running_router([w0.address, w1.address]) as router,
    ):
        await router.wait_synced(2)
        first = await router.client.generate(text + "one", OPTS)
        tokens = list((text + "one").encode())
        core = router.server.core
        full = tokens[: len(tokens) // BLOCK * BLOCK]
        await router.wait_for(lambda: prefix_blocks(full) <= core.worker_blocks(first.worker_id))
        second = await router.client.generate(text + "two", OPTS)
        assert second.worker_id == first.worker_id
        assert second.cached_prompt_tokens >= len(text) // BLOCK * BLOCK


async def test_dead_worker_is_avoided_and_purged_then_resynced_on_restart():
    stacks = {wid: contextlib.AsyncExitStack() for wid in ("w0", "w1")}
    try:
        workers = {
            wid: await stack.enter_async_context(sim_worker(wid)) for wid, stack in stacks.items()
        }
        addresses = [w.address for w in workers.values()]
        async with running_router(addresses) as router:
            await router.wait_synced(2)
            core = router.server.core
            holder = (await router.client.generate([*PREFIX, 1], OPTS)).worker_id
            other = "w1" if holder == "w0" else "w0"
            conn = router.server.pool.by_worker_id(holder)
            assert conn is not None
            await router.wait_for(lambda: prefix_blocks(PREFIX) <= core.worker_blocks(holder))
            old_epoch = core.expected_subscription(holder)[0]

            await stacks[holder].aclose()  # the holder goes away
            await router.wait_for(lambda: not conn.healthy)
            for i in range(3):
                r = await router.client.generate([*PREFIX, 9, i], OPTS)
                assert (r.worker_id, r.attempts) == (other, 1)
            # unreachable past purge_after_s: its index entries are gone
            await router.wait_for(lambda: conn.num_purges == 1)
            assert core.worker_blocks(holder) == set()
            assert core.has_worker(holder)

            # restart on the same port: a new epoch, resync from a snapshot
            port = int(workers[holder].address.rsplit(":", 1)[1])
            stacks[holder] = contextlib.AsyncExitStack()
            await stacks[holder].enter_async_context(sim_worker(holder, port=port))
            await router.wait_for(lambda: conn.healthy and conn.num_connects == 2)
            await router.wait_for(
                lambda: core.expected_subscription(holder)[0] not in (0, old_epoch)
            )
            assert core.worker_blocks(holder) == set()
            assert router.server.pool.num_healthy == 2
    finally:
        for stack in stacks.values():
            await stack.aclose()


async def test_two_replicas_see_all_events_and_route_consistently():
    async with sim_worker("w0") as w0, sim_worker("w1") as w1:
        cfg_a = router_config([w0.address, w1.address])
        cfg_b = dataclasses.replace(cfg_a, seed=1)
        async with (
            running_router([w0.address, w1.address], cfg_a) as ra,
            running_router([w0.address, w1.address], cfg_b) as rb,
        ):
            await ra.wait_synced(2)
            await rb.wait_synced(2)
            first = await ra.client.generate([*PREFIX, 1], OPTS)
            holder = first.worker_id
            # replica B never routed this request, but it sees the holder's events
            await rb.wait_for(lambda: prefix_blocks(PREFIX) <= rb.server.core.worker_blocks(holder))
            await ra.wait_for(lambda: prefix_blocks(PREFIX) <= ra.server.core.worker_blocks(holder))
            for i in range(3):
                prompt = [*PREFIX, 50 + i]
                a = await ra.client.generate(prompt, OPTS)
                b = await rb.client.generate(prompt, OPTS)
                assert a.worker_id == b.worker_id == holder


async def test_redis_membership_adds_and_removes_workers(redis_url, redis_prefix):
    prefix, url = redis_prefix, redis_url
    async with sim_worker("w0") as w0, sim_worker("w1") as w1:
        regs = [
            RedisRegistration(url, WorkerRecord(w.worker_id, w.address), prefix=prefix, ttl_s=5)
            for w in (w0, w1)
        ]
        for reg in regs:
            await reg.start()
        registry = RegistryConfig(url, prefix, poll_s=0.05, absent_grace_s=0)
        config = router_config([], registry=registry)
        try:
            async with running_router([], config) as router:
                await router.wait_synced(2)
                r = await router.client.generate(PREFIX, OPTS)
                assert r.worker_id in ("w0", "w1")
                await regs[0].stop()  # w0 deregisters: the router drops it
                await router.wait_for(lambda: not router.server.core.has_worker("w0"))
                assert list(router.server.pool.conns) == [w1.address]
                assert router.server.watcher is not None
                assert not router.server.watcher.redis_down
        finally:
            await regs[1].stop()


async def test_health_and_reflection():
    async with sim_worker("w0") as w0, running_router([w0.address, "127.0.0.1:1"]) as router:
        await router.wait_synced(1)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvroute.v1.Router"):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            async for answer in refl.ServerReflectionInfo(iter([ask])):
                names = {s.name for s in answer.list_services_response.service}
                assert {"kvroute.v1.Router", "grpc.health.v1.Health"} <= names


async def test_router_is_not_ready_without_a_healthy_worker():
    async with (
        running_router(["127.0.0.1:1"]) as router,
        grpc.aio.insecure_channel(router.address) as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        live = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        ready = await stub.Check(health_pb2.HealthCheckRequest(service="kvroute.v1.Router"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING
        assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_registry_flush_keeps_the_fleet_routing(redis_url, redis_prefix):
    """A Redis that restarts empty: no worker is removed (connection, load history and
    index kept) and every request is served while the workers re-register."""
    prefix, url = redis_prefix, redis_url
    async with sim_worker("w0") as w0, sim_worker("w1") as w1:
        records = [WorkerRecord(w.worker_id, w.address) for w in (w0, w1)]
        regs = [RedisRegistration(url, rec, prefix=prefix, ttl_s=5) for rec in records]
        for reg in regs:
            await reg.start()
        config = router_config([], registry=RegistryConfig(url, prefix, poll_s=0.05))
        rds = redis.Redis.from_url(url)
        try:
            async with running_router([], config) as router:
                await router.wait_synced(2)
                await router.client.generate(PREFIX, OPTS)
                blocks = {w: router.server.core.worker_blocks(w) for w in ("w0", "w1")}
                conns = dict(router.server.pool.conns)
                polls = router.server.watcher.num_polls
                rds.delete(*rds.keys(prefix + "*"))  # the registry lost its data
                for _ in range(200):  # bounded: 5 polls of 0.05 s
                    if router.server.watcher.num_polls >= polls + 5:
                        break
                    await asyncio.sleep(0.02)
                assert router.server.watcher.num_polls >= polls + 5
                for i in range(5):
                    r = await router.client.generate([i + 1, *PREFIX], OPTS)
                    assert r.worker_id in ("w0", "w1")
                assert router.server.pool.conns == conns  # the same connection objects
                for w, held in blocks.items():
                    assert held <= router.server.core.worker_blocks(w)
        finally:
            rds.close()
            for reg in regs:
                await reg.stop()


async def test_the_redis_password_is_never_logged(redis_url, redis_prefix, caplog):
    """A Redis URL with a password (refused by this Redis, which has none): the router still
    starts (the registry is best effort) and no log line at any level carries the password."""
    url = redis_url.replace("redis://", "redis://kvroute-nobody:hunter2-secret@")
    registry = RegistryConfig(url, redis_prefix, poll_s=0.05, absent_grace_s=0)
    router = RouterServer(router_config([], registry=registry))
    with caplog.at_level(logging.DEBUG):
        await router.start()
        await asyncio.sleep(0.2)  # a few failed polls
        await router.stop(grace_s=0.1)
    lines = [r.getMessage() for r in caplog.records]
    assert any("router listening on" in x and "kvroute-nobody:***@" in x for x in lines)
    assert not any("hunter2" in x for x in lines)
