"""SubscribeKvEvents: snapshot then live, replay from a seq, snapshot past the replay buffer,
a new epoch per start, several subscribers, load reports, slow subscribers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from svc_harness import (
    BYTE_VOCAB,
    HeldBlocks,
    WorkerSetup,
    read_item,
    read_until,
    running_worker,
    settle,
    subscribe,
    token_request,
)

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.codec import stream_message_from_pb
from kvroute_proto.events import BlockStored, EventBatch, Snapshot
from worker.engine.sim_executor import SimCostModel, SimExecutorConfig
from worker.service.engine_runner import RunnerConfig, SubscriberOverflowError, Subscription


def prompt(k: int, n: int = 12) -> list[int]:
    """n tokens (3 blocks of 4), distinct per k."""
    return [k % 250, *range(1, n)]


async def test_fresh_subscriber_gets_a_snapshot_then_live_batches() -> None:
    async with running_worker() as w:
        call = subscribe(w)
        first = await read_item(call)
        assert isinstance(first, Snapshot)
        assert (first.worker_id, first.seq, first.block_size, first.blocks) == ("w-test", 0, 4, ())
        info = await w.stub.GetLoad(pb.GetLoadRequest())
        assert first.epoch == info.epoch != 0
        await w.generate(token_request(prompt(1), max_new_tokens=4))
        last_seq, truth = await settle(w)
        model = HeldBlocks.of(first)
        items = await read_until(call, model, last_seq)
        assert all(isinstance(i, EventBatch) for i in items)
        assert [i.seq for i in items] == list(range(1, last_seq + 1))
        stored = [ev for i in items for ev in i.events if isinstance(ev, BlockStored)]
        assert stored and stored[0].parent_hash is None
        assert stored[0].token_array[:4].tolist() == prompt(1)[:4]
        assert model.blocks == HeldBlocks.of(truth).blocks
        assert len(model.blocks) >= 3  # the 12-token prompt's three full blocks
        call.cancel()


async def test_reconnect_with_a_recent_seq_replays_the_missed_batches() -> None:
    async with running_worker() as w:
        call = subscribe(w)
        model = HeldBlocks()
        model.apply(await read_item(call))
        await w.generate(token_request(prompt(1), max_new_tokens=3))
        seen, _ = await settle(w)
        await read_until(call, model, seen)
        call.cancel()
        for k in (2, 3):  # missed while disconnected
            await w.generate(token_request(prompt(k), max_new_tokens=3))
        last_seq, truth = await settle(w)
        assert last_seq > seen
        again = subscribe(w, model.epoch, seen)
        items = await read_until(again, model, last_seq)
        assert [i.seq for i in items] == list(range(seen + 1, last_seq + 1))  # no snapshot
        assert model.blocks == HeldBlocks.of(truth).blocks
        again.cancel()


async def test_a_seq_older_than_the_replay_buffer_gets_a_snapshot() -> None:
    async with running_worker(WorkerSetup(replay_buffer_size=2)) as w:
        for k in range(4):
            await w.generate(token_request(prompt(k), max_new_tokens=3))
        last_seq, truth = await settle(w)
        assert last_seq > 3
        epoch = (await w.stub.GetLoad(pb.GetLoadRequest())).epoch
        # Still buffered: replay.
        recent = subscribe(w, epoch, last_seq - 2)
        assert [(await read_item(recent)).seq for _ in range(2)] == [last_seq - 1, last_seq]
        recent.cancel()
        # Too old, another epoch, a seq never produced, or no state at all: a snapshot at
        # last_seq that equals the cache.
        for e, s in ((epoch, last_seq - 3), (epoch + 1, last_seq), (epoch, last_seq + 5), (0, 0)):
            call = subscribe(w, e, s)
            snap = await read_item(call)
            assert isinstance(snap, Snapshot), (e, s)
            assert (snap.epoch, snap.seq) == (epoch, last_seq)
            assert HeldBlocks.of(snap).blocks == HeldBlocks.of(truth).blocks
            call.cancel()


async def test_restart_means_a_new_epoch_and_a_snapshot() -> None:
    async with running_worker() as w:
        call = subscribe(w)
        old = await read_item(call)
        await w.generate(token_request(prompt(1), max_new_tokens=3))
        last_seq, _ = await settle(w)
        await read_until(call, HeldBlocks.of(old), last_seq)
    async with running_worker() as w2:
        call = subscribe(w2, old.epoch, last_seq)
        snap = await read_item(call)
        assert isinstance(snap, Snapshot)
        assert snap.epoch not in (0, old.epoch)
        assert (snap.seq, snap.blocks) == (0, ())
        call.cancel()


async def test_two_subscribers_see_the_same_stream() -> None:
    async with running_worker() as w:
        calls = [subscribe(w, who=f"router-{i}") for i in range(2)]
        models = [HeldBlocks() for _ in calls]
        for call, model in zip(calls, models, strict=True):
            model.apply(await read_item(call))
        await asyncio.gather(
            *(w.generate(token_request(prompt(k), max_new_tokens=2 + k)) for k in range(6))
        )
        last_seq, truth = await settle(w)
        seen = [await read_until(c, m, last_seq) for c, m in zip(calls, models, strict=True)]
        assert seen[0] == seen[1] and len(seen[0]) == last_seq
        assert models[0].blocks == models[1].blocks == HeldBlocks.of(truth).blocks
        for call in calls:
            call.cancel()


async def test_load_reports_ride_the_stream_in_their_own_batches() -> None:
    setup = WorkerSetup(runner=RunnerConfig(load_interval_s=0.02))
    async with running_worker(setup) as w:
        call = subscribe(w)
        model = HeldBlocks()
        model.apply(await read_item(call))
        loads = []
        for _ in range(100):  # bounded: a load batch arrives every 20 ms
            item = await read_item(call)
            model.apply(item)  # seqs follow on: load batches consume seq numbers
            if item.load is not None:
                loads.append(item)
            if len(loads) == 2:
                break
        assert len(loads) == 2 and all(b.events == () for b in loads)
        assert loads[0].load.num_total_kv_tokens == 4096
        assert loads[1].seq > loads[0].seq
        call.cancel()


async def test_a_subscriber_that_stops_reading_does_not_block_generation() -> None:
    setup = WorkerSetup(runner=RunnerConfig(load_interval_s=0, subscriber_queue_size=2))
    async with running_worker(setup) as w:
        stalled = subscribe(w, who="stalled")
        await read_item(stalled)  # the snapshot; then it never reads again
        for k in range(20):
            msgs = await w.generate(token_request(prompt(k), max_new_tokens=2))
            assert msgs[-1].finished.reason == pb.FINISH_REASON_LENGTH
        live = subscribe(w, who="live")
        assert isinstance(await read_item(live), Snapshot)
        stalled.cancel()
        live.cancel()


async def test_subscription_overflow_drops_the_subscriber() -> None:
    sub = Subscription("slow", max_queued=2)
    msgs = [pb.KvStreamMessage(batch=pb.EventBatch(seq=i)) for i in range(1, 4)]
    sub.push(msgs[0])
    sub.push(msgs[1])
    assert await sub.get() is msgs[0]
    sub.push(msgs[2])
    sub.push(msgs[0])  # third queued message: over the limit
    with pytest.raises(SubscriberOverflowError, match="more than 2 messages behind"):
        await sub.get()


async def test_subscription_close_ends_after_what_is_queued() -> None:
    sub = Subscription("s", max_queued=4)
    msg = pb.KvStreamMessage(batch=pb.EventBatch(seq=1))
    waiter = asyncio.ensure_future(sub.get())
    sub.push(msg)
    assert await waiter is msg
    sub.push(msg)
    sub.close()
    assert await sub.get() is msg
    assert await sub.get() is None


async def test_shutdown_ends_event_streams_cleanly() -> None:
    async with running_worker() as w:
        call = subscribe(w)
        await read_item(call)
        await w.server.begin_shutdown()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_a_subscriber_that_joins_during_shutdown_is_refused() -> None:
    # Routers reconnect when their stream ends; a draining worker must not hand them a new
    # live stream (it would only be cancelled once the grace period is over).
    async with running_worker() as w:
        await w.server.begin_shutdown()
        late = subscribe(w, who="late")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await late.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in info.value.details()


async def test_a_subscriber_that_falls_behind_is_dropped_with_resource_exhausted() -> None:
    setup = WorkerSetup(runner=RunnerConfig(load_interval_s=0, subscriber_queue_size=1))
    async with running_worker(setup) as w:
        slow = subscribe(w, who="slow")
        model = HeldBlocks()
        model.apply(await read_item(slow))
        runner = w.server.runner

        def burst() -> None:  # 100 load batches in one engine-thread job: far faster than
            for _ in range(100):  # the handler can write them out
                runner._job_load()

        await runner.call(burst)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):  # a safety net only: the error comes at once
                for _ in range(101):
                    model.apply(stream_message_from_pb(await slow.read()))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 1 messages behind" in info.value.details()
        # What it did get was a gap-free prefix; it resumes from there by replay.
        again = subscribe(w, model.epoch, model.seq)
        await read_until(again, model, 100)
        assert model.seq == 100
        again.cancel()


async def test_step_reports_tell_a_prefill_as_it_starts_and_ends() -> None:
    """RunnerConfig.step_reports: with no periodic reports at all, a request's prefill step
    sends a load-only batch before its KV events that counts the prompt as queued, then one
    with the step's events once the queue it reported has drained; without the setting, the
    same request brings no load batch."""
    tokens = [1 + i % 200 for i in range(2048)]  # one chunk, a drop past the 1,024 floor
    for on in (True, False):
        runner = RunnerConfig(pace_speedup=1.0, load_interval_s=0, step_reports=on)
        sim = SimExecutorConfig(vocab_size=BYTE_VOCAB, max_context_tokens=4096)
        setup = WorkerSetup(sim=sim, cost=SimCostModel(), runner=runner)
        async with running_worker(setup) as w:
            call = subscribe(w)
            model = HeldBlocks()
            model.apply(await read_item(call))
            await w.generate(token_request(tokens, max_new_tokens=4))
            last_seq, _ = await settle(w)
            items = await read_until(call, model, last_seq)
            loads = [i for i in items if i.load is not None]
            if on:
                start, drained = loads[:2]
                assert start.events == () and start.load.num_running == 1
                assert start.load.num_queued_prefill_tokens == len(tokens)
                assert drained.load.num_queued_prefill_tokens == 0
                assert drained.events  # the prefill's stored blocks travel with it
                assert drained.seq == start.seq + 1
            else:
                assert loads == []
            call.cancel()
