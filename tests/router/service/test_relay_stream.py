"""The worker's relay stream under the router (decisions 0033, 0034): real in-process sim
workers, every request started and its tokens streamed on one stream per worker, and the
request path's rules kept: usage, abort on a client's cancel, a broken relay stream failing
its requests (then reopened), a worker without the stream (or one of 0033, which takes no
starts) served a call per request; a cancelled id is fenced until the worker acknowledges."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_fake_worker import FakeWorker, running_fake
from router_harness import WAIT_S, running_router, sim_worker

from kvroute_proto import kvroute_pb2 as pb
from router.cli.client import GenerateOptions
from router.service.relay_mux import ENDED, RelayMux

PROMPT = list(range(1, 33))


async def relay_ready(router, n: int = 1) -> list:
    conns = list(router.server.pool.conns.values())
    await router.wait_for(lambda: sum(c.relay.ready for c in conns) == n)
    return conns


async def worker_idle(router, worker) -> None:
    async with asyncio.timeout(WAIT_S):
        while worker.server.runner.num_in_flight or router.server.frontend.num_inflight:
            await asyncio.sleep(0.01)


async def test_concurrent_requests_share_one_relay_stream_with_exact_usage():
    async with sim_worker("w0") as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        (conn,) = await relay_ready(router)
        (outbox,) = w0.server.servicer.relays.outboxes
        opts = [GenerateOptions(request_id=f"r{i}", max_new_tokens=20 + i) for i in range(16)]
        results = await asyncio.gather(*(router.client.generate(PROMPT, o) for o in opts))
        for i, r in enumerate(results):
            assert r.request_id == f"r{i}"
            assert len(r.token_ids) == r.completion_tokens == 20 + i
            assert r.prompt_tokens == len(PROMPT) and r.worker_id == "w0"
        # 16 requests, 20-35 tokens each, one engine step advancing all of them: far fewer
        # relay batches than chunks, and every one of them read by the router
        assert conn.relay.num_batches == outbox.num_batches
        assert conn.relay.num_started == 16  # no Generate call of their own
        assert 1 < conn.relay.num_batches < sum(r.completion_tokens for r in results) / 4
        assert router.server.frontend.num_inflight == 0


async def test_client_cancel_aborts_the_request_on_the_worker():
    async with sim_worker("w0", pace_speedup=1.0) as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        await relay_ready(router)
        stream = router.client.stream(PROMPT, GenerateOptions(max_new_tokens=500))
        first = await anext(stream)
        assert first.chunk.token_ids
        assert w0.server.runner.num_in_flight == 1
        await stream.aclose()  # the client goes away mid-stream
        await worker_idle(router, w0)
        stats = await w0.server.runner.call(w0.server.engine.stats)
        assert stats.num_aborted == 1


async def test_a_broken_relay_stream_fails_its_requests_and_is_reopened():
    async with sim_worker("w0", pace_speedup=1.0) as w0, running_router([w0.address]) as router:
        await router.wait_synced(1)
        (conn,) = await relay_ready(router)
        first_stream = conn.relay.stream_id
        relays = w0.server.servicer.relays
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for msg in router.client.stream(PROMPT, GenerateOptions(max_new_tokens=500)):
                received.append(msg)
                if len(received) == 1:
                    relays.close(relays.outboxes[0])  # the worker ends the stream
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "after the response had started" in err.value.details()
        assert "relay stream" in err.value.details()
        await worker_idle(router, w0)
        await router.wait_for(lambda: conn.relay.ready and conn.relay.stream_id != first_stream)
        r = await router.client.generate(PROMPT, GenerateOptions(max_new_tokens=4))
        assert r.completion_tokens == len(r.token_ids) == 4


async def test_a_worker_without_the_relay_stream_gets_a_stream_per_request():
    fake = FakeWorker("w0", relay=False)
    async with running_fake(fake) as rf, running_router([rf.address]) as router:
        await router.wait_synced(1)
        (conn,) = router.server.pool.conns.values()
        r = await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
        assert (r.token_ids, r.completion_tokens) == ((1, 2, 3), 3)
        assert not conn.relay.ready and conn.relay.num_batches == 0
        assert "kvroute-relay-stream" not in fake.received[0].metadata


async def test_a_worker_that_takes_no_starts_gets_a_call_per_request():
    fake = FakeWorker("w0", relay=True, starts=False)  # a worker of decision 0033
    async with running_fake(fake) as rf, running_router([rf.address]) as router:
        await router.wait_synced(1)
        (conn,) = router.server.pool.conns.values()
        async with asyncio.timeout(WAIT_S):
            while fake.num_relays == 0:  # the router asked for the relay stream
                await asyncio.sleep(0.01)
        r = await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
        assert (r.token_ids, r.completion_tokens) == ((1, 2, 3), 3)
        assert not conn.relay.ready and conn.relay.num_started == 0
        assert "kvroute-relay-stream" not in fake.received[0].metadata


def chunk(rid: str, token: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(token_ids=[token]))


async def test_a_cancelled_id_started_again_gets_nothing_of_the_cancelled_request():
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        mux = RelayMux(channel, "test")
        request = pb.GenerateRequest(request_id="r1")
        old = mux.start(request, 30.0, (), request.ByteSize())
        mux._out.clear()  # as if written
        assert old.cancel()
        assert list(mux._out[-1].cancels) == ["r1"]
        new = mux.start(request, 30.0, (), request.ByteSize())
        mux._take(pb.RelayBatch(responses=[chunk("r1", 7)]))  # the old one's, in flight
        mux._take(pb.RelayBatch(ends=[pb.RelayEnd(request_id="r1", code=1)]))
        assert new.inbox.items == [] and old.inbox.items == []
        mux._take(pb.RelayBatch(cancelled=["r1"], responses=[chunk("r1", 8)]))
        mux._take(pb.RelayBatch(ends=[pb.RelayEnd(request_id="r1")]))
        assert new.inbox.items == [chunk("r1", 8), ENDED]
        # a start cancelled before it was written is dropped: no cancel, no fence
        third = mux.start(pb.GenerateRequest(request_id="r2"), 30.0, (), 2)
        assert third.cancel()
        assert [list(m.starts) for m in mux._out] == [[new_start(mux)]]
        assert "r2" not in mux._fenced
        new.cancel()  # not written yet either
        old.cancel()  # cancelled already: nothing sent twice
        assert [list(m.starts) for m in mux._out] == [[]] and mux._fenced == {}


def new_start(mux: RelayMux) -> pb.RelayStart:
    return mux._out[-1].starts[0]


async def test_a_request_too_large_for_the_stream_gets_a_call_of_its_own(monkeypatch):
    import router.service.worker_conn as worker_conn

    fake = FakeWorker("w0", relay=True)
    async with running_fake(fake) as rf, running_router([rf.address]) as router:
        await router.wait_synced(1)
        (conn,) = await relay_ready(router)
        monkeypatch.setattr(worker_conn, "MAX_START_BYTES", len(PROMPT))  # PROMPT is larger
        r = await router.client.generate(PROMPT, GenerateOptions(request_id="big"))
        assert (r.token_ids, r.completion_tokens) == ((1, 2, 3), 3)
        assert conn.relay.ready and conn.relay.num_started == 0
        monkeypatch.setattr(worker_conn, "MAX_START_BYTES", 1 << 20)
        r = await router.client.generate(PROMPT, GenerateOptions(request_id="small"))
        assert r.completion_tokens == 3 and conn.relay.num_started == 1
