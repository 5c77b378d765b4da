"""Relay streams: one worker->router stream that carries every attached request's messages.

A router opens ``Relay(stream_id)`` once per connection and then starts requests with
Generate as before, naming the stream in the metadata (``RELAY_METADATA_KEY``). Such a call
puts its messages into the stream's :class:`RelayOutbox` instead of yielding them; the
outbox's writer sends everything put since its last write as one ``RelayBatch``: the
requests an engine step advanced cost the router one read, not one each (decision 0033).
While the router is behind (its flow-control window holds the writer), a request's chunks
pile up and are merged into one, as a request's own stream coalesces (decision 0030).

Requests may also be started on the stream itself, with no call of their own (decision
0034, worker/service/relay_starts.py): their messages go into the same outbox, and one that
ends without a Finished puts its end (a status) there.

Lifecycle: ``RelayRegistry.open`` registers a stream; its first batch is empty but for
``accepts_starts`` (the router knows the stream is registered); ``close`` (the router's call
ended) unregisters it and makes every later ``put`` raise :class:`RelayClosedError`, which
ends the attached calls (the engine aborts their requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvroute_proto import kvroute_pb2 as pb

# the Generate metadata naming the relay stream a call's messages go to
RELAY_METADATA_KEY = "kvroute-relay-stream"
# the trailing metadata of an attached call that ended with OK: the number of the relay
# batch (1 = the first, empty one) by which all its messages were sent. The call's status
# may reach the router before that batch; the router waits for it, so a call that ended
# without a Finished is told from one whose Finished is still on its way.
RELAY_BATCH_KEY = "kvroute-relay-batch"
MAX_STREAM_ID_CHARS = 128


class RelayClosedError(Exception):
    """The relay stream a Generate call is attached to has ended."""


class _Pending:
    """What one request put since the last batch: its chunks merged, then its Finished or,
    for a request started on the stream, its end (decision 0034)."""

    __slots__ = ("chunk", "end", "finished")

    def __init__(self) -> None:
        self.chunk: pb.GenerateResponse | None = None
        self.finished: pb.GenerateResponse | None = None
        self.end: pb.RelayEnd | None = None


class RelayOutbox:
    """The messages waiting for one relay stream's next batch."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self._pending: dict[str, _Pending] = {}
        self._cancelled: list[str] = []  # cancels taken since the last batch
        self._wake = asyncio.Event()
        self._sent = asyncio.Event()  # set when a batch was handed to grpc
        self._writing = False  # a batch taken and not yet handed to grpc
        self.closed = False
        self.num_batches = 0

    def put(self, response: pb.GenerateResponse) -> None:
        """Queue one Generate message (a chunk or the Finished) for the next batch."""
        if self.closed:
            raise RelayClosedError(f"relay stream {self.stream_id!r} has ended")
        pending = self._pending.get(response.request_id)
        if pending is None:
            pending = self._pending[response.request_id] = _Pending()
        if response.HasField("finished"):
            pending.finished = response
        elif pending.chunk is None:
            pending.chunk = response
        else:  # the writer is behind: one chunk for all of them, in order
            chunk = pending.chunk.chunk
            chunk.token_ids.extend(response.chunk.token_ids)
            chunk.text += response.chunk.text
        self._wake.set()

    def end(self, request_id: str, code: int, details: str) -> None:
        """A started request ended without a Finished (``code``: a gRPC status code)."""
        if self.closed:
            raise RelayClosedError(f"relay stream {self.stream_id!r} has ended")
        pending = self._pending.get(request_id)
        if pending is None:
            pending = self._pending[request_id] = _Pending()
        pending.end = pb.RelayEnd(request_id=request_id, code=code, details=details)
        self._wake.set()

    def cancelled(self, request_id: str) -> None:
        """The router cancelled ``request_id``: what it put and was not sent is dropped,
        and the next batch acknowledges the cancel (nothing of it comes after that)."""
        self._pending.pop(request_id, None)
        self._cancelled.append(request_id)
        self._wake.set()

    def take(self) -> pb.RelayBatch:
        """Everything put since the last call, as one batch (each request in put order)."""
        batch = pb.RelayBatch(cancelled=self._cancelled)
        self._cancelled = []
        responses = batch.responses
        for pending in self._pending.values():
            if pending.chunk is not None:
                responses.append(pending.chunk)
            if pending.finished is not None:
                responses.append(pending.finished)
            if pending.end is not None:
                batch.ends.append(pending.end)
        self._pending.clear()
        self._wake.clear()
        return batch

    async def batches(self, *, accepts_starts: bool = True) -> AsyncIterator[pb.RelayBatch]:
        """A batch with only ``accepts_starts`` (registered), then one batch per wake-up,
        until cancelled or closed."""
        self.num_batches = 1
        yield pb.RelayBatch(accepts_starts=accepts_starts)
        while True:
            await self._wake.wait()
            if self.closed:
                return
            self.num_batches += 1
            self._writing = True
            yield self.take()
            self._writing = False
            self._sent.set()

    async def flushed(self) -> None:
        """Return once everything put so far has been handed to grpc (or the stream
        ended): a call that fails after its chunks can let them go first."""
        while (self._pending or self._cancelled or self._writing) and not self.closed:
            self._sent.clear()
            await self._sent.wait()

    def close(self) -> None:
        """The stream ended: later puts raise, waiters return."""
        self.closed = True
        self._sent.set()
        self._wake.set()


async def send_all(outbox: RelayOutbox, responses: AsyncIterator[pb.GenerateResponse]) -> str:
    """Put each of a call's messages on ``outbox``; once they were all sent, the value of
    its trailing ``RELAY_BATCH_KEY``."""
    async for response in responses:
        outbox.put(response)
    await outbox.flushed()
    return str(outbox.num_batches)


async def own_stream_or_relay(
    outbox: RelayOutbox | None, responses: AsyncIterator[pb.GenerateResponse], context: Any
) -> AsyncIterator[pb.GenerateResponse]:
    """A Generate call's messages: yielded on its own stream or, when its metadata named a
    relay stream (``outbox``), put there; the call then carries only the batch they went by
    (``RELAY_BATCH_KEY`` in its trailing metadata)."""
    if outbox is None:
        async for response in responses:
            yield response
    else:
        sent = await send_all(outbox, responses)
        context.set_trailing_metadata(((RELAY_BATCH_KEY, sent),))


class RelayRegistry:
    """The relay streams open on this worker, by stream id."""

    def __init__(self) -> None:
        self._outboxes: dict[str, RelayOutbox] = {}

    def open(self, stream_id: str) -> RelayOutbox:
        """Register a stream; raises ValueError for an empty, too long or taken id."""
        if not stream_id or len(stream_id) > MAX_STREAM_ID_CHARS:
            raise ValueError(
                f"stream_id must be 1 to {MAX_STREAM_ID_CHARS} characters, got {len(stream_id)}"
            )
        if stream_id in self._outboxes:
            raise ValueError(f"stream_id {stream_id!r} is already open")
        outbox = self._outboxes[stream_id] = RelayOutbox(stream_id)
        return outbox

    def close(self, outbox: RelayOutbox) -> None:
        """Unregister ``outbox`` and end its stream (its calls end at their next message)."""
        outbox.close()
        if self._outboxes.get(outbox.stream_id) is outbox:
            del self._outboxes[outbox.stream_id]

    def find(self, metadata: tuple[tuple[str, str | bytes], ...]) -> RelayOutbox | None:
        """The outbox a Generate call's metadata names, or None when it names none; raises
        RelayClosedError when it names a stream that is not open."""
        for key, value in metadata:
            if key == RELAY_METADATA_KEY:
                stream_id = value if isinstance(value, str) else value.decode()
                outbox = self._outboxes.get(stream_id)
                if outbox is None:
                    raise RelayClosedError(f"relay stream {stream_id!r} is not open")
                return outbox
        return None

    @property
    def outboxes(self) -> list[RelayOutbox]:
        return list(self._outboxes.values())
