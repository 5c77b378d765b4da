"""Fleet membership: a static worker list, or a Redis registry with TTL heartbeats.

Redis layout (one key per worker, a JSON value, expiring unless refreshed)::

    {prefix}worker:{worker_id} = {"worker_id", "address", "epoch", "block_size",
                                  "kv_capacity_tokens"}     EX ttl_s

* A worker runs :class:`RedisRegistration`: it writes its key on start, rewrites it with a
  fresh TTL every ``heartbeat_s`` (default ttl/3), and deletes it on a clean stop. A crashed
  worker's key expires after ``ttl_s``.
* A router runs :class:`RedisMembershipWatcher`: every ``poll_s`` it SCANs the prefix and
  hands the full set of live records to a callback, which adds and removes connections.
  Polling (rather than keyspace notifications) needs no Redis configuration and recovers by
  itself after an outage. While Redis is unreachable the watcher keeps the last known
  membership (routing goes on) and logs the outage once, and once more when it ends.
* A registry that comes back *empty* (Redis restarted without persistence, a flush) is not
  taken as the truth: a worker missing from a poll is still reported for
  ``absent_grace_s`` (default one TTL), long enough for live workers to re-register with
  their next heartbeat. Only a worker absent for the whole window is removed, so a registry
  that lost its data costs the router no connection, no load history and no index.

The key layout and record format are a contract between worker and router, so this module
lives in the shared package; it imports only the standard library and ``redis``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from edge.runtime import stop_task

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "kvroute:"
DEFAULT_TTL_S = 10.0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker announces about itself in the registry."""

    worker_id: str
    address: str  # HOST:PORT the router dials
    epoch: int = 0
    block_size: int = 0
    kv_capacity_tokens: int = 0
    # the model it serves (its pool on a router serving several: router.core.pools); for
    # operators and tools: the router takes it from the worker's GetLoad
    model: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> WorkerRecord:
        """Parse a registry value; raises ValueError naming the bad field."""
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"registry value is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("registry value must be a JSON object")
        for name in ("worker_id", "address"):
            if not isinstance(obj.get(name), str) or not obj[name]:
                raise ValueError(f"registry value field {name!r} must be a non-empty string")
        for name in ("epoch", "block_size", "kv_capacity_tokens"):
            if not isinstance(obj.get(name, 0), int) or obj.get(name, 0) < 0:
                raise ValueError(f"registry value field {name!r} must be an int >= 0")
        if not isinstance(obj.get("model", ""), str):
            raise ValueError("registry value field 'model' must be a string")
        return cls(
            worker_id=obj["worker_id"],
            address=obj["address"],
            epoch=obj.get("epoch", 0),
            block_size=obj.get("block_size", 0),
            kv_capacity_tokens=obj.get("kv_capacity_tokens", 0),
            model=obj.get("model", ""),
        )


def redacted_url(url: str) -> str:
    """``url`` fit for a log line: a password in it (``redis://user:PASS@host``) becomes
    ``***``; the rest (scheme, user, host, port, database) stays, to tell where it points."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def worker_key(prefix: str, worker_id: str) -> str:
    """The registry key of one worker."""
    return f"{prefix}worker:{worker_id}"


def _check_timing(ttl_s: float, period_s: float, period_name: str) -> None:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    if not 0 < period_s < ttl_s:
        raise ValueError(f"{period_name} must be in (0, ttl_s={ttl_s}), got {period_s}")


class RedisRegistration:
    """Worker side: keep ``record`` registered while running (start / stop).

    Redis being down never stops the worker: the heartbeat logs once per outage and retries
    at the next beat.
    """

    def __init__(
        self,
        redis_url: str,
        record: WorkerRecord,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = DEFAULT_TTL_S,
        heartbeat_s: float | None = None,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        heartbeat_s = ttl_s / 3 if heartbeat_s is None else heartbeat_s
        _check_timing(ttl_s, heartbeat_s, "heartbeat_s")
        self.record = record
        self.key = worker_key(prefix, record.worker_id)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._heartbeat_s = heartbeat_s
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=heartbeat_s,
            socket_connect_timeout=heartbeat_s,
            **(client_options or {}),  # TLS and ACL user (edge.tls.RedisAuth)
        )
        self._task: asyncio.Task[None] | None = None
        self._down = False
        self.num_beats = 0  # successful writes, for tests and logs

    async def beat(self) -> bool:
        """Write the record with a fresh TTL once; False (logged once) when Redis is down."""
        try:
            await self._redis.set(self.key, self.record.to_json(), px=self._ttl_ms)
        except (RedisError, OSError) as exc:
            if not self._down:
                log.warning("registry: cannot write %s (%s); retrying every beat", self.key, exc)
            self._down = True
            return False
        if self._down:
            log.info("registry: Redis reachable again; %s registered", self.key)
        self._down = False
        self.num_beats += 1
        return True

    async def start(self) -> bool:
        """Register now (best effort) and keep the registration alive in the background;
        whether this first write reached Redis (a refused password, Redis down: False, logged,
        retried every beat)."""
        written = await self.beat()
        self._task = asyncio.create_task(self._run(), name=f"registry-heartbeat-{self.key}")
        return written

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            await self.beat()

    async def stop(self) -> None:
        """Stop the heartbeat and remove the key, so routers drop this worker at once."""
        if self._task is not None:
            if not await stop_task(self._task):
                log.warning("registry: the heartbeat of %s did not stop", self.key)
            self._task = None
        try:
            await self._redis.delete(self.key)
        except (RedisError, OSError) as exc:
            log.warning("registry: cannot delete %s (%s); it expires by itself", self.key, exc)
        await self._redis.aclose()


MembershipCallback = Callable[[dict[str, WorkerRecord]], Awaitable[None]]


class RedisMembershipWatcher:
    """Router side: poll the registry and report the live members (by worker_id)."""

    def __init__(
        self,
        redis_url: str,
        on_members: MembershipCallback,
        *,
        prefix: str = DEFAULT_PREFIX,
        poll_s: float = DEFAULT_TTL_S / 3,
        absent_grace_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if not absent_grace_s >= 0:  # NaN too
            raise ValueError(f"absent_grace_s must be >= 0, got {absent_grace_s}")
        self._prefix = prefix
        self._poll_s = poll_s
        self._absent_grace_s = absent_grace_s
        self._clock = clock
        self._absent_since: dict[str, float] = {}  # reported, but missing from the registry
        self._on_members = on_members
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=max(poll_s, 1.0),
            socket_connect_timeout=max(poll_s, 1.0),
            **(client_options or {}),  # TLS and ACL user (edge.tls.RedisAuth)
        )
        self._task: asyncio.Task[None] | None = None
        self.redis_down = False
        self.members: dict[str, WorkerRecord] = {}
        self.num_polls = 0  # completed polls (reachable or not)

    async def read_members(self) -> dict[str, WorkerRecord]:
        """One SCAN of the registry; raises RedisError/OSError when Redis is unreachable."""
        keys = [k async for k in self._redis.scan_iter(match=f"{self._prefix}worker:*")]
        members: dict[str, WorkerRecord] = {}
        if not keys:
            return members
        for key, value in zip(keys, await self._redis.mget(keys), strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                record = WorkerRecord.from_json(value)
            except ValueError as exc:
                log.warning("registry: ignoring malformed %s: %s", key, exc)
                continue
            members[record.worker_id] = record
        return members

    async def poll_once(self) -> None:
        """Read the registry and report it; on an outage keep (and report) nothing new."""
        try:
            members = await self.read_members()
        except (RedisError, OSError) as exc:
            if not self.redis_down:
                log.warning(
                    "registry: Redis unreachable (%s); routing with the last known %d workers",
                    exc,
                    len(self.members),
                )
            self.redis_down = True
            self.num_polls += 1
            return
        if self.redis_down:
            log.info("registry: Redis reachable again (%d workers registered)", len(members))
        self.redis_down = False
        self.members = self._with_grace(members)
        self.num_polls += 1
        await self._on_members(dict(self.members))

    def _with_grace(self, live: dict[str, WorkerRecord]) -> dict[str, WorkerRecord]:
        """``live`` plus the workers reported before and missing for less than the grace."""
        now = self._clock()
        report = dict(live)
        for worker_id, record in self.members.items():
            if worker_id in live:
                continue
            since = self._absent_since.setdefault(worker_id, now)
            if now - since < self._absent_grace_s:
                if since == now:
                    log.warning(
                        "registry: worker %s (%s) is no longer registered; keeping it for "
                        "up to %.1f s in case the registry lost its data",
                        worker_id,
                        record.address,
                        self._absent_grace_s,
                    )
                report[worker_id] = record
            else:
                log.info("registry: worker %s absent for %.1f s: removed", worker_id, now - since)
        for worker_id in list(self._absent_since):
            if worker_id in live or worker_id not in report:
                del self._absent_since[worker_id]
        return report

    async def start(self) -> None:
        """Poll once now, then every ``poll_s`` in the background."""
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="registry-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self.poll_once()
            except Exception:  # a callback bug must not end membership updates
                log.exception("registry: membership update failed")

    async def stop(self) -> None:
        if self._task is not None:
            if not await stop_task(self._task):
                log.warning("registry: the membership watch did not stop")
            self._task = None
        await self._redis.aclose()
