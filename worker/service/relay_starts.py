"""Requests started on a relay stream, without a gRPC call of their own (decision 0034).

The router sends ``RelayRequest`` messages on the worker's relay stream: each may cancel
requests and start others (cancels first). A start runs the same handler as a Generate call
(an engine bridge's ``Generate``) with a :class:`StartedContext`, the part of a servicer
context that handler uses: the start's metadata, its deadline, and ``abort``; or, given one,
a handler that puts the messages itself as the engine makes them (the worker's
``WorkerServicer.generate_into``: the request's task then wakes at its end only, not at
every engine step; decision 0049). Its messages go into the stream's outbox
(worker/service/relay.py), so they travel in the same batches as every other request's;
where Generate would have ended with a status other than OK after a Finished, the outbox
gets a ``RelayEnd`` with that status instead:

    router                                   worker
    RelayRequest{starts, cancels} ---------> RelayStarts.take: a task per start
    RelayBatch{cancelled, responses, ends} <- RelayOutbox: chunks, Finished, RelayEnd

A cancel cancels the request's task (the engine aborts the request, as for a cancelled
Generate call), drops what of it was not sent, and is acknowledged in the next batch.
When the stream ends every task on it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from kvroute_proto import kvroute_pb2 as pb
from worker.service.relay import RELAY_METADATA_KEY, RelayClosedError, RelayOutbox, RelayRegistry

log = logging.getLogger("kvroute.worker.service")


class StartAborted(Exception):
    """A started request's handler ended it with a status (``StartedContext.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class StartedContext:
    """What a Generate handler reads from its servicer context, for a started request."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], timeout_s: float) -> None:
        self._metadata = metadata
        self._deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s else None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def set_trailing_metadata(self, metadata: Any) -> None:
        """Nothing to do: a started request has no call of its own."""

    def peer(self) -> str:
        return "relay"

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise StartAborted(code, details)


Handler = Callable[[pb.GenerateRequest, Any], AsyncIterator[pb.GenerateResponse]]
# A handler that hands each message to a callable as it is made, and returns once the
# request's Finished was handed over (the worker's: WorkerServicer.generate_into)
IntoHandler = Callable[
    [pb.GenerateRequest, Any, Callable[[pb.GenerateResponse], None]], Awaitable[None]
]


class _Started:
    """One started request: its task, and whether what it makes still goes to the outbox.
    A cancel closes it at once: with ``into`` the engine's dispatch puts the request's
    messages itself, and may do so before the task sees its cancellation; those are dropped
    (the cancel's acknowledgement must be the last the router hears of that id)."""

    __slots__ = ("open", "outbox", "task")

    def __init__(self, outbox: RelayOutbox) -> None:
        self.outbox = outbox
        self.open = True
        self.task: asyncio.Task[None] | None = None

    def put(self, response: pb.GenerateResponse) -> None:
        if self.open:
            self.outbox.put(response)

    def cancel(self) -> None:
        self.open = False
        if self.task is not None:
            self.task.cancel()


class RelayStarts:
    """The requests started on one relay stream, each a task putting into ``outbox``.

    With ``into``, a start runs that handler, which puts the request's messages into the
    outbox itself as the engine makes them (its task waits for the end only); without
    it, the task iterates ``handler``'s messages and puts each.
    """

    def __init__(
        self, outbox: RelayOutbox, handler: Handler, into: IntoHandler | None = None
    ) -> None:
        self._outbox = outbox
        self._handler = handler
        self._into = into
        self._tasks: dict[str, _Started] = {}

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    async def follow(self, requests: AsyncIterator[pb.RelayRequest]) -> None:
        """Take each message of the router's side of the stream until it half-closes."""
        async for message in requests:
            self.take(message)

    def take(self, message: pb.RelayRequest) -> None:
        for request_id in message.cancels:
            started = self._tasks.pop(request_id, None)
            if started is not None:
                started.cancel()
            self._outbox.cancelled(request_id)
        for start in message.starts:
            self._start(start)

    def _start(self, start: pb.RelayStart) -> None:
        rid = start.request.request_id
        timeout_s = start.timeout_s
        if not rid or rid in self._tasks:
            details = "request_id must be set" if not rid else f"{rid!r} is already in flight here"
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {details}")
        elif not (math.isfinite(timeout_s) and timeout_s >= 0):
            details = f"timeout_s must be a finite number >= 0 (0: none), got {timeout_s}"
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT, details)
        else:
            started = self._tasks[rid] = _Started(self._outbox)
            started.task = asyncio.create_task(self._run(start, started), name=f"relay-start-{rid}")

    def _end(self, rid: str, code: grpc.StatusCode, details: str) -> None:
        with contextlib.suppress(RelayClosedError):  # the stream ended: nobody to tell
            self._outbox.end(rid, code.value[0], details)

    async def _run(self, start: pb.RelayStart, started: _Started) -> None:
        request = start.request
        rid = request.request_id
        metadata = tuple((m.key, m.value) for m in start.metadata if m.key != RELAY_METADATA_KEY)
        context = StartedContext(metadata, start.timeout_s)
        outbox = self._outbox
        try:
            finished = False
            async with asyncio.timeout(start.timeout_s or None):
                if self._into is not None:
                    await self._into(request, context, started.put)
                    finished = True
                else:
                    handler = self._handler(request, context)
                    async with contextlib.aclosing(handler) as responses:  # type: ignore[type-var]
                        async for response in responses:
                            outbox.put(response)
                            if response.HasField("finished"):
                                finished = True
                                break
            if not finished:  # what Generate's OK without a Finished was
                self._end(rid, grpc.StatusCode.OK, "")
        except StartAborted as exc:
            self._end(rid, exc.code, exc.details)
        except TimeoutError:
            self._end(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except RelayClosedError:
            pass  # the stream ended; the router failed the request already
        except Exception:
            log.exception("request %s started on relay stream %s failed", rid, outbox.stream_id)
            self._end(rid, grpc.StatusCode.INTERNAL, "internal error on the worker")
        finally:
            if self._tasks.get(rid) is started:
                del self._tasks[rid]

    def close(self) -> None:
        """The stream ended: cancel every request on it (the engine aborts them)."""
        tasks, self._tasks = self._tasks, {}
        for started in tasks.values():
            started.cancel()


async def serve_relay(
    registry: RelayRegistry,
    requests: AsyncIterator[pb.RelayRequest],
    context: grpc.aio.ServicerContext,
    handler: Handler,
    into: IntoHandler | None = None,
) -> AsyncIterator[pb.RelayBatch]:
    """The Worker service's Relay: open the stream the first message names, take starts and
    cancels from the rest, and send the outbox's batches until the router ends the call.
    A router of decision 0033 sends the first message only and half-closes."""
    first: pb.RelayRequest | None = await anext(aiter(requests), None)
    if first is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream_id must be sent first")
        return
    try:
        outbox = registry.open(first.stream_id)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    log.info("relay stream %s opened by %s", first.stream_id, context.peer() or "?")
    starts = RelayStarts(outbox, handler, into)
    starts.take(first)
    reader = asyncio.create_task(starts.follow(requests), name=f"relay-{first.stream_id}")
    reader.add_done_callback(lambda task: _reader_ended(task, registry, outbox))
    try:
        async for batch in outbox.batches(accepts_starts=True):
            yield batch
    finally:
        reader.cancel()
        starts.close()
        registry.close(outbox)


def _reader_ended(task: asyncio.Task[None], registry: RelayRegistry, outbox: RelayOutbox) -> None:
    """The router's side ended: a half-close (a router of 0033) leaves the stream open; a
    failure ends it, so the router reopens it instead of waiting on starts never taken."""
    if task.cancelled() or task.exception() is None:
        return
    log.warning("relay stream %s: reading failed: %r", outbox.stream_id, task.exception())
    registry.close(outbox)
