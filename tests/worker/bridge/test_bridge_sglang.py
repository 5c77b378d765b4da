"""``kvroute bridge --engine sglang``: SGLang's /generate (input_ids, streamed), its
cached_tokens, abort on a closed stream, load from its /metrics -- against a fake SGLang
(tests/worker/bridge/fake_engine.py, kind "sglang": 1-token pages, /generate) with real
bridges and a real router on 127.0.0.1 port 0."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from edge.frontdoor import BadRequest
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli.client import GenerateOptions
from tests.worker.bridge.fake_engine import FakeEngine
from tests.worker.bridge.test_bridge_service import (
    BLOCK,
    cancel_after_first_chunk,
    explain_when,
    matched,
    prompt,
    router_over,
    wait_until,
)
from worker.bridge.service.cli import build_parser, config_from_args
from worker.bridge.service.engine_sglang import (
    SglangStream,
    generate_body,
    parse_sglang_metrics,
)
from worker.bridge.service.events import EventSourceConfig
from worker.bridge.service.server import BridgeConfig, BridgeServer


@contextlib.asynccontextmanager
async def sglang_and_bridge(
    worker_id: str, *, token_delay_s: float = 0.0, incremental: bool = False
) -> AsyncIterator[tuple[FakeEngine, BridgeServer]]:
    engine = FakeEngine(
        block_size=1, kind="sglang", token_delay_s=token_delay_s, incremental=incremental
    )
    await engine.start()
    events = EventSourceConfig(
        connect=engine.pub_endpoint, replay=engine.replay_endpoint, replay_timeout_s=1.0
    )
    config = BridgeConfig(
        engine.url, events, worker_id, BLOCK, load_interval_s=0.1, engine="sglang"
    )
    bridge = BridgeServer(config, rng=random.Random(0))
    await bridge.start()
    try:
        await wait_until(lambda: bool(bridge.state.model_name))
        yield engine, bridge
    finally:
        await bridge.stop(grace_s=0.2)
        await engine.stop()


# ---- the request and the stream, alone ----------------------------------------------------


def test_generate_body_is_sglangs():
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(
            max_new_tokens=9, temperature=0.5, top_k=4, seed=3, stop_token_ids=[2], ignore_eos=True
        ),
        partition=pb.Partition(cache_salt="tenant-a"),
    )
    body = generate_body(req)
    assert body["input_ids"] == [5, 6, 7] and body["stream"] is True
    assert body["cache_salt"] == "tenant-a"
    assert body["sampling_params"] == {
        "max_new_tokens": 9,
        "temperature": 0.5,
        "top_k": 4,
        "sampling_seed": 3,
        "stop_token_ids": [2],
        "ignore_eos": True,
    }
    assert (
        "max_new_tokens"
        not in generate_body(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5])))[
            "sampling_params"
        ]
    )  # 0: the engine's default
    with pytest.raises(BadRequest, match="prompt_token_ids"):
        generate_body(pb.GenerateRequest(prompt_text="hello"))


def _events(incremental: bool) -> list[str]:
    out, data = [], []
    for i in range(3):
        out.append(10 + i)
        meta = {
            "prompt_tokens": 4,
            "completion_tokens": i + 1,
            "cached_tokens": 2,
            "finish_reason": {"type": "stop"} if i == 2 else None,
        }
        text = f"t{i}" if incremental else "".join(f"t{j}" for j in range(i + 1))
        ids = out[-1:] if incremental else list(out)
        data.append(json.dumps({"text": text, "output_ids": ids, "meta_info": meta}))
    return [*data, "[DONE]"]


@pytest.mark.parametrize("incremental", [False, True])
def test_cumulative_and_incremental_streams_give_the_same_deltas(incremental: bool):
    stream = SglangStream()
    got = [stream.parse(d) for d in _events(incremental)]
    assert got[-1] is None
    chunks = [c for c in got if c is not None]
    assert [c.token_ids for c in chunks] == [(10,), (11,), (12,)]
    assert [c.text for c in chunks] == ["t0", "t1", "t2"]
    assert [c.finish for c in chunks] == [None, None, pb.FINISH_REASON_STOP]
    assert chunks[-1].usage == pb.Usage(
        prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=2
    )


def test_stream_errors_are_unavailable():
    from edge.frontdoor import Unavailable

    for bad in ("{", "[1]", '{"error": "boom"}', '{"text": "x"}'):
        with pytest.raises(Unavailable):
            SglangStream().parse(bad)


def test_sglang_metrics():
    text = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 3.0\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank="0"} 1.0\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{tp_rank="0"} 0.25\n'
    )
    load = parse_sglang_metrics(text)
    assert load is not None and (load.running, load.waiting, load.kv_usage) == (3, 1, 0.25)
    assert parse_sglang_metrics("# TYPE vllm:num_requests_running gauge\n") is None


def test_cli_engine_flag():
    base = ["--engine-url", "http://127.0.0.1:30000", "--events", "tcp://127.0.0.1:5557"]
    assert config_from_args(build_parser().parse_args(base)).engine == "vllm"
    args = build_parser().parse_args([*base, "--engine", "sglang"])
    assert config_from_args(args).engine == "sglang"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--engine", "trtllm"])


# ---- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("incremental", [False, True])
async def test_router_through_sglang_bridges(incremental: bool):
    """1-token pages become our 16-token blocks; the router routes a shared prefix to the
    engine that announced it, and the engine's cached_tokens come back."""
    async with (
        sglang_and_bridge("s0", incremental=incremental) as (e0, b0),
        sglang_and_bridge("s1", incremental=incremental) as (e1, b1),
        router_over(b0, b1) as r,
    ):
        p = prompt(11)
        first = await r.client.generate(p, GenerateOptions(max_new_tokens=3))
        assert first.token_ids == (p[-1] + 1, p[-1] + 2, p[-1] + 3)
        assert first.cached_prompt_tokens == 0
        holder = {"s0": (e0, b0), "s1": (e1, b1)}[first.worker_id]
        assert holder[0].bodies[-1]["input_ids"] == p
        await wait_until(lambda: len(holder[1].translator.held_blocks()) == 96 // BLOCK)
        expl = await explain_when(r, [*p, 7], lambda e: matched(e, first.worker_id) == 96)
        assert expl.chosen_worker_id == first.worker_id
        again = await r.client.generate([*p, 9, 9], GenerateOptions(max_new_tokens=2))
        assert again.worker_id == first.worker_id and again.cached_prompt_tokens == 96


async def test_a_cancelled_call_aborts_the_sglang_request_and_load_is_read():
    async with sglang_and_bridge("s0", token_delay_s=0.05) as (engine, bridge):
        async with grpc.aio.insecure_channel(bridge.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            await wait_until(lambda: bridge.state.load is not None)
            info = await stub.GetLoad(pb.GetLoadRequest())
            assert info.kv_capacity_tokens == 4096  # sglang:max_total_num_tokens
            assert info.load.num_free_kv_tokens == 2048  # sglang:token_usage 0.5
            await cancel_after_first_chunk(stub)
        await wait_until(lambda: engine.disconnects == 1)
        await wait_until(lambda: not bridge.servicer.inflight)
