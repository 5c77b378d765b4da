"""Eviction: exact order per strategy, cascade within one call, locks, heap cost bounds."""

import numpy as np
import pytest

from worker.cache import eviction
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig
from worker.cache.radix_cache import RadixCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def insert(cache, alloc, tokens, priority=0):
    slots = alloc.alloc(len(tokens))
    prefix_len = cache.insert(tokens, slots, priority=priority)
    alloc.free(slots[:prefix_len])


def four_leaves(policy):
    """Leaves A=[1] B=[2] C=[3] D=[4] with these final fields:

    node  created  last_access  hits  priority
    A     1        9            1     5
    B     2        2            1     0
    C     3        8            3     0
    D     4        10           2     1
    """
    clock = Clock()
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(eviction_policy=policy), alloc, clock)
    steps = [
        (1, lambda: insert(cache, alloc, [1], priority=5)),
        (2, lambda: insert(cache, alloc, [2])),
        (3, lambda: insert(cache, alloc, [3])),
        (4, lambda: insert(cache, alloc, [4], priority=1)),
        (6, lambda: insert(cache, alloc, [4])),
        (7, lambda: insert(cache, alloc, [3])),
        (8, lambda: insert(cache, alloc, [3])),
        (9, lambda: cache.match_prefix([1])),
        (10, lambda: cache.match_prefix([4])),
    ]
    for t, step in steps:
        clock.now = float(t)
        step()
    return cache, alloc


def eviction_order(cache):
    order = []
    while cache.root.children:
        before = set(cache.structure())
        assert cache.evict(1) == 1
        cache.check_invariants()
        (gone,) = before - set(cache.structure())
        order.append("ABCD"[gone[0] - 1])
    return "".join(order)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", "BCAD"),
        ("mru", "DACB"),
        ("fifo", "ABCD"),
        ("filo", "DCBA"),
        ("lfu", "BADC"),
        ("slru", "BACD"),
        ("priority", "BCDA"),
    ],
)
def test_exact_eviction_order_per_strategy(policy, expected):
    cache, alloc = four_leaves(policy)
    assert eviction_order(cache) == expected
    assert alloc.num_free == alloc.num_slots


def test_every_registered_strategy_is_covered():
    assert eviction.strategy_names() == ["fifo", "filo", "lfu", "lru", "mru", "priority", "slru"]


def test_parent_becomes_candidate_within_the_same_call():
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(block_size=None), alloc)
    insert(cache, alloc, [1, 2, 3])
    insert(cache, alloc, [1, 2, 4])
    insert(cache, alloc, [9, 9, 9, 9, 9])  # newest: evicted last under LRU
    assert cache.structure() == {(1, 2): {(3,): {}, (4,): {}}, (9, 9, 9, 9, 9): {}}
    assert cache.evict(3) == 4  # [3], [4], then their parent [1,2] in one call
    assert cache.structure() == {(9, 9, 9, 9, 9): {}}
    assert alloc.num_allocated == 5
    cache.check_invariants()


def test_locked_leaf_and_its_ancestors_are_never_evicted():
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(eviction_policy="mru"), alloc)
    insert(cache, alloc, [1, 2, 3])
    insert(cache, alloc, [1, 2, 4])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(10) == 1
    assert cache.structure() == {(1, 2): {(3,): {}}}
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    cache.check_invariants()


def test_evict_zero_and_negative():
    alloc = SlotAllocator(8)
    cache = RadixCache(CacheConfig(), alloc)
    insert(cache, alloc, [1])
    assert cache.evict(0) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)


class _CountingLru:
    calls = 0

    @classmethod
    def priority(cls, node):
        cls.calls += 1
        return node.last_access


def test_evicting_one_leaf_does_not_rekey_every_leaf(monkeypatch):
    strategy = eviction.EvictionStrategy("test-counting-lru", _CountingLru.priority)
    monkeypatch.setitem(eviction._REGISTRY, "test-counting-lru", strategy)
    alloc = SlotAllocator(4096)
    cache = RadixCache(CacheConfig(eviction_policy="test-counting-lru"), alloc)
    for i in range(1000):
        insert(cache, alloc, [i, i, i])
    _CountingLru.calls = 0
    for _ in range(10):
        assert cache.evict(1) == 3
    # One key check per popped leaf: the heap is persistent, never rebuilt over all leaves.
    assert _CountingLru.calls == 10
    assert cache.num_evictable_leaves == 990
    cache.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "mru"])
def test_stale_heap_entries_are_purged(policy):
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(eviction_policy=policy), alloc)
    for i in range(10):
        insert(cache, alloc, [i])
    for _ in range(5000):
        cache.match_prefix([3])  # each touch re-keys the leaf
    assert len(cache._candidates.entries) <= 2 * cache.num_evictable_leaves + 64 + 1
    order = [0, 1, 2, 4, 5, 6, 7, 8, 9, 3]
    assert eviction_order_tokens(cache) == (order if policy == "lru" else order[::-1])


def eviction_order_tokens(cache):
    out = []
    while cache.root.children:
        before = set(cache.structure())
        cache.evict(1)
        out.extend(t[0] for t in before - set(cache.structure()))
    return out


def test_lock_then_unlock_reenters_candidates_with_fresh_key():
    clock = Clock()
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(), alloc, clock)
    for t, toks in enumerate(([1], [2], [3])):
        clock.now = float(t)
        insert(cache, alloc, toks)
    node = cache.match_prefix([1]).last_node  # touched at t=2
    cache.inc_lock_ref(node)
    assert cache.num_evictable_leaves == 2
    cache.dec_lock_ref(node)
    assert cache.num_evictable_leaves == 3
    # [1] and [3] both at t=2: ties break by node age ([1] is older)
    assert eviction_order_tokens(cache) == [2, 1, 3]
    assert np.all(alloc.allocated_slots() == np.array([], dtype=np.int64))
