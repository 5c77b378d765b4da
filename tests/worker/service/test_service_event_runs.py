"""SubscribeKvEvents with ``accepts_runs`` (decision 0056): what queued while the subscriber's
last message was unread comes as one EventBatchRun, gap-free, a snapshot always alone; a
subscriber that did not ask gets one batch per message."""

from __future__ import annotations

import asyncio

import grpc
from svc_harness import HeldBlocks, Worker, WorkerSetup, running_worker, token_request

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.codec import decode_stream_message, stream_parts
from kvroute_proto.events import EventBatch, Snapshot
from worker.service.engine_runner import RUN_MAX_BATCHES, RunnerConfig, Subscription

# the router's own event channel: a 1 KiB stream window, so the worker's writes wait for it
ROUTER_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
BURST = 600  # load batches, more than two runs' worth


async def _burst(w: Worker, n: int) -> None:
    runner = w.server.runner

    def job() -> None:  # n batches in one engine-thread job: faster than any stream reads
        for _ in range(n):
            runner._job_load()

    await runner.call(job)


async def _read_to(call, model: HeldBlocks, seq: int) -> list[pb.KvStreamMessage]:
    """Stream messages until ``model`` reaches ``seq`` (each part applied in order)."""
    messages = []
    async with asyncio.timeout(20):  # a safety net: they are all queued already
        while model.seq < seq:
            msg = await call.read()
            assert msg is not grpc.aio.EOF
            messages.append(msg)
            for part in stream_parts(msg.SerializeToString()):
                item = decode_stream_message(part)
                assert isinstance(item, EventBatch) and item.seq == model.seq + 1  # no gap
                model.apply(item)
    return messages


async def test_batches_queued_behind_an_unread_message_come_as_runs() -> None:
    setup = WorkerSetup(runner=RunnerConfig(load_interval_s=0, subscriber_queue_size=4096))
    async with (
        running_worker(setup) as w,
        grpc.aio.insecure_channel(f"127.0.0.1:{w.server.port}", options=ROUTER_WINDOW) as ch,
    ):
        call = pb_grpc.WorkerStub(ch).SubscribeKvEvents(
            pb.SubscribeRequest(subscriber_id="router", accepts_runs=True)
        )
        first = decode_stream_message((await call.read()).SerializeToString())
        assert isinstance(first, Snapshot)
        model = HeldBlocks.of(first)
        await _burst(w, BURST)
        messages = await _read_to(call, model, BURST)
        assert "run" in [m.WhichOneof("kind") for m in messages]
        assert len(messages) < BURST / 4
        assert max(len(m.run.batches) for m in messages) == RUN_MAX_BATCHES
        # and the live stream goes on after the runs, gap-free
        await w.generate(token_request([5, 1, 2, 3, 4, 5, 6, 7], max_new_tokens=2))
        await w.server.runner.wait_until_idle()
        await _read_to(call, model, w.server.runner.publisher.last_seq)
        call.cancel()


async def test_a_subscriber_that_did_not_ask_gets_one_batch_a_message() -> None:
    setup = WorkerSetup(runner=RunnerConfig(load_interval_s=0, subscriber_queue_size=4096))
    async with running_worker(setup) as w:
        call = w.stub.SubscribeKvEvents(pb.SubscribeRequest(subscriber_id="old-router"))
        model = HeldBlocks.of(decode_stream_message((await call.read()).SerializeToString()))
        await _burst(w, 200)
        messages = await _read_to(call, model, 200)
        assert [m.WhichOneof("kind") for m in messages] == ["batch"] * 200
        call.cancel()


def _batch(seq: int) -> pb.KvStreamMessage:
    return pb.KvStreamMessage(batch=pb.EventBatch(worker_id="w", epoch=1, seq=seq))


async def test_runs_keep_a_snapshot_alone_and_hold_at_most_the_limit() -> None:
    sub = Subscription("s", max_queued=16)
    snapshot = pb.KvStreamMessage(snapshot=pb.Snapshot(worker_id="w", epoch=1, seq=0))
    sub.initial = [snapshot, _batch(1), _batch(2), _batch(3)]  # a snapshot, then replay
    runs = sub.runs(limit=2)
    seqs = []
    for _ in range(3):
        seqs.append([(m.WhichOneof("kind"), m.batch.seq) for m in await anext(runs)])
    assert seqs == [[("snapshot", 0)], [("batch", 1), ("batch", 2)], [("batch", 3)]]
    for seq in (4, 5, 6):
        sub.push(_batch(seq))
    assert [m.batch.seq for m in await anext(runs)] == [4, 5]
    assert [m.batch.seq for m in await anext(runs)] == [6]
    waiting = asyncio.ensure_future(anext(runs))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing queued: it waits for the next push
    sub.push(_batch(7))
    assert [m.batch.seq for m in await waiting] == [7]
    sub.close()
    assert [r async for r in runs] == []
