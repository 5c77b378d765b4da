"""The Engine facade: one worker's cache + allocator + scheduler + executor.

Sans-I/O: imports neither asyncio, grpc, torch nor a clock. The clock is injected and only
the cache reads it (LRU recency); the engine never reads time itself, so the same code runs
under the replay simulator's virtual clock (advance it by ``last_step_cost_s`` after each
``step()``).

Single-threaded and not thread-safe: the worker service calls every method from one
dedicated thread.

Typical loop::

    engine = Engine(EngineConfig(), SimExecutor(), clock=time.monotonic)
    engine.add_request(EngineRequest("r1", np.array([1, 2, 3])))
    while engine.has_work():
        for out in engine.step():
            ...  # stream out.new_token_ids; out.finish_reason/usage on the last one
        events = engine.take_events()  # publish to the router
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from kvroute_proto.events import KvEvent, LoadReport, Snapshot
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, PrefixCache
from worker.engine.engine_config import EngineConfig
from worker.engine.request import Req
from worker.engine.scheduler import Scheduler
from worker.engine.stats import (
    QUEUE_WAIT_BUCKETS_S,
    EngineStats,
    HistogramCounter,
    HistogramStats,
    ModelLimits,
)
from worker.engine.types import EngineRequest, Executor, RequestOutput

__all__ = ["Engine", "EngineConfig", "EngineStats"]


def build_cache(
    config: EngineConfig, allocator: SlotAllocator, clock: Callable[[], float]
) -> PrefixCache:
    """The radix cache, or the disabled control when ``enable_cache`` is off."""
    cache_config = CacheConfig(
        page_size=config.page_size,
        eviction_policy=config.eviction_policy,
        block_size=config.block_size,
        split_recency=config.split_recency,
    )
    if config.enable_cache:
        from worker.cache.radix_cache import RadixCache

        return RadixCache(cache_config, allocator, clock)
    from worker.cache.disabled import DisabledCache

    return DisabledCache(cache_config, allocator, clock)


class Engine:
    """Accepts requests, runs one scheduling iteration + forward per ``step()``."""

    def __init__(
        self, config: EngineConfig, executor: Executor, clock: Callable[[], float]
    ) -> None:
        pool = getattr(executor, "num_kv_slots", None)
        if pool is not None and pool < config.num_kv_slots:
            raise ValueError(
                f"EngineConfig.num_kv_slots={config.num_kv_slots} exceeds the executor's KV "
                f"pool of {pool} slots"
            )
        self.config = config
        self.executor = executor
        self.allocator = SlotAllocator(config.num_kv_slots)
        self.cache = build_cache(config, self.allocator, clock)
        limits = ModelLimits(
            vocab_size=executor.vocab_size,
            max_context_tokens=executor.max_context_tokens,
            eos_token_id=executor.eos_token_id,
            eos_token_ids=frozenset(executor.eos_token_ids),
        )
        self.scheduler = Scheduler(
            config, self.cache, self.allocator, limits, random.Random(config.seed)
        )
        self._last_step_cost_s = 0.0
        # the step between schedule and forward: its prefill tokens, and the requests it
        # prefills that the scheduler counts as running only once the step is processed
        self._step_prefill_tokens = self._step_prefill_reqs = 0
        self._clock = clock
        # request id -> clock at add_request, until its first prefill step (queue wait)
        self._arrived: dict[str, float] = {}
        self._queue_wait = HistogramCounter(QUEUE_WAIT_BUCKETS_S)
        self._waited: dict[str, float] = {}  # queue wait, until the request's first output
        # requests in flight that asked for logprobs: only then are they collected
        self._logprob_ids: set[str] = set()

    # -- model limits (from the executor)

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def max_context_tokens(self) -> int:
        return self.executor.max_context_tokens

    @property
    def eos_token_id(self) -> int | None:
        """The model's first end-of-sequence id (None when it has none)."""
        return self.executor.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that finishes a request (unless it sets ``ignore_eos``), in model order."""
        return self.executor.eos_token_ids

    # -- requests

    def add_request(self, req: EngineRequest) -> None:
        """Validate and enqueue. Raises InvalidRequestError (field + limit),
        DuplicateRequestError (id in flight) or QueueFullError (max_waiting_requests)."""
        self.scheduler.add(req)
        self._arrived[req.request_id] = self._clock()
        if req.sampling.logprobs is not None:
            self._logprob_ids.add(req.request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request at any stage, freeing every slot and lock it held. Returns False
        for an unknown (or already finished) id. No further output is produced for it."""
        self._arrived.pop(request_id, None)
        self._waited.pop(request_id, None)
        self._logprob_ids.discard(request_id)
        return self.scheduler.abort(request_id)

    def stop(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with ``FinishReason.STOP`` and its usage (a stop string was
        found in its decoded text), freeing its slots as ``abort`` does; None for an unknown
        (or already finished) id."""
        self._arrived.pop(request_id, None)
        self._waited.pop(request_id, None)
        self._logprob_ids.discard(request_id)
        return self.scheduler.stop(request_id)

    def step(self, before_forward: Callable[[], object] | None = None) -> list[RequestOutput]:
        """One scheduling iteration + forward. Each output carries the new token(s) of one
        request; the last one of a request has ``finish_reason`` and ``usage``.

        ``before_forward`` runs once a non-empty batch is scheduled, before the forward pass;
        a :meth:`load_report` taken there counts the batch's prefill as still to compute
        (:attr:`step_prefill_tokens`), as it is until the step ends.

        If ``before_forward`` or the executor raises, the slots scheduled for this step are
        neither written nor freed and the batch's requests are left mid-step: discard the
        engine (the worker service treats it as fatal); ``abort`` does not repair it."""
        batch = self.scheduler.schedule()
        if self._arrived and batch.prefill_reqs:
            self._record_queue_wait(batch.prefill_reqs)
        if batch.is_empty:
            self._last_step_cost_s = 0.0
            return []
        if before_forward is not None:
            uncounted = self.scheduler.uncounted_prefill(batch)
            self._step_prefill_tokens, self._step_prefill_reqs = uncounted
            try:
                before_forward()
            finally:
                self._step_prefill_tokens = self._step_prefill_reqs = 0
        tokens = self.executor.forward(batch.prefill, batch.decode)
        self._last_step_cost_s = self.executor.step_cost_s(batch.prefill, batch.decode)
        outputs = self.scheduler.process(batch, tokens)
        if self._waited:
            self._attach_queue_wait(outputs)
        if self._logprob_ids:
            self._attach_logprobs(outputs)
        return outputs

    def _attach_logprobs(self, outputs: list[RequestOutput]) -> None:
        """The executor's logprobs of this step's tokens (one per output), for the requests
        that asked (an executor without ``take_logprobs`` has none to give)."""
        take = getattr(self.executor, "take_logprobs", None)
        logprobs = take() if take is not None else {}
        for i, out in enumerate(outputs):
            lp = logprobs.get(out.request_id)
            if lp is not None and out.new_token_ids:
                outputs[i] = out = dataclasses.replace(out, logprobs=(lp,))
            if out.finish_reason is not None:
                self._logprob_ids.discard(out.request_id)

    def _record_queue_wait(self, admitted: list[Req]) -> None:
        now = self._clock()
        arrived = self._arrived
        for r in admitted:
            t = arrived.pop(r.request_id, None)
            if t is not None:  # its first prefill step (later chunks were popped already)
                self._queue_wait.observe(now - t)
                self._waited[r.request_id] = now - t

    def _attach_queue_wait(self, outputs: list[RequestOutput]) -> None:
        waited = self._waited
        for i, out in enumerate(outputs):
            wait = waited.pop(out.request_id, None)
            if wait is not None:
                outputs[i] = dataclasses.replace(out, queue_wait_s=wait)

    def queue_wait_stats(self) -> HistogramStats:
        """Seconds from add_request to the first step that prefills the request."""
        return self._queue_wait.stats()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def last_step_cost_s(self) -> float:
        """The executor's ``step_cost_s`` of the last step (0 when it ran nothing)."""
        return self._last_step_cost_s

    # -- events, reports, leak checks

    def take_events(self) -> list[KvEvent]:
        """Drain the cache's event outbox (stored / removed / cleared blocks)."""
        return self.cache.take_events()

    def snapshot(self, worker_id: str, epoch: int, seq: int) -> Snapshot:
        """Every block the cache holds, as of (epoch, seq)."""
        return self.cache.snapshot(worker_id, epoch, seq)

    @property
    def step_prefill_tokens(self) -> int:
        """Inside ``step(before_forward=)``: the step's prefill tokens that the scheduler's
        queue has stopped counting (requests it admitted, a chunked prefill's last chunk);
        else 0."""
        return self._step_prefill_tokens

    def load_report(self) -> LoadReport:
        s = self.scheduler
        return LoadReport(
            num_running=s.num_running + self._step_prefill_reqs,
            num_waiting=s.num_waiting,
            num_queued_prefill_tokens=s.num_queued_prefill_tokens() + self._step_prefill_tokens,
            num_free_kv_tokens=self.allocator.num_free,
            num_evictable_kv_tokens=self.cache.evictable_size(),
            num_total_kv_tokens=self.allocator.num_slots,
        )

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting
