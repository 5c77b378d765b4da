"""Generate / Abort / GetLoad against a real server over the sim executor."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from svc_harness import (
    BYTE_VOCAB,
    MAX_CONTEXT,
    WorkerSetup,
    running_worker,
    text_request,
    token_request,
)

from kvroute_proto import kvroute_pb2 as pb
from worker.engine.engine import EngineConfig
from worker.engine.sim_executor import SimCostModel
from worker.engine.tokenizer import ByteTokenizer
from worker.service import generation
from worker.service.engine_runner import RunnerConfig

# Real-time pacing with the default cost model: ~8 ms per decode step, so a long request
# stays in flight while a test cancels it.
PACED = WorkerSetup(cost=SimCostModel(), runner=RunnerConfig(pace_speedup=1.0, load_interval_s=0))


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    """The rest of a stream already read with ``read()`` (bounded by max_new_tokens)."""
    msgs = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        msgs.append(msg)
    return msgs


def split(msgs: list[pb.GenerateResponse]) -> tuple[list[int], str, pb.Finished]:
    assert msgs and msgs[-1].WhichOneof("kind") == "finished"
    assert all(m.WhichOneof("kind") == "chunk" for m in msgs[:-1])
    ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    text = "".join(m.chunk.text for m in msgs[:-1])
    return ids, text, msgs[-1].finished


async def test_generate_from_token_ids_streams_tokens_then_usage() -> None:
    async with running_worker() as w:
        msgs = await w.generate(token_request(list(range(10)), request_id="r1", max_new_tokens=6))
        ids, text, fin = split(msgs)
        assert {m.request_id for m in msgs} == {"r1"}
        assert len(ids) == 6 and all(0 <= t < BYTE_VOCAB for t in ids)
        assert fin.reason == pb.FINISH_REASON_LENGTH
        assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (10, 6)
        assert fin.usage.cached_prompt_tokens == 0
        assert fin.worker_id == "w-test"
        assert text == ByteTokenizer().decode(ids)
        await w.assert_no_leak()


async def test_generate_from_text_detokenizes_and_second_request_hits_the_cache() -> None:
    async with running_worker() as w:
        prompt = "The quick brown fox jumps over the lazy dog"
        first = split(await w.generate(text_request(prompt, max_new_tokens=5)))
        second = split(await w.generate(text_request(prompt, max_new_tokens=5)))
        n = len(prompt.encode())
        assert first[2].usage.prompt_tokens == second[2].usage.prompt_tokens == n
        assert first[2].usage.cached_prompt_tokens == 0
        assert second[2].usage.cached_prompt_tokens > 0
        assert first[1] == ByteTokenizer().decode(first[0])
        await w.assert_no_leak()


async def test_ids_without_text_yet_go_with_the_next_text() -> None:
    # the sim's tokens are random bytes: many start a multi-byte character or are not UTF-8,
    # and a chunk for them alone would carry ids and no text; they wait for the next text
    async with running_worker() as w:
        msgs = await w.generate(token_request(list(range(10)), request_id="r1", max_new_tokens=96))
        ids, text, fin = split(msgs)
        assert len(ids) == 96 and fin.usage.completion_tokens == 96
        assert text == ByteTokenizer().decode(ids)
        assert any(t >= 0x80 for t in ids)  # some bytes that are not a character alone
        assert all(m.chunk.text for m in msgs[:-1])


async def test_long_texts_are_tokenized_off_the_event_loop(monkeypatch) -> None:
    """A long prompt_text or prompt_text_suffix is decoded on a worker thread (the loop keeps
    streaming meanwhile); short ones on the loop. The suffix's ids follow the prompt's."""
    threads: list[str] = []
    decode = generation.convert.request_from_pb

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return decode(*args, **kwargs)

    monkeypatch.setattr(generation.convert, "request_from_pb", recording)
    monkeypatch.setattr(generation, "THREAD_TEXT_CHARS", 20)
    async with running_worker() as w:
        short = split(await w.generate(text_request("short text", max_new_tokens=2)))
        req = token_request([104, 105], max_new_tokens=2)
        req.prompt_text_suffix = " and the rest of a long prompt"
        tail = split(await w.generate(req))
        await w.assert_no_leak()
    assert threads[0] == threading.main_thread().name
    assert threads[1] != threading.main_thread().name
    assert short[2].usage.prompt_tokens == len("short text")
    assert tail[2].usage.prompt_tokens == 2 + len(" and the rest of a long prompt")


async def test_server_assigns_a_request_id_when_empty() -> None:
    async with running_worker() as w:
        msgs = await w.generate(token_request([1, 2, 3], max_new_tokens=2))
        rids = {m.request_id for m in msgs}
        assert len(rids) == 1 and rids.pop() != ""


async def test_stop_token_finishes_with_stop() -> None:
    async with running_worker() as w:
        probe = split(await w.generate(token_request([5, 6, 7], request_id="p", max_new_tokens=4)))
        # Same request id, so the sim executor produces the same tokens; stop on the third.
        req = token_request([5, 6, 7], request_id="p", max_new_tokens=4)
        req.sampling.stop_token_ids.append(probe[0][2])
        ids, _, fin = split(await w.generate(req))
        assert fin.reason == pb.FINISH_REASON_STOP
        assert ids == probe[0][: len(ids)] and probe[0][2] in ids


async def test_concurrent_requests_each_get_their_own_stream() -> None:
    async with running_worker() as w:
        reqs = [
            token_request([i % 7] * (5 + i), request_id=f"c{i}", max_new_tokens=3 + i)
            for i in range(12)
        ]
        results = await asyncio.gather(*(w.generate(r) for r in reqs))
        for i, msgs in enumerate(results):
            ids, _, fin = split(msgs)
            assert {m.request_id for m in msgs} == {f"c{i}"}
            assert len(ids) == 3 + i and fin.usage.completion_tokens == 3 + i
        await w.assert_no_leak()


async def test_cancel_mid_stream_aborts_and_frees_slots() -> None:
    async with running_worker(PACED) as w:
        call = w.stub.Generate(
            token_request(list(range(64)), request_id="long", max_new_tokens=400)
        )
        first = await call.read()
        assert first.WhichOneof("kind") == "chunk"
        s = await w.stats()
        assert s.num_running == 1 and s.num_protected_kv_tokens > 0
        assert call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await w.assert_no_leak()
        assert (await w.stats()).num_aborted == 1


async def test_deadline_exceeded_aborts_the_request() -> None:
    async with running_worker(PACED) as w:
        call = w.stub.Generate(
            token_request(list(range(32)), request_id="slow", max_new_tokens=400), timeout=0.3
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await w.assert_no_leak()
        assert (await w.stats()).num_aborted == 1


async def test_abort_rpc_ends_the_stream_with_abort() -> None:
    async with running_worker(PACED) as w:
        call = w.stub.Generate(token_request([1] * 16, request_id="victim", max_new_tokens=400))
        await call.read()
        assert (await w.stub.Abort(pb.AbortRequest(request_id="victim"))).found is True
        rest = await read_all(call)
        assert rest[-1].finished.reason == pb.FINISH_REASON_ABORT
        assert rest[-1].finished.usage.prompt_tokens == 16
        assert (await w.stub.Abort(pb.AbortRequest(request_id="victim"))).found is False
        await w.assert_no_leak()


async def test_get_load_reports_identity_geometry_and_load() -> None:
    setup = WorkerSetup(
        engine=EngineConfig(
            worker_id="w-load",
            num_kv_slots=2048,
            page_size=2,
            block_size=8,
            max_running_requests=40,
        ),
        epoch=1234,
        cost=SimCostModel(),
    )
    async with running_worker(setup) as w:
        info = await w.stub.GetLoad(pb.GetLoadRequest())
        assert (info.worker_id, info.epoch, info.block_size, info.page_size) == (
            "w-load",
            1234,
            8,
            2,
        )
        assert info.kv_capacity_tokens == 2048
        assert (info.max_context_tokens, info.vocab_size, info.executor) == (
            MAX_CONTEXT,
            BYTE_VOCAB,
            "sim",
        )
        assert info.load.num_total_kv_tokens == 2048
        assert info.load.num_running == 0
        assert info.max_running_requests == 40  # the router's cost charges waits past it
        # the sim executor's cost model, as the router's decode-time term reads it
        profile = SimCostModel().step_profile_s()
        assert (
            info.step_decode_base_s,
            info.step_decode_s_per_seq,
            info.step_decode_s_per_context_token,
            info.step_prefill_s_per_token,
        ) == profile
        assert profile[3] > 0  # stated (0 would be "none")
        # the default model's name, and the byte tokenizer's fingerprint (the router checks it)
        assert info.model_name == "kvroute-tiny"
        assert info.tokenizer_fingerprint == ByteTokenizer().fingerprint


async def test_each_generate_records_a_span_that_continues_the_callers_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(generation, "tracer", provider.get_tracer("test"))
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    async with running_worker() as w:
        metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
        await w.generate(token_request([1, 2, 3], request_id="traced"), metadata=metadata)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvroute.worker.Generate"
    assert span.attributes["kvroute.request_id"] == "traced"
    assert span.attributes["kvroute.prompt_tokens"] == 3
    assert span.attributes["kvroute.finish_reason"] == "length"
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == parent_id
