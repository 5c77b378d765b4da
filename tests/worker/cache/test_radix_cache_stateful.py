"""Hypothesis state machine: RadixCache against a tiny reference model.

The model is, per partition, a dict {cached page-aligned token prefix (tuple): KV slots of
its last page} -- prefix-closed, so "longest cached prefix" is a scan -- plus the live locks
and requests. (Pages, not tokens: two siblings at page_size 4 may both start with [2, 0, 0]
and hold those three tokens in different slots.)
After every step: the tree holds exactly the model's prefixes with the model's slots; every
allocated slot is owned by exactly one of the tree or a request; free + evictable + protected
+ request-owned == total; locked paths are still cached; replayed events == snapshot ==
hashes the model computes from its own prefixes.
"""

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, Partition
from kvroute_proto.hashing import block_hash_list
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, CacheReq
from worker.cache.radix_cache import RadixCache

NUM_SLOTS = 96
PARTITIONS = (Partition(), Partition(cache_salt="tenant-b"))
STRATEGIES = ["lru", "mru", "fifo", "filo", "lfu", "slru", "priority"]

# Keys are built from a few overlapping 4-token chunks plus a short free tail, so that keys
# share prefixes, split edges mid-page, and (at page 4) siblings agree inside their first page.
CHUNKS = [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 1), (0, 1, 1, 1), (2, 2, 2, 2)]
tokens_st = st.builds(
    lambda chunks, tail: [t for chunk in chunks for t in chunk] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=3),
    st.lists(st.integers(0, 2), max_size=3),
)
partition_st = st.sampled_from(PARTITIONS)
index_st = st.integers(0, 1000)


@functools.lru_cache(maxsize=100_000)
def last_block_hash(prefix: tuple, block_size: int, seed: int) -> int:
    return block_hash_list(prefix, block_size, seed)[-1]


class RadixMachine(RuleBasedStateMachine):
    @initialize(
        # (page_size, block_size): at page 4, blocks of 3 and 6 can be held by two siblings
        # at once (the ledger's reference-counted case); 4 and 8 cannot.
        sizes=st.sampled_from([(1, 2), (1, 3), (4, 3), (4, 6), (4, 4), (4, 8)]),
        policy=st.sampled_from(STRATEGIES),
    )
    def setup(self, sizes, policy):
        page_size, block_size = sizes
        self.page = page_size
        self.block_size = block_size
        self.alloc = SlotAllocator(NUM_SLOTS)
        config = CacheConfig(page_size=page_size, eviction_policy=policy, block_size=block_size)
        self.cache = RadixCache(config, self.alloc)
        self.ref: dict[Partition, dict[tuple, int]] = {p: {} for p in PARTITIONS}
        self.locks: list[tuple] = []  # (node, partition, prefix)
        self.reqs: list[CacheReq] = []
        self.held: set[int] = set()

    # ------------------------------------------------------------------ model helpers

    def aligned(self, tokens):
        return tokens[: len(tokens) - len(tokens) % self.page]

    def ref_match(self, part, tokens):
        n = len(self.aligned(tokens))
        cached = self.ref[part]
        while n and tuple(tokens[:n]) not in cached:
            n -= self.page
        return n

    def ref_slots(self, part, tokens, n):
        cached = self.ref[part]
        return [s for j in range(self.page, n + 1, self.page) for s in cached[tuple(tokens[:j])]]

    def ref_add(self, part, tokens, slots, start):
        page = self.page
        for j in range(start + page, len(tokens) + 1, page):
            self.ref[part][tuple(tokens[:j])] = tuple(int(s) for s in slots[j - page : j])

    def tree_map(self):
        out = {p: {} for p in PARTITIONS}
        parts = self.cache._partitions
        stack = [(c, ()) for c in self.cache.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            cached = out[parts[node.pid]]
            toks, slots, page = node.tokens.tolist(), node.value.tolist(), self.page
            for j in range(0, len(toks), page):
                prefix = (*prefix, *toks[j : j + page])
                cached[prefix] = tuple(slots[j : j + page])
            stack.extend((c, prefix) for c in node.children.values())
        return out

    def protected_prefixes(self):
        out = [(part, prefix) for _, part, prefix in self.locks]
        for req in self.reqs:
            out.append((req.partition, tuple(req.token_ids[: req.num_tree_tokens].tolist())))
        return out

    def alloc_with_evict(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.evict_checked(n - self.alloc.num_free)
            slots = self.alloc.alloc(n)
        return slots

    def evict_checked(self, k):
        before = self.tree_map()
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(k)
        after = self.tree_map()
        removed = []
        for part in PARTITIONS:
            for prefix, slot in after[part].items():
                assert before[part].get(prefix) == slot, "eviction changed a kept slot"
            removed += [s for p, ss in before[part].items() if p not in after[part] for s in ss]
        assert freed == len(removed) <= evictable
        assert freed >= k or self.cache.evictable_size() == 0
        if removed:
            assert not self.alloc.is_allocated(removed).any(), "evicted slot not freed"
        for part, prefix in self.protected_prefixes():
            assert not prefix or prefix in after[part], "a locked path was evicted"
        self.ref = after
        return freed

    def state(self):
        return (self.cache.pretty_print(), self.alloc.allocated_slots().tolist())

    # ------------------------------------------------------------------ rules

    @rule(part=partition_st, tokens=tokens_st)
    def worker_step(self, part, tokens):
        """match, lock, allocate the miss (evicting if needed), insert, free duplicates."""
        tokens = self.aligned(tokens)
        expect = self.ref_match(part, tokens)
        m = self.cache.match_prefix(tokens, part)
        assert m.num_matched == expect
        assert m.slots.tolist() == self.ref_slots(part, tokens, expect)
        self.cache.inc_lock_ref(m.last_node)
        new = self.alloc_with_evict(len(tokens) - expect)
        if new is not None:
            slots = np.concatenate((m.slots, new))
            assert self.cache.insert(tokens, slots, part) == expect
            self.ref_add(part, tokens, slots, expect)
        self.cache.dec_lock_ref(m.last_node)

    @rule(part=partition_st, tokens=tokens_st, priority=st.integers(0, 3))
    def insert_fresh(self, part, tokens, priority):
        """Insert with freshly computed slots only: the caller frees its duplicates."""
        tokens = self.aligned(tokens)
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            return
        expect = self.ref_match(part, tokens)
        assert self.cache.insert(tokens, slots, part, priority) == expect
        self.alloc.free(slots[:expect])
        self.ref_add(part, tokens, slots, expect)

    @rule(part=partition_st, tokens=tokens_st)
    def match(self, part, tokens):
        expect = self.ref_match(part, tokens)
        m = self.cache.match_prefix(tokens, part)
        assert m.num_matched == expect
        assert m.slots.tolist() == self.ref_slots(part, tokens, expect)
        assert m.last_node.end == expect

    @rule(part=partition_st, tokens=tokens_st)
    def lock(self, part, tokens):
        m = self.cache.match_prefix(tokens, part)
        if m.num_matched:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, part, tuple(tokens[: m.num_matched])))

    @precondition(lambda self: self.locks)
    @rule(i=index_st)
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(part=partition_st, tokens=tokens_st)
    def unlock_without_lock_raises(self, part, tokens):
        node = self.cache.match_prefix(tokens, part).last_node
        if node is self.cache.root or node.direct_locks:
            return
        before = self.state()
        try:
            self.cache.dec_lock_ref(node)
        except ValueError:
            pass
        else:
            raise AssertionError("dec_lock_ref below zero did not raise")
        assert self.state() == before

    @rule(k=st.integers(0, 40))
    def evict(self, k):
        self.evict_checked(k)

    @rule()
    def reset(self):
        keep = self.protected_prefixes()
        self.cache.reset()
        after = self.tree_map()
        for part in PARTITIONS:
            expect = {
                p: s
                for p, s in self.ref[part].items()
                if any(q == part and r[: len(p)] == p for q, r in keep)
            }
            assert after[part] == expect
        self.ref = after

    @rule(part=partition_st, tokens=tokens_st)
    def bad_input_changes_nothing(self, part, tokens):
        before = self.state()
        head = self.aligned(tokens)
        with pytest.raises(ValueError, match="token_ids"):
            self.cache.insert([-1] * self.page, np.zeros(self.page, dtype=np.int64), part)
        with pytest.raises(ValueError, match="token_ids"):
            self.cache.match_prefix([*tokens, -1], part)
        with pytest.raises(ValueError, match="slots has length"):
            self.cache.insert(head, np.zeros(len(head) + 1, dtype=np.int64), part)
        with pytest.raises(TypeError, match="token_ids"):
            self.cache.insert([0.5] * self.page, np.zeros(self.page, dtype=np.int64), part)
        assert self.state() == before

    # requests: admission, chunked prefill, finish

    @precondition(lambda self: len(self.reqs) < 3)
    @rule(part=partition_st, tokens=tokens_st.filter(len))
    def req_start(self, part, tokens):
        m = self.cache.match_prefix(tokens, part)
        assert m.num_matched == self.ref_match(part, tokens)
        self.cache.inc_lock_ref(m.last_node)
        new = self.alloc_with_evict(len(tokens) - m.num_matched)
        if new is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.reqs.append(
            CacheReq(
                token_ids=np.asarray(tokens, dtype=np.int64),
                slots=np.concatenate((m.slots, new)),
                last_node=m.last_node,
                num_tree_tokens=m.num_matched,
                partition=part,
            )
        )

    @precondition(lambda self: self.reqs)
    @rule(i=index_st, more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def req_compute_more(self, i, more):
        req = self.reqs[i % len(self.reqs)]
        new = self.alloc_with_evict(len(more))
        if new is not None:
            req.token_ids = np.concatenate((req.token_ids, np.asarray(more, dtype=np.int64)))
            req.slots = np.concatenate((req.slots, new))

    def _cache_req(self, req, finished):
        tokens = req.token_ids.tolist()
        head = self.aligned(tokens)
        prefix = self.ref_match(req.partition, head)
        old = req.slots.copy()
        num_tree = req.num_tree_tokens
        if finished:
            self.cache.cache_finished_req(req)
            assert len(req.slots) == 0 and req.last_node is self.cache.root
            gone = [*old[num_tree:prefix], *old[len(head) :]]
        else:
            self.cache.cache_unfinished_req(req)
            assert req.num_tree_tokens == len(head) == req.last_node.end
            assert req.slots[len(head) :].tolist() == old[len(head) :].tolist()
            gone = old[num_tree:prefix]
        self.ref_add(req.partition, head, old, prefix)
        if not finished:
            assert req.slots[: len(head)].tolist() == self.ref_slots(req.partition, head, len(head))
        if len(gone):
            assert not self.alloc.is_allocated(np.asarray(gone)).any()

    @precondition(lambda self: self.reqs)
    @rule(i=index_st)
    def req_chunk_done(self, i):
        self._cache_req(self.reqs[i % len(self.reqs)], finished=False)

    @precondition(lambda self: self.reqs)
    @rule(i=index_st)
    def req_finish(self, i):
        self._cache_req(self.reqs.pop(i % len(self.reqs)), finished=True)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_model(self):
        self.cache.check_invariants()
        assert self.tree_map() == self.ref

    @invariant()
    def every_slot_has_exactly_one_owner(self):
        tree = [s for part in PARTITIONS for ss in self.ref[part].values() for s in ss]
        owned = [int(s) for r in self.reqs for s in r.slots[r.num_tree_tokens :]]
        everything = tree + owned
        assert len(set(everything)) == len(everything), "a slot has two owners"
        assert sorted(everything) == self.alloc.allocated_slots().tolist(), "leak"
        total = self.alloc.num_free + self.cache.evictable_size() + self.cache.protected_size()
        assert total + len(owned) == NUM_SLOTS

    @invariant()
    def locked_paths_are_cached(self):
        for part, prefix in self.protected_prefixes():
            assert not prefix or prefix in self.ref[part]
        for node, _, prefix in self.locks:
            assert not node.evicted and node.end == len(prefix)

    @invariant()
    def events_replay_to_snapshot_and_model(self):
        for ev in self.cache.take_events():
            match ev:
                case BlockStored(block_hashes=hashes):
                    assert not self.held & set(hashes), "block stored twice"
                    self.held |= set(hashes)
                case BlockRemoved(block_hashes=hashes):
                    assert set(hashes) <= self.held, "removed a block not held"
                    self.held -= set(hashes)
                case AllCleared():
                    self.held.clear()
        snap = {h for b in self.cache.snapshot("w", 1, 0).blocks for h in b.block_hashes}
        bs = self.block_size
        # Block ends L (multiples of bs) inside each cached prefix's last page.
        model = {
            last_block_hash(prefix[:end], bs, part.seed)
            for part in PARTITIONS
            for prefix in self.ref[part]
            for end in range(len(prefix) - len(prefix) % bs, len(prefix) - self.page, -bs)
            if end
        }
        assert self.held == snap == model


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheStateMachine = RadixMachine.TestCase
