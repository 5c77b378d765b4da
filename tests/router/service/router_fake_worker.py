"""A scriptable Worker gRPC server for router tests: exact control over failures.

Generate behaviours (by ``FakeWorker.behaviour``): "ok" streams ``num_chunks`` one-token
chunks then Finished; "fail_before" aborts with ``fail_code`` before any message;
"fail_after" sends one chunk then aborts; "hang" waits until cancelled; "no_finished"
sends the chunks and ends the call with OK but no Finished. With ``relay`` it offers the
relay stream and takes requests started on it (decision 0034; the worker's own
``serve_relay``); with ``starts`` False it is a worker of decision 0033, whose calls attached
by metadata send their messages there (the chunks of "fail_after" are flushed before the
error, as the worker's servicer does). Every request,
cancellation and Abort is recorded. The event stream sends an empty snapshot, then whatever
the test pushes with ``push()`` (earlier pushes are replayed to a new stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import EventBatch, Snapshot
from worker.service.relay import RELAY_BATCH_KEY, RelayRegistry, send_all
from worker.service.relay_starts import serve_relay


@dataclass
class Received:
    request: pb.GenerateRequest
    time_remaining: float | None
    metadata: dict[str, str]


@dataclass
class FakeWorker(pb_grpc.WorkerServicer):
    worker_id: str
    epoch: int = 1
    block_size: int = 4
    behaviour: str = "ok"
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    num_chunks: int = 3
    cached_prompt_tokens: int = 0
    received: list[Received] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled_event: asyncio.Event = field(default_factory=asyncio.Event)
    subscriptions: list[pb.SubscribeRequest] = field(default_factory=list)
    history: list = field(default_factory=list)  # pushed messages, replayed to new streams
    _queues: list[asyncio.Queue] = field(default_factory=list)
    relay: bool = False
    starts: bool = True  # with relay: requests are started on the stream (decision 0034)
    num_relays: int = 0  # Relay calls served
    relays: RelayRegistry = field(default_factory=RelayRegistry)

    async def GetLoad(self, request, context):
        return pb.WorkerInfo(
            worker_id=self.worker_id, epoch=self.epoch, block_size=self.block_size, executor="fake"
        )

    async def Relay(self, request_iterator, context):
        if not self.relay:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no relay stream")
        self.num_relays += 1
        if not self.starts:  # a worker of decision 0033: its calls are attached by metadata
            first = await anext(aiter(request_iterator))
            outbox = self.relays.open(first.stream_id)
            try:
                async for batch in outbox.batches(accepts_starts=False):
                    yield batch
            finally:
                self.relays.close(outbox)
            return
        async for batch in serve_relay(self.relays, request_iterator, context, self.Generate):
            yield batch

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        outbox = self.relays.find(tuple(context.invocation_metadata()))
        if outbox is None:
            async for msg in self._generate(request, context, None):
                yield msg
        else:
            sent = await send_all(outbox, self._generate(request, context, outbox.flushed))
            context.set_trailing_metadata(((RELAY_BATCH_KEY, sent),))

    async def _generate(self, request, context, flushed) -> AsyncIterator[pb.GenerateResponse]:
        md = {k: v for k, v in context.invocation_metadata()}
        self.received.append(Received(request, context.time_remaining(), md))
        rid = request.request_id
        try:
            match self.behaviour:
                case "fail_before":
                    await context.abort(self.fail_code, f"{self.worker_id} scripted failure")
                case "fail_after":
                    yield pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(token_ids=[1]))
                    if flushed is not None:
                        await flushed()
                    await context.abort(self.fail_code, f"{self.worker_id} failed mid-stream")
                case "hang":
                    self.hanging.set()
                    await asyncio.Event().wait()
            for i in range(self.num_chunks):
                yield pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(token_ids=[i + 1]))
            if self.behaviour == "no_finished":
                return
            n = len(request.prompt_token_ids.ids) or len(request.prompt_text.encode())
            yield pb.GenerateResponse(
                request_id=rid,
                finished=pb.Finished(
                    reason=pb.FINISH_REASON_LENGTH,
                    usage=pb.Usage(
                        prompt_tokens=n,
                        cached_prompt_tokens=self.cached_prompt_tokens,
                        completion_tokens=self.num_chunks,
                    ),
                    worker_id=self.worker_id,
                ),
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            self.cancelled_event.set()
            raise

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=True)

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions.append(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.append(queue)
        try:
            snap = Snapshot(self.worker_id, self.epoch, 0, self.block_size)
            yield codec.stream_message_to_pb(snap)
            for msg in list(self.history):
                yield codec.stream_message_to_pb(msg)
            while True:
                yield codec.stream_message_to_pb(await queue.get())
        finally:
            self._queues.remove(queue)

    def push(self, msg: EventBatch | Snapshot) -> None:
        self.history.append(msg)
        for q in self._queues:
            q.put_nowait(msg)


@dataclass
class RunningFake:
    fake: FakeWorker
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_fake(fake: FakeWorker, port: int = 0) -> AsyncIterator[RunningFake]:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(fake, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield RunningFake(fake, server, bound)
    finally:
        await server.stop(0)
