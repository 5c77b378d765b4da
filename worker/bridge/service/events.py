"""The bridge's event side: follow an engine's ZMQ KV-event publisher, translate, fan out.

::

    engine PUB ──[topic, seq, payload]──► SUB ─┐
    engine ROUTER ◄─[b"", start]── DEALER ─────┤  EngineEventFollower (one task, owns
                  ──[b"", topic, seq, payload]…│  the EventTranslator: no locks)
                  ──[b"", topic, -1, b""]──────┘
                                               │ translator.take_batches()
                                               ▼
                                          EventHub: replay buffer of our batches, one
                                          bounded queue per SubscribeKvEvents stream

Sockets. The engine's replay ROUTER always binds, so the bridge connects its DEALER. The
PUB side depends on how the engine was configured: vLLM binds its PUB when its endpoint has
a wildcard (``tcp://*:5557``: the bridge connects, ``--events``) and connects it otherwise
(``tcp://127.0.0.1:5557``: the bridge binds, ``--events-bind``).

Sequencing is the translator's (:mod:`worker.bridge.translate`): on start the follower asks
the replay socket for everything from seq 0; a gap in the live stream asks for the missing
seqs while live frames wait in the SUB socket; a replay that does not answer within
``replay_timeout_s`` is given up (the translator then starts a new epoch of ours rather
than guess). Each replay round is bounded (``MAX_REPLAY_ROUNDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvroute_proto import codec
from kvroute_proto.events import EventBatch, LoadReport
from worker.bridge.engine_wire import EngineReplayEnd, EngineWireError, decode_frames
from worker.bridge.translate import EventTranslator, ReplayFrom
from worker.service.engine_runner import Subscription

log = logging.getLogger("kvroute.bridge.events")

MAX_REPLAY_ROUNDS = 8  # replay requests in a row for one gap (each must make progress)
MAX_REPLAY_FRAMES = 1_000_000  # frames read from one replay answer at most


@dataclass(frozen=True, slots=True)
class EventSourceConfig:
    """Where the engine publishes. Exactly one of ``connect`` / ``bind`` (the PUB side);
    ``replay``: the engine's replay ROUTER (None: gaps cannot be filled, they start a new
    epoch); ``topic``: the SUB filter (b"": every topic)."""

    connect: str | None = None
    bind: str | None = None
    replay: str | None = None
    topic: bytes = b""
    replay_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if (self.connect is None) == (self.bind is None):
            raise ValueError("give exactly one of --events (connect) and --events-bind")
        for name in ("connect", "bind", "replay"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(
                    f"{'--events' if name == 'connect' else '--events-' + name} must be a ZMQ "
                    f"endpoint such as tcp://127.0.0.1:5557, got {value!r}"
                )
        if self.replay_timeout_s <= 0:
            raise ValueError(f"replay_timeout_s must be > 0, got {self.replay_timeout_s}")


@dataclass(slots=True)
class FollowerCounters:
    """What the follower saw on the wire (translation counters are the translator's)."""

    frames_received: int = 0
    frames_malformed: int = 0
    replay_requests: int = 0
    replay_frames: int = 0
    replay_timeouts: int = 0


class EventHub:
    """Our translated batches: a replay buffer of the current epoch and the subscribers."""

    def __init__(
        self, translator: EventTranslator, replay_buffer_size: int, subscriber_queue_size: int
    ) -> None:
        self.translator = translator
        self._buffer: deque[EventBatch] = deque(maxlen=max(replay_buffer_size, 1))
        self._subs: set[Subscription] = set()
        self._queue_size = subscriber_queue_size
        self.num_published = 0
        self.closed = False

    def pump(self) -> None:
        """Publish what the translator produced since the last call (call after each
        translator operation, on the event loop)."""
        for batch in self.translator.take_batches():
            if self._buffer and self._buffer[-1].epoch != batch.epoch:
                self._buffer.clear()
            self._buffer.append(batch)
            self.num_published += 1
            msg = codec.stream_message_to_pb(batch)
            for sub in self._subs:
                sub.push(msg)

    def publish_load(self, load: LoadReport) -> None:
        self.translator.publish_load(load)
        self.pump()

    def subscribe(self, who: str, epoch: int, after_seq: int) -> Subscription:
        """A subscriber that has seen ``(epoch, after_seq)``: its missing batches when the
        buffer holds them, else a snapshot as of our last seq; live batches follow."""
        self.pump()
        sub = Subscription(who, self._queue_size)
        last = self._buffer[-1].seq if self._buffer else 0
        current = self.translator.epoch
        oldest = self._buffer[0].seq if self._buffer else last + 1
        if epoch == current and oldest - 1 <= after_seq <= last:
            sub.initial = [codec.stream_message_to_pb(b) for b in self._buffer if b.seq > after_seq]
        else:
            sub.initial = [codec.stream_message_to_pb(self.translator.snapshot())]
        if self.closed:
            sub.close()
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def close(self) -> None:
        """End every stream (shutdown); later subscribers get their first messages only."""
        self.closed = True
        for sub in self._subs:
            sub.close()

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)


class EngineEventFollower:
    """One task that reads the engine's live and replay sockets and feeds the translator."""

    def __init__(self, config: EventSourceConfig, hub: EventHub) -> None:
        self.config = config
        self.hub = hub
        self.translator = hub.translator
        self.counters = FollowerCounters()
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self.bound_endpoint: str | None = None  # --events-bind's endpoint once bound

    def open(self) -> None:
        """Create the SUB socket (bind or connect); raises ValueError on a bad endpoint."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic)
        try:
            if self.config.bind is not None:
                sub.bind(self.config.bind)
                self.bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                assert self.config.connect is not None
                sub.connect(self.config.connect)
        except zmq.ZMQError as exc:
            sub.close()
            where = self.config.bind or self.config.connect
            raise ValueError(f"cannot open the events socket {where}: {exc}") from None
        self._sub = sub

    def close(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None

    async def run(self) -> None:
        """Catch up from the engine's replay buffer, then follow the live stream."""
        if self._sub is None:
            self.open()
        assert self._sub is not None
        if self.config.replay is not None:
            await self._replay(0)
        while True:  # until cancelled
            frames = await self._sub.recv_multipart()
            self.counters.frames_received += 1
            decoded = self._decode(frames)
            if decoded is None or isinstance(decoded, EngineReplayEnd):
                continue
            ask = self.translator.feed(decoded)
            self.hub.pump()
            if ask is not None:
                await self._fill_gap(ask)

    def _decode(self, frames: list[bytes]):  # type: ignore[no-untyped-def]
        try:
            return decode_frames(frames)
        except EngineWireError as exc:
            self.counters.frames_malformed += 1
            log.warning("dropping a malformed engine frame: %s", exc)
            return None

    async def _fill_gap(self, ask: ReplayFrom) -> None:
        if self.config.replay is None:  # nothing can fill it: the translator gives up
            self.translator.end_replay()
            self.hub.pump()
            return
        await self._replay(ask.seq)

    async def _replay(self, seq: int) -> None:
        """Replay from ``seq`` until the translator has no gap left (bounded rounds)."""
        for _ in range(MAX_REPLAY_ROUNDS):
            await self._replay_once(seq)
            ask = self.translator.end_replay()
            self.hub.pump()
            if ask is None:
                return
            seq = ask.seq
        log.warning("replay from seq %d made no end after %d rounds", seq, MAX_REPLAY_ROUNDS)

    async def _replay_once(self, seq: int) -> None:
        dealer = self._replay_socket()
        self.counters.replay_requests += 1
        log.info("asking the engine's replay socket for its batches from seq %d", seq)
        await dealer.send_multipart([b"", seq.to_bytes(8, "big", signed=True)])
        for _ in range(MAX_REPLAY_FRAMES):
            try:
                frames = await asyncio.wait_for(
                    dealer.recv_multipart(), self.config.replay_timeout_s
                )
            except TimeoutError:
                self.counters.replay_timeouts += 1
                log.warning(
                    "the engine's replay socket %s did not answer within %.1f s",
                    self.config.replay,
                    self.config.replay_timeout_s,
                )
                self._drop_replay_socket()  # a late answer must not meet the next request
                return
            if frames and frames[0] == b"":
                frames = frames[1:]
            decoded = self._decode(frames)
            if isinstance(decoded, EngineReplayEnd):
                return
            if decoded is not None:
                self.counters.replay_frames += 1
                self.translator.feed_replay(decoded)
                self.hub.pump()

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            assert self.config.replay is not None
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.config.replay)
            self._dealer = dealer
        return self._dealer

    def _drop_replay_socket(self) -> None:
        if self._dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.close(linger=0)
            self._dealer = None
