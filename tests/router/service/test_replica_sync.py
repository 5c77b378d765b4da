"""router.service.replica_sync: the batch codec, what a router does with its peers' batches, and two
routers syncing through the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid

import numpy as np
import pytest

from kvroute_proto import kvroute_pb2 as pb
from router.core.core_types import ReplicaConfig, ReplicaFinished, ReplicaFirstToken, ReplicaRouted
from router.core.router_core import RouterConfig, RouterCore, RouteRequest
from router.service.redis_wire import RedisTarget, RespConnection, RespParser
from router.service.replica_sync import (
    MAX_BLOCKS,
    MAX_EVENTS_PER_BATCH,
    ReplicaDecodeError,
    ReplicaSync,
    decode_batch,
    encode_batch,
)

B = 16
NOWHERE = "redis://127.0.0.1:1/0"  # never connected to by the tests that use it


def make_core(seed: int = 0) -> RouterCore:
    core = RouterCore(RouterConfig(block_size=B), clock=lambda: 0.0, rng=random.Random(seed))
    for i in range(3):
        core.add_worker(f"w{i}", block_size=B)
    return core


def test_a_batch_survives_the_wire():
    hashes = np.array([1, 2**64 - 1, 12345], dtype=np.uint64)
    events = (
        ReplicaRouted("r1", "w0", 100, 32, hashes),
        ReplicaFirstToken("r1"),
        ReplicaFinished("r1", 9),
        ReplicaRouted("r2", "w1", 5, 0),
    )
    batch = decode_batch(encode_batch("me", 7, events))
    assert (batch.router_id, batch.seq, batch.leaving) == ("me", 7, False)
    routed = batch.events[0]
    assert isinstance(routed, ReplicaRouted)
    assert routed.block_hashes.tolist() == hashes.tolist()  # type: ignore[union-attr]
    assert batch.events[1:3] == events[1:3]
    assert len(batch.events[3].block_hashes) == 0  # type: ignore[union-attr]
    assert decode_batch(encode_batch("me", 8, (), leaving=True)).leaving


def _batch(**fields) -> pb.ReplicaBatch:
    return pb.ReplicaBatch(router_id=fields.pop("router_id", "peer"), seq=fields.pop("seq", 1))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: setattr(b, "router_id", ""), "router_id is empty"),
        (lambda b: setattr(b, "router_id", "x" * 257), "router_id has 257 characters, limit 256"),
        (lambda b: setattr(b, "seq", 0), "seq must be >= 1"),
        (lambda b: b.events.add(), r"events\[0\] has no event"),
        (
            lambda b: b.events.add().routed.CopyFrom(
                pb.ReplicaRouted(request_id="r", worker_id="w", block_hashes=b"123")
            ),
            r"events\[0\]\.routed\.block_hashes has 3 bytes, not a multiple of 8",
        ),
        (
            lambda b: b.events.add().routed.CopyFrom(
                pb.ReplicaRouted(
                    request_id="r", worker_id="w", block_hashes=bytes(8 * (MAX_BLOCKS + 1))
                )
            ),
            rf"block_hashes has {MAX_BLOCKS + 1} blocks, limit {MAX_BLOCKS}",
        ),
        (
            lambda b: b.events.add().routed.CopyFrom(
                pb.ReplicaRouted(request_id="r", worker_id="w", prompt_tokens=4, matched_tokens=5)
            ),
            r"matched_tokens 5 > prompt_tokens 4",
        ),
        (
            lambda b: b.events.add().routed.CopyFrom(pb.ReplicaRouted(request_id="r")),
            r"events\[0\]\.routed\.worker_id is empty",
        ),
        (
            lambda b: b.events.add().first_token.CopyFrom(pb.ReplicaFirstToken()),
            r"events\[0\]\.first_token\.request_id is empty",
        ),
        (
            lambda b: [
                b.events.add().finished.CopyFrom(pb.ReplicaFinished(request_id="r"))
                for _ in range(MAX_EVENTS_PER_BATCH + 1)
            ],
            rf"events has {MAX_EVENTS_PER_BATCH + 1} entries, limit {MAX_EVENTS_PER_BATCH}",
        ),
    ],
)
def test_a_malformed_batch_is_refused_naming_the_field(mutate, message):
    batch = _batch()
    mutate(batch)
    with pytest.raises(ReplicaDecodeError, match=message):
        decode_batch(batch.SerializeToString())


def test_bytes_that_are_no_batch_are_refused():
    with pytest.raises(ReplicaDecodeError, match="not a ReplicaBatch"):
        decode_batch(b"\xff\xff\xff")


async def test_a_peers_batches_are_applied_in_sequence_and_a_gap_forgets_its_requests():
    core = make_core()
    now = [0.0]
    sync = ReplicaSync(core, NOWHERE, router_id="me", clock=lambda: now[0], peer_timeout_s=5)
    try:
        view = core.worker_view("w0")
        sync.on_message(encode_batch("me", 1, (ReplicaRouted("own", "w0", 10, 0),)))
        assert view.num_active == 0  # our own batch, echoed by the channel
        sync.on_message(encode_batch("p", 4, (ReplicaRouted("a", "w0", 100, 0),)))
        assert sync.peers == ["p"] and view.num_active == 1  # a new peer, from any seq
        sync.on_message(encode_batch("p", 4, (ReplicaRouted("dup", "w0", 1, 0),)))
        assert view.num_active == 1  # a duplicate batch
        sync.on_message(encode_batch("p", 5, (ReplicaRouted("b", "w0", 50, 0),)))
        assert view.num_active == 2 and view.inflight_prefill_tokens == 150
        sync.on_message(encode_batch("p", 7, (ReplicaRouted("c", "w1", 30, 0),)))
        # batch 6 was lost (it may have ended a or b): forget what p had, keep what came
        assert sync.counters["gaps"] == 1 and sync.counters["requests_dropped"] == 2
        assert view.num_active == 0 and core.worker_view("w1").num_active == 1
        sync.on_message(encode_batch("p", 8, (ReplicaFinished("c"), ReplicaFinished("zz"))))
        assert core.worker_view("w1").num_active == 0
        assert sync.counters["events_ignored"] == 1  # zz was never placed
        sync.on_message(b"garbage")
        assert sync.counters["batches_malformed"] == 1
        sync.on_message(encode_batch("q", 1, (ReplicaRouted("d", "w2", 10, 0),)))
        now[0] = 3.0
        sync.on_message(encode_batch("p", 9, ()))  # p's heartbeat
        now[0] = 6.0
        sync.expire_peers()  # q silent for 6 s > 5 s: dead; p heard 3 s ago
        assert sync.peers == ["p"] and core.worker_view("w2").num_active == 0
        sync.on_message(encode_batch("p", 10, (ReplicaRouted("e", "w1", 10, 0),)))
        sync.on_message(encode_batch("p", 11, (), leaving=True))
        assert sync.peers == [] and core.worker_view("w1").num_active == 0
    finally:
        await sync.close(timeout_s=0.1)


async def test_a_peer_cannot_grow_this_router_without_bound():
    core = make_core()
    sync = ReplicaSync(core, NOWHERE, max_peer_requests=2)
    try:
        events = tuple(ReplicaRouted(f"r{i}", "w0", 10, 0) for i in range(3))
        sync.on_message(encode_batch("p", 1, events))
        assert core.num_replica_inflight == 2 and sync.counters["events_over_limit"] == 1
        sync.on_message(encode_batch("p", 2, (ReplicaFinished("r0"), events[2])))
        assert core.num_replica_inflight == 2  # one ended, so the next pick counts
        assert sync.counters["events_over_limit"] == 1
    finally:
        await sync.close(timeout_s=0.1)
    with pytest.raises(ValueError, match="max_peer_requests must be >= 1"):
        ReplicaSync(make_core(), NOWHERE, max_peer_requests=0)


async def test_settings_that_would_drop_live_peers_are_refused():
    with pytest.raises(ValueError, match=r"peer_timeout_s \(1.0\) must be > heartbeat_s"):
        ReplicaSync(make_core(), NOWHERE, heartbeat_s=1.0, peer_timeout_s=1.0)
    with pytest.raises(ValueError, match="max_pending must be >= 1"):
        ReplicaSync(make_core(), NOWHERE, max_pending=0)


async def test_a_full_queue_drops_new_events_and_never_blocks_routing():
    core = make_core()
    sync = ReplicaSync(core, NOWHERE, max_pending=2)
    core.set_replica_listener(sync._on_local)  # as start() does, without the Redis tasks
    for i in range(3):
        core.route(RouteRequest(f"r{i}", np.arange(32, dtype=np.uint32)))
    assert sync.counters["events_dropped"] == 1
    await sync.close(timeout_s=0.1)
    core.route(RouteRequest("after", np.arange(32, dtype=np.uint32)))  # listener removed


async def _wait(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_two_routers_sync_through_redis(redis_url):
    prefix = f"kvroute-test-{uuid.uuid4().hex[:8]}:"
    a, b = make_core(1), make_core(2)
    sa = ReplicaSync(a, redis_url, prefix=prefix, heartbeat_s=0.2, peer_timeout_s=2)
    sb = ReplicaSync(b, redis_url, prefix=prefix, heartbeat_s=0.2, peer_timeout_s=2)
    await sa.start()
    await sb.start()
    try:
        await _wait(lambda: sa.subscribed.is_set() and sb.subscribed.is_set())
        d = a.route(RouteRequest("x", np.arange(320, dtype=np.uint32)))
        view = b.worker_view(d.worker_id)
        await _wait(lambda: view.num_active == 1)
        assert view.inflight_prefill_tokens == 320
        a.on_first_token("x")
        await _wait(lambda: view.inflight_prefill_tokens == 0)
        a.on_finished("x", 3)
        await _wait(lambda: view.num_active == 0)
        b.route(RouteRequest("y", np.arange(64, dtype=np.uint32)))
        await _wait(lambda: b.stats().num_routed == 1 and a.stats().num_replica_inflight == 1)
        assert sb.peers == [sa.router_id] and sa.peers == [sb.router_id]
    finally:
        await sb.close()
    # b said it was leaving: a forgets b's request at once
    await _wait(lambda: a.stats().num_replica_inflight == 0)
    await sa.close()
    assert sa.counters["batches_malformed"] == sb.counters["batches_malformed"] == 0
    assert sa.counters["gaps"] == 0


async def test_the_echo_of_its_own_batches_times_the_window(redis_url):
    """Redis echoes a router's batches to itself: the delay from queueing to the echo sets an
    auto window (RouterConfig.replica_sync_window_s None); a fixed one stays as set."""
    prefix = f"kvroute-test-{uuid.uuid4().hex[:8]}:"
    fake_now = [100.0]  # the sync's clock: the echo comes 30 ms after the pick was queued
    auto = RouterCore(
        RouterConfig(block_size=B, replica=ReplicaConfig(count=2, sync=True)),
        clock=lambda: 0.0,
        rng=random.Random(0),
    )
    fixed = RouterCore(
        RouterConfig(block_size=B, replica=ReplicaConfig(count=2, sync=True, sync_window_s=0.001)),
        clock=lambda: 0.0,
        rng=random.Random(0),
    )
    syncs = []
    for core in (auto, fixed):
        core.add_worker("w0", block_size=B)
        sync = ReplicaSync(
            core,
            redis_url,
            prefix=prefix,
            heartbeat_s=5,
            peer_timeout_s=10,
            clock=lambda: fake_now[0],
        )
        syncs.append(sync)
        await sync.start()
    try:
        await _wait(lambda: all(s.subscribed.is_set() for s in syncs))
        assert auto.replica_sync_window_s == 0.005  # INITIAL_REPLICA_SYNC_WINDOW_S
        auto.route(RouteRequest("x", np.arange(64, dtype=np.uint32)))  # queued at t = 100
        fixed.route(RouteRequest("y", np.arange(64, dtype=np.uint32)))
        fake_now[0] = 100.03
        await _wait(lambda: all(s.last_delivery_s is not None for s in syncs))
        assert syncs[0].last_delivery_s == pytest.approx(0.03)
        assert auto.replica_sync_window_s == pytest.approx(0.03)  # up at once
        assert fixed.replica_sync_window_s == 0.001
    finally:
        for sync in syncs:
            await sync.close()


async def test_routing_goes_on_when_redis_is_down():
    """Nothing listens at the Redis address: routing never waits, the events are dropped and
    counted, and close() returns promptly."""
    core = make_core()
    sync = ReplicaSync(core, NOWHERE, heartbeat_s=0.05, peer_timeout_s=1)
    await sync.start()
    try:
        for i in range(5):
            core.route(RouteRequest(f"r{i}", np.arange(64, dtype=np.uint32)))
            core.on_finished(f"r{i}")
        await _wait(lambda: sync.counters["events_dropped"] >= 10, timeout_s=5)
        assert sync.counters["batches_published"] == 0
        assert not sync.subscribed.is_set()
    finally:
        async with asyncio.timeout(5):
            await sync.close(timeout_s=0.2)


@contextlib.asynccontextmanager
async def _synced_pair(redis_url: str, heartbeat_s: float, peer_timeout_s: float):
    """Two routers syncing on a channel of their own, both subscribed and able to publish."""
    prefix = f"kvroute-test-{uuid.uuid4().hex[:8]}:"
    a, b = make_core(1), make_core(2)
    syncs = [
        ReplicaSync(core, redis_url, prefix=prefix, heartbeat_s=heartbeat_s,
                    peer_timeout_s=peer_timeout_s)
        for core in (a, b)
    ]  # fmt: skip
    for sync in syncs:
        await sync.start()
    try:
        await _wait(lambda: all(s.subscribed.is_set() and s._pub is not None for s in syncs))
        yield a, b, syncs[0], syncs[1]
    finally:
        for sync in reversed(syncs):
            await sync.close()


async def test_a_pick_is_written_inside_route_and_ends_go_at_the_loops_next_turn(redis_url):
    """No task hop for a pick: it is on the socket when route() returns (nothing queued), so
    a burst of routing calls cannot hold it back; a first token or finish waits for the
    publishing task and goes out with whatever else came in the same turn."""
    async with _synced_pair(redis_url, 5, 10) as (a, b, sa, sb):
        d = a.route(RouteRequest("x", np.arange(320, dtype=np.uint32)))
        assert not sa._pending  # written already
        a.on_first_token("x")
        a.on_finished("x", 3)
        assert len(sa._pending) == 2  # queued for the publishing task
        view = b.worker_view(d.worker_id)
        await _wait(lambda: sb.counters["events_applied"] == 3)
        assert view.num_active == 0 and view.inflight_prefill_tokens == 0 and not sa._pending
        # a pick made while ends are queued takes them along, in order, in one batch
        received = sb.counters["batches_received"]  # no heartbeat comes in 5 s
        a.route(RouteRequest("y", np.arange(64, dtype=np.uint32)))
        a.on_finished("y", 1)
        a.route(RouteRequest("z", np.arange(96, dtype=np.uint32)))
        assert not sa._pending
        await _wait(lambda: sb.counters["events_applied"] == 6)
        assert b.stats().num_replica_inflight == 1  # z; y came and went, in order
        assert sb.counters["batches_received"] - received == 2  # y, then its end with z
        assert sb.counters["gaps"] == 0


async def _kill(redis_url: str, name: str) -> None:
    """Redis closes the connection of the client called ``name``."""
    conn = await RespConnection.open(RedisTarget.from_url(redis_url))
    try:
        listing = (await conn.call("CLIENT", "LIST")).decode()
        for line in listing.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("name") == name:
                assert await conn.call("CLIENT", "KILL", "ID", fields["id"]) == 1
                return
        raise AssertionError(f"no Redis client named {name}")
    finally:
        conn.close()


async def test_lost_connections_are_made_again_and_what_went_past_is_forgotten(redis_url):
    """Redis drops a router's subscription: it forgets the other's requests (their ends went
    past it) and subscribes again. Redis drops the other's publishing connection: what that
    router placed meanwhile is lost, its next batch shows the gap, and the peer forgets."""
    async with _synced_pair(redis_url, 0.1, 2) as (a, b, sa, sb):
        a.route(RouteRequest("x", np.arange(320, dtype=np.uint32)))
        await _wait(lambda: b.stats().num_replica_inflight == 1)
        await _kill(redis_url, f"kvroute-router-{sb.router_id}-subscribe")
        await _wait(lambda: sb.counters["peers_dropped"] == 1)
        assert b.stats().num_replica_inflight == 0
        await _wait(lambda: sb.subscribed.is_set())
        a.route(RouteRequest("y", np.arange(64, dtype=np.uint32)))
        await _wait(lambda: b.stats().num_replica_inflight == 1)  # counted again
        # now a's publishing connection
        await _kill(redis_url, f"kvroute-router-{sa.router_id}-publish")
        await _wait(lambda: sa._pub is None)
        a.route(RouteRequest("lost", np.arange(64, dtype=np.uint32)))  # Redis is "down" for a
        assert sa.counters["events_dropped"] >= 1
        await _wait(lambda: sa._pub is not None)
        a.route(RouteRequest("z", np.arange(64, dtype=np.uint32)))
        # b sees the gap in a's numbers: forgets y, counts z
        await _wait(lambda: sb.counters["gaps"] == 1)
        assert b.stats().num_replica_inflight == 1


async def _fake_redis(refuse_publish: bool) -> tuple[asyncio.Server, int, list[bytes]]:
    """A RESP server on 127.0.0.1:0 that takes SUBSCRIBE and CLIENT, and answers every
    PUBLISH with an error: a Redis that refuses the batches (an ACL, a full memory)."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = RespParser()
        try:
            while data := await reader.read(65536):
                for cmd in parser.feed(data):
                    name = cmd[0].upper()
                    seen.append(name)
                    if name == b"SUBSCRIBE":
                        ch = cmd[1]  # the confirmation: subscribe, the channel, one
                        writer.write(b"*3\r\n$9\r\nsubscribe\r\n")
                        writer.write(b"$%d\r\n%s\r\n:1\r\n" % (len(ch), ch))
                    elif name == b"PUBLISH" and refuse_publish:
                        writer.write(b"-NOPERM this user has no permissions to publish\r\n")
                    elif name == b"PUBLISH":
                        writer.write(b":0\r\n")
                    else:
                        writer.write(b"+OK\r\n")
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def test_batches_redis_refuses_are_counted_as_dropped_and_logged_once(caplog):
    server, port, seen = await _fake_redis(refuse_publish=True)
    core = make_core()
    sync = ReplicaSync(core, f"redis://127.0.0.1:{port}/0", heartbeat_s=0.05, peer_timeout_s=1)
    await sync.start()
    try:
        await _wait(lambda: sync.subscribed.is_set() and sync._pub is not None)
        for i in range(5):
            core.route(RouteRequest(f"r{i}", np.arange(64, dtype=np.uint32)))
        await _wait(lambda: sync.counters["events_dropped"] >= 5)
        await _wait(lambda: seen.count(b"PUBLISH") >= 8)  # heartbeats go on
        assert sync.counters["batches_published"] == 0
        assert "Redis did not take a batch (NOPERM" in caplog.text
        assert caplog.text.count("Redis did not take a batch") == 1
        assert b"AUTH" not in seen  # no user, no password: no AUTH
    finally:
        await sync.close(timeout_s=0.2)
        server.close()
