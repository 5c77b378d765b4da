"""The worker's relay streams (decision 0033): the outbox's batches and merging, exactly,
and the Worker service's Relay / attached Generate over a real in-process sim worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from svc_harness import running_worker, token_request

from kvroute_proto import kvroute_pb2 as pb
from worker.service.relay import (
    RELAY_BATCH_KEY,
    RELAY_METADATA_KEY,
    RelayClosedError,
    RelayOutbox,
    RelayRegistry,
)


def chunk(rid: str, ids: list[int], text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(token_ids=ids, text=text))


def finished(rid: str, n: int) -> pb.GenerateResponse:
    usage = pb.Usage(completion_tokens=n)
    return pb.GenerateResponse(request_id=rid, finished=pb.Finished(usage=usage))


async def test_a_batch_holds_each_request_once_its_chunks_merged_in_order():
    outbox = RelayOutbox("s")
    outbox.put(chunk("a", [1], "x"))
    outbox.put(chunk("b", [7], "q"))
    outbox.put(chunk("a", [2, 3], "yz"))
    outbox.put(finished("a", 3))
    batch = outbox.take()
    got = [(r.request_id, r.WhichOneof("kind")) for r in batch.responses]
    assert got == [("a", "chunk"), ("a", "finished"), ("b", "chunk")]
    assert list(batch.responses[0].chunk.token_ids) == [1, 2, 3]
    assert batch.responses[0].chunk.text == "xyz"
    assert batch.responses[1].finished.usage.completion_tokens == 3
    assert len(outbox.take().responses) == 0


async def test_a_closed_outbox_refuses_puts_and_ends_its_batches():
    registry = RelayRegistry()
    outbox = registry.open("s")
    batches = outbox.batches()
    assert len((await anext(batches)).responses) == 0  # registered
    assert registry.find(((RELAY_METADATA_KEY, "s"),)) is outbox
    registry.close(outbox)
    with pytest.raises(StopAsyncIteration):
        await anext(batches)
    with pytest.raises(RelayClosedError, match="'s' has ended"):
        outbox.put(chunk("a", [1], ""))
    with pytest.raises(RelayClosedError, match="'s' is not open"):
        registry.find(((RELAY_METADATA_KEY, "s"),))
    assert registry.find((("other", "s"),)) is None


@pytest.mark.parametrize(
    ("stream_id", "message"), [("", "1 to 128 characters, got 0"), ("x" * 129, "got 129")]
)
async def test_bad_stream_ids_are_refused(stream_id, message):
    with pytest.raises(ValueError, match=message):
        RelayRegistry().open(stream_id)
    registry = RelayRegistry()
    registry.open("s")
    with pytest.raises(ValueError, match="already open"):
        registry.open("s")


def request(rid: str, n: int) -> pb.GenerateRequest:
    return token_request(list(range(1, 17)), request_id=rid, max_new_tokens=n, ignore_eos=True)


def open_0033(channel: grpc.aio.Channel, stream_id: str):
    """Relay as a router of decision 0033 calls it: one RelayRequest, then only reading."""
    relay = channel.unary_stream(
        "/kvroute.v1.Worker/Relay",
        request_serializer=pb.RelayRequest.SerializeToString,
        response_deserializer=pb.RelayBatch.FromString,
    )
    return relay(pb.RelayRequest(stream_id=stream_id))


async def test_an_attached_call_sends_its_messages_on_the_relay_stream():
    """A router of decision 0033 (Relay called with one message, requests by Generate
    calls attached by metadata) is served as before."""
    async with running_worker() as w:
        stub = w.stub
        relay = open_0033(w.channel, "s1")
        batches = relay.__aiter__()
        first = await anext(batches)
        assert len(first.responses) == 0 and first.accepts_starts
        call = stub.Generate(request("r1", 9), metadata=((RELAY_METADATA_KEY, "s1"),))
        assert [m async for m in call] == []  # nothing on the call's own stream
        sent = dict(await call.trailing_metadata())[RELAY_BATCH_KEY]
        tokens, fin, number = [], None, 1
        while fin is None:
            batch = await anext(batches)
            number += 1
            for r in batch.responses:
                assert r.request_id == "r1"
                if r.HasField("finished"):
                    fin = r.finished
                else:
                    tokens.extend(r.chunk.token_ids)
        assert len(tokens) == fin.usage.completion_tokens == 9
        assert int(sent) == number  # the batch by which all its messages were sent
        await w.assert_no_leak()
        relay.cancel()
        async with asyncio.timeout(5):
            while w.server.servicer.relays.outboxes:
                await asyncio.sleep(0.01)


async def test_relay_and_generate_errors_name_the_stream():
    async with running_worker() as w:
        stub = w.stub
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anext(stub.Relay(iter([pb.RelayRequest(stream_id="")])).__aiter__())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stream_id must be 1 to 128 characters" in err.value.details()
        call = stub.Generate(request("r1", 2), metadata=((RELAY_METADATA_KEY, "gone"),))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anext(call.__aiter__())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "relay stream 'gone' is not open" in err.value.details()
