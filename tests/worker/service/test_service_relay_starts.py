"""Requests started on the relay stream (decision 0034), against a real in-process sim
worker over gRPC: usage, per-request errors, deadline, cancel (aborted on the engine and
fenced), and the stream's end aborting its requests."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from svc_harness import WorkerSetup, running_worker, token_request

from edge.frontdoor import CallInfo
from kvroute_proto import kvroute_pb2 as pb
from tests.worker.relay_client import RelayClient
from worker.engine.sim_executor import SimCostModel
from worker.service.engine_runner import RequestStream, RunnerConfig
from worker.service.relay import RelayClosedError, RelayOutbox
from worker.service.relay_starts import RelayStarts

WAIT_S = 10.0


def start(rid: str, n: int, timeout_s: float = 0.0, **sampling) -> pb.RelayStart:
    req = token_request(list(range(1, 17)), request_id=rid, max_new_tokens=n, **sampling)
    return pb.RelayStart(request=req, timeout_s=timeout_s)


def paced() -> WorkerSetup:
    """A worker whose steps take real time (the modelled 8B's, ~8 ms a decode step)."""
    setup = WorkerSetup(cost=SimCostModel())
    return dataclasses.replace(setup, runner=RunnerConfig(load_interval_s=0, pace_speedup=1.0))


async def test_started_requests_stream_their_tokens_and_usage_in_shared_batches():
    async with running_worker() as w:
        relay = RelayClient(w.stub, WAIT_S)
        first = await relay.open()
        assert first.accepts_starts and not first.responses
        await relay.call.write(pb.RelayRequest(starts=[start(f"r{i}", 5 + i) for i in range(8)]))
        rids = [f"r{i}" for i in range(8)]
        await relay.read_until(lambda: all(relay.finished(r) for r in rids))
        for i, rid in enumerate(rids):
            tokens = [t for r in relay.responses(rid) for t in r.chunk.token_ids]
            fin = relay.finished(rid)
            assert len(tokens) == fin.usage.completion_tokens == 5 + i
            assert fin.usage.prompt_tokens == 16 and fin.worker_id == "w-test"
            assert relay.ends(rid) == []  # a Finished is the whole answer
        assert len(relay.batches) < sum(5 + i for i in range(8))  # requests share batches
        await w.assert_no_leak()
        relay.call.cancel()


@pytest.mark.parametrize(
    ("the_start", "message"),
    [
        (start("r1", 4, temperature=-1.0), "temperature"),
        (start("r1", 4, timeout_s=-1.0), "timeout_s must be a finite number >= 0"),
        (start("r1", 4, timeout_s=float("nan")), "timeout_s must be a finite number >= 0"),
        (start("", 4), "request_id must be set"),
    ],
)
async def test_a_bad_start_ends_with_invalid_argument_naming_the_field(the_start, message):
    async with running_worker() as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        rid = the_start.request.request_id
        await relay.call.write(pb.RelayRequest(starts=[the_start, start("ok", 3)]))
        await relay.read_until(lambda: relay.ends(rid) and relay.finished("ok"))
        (end,) = relay.ends(rid)
        assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert message in end.details
        assert relay.finished("ok").usage.completion_tokens == 3  # the stream goes on
        await w.assert_no_leak()
        relay.call.cancel()


async def test_a_second_start_of_a_running_id_is_refused_and_the_first_goes_on():
    async with running_worker(paced()) as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 20), start("r1", 3)]))
        await relay.read_until(lambda: relay.ends("r1") and relay.finished("r1"))
        (end,) = relay.ends("r1")
        assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "'r1' is already in flight here" in end.details
        assert relay.finished("r1").usage.completion_tokens == 20
        relay.call.cancel()


async def test_a_start_past_its_deadline_ends_deadline_exceeded_and_is_aborted():
    async with running_worker(paced()) as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 400, timeout_s=0.1)]))
        await relay.read_until(lambda: relay.ends("r1"))
        (end,) = relay.ends("r1")
        assert end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert relay.responses("r1")  # it had started streaming
        assert relay.finished("r1") is None
        await w.assert_no_leak()
        assert (await w.stats()).num_aborted == 1
        relay.call.cancel()


async def test_a_cancel_aborts_the_request_and_nothing_of_it_follows_the_ack():
    async with running_worker(paced()) as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 400)]))
        await relay.read_until(lambda: relay.responses("r1"))
        # the same id started again right after its cancel: a new request
        await relay.call.write(pb.RelayRequest(cancels=["r1"], starts=[start("r1", 4)]))
        await relay.read_until(lambda: relay.finished("r1"))
        acked = next(i for i, b in enumerate(relay.batches) if "r1" in b.cancelled)
        after = [t for b in relay.batches[acked:] for r in b.responses for t in r.chunk.token_ids]
        assert len(after) == relay.finished("r1").usage.completion_tokens == 4
        await w.assert_no_leak()
        assert (await w.stats()).num_aborted == 1
        # a cancel of an id not running is acknowledged too (it may have just ended)
        await relay.call.write(pb.RelayRequest(cancels=["gone"]))
        await relay.read_until(lambda: "gone" in relay.batches[-1].cancelled)
        relay.call.cancel()


async def test_the_streams_end_aborts_its_requests():
    async with running_worker(paced()) as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 400), start("r2", 400)]))
        await relay.read_until(lambda: relay.responses("r1") and relay.responses("r2"))
        relay.call.cancel()  # the router went away
        await w.assert_no_leak()
        assert (await w.stats()).num_aborted == 2
        assert w.server.servicer.relays.outboxes == []


async def test_a_draining_worker_ends_new_starts_unavailable():
    async with running_worker() as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        w.server.servicer.refuse_new_requests()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 4)]))
        await relay.read_until(lambda: relay.ends("r1"))
        (end,) = relay.ends("r1")
        assert end.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "shutting down" in end.details
        relay.call.cancel()


async def test_started_requests_are_made_in_the_engine_dispatch_not_read_by_their_task(
    monkeypatch,
) -> None:
    """A started request's outputs reach the outbox through the stream's sink (decision
    0049): its task never reads the stream, whatever the number of steps."""

    async def no_reading(self) -> None:
        raise AssertionError("a started request's task read its stream")

    monkeypatch.setattr(RequestStream, "get", no_reading)
    async with running_worker(WorkerSetup()) as w:
        relay = RelayClient(w.stub, WAIT_S)
        await relay.open()
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 30), start("r2", 1)]))
        await relay.read_until(lambda: relay.finished("r1") and relay.finished("r2"))
        tokens = [t for r in relay.responses("r1") for t in r.chunk.token_ids]
        assert len(tokens) == relay.finished("r1").usage.completion_tokens == 30
        assert relay.ends("r1") == relay.ends("r2") == []
        relay.call.cancel()
        await w.assert_no_leak()


async def test_a_put_that_fails_ends_the_request_and_frees_its_slots() -> None:
    """``generate_into``: when handing a message over fails (the outbox closed under it),
    the request's task raises that error and the engine releases the request."""
    async with running_worker(WorkerSetup()) as w:
        got: list[pb.GenerateResponse] = []

        def put(message: pb.GenerateResponse) -> None:
            if len(got) == 3:
                raise RelayClosedError("relay stream 's1' has ended")
            got.append(message)

        request = token_request(list(range(1, 17)), request_id="r1", max_new_tokens=400)
        with pytest.raises(RelayClosedError):
            await w.server.generation.generate_into(request, CallInfo((), None), put)
        assert len(got) == 3 and not any(m.HasField("finished") for m in got)
        await w.assert_no_leak()
        assert w.server.generation.num_generating == 0


async def test_what_the_dispatch_puts_after_a_cancel_is_dropped() -> None:
    """With a handler that puts messages itself (the engine's dispatch does, decision 0049),
    a cancel closes the request's way to the outbox at once: a message made before its task
    sees the cancellation never follows the cancel's acknowledgement."""
    outbox = RelayOutbox("s1")
    puts: list = []

    async def into(request, context, put) -> None:
        puts.append(put)
        await asyncio.Event().wait()  # until cancelled

    async def no_handler(request, context):  # the iterator path, unused here
        raise AssertionError("not called")
        yield

    starts = RelayStarts(outbox, no_handler, into)
    starts.take(pb.RelayRequest(starts=[start("r1", 8)]))
    await asyncio.sleep(0)  # the start's task runs up to its wait
    (put,) = puts
    chunk = pb.GenerateResponse(request_id="r1", chunk=pb.TokenChunk(token_ids=[7]))
    put(chunk)
    assert [r.request_id for r in outbox.take().responses] == ["r1"]
    starts.take(pb.RelayRequest(cancels=["r1"]))
    put(chunk)  # the engine dispatched once more before the task was cancelled
    batch = outbox.take()
    assert list(batch.cancelled) == ["r1"] and not batch.responses
    await asyncio.sleep(0)
    assert starts.num_running == 0
    starts.close()
