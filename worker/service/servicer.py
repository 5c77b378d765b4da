"""The Worker gRPC servicer: decode, call the engine runner, encode.

Status codes: INVALID_ARGUMENT for bad input (the message names the field and the limit),
RESOURCE_EXHAUSTED when the waiting queue is full or a KV subscriber falls too far behind,
UNAVAILABLE while shutting down, DEADLINE_EXCEEDED / CANCELLED come from grpc itself (the
request is aborted and its KV freed either way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from edge.frontdoor import CallInfo, ServiceError
from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker.engine.tokenizer import Tokenizer
from worker.service import convert
from worker.service.convert import WorkerInfo
from worker.service.engine_runner import (
    EngineRunner,
    EngineStoppedError,
    SubscriberOverflowError,
)
from worker.service.generation import SHUTTING_DOWN, WorkerGeneration
from worker.service.relay import RelayClosedError, RelayRegistry, own_stream_or_relay
from worker.service.relay_starts import StartedContext, serve_relay

log = logging.getLogger("kvroute.worker.service")


class WorkerServicer(pb_grpc.WorkerServicer):
    """Generate / Abort / SubscribeKvEvents / GetLoad over an :class:`EngineRunner`.

    Generate is a thin shell over :class:`WorkerGeneration` (the request path the HTTP front
    shares): a ServiceError it raises becomes the status of the same name.
    """

    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        info: WorkerInfo,
        *,
        generation: WorkerGeneration | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info  # static fields; load is filled per GetLoad
        self.generation = generation or WorkerGeneration(runner, tokenizer, limits, info)
        self.relays = RelayRegistry()

    def refuse_new_requests(self) -> None:
        """From now on Generate answers UNAVAILABLE (graceful shutdown)."""
        self.generation.refuse_new_requests()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new Generate calls and wait up to ``timeout_s`` for the running ones to
        end; True when they all did."""
        return await self.generation.drain(timeout_s)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext | StartedContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """A request's chunks and Finished, on this call's stream or, when its metadata
        names a relay stream, on that one (this call then ends with the status alone)."""
        metadata = tuple(context.invocation_metadata() or ())
        call = CallInfo(metadata, context.time_remaining())
        outbox = None
        try:
            outbox = self.relays.find(metadata)
            async with contextlib.aclosing(self.generation.generate(request, call)) as responses:
                async for response in own_stream_or_relay(outbox, responses, context):
                    yield response
        except ServiceError as exc:
            if outbox is not None:  # the chunks sent so far first, as on a stream of its own
                await outbox.flushed()
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
        except RelayClosedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def generate_into(
        self,
        request: pb.GenerateRequest,
        context: StartedContext,
        put: Callable[[pb.GenerateResponse], None],
    ) -> None:
        """A request started on a relay stream: Generate's messages handed to ``put`` (the
        stream's outbox) as the engine makes them, with no wake-up of the request's task per
        engine step (worker/service/relay_starts.py, decision 0049)."""
        call = CallInfo(tuple(context.invocation_metadata() or ()), context.time_remaining())
        try:
            await self.generation.generate_into(request, call, put)
        except ServiceError as exc:
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)

    async def Relay(
        self, request_iterator: AsyncIterator[pb.RelayRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RelayBatch]:
        """One stream for the messages of every request started on it or attached to it
        (see worker/service/relay.py, relay_starts.py); its end aborts them."""
        async for batch in serve_relay(
            self.relays, request_iterator, context, self.Generate, self.generate_into
        ):
            yield batch

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            found = await self.runner.abort(request.request_id)
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("abort %s: %s", request.request_id, "found" if found else "not in flight")
        return convert.abort_response_to_pb(found)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvStreamMessage]:
        """The KV event stream of this worker.

        * First message: the buffered batches after ``(epoch, after_seq)`` when the replay
          buffer still holds them, else a Snapshot at the current seq (always for epoch 0,
          another epoch, or a seq this worker never produced). Live batches follow.
        * Every batch has the next seq. Engine steps publish batches of events only (load
          unset); every ``load_interval_s`` a batch with the load report (and whatever
          events were pending) takes its own seq.
        * A subscriber that sets ``accepts_runs`` gets the batches that queued while its
          last message was unread (its stream's flow-control window full) as one
          ``EventBatchRun`` of up to ``RUN_MAX_BATCHES`` (decision 0056).
        * A subscriber that falls more than ``subscriber_queue_size`` batches behind is
          dropped with RESOURCE_EXHAUSTED; what it received is a gap-free prefix, so it
          resubscribes with its last seq (replay, or a snapshot if that is gone).
        * On shutdown the stream ends with OK; subscribing after that is UNAVAILABLE.
        """
        who = request.subscriber_id or (context.peer() or "?")
        try:
            sub = await self.runner.subscribe(who, request.epoch, request.after_seq)
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        first = sub.initial[0].WhichOneof("kind") if sub.initial else "live"
        log.info(
            "subscriber %s joined at epoch=%d after_seq=%d: %s",
            who,
            request.epoch,
            request.after_seq,
            first,
        )
        try:
            async for msg in sub.stream(request.accepts_runs):  # runs: decision 0056
                yield msg
        except SubscriberOverflowError as exc:
            log.warning("dropping slow subscriber %s: %s", who, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            self.runner.unsubscribe(sub)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        if self.generation.draining:  # routers identify workers with GetLoad: not re-adopted
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        try:
            load = await self.runner.load_report()
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return convert.worker_info_to_pb(dataclasses.replace(self.info, load=load))
