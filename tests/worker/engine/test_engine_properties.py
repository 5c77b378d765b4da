"""Hypothesis state machine: any mix of add / step / abort on a small KV pool keeps the slot
accounting exact, the event stream replayable into the snapshot, and every finished request's
tokens equal to the deterministic sim stream (retractions and all)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sched_harness import (
    VOCAB,
    Collected,
    check_accounting,
    collect,
    expected_tokens,
    make_engine,
)

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, Partition
from worker.engine.types import EngineRequest, FinishReason, SamplingParams

_BASES = [np.random.default_rng(s).integers(1, VOCAB, 48).tolist() for s in range(3)]
_PARTITIONS = [Partition(), Partition(cache_salt="tenant-b")]


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        policy=st.sampled_from(["fcfs", "lpm", "lof", "random", "dfs-weight", "routing-key"]),
        reserve=st.sampled_from([0.0, 0.25, None]),  # None: adaptive
        num_kv_slots=st.sampled_from([72, 160]),
    )
    def setup(self, page_size: int, policy: str, reserve: float | None, num_kv_slots: int) -> None:
        self.engine, _ = make_engine(
            num_kv_slots=num_kv_slots,
            page_size=page_size,
            block_size=4,
            schedule_policy=policy,
            max_running_requests=4,
            max_prefill_tokens_per_step=32,
            chunk_size=16,
            new_token_reserve_ratio=reserve,
            in_batch_dedup_min_tokens=8,
        )
        self.ids = itertools.count()
        self.in_flight: list[str] = []
        self.results: dict[str, Collected] = {}
        self.max_new: dict[str, int] = {}
        self.held: set[int] = set()
        self.num_steps = 0

    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 48),
        suffix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12),
        max_new=st.integers(1, 8),
        part=st.integers(0, 1),
        priority=st.integers(0, 1),
    )
    def add(
        self, base: int, shared: int, suffix: list[int], max_new: int, part: int, priority: int
    ) -> None:
        if self.engine.num_waiting >= self.engine.config.max_waiting_requests:
            return
        rid = f"r{next(self.ids)}"
        prompt = np.asarray(_BASES[base][:shared] + suffix, dtype=np.int64)
        self.engine.add_request(
            EngineRequest(
                rid,
                prompt,
                SamplingParams(max_new_tokens=max_new),
                _PARTITIONS[part],
                priority=priority,
                routing_key=f"k{base}",  # for routing-key; ignored by the other policies
            )
        )
        self.in_flight.append(rid)
        self.max_new[rid] = max_new

    @rule()
    def step(self) -> None:
        collect(self.engine.step(), self.results, self.num_steps)
        self.num_steps += 1
        for rid in list(self.in_flight):
            c = self.results.get(rid)
            if c is not None and c.finish_reason is not None:
                self.in_flight.remove(rid)
                assert c.finish_reason is FinishReason.LENGTH
                assert c.tokens == expected_tokens(self.engine, rid, self.max_new[rid])
                assert c.usage.completion_tokens == self.max_new[rid]

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.in_flight))
        assert self.engine.abort(rid)
        self.in_flight.remove(rid)

    def _drain_events(self) -> None:
        for event in self.engine.take_events():
            match event:
                case BlockStored(block_hashes=hashes):
                    self.held.update(hashes)
                case BlockRemoved(block_hashes=hashes):
                    self.held.difference_update(hashes)
                case AllCleared():
                    self.held.clear()

    @invariant()
    def accounting_and_events(self) -> None:
        check_accounting(self.engine)
        self.engine.cache.check_invariants()
        assert self.engine.num_running <= self.engine.config.max_running_requests
        # the queued-prefill report's block counts are exactly the waiting contexts' blocks,
        # and what it reports lies between nothing and every waiting token
        s = self.engine.scheduler
        held_ahead: Counter[int] = Counter()
        for r in s._waiting.values():
            held_ahead.update(r.context_hashes(s.config.block_size).tolist())
        assert s._ahead == dict(held_ahead)
        chunked = s._chunked
        rest = 0 if chunked is None else chunked.num_tokens - chunked.num_computed
        queued = s.num_queued_prefill_tokens()
        assert rest <= queued <= rest + sum(r.num_tokens for r in s._waiting.values())
        self._drain_events()
        snapshot = self.engine.snapshot("w", 1, 0)
        assert self.held == {h for b in snapshot.blocks for h in b.block_hashes}
        # Partial streams never contain more tokens than asked for.
        for rid in self.in_flight:
            c = self.results.get(rid)
            if c is not None:
                assert c.tokens == expected_tokens(self.engine, rid, len(c.tokens))

    def teardown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for rid in self.in_flight:
            assert engine.abort(rid)
        assert not engine.has_work()
        assert engine.cache.protected_size() == 0
        assert engine.scheduler._ahead == {}
        check_accounting(engine)
        engine.cache.reset()
        assert engine.allocator.num_free == engine.config.num_kv_slots


EngineMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


def test_drains_to_completion_after_random_load() -> None:
    """Everything added eventually finishes (no starvation, no deadlock) on a tiny pool."""
    rng = np.random.default_rng(5)
    engine, _ = make_engine(
        num_kv_slots=96, max_running_requests=8, chunk_size=16, new_token_reserve_ratio=0.0
    )
    for i in range(60):
        prompt = [*_BASES[i % 3][: int(rng.integers(0, 48))], int(rng.integers(1, VOCAB))]
        engine.add_request(
            EngineRequest(f"q{i}", np.asarray(prompt), SamplingParams(max_new_tokens=16))
        )
    results: dict[str, Collected] = {}
    for step in range(20_000):
        if not engine.has_work():
            break
        collect(engine.step(), results, step)
        check_accounting(engine)
    assert not engine.has_work()
    assert len(results) == 60
    for rid, c in results.items():
        assert c.tokens == expected_tokens(engine, rid, 16)
    assert engine.stats().num_retractions > 0
