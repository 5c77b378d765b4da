"""The serving loop's brain: waiting queue, cache-aware admission, chunked prefill,
continuous-batching decode, retraction, abort and stop conditions.

Sans-I/O: imports neither asyncio, grpc, torch nor a clock. Randomness is an injected
``random.Random``; the cache gets the injected clock from the engine.

One step, in order::

    schedule()                                    process(batch, tokens)
      1. decode: one KV slot per decoding request   prefill items: insert the computed KV
         (evict; retract victims if still short)      (cache_unfinished_req), final chunk ->
      2. continue the chunked prefill, if any         decoding; decode items: append token
      3. admit waiting requests in policy order       stop checks -> cache_finished_req
         (lock the matched prefix, budget, dedup)

Retraction inserts the victim's computed KV into the tree before releasing it
(``cache_finished_req`` = insert + unlock), so the retry recomputes little; its generated
tokens are kept (context = prompt + generated) and never re-emitted.

In-batch prefix dedup: a waiting request whose uncached prefix shares at least
``in_batch_dedup_min_tokens`` tokens with a request being prefilled is held until that
prefix is in the tree. Overlap is found by block hashes (chained, so "block k of B is in the
set" is monotone in k and a binary search finds the shared length).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np

from worker.cache.allocator import SlotAllocator
from worker.cache.base import PrefixCache
from worker.engine.engine_config import EngineConfig
from worker.engine.prefix_tracker import InflightPrefixes, TreeChangeLog
from worker.engine.request import Req, ReqStatus, reserve_tokens, validate_request
from worker.engine.schedule_policy import make_policy
from worker.engine.stats import Counters, EngineStats, ModelLimits
from worker.engine.types import EngineRequest, FinishReason, ForwardItem, RequestOutput, Usage
from worker.errors import DuplicateRequestError, QueueFullError

logger = logging.getLogger(__name__)

# Waiting requests one step may pass over (held by dedup, or needing a second chunked
# prefill) before it stops scanning the queue.
MAX_SKIPS_PER_STEP = 256

_WAITING = ReqStatus.WAITING
_PREFILLING = ReqStatus.PREFILLING
_DECODING = ReqStatus.DECODING
_NO_HASHES = np.empty(0, dtype=np.uint64)


@dataclass(slots=True)
class ScheduledBatch:
    """What one step runs: forward items and the requests they belong to (same order)."""

    prefill: list[ForwardItem] = field(default_factory=list)
    prefill_reqs: list[Req] = field(default_factory=list)
    decode: list[ForwardItem] = field(default_factory=list)
    decode_reqs: list[Req] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode)


class Scheduler:
    """Owns every in-flight request; drives the cache and the allocator."""

    def __init__(
        self,
        config: EngineConfig,
        cache: PrefixCache,
        allocator: SlotAllocator,
        limits: ModelLimits,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.cache = cache
        self.allocator = allocator
        self.limits = limits
        self.policy = make_policy(config.schedule_policy, rng, cache)
        self.counters = Counters()
        self._root = cache.root
        self._reqs: dict[str, Req] = {}
        self._waiting: dict[str, Req] = {}  # insertion order; requeued ones go to the end
        self._num_requeued = 0  # requeued (retracted) requests now waiting
        self._decoding: dict[str, Req] = {}
        self._chunked: Req | None = None
        self._next_seq = 0
        self._changes = TreeChangeLog(config.block_size)  # what the tree gained / lost
        # chained hash -> how many waiting contexts hold that block (_enter_queue)
        self._ahead: dict[int, int] = {}
        self._track = config.enable_cache
        self._rematch_cursor = 0
        self._warned_stale = False
        self._dedup = config.enable_cache and config.in_batch_dedup_min_tokens > 0
        fixed = config.new_token_reserve_ratio
        self._adaptive = config.adaptive_reserve if fixed is None else None
        # The new-token reserve ratio admission uses now (adaptive unless a fixed one is set).
        self.new_token_ratio = config.adaptive_reserve.init_ratio if fixed is None else fixed

    # ------------------------------------------------------------------ requests in / out

    def add(self, er: EngineRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError, DuplicateRequestError or
        QueueFullError (nothing changes on error)."""
        if er.request_id in self._reqs:
            raise DuplicateRequestError("request_id", f"{er.request_id!r} is already in flight")
        lim = self.limits
        max_new = validate_request(er, self.config, lim.vocab_size, lim.max_context_tokens)
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"waiting queue is full: max_waiting_requests={self.config.max_waiting_requests}"
            )
        eos = frozenset() if er.sampling.ignore_eos else lim.eos_token_ids
        if self._adaptive is not None and not self._reqs:
            self.new_token_ratio = self._adaptive.init_ratio  # was idle: start cautious again
        req = Req(er, self._next_seq, max_new, self._root, eos)
        self._next_seq += 1
        if self._track:
            # What is cached now, so the load report counts only what this request adds
            # (the LPM order would take the same match at the next step).
            self._estimate(req)
            self._enter_queue(req)
        self._reqs[er.request_id] = req
        self._waiting[er.request_id] = req
        self.counters.num_requests += 1
        self.counters.prompt_tokens += req.prompt_len

    def abort(self, request_id: str) -> bool:
        """Drop a request at any stage, releasing its slots and locks. False if unknown.
        An aborted request produces no further output."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return False
        self._drop(req)
        self.counters.num_aborted += 1
        return True

    def stop(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with ``FinishReason.STOP`` (the service found a stop string in
        its text), releasing it as ``abort`` does; None if unknown or finished."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return None
        self._drop(req)
        self.counters.num_finished += 1
        usage = Usage(req.prompt_len, req.cached_prompt_tokens or 0, len(req.output_ids))
        return RequestOutput(request_id, (), FinishReason.STOP, usage)

    def _drop(self, req: Req) -> None:
        match req.status:
            case ReqStatus.WAITING:
                self._remove_waiting(req)
            case ReqStatus.DECODING:
                del self._decoding[req.request_id]
                self._release(req)
            case ReqStatus.PREFILLING:
                if self._chunked is req:
                    self._chunked = None
                self._release(req)
        req.status = ReqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self._reqs)

    @property
    def num_running(self) -> int:
        return len(self._decoding) + (self._chunked is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def uncounted_prefill(self, batch: ScheduledBatch) -> tuple[int, int]:
        """The prefill tokens and requests of ``batch``, scheduled and not yet processed,
        that :meth:`num_queued_prefill_tokens` and :attr:`num_running` leave out until the
        step is processed: all but a chunked prefill that continues after this step (whose
        rest, this chunk included, both count already)."""
        chunked = self._chunked
        tokens = requests = 0
        for item, r in zip(batch.prefill, batch.prefill_reqs, strict=True):
            if r is not chunked:
                tokens += len(item.token_ids)
                requests += 1
        return tokens, requests

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and allocate its KV slots."""
        self.counters.num_steps += 1
        batch = ScheduledBatch()
        if self._decoding:
            self._schedule_decode(batch)
        budget = self.config.max_prefill_tokens_per_step
        if self._chunked is not None:
            budget = self._continue_chunked(batch, budget)
        if self._waiting and budget > 0:
            self._admit(batch, budget)
        return batch

    def _make_free(self, n: int) -> bool:
        """Evict until ``n`` slots are free; True if they are."""
        free = self.allocator.num_free
        if free >= n:
            return True
        evicted = self.cache.evict(n - free)
        if evicted:
            self._changes.on_evict()
            self.counters.num_evicted_tokens += evicted
        return self.allocator.num_free >= n

    def _schedule_decode(self, batch: ScheduledBatch) -> None:
        retracted = False
        while not self._make_free(len(self._decoding)):
            # Retract until the rest fits; the last one too when something else pins the
            # pool (locked prefixes): it waits in the queue instead of killing the loop.
            self._retract(self._pick_victim())
            retracted = True
        if self._adaptive is not None:
            self._adapt_reserve(retracted)
        decoding = list(self._decoding.values())
        if not decoding:
            return
        slots = self.allocator.alloc(len(decoding))
        assert slots is not None
        items = batch.decode
        for r, slot in zip(decoding, slots.tolist(), strict=True):
            pos = r.num_computed  # == num_tokens - 1: the last sampled token
            r.slot_buf[pos] = slot
            items.append(
                ForwardItem(
                    r.request_id,
                    r.token_buf[pos : pos + 1],
                    pos,
                    r.slot_buf[: pos + 1],
                    r.sampling,
                    True,
                    len(r.output_ids),
                    r.token_buf[r.prompt_len : pos + 1] if r.sampling.penalized else None,
                )
            )
        batch.decode_reqs = decoding

    def _adapt_reserve(self, retracted: bool) -> None:
        """SGLang's rule: after a retraction, reserve what the surviving batch is expected
        to need; otherwise decay towards the floor (AdaptiveReserve)."""
        a = self._adaptive
        assert a is not None
        if not retracted:
            self.new_token_ratio = max(self.new_token_ratio - a.decay, a.min_ratio)
            return
        survivors = self._decoding.values()
        max_new = sum(r.max_new_tokens for r in survivors)
        if max_new == 0:  # nothing survived: something else pins the pool
            self.new_token_ratio = max(self.new_token_ratio, a.init_ratio)
            return
        generated = sum(len(r.output_ids) for r in survivors)
        needed = (generated + a.retract_decode_steps * len(self._decoding)) / max_new
        self.new_token_ratio = min(1.0, needed)
        logger.debug("retraction: new-token reserve ratio now %.3f", self.new_token_ratio)

    def _pick_victim(self) -> Req:
        """Lowest priority, then fewest generated tokens, then newest (called while at
        least one request decodes)."""
        candidates = list(self._decoding.values())
        if self._chunked is not None:
            candidates.append(self._chunked)
        return min(candidates, key=lambda r: (r.priority, len(r.output_ids), -r.seq))

    def _retract(self, req: Req) -> None:
        """Insert the victim's computed KV into the tree, release it, requeue it."""
        if req is self._chunked:
            self._chunked = None
        else:
            del self._decoding[req.request_id]
        self._release(req)
        req.status = _WAITING
        req.requeued = True
        req.match_version = -1
        self._num_requeued += 1
        self._waiting[req.request_id] = req
        if self._track:
            self._enter_queue(req)
        self.counters.num_retractions += 1
        logger.debug("retracted %s after %d generated tokens", req.request_id, len(req.output_ids))

    def _release(self, req: Req) -> None:
        """cache_finished_req: insert what was computed, free the rest, drop the lock."""
        req.sync_cache_views()
        if self._track:
            self._changes.on_insert(req, req.cache_req.num_tree_tokens, req.num_computed)
        self.cache.cache_finished_req(req.cache_req)
        req.reset_cache_state(self._root)

    def _continue_chunked(self, batch: ScheduledBatch, budget: int) -> int:
        r = self._chunked
        assert r is not None
        start = r.num_computed
        chunk = min(r.num_tokens - start, self.config.chunk_size, budget)
        if not self._make_free(chunk):
            chunk = self.allocator.num_free
        if chunk <= 0:
            return budget
        self._add_prefill(batch, r, start, chunk)
        if start + chunk == r.num_tokens:
            self._chunked = None  # its last chunk runs now: another request may start chunking
        return budget - chunk

    def _add_prefill(self, batch: ScheduledBatch, r: Req, start: int, chunk: int) -> None:
        slots = self.allocator.alloc(chunk)
        assert slots is not None
        end = start + chunk
        r.slot_buf[start:end] = slots
        batch.prefill.append(
            ForwardItem(
                r.request_id,
                r.token_buf[start:end],
                start,
                r.slot_buf[:end],
                r.sampling,
                end == r.num_tokens,
                len(r.output_ids),
                r.token_buf[r.prompt_len : end] if r.sampling.penalized else None,
            )
        )
        batch.prefill_reqs.append(r)
        self.counters.computed_prefill_tokens += chunk

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        cfg = self.config
        # Decoding requests, whatever prefills this step (a finishing chunked one too), and a
        # chunked prefill that got no memory this step.
        stalled = self._chunked is not None and not batch.prefill_reqs
        num_running = len(self._decoding) + len(batch.prefill_reqs) + stalled
        if num_running >= cfg.max_running_requests:
            return
        waiting = list(self._waiting.values())
        policy = self.policy
        if policy.uses_prefix_match:
            self._refresh_estimates(waiting)
        running: list[Req] = []
        if policy.uses_running_batch:
            running = [*self._decoding.values(), *batch.prefill_reqs]
            if stalled:
                running.append(self._chunked)  # type: ignore[arg-type]
        ordered = policy.order(waiting, self._num_requeued == 0, running)

        ratio = self.new_token_ratio
        reserved = 0
        if ratio:
            reserved = sum(reserve_tokens(r, ratio) for r in self._decoding.values())
        cache = self.cache
        alloc = self.allocator
        min_dedup = cfg.in_batch_dedup_min_tokens
        inflight = InflightPrefixes(cfg.block_size)
        chunked = self._chunked
        if self._dedup:
            for r in batch.prefill_reqs:  # the chunked prefill continuing this step
                inflight.add(r)
            if stalled:
                inflight.add(self._chunked)  # type: ignore[arg-type]
        changes = self._changes
        skips = 0
        for r in ordered:
            if num_running >= cfg.max_running_requests or budget <= 0:
                break
            if skips >= MAX_SKIPS_PER_STEP:
                break  # bound the matches one step spends on requests it cannot admit
            ctx_len = r.num_tokens
            match = cache.match_prefix(r.token_buf[: ctx_len - 1], r.partition)
            m = match.num_matched
            r.est_match = m
            r.est_node = match.last_node
            r.match_version = changes.version
            extend = ctx_len - m
            if inflight and extend >= min_dedup and inflight.shares(r, m, min_dedup):
                self.counters.num_dedup_holds += 1
                skips += 1
                continue
            chunk = min(extend, cfg.chunk_size, budget)
            if chunk < extend and chunked is not None:
                skips += 1
                continue  # one chunked prefill at a time
            node = match.last_node
            cache.inc_lock_ref(node)
            need = chunk + (reserved + reserve_tokens(r, ratio) if num_running else 0)
            if alloc.num_free + cache.evictable_size() < need or not self._make_free(chunk):
                cache.dec_lock_ref(node)
                break
            # Admitted.
            self._remove_waiting(r)
            if r.cached_prompt_tokens is None:
                r.cached_prompt_tokens = min(m, r.prompt_len)
                self.counters.cached_prompt_tokens += r.cached_prompt_tokens
            r.slot_buf[:m] = match.slots
            cr = r.cache_req
            cr.last_node = node
            cr.num_tree_tokens = m
            r.num_computed = m
            r.status = _PREFILLING
            self._add_prefill(batch, r, m, chunk)
            if chunk < extend:
                chunked = self._chunked = r
            num_running += 1
            budget -= chunk
            reserved += reserve_tokens(r, ratio)
            if self._dedup and extend >= min_dedup:
                inflight.add(r)

    def _estimate(self, r: Req) -> None:
        """Match ``r``'s context against the tree now: its cached-prefix estimate."""
        match = self.cache.match_prefix(r.token_buf[: r.num_tokens - 1], r.partition)
        r.est_match = match.num_matched
        r.est_node = match.last_node
        r.match_version = self._changes.version

    def _refresh_estimates(self, waiting: list[Req]) -> None:
        """Re-match waiting requests whose estimate predates the last tree change, at most
        ``lpm_rematch_budget`` per step, rotating so every request is refreshed in turn."""
        n = len(waiting)
        changes = self._changes
        budget = self.config.lpm_rematch_budget
        start = self._rematch_cursor % n
        stale = 0
        for i in range(n):
            r = waiting[(start + i) % n]
            if not changes.may_have_changed(r):
                continue
            if budget == 0:
                stale += 1
                continue
            budget -= 1
            self._estimate(r)
        used = self.config.lpm_rematch_budget - budget
        self.counters.num_lpm_rematches += used
        self._rematch_cursor = start + used
        if stale:
            self.counters.num_lpm_stale_estimates += stale
            if not self._warned_stale:
                self._warned_stale = True
                logger.warning(
                    "lpm: %d waiting requests ordered on stale prefix matches "
                    "(lpm_rematch_budget=%d per step); LPM stays on, estimates refresh in turn",
                    stale,
                    self.config.lpm_rematch_budget,
                )

    def _remove_waiting(self, r: Req) -> None:
        del self._waiting[r.request_id]
        if self._track:
            ahead = self._ahead
            for h in r.context_hashes(self.config.block_size).tolist():
                n = ahead[h] - 1
                if n:
                    ahead[h] = n
                else:
                    del ahead[h]
        if r.requeued:
            r.requeued = False
            self._num_requeued -= 1

    # ------------------------------------------------------------------ results

    def process(self, batch: ScheduledBatch, tokens: list[int]) -> list[RequestOutput]:
        """Apply one step's sampled tokens: cache prefills, stop checks, outputs."""
        outputs: list[RequestOutput] = []
        for item, r, tok in zip(batch.prefill, batch.prefill_reqs, tokens, strict=False):
            r.num_computed = item.start_pos + len(item.token_ids)
            r.sync_cache_views()
            if not item.sample:  # a non-final chunk: insert it, keep going next step
                self._cache_unfinished(r)
                continue
            if r is self._chunked:
                self._chunked = None
            reason = self._append_token(r, tok)
            if reason is not None:
                outputs.append(self._finish(r, reason, tok))
                continue
            r.status = _DECODING
            self._decoding[r.request_id] = r
            self._cache_unfinished(r)
            outputs.append(RequestOutput(r.request_id, (tok,)))
        offset = len(batch.prefill)
        for j, r in enumerate(batch.decode_reqs):
            tok = tokens[offset + j]
            r.num_computed += 1
            reason = self._append_token(r, tok)
            if reason is not None:
                outputs.append(self._finish(r, reason, tok))
            else:
                outputs.append(RequestOutput(r.request_id, (tok,)))
        return outputs

    def _cache_unfinished(self, r: Req) -> None:
        """Insert a running request's computed KV so others can share it now."""
        if self._track:
            self._changes.on_insert(r, r.cache_req.num_tree_tokens, r.num_computed)
        self.cache.cache_unfinished_req(r.cache_req)
        r.sync_cache_views()

    def _append_token(self, r: Req, tok: int) -> FinishReason | None:
        n = r.num_tokens
        r.token_buf[n] = tok
        r.num_tokens = n + 1
        r.output_ids.append(tok)
        self.counters.generated_tokens += 1
        sp = r.sampling
        if tok in r.stop_ids:  # stop_token_ids and, unless ignore_eos, every EOS id
            return FinishReason.STOP
        num_out = len(r.output_ids)
        if sp.max_new_tokens is not None and num_out >= sp.max_new_tokens:
            return FinishReason.LENGTH
        if r.num_tokens >= self.limits.max_context_tokens:
            return FinishReason.MAX_CONTEXT
        if num_out >= r.max_new_tokens:  # no max_new_tokens given: the KV pool's bound
            return FinishReason.LENGTH
        return None

    def _finish(self, r: Req, reason: FinishReason, tok: int) -> RequestOutput:
        if r.status is _DECODING:
            del self._decoding[r.request_id]
        del self._reqs[r.request_id]
        self._release(r)
        r.status = ReqStatus.FINISHED
        self.counters.num_finished += 1
        usage = Usage(r.prompt_len, r.cached_prompt_tokens or 0, len(r.output_ids))
        return RequestOutput(r.request_id, (tok,), reason, usage)

    # ------------------------------------------------------------------ reports

    def num_queued_prefill_tokens(self) -> int:
        """Prefill tokens still to compute: the rest of the chunked prefill, plus each waiting
        context less its cached estimate or, if more, the whole blocks it shared with the
        contexts queued ahead of it when it joined the queue (a burst on one new prefix
        computes that prefix once, then each request's own suffix: prefix caching, or the
        in-batch dedup, reuses the rest)."""
        total = 0
        chunked = self._chunked
        if chunked is not None:
            total += chunked.num_tokens - chunked.num_computed
        for r in self._waiting.values():
            total += r.num_tokens - max(r.est_match, r.queue_shared)
        return total

    def _enter_queue(self, r: Req) -> None:
        """``r`` joins the waiting queue: how many of its leading blocks the contexts ahead
        (waiting, or the chunked prefill) hold, then count its blocks in."""
        bs = self.config.block_size
        hashes = r.context_hashes(bs).tolist()
        ahead = self._ahead
        chunked = self._chunked
        theirs = _NO_HASHES if chunked is None else chunked.context_hashes(bs)
        j = r.est_match // bs
        n = len(hashes)
        # Chained hashes: once a block is not ahead, no later block of r can be.
        while j < n and (hashes[j] in ahead or (j < len(theirs) and int(theirs[j]) == hashes[j])):
            j += 1
        r.queue_shared = j * bs
        for h in hashes:
            ahead[h] = ahead.get(h, 0) + 1

    def num_request_owned_slots(self) -> int:
        """KV slots running requests own outside the tree (for leak checks: between steps,
        free + evictable + protected + this == total)."""
        total = 0
        for r in self._decoding.values():
            total += r.num_computed - r.cache_req.num_tree_tokens
        if self._chunked is not None:
            total += self._chunked.num_computed - self._chunked.cache_req.num_tree_tokens
        return total

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            num_requests=c.num_requests,
            num_finished=c.num_finished,
            num_aborted=c.num_aborted,
            prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens,
            computed_prefill_tokens=c.computed_prefill_tokens,
            generated_tokens=c.generated_tokens,
            num_retractions=c.num_retractions,
            num_steps=c.num_steps,
            num_dedup_holds=c.num_dedup_holds,
            num_lpm_rematches=c.num_lpm_rematches,
            num_lpm_stale_estimates=c.num_lpm_stale_estimates,
            num_evicted_tokens=c.num_evicted_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_free_kv_tokens=self.allocator.num_free,
            num_evictable_kv_tokens=self.cache.evictable_size(),
            num_protected_kv_tokens=self.cache.protected_size(),
            num_total_kv_tokens=self.allocator.num_slots,
        )
