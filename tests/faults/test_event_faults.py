"""KV event stream faults: loss, duplication, reordering, a gap beyond the replay buffer,
and a router cold start while the workers hold many blocks. After quiet the router's index
must equal each worker's own snapshot."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from e2e_procs import procs
from faults_harness import (
    BLOCK_SIZE,
    Row,
    assert_no_leak,
    codes_text,
    converge,
    drive,
    no_stray_tasks,
    record,
    router_config,
    snapshot_blocks,
    start_router,
    start_worker,
    wait_synced,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

FAULT_ENV = "KVROUTE_TEST_EVENT_FAULTS"


@pytest.mark.parametrize(
    ("kind", "spec", "extra"),
    [
        ("event_loss", "drop=0.2", ()),
        ("event_duplication", "duplicate=0.3", ()),
        ("event_reordering", "reorder=0.3", ()),
        ("event_mixed", "drop=0.1,duplicate=0.1,reorder=0.1", ()),
        ("replay_gap", "drop=0.3", ("--replay-buffer", "2")),
    ],
)
async def test_event_faults_converge(kind: str, spec: str, extra: tuple[str, ...]) -> None:
    with procs() as p:
        workers = [
            start_worker(p, f"w{i}", *extra, env={FAULT_ENV: f"{spec},seed={i + 1}"})
            for i in range(2)
        ]
        async with no_stray_tasks():
            router = await start_router(router_config([w.address for w in workers]))
            try:
                await wait_synced(router, 2)
                load = await drive(router.address, num_requests=120, concurrency=12)
                quiet = time.perf_counter()
                converge_s = await converge(router, workers)
                del quiet
                stats = {c.worker_id: c.num_messages for c in router.pool.conns.values()}
                sync = sum(
                    (Counter(w.sync_counters) for w in router.core.worker_stats()), Counter()
                )
                blocks = {w.worker_id: len(router.core.worker_blocks(w.worker_id)) for w in workers}
                await assert_no_leak(workers, router)
            finally:
                await router.stop(0)
    assert load.codes() == {"OK": 120}, load.codes()
    assert min(blocks.values()) > 0
    record(
        Row(
            test=kind,
            fault=f"{kind.replace('_', ' ')}: KVROUTE_TEST_EVENT_FAULTS={spec}"
            + (" with --replay-buffer 2 (gaps beyond the buffer)" if extra else "")
            + " on 2 workers",
            client_sees=f"{codes_text(load)} (routing unaffected)",
            index_after=f"index == each worker's snapshot ({sum(blocks.values())} blocks); "
            f"router saw {sync['duplicate']} duplicate, {sync['out_of_order']} out-of-order "
            f"batches, {sync['snapshot']} snapshots",
            recovery="end of load -> index equal to the snapshots",
            recover_s=round(converge_s, 2),
            details={"messages": stats, "blocks": blocks, "sync": dict(sync)},
        )
    )


COLD_START_PROMPTS = 250  # per worker
COLD_START_TOKENS = 8000  # per prompt: 2,000 blocks of 4, so 500,000 blocks per worker


async def test_router_cold_start_with_many_blocks() -> None:
    """Workers filled directly (no router) with 500k blocks each, then a router starts: it
    must take both snapshots (24 bytes a block: 12 MB messages, past gRPC's 4 MB default)
    and its index must equal them."""
    import random

    import grpc

    from kvroute_proto import kvroute_pb2 as pb
    from kvroute_proto import kvroute_pb2_grpc as pb_grpc

    kv = COLD_START_PROMPTS * COLD_START_TOKENS + 8192
    context = str(COLD_START_TOKENS + 64)
    with procs() as p:
        workers = [
            start_worker(
                p,
                f"w{i}",
                "--sim-max-context-tokens",
                context,
                "--chunk-size",
                context,
                kv_slots=kv,
            )
            for i in range(2)
        ]

        async def fill(wi: int) -> None:
            rng = random.Random(wi)
            async with grpc.aio.insecure_channel(workers[wi].address) as ch:
                stub = pb_grpc.WorkerStub(ch)
                for _ in range(COLD_START_PROMPTS):
                    ids = [rng.randrange(1, 250) for _ in range(COLD_START_TOKENS)]
                    req = pb.GenerateRequest(
                        prompt_token_ids=pb.TokenIds(ids=ids),
                        sampling=pb.SamplingParams(max_new_tokens=1, ignore_eos=True),
                    )
                    async for _ in stub.Generate(req, timeout=60):
                        pass

        await asyncio.gather(fill(0), fill(1))
        held = {w.worker_id: len(snapshot_blocks(await w.snapshot())) for w in workers}
        async with no_stray_tasks():
            started = time.perf_counter()
            router = await start_router(router_config([w.address for w in workers]))
            try:
                await wait_synced(router, 2, timeout=60)
                synced_s = time.perf_counter() - started
                converge_s = await converge(router, workers, timeout=60)
                load = await drive(router.address, num_requests=20, concurrency=4)
                await assert_no_leak(workers, router)
            finally:
                await router.stop(0)
    total = sum(held.values())
    assert held == dict.fromkeys(held, COLD_START_PROMPTS * COLD_START_TOKENS // BLOCK_SIZE)
    assert load.codes() == {"OK": 20}
    record(
        Row(
            test="router_cold_start",
            fault=f"router cold start while 2 workers hold {total:,} blocks "
            f"({COLD_START_PROMPTS} random prompts of {COLD_START_TOKENS:,} tokens each per "
            f"worker, block size {BLOCK_SIZE})",
            client_sees=f"after sync: {codes_text(load)}",
            index_after=f"index == each worker's snapshot ({total:,} blocks)",
            recovery="router start -> both snapshots applied",
            recover_s=round(synced_s, 2),
            details={"held": held, "converge_check_s": round(converge_s, 2)},
        )
    )
