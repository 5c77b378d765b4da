"""The bridge's Worker gRPC servicer: kvroute's worker contract over an engine.

* Generate: the request as the engine's streamed completion (:mod:`.engine_http`); chunks
  as TokenChunk, then Finished with the engine's usage. A cancelled call closes the HTTP
  stream, which aborts the request on the engine.
* Relay: the router's one stream per worker (decisions 0033, 0034), served by the worker's
  own machinery (worker/service/relay.py, relay_starts.py) over this Generate: requests
  started on it, and Generate calls that name it, put their messages into its batches; a
  cancel or the stream's end closes the request's HTTP stream (decision 0038).
* Abort: closes the request's HTTP stream; its Generate ends with FINISH_REASON_ABORT.
* SubscribeKvEvents: the translated event stream (:class:`.events.EventHub`): replay of
  our buffered batches or a snapshot, then live batches.
* GetLoad: the engine's identity and load (:class:`.engine_state.EngineState`) plus what
  the bridge forwarded and has not seen start. UNAVAILABLE while the engine does not
  answer, so routers do not send here before it is up.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from edge.frontdoor import BadRequest, ServiceError, Unavailable
from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker.bridge.service.engine_http import EngineHttp, completion_body, events, parse_event
from worker.bridge.service.engine_sglang import SglangStream, generate_body
from worker.bridge.service.engine_state import EngineState
from worker.bridge.service.engine_stream import EngineResponse
from worker.bridge.service.events import EventHub
from worker.service.engine_runner import SubscriberOverflowError
from worker.service.relay import RelayClosedError, RelayRegistry, own_stream_or_relay
from worker.service.relay_starts import StartedContext, serve_relay

log = logging.getLogger("kvroute.bridge.service")


@dataclass(slots=True)
class InFlight:
    """One forwarded request."""

    prompt_tokens: int
    started: bool = False  # the engine sent its first tokens
    aborted: bool = False
    resp: EngineResponse | None = None


class BridgeServicer(pb_grpc.WorkerServicer):
    """Generate / Abort / SubscribeKvEvents / GetLoad for one engine."""

    def __init__(
        self,
        engine: EngineHttp,
        state: EngineState,
        hub: EventHub,
        engine_kind: str = "vllm",
    ) -> None:
        self.engine = engine
        self.engine_kind = engine_kind  # "vllm": /v1/completions; "sglang": /generate
        self.state = state
        self.hub = hub
        self.inflight: dict[str, InFlight] = {}
        self.relays = RelayRegistry()
        self.draining = False
        self.num_requests = 0
        self.num_aborted = 0
        self.num_engine_errors = 0

    # ---- load ----------------------------------------------------------------------------

    def forwarded_load(self) -> tuple[int, int, int]:
        """(started, not started, prompt tokens not started) of the forwarded requests."""
        waiting = [r for r in self.inflight.values() if not r.started]
        return (
            len(self.inflight) - len(waiting),
            len(waiting),
            sum(r.prompt_tokens for r in waiting),
        )

    # ---- RPCs ----------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext | StartedContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's chunks and Finished, on this call's stream or, when its metadata
        names a relay stream, on that one (this call then ends with the status alone)."""
        outbox = None
        try:
            outbox = self.relays.find(tuple(context.invocation_metadata() or ()))
            responses = self._generate(request)
            async with contextlib.aclosing(responses):
                async for response in own_stream_or_relay(outbox, responses, context):
                    yield response
        except ServiceError as exc:
            if isinstance(exc, Unavailable):
                self.num_engine_errors += 1
            if outbox is not None:  # the chunks sent so far first, as on a stream of its own
                await outbox.flushed()
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
        except RelayClosedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _generate(
        self, request: pb.GenerateRequest
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        rid = request.request_id or uuid.uuid4().hex
        body = self._admit(request, rid)
        entry = self.inflight[rid] = InFlight(len(request.prompt_token_ids.ids))
        self.num_requests += 1
        try:
            async for msg in self._stream(rid, body, entry):
                yield msg
        finally:
            self.inflight.pop(rid, None)
            if entry.resp is not None:
                entry.resp.close()  # a request still running on the engine is aborted

    async def Relay(
        self, request_iterator: AsyncIterator[pb.RelayRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RelayBatch]:
        """One stream for the messages of every request started on it or attached to it;
        its end aborts them on the engine."""
        async for batch in serve_relay(self.relays, request_iterator, context, self.Generate):
            yield batch

    def _admit(self, request: pb.GenerateRequest, rid: str) -> dict[str, object]:
        if self.draining:
            raise Unavailable("the bridge is shutting down")
        limit = RequestLimits().max_request_id_chars  # the limit kvroute's worker applies
        if len(rid) > limit:
            raise BadRequest(
                f"request_id: at most {limit} characters, got {len(rid)}", param="request_id"
            )
        if rid in self.inflight:
            raise BadRequest(f"request_id: {rid!r} is already in flight", param="request_id")
        if not self.state.model_name:
            raise Unavailable(f"the engine at {self.engine.base_url} has not answered yet")
        if self.engine_kind == "sglang":
            return generate_body(request)
        return completion_body(request, self.state.model_name)

    async def _stream(
        self, rid: str, body: dict[str, object], entry: InFlight
    ) -> AsyncIterator[pb.GenerateResponse]:
        sglang = self.engine_kind == "sglang"
        resp = await self.engine.open_completion(body, "/generate" if sglang else "/v1/completions")
        parse = SglangStream().parse if sglang else parse_event
        entry.resp = resp
        if entry.aborted:  # aborted while the engine was answering
            resp.close()
        finish: int | None = None
        usage: pb.Usage | None = None
        generated = 0
        try:
            async for ev in events(resp, parse):
                usage = ev.usage or usage
                if ev.token_ids or ev.text:
                    entry.started = True
                    generated += len(ev.token_ids)
                    yield pb.GenerateResponse(
                        request_id=rid, chunk=pb.TokenChunk(token_ids=ev.token_ids, text=ev.text)
                    )
                if ev.finish is not None:
                    finish = ev.finish
        except OSError as exc:  # the connection broke (TimeoutError, ConnectionError)
            if not entry.aborted:
                raise Unavailable(f"the engine's stream broke: {exc!r}") from None
        if entry.aborted:
            finish = pb.FINISH_REASON_ABORT
            self.num_aborted += 1
        elif finish is None:
            raise Unavailable("the engine ended the stream without a finish reason")
        if usage is None:
            usage = pb.Usage(prompt_tokens=entry.prompt_tokens, completion_tokens=generated)
        yield pb.GenerateResponse(
            request_id=rid,
            finished=pb.Finished(reason=finish, usage=usage, worker_id=self.state.worker_id),
        )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        entry = self.inflight.get(request.request_id)
        if entry is None or entry.aborted:
            return pb.AbortResponse(found=False)
        entry.aborted = True
        if entry.resp is not None:
            entry.resp.close()
        log.info("abort %s: found", request.request_id)
        return pb.AbortResponse(found=True)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvStreamMessage]:
        who = request.subscriber_id or (context.peer() or "?")
        sub = self.hub.subscribe(who, request.epoch, request.after_seq)
        log.info(
            "subscriber %s joined at epoch=%d after_seq=%d", who, request.epoch, request.after_seq
        )
        try:
            async for msg in sub.stream(request.accepts_runs):  # runs: decision 0056
                yield msg
        except SubscriberOverflowError as exc:
            log.warning("dropping slow subscriber %s: %s", who, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            self.hub.unsubscribe(sub)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the bridge is shutting down")
        if not await self.state.ensure_model():
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the engine at {self.engine.base_url} does not answer: {self.state.last_error}",
            )
        return self.state.worker_info(self.hub.translator.epoch, *self.forwarded_load())
