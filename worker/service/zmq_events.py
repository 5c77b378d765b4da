"""The worker's KV events in vLLM's ZMQ wire, for routers written for vLLM
(``kvroute worker --kv-events-zmq``).

One more subscriber of the engine's event stream (like a router's ``SubscribeKvEvents``),
re-published as vLLM publishes its own::

    PUB  (binds --kv-events-zmq)          [topic, seq (8 bytes big-endian), payload]
    ROUTER (binds --kv-events-zmq-replay) a DEALER's [b"", start_seq] is answered with
                                          [b"", topic, seq, payload] for every buffered
                                          frame from start_seq, then [b"", topic, -1, b""]

``seq`` counts from 0 in every process, as vLLM's does (a consumer that sees it go back
knows the worker restarted). The payload is :func:`~worker.bridge.engine_wire.
encode_vllm_batch`'s. The first frame holds every block cached when the publisher started
(the engine's snapshot, as stores); if this subscriber falls behind the engine and its
events cannot be replayed, it publishes ``AllBlocksCleared`` and the snapshot again, so a
consumer that follows the frames always holds what the worker holds. Load reports are not
part of vLLM's event wire and are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvroute_proto.codec import stream_message_from_pb
from kvroute_proto.events import AllCleared, KvEvent, Snapshot
from worker.bridge.engine_wire import encode_vllm_batch
from worker.service.engine_runner import (
    EngineRunner,
    EngineStoppedError,
    SubscriberOverflowError,
)

log = logging.getLogger("kvroute.worker.zmq_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAY_FRAMES = 10_000  # frames kept for the replay socket (vLLM's default buffer)


@dataclass(frozen=True, slots=True)
class ZmqEventsConfig:
    """``endpoint``: where the PUB socket binds (``tcp://*:5557``); ``replay``: where the
    replay ROUTER binds (None: no replay); ``topic``: the first frame of every message."""

    endpoint: str
    replay: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--kv-events-zmq", self.endpoint),
            ("--kv-events-zmq-replay", self.replay),
        ):
            if value is not None and "://" not in value:
                raise ValueError(
                    f"{flag} must be a ZMQ endpoint such as tcp://*:5557, got {value!r}"
                )


class ZmqEventPublisher:
    """Subscribes to the runner's events and publishes them in vLLM's wire."""

    def __init__(self, runner: EngineRunner, config: ZmqEventsConfig, block_size: int) -> None:
        self.runner = runner
        self.config = config
        self.block_size = block_size
        self._topic = config.topic.encode()
        self._ctx = zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._frames: deque[tuple[int, bytes]] = deque(maxlen=MAX_REPLAY_FRAMES)
        self._next_seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoints: dict[str, str] = {}  # what was bound, wildcards resolved

    def start(self) -> None:
        """Bind the sockets (OSError naming the flag when one cannot be bound) and start
        publishing."""
        self._pub = self._bind(zmq.PUB, self.config.endpoint, "--kv-events-zmq")
        if self.config.replay is not None:
            self._router = self._bind(zmq.ROUTER, self.config.replay, "--kv-events-zmq-replay")
            self._tasks.append(asyncio.create_task(self._serve_replay(self._router)))
        self._tasks.append(asyncio.create_task(self._pump()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def _bind(self, kind: int, endpoint: str, flag: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"{flag} {endpoint}: cannot bind: {exc}") from None
        self.endpoints[flag] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    async def _pump(self) -> None:
        """Follow the engine's stream; after falling behind, resubscribe from the last seq
        (a replay, or a snapshot that replaces everything published before)."""
        epoch = after = 0
        first = True
        while True:
            try:
                sub = await self.runner.subscribe("zmq-publisher", epoch, after)
            except EngineStoppedError:
                return  # shutting down
            try:
                async for msg in sub.messages():
                    item = stream_message_from_pb(msg)
                    events: tuple[KvEvent, ...]
                    if isinstance(item, Snapshot):
                        events = (() if first else (AllCleared(),)) + item.blocks
                    else:
                        events = item.events
                    epoch, after, first = item.epoch, item.seq, False
                    if events:
                        await self._publish(events)
                return  # the worker shut its streams
            except SubscriberOverflowError:
                log.warning("the ZMQ event publisher fell behind the engine; resubscribing")
            finally:
                self.runner.unsubscribe(sub)

    async def _publish(self, events: tuple[KvEvent, ...]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_vllm_batch(events, self.block_size, time.time())
        self._frames.append((seq, payload))
        assert self._pub is not None
        await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._frames):
                if seq >= start:
                    await router.send_multipart(
                        [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await router.send_multipart([identity, b"", self._topic, END_SEQ, b""])
