"""WorkerConnection's event stream arrives as wire bytes (no gRPC deserializer) and is decoded
by ``codec.decode_stream_message``: batches the compiled scan reads, messages it declines
(a snapshot, an unknown field: protobuf decodes them), runs of batches (decision 0056),
bytes that do not parse and a foreign worker_id -- each against a worker that sends exactly
the bytes the test gives it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import (
    DEFAULT_PARTITION,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Snapshot,
)
from kvroute_proto.hashing import block_hashes
from router.core.core_types import IndexConfig
from router.core.pools import PoolsConfig, RouterPools
from router.core.router_core import RouterConfig, RouterCore
from router.core.step_profile import StepProfile
from router.service.resilience import BackoffConfig
from router.service.worker_conn import (
    SUBSCRIBE_METHOD,
    ConnectionConfig,
    ConnectionHooks,
    WorkerConnection,
)

BS = 4
WID = "w0"


class RawWorker:
    """GetLoad answers ``WID``; every SubscribeKvEvents call sends ``messages`` (raw bytes)
    as they are, then stays open."""

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages
        self.subscriptions = 0
        self.requests: list[pb.SubscribeRequest] = []

    async def get_load(self, request: pb.GetLoadRequest, context: object) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=WID,
            epoch=1,
            block_size=BS,
            executor="fake",
            max_running_requests=48,
            step_decode_base_s=0.02,
            step_decode_s_per_seq=2e-4,
            step_decode_s_per_context_token=1e-7,
            step_prefill_s_per_token=5e-5,
        )

    async def subscribe(
        self, request: pb.SubscribeRequest, context: object
    ) -> AsyncIterator[bytes]:
        self.subscriptions += 1
        self.requests.append(request)
        for data in self.messages:
            yield data
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def serving(worker: RawWorker) -> AsyncIterator[str]:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "kvroute.v1.Worker",
        {
            "GetLoad": grpc.unary_unary_rpc_method_handler(
                worker.get_load,
                request_deserializer=pb.GetLoadRequest.FromString,
                response_serializer=pb.WorkerInfo.SerializeToString,
            ),
            "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(
                worker.subscribe,
                request_deserializer=pb.SubscribeRequest.FromString,
                response_serializer=None,  # the test's bytes go out as they are
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def connected(
    address: str, backend: str
) -> AsyncIterator[tuple[WorkerConnection, RouterCore]]:
    core = RouterCore(
        RouterConfig(index=IndexConfig(backend=backend)), clock=lambda: 0.0, rng=random.Random(0)
    )

    pools = RouterPools(PoolsConfig(("m",)), lambda: core)  # one pool: every worker's

    def claim(conn: WorkerConnection, worker_id: str, block_size: int, model: str) -> bool:
        pools.add_worker(worker_id, conn.address, block_size, model=model)
        return True

    hooks = ConnectionHooks(
        claim=claim,
        release=lambda conn, wid: None,
        on_health=lambda conn, healthy: None,
        changed=asyncio.Condition(),
    )
    config = ConnectionConfig(backoff=BackoffConfig(initial_s=0.05, max_s=0.1))
    conn = WorkerConnection(address, pools, config, hooks, rng=random.Random(1), clock=lambda: 0.0)
    conn.start()
    try:
        yield conn, core
    finally:
        await conn.close()


async def until(cond: object, timeout: float = 10.0) -> None:
    async def wait() -> None:
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout)


def chain(seed: int, blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    tokens = np.random.default_rng(seed).integers(0, 32_000, blocks * BS, dtype=np.uint32)
    return tuple(block_hashes(tokens, BS, DEFAULT_PARTITION.seed).tolist()), tuple(tokens.tolist())


def test_the_method_is_the_generated_stubs() -> None:
    service = pb.DESCRIPTOR.services_by_name["Worker"]
    assert f"/{service.full_name}/SubscribeKvEvents" == SUBSCRIBE_METHOD
    assert "SubscribeKvEvents" in service.methods_by_name


@pytest.mark.parametrize("backend", ["numba", "dict"])
async def test_wire_bytes_decoded_as_sent(backend: str) -> None:
    a, a_tokens = chain(1, 6)
    b, b_tokens = chain(2, 3)
    snap = Snapshot(WID, 1, 1, BS, (BlockStored(a[:2], None, a_tokens[: 2 * BS]),))
    stored = EventBatch(WID, 1, 2, BS, (BlockStored(a[2:], a[1], a_tokens[2 * BS :]),))
    other = EventBatch(WID, 1, 3, BS, (BlockStored(b, None, b_tokens),))
    removed = EventBatch(WID, 1, 4, BS, (BlockRemoved(a[4:]),))
    # an unknown field at the end of the batch: the compiled scan declines it, protobuf
    # decodes it (skipping the field)
    irregular = codec.encode_stream_message(other)
    unknown = bytes([15 << 3 | 0, 7])
    irregular = bytes([irregular[0], irregular[1] + len(unknown)]) + irregular[2:] + unknown
    assert pb.KvStreamMessage.FromString(irregular).batch.seq == 3
    messages = [codec.encode_stream_message(m) for m in (snap, stored)]
    messages += [irregular, codec.encode_stream_message(removed)]
    worker = RawWorker(messages)
    async with serving(worker) as address, connected(address, backend) as (conn, core):
        await until(lambda: conn.num_messages == 4)
        assert core.worker_blocks(WID) == set(a[:4]) | set(b)
        assert core.stream_position(WID) == (1, 4)
        assert conn.num_failures == 0 and conn.healthy
        assert core.worker_view(WID).max_running == 48  # the cap GetLoad states
        # and the step profile it states, which the cost's decode-time term reads
        assert core.worker_view(WID).step_profile == StepProfile(0.02, 2e-4, 1e-7, 5e-5)


@pytest.mark.parametrize("backend", ["numba", "dict"])
async def test_bytes_that_do_not_parse_end_the_stream(backend: str) -> None:
    snap = codec.encode_stream_message(Snapshot(WID, 1, 1, BS))
    worker = RawWorker([snap, b"\x0a\xff\xff\xff"])  # a batch longer than the message
    async with serving(worker) as address, connected(address, backend) as (conn, _core):
        await until(lambda: conn.num_failures >= 1)
        assert conn.last_error.startswith("ContractError: KvStreamMessage does not parse")
        assert conn.num_messages == 1
        await until(lambda: worker.subscriptions >= 2)  # reconnects


async def test_a_foreign_worker_id_ends_the_stream() -> None:
    snap = codec.encode_stream_message(Snapshot("w9", 1, 1, BS))
    worker = RawWorker([snap])
    async with serving(worker) as address, connected(address, "numba") as (conn, _core):
        await until(lambda: conn.num_failures >= 1)
        assert "worker_id='w9'" in conn.last_error and conn.num_messages == 0


@pytest.mark.parametrize("backend", ["numba", "dict"])
async def test_a_run_is_applied_batch_by_batch(backend: str) -> None:
    a, a_tokens = chain(1, 6)
    snap = Snapshot(WID, 1, 1, BS, (BlockStored(a[:2], None, a_tokens[: 2 * BS]),))
    batches = [
        EventBatch(WID, 1, 2, BS, (BlockStored(a[2:4], a[1], a_tokens[2 * BS : 4 * BS]),)),
        EventBatch(WID, 1, 3, BS, (BlockStored(a[4:], a[3], a_tokens[4 * BS :]),)),
        EventBatch(WID, 1, 4, BS, (BlockRemoved(a[5:]),)),
    ]
    run = codec.run_to_pb([codec.stream_message_to_pb(b) for b in batches])
    worker = RawWorker([codec.encode_stream_message(snap), run.SerializeToString()])
    async with serving(worker) as address, connected(address, backend) as (conn, core):
        await until(lambda: conn.num_messages == 4)  # the snapshot and three batches
        assert core.worker_blocks(WID) == set(a[:5])
        assert core.stream_position(WID) == (1, 4)
        assert conn.num_failures == 0 and conn.num_resubscribes == 0
        assert conn.num_runs == 1  # the snapshot came alone
        assert worker.requests[0].accepts_runs


async def test_a_gap_inside_a_run_resubscribes_after_the_last_batch_applied() -> None:
    a, a_tokens = chain(1, 4)
    snap = Snapshot(WID, 1, 1, BS, (BlockStored(a[:2], None, a_tokens[: 2 * BS]),))
    first = EventBatch(WID, 1, 2, BS, (BlockStored(a[2:], a[1], a_tokens[2 * BS :]),))
    gap = EventBatch(WID, 1, 4, BS, (BlockRemoved(a[3:]),))  # seq 3 never came
    run = codec.run_to_pb([codec.stream_message_to_pb(b) for b in (first, gap)])
    worker = RawWorker([codec.encode_stream_message(snap), run.SerializeToString()])
    async with serving(worker) as address, connected(address, "numba") as (conn, core):
        await until(lambda: len(worker.requests) >= 2)
        again = worker.requests[1]
        assert (again.epoch, again.after_seq) == (1, 2)  # from the last batch it applied
        assert conn.num_resubscribes >= 1
        assert core.worker_blocks(WID) >= set(a[:4])
