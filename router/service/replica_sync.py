"""Replica sync: router replicas tell each other what they place, through Redis pub/sub.

Production runs several router replicas behind one load balancer. Each sees every worker's
KV events and load reports, but only its own routing decisions, so in the tens of
milliseconds between two load reports it cannot see the requests the others just sent
(decision 0016). With ``kvroute router --replica-sync`` every replica
publishes its own picks, first tokens and finishes (:class:`~router.core.core_types.ReplicaEvent`,
from :meth:`RouterCore.set_replica_listener`) on the Redis channel ``<prefix>replica`` of the
registry it already uses, and applies everybody else's (:meth:`RouterCore.apply_replica`):
their queued prefill, active requests and predicted prefixes then count at every router
about a Redis round trip after the pick.

Wire: one :class:`ReplicaBatch` protobuf per message (``kvroute.proto``): the publisher's
random ``router_id``, a sequence number, the events, and ``leaving`` on shutdown. Nothing is
ever retried or blocked for: routing never waits on Redis.

* Publishing: a pick goes to the socket inside route(), one PUBLISH written without waiting
  (``router/service/redis_wire.py``; no task hop, so a burst of routing calls does not hold it
  back), with any first tokens and finishes queued before it in the same batch. Those
  otherwise go out from the publishing task at the event loop's next turn, together. While
  the connection is being made, or the socket's buffer is full, events queue in memory (at
  most ``max_pending``); an empty heartbeat goes out after ``heartbeat_s`` without a batch.
  Events that cannot be sent (the queue full, Redis down, a batch refused) are lost and
  counted, and a sequence number is spent so the peers see the gap.
* Timing: Redis echoes each batch to its publisher too. The time from queueing a batch's
  oldest event to its echo is about what the peers wait for it, and sets how long this
  router's own picks count ``replicas`` times (``RouterCore.observe_replica_sync_delay``;
  the auto ``--replica-sync-window-s``).
* Receiving: a batch is applied in the socket's read callback, the moment it is read. A gap
  in a peer's sequence numbers means lost events (a finish among them would
  leave a request counted forever), so the peer's requests are all dropped
  (:meth:`RouterCore.drop_replica`) and counting starts again from what arrives next; the same
  when a peer is silent for ``peer_timeout_s`` (it died), when it says it is leaving, and for
  every peer when this router's own subscription broke. Malformed batches are counted and
  ignored (field and limit logged), as are events for workers this router does not know;
  at most ``max_peer_requests`` of the others' requests are counted at once (a peer that
  never reports its ends cannot grow this router without bound).

The channel carries request ids, worker ids and prompt block hashes: it is as sensitive as
the registry, and protected the same way (the registry's Redis URL, ACL user and TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from edge.registry import DEFAULT_PREFIX
from edge.runtime import stop_task
from kvroute_proto import kvroute_pb2 as pb
from router.core.core_types import ReplicaEvent, ReplicaFinished, ReplicaFirstToken, ReplicaRouted
from router.core.pools import RouterPools
from router.core.router_core import RouterCore
from router.service.redis_wire import RedisTarget, RespConnection

log = logging.getLogger("kvroute.router.service.replica_sync")

MAX_EVENTS_PER_BATCH = 1024
MAX_ID_CHARS = 256  # request and worker ids
MAX_BLOCKS = 65_536  # block hashes of one routed request (1M tokens at block size 16)
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_PEER_TIMEOUT_S = 5.0
DEFAULT_MAX_PENDING = 100_000
DEFAULT_MAX_PEER_REQUESTS = 100_000  # the others' requests counted at once, at most
MAX_TIMED_BATCHES = 1024  # own batches awaiting their echo, at most
COUNTER_NAMES = (  # ReplicaSync.counters (and the /metrics families built from them)
    "batches_published",
    "events_published",
    "events_dropped",  # queue full, or Redis refused the batch
    "batches_received",
    "events_applied",
    "events_ignored",  # unknown worker, a request already counted, an unseen end
    "events_over_limit",  # a peer's pick past max_peer_requests: not counted
    "batches_malformed",
    "gaps",
    "peers_dropped",
    "requests_dropped",  # peers' requests forgotten (gap, silence, leaving)
)


class ReplicaDecodeError(ValueError):
    """A replica batch that is not what a kvroute router publishes (names the field)."""


@dataclass(frozen=True, slots=True)
class ReplicaBatchMessage:
    """A decoded :class:`ReplicaBatch`."""

    router_id: str
    seq: int
    events: tuple[ReplicaEvent, ...]
    leaving: bool = False


def encode_batch(
    router_id: str, seq: int, events: Sequence[ReplicaEvent], *, leaving: bool = False
) -> bytes:
    """The wire form of one batch."""
    out = pb.ReplicaBatch(router_id=router_id, seq=seq, leaving=leaving)
    for event in events:
        item = out.events.add()
        if isinstance(event, ReplicaRouted):
            hashes = np.asarray(event.block_hashes, dtype="<u8").tobytes()
            item.routed.CopyFrom(
                pb.ReplicaRouted(
                    request_id=event.request_id,
                    worker_id=event.worker_id,
                    prompt_tokens=event.prompt_tokens,
                    matched_tokens=event.matched_tokens,
                    block_hashes=hashes,
                    model=event.model,
                )
            )
        elif isinstance(event, ReplicaFirstToken):
            item.first_token.request_id = event.request_id
        else:
            item.finished.request_id = event.request_id
            item.finished.generated_tokens = event.generated_tokens
    return out.SerializeToString()


def _check_id(value: str, field: str) -> str:
    if not value:
        raise ReplicaDecodeError(f"{field} is empty")
    if len(value) > MAX_ID_CHARS:
        raise ReplicaDecodeError(f"{field} has {len(value)} characters, limit {MAX_ID_CHARS}")
    return value


def decode_batch(data: bytes) -> ReplicaBatchMessage:
    """Parse and check one batch; :class:`ReplicaDecodeError` names what is wrong."""
    msg = pb.ReplicaBatch()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError, or a type error for non-bytes
        raise ReplicaDecodeError(f"not a ReplicaBatch: {exc}") from None
    router_id = _check_id(msg.router_id, "router_id")
    if msg.seq < 1:
        raise ReplicaDecodeError(f"seq must be >= 1, got {msg.seq}")
    if len(msg.events) > MAX_EVENTS_PER_BATCH:
        raise ReplicaDecodeError(
            f"events has {len(msg.events)} entries, limit {MAX_EVENTS_PER_BATCH}"
        )
    events: list[ReplicaEvent] = []
    for i, item in enumerate(msg.events):
        kind = item.WhichOneof("kind")
        where = f"events[{i}]"
        if kind == "routed":
            r = item.routed
            raw = r.block_hashes
            if len(raw) % 8:
                raise ReplicaDecodeError(
                    f"{where}.routed.block_hashes has {len(raw)} bytes, not a multiple of 8"
                )
            if len(raw) // 8 > MAX_BLOCKS:
                raise ReplicaDecodeError(
                    f"{where}.routed.block_hashes has {len(raw) // 8} blocks, limit {MAX_BLOCKS}"
                )
            if r.matched_tokens > r.prompt_tokens:
                raise ReplicaDecodeError(
                    f"{where}.routed.matched_tokens {r.matched_tokens} > prompt_tokens "
                    f"{r.prompt_tokens}"
                )
            events.append(
                ReplicaRouted(
                    _check_id(r.request_id, f"{where}.routed.request_id"),
                    _check_id(r.worker_id, f"{where}.routed.worker_id"),
                    r.prompt_tokens,
                    r.matched_tokens,
                    np.frombuffer(raw, dtype="<u8").astype(np.uint64),
                    _check_id(r.model, f"{where}.routed.model") if r.model else "",
                )
            )
        elif kind == "first_token":
            rid = _check_id(item.first_token.request_id, f"{where}.first_token.request_id")
            events.append(ReplicaFirstToken(rid))
        elif kind == "finished":
            f = item.finished
            rid = _check_id(f.request_id, f"{where}.finished.request_id")
            events.append(ReplicaFinished(rid, f.generated_tokens))
        else:
            raise ReplicaDecodeError(f"{where} has no event (routed, first_token or finished)")
    return ReplicaBatchMessage(router_id, msg.seq, tuple(events), msg.leaving)


@dataclass(slots=True)
class _Peer:
    last_seq: int
    last_seen: float


class ReplicaSync:
    """One router's side of replica sync (module docstring): :meth:`start`, :meth:`close`."""

    def __init__(
        self,
        core: RouterPools | RouterCore,
        redis_url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        router_id: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_peer_requests: int = DEFAULT_MAX_PEER_REQUESTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not heartbeat_s > 0:
            raise ValueError(f"replica sync heartbeat_s must be > 0, got {heartbeat_s}")
        if not peer_timeout_s > heartbeat_s:
            raise ValueError(
                f"replica sync peer_timeout_s ({peer_timeout_s}) must be > heartbeat_s "
                f"({heartbeat_s}): a live peer would be dropped between its heartbeats"
            )
        if max_pending < 1:
            raise ValueError(f"replica sync max_pending must be >= 1, got {max_pending}")
        if max_peer_requests < 1:
            raise ValueError(
                f"replica sync max_peer_requests must be >= 1, got {max_peer_requests}"
            )
        self._max_peer_requests = max_peer_requests
        self.core = core
        self.channel = f"{prefix}replica"
        self.router_id = router_id or secrets.token_hex(8)
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._max_pending = max_pending
        self._clock = clock
        timeout = max(heartbeat_s, 1.0)
        # checked now: a URL or option the sync cannot use stops the router at its start
        self._target = RedisTarget.from_url(redis_url, client_options, connect_timeout_s=timeout)
        self._pub: RespConnection | None = None  # the publishing connection, while open
        self._sub: RespConnection | None = None  # the subscription, while open
        self._pub_lost_events = False  # events dropped since the last batch: spend a seq
        # this router's events not yet published, with when each was queued
        self._pending: deque[tuple[ReplicaEvent, float]] = deque()
        # when each recent batch's oldest event was queued, by sequence number: the echo
        # of a batch times the sync's delivery (RouterCore.observe_replica_sync_delay)
        self._sent: dict[int, float] = {}
        self.last_delivery_s: float | None = None  # the last echo's delay
        self._wake = asyncio.Event()
        self._seq = 0
        self._peers: dict[str, _Peer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()  # set while the subscription is live
        # set when a connect attempt or a batch fails, cleared by a batch Redis takes; with
        # no connection it tells Redis down (events dropped) from the first connect (queued)
        self._publish_down = False
        self._subscribe_down = False
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    @property
    def peers(self) -> list[str]:
        """The other routers heard from (and not dropped since)."""
        return list(self._peers)

    async def start(self) -> None:
        """Start publishing this router's events and applying the others'."""
        if self._tasks:
            raise RuntimeError("replica sync already started")
        self.core.set_replica_listener(self._on_local)
        self._tasks = [
            asyncio.create_task(self._subscribe_loop(), name="replica-subscribe"),
            asyncio.create_task(self._publish_loop(), name="replica-publish"),
        ]
        log.info("replica sync: router %s on channel %s", self.router_id, self.channel)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Stop listening; publish what is queued and a ``leaving`` batch (best effort,
        within ``timeout_s``), forget every peer's requests, close the connections."""
        self.core.set_replica_listener(None)
        stopped = await asyncio.gather(*(stop_task(t, timeout_s=timeout_s) for t in self._tasks))
        for task, ok in zip(self._tasks, stopped, strict=True):
            if not ok:
                log.warning(
                    "replica sync: %s did not stop within %.1f s", task.get_name(), timeout_s
                )
        pub = self._pub
        if self._tasks and pub is not None and pub.is_open:
            with contextlib.suppress(TimeoutError, RedisError, OSError):
                async with asyncio.timeout(timeout_s):
                    await self._flush(pub)
                    self._send(pub, (), self._clock(), leaving=True)
                    await pub.call("PING")  # every batch before it has been taken
        self._tasks = []
        for router_id in list(self._peers):
            self._drop(router_id, "this router is stopping")
        for conn in (self._pub, self._sub):
            if conn is not None:
                conn.close()
        self._pub = self._sub = None

    # ---- publishing ------------------------------------------------------------------------

    def _on_local(self, event: ReplicaEvent) -> None:
        """The core's listener: runs inside route(), so it never waits. A pick goes to the
        socket at once (with whatever is queued before it, in order, as one batch): the
        others must count it before their next route. First tokens and finishes queue for
        the publishing task, which sends them together at the loop's next turn. With no
        connection they queue while it is being made, and are dropped (counted; the peers
        are shown a gap) while Redis is unreachable."""
        pub = self._pub
        if pub is None and self._publish_down:  # Redis is down: nobody to tell
            self._lose(1)
            return
        if len(self._pending) >= self._max_pending:
            self._lose(1)
            return
        self._pending.append((event, self._clock()))
        if isinstance(event, ReplicaRouted) and pub is not None and pub.can_send_now():
            self._send_pending(pub)
        else:
            self._wake.set()

    def _lose(self, n: int) -> None:
        self.counters["events_dropped"] += n
        if not self._pub_lost_events:
            self._pub_lost_events = True
            self._seq += 1  # the peers must see a gap and forget what this router told them

    async def _publish_loop(self) -> None:
        while True:
            try:
                pub = await RespConnection.open(
                    self._target, name=f"kvroute-router-{self.router_id}-publish"
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self._publish_failed(exc)
                await asyncio.sleep(min(self._heartbeat_s, 0.5))
                continue
            self._pub = pub
            try:
                while pub.is_open:
                    woken = False
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._heartbeat_s):
                            woken = await self._wake.wait()
                    self._wake.clear()
                    if not pub.is_open:
                        break
                    if self._pending:
                        await self._flush(pub)
                    elif not woken:  # quiet for heartbeat_s: the peers must know we live
                        self._send(pub, (), self._clock())
            except (RedisError, OSError) as exc:
                reason: BaseException = exc
            else:
                reason = pub.close_reason or ConnectionError("connection closed")
            # (cancelled by close(), the loop leaves the connection to it for the last batches)
            pub.close()
            self._pub = None
            self._publish_failed(reason)
            await asyncio.sleep(min(self._heartbeat_s, 0.5))

    def _publish_failed(self, exc: BaseException) -> None:
        if self._pending:
            self._lose(len(self._pending))
            self._pending.clear()
        if not self._publish_down:
            log.warning("replica sync: cannot publish to Redis (%s); events are dropped", exc)
        self._publish_down = True

    async def _flush(self, pub: RespConnection) -> None:
        while self._pending:
            await pub.wait_writable()  # the transport's buffer is below its high mark
            if not pub.is_open:
                raise ConnectionError("the connection to Redis closed")
            self._send_batch(pub)

    def _send_pending(self, pub: RespConnection) -> None:
        """Everything queued, written now (in order)."""
        while self._pending:
            self._send_batch(pub)

    def _send_batch(self, pub: RespConnection) -> None:
        n = min(len(self._pending), MAX_EVENTS_PER_BATCH)
        items = [self._pending.popleft() for _ in range(n)]
        self._send(pub, [event for event, _ in items], items[0][1])

    def _send(
        self,
        pub: RespConnection,
        events: Sequence[ReplicaEvent],
        queued_at: float,
        *,
        leaving: bool = False,
    ) -> None:
        """Write one batch to the socket now; its reply is counted when it comes."""
        self._seq += 1  # spent even if the batch is lost: the peers must see the gap
        self._pub_lost_events = False
        sent = self._sent
        sent[self._seq] = queued_at
        if len(sent) > MAX_TIMED_BATCHES:  # echoes lost with a broken subscription
            del sent[next(iter(sent))]
        data = encode_batch(self.router_id, self._seq, events, leaving=leaving)
        n = len(events)
        pub.send("PUBLISH", self.channel, data, on_reply=lambda reply: self._published(reply, n))

    def _published(self, reply: Any, n: int) -> None:
        if isinstance(reply, BaseException):
            self.counters["events_dropped"] += n
            if not self._publish_down:
                log.warning(
                    "replica sync: Redis did not take a batch (%s); its events are dropped", reply
                )
            self._publish_down = True
            return
        if self._publish_down:
            log.info("replica sync: publishing again")
        self._publish_down = False
        self.counters["batches_published"] += 1
        self.counters["events_published"] += n

    # ---- receiving -------------------------------------------------------------------------

    async def _subscribe_loop(self) -> None:
        while True:
            sub: RespConnection | None = None
            try:
                sub = await RespConnection.open(
                    self._target,
                    name=f"kvroute-router-{self.router_id}-subscribe",
                    on_message=self._on_push,
                )
                async with asyncio.timeout(self._target.connect_timeout_s):
                    await sub.call("SUBSCRIBE", self.channel)
                self._sub = sub
                if self._subscribe_down:
                    log.info("replica sync: subscribed again")
                self._subscribe_down = False
                self.subscribed.set()
                while not sub.closed.done():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._heartbeat_s):
                            await asyncio.shield(sub.closed)
                    self.expire_peers()
                raise ConnectionError(f"Redis closed the subscription ({sub.close_reason})")
            except (RedisError, OSError, TimeoutError) as exc:
                if sub is not None:
                    sub.close()
                self._sub = None
                self.subscribed.clear()
                if not self._subscribe_down:
                    log.warning(
                        "replica sync: subscription to Redis lost (%s); the other routers' "
                        "requests are forgotten until it is back",
                        exc,
                    )
                self._subscribe_down = True
                for router_id in list(self._peers):  # their events went past us
                    self._drop(router_id, "this router's subscription broke")
                await asyncio.sleep(min(self._heartbeat_s, 1.0))

    def _on_push(self, channel: bytes, data: bytes) -> None:
        """The subscription's read callback: apply a batch the moment it is read."""
        try:
            self.on_message(data)
        except Exception:  # a bug here must not close the subscription
            self.counters["batches_malformed"] += 1
            log.exception("replica sync: applying a batch failed")

    def on_message(self, data: bytes) -> None:
        """Apply one published batch (the subscription calls it; tests may too)."""
        try:
            batch = decode_batch(data)
        except ReplicaDecodeError as exc:
            self.counters["batches_malformed"] += 1
            log.warning("replica sync: ignoring a malformed batch: %s", exc)
            return
        if batch.router_id == self.router_id:  # our own, echoed by the channel: it took
            queued_at = self._sent.pop(batch.seq, None)  # about as long to reach the peers
            if queued_at is not None:
                self.last_delivery_s = delay = self._clock() - queued_at
                self.core.observe_replica_sync_delay(delay)
            return
        self.counters["batches_received"] += 1
        peer = self._peers.get(batch.router_id)
        if batch.leaving:
            if peer is not None:
                self._drop(batch.router_id, "it is stopping")
            return
        now = self._clock()
        if peer is None:
            peer = self._peers[batch.router_id] = _Peer(batch.seq - 1, now)
            log.info("replica sync: router %s joined", batch.router_id)
        if batch.seq <= peer.last_seq:
            return  # a duplicate
        if batch.seq != peer.last_seq + 1:
            self.counters["gaps"] += 1
            n = self.core.drop_replica(batch.router_id)
            self.counters["requests_dropped"] += n
            log.warning(
                "replica sync: %d batch(es) from router %s lost; forgot its %d request(s)",
                batch.seq - peer.last_seq - 1,
                batch.router_id,
                n,
            )
        peer.last_seq = batch.seq
        peer.last_seen = now
        for event in batch.events:
            if (
                isinstance(event, ReplicaRouted)
                and self.core.num_replica_inflight >= self._max_peer_requests
            ):
                # a peer that never ends its requests must not grow this router without bound
                if not self.counters["events_over_limit"]:
                    log.warning(
                        "replica sync: %d of the other routers' requests counted, the limit; "
                        "further picks are not counted until some end",
                        self._max_peer_requests,
                    )
                self.counters["events_over_limit"] += 1
                continue
            if self.core.apply_replica(batch.router_id, event):
                self.counters["events_applied"] += 1
            else:
                self.counters["events_ignored"] += 1

    def expire_peers(self) -> None:
        """Forget peers silent for longer than ``peer_timeout_s`` (they died)."""
        now = self._clock()
        for router_id, peer in list(self._peers.items()):
            if now - peer.last_seen > self._peer_timeout_s:
                self._drop(router_id, f"silent for {now - peer.last_seen:.1f} s")

    def _drop(self, router_id: str, why: str) -> None:
        del self._peers[router_id]
        n = self.core.drop_replica(router_id)
        self.counters["peers_dropped"] += 1
        self.counters["requests_dropped"] += n
        log.info("replica sync: forgot router %s (%s) and its %d request(s)", router_id, why, n)
