"""The worker's one request path, under both front doors (gRPC and HTTP).

``WorkerGeneration.generate``: admit (decode + submit) -> stream the outputs as
``GenerateResponse`` messages (chunks, then one Finished) -> abort on close. It knows neither
protocol: it refuses by raising a :class:`~edge.frontdoor.ServiceError` (BadRequest
for an invalid request, Overloaded when the waiting queue is full, Unavailable while shutting
down or when the engine loop stopped). Closing the iterator before the Finished (a cancelled
gRPC call, an HTTP client that went away) releases the request: the engine aborts it and
frees its KV slots. ``WorkerGeneration.generate_into`` is the same path for a request
started on a relay stream: its messages are made as the engine loop dispatches each step's
outputs and handed to the stream's outbox, so its task does not wake per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode

from edge.frontdoor import BadRequest, CallInfo, Overloaded, Unavailable
from edge.limits import RequestLimits
from edge.stop_strings import StopMatcher
from kvroute_proto import kvroute_pb2 as pb
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from worker.engine.types import FinishReason, RequestOutput, TokenLogprobs
from worker.errors import InvalidRequestError, QueueFullError
from worker.service import convert, spans
from worker.service.convert import WorkerInfo
from worker.service.engine_runner import EngineRunner, EngineStoppedError, RequestStream
from worker.service.observe import NO_OBSERVER, GenerationObserver

log = logging.getLogger("kvroute.worker.service")
tracer = trace.get_tracer("kvroute.worker")

# texts longer than this (characters) are tokenized on a thread, not on the event loop
THREAD_TEXT_CHARS = 16_384
SHUTTING_DOWN = "the worker is shutting down; send it elsewhere"


class WorkerGeneration:
    """Generate over an :class:`EngineRunner`; a ``edge.frontdoor.GenerationBackend``."""

    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        info: WorkerInfo,
        *,
        model_name: str = "kvroute-tiny",
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info
        self._model_name = model_name
        self._num_generating = 0
        self._none_generating = asyncio.Event()
        self._none_generating.set()
        self.draining = False
        self.observer: GenerationObserver = NO_OBSERVER  # metrics: watches, never steers

    @property
    def model_name(self) -> str:
        return self._model_name

    def token_text(self, ids: list[int]) -> str:
        """One token's text, for logprobs ("" without a tokenizer)."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    @property
    def num_generating(self) -> int:
        """Generate calls (any front door) that have not ended yet."""
        return self._num_generating

    def refuse_new_requests(self) -> None:
        """From now on generate raises Unavailable (graceful shutdown)."""
        self.draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to ``timeout_s`` for the running ones to end;
        True when they all did."""
        self.draining = True
        try:
            await asyncio.wait_for(self._none_generating.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def generate(
        self, request: pb.GenerateRequest, call: CallInfo
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The request's chunks, then its Finished; raises ServiceError to refuse."""
        with self._generating(), _request_span(call) as span:
            out_of = await self._start(request, span)
            stream = out_of.stream
            try:
                while not out_of.finished:  # every stream ends with a finish_reason or an error
                    try:
                        out = await stream.get()
                    except EngineStoppedError as exc:
                        raise Unavailable(str(exc)) from None
                    messages = out_of.take(out)
                    if out_of.stop_wanted:  # a stop string: end it on the engine now
                        await self._stop(stream, out_of)
                    for message in messages:
                        yield message
            except (asyncio.CancelledError, GeneratorExit):
                out_of.cancelled()
                raise
            finally:
                out_of.close()

    async def generate_into(
        self,
        request: pb.GenerateRequest,
        call: CallInfo,
        put: Callable[[pb.GenerateResponse], None],
    ) -> None:
        """What ``generate`` yields, handed to ``put`` instead, as the engine loop dispatches
        each output: a request started on a relay stream costs no task wake-up per engine
        step, and its tokens reach the outbox in the step's own dispatch (decision 0049).
        Returns once its Finished was put; raises what ``generate`` raises, and what ``put``
        raised (the rest of the request is then released)."""
        with self._generating(), _request_span(call) as span:
            out_of = await self._start(request, span)
            stream = out_of.stream
            woken = asyncio.Event()
            failure: list[BaseException] = []

            def sink(item: RequestOutput | BaseException) -> None:
                if failure or out_of.finished:
                    return
                try:
                    if isinstance(item, BaseException):
                        raise item
                    for message in out_of.take(item):
                        put(message)
                except EngineStoppedError as exc:
                    failure.append(Unavailable(str(exc)))
                except BaseException as exc:  # the outbox closed, or a bug: the task raises it
                    failure.append(exc)
                if failure or out_of.finished or out_of.stop_wanted:
                    woken.set()

            try:
                stream.divert(sink)
                while not (out_of.finished or failure):
                    await woken.wait()
                    woken.clear()
                    if out_of.stop_wanted and not (out_of.finished or failure):
                        await self._stop(stream, out_of)
                if failure:
                    raise failure[0]
            except asyncio.CancelledError:
                out_of.cancelled()
                raise
            finally:
                out_of.close()

    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """Count a request in ``num_generating`` (drain waits for it); refused while
        draining."""
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        self._num_generating += 1
        self._none_generating.clear()
        try:
            yield
        finally:
            self._num_generating -= 1
            if self._num_generating == 0:
                self._none_generating.set()

    async def _start(self, request: pb.GenerateRequest, span: Span) -> _Outputs:
        """Admit ``request``: what makes its messages from its engine outputs."""
        started = time.perf_counter()
        stream = await self._admit(request, span)
        return _Outputs(self, request, stream, span, started)

    async def _stop(self, stream: RequestStream, out_of: _Outputs) -> None:
        """A stop string was found: finish the request on the engine now (its slots freed);
        what it generated meanwhile is skipped and its last output ends it (``_Outputs``)."""
        out_of.stop_wanted = False
        try:
            await self.runner.stop_request(stream.request_id)
        except EngineStoppedError as exc:
            raise Unavailable(str(exc)) from None

    async def _admit(self, request: pb.GenerateRequest, span: Span) -> RequestStream:
        """Decode and submit a request, or raise the matching ServiceError."""
        try:
            decode = functools.partial(
                convert.request_from_pb,
                request,
                tokenizer=self.tokenizer,
                limits=self.limits,
                new_request_id=lambda: uuid.uuid4().hex,
            )
            text = len(request.prompt_text) + len(request.prompt_text_suffix)
            # a long text (a prompt, or the tail a router left to us) is tokenized off the
            # event loop, which keeps streaming the running requests' tokens meanwhile
            req = await asyncio.to_thread(decode) if text > THREAD_TEXT_CHARS else decode()
            span.set_attribute("kvroute.request_id", req.request_id)
            span.set_attribute("kvroute.prompt_tokens", len(req.prompt_token_ids))
            if span.is_recording():
                spans.record_request(span, req, self._model_name)
            stream = await self.runner.submit(req)
        except InvalidRequestError as exc:
            log.info("request %s rejected: %s", request.request_id or "-", exc)
            raise BadRequest(str(exc), param=exc.field) from None
        except QueueFullError as exc:
            log.info("request %s rejected: %s", request.request_id or "-", exc)
            raise Overloaded(str(exc), retry_after_s=1.0) from None
        except EngineStoppedError as exc:
            raise Unavailable(str(exc)) from None
        log.debug("request %s admitted (%d prompt tokens)", req.request_id, stream.num_prompt)
        return stream


@contextlib.contextmanager
def _request_span(call: CallInfo) -> Iterator[Span]:
    """The request's span. It continues the caller's trace when it sent a W3C traceparent
    (the router does, when it is instrumented); otherwise it is a root span. No exporter is
    configured by default, so spans cost little. The span is not made "current": a context
    attached across the yields of a generator is detached in another context when the call
    is cancelled mid-yield, which OpenTelemetry logs as "Failed to detach context"."""
    parent = propagate.extract(dict(call.metadata))
    span = tracer.start_span("kvroute.worker.Generate", context=parent)
    try:
        yield span
    except Exception as exc:  # what start_as_current_span would record
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


class _Outputs:
    """One request's engine outputs made into its messages (chunks, then the Finished),
    with its metrics and span: the steps shared by ``generate`` and ``generate_into``.

    ``take`` never waits. When the text reaches a stop string before the engine finished,
    it sets ``stop_wanted`` (the caller asks the engine to stop the request), holds that
    output, skips the ones after it and ends with the engine's last output's usage.
    """

    def __init__(
        self,
        owner: WorkerGeneration,
        request: pb.GenerateRequest,
        stream: RequestStream,
        span: Span,
        started: float,
    ) -> None:
        self._owner = owner
        self.stream = stream
        self._span = span
        self._started = started
        self._rid = stream.request_id
        tokenizer = owner.tokenizer
        self._texts = OutputText(tokenizer, request.sampling.stop) if tokenizer else None
        self._phases = spans.Phases(time.time_ns()) if span.is_recording() else None
        self._last_sent: float | None = None  # when the last tokens came (TTFT, inter-token)
        self._stopped: tuple[RequestOutput, str, tuple[int, ...], Any] | None = None
        self.finished = False
        self.stop_wanted = False
        self._outcome = "error"

    def take(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        """The messages ``out`` makes (none while held for a stop string)."""
        if self._stopped is not None:  # stopping: only the end counts
            if out.finish_reason is None:
                return []
            held, text, ids, logprobs = self._stopped
            end = dataclasses.replace(held, finish_reason=FinishReason.STOP, usage=out.usage)
            return self._messages(end, text, ids, logprobs)
        finished = out.finish_reason is not None
        phases = self._phases
        if phases is not None:
            if out.queue_wait_s is not None:
                phases.queue_wait_s = out.queue_wait_s
            if out.new_token_ids and phases.first_token_ns is None:
                phases.first_token_ns = time.time_ns()
        ids, logprobs = out.new_token_ids, out.logprobs
        observer = self._owner.observer
        if ids:  # the metrics see tokens as generated, however they are sent
            now = time.perf_counter()
            if self._last_sent is None:
                observer.on_first_token(now - self._started)
            else:
                observer.on_tokens(len(ids), now - self._last_sent)
            self._last_sent = now
        text = ""
        texts = self._texts
        if texts is not None:
            text = texts.push(ids, finished)
            if texts.stopped:  # the text ends before a stop string
                ids, logprobs = texts.take_ids(ids, logprobs, True)
                if not finished:
                    self._stopped = (out, text, ids, logprobs)
                    self.stop_wanted = True
                    return []
                out = dataclasses.replace(out, finish_reason=FinishReason.STOP)
            else:
                ids, logprobs = texts.take_ids(ids, logprobs, bool(text) or finished)
        return self._messages(out, text, ids, logprobs)

    def _messages(
        self, out: RequestOutput, text: str, ids: tuple[int, ...], logprobs: Any
    ) -> list[pb.GenerateResponse]:
        messages = []
        rid = self._rid
        if ids or text:
            messages.append(convert.chunk_to_pb(rid, ids, text, logprobs, self._owner.token_text))
        if out.finish_reason is not None:
            self.finished = True
            self._outcome = out.finish_reason.value
            _record_finish(self._span, out)
            if self._phases is not None:
                spans.record_phases(self._span, self._phases, out, time.time_ns())
            log.debug("request %s finished: %s", rid, out.finish_reason.value)
            messages.append(
                convert.finished_to_pb(
                    rid, out.finish_reason, out.usage, self._owner.info.worker_id
                )
            )
        return messages

    def cancelled(self) -> None:
        if not self.finished:
            self._outcome = "cancelled"

    def close(self) -> None:
        """The request's end, however it came: released on the engine when unfinished
        (cancelled, deadline passed, the client went away, an error)."""
        if not self.finished:
            log.info("request %s stopped before finishing; aborting it", self._rid)
            self._owner.runner.release(self.stream)
        self._owner.observer.on_end(self._outcome, time.perf_counter() - self._started)


class OutputText:
    """A request's output text as it streams: detokenized, cut before its first stop
    string, holding back only what could still start one (edge.stop_strings)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(stops) if stops else None
        self._held_ids: tuple[int, ...] = ()  # generated ids waiting for their text
        self._held_logprobs: tuple[TokenLogprobs, ...] = ()

    def take_ids(
        self, ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...] | None, ready: bool
    ) -> tuple[tuple[int, ...], tuple[TokenLogprobs, ...] | None]:
        """The ids (and their logprobs) to send now: while there is no text to send with
        them (a character's first bytes, or text held for a stop string), none -- they go
        with the next text or the end (``ready``), so no message is text-free (decision
        0030)."""
        self._held_ids += ids
        self._held_logprobs += logprobs or ()
        if not ready:
            return (), None
        out = (self._held_ids, self._held_logprobs or None)
        self._held_ids, self._held_logprobs = (), ()
        return out

    @property
    def stopped(self) -> bool:
        return self._stops is not None and self._stops.stopped

    def push(self, token_ids: tuple[int, ...], last: bool) -> str:
        """The text to send for ``token_ids`` (``last``: the output's final ids)."""
        text = self._detok.push(token_ids)
        if last:
            text += self._detok.flush()
        if self._stops is None:
            return text
        out = self._stops.push(text)
        return out + self._stops.flush() if last else out


def _record_finish(span: Span, out: RequestOutput) -> None:
    assert out.finish_reason is not None
    span.set_attribute("kvroute.finish_reason", out.finish_reason.value)
    if out.usage is not None:
        span.set_attribute("kvroute.cached_prompt_tokens", out.usage.cached_prompt_tokens)
        span.set_attribute("kvroute.completion_tokens", out.usage.completion_tokens)
