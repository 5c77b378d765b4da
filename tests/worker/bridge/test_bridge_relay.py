"""The bridge's relay stream (decisions 0033, 0034, 0038): requests started on it, and
Generate calls attached to it, forwarded to a fake engine over HTTP; a real bridge on
127.0.0.1 port 0. Tokens and the engine's usage come back in the stream's batches; a
cancel, a deadline or the stream's end closes the engine's HTTP stream; errors become a
RelayEnd with the status Generate would have ended with; nothing stays behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli.client import GenerateOptions
from tests.router.service.router_harness import WAIT_S
from tests.worker.bridge.test_bridge_service import (
    engine_and_bridge,
    prompt,
    router_over,
    wait_until,
)
from tests.worker.relay_client import RelayClient
from worker.bridge.service.server import BridgeServer
from worker.service.relay import RELAY_BATCH_KEY, RELAY_METADATA_KEY


def start(rid: str, n: int, *, seed: int = 1, timeout_s: float = 0.0) -> pb.RelayStart:
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=prompt(seed)),
        sampling=pb.SamplingParams(max_new_tokens=n),
    )
    return pb.RelayStart(request=req, timeout_s=timeout_s)


@contextlib.asynccontextmanager
async def relay_on_bridge(**engine_options: Any) -> AsyncIterator[Any]:
    """A fake engine, its bridge on 127.0.0.1, and a router's side of a relay stream to it,
    opened: (bridge, relay, engine, the stream's first batch)."""
    async with (
        engine_and_bridge("b0", **engine_options) as (engine, bridge),
        grpc.aio.insecure_channel(bridge.address) as ch,
    ):
        relay = RelayClient(pb_grpc.WorkerStub(ch), WAIT_S)
        first = await relay.open()
        yield bridge, relay, engine, first


def start_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("relay-start-")]


async def nothing_left(bridge: BridgeServer) -> None:
    """No forwarded request, no start task, no open stream once the streams ended."""
    await wait_until(lambda: not bridge.servicer.inflight and not start_tasks())


async def test_started_requests_come_back_with_the_engines_tokens_and_usage():
    async with relay_on_bridge() as (bridge, relay, engine, first):
        assert first.accepts_starts and not first.responses
        engine.done_to_end_s = 0.02  # the body's end comes a little after [DONE]
        starts = [start(f"r{i}", 2 + i, seed=i) for i in range(4)]
        for s in starts:  # one at a time
            await relay.call.write(pb.RelayRequest(starts=[s]))
            await relay.read_until(lambda s=s: relay.finished(s.request.request_id))
        for i in range(4):
            p = prompt(i)
            assert relay.tokens(f"r{i}") == [p[-1] + k + 1 for k in range(2 + i)]
            fin = relay.finished(f"r{i}")
            assert fin.reason == pb.FINISH_REASON_LENGTH and fin.worker_id == "b0"
            assert fin.usage.prompt_tokens == 96 and fin.usage.completion_tokens == 2 + i
            assert relay.ends(f"r{i}") == []  # a Finished is the whole answer
        assert [b["max_tokens"] for b in engine.bodies] == [2, 3, 4, 5]
        # the same prompt again: the engine's cached_tokens passed on
        await relay.call.write(pb.RelayRequest(starts=[start("again", 1, seed=0)]))
        await relay.read_until(lambda: relay.finished("again"))
        assert relay.finished("again").usage.cached_prompt_tokens == 96
        assert bridge.servicer.num_requests == 5
        # one request at a time: each took the connection the one before handed back
        assert len(engine.peers) == 5 and len(set(engine.peers)) == 1
        await nothing_left(bridge)
        relay.call.cancel()
        await wait_until(lambda: not bridge.servicer.relays.outboxes)


async def test_a_router_starts_its_requests_on_the_bridges_relay_stream():
    async with engine_and_bridge("b0") as (engine, bridge), router_over(bridge) as r:
        (conn,) = r.server.pool.conns.values()
        await r.wait_for(lambda: conn.relay.ready)
        opts = [GenerateOptions(request_id=f"q{i}", max_new_tokens=3) for i in range(3)]
        results = await asyncio.gather(
            *(r.client.generate(prompt(10 + i), o) for i, o in enumerate(opts))
        )
        for i, result in enumerate(results):
            assert result.token_ids == tuple(prompt(10 + i)[-1] + k for k in (1, 2, 3))
            assert result.worker_id == "b0" and result.prompt_tokens == 96
        assert conn.relay.num_started == 3  # no Generate call of their own
        (outbox,) = bridge.servicer.relays.outboxes
        assert outbox.num_batches > 1 and engine.completions == 3
        await nothing_left(bridge)


async def test_a_cancel_closes_the_engine_stream_and_nothing_of_it_follows_the_ack():
    async with relay_on_bridge(token_delay_s=0.05) as (bridge, relay, engine, _):
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 500), start("r2", 3, seed=2)]))
        await relay.read_until(lambda: relay.tokens("r1"))
        await relay.call.write(pb.RelayRequest(cancels=["r1"]))
        await relay.read_until(lambda: any("r1" in b.cancelled for b in relay.batches))
        acked = next(i for i, b in enumerate(relay.batches) if "r1" in b.cancelled)
        await wait_until(lambda: engine.disconnects == 1)
        await relay.read_until(lambda: relay.finished("r2"))
        assert all(r.request_id != "r1" for b in relay.batches[acked:] for r in b.responses)
        assert relay.finished("r1") is None and relay.ends("r1") == []
        assert len(relay.tokens("r1")) < 500
        assert relay.finished("r2").usage.completion_tokens == 3  # the stream goes on
        await nothing_left(bridge)
        relay.call.cancel()


async def test_the_streams_end_aborts_its_requests_on_the_engine():
    async with relay_on_bridge(token_delay_s=0.05) as (bridge, relay, engine, _):
        await relay.call.write(
            pb.RelayRequest(starts=[start(f"r{i}", 500, seed=i) for i in (1, 2)])
        )
        await relay.read_until(lambda: relay.tokens("r1") and relay.tokens("r2"))
        relay.call.cancel()
        await wait_until(lambda: engine.disconnects == 2)
        await nothing_left(bridge)
        await wait_until(lambda: not bridge.servicer.relays.outboxes)


async def test_a_start_past_its_deadline_ends_deadline_exceeded_and_is_aborted():
    async with relay_on_bridge(token_delay_s=0.05) as (bridge, relay, engine, _):
        await relay.call.write(pb.RelayRequest(starts=[start("r1", 500, timeout_s=0.3)]))
        await relay.read_until(lambda: relay.ends("r1"))
        (end,) = relay.ends("r1")
        assert end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert relay.tokens("r1") and relay.finished("r1") is None
        await wait_until(lambda: engine.disconnects == 1)
        await nothing_left(bridge)
        relay.call.cancel()


async def test_requests_the_bridge_cannot_forward_end_with_the_status_naming_why():
    async with relay_on_bridge() as (bridge, relay, _engine, _):
        text = pb.RelayStart(request=pb.GenerateRequest(request_id="t", prompt_text="hi"))
        twice = [start("d", 3), start("d", 3)]
        await relay.call.write(pb.RelayRequest(starts=[text, *twice, start("ok", 2, seed=3)]))
        await relay.read_until(lambda: relay.ends("t") and relay.ends("d") and relay.finished("ok"))
        (end,) = relay.ends("t")
        assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "send prompt_token_ids" in end.details
        (end,) = relay.ends("d")  # the second start of a running id; the first goes on
        assert end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "'d' is already in flight here" in end.details
        await relay.read_until(lambda: relay.finished("d"))
        assert relay.finished("d").usage.completion_tokens == 3
        await nothing_left(bridge)
        relay.call.cancel()


async def test_engine_failures_end_the_request_with_its_status_after_its_tokens():
    async with relay_on_bridge() as (bridge, relay, engine, _):
        engine.cut_after = 2  # the stream ends after 2 tokens, without a finish reason
        await relay.call.write(pb.RelayRequest(starts=[start("cut", 10)]))
        await relay.read_until(lambda: relay.ends("cut"))
        (end,) = relay.ends("cut")
        assert end.code == grpc.StatusCode.UNAVAILABLE.value[0]  # the router may retry
        assert "without a finish reason" in end.details
        assert len(relay.tokens("cut")) == 2 and relay.finished("cut") is None
        engine.cut_after = 0
        for status, code in (
            (400, grpc.StatusCode.INVALID_ARGUMENT),
            (503, grpc.StatusCode.UNAVAILABLE),
        ):
            engine.fail_status = status
            rid = f"refused-{status}"
            await relay.call.write(pb.RelayRequest(starts=[start(rid, 3)]))
            await relay.read_until(lambda rid=rid: relay.ends(rid))
            (end,) = relay.ends(rid)
            assert end.code == code.value[0]
            assert f"({status})" in end.details and not relay.responses(rid)
        assert bridge.servicer.num_engine_errors == 2  # the cut stream and the 503
        await nothing_left(bridge)
        relay.call.cancel()


async def test_a_draining_bridge_ends_new_starts_unavailable():
    async with relay_on_bridge() as (bridge, relay, _engine, _):
        bridge.servicer.draining = True
        await relay.call.write(pb.RelayRequest(starts=[start("late", 3)]))
        await relay.read_until(lambda: relay.ends("late"))
        (end,) = relay.ends("late")
        assert end.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "shutting down" in end.details
        relay.call.cancel()


async def test_a_generate_call_attached_to_the_stream_sends_its_messages_there():
    async with (
        engine_and_bridge("b0") as (_engine, bridge),
        grpc.aio.insecure_channel(bridge.address) as ch,
    ):
        relay = RelayClient(pb_grpc.WorkerStub(ch), WAIT_S)
        await relay.open("s-attached")
        req = start("a1", 3).request
        call = pb_grpc.WorkerStub(ch).Generate(req, metadata=((RELAY_METADATA_KEY, "s-attached"),))
        assert [m async for m in call] == []  # its messages went on the relay stream
        await relay.read_until(lambda: relay.finished("a1"))
        assert len(relay.tokens("a1")) == 3
        trailing = dict(await call.trailing_metadata())
        assert int(trailing[RELAY_BATCH_KEY]) <= 1 + len(relay.batches)
        gone = pb_grpc.WorkerStub(ch).Generate(req, metadata=((RELAY_METADATA_KEY, "nope"),))
        try:
            async for _ in gone:
                raise AssertionError("a call naming no open stream streams nothing")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "'nope' is not open" in (exc.details() or "")
        await nothing_left(bridge)
        relay.call.cancel()
