"""Drives the (single-threaded) Engine from asyncio.

Every Engine call runs on one dedicated thread (a 1-worker ThreadPoolExecutor) as a *job*.
Jobs hand their results to the event loop with ``loop.call_soon_threadsafe`` in the order
they ran, so request outputs, synthetic abort outputs and event batches reach the loop in
engine order::

    event loop                         engine thread (jobs run one at a time, FIFO)
    ----------                         ---------------------------------------------
    submit(req)      -- add job -->    engine.add_request
    _run loop        -- step job -->   engine.step; take_events -> publisher -> batch
       <-- call_soon_threadsafe(dispatch outputs), (fan out batch to subscribers)
    abort(rid)       -- abort job -->  engine.abort; take_events -> batch
    subscribe(e, s)  -- sub job   -->  take_events -> batch; replay or snapshot at last_seq;
                                       register the subscriber (it gets every later batch)
    load tick        -- load job  -->  take_events + load_report -> batch (own seq)

With ``step_reports`` the step job also publishes a load report at the start of a step
(between scheduling and the forward pass) and after it, when worker/engine/load_reports.py
says so -- on the engine thread, like every batch.

The publisher and the subscriber set are touched on the engine thread only, which is what
makes "snapshot at seq S, then live S+1.." exact. The step loop sleeps on an asyncio.Event
when the engine has no work. With ``pace_speedup > 0`` it sleeps ``last_step_cost_s /
pace_speedup`` after each step (the sim executor replaying in real time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import EventBatch, LoadReport, Snapshot
from worker.engine.load_reports import StepReports
from worker.engine.types import EngineRequest, FinishReason, RequestOutput, Usage
from worker.errors import DuplicateRequestError, WorkerError
from worker.service import convert
from worker.service.faults import EventFaults, faults_from_env
from worker.service.publisher import EventPublisher

if TYPE_CHECKING:
    from worker.engine.engine import Engine

log = logging.getLogger("kvroute.worker.runner")
T = TypeVar("T")


class EngineStoppedError(WorkerError):
    """The engine loop is not running (shutting down, or it crashed): gRPC UNAVAILABLE."""


class SubscriberOverflowError(WorkerError):
    """A subscriber fell more than its queue size behind: gRPC RESOURCE_EXHAUSTED."""


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the engine loop runs."""

    pace_speedup: float = 0.0  # > 0: sleep last_step_cost_s / pace_speedup after a step
    load_interval_s: float = 1.0  # a load report batch this often (0 = never)
    subscriber_queue_size: int = 1024  # live messages a subscriber may lag before overflow
    # load reports around steps as well (worker/engine/load_reports.py): router replicas
    # that cannot see each other's picks then learn this worker's queue as each step starts,
    # not a load interval (and a long prefill) later (kvroute worker --step-reports)
    step_reports: bool = False

    def __post_init__(self) -> None:
        if self.pace_speedup < 0:
            raise ValueError(f"pace_speedup must be >= 0, got {self.pace_speedup}")
        if self.load_interval_s < 0:
            raise ValueError(f"load_interval_s must be >= 0, got {self.load_interval_s}")
        if self.subscriber_queue_size < 1:
            raise ValueError(
                f"subscriber_queue_size must be >= 1, got {self.subscriber_queue_size}"
            )


Sink: TypeAlias = Callable[[RequestOutput | BaseException], None]


class RequestStream:
    """The outputs of one request in engine order; the last one has a finish_reason.

    A reader either awaits ``get`` or hands the stream a sink (``divert``) that is called
    with each output as the engine loop dispatches it: no task wakes per step for it.
    """

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.num_generated = 0
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._sink: Sink | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.num_generated += len(item.new_token_ids)
        if self._sink is not None:
            self._sink(item)
            return
        self._items.append(item)
        self._ready.set()

    def divert(self, sink: Sink) -> None:
        """Call ``sink`` with every output from now on, those not yet read first, instead
        of keeping them for ``get``. ``sink`` runs inside the engine loop's dispatch: it
        must not raise."""
        self._sink = sink
        while self._items:
            sink(self._items.popleft())

    async def get(self) -> RequestOutput:
        """Everything produced since the last call, merged into one output (a reader that
        lags behind the engine sends fewer, larger chunks); raises what the engine loop
        failed with once the outputs before the failure are taken."""
        while not self._items:  # each turn waits for a put
            self._ready.clear()
            await self._ready.wait()
        first = self._items.popleft()
        if isinstance(first, BaseException):
            raise first
        merged, last = list(first.new_token_ids), first
        logprobs = list(first.logprobs or ())
        while self._items and isinstance(self._items[0], RequestOutput):
            last = self._items.popleft()  # type: ignore[assignment]
            merged += last.new_token_ids
            logprobs += last.logprobs or ()
        if last is first:
            return first
        return RequestOutput(
            first.request_id,
            tuple(merged),
            last.finish_reason,
            last.usage,
            logprobs=tuple(logprobs) if logprobs else None,
        )


# The most batches one EventBatchRun carries (decision 0056)
RUN_MAX_BATCHES = 256


class Subscription:
    """One KV event subscriber: its first messages, then a bounded queue of live ones."""

    def __init__(self, subscriber_id: str, max_queued: int) -> None:
        self.subscriber_id = subscriber_id
        self.max_queued = max_queued
        self.initial: list[pb.KvStreamMessage] = []
        self._queue: deque[pb.KvStreamMessage] = deque()
        self._wake = asyncio.Event()
        self._overflowed = False
        self._closed = False

    def push(self, msg: pb.KvStreamMessage) -> None:
        if self._closed or self._overflowed:
            return
        if len(self._queue) >= self.max_queued:
            self._overflowed = True
            self._queue.clear()
        else:
            self._queue.append(msg)
        self._wake.set()

    def close(self) -> None:
        """End the stream after what is queued (server shutdown)."""
        self._closed = True
        self._wake.set()

    async def messages(self) -> AsyncIterator[pb.KvStreamMessage]:
        """The first messages, then the live ones until closed (SubscriberOverflowError
        when the subscriber fell too far behind)."""
        for msg in self.initial:
            yield msg
        while (msg := await self.get()) is not None:
            yield msg

    async def stream(self, runs: bool) -> AsyncIterator[pb.KvStreamMessage]:
        """What a SubscribeKvEvents call sends: a message a batch, or with ``runs`` (the
        subscriber's ``accepts_runs``) what queued meanwhile as one EventBatchRun."""
        if not runs:
            async for msg in self.messages():
                yield msg
            return
        async for run in self.runs(RUN_MAX_BATCHES):
            yield run[0] if len(run) == 1 else convert.run_to_pb(run)

    async def runs(self, limit: int) -> AsyncIterator[list[pb.KvStreamMessage]]:
        """As :meth:`messages`, but each item is every batch queued when the stream asks for
        the next (at most ``limit``, in order): while the subscriber's last message is
        unread they queue here, and go out as one run (decision 0056). A snapshot is alone."""
        initial = deque(self.initial)
        while initial:
            yield _take_run(initial.popleft(), initial, limit)
        while (msg := await self.get()) is not None:
            yield _take_run(msg, self._queue, limit)

    async def get(self) -> pb.KvStreamMessage | None:
        """The next live message; None once closed; raises SubscriberOverflowError."""
        while True:  # each turn either returns or waits for a push/close
            if self._overflowed:
                raise SubscriberOverflowError(
                    f"subscriber {self.subscriber_id!r} fell more than "
                    f"{self.max_queued} messages behind; resubscribe with the last seq seen"
                )
            if self._queue:
                return self._queue.popleft()
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()


def _take_run(
    first: pb.KvStreamMessage, queue: deque[pb.KvStreamMessage], limit: int
) -> list[pb.KvStreamMessage]:
    """``first`` and, when it is a batch, the batches that follow it in ``queue`` (taken
    from it), at most ``limit`` in all."""
    run = [first]
    if first.HasField("batch"):
        while queue and len(run) < limit and queue[0].HasField("batch"):
            run.append(queue.popleft())
    return run


class EngineRunner:
    """Owns the engine thread, the step loop, request streams and KV event subscribers."""

    def __init__(
        self,
        engine: Engine,
        publisher: EventPublisher,
        config: RunnerConfig,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_failure = on_failure  # called on the event loop if the engine loop crashes
        self.publisher = publisher
        self.config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvroute-engine"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        # Released request ids whose abort job has not reported back yet: outputs for them
        # belong to the released request, even once a new one reuses the id.
        self._releasing: dict[str, int] = {}
        self._subscribers: set[Subscription] = set()  # engine thread only
        self._live_subscriptions: set[Subscription] = set()  # event loop side, for close()
        self._subscriptions_closed = False  # shutting down: no new KV event streams
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while the loop sleeps with nothing to do
        self._tasks: list[asyncio.Task[None]] = []
        self._step_reports = StepReports(engine) if config.step_reports else None
        self._failure: BaseException | None = None
        self._stopping = False
        self._pool_closed = False
        # test-only (tests/faults): drop / duplicate / reorder live batches; None when off
        self.event_faults: EventFaults[pb.KvStreamMessage] | None = faults_from_env()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (and the load ticker) on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._step_loop(), name="engine-step-loop"))
        if self.config.load_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._load_loop(), name="engine-load"))

    def close_subscriptions(self) -> None:
        """End every KV event stream cleanly and refuse new ones (first step of a graceful
        shutdown)."""
        self._subscriptions_closed = True
        for sub in self._live_subscriptions:
            sub.close()

    async def stop(self) -> None:
        """Stop the loops, abort what is still in flight (freeing its KV), fail its streams
        and release the engine thread (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        self.close_subscriptions()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The last job: every earlier one has run, and nothing is submitted after it.
        await self._call(self._job_abort_all, list(self._streams))
        self._pool_closed = True
        self._fail_all(EngineStoppedError("the worker is shutting down"))
        self._pool.shutdown(wait=False)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------

    async def submit(self, request: EngineRequest) -> RequestStream:
        """Add a request; raises InvalidRequestError, DuplicateRequestError, QueueFullError."""
        self._check_running()
        rid = request.request_id
        if rid in self._streams:
            raise DuplicateRequestError("request_id", f"{rid!r} is already in flight here")
        stream = RequestStream(request)
        self._streams[rid] = stream  # before the job: outputs may follow right after it
        try:
            await self._call(self.engine.add_request, request)
        except asyncio.CancelledError:
            self.release(stream)  # the add may still run: abort after it (FIFO)
            raise
        except BaseException:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            raise
        self._idle.clear()  # the loop sets it again once it finds no work
        self._wake.set()
        return stream

    def release(self, stream: RequestStream) -> None:
        """The caller stopped reading ``stream`` before its end (cancelled, deadline): abort
        it on the engine thread without waiting (safe to call from a cancelled task)."""
        if self._streams.get(stream.request_id) is not stream:
            return  # already finished
        rid = stream.request_id
        del self._streams[rid]
        if not self._pool_closed:
            self._releasing[rid] = self._releasing.get(rid, 0) + 1
            self._pool.submit(self._job_release, rid)

    async def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; its stream ends with FinishReason.ABORT."""
        self._check_running()
        return await self._call(self._job_abort, request_id)

    async def stop_request(self, request_id: str) -> None:
        """Finish a request now (its stop string was found): its stream ends with
        FinishReason.STOP and its usage, unless it had finished already."""
        self._check_running()
        await self._call(self._job_stop, request_id)

    async def flush_cache(self) -> bool:
        """Drop every cached block (AllCleared goes out to subscribers) when no request is in
        flight, as SGLang's /flush_cache does; False (nothing done) otherwise."""
        self._check_running()
        if self._streams:
            return False
        return await self._call(self._job_flush_cache)

    # ---- KV events and load --------------------------------------------------------------

    async def subscribe(self, subscriber_id: str, epoch: int, after_seq: int) -> Subscription:
        """Register a subscriber; its ``initial`` messages are the replay (batches after
        ``after_seq``) or a snapshot, and its queue gets every later batch. Raises
        EngineStoppedError once the streams are closed for shutdown."""
        self._check_running()
        if self._subscriptions_closed:
            raise EngineStoppedError("the worker is shutting down; it takes no new subscribers")
        sub = Subscription(subscriber_id, self.config.subscriber_queue_size)
        try:
            initial = await self._call(self._job_subscribe, sub, epoch, after_seq)
        except BaseException:
            self.unsubscribe(sub)  # it may have registered before the caller went away
            raise
        sub.initial = [convert.stream_message_to_pb(item) for item in initial]
        self._live_subscriptions.add(sub)
        if self._subscriptions_closed:  # closed while it registered: end after the initial
            sub.close()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._live_subscriptions.discard(sub)
        if not self._pool_closed:
            self._pool.submit(self._subscribers.discard, sub)

    async def wait_until_idle(self) -> None:
        """Wait until the step loop last found the engine without work (tests use it; the
        server's shutdown does not). release() does not wake the loop, so a test reads the
        engine through call() afterwards, which runs after every abort already queued."""
        await self._idle.wait()

    async def load_report(self) -> LoadReport:
        self._check_running()
        return await self._call(self.engine.load_report)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread (tests use it to inspect the engine safely)."""
        return await self._call(fn)

    # ---- event loop side -----------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def _check_running(self) -> None:
        if self._failure is not None:
            raise EngineStoppedError(f"the engine loop failed: {self._failure!r}")
        if self._stopping:
            raise EngineStoppedError("the worker is shutting down")

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                # Clear before the step: an add that lands after it sets the event again.
                self._wake.clear()
                started = loop.time()
                has_work, cost_s = await self._call(self._job_step)
                if self.config.pace_speedup > 0 and cost_s > 0:
                    delay = cost_s / self.config.pace_speedup - (loop.time() - started)
                    if delay > 0:
                        await asyncio.sleep(delay)
                if not has_work:
                    self._idle.set()
                    await self._wake.wait()
                    self._idle.clear()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine step failed; failing every in-flight request")
            self._failure = exc
            self._fail_all(EngineStoppedError(f"the engine loop failed: {exc!r}"))
            if self.on_failure is not None:
                self.on_failure(exc)

    async def _load_loop(self) -> None:
        # A steady timer, not a poll: each tick publishes one load batch.
        try:
            while not self._stopping and self._failure is None:
                await asyncio.sleep(self.config.load_interval_s)
                await self._call(self._job_load)
        except Exception:
            log.exception("load report failed; no more load batches")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id in self._releasing:
                continue  # from a released request (its id may be reused already)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason is FinishReason.ABORT and out.usage is None:
                out = RequestOutput(
                    out.request_id,
                    out.new_token_ids,
                    FinishReason.ABORT,
                    Usage(stream.num_prompt, 0, stream.num_generated),
                )
            stream.put(out)
            if out.finish_reason is not None:
                del self._streams[out.request_id]

    def _fan_out(self, batch: EventBatch, targets: tuple[Subscription, ...]) -> None:
        msg = convert.stream_message_to_pb(batch)  # encoded once for every subscriber
        if self.event_faults is not None:
            for faulty in self.event_faults.apply(msg):
                for sub in targets:
                    sub.push(faulty)
            return
        for sub in targets:
            sub.push(msg)

    def _end_release(self, request_id: str) -> None:
        # Posted after every output of the released request: later ones are a new request's.
        left = self._releasing[request_id] - 1
        if left:
            self._releasing[request_id] = left
        else:
            del self._releasing[request_id]

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)
        self.close_subscriptions()

    # ---- engine thread jobs --------------------------------------------------------------

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _publish(self, load: LoadReport | None = None) -> None:
        if load is not None and self._step_reports is not None:
            self._step_reports.published(load)
        batch = self.publisher.publish(self.engine.take_events(), load)
        if batch is not None and self._subscribers:
            self._post(self._fan_out, batch, tuple(self._subscribers))

    def _job_step(self) -> tuple[bool, float]:
        reports = self._step_reports
        if reports is None:
            outputs = self.engine.step()
            load = None
        else:
            outputs = self.engine.step(self._report_step_start)
            load = reports.after_step()
        if outputs:
            self._post(self._dispatch, outputs)
        self._publish(load)
        return self.engine.has_work(), self.engine.last_step_cost_s

    def _report_step_start(self) -> None:
        load = self._step_reports.at_step_start()  # type: ignore[union-attr]
        if load is not None:
            self._publish(load)

    def _job_abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        if found:
            self._post(self._dispatch, [RequestOutput(request_id, (), FinishReason.ABORT)])
        self._publish()
        return found

    def _job_stop(self, request_id: str) -> None:
        out = self.engine.stop(request_id)
        if out is not None:
            self._post(self._dispatch, [out])
        self._publish()

    def _job_flush_cache(self) -> bool:
        if self.engine.has_work():
            return False
        self.engine.cache.reset()
        self._publish()
        return True

    def _job_release(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
            self._publish()
        finally:
            self._post(self._end_release, request_id)

    def _job_abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
        self._publish()

    def _job_subscribe(
        self, sub: Subscription, epoch: int, after_seq: int
    ) -> list[EventBatch | Snapshot]:
        self._publish()  # pending events first, so the snapshot is taken at last_seq
        replay = self.publisher.resume(epoch, after_seq)
        self._subscribers.add(sub)
        if replay is not None:
            return list(replay)
        pub = self.publisher
        return [self.engine.snapshot(pub.config.worker_id, pub.epoch, pub.last_seq)]

    def _job_load(self) -> None:
        self._publish(self.engine.load_report())
