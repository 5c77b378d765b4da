"""Redis registry against the real Redis at 127.0.0.1:6379 (unique key prefix per test)."""

import asyncio
import logging

import pytest
import redis

from edge.registry import (
    RedisMembershipWatcher,
    RedisRegistration,
    WorkerRecord,
    redacted_url,
    worker_key,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.fixture
def prefix(redis_prefix):
    return redis_prefix


def test_record_json_round_trip_and_validation():
    rec = WorkerRecord("w0", "127.0.0.1:5000", epoch=7, block_size=16, kv_capacity_tokens=99)
    assert WorkerRecord.from_json(rec.to_json()) == rec
    named = WorkerRecord("w0", "a:1", model="alpha")  # the model pool it serves (0036)
    assert WorkerRecord.from_json(named.to_json()).model == "alpha"
    assert WorkerRecord.from_json('{"worker_id": "w0", "address": "a:1"}').model == ""
    with pytest.raises(ValueError, match="'model' must be a string"):
        WorkerRecord.from_json('{"worker_id": "w0", "address": "a:1", "model": 3}')
    with pytest.raises(ValueError, match="'address' must be a non-empty string"):
        WorkerRecord.from_json('{"worker_id": "w0"}')
    with pytest.raises(ValueError, match="'epoch' must be an int >= 0"):
        WorkerRecord.from_json('{"worker_id": "w0", "address": "a:1", "epoch": -1}')
    with pytest.raises(ValueError, match="not JSON"):
        WorkerRecord.from_json("{")


def test_timing_validation():
    rec = WorkerRecord("w0", "a:1")
    with pytest.raises(ValueError, match="heartbeat_s must be in"):
        RedisRegistration(REDIS_URL, rec, ttl_s=1.0, heartbeat_s=2.0)
    with pytest.raises(ValueError, match="poll_s must be > 0"):
        RedisMembershipWatcher(REDIS_URL, None, poll_s=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="absent_grace_s must be >= 0"):
        RedisMembershipWatcher(REDIS_URL, None, absent_grace_s=-1)  # type: ignore[arg-type]


async def test_registration_is_seen_by_the_watcher_and_removed_on_stop(prefix):
    seen: list[dict[str, WorkerRecord]] = []

    async def on_members(members):
        seen.append(members)

    rec = WorkerRecord("w0", "127.0.0.1:5000", epoch=3, block_size=16, kv_capacity_tokens=1024)
    reg = RedisRegistration(REDIS_URL, rec, prefix=prefix, ttl_s=5.0)
    watcher = RedisMembershipWatcher(
        REDIS_URL, on_members, prefix=prefix, poll_s=0.05, absent_grace_s=0
    )
    await reg.start()
    try:
        assert reg.num_beats == 1
        ttl_ms = redis.Redis.from_url(REDIS_URL).pttl(worker_key(prefix, "w0"))
        assert 0 < ttl_ms <= 5000
        await watcher.poll_once()
        assert seen[-1] == {"w0": rec}
    finally:
        await reg.stop()
    await watcher.poll_once()
    assert seen[-1] == {}
    await watcher.stop()


async def test_key_expires_without_heartbeat(prefix):
    rec = WorkerRecord("w1", "127.0.0.1:5001")
    reg = RedisRegistration(REDIS_URL, rec, prefix=prefix, ttl_s=0.2, heartbeat_s=0.1)
    assert await reg.beat()  # one write, no heartbeat task
    r = redis.Redis.from_url(REDIS_URL)
    assert r.exists(worker_key(prefix, "w1"))
    members: list = []

    async def on_members(m):
        members.append(m)

    watcher = RedisMembershipWatcher(
        REDIS_URL, on_members, prefix=prefix, poll_s=0.05, absent_grace_s=0
    )
    for _ in range(100):  # bounded: the key expires after 0.2 s
        await watcher.poll_once()
        if members[-1] == {}:
            break
        await asyncio.sleep(0.05)
    assert members[-1] == {}
    await watcher.stop()
    await reg.stop()


async def test_malformed_values_are_skipped(prefix, caplog):
    r = redis.Redis.from_url(REDIS_URL)
    r.set(f"{prefix}worker:bad", "not json")
    r.set(f"{prefix}worker:good", WorkerRecord("good", "h:1").to_json())
    got: list = []

    async def on_members(m):
        got.append(m)

    watcher = RedisMembershipWatcher(REDIS_URL, on_members, prefix=prefix, poll_s=1)
    await watcher.poll_once()
    assert list(got[-1]) == ["good"]
    assert "malformed" in caplog.text
    await watcher.stop()


async def test_redis_down_keeps_last_membership_and_logs_once(caplog):
    calls: list = []

    async def on_members(m):
        calls.append(m)

    watcher = RedisMembershipWatcher(DEAD_URL, on_members, poll_s=0.05)
    watcher.members = {"w0": WorkerRecord("w0", "h:1")}
    with caplog.at_level(logging.WARNING, logger="edge.registry"):
        for _ in range(3):
            await watcher.poll_once()
    assert watcher.redis_down and calls == []
    assert watcher.members == {"w0": WorkerRecord("w0", "h:1")}
    assert watcher.num_polls == 3
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "last known 1 workers" in warnings[0].getMessage()
    await watcher.stop()


async def test_registration_survives_redis_down(caplog):
    reg = RedisRegistration(DEAD_URL, WorkerRecord("w0", "h:1"), ttl_s=1.0)
    with caplog.at_level(logging.WARNING, logger="edge.registry"):
        assert not await reg.beat()
        assert not await reg.beat()
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    await reg.stop()


async def test_a_registry_that_lost_its_data_does_not_empty_the_fleet(prefix, caplog):
    """Redis restarted empty: every key is gone at once. The watcher keeps reporting the
    workers for the grace window; those that re-register in it are never removed, and one
    that stays away is removed once the window has passed."""
    now = [100.0]
    seen: list[dict[str, WorkerRecord]] = []

    async def on_members(m):
        seen.append(m)

    r = redis.Redis.from_url(REDIS_URL)
    recs = {w: WorkerRecord(w, f"127.0.0.1:{5000 + i}") for i, w in enumerate(("w0", "w1"))}
    for rec in recs.values():
        r.set(worker_key(prefix, rec.worker_id), rec.to_json())
    watcher = RedisMembershipWatcher(
        REDIS_URL, on_members, prefix=prefix, poll_s=1, absent_grace_s=10, clock=lambda: now[0]
    )
    await watcher.poll_once()
    assert seen[-1] == recs
    r.delete(*(worker_key(prefix, w) for w in recs))  # the registry lost everything
    with caplog.at_level(logging.WARNING, logger="edge.registry"):
        await watcher.poll_once()
    assert seen[-1] == recs  # not taken as the truth
    assert caplog.text.count("no longer registered") == 2
    now[0] += 3.0  # w0 re-registers with its next heartbeat; w1 does not come back
    r.set(worker_key(prefix, "w0"), recs["w0"].to_json())
    await watcher.poll_once()
    assert seen[-1] == recs
    now[0] += 6.9  # 9.9 s after w1 went missing
    await watcher.poll_once()
    assert seen[-1] == recs
    now[0] += 0.2  # past the grace: w1 is removed, w0 never was
    await watcher.poll_once()
    assert seen[-1] == {"w0": recs["w0"]}
    assert all("w0" in m for m in seen)
    await watcher.stop()
    r.close()


async def test_a_refused_password_is_not_reported_as_registered(redis_url, prefix, caplog):
    """The Redis here has no password: AUTH with one is refused. start() says so (the worker
    logs "registered" only on True), and the password appears in no log line."""
    url = redis_url.replace("redis://", "redis://kvroute-nobody:hunter2-secret@")
    reg = RedisRegistration(url, WorkerRecord("w0", "h:1"), prefix=prefix, ttl_s=1.0)
    with caplog.at_level(logging.DEBUG):
        assert not await reg.start()
        await reg.stop()
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    assert not any("hunter2" in r.getMessage() for r in caplog.records)


def test_redacted_url_hides_only_the_password():
    assert redacted_url("redis://u:pw@10.0.0.1:6380/2") == "redis://u:***@10.0.0.1:6380/2"
    assert redacted_url("rediss://:pw@[::1]:6379") == "rediss://:***@[::1]:6379"
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted_url("redis://u@h") == "redis://u@h"
    assert redacted_url("-") == "-"
