"""The bridge service end to end: fake engines (ZMQ events + OpenAI completions), real
bridges and a real router on 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from edge.tokenizer import ByteTokenizer
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import LoadReport
from router.cli.client import GenerateOptions
from router.core.router_core import RouterConfig
from tests.router.service.router_harness import FAST_CONN, WAIT_S, router_config, running_router
from tests.worker.bridge.fake_engine import FakeEngine
from worker.bridge.service.events import EventSourceConfig
from worker.bridge.service.server import BridgeConfig, BridgeServer

BLOCK = 16  # kvroute's; the fake engines use 32-token blocks (one of theirs = two of ours)
# as `kvroute router` without --model: its byte tokenizer's fingerprint, bridges accepted
CONN = dataclasses.replace(
    FAST_CONN, tokenizer_fingerprint=ByteTokenizer().fingerprint, accept_no_fingerprint=True
)


async def wait_until(predicate, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def engine_and_bridge(
    worker_id: str,
    *,
    token_delay_s: float = 0.0,
    replay: bool = True,
    bind: bool = False,
    router_token: str | None = None,
) -> AsyncIterator[tuple[FakeEngine, BridgeServer]]:
    if bind:  # the bridge binds, the engine connects (vLLM's endpoint with a host)
        events = EventSourceConfig(bind="tcp://127.0.0.1:*", replay=None)
        bridge = BridgeServer(
            BridgeConfig("http://127.0.0.1:1", events, worker_id, BLOCK, load_interval_s=0.1),
            rng=random.Random(0),
        )
        bridge.follower.open()
        assert bridge.follower.bound_endpoint is not None
        engine = FakeEngine(
            token_delay_s=token_delay_s, events_connect=bridge.follower.bound_endpoint
        )
        await engine.start()
        bridge.config = dataclasses.replace(
            bridge.config,
            engine_url=engine.url,
            events=dataclasses.replace(events, replay=engine.replay_endpoint),
        )
        bridge.engine.base_url = engine.url
        bridge.follower.config = bridge.config.events
    else:
        engine = FakeEngine(token_delay_s=token_delay_s)
        await engine.start()
        events = EventSourceConfig(
            connect=engine.pub_endpoint,
            replay=engine.replay_endpoint if replay else None,
            replay_timeout_s=1.0,
        )
        config = BridgeConfig(
            engine.url, events, worker_id, BLOCK, load_interval_s=0.1, router_token=router_token
        )
        bridge = BridgeServer(config, rng=random.Random(0))
    await bridge.start()
    try:
        # until the engine's first answer (its model name) Generate is UNAVAILABLE: the
        # tests that call it start once the bridge has it (a loaded box is slow)
        if not bind:
            await wait_until(lambda: bool(bridge.state.model_name))
        yield engine, bridge
    finally:
        await bridge.stop(grace_s=0.2)
        await engine.stop()


def matched(expl, worker_id: str) -> int:  # type: ignore[no-untyped-def]
    return {w.worker_id: w.event_matched_tokens for w in expl.workers}[worker_id]


async def explain_when(r, p, predicate):  # type: ignore[no-untyped-def]
    """The router's Explain of ``p`` once ``predicate`` holds (events applied)."""
    for _ in range(int(WAIT_S / 0.02)):
        expl = await r.client.explain(p)
        if predicate(expl):
            return expl
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {expl}")


def prompt(seed: int, n: int = 96) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 1 for i in range(n)]


@contextlib.asynccontextmanager
async def router_over(*bridges: BridgeServer, connection: Any = CONN) -> AsyncIterator[Any]:
    """A cache-aware router (our block size) in front of ``bridges``, synced with them all."""
    config = router_config(
        [b.address for b in bridges],
        connection=connection,
        core=RouterConfig(policy="cache_aware", block_size=BLOCK),
    )
    async with running_router([], config) as r:
        await r.wait_synced(len(bridges))
        yield r


async def test_events_reach_the_router_and_routing_prefers_the_holder():
    async with (
        engine_and_bridge("b0") as (e0, b0),
        engine_and_bridge("b1") as (e1, b1),
        router_over(b0, b1) as r,
    ):
        p = prompt(1)
        first = await r.client.generate(p, GenerateOptions(max_new_tokens=3))
        assert first.finish_reason and first.completion_tokens == 3
        assert first.token_ids == (p[-1] + 1, p[-1] + 2, p[-1] + 3)
        holder = {"b0": (e0, b0), "b1": (e1, b1)}[first.worker_id]
        # the engine published its 96-token prompt as 3 blocks of 32: 6 of ours
        await wait_until(lambda: len(holder[1].translator.held_blocks()) == 6)
        expl = await explain_when(r, [*p, 7, 8], lambda e: matched(e, first.worker_id) == 96)
        assert expl.chosen_worker_id == first.worker_id
        other = "b1" if first.worker_id == "b0" else "b0"
        assert matched(expl, other) == 0
        for _ in range(3):
            again = await r.client.generate([*p, 9, 9, 9], GenerateOptions(max_new_tokens=2))
            assert again.worker_id == first.worker_id
            assert again.cached_prompt_tokens == 96  # the engine's own count, passed on
        assert holder[0].completions == 4


async def test_abort_closes_the_engine_stream_and_finishes_with_abort():
    async with engine_and_bridge("b0", token_delay_s=0.05) as (engine, bridge):
        config = router_config([bridge.address], connection=CONN)
        async with running_router([], config) as r:
            await r.wait_synced(1)
            got: list[pb.GenerateResponse] = []
            stream = r.client.stream(
                prompt(2), GenerateOptions(request_id="r-abort", max_new_tokens=500)
            )
            async for msg in stream:
                got.append(msg)
                if len(got) == 2:
                    assert await r.client.abort("r-abort") is True
                if msg.HasField("finished"):
                    break
            assert got[-1].HasField("finished")
            assert got[-1].finished.reason == pb.FINISH_REASON_ABORT
            assert 2 <= sum(len(m.chunk.token_ids) for m in got if m.HasField("chunk")) < 500
            await wait_until(lambda: engine.disconnects == 1)
            assert not bridge.servicer.inflight and bridge.servicer.num_aborted == 1
            assert await r.client.abort("r-abort") is False  # no longer in flight


async def cancel_after_first_chunk(stub: pb_grpc.WorkerStub) -> None:
    """A long Generate call, cancelled once its first chunk came."""
    req = pb.GenerateRequest(
        request_id="c1",
        prompt_token_ids=pb.TokenIds(ids=prompt(3)),
        sampling=pb.SamplingParams(max_new_tokens=500),
    )
    call = stub.Generate(req)
    async for msg in call:
        assert msg.HasField("chunk")
        break
    call.cancel()


async def test_a_cancelled_call_aborts_the_engine_request():
    async with engine_and_bridge("b0", token_delay_s=0.05) as (engine, bridge):
        async with grpc.aio.insecure_channel(bridge.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            await cancel_after_first_chunk(stub)
        await wait_until(lambda: engine.disconnects == 1)
        await wait_until(lambda: not bridge.servicer.inflight)


async def test_a_gap_is_filled_from_the_engine_replay_socket():
    async with engine_and_bridge("b0") as (engine, bridge):
        await wait_until(lambda: bridge.follower.counters.replay_requests >= 1)  # start-up
        ev1, _ = engine.store_events(prompt(4, 64))
        ev2, _ = engine.store_events(prompt(5, 64))
        ev3, _ = engine.store_events(prompt(6, 64))
        await asyncio.sleep(0.2)  # the SUB has joined (slow joiner)
        await engine.publish(ev1)
        await engine.publish(ev2, live=False)  # lost on the way: only the replay has it
        await engine.publish(ev3)
        await wait_until(lambda: len(bridge.translator.held_blocks()) == 12)
        stats = bridge.translator.stats()
        assert stats.num_gaps >= 1 and stats.num_batches_lost == 0
        assert bridge.follower.counters.replay_frames >= 1


async def test_the_bridge_catches_up_on_what_the_engine_cached_before_it_started():
    engine = FakeEngine()
    await engine.start()
    try:
        ev, _ = engine.store_events(prompt(7, 64))
        await engine.publish(ev)  # nobody listens yet
        events = EventSourceConfig(connect=engine.pub_endpoint, replay=engine.replay_endpoint)
        bridge = BridgeServer(BridgeConfig(engine.url, events, "b0", BLOCK), rng=random.Random(0))
        await bridge.start()
        try:
            await wait_until(lambda: len(bridge.translator.held_blocks()) == 4)
        finally:
            await bridge.stop(grace_s=0.1)
    finally:
        await engine.stop()


async def test_a_bridge_that_binds_receives_from_an_engine_that_connects():
    async with engine_and_bridge("b0", bind=True) as (engine, bridge):
        ev, _ = engine.store_events(prompt(8, 64))
        for _ in range(int(WAIT_S / 0.1)):  # the engine's connect may lose the first sends
            await engine.publish(ev if not bridge.translator.held_blocks() else [])
            if bridge.translator.held_blocks():
                break
            await asyncio.sleep(0.1)
        assert len(bridge.translator.held_blocks()) == 4


async def test_get_load_reports_the_engine_and_refuses_text_prompts():
    async with (
        engine_and_bridge("b0") as (_engine, bridge),
        grpc.aio.insecure_channel(bridge.address) as ch,
    ):
        stub = pb_grpc.WorkerStub(ch)
        info = await stub.GetLoad(pb.GetLoadRequest())
        assert info.worker_id == "b0" and info.block_size == BLOCK
        assert info.model_name == "tiny" and info.max_context_tokens == 1024
        assert info.tokenizer_fingerprint == "" and info.executor == "bridge"
        await wait_until(lambda: bridge.state.load is not None)
        info = await stub.GetLoad(pb.GetLoadRequest())
        assert info.kv_capacity_tokens == 64 * 32  # vllm:cache_config_info
        assert info.load.num_free_kv_tokens == int(64 * 32 * 0.75)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.Generate(pb.GenerateRequest(prompt_text="hello")):
                pass
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "send prompt_token_ids" in (exc.value.details() or "")


async def test_get_load_is_unavailable_while_the_engine_does_not_answer():
    engine = FakeEngine()
    await engine.start()
    dead_url = "http://127.0.0.1:9"  # nothing listens (discard port)
    events = EventSourceConfig(connect=engine.pub_endpoint)
    bridge = BridgeServer(BridgeConfig(dead_url, events, "b0", BLOCK), rng=random.Random(0))
    await bridge.start()
    try:
        async with grpc.aio.insecure_channel(bridge.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest())
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dead_url in (exc.value.details() or "")
    finally:
        await bridge.stop(grace_s=0.1)
        await engine.stop()


async def test_a_bridge_with_a_token_serves_only_routers_that_send_it():
    async with (
        engine_and_bridge("b0", router_token="tok") as (_engine, bridge),
        grpc.aio.insecure_channel(bridge.address) as ch,
    ):
        stub = pb_grpc.WorkerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.GetLoad(pb.GetLoadRequest())
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = await stub.GetLoad(pb.GetLoadRequest(), metadata=(("authorization", "Bearer tok"),))
        assert info.worker_id == "b0"
        async with router_over(bridge, connection=dataclasses.replace(CONN, token="tok")) as r:
            result = await r.client.generate(prompt(3), GenerateOptions(max_new_tokens=2))
            assert result.worker_id == "b0" and len(result.token_ids) == 2


@pytest.mark.parametrize("runs", [True, False])
async def test_a_router_that_reads_late_gets_the_queued_batches_as_runs(runs: bool):
    # decision 0056: the bridge serves runs as the worker does, and only to who asks
    async with (
        engine_and_bridge("b0") as (_engine, bridge),
        grpc.aio.insecure_channel(bridge.address) as channel,
    ):
        call = pb_grpc.WorkerStub(channel).SubscribeKvEvents(
            pb.SubscribeRequest(subscriber_id="r", accepts_runs=runs)
        )
        first = await call.read()
        assert first.WhichOneof("kind") == "snapshot"
        seq = first.snapshot.seq
        for _ in range(300):  # in one turn of the loop: all queued before the stream writes
            bridge.hub.publish_load(LoadReport(1, 0, 0, 100, 0, 100))
        kinds, seqs = [], []
        while len(seqs) < 300:
            msg = await asyncio.wait_for(call.read(), WAIT_S)
            kinds.append(msg.WhichOneof("kind"))
            batches = msg.run.batches if kinds[-1] == "run" else [msg.batch]
            seqs += [b.seq for b in batches]  # the bridge's own load timer's too
        assert seqs == list(range(seq + 1, seq + 1 + len(seqs)))  # in order, none missing
        assert ("run" in kinds) is runs and (len(kinds) < 10) is runs
        call.cancel()
