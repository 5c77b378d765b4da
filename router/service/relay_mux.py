"""The worker's relay stream: every request started, and every token streamed, on one stream.

Without it each in-flight request is a Generate call of its own, and the router pays grpc's
Python-side costs per call (its start, its status) and per message of every request (the
largest share of the router's CPU, decisions 0030 and 0033). With it a worker that offers
``Relay`` takes the requests themselves on the stream (decision 0034) and sends one
``RelayBatch`` per engine step with the messages of every request the step advanced; the
router demultiplexes them to the requests by id::

    router                                    worker
    RelayMux._write: starts, cancels -------> RelayStarts: a task per request
    RelayMux._take: batch -> Inbox per request <- RelayOutbox: chunks, Finished, RelayEnd

A ``RelayCall`` looks like the grpc call it replaces (``async for`` messages, ``cancel``,
errors raised as ``grpc.aio.AioRpcError``), so the request path (frontend.py) keeps its
retry, deadline and abort rules: a request's end without a Finished comes as a ``RelayEnd``
with the status Generate would have ended with, its deadline is timed here (and on the
worker), and cancelling it sends a cancel, which aborts the request on the worker. A cancel
is fenced: until the worker acknowledges it, whatever comes under that request id is
dropped, so an id started again at once never receives the cancelled request's tokens. A
request's chunks that arrived together are merged into one message (the router was behind),
and the stream's next batch is read once the requests the last one woke have passed theirs
on (``Pace``, decision 0043): while the router's writes lag, the worker's steps merge in its
outbox instead of becoming more messages here. When the relay stream breaks, every request
on it fails with UNAVAILABLE (retried when nothing was relayed yet). A worker that does not
offer ``Relay`` (an engine bridge, an older worker) answers UNIMPLEMENTED, and one of
decision 0033 (no ``accepts_starts``) is left: both get a Generate call per request, as
before; so does a request too large to share the stream (``MAX_START_BYTES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from kvroute_proto import kvroute_pb2 as pb

log = logging.getLogger(__name__)

RELAY_METHOD = "/kvroute.v1.Worker/Relay"
# A request larger than this goes in a Generate call of its own (a relay message must fit
# the worker's receive limit, grpc's 4 MiB by default); several starts share one message up
# to twice this.
MAX_START_BYTES = 1 << 20
# The longest a relay stream waits for the readers its last batch woke (Pace): a client
# that reads slowly or stops holds the worker's other requests back at most this long, once.
PACE_BOUND_S = 0.005
_EMPTY = grpc.aio.Metadata()
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def relay_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error of the shape a failed grpc call raises."""
    return grpc.aio.AioRpcError(code, _EMPTY, _EMPTY, details)


class _Ended:
    """The request ended without a Finished (Generate's OK without one)."""


ENDED = _Ended()
Item: TypeAlias = pb.GenerateResponse | grpc.aio.AioRpcError | _Ended


class Pace:
    """The readers a relay stream waits for before it reads the worker's next batch: those
    its last batch woke from idle, until they are done with what they took (decision 0043).
    While they write, the worker's steps merge in its outbox instead of in more messages
    here. A reader not done within ``PACE_BOUND_S`` (its client reads slowly, or not at
    all) is not waited for again: it costs the other requests that wait once."""

    __slots__ = ("_done", "owed")

    def __init__(self) -> None:
        self.owed: set[Inbox] = set()
        self._done: asyncio.Future[None] | None = None

    def settle(self, inbox: Inbox) -> None:
        owed = self.owed
        if inbox in owed:
            owed.discard(inbox)
            done = self._done
            if not owed and done is not None and not done.done():
                done.set_result(None)

    async def drain(self) -> None:
        """Until every owed reader settled, at most ``PACE_BOUND_S``."""
        if not self.owed:
            return
        loop = asyncio.get_running_loop()
        done = self._done = loop.create_future()
        timer = loop.call_later(PACE_BOUND_S, _resolve, done)
        try:
            await done
        finally:
            timer.cancel()
            self._done = None
            for slow in self.owed:  # its client reads slowly: never waited for again
                slow.unpace()
            self.owed.clear()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Inbox:
    """What arrived for one request and was not taken yet; one waiter at a time."""

    __slots__ = ("_pace", "_waiter", "items")

    def __init__(self, pace: Pace | None = None) -> None:
        self.items: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None
        self._pace = pace

    def push(self, item: Item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            if self._pace is not None:  # an idle reader woken: the relay waits for it
                self._pace.owed.add(self)

    def settle(self) -> None:
        """Its reader is done with what it took, or gone."""
        if self._pace is not None:
            self._pace.settle(self)

    def unpace(self) -> None:
        """The relay no longer waits for this reader."""
        self._pace = None

    async def take(self) -> list[Item]:
        """Everything pushed since the last take, waiting for at least one item (its
        reader is done with the last take's: settled)."""
        self.settle()
        if not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


class RelayCall:
    """One request started on a relay stream, shaped like a grpc.aio stream call."""

    __slots__ = ("_done", "_mux", "_request_id", "_timer", "inbox")

    def __init__(self, mux: RelayMux, request_id: str, timeout_s: float) -> None:
        self._mux = mux
        self._request_id = request_id
        self.inbox = Inbox(mux.pace)
        self._done = False  # the worker is done with it (or told to be): nothing to cancel
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        """Its deadline passed: the worker is told to abort it, its reader gets the error
        grpc raises for a call past its deadline."""
        if not self._done:
            self._done = True
            self._mux.cancel(self._request_id, self.inbox)
            self.inbox.push(relay_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self) -> None:
        """The worker ended it (its Finished, its end, or the stream broke)."""
        self.inbox.settle()
        self._done = True
        self._timer.cancel()
        self._mux.detach(self._request_id, self.inbox)

    def cancel(self) -> bool:
        """Stop relaying: unless the worker ended it already, the worker aborts it."""
        self.inbox.settle()
        self._timer.cancel()
        if self._done:
            return False
        self._done = True
        self._mux.cancel(self._request_id, self.inbox)
        return True

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages (each take's chunks merged); raises its error."""
        while True:
            items = await self.inbox.take()
            chunk: pb.GenerateResponse | None = None
            for item in items:
                if isinstance(item, pb.GenerateResponse):
                    if item.HasField("finished"):
                        self._end()
                        if chunk is not None:
                            yield chunk
                        yield item
                        return
                    if chunk is None:
                        chunk = item
                    else:
                        chunk.chunk.token_ids.extend(item.chunk.token_ids)
                        chunk.chunk.text += item.chunk.text
                else:
                    if not self._done:
                        self._end()
                    if chunk is not None:
                        yield chunk
                    if isinstance(item, _Ended):  # all its messages came: no Finished
                        return
                    raise item
            if chunk is not None:
                yield chunk


class _Refused(Exception):
    """The worker's relay stream takes no starts (a worker of decision 0033)."""


class RelayMux:
    """A worker's relay stream on ``channel``, and the requests started on it."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        on_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._address = address
        self._on_ready = on_ready  # awaited when the stream is registered (tests await it)
        self._open = channel.stream_stream(
            RELAY_METHOD,
            request_serializer=pb.RelayRequest.SerializeToString,
            response_deserializer=pb.RelayBatch.FromString,
        )
        self._inboxes: dict[str, Inbox] = {}
        self._fenced: dict[str, int] = {}  # request id -> cancels not yet acknowledged
        self._out: list[pb.RelayRequest] = []  # not yet written: starts and cancels
        self._out_bytes = 0  # the starts in its last message
        self._wake = asyncio.Event()
        self.pace = Pace()
        self.stream_id = ""
        self.ready = False
        self.num_batches = 0  # of the current stream, the first one included
        self.num_started = 0  # requests started on the stream (all streams)

    def start(
        self,
        request: pb.GenerateRequest,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
        size: int,
    ) -> RelayCall:
        """Start ``request`` (of ``size`` bytes) on this stream."""
        rid = request.request_id
        self.num_started += 1
        call = RelayCall(self, rid, timeout_s)
        self._inboxes[rid] = call.inbox
        out = self._out
        if not out or self._out_bytes + size > 2 * MAX_START_BYTES:
            out.append(pb.RelayRequest())
            self._out_bytes = 0
        self._out_bytes += size
        start = out[-1].starts.add(request=request, timeout_s=timeout_s)
        if metadata:
            start.metadata.extend(pb.MetadataEntry(key=k, value=v) for k, v in metadata)
        self._wake.set()
        return call

    def detach(self, request_id: str, inbox: Inbox) -> None:
        if self._inboxes.get(request_id) is inbox:
            del self._inboxes[request_id]

    def cancel(self, request_id: str, inbox: Inbox) -> None:
        """Abort a request on the worker (never sent: just forget it) and fence its id."""
        if self._inboxes.get(request_id) is not inbox:
            return  # not on this stream (it broke meanwhile)
        del self._inboxes[request_id]
        for message in self._out:  # a start not written yet is dropped, nothing to cancel
            for i, start in enumerate(message.starts):
                if start.request.request_id == request_id:
                    del message.starts[i]
                    return
        if not self._out:
            self._out.append(pb.RelayRequest())
            self._out_bytes = 0
        self._out[-1].cancels.append(request_id)  # a message's cancels go before its starts
        self._fenced[request_id] = self._fenced.get(request_id, 0) + 1
        self._wake.set()

    async def run(self) -> None:
        """Follow the worker's relay stream until it is not offered (or takes no starts);
        a broken stream is reopened (its requests fail) after ``retry_s``, doubling up to
        30 s."""
        retry_s = 0.1
        while True:
            try:
                await self._follow()
                reason = "the relay stream ended"
            except _Refused:
                log.info(
                    "worker at %s takes no starts on its relay stream: a call per request",
                    self._address,
                )
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker at %s has no relay stream: a call per request", self._address)
                    return
                reason = f"{exc.code().name}: {exc.details()}"
            finally:
                self._fail_all("the worker's relay stream broke")
            log.info("worker at %s: %s; reopening it", self._address, reason)
            await asyncio.sleep(retry_s)
            retry_s = min(retry_s * 2, 30.0)

    async def _follow(self) -> None:
        self.stream_id = uuid.uuid4().hex
        self.num_batches = 0
        call = self._open()
        writer: asyncio.Task[None] | None = None
        try:
            await call.write(pb.RelayRequest(stream_id=self.stream_id))
            first = await call.read()
            if first is grpc.aio.EOF:
                return
            if not first.accepts_starts:
                raise _Refused
            self.num_batches = 1
            self.ready = True
            writer = asyncio.create_task(self._write(call), name=f"relay-{self._address}")
            if self._on_ready is not None:
                await self._on_ready()
            while (batch := await call.read()) is not grpc.aio.EOF:
                self._take(batch)
                # the next batch once the requests this one woke have passed theirs on
                await self.pace.drain()
        finally:
            self.ready = False
            if writer is not None:
                writer.cancel()
            call.cancel()

    def _take(self, batch: pb.RelayBatch) -> None:
        """Hand a batch's messages to their requests (a fenced id's are dropped)."""
        self.num_batches += 1
        fenced = self._fenced
        for rid in batch.cancelled:
            left = fenced.get(rid, 0) - 1
            if left > 0:
                fenced[rid] = left
            else:
                fenced.pop(rid, None)
        inboxes = self._inboxes
        for response in batch.responses:
            rid = response.request_id
            if fenced and rid in fenced:
                continue
            inbox = inboxes.get(rid)
            if inbox is not None:  # else cancelled meanwhile
                inbox.push(response)
        for end in batch.ends:
            rid = end.request_id
            inbox = inboxes.get(rid)
            if inbox is None or (fenced and rid in fenced):
                continue
            if end.code == 0:
                inbox.push(ENDED)
            else:
                code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
                inbox.push(relay_error(code, end.details))

    async def _write(self, call: Any) -> None:
        """Send the starts and cancels made since the last write (as few messages as
        ``MAX_START_BYTES`` allows); a failed write ends it (the reader sees the stream's
        status)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                out, self._out = self._out, []
                for message in out:
                    if message.starts or message.cancels:
                        await call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.debug("relay stream to %s: write failed: %s", self._address, exc)

    def _fail_all(self, details: str) -> None:
        self.ready = False
        inboxes, self._inboxes = self._inboxes, {}
        self._out = []
        self._fenced.clear()
        self.pace.owed.clear()
        error = relay_error(grpc.StatusCode.UNAVAILABLE, details)
        for inbox in inboxes.values():
            inbox.push(error)

    async def close(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("the connection to the worker was closed")
