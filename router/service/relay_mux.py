"""The worker's relay stream: every request's tokens from one worker on one gRPC stream.

Without it each in-flight request is a Generate stream of its own, and the router pays
grpc's Python-side read for every message of every request (the largest share of the
router's CPU, decision 0030). With it (decision 0033) a worker that offers ``Relay`` sends one
``RelayBatch`` per engine step with the messages of every request the step advanced, and
the router demultiplexes them to the requests by id::

    worker                                   router
    Relay(stream_id) ------------------------> RelayMux._follow: batch -> Inbox per request
    Generate(req, metadata stream_id) <------- RelayCall: starts it; its status (OK, or the
      chunks, Finished -> the relay stream       request's error) is read by a pump task

A ``RelayCall`` looks like the grpc call it replaces (``async for`` messages, ``cancel``,
errors raised as ``grpc.aio.AioRpcError``), so the request path (frontend.py) keeps its
retry, deadline and abort rules: cancelling it cancels the Generate call, which aborts the
request on the worker. A request's chunks that arrived together are merged into one
message (the router was behind). When the relay stream breaks, every request attached to it
fails with UNAVAILABLE (retried when nothing was relayed yet). A worker that does not offer
``Relay`` (an engine bridge, an older worker) answers UNIMPLEMENTED and gets per-request
streams, as before.
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
RELAY_METADATA_KEY = "kvroute-relay-stream"
RELAY_BATCH_KEY = "kvroute-relay-batch"  # see worker/service/relay.py
_EMPTY = grpc.aio.Metadata()


def relay_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error of the shape a failed grpc call raises."""
    return grpc.aio.AioRpcError(code, _EMPTY, _EMPTY, details)


class _Ended:
    """The Generate call ended with OK (its messages went to the relay stream)."""


ENDED = _Ended()
Item: TypeAlias = pb.GenerateResponse | grpc.aio.AioRpcError | _Ended


class Inbox:
    """What arrived for one request and was not taken yet; one waiter at a time."""

    __slots__ = ("_waiter", "items")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: Item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Item]:
        """Everything pushed since the last take, waiting for at least one item."""
        if not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


class RelayCall:
    """One request attached to a relay stream, shaped like a grpc.aio stream call."""

    def __init__(self, mux: RelayMux, call: Any, request_id: str, timeout_s: float) -> None:
        self._mux = mux
        self._call = call
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout_s
        self.inbox = Inbox()
        self._finished = False  # the Finished was taken
        self._pump = asyncio.create_task(self._read_status())

    async def _read_status(self) -> None:
        try:
            async for msg in self._call:  # a worker that streamed here anyway
                self.inbox.push(msg)
            trailing = await self._call.trailing_metadata()
            sent = _batch_number(trailing)
            if sent > self._mux.num_batches:  # the call's OK overtook its last messages
                await self._mux.caught_up(sent)
            self.inbox.push(ENDED)
        except grpc.aio.AioRpcError as exc:
            self.inbox.push(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # cancel(): nobody reads the inbox
                raise
            # the channel closed under the call (the worker left the registry)
            self.inbox.push(
                relay_error(grpc.StatusCode.UNAVAILABLE, "the connection to the worker was closed")
            )

    def cancel(self) -> bool:
        """Stop relaying: before the Finished, cancel the call (the worker aborts the
        request); after it, leave the call to end by itself (a cancel would cost more than
        its OK, and race it)."""
        self._mux.detach(self._request_id, self.inbox)
        if self._finished:
            return False
        self._pump.cancel()
        return bool(self._call.cancel())

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages (each take's chunks merged); raises the call's error."""
        ended = False
        while not ended:
            items = await self.inbox.take()
            chunk: pb.GenerateResponse | None = None
            for item in items:
                if isinstance(item, pb.GenerateResponse):
                    if item.HasField("finished"):
                        self._finished = True
                        if chunk is not None:
                            yield chunk
                        yield item
                        return
                    if chunk is None:
                        chunk = item
                    else:
                        chunk.chunk.token_ids.extend(item.chunk.token_ids)
                        chunk.chunk.text += item.chunk.text
                elif isinstance(item, _Ended):  # all its messages came: no Finished
                    ended = True
                else:
                    if chunk is not None:
                        yield chunk
                    raise item
            if chunk is not None:
                yield chunk


def _batch_number(metadata: Any) -> int:
    """The ``RELAY_BATCH_KEY`` of an attached call's trailing metadata (0: none, or not a
    number: the call's messages are then taken to have come, and a missing Finished is the
    worker's failure, not a wait)."""
    for key, value in metadata or ():
        if key == RELAY_BATCH_KEY and isinstance(value, str) and value.isdecimal():
            return int(value)
    return 0


class RelayMux:
    """A worker's relay stream on ``channel``, and the requests attached to it."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        on_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._address = address
        self._on_ready = on_ready  # awaited when the stream is registered (tests await it)
        self._open = channel.unary_stream(
            RELAY_METHOD,
            request_serializer=pb.RelayRequest.SerializeToString,
            response_deserializer=pb.RelayBatch.FromString,
        )
        self._inboxes: dict[str, Inbox] = {}
        self.stream_id = ""
        self.ready = False
        self.num_batches = 0  # of the current stream, the first (empty) one included
        self._catching_up: list[tuple[int, asyncio.Future[None]]] = []

    def start(
        self,
        stub_generate: Any,
        request: pb.GenerateRequest,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> RelayCall:
        """Start ``request`` with Generate, its messages to come on this stream."""
        rid = request.request_id
        call = stub_generate(
            request,
            timeout=timeout_s,
            metadata=(*metadata, (RELAY_METADATA_KEY, self.stream_id)),
        )
        relay_call = RelayCall(self, call, rid, timeout_s)
        self._inboxes[rid] = relay_call.inbox
        return relay_call

    def detach(self, request_id: str, inbox: Inbox) -> None:
        if self._inboxes.get(request_id) is inbox:
            del self._inboxes[request_id]

    async def run(self) -> None:
        """Follow the worker's relay stream until it is not offered; a broken stream is
        reopened (its requests fail) after ``retry_s``, doubling up to 30 s."""
        retry_s = 0.1
        while True:
            try:
                await self._follow()
                reason = "the relay stream ended"
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "worker at %s has no relay stream: a stream per request", self._address
                    )
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
        call = self._open(pb.RelayRequest(stream_id=self.stream_id))
        try:
            async for batch in call:
                if not self.ready:
                    self.ready = True
                    if self._on_ready is not None:
                        await self._on_ready()
                self.num_batches += 1
                inboxes = self._inboxes
                for response in batch.responses:
                    inbox = inboxes.get(response.request_id)
                    if inbox is not None:  # else cancelled meanwhile
                        inbox.push(response)
                if self._catching_up:
                    self._wake_caught_up()
        finally:
            self.ready = False
            call.cancel()

    async def caught_up(self, number: int) -> None:
        """Return once batch ``number`` of this stream was read (or the stream broke)."""
        future = asyncio.get_running_loop().create_future()
        self._catching_up.append((number, future))
        await future

    def _wake_caught_up(self, *, all_of_them: bool = False) -> None:
        waiting = []
        for number, future in self._catching_up:
            if all_of_them or number <= self.num_batches:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((number, future))
        self._catching_up = waiting

    def _fail_all(self, details: str) -> None:
        self.ready = False
        self._wake_caught_up(all_of_them=True)
        inboxes, self._inboxes = self._inboxes, {}
        error = relay_error(grpc.StatusCode.UNAVAILABLE, details)
        for inbox in inboxes.values():
            inbox.push(error)

    async def close(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("the connection to the worker was closed")
