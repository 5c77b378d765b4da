"""Bad input gets INVALID_ARGUMENT naming the field and the limit; overload gets
RESOURCE_EXHAUSTED; nothing leaks either way."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from svc_harness import MAX_CONTEXT, WorkerSetup, running_worker, text_request, token_request

from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from worker.engine.engine import EngineConfig
from worker.engine.sim_executor import SimCostModel
from worker.service.engine_runner import RunnerConfig


async def expect_status(call: grpc.aio.UnaryStreamCall) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value.code(), info.value.details()


BAD_REQUESTS = [
    pytest.param(pb.GenerateRequest(request_id="x"), ["prompt", "neither"], id="prompt-unset"),
    pytest.param(token_request([]), ["prompt", "at least 1"], id="empty-token-prompt"),
    pytest.param(text_request(""), ["prompt", "at least 1"], id="empty-text-prompt"),
    pytest.param(token_request([1, 260]), ["prompt_token_ids", "260", "[0, 260)"], id="vocab"),
    pytest.param(
        token_request([1] * 500, max_new_tokens=20),
        ["max_new_tokens", "500", f"max_context_tokens={MAX_CONTEXT}"],
        id="context",
    ),
    pytest.param(token_request([1], temperature=-1.0), ["temperature", "-1"], id="temperature"),
    pytest.param(
        token_request([1], temperature=float("nan")), ["temperature", "finite"], id="temp-nan"
    ),
    pytest.param(token_request([1], top_p=1.5), ["top_p", "[0, 1]"], id="top-p"),
    pytest.param(
        token_request([1], stop_token_ids=[999]), ["stop_token_ids", "999"], id="stop-token"
    ),
    pytest.param(text_request("x" * 101), ["prompt_text", "at most 100", "101"], id="text-long"),
    pytest.param(
        token_request([1], request_id="r" * 300), ["request_id", "at most 256"], id="id-long"
    ),
]


async def test_every_bad_input_is_invalid_argument_naming_field_and_limit() -> None:
    setup = WorkerSetup(limits=RequestLimits(max_prompt_text_chars=100))
    async with running_worker(setup) as w:
        for param in BAD_REQUESTS:
            request, needles = param.values
            code, details = await expect_status(w.stub.Generate(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, param.id
            for needle in needles:
                assert needle in details, (param.id, details)
        await w.assert_no_leak()
        assert (await w.stats()).num_requests == 0


async def test_text_prompt_without_tokenizer_is_invalid_argument() -> None:
    async with running_worker(WorkerSetup(tokenizer=False)) as w:
        code, details = await expect_status(w.stub.Generate(text_request("hi")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_text" in details and "prompt_token_ids" in details
        ok = await w.generate(token_request([1, 2], max_new_tokens=2))
        assert ok[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert all(m.chunk.text == "" for m in ok[:-1])


PACED_ONE_AT_A_TIME = WorkerSetup(
    engine=EngineConfig(
        worker_id="w-test",
        num_kv_slots=4096,
        block_size=4,
        max_running_requests=1,
        max_waiting_requests=1,
    ),
    cost=SimCostModel(),
    runner=RunnerConfig(pace_speedup=1.0, load_interval_s=0),
)


async def test_duplicate_in_flight_request_id_is_invalid_argument() -> None:
    async with running_worker(PACED_ONE_AT_A_TIME) as w:
        first = w.stub.Generate(token_request([1, 2, 3], request_id="dup", max_new_tokens=400))
        assert (await first.read()).WhichOneof("kind") == "chunk"
        code, details = await expect_status(w.stub.Generate(token_request([4], request_id="dup")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in details and "'dup'" in details and "in flight" in details
        # The original keeps running until it is cancelled.
        assert (await first.read()).WhichOneof("kind") == "chunk"
        first.cancel()
        await w.assert_no_leak()


async def test_full_waiting_queue_is_resource_exhausted() -> None:
    async with running_worker(PACED_ONE_AT_A_TIME) as w:
        running = w.stub.Generate(token_request([1, 2], request_id="run", max_new_tokens=400))
        assert (await running.read()).WhichOneof("kind") == "chunk"  # admitted: waiting is empty
        # One of these two waits (max_running_requests=1); the other finds the queue full.
        calls = [
            w.stub.Generate(token_request([3, 4], request_id=f"q{i}", max_new_tokens=4))
            for i in range(2)
        ]
        first_done, _ = await asyncio.wait(
            [asyncio.ensure_future(c.code()) for c in calls], return_when=asyncio.FIRST_COMPLETED
        )
        assert [t.result() for t in first_done] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        rejected = next(c for c in calls if c.done())
        assert "max_waiting_requests=1" in await rejected.details()
        running.cancel()  # frees the running slot: the waiting one now completes
        waiting = next(c for c in calls if c is not rejected)
        msgs = [m async for m in waiting]  # the status follows the messages
        assert msgs[-1].finished.reason == pb.FINISH_REASON_LENGTH
        await w.assert_no_leak()
