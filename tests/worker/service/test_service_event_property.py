"""Property: whatever mix of requests, aborts and cancellations a worker serves (with a KV
pool small enough to force eviction and retraction), the events a subscriber saw replay to
exactly the cache's own snapshot, and nothing leaks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from svc_harness import (
    HeldBlocks,
    Worker,
    WorkerSetup,
    read_item,
    read_until,
    running_worker,
    settle,
    subscribe,
    token_request,
)

from kvroute_proto import kvroute_pb2 as pb
from worker.engine.engine import EngineConfig

TINY_POOL = 96  # tokens; prompts up to 40 + 24 new tokens fit alone, not together
FAMILIES = [[7] * 16, list(range(20, 36)), [3, 1, 4, 1, 5, 9, 2, 6] * 2]


@dataclass(frozen=True)
class Op:
    family: int
    suffix: int  # extra tokens after the shared 16-token prefix
    max_new_tokens: int
    then: str  # "finish" | "abort" | "cancel"
    after_chunks: int  # chunks read before abort/cancel
    salt: str


ops_strategy = st.lists(
    st.builds(
        Op,
        family=st.integers(0, len(FAMILIES) - 1),
        suffix=st.integers(0, 24),
        max_new_tokens=st.integers(1, 24),
        then=st.sampled_from(["finish", "finish", "abort", "cancel"]),
        after_chunks=st.integers(0, 3),
        salt=st.sampled_from(["", "", "tenant-b"]),
    ),
    min_size=1,
    max_size=12,
)


def tiny_pool_setup() -> WorkerSetup:
    return WorkerSetup(
        engine=EngineConfig(
            worker_id="w-prop",
            num_kv_slots=TINY_POOL,
            block_size=4,
            chunk_size=16,
            new_token_reserve_ratio=0.0,  # admit greedily: overflow becomes retraction
        )
    )


async def run_op(w: Worker, i: int, op: Op) -> None:
    ids = FAMILIES[op.family] + [(i * 13 + k) % 250 for k in range(op.suffix)]
    req = token_request(ids, request_id=f"p{i}", max_new_tokens=op.max_new_tokens)
    req.partition.cache_salt = op.salt
    call = w.stub.Generate(req)
    try:
        for _ in range(op.after_chunks if op.then != "finish" else 0):
            if await call.read() is grpc.aio.EOF:
                return
        match op.then:
            case "abort":
                await w.stub.Abort(pb.AbortRequest(request_id=f"p{i}"))
            case "cancel":
                call.cancel()
                return
        while await call.read() is not grpc.aio.EOF:  # bounded by max_new_tokens
            pass
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED, exc


async def scenario(ops: list[Op]) -> int:
    async with running_worker(tiny_pool_setup()) as w:
        call = subscribe(w)
        model = HeldBlocks()
        model.apply(await read_item(call))
        await asyncio.gather(*(run_op(w, i, op) for i, op in enumerate(ops)))
        last_seq, truth = await settle(w)
        await read_until(call, model, last_seq)
        assert model.blocks == HeldBlocks.of(truth).blocks
        await w.assert_no_leak()
        call.cancel()
        return (await w.stats()).num_retractions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_events_replay_to_the_cache_snapshot(ops: list[Op]) -> None:
    asyncio.run(scenario(ops))


def test_a_heavy_mix_retracts_and_still_replays_exactly() -> None:
    ops = [Op(i % 3, 20 + i % 5, 24, "finish", 0, "") for i in range(10)]
    ops += [Op(1, 8, 24, "abort", 1, ""), Op(2, 4, 24, "cancel", 2, "tenant-b")]
    assert asyncio.run(scenario(ops)) > 0
