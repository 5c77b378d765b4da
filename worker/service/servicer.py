"""The Worker gRPC servicer: decode, call the engine runner, encode.

Status codes: INVALID_ARGUMENT for bad input (the message names the field and the limit),
RESOURCE_EXHAUSTED when the waiting queue is full or a KV subscriber falls too far behind,
UNAVAILABLE while shutting down, DEADLINE_EXCEEDED / CANCELLED come from grpc itself (the
request is aborted and its KV freed either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from worker.engine.types import RequestOutput
from worker.errors import InvalidRequestError, QueueFullError
from worker.service import convert
from worker.service.convert import RequestLimits, WorkerInfo
from worker.service.engine_runner import (
    EngineRunner,
    EngineStoppedError,
    RequestStream,
    SubscriberOverflowError,
)

log = logging.getLogger("kvroute.worker.service")
tracer = trace.get_tracer("kvroute.worker")


class WorkerServicer(pb_grpc.WorkerServicer):
    """Generate / Abort / SubscribeKvEvents / GetLoad over an :class:`EngineRunner`."""

    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        info: WorkerInfo,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info  # static fields; load is filled per GetLoad
        self._num_generating = 0
        self._none_generating = asyncio.Event()
        self._none_generating.set()
        self._draining = False

    def refuse_new_requests(self) -> None:
        """From now on Generate answers UNAVAILABLE (graceful shutdown)."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new Generate calls and wait up to ``timeout_s`` for the running ones to
        end; True when they all did."""
        self._draining = True
        try:
            await asyncio.wait_for(self._none_generating.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self._draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker is shutting down; send it elsewhere"
            )
        self._num_generating += 1
        self._none_generating.clear()
        try:
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._num_generating -= 1
            if self._num_generating == 0:
                self._none_generating.set()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        # Continue the caller's trace when it sent a W3C traceparent (the router does, when
        # it is instrumented); otherwise this is a root span. No exporter is configured by
        # default, so spans cost little.
        parent = propagate.extract(dict(context.invocation_metadata() or ()))
        with tracer.start_as_current_span("kvroute.worker.Generate", context=parent) as span:
            stream = await self._admit(request, context, span)
            rid = stream.request_id
            detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
            finished = False
            try:
                while not finished:  # every stream ends with a finish_reason or an error
                    try:
                        out = await stream.get()
                    except EngineStoppedError as exc:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                    finished = out.finish_reason is not None
                    text = ""
                    if detok is not None:
                        text = detok.push(out.new_token_ids)
                        text += detok.flush() if finished else ""
                    if out.new_token_ids or text:
                        yield convert.chunk_to_pb(rid, out.new_token_ids, text)
                    if out.finish_reason is not None:
                        _record_finish(span, out)
                        log.debug("request %s finished: %s", rid, out.finish_reason.value)
                        yield convert.finished_to_pb(
                            rid, out.finish_reason, out.usage, self.info.worker_id
                        )
            finally:
                if not finished:  # cancelled, deadline passed, or the client went away
                    log.info("request %s stopped before finishing; aborting it", rid)
                    self.runner.release(stream)

    async def _admit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, span: Span
    ) -> RequestStream:
        """Decode and submit a request, or abort the RPC with the matching status."""
        try:
            req = convert.request_from_pb(
                request,
                tokenizer=self.tokenizer,
                limits=self.limits,
                new_request_id=lambda: uuid.uuid4().hex,
            )
            span.set_attribute("kvroute.request_id", req.request_id)
            span.set_attribute("kvroute.prompt_tokens", len(req.prompt_token_ids))
            stream = await self.runner.submit(req)
        except InvalidRequestError as exc:
            log.info("request %s rejected: %s", request.request_id or "-", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            log.info("request %s rejected: %s", request.request_id or "-", exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.debug("request %s admitted (%d prompt tokens)", req.request_id, stream.num_prompt)
        return stream

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
            for msg in sub.initial:
                yield msg
            while (msg := await sub.get()) is not None:
                yield msg
        except SubscriberOverflowError as exc:
            log.warning("dropping slow subscriber %s: %s", who, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            self.runner.unsubscribe(sub)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        if self._draining:  # routers identify workers with GetLoad: do not get re-adopted
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker is shutting down; send it elsewhere"
            )
        try:
            load = await self.runner.load_report()
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return convert.worker_info_to_pb(dataclasses.replace(self.info, load=load))


def _record_finish(span: Span, out: RequestOutput) -> None:
    assert out.finish_reason is not None
    span.set_attribute("kvroute.finish_reason", out.finish_reason.value)
    if out.usage is not None:
        span.set_attribute("kvroute.cached_prompt_tokens", out.usage.cached_prompt_tokens)
        span.set_attribute("kvroute.completion_tokens", out.usage.completion_tokens)
