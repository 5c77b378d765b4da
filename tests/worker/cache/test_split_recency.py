"""Split recency: when an access splits an edge, does the unused lower half count as
accessed? "keep" (default, true LRU): no. "stamp" (SGLang's rule): yes. Exact times and the
eviction victim that follows, for a match and for an insert."""

from __future__ import annotations

import numpy as np
import pytest

from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig
from worker.cache.radix_cache import RadixCache


def _cache(split_recency: str) -> tuple[RadixCache, list[float]]:
    now = [0.0]
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(split_recency=split_recency), alloc, lambda: now[0])
    return cache, now


def _put(cache: RadixCache, tokens: list[int]) -> None:
    key = np.asarray(tokens)
    m = cache.match_prefix(key)
    slots = np.concatenate((m.slots, cache.allocator.alloc(len(key) - m.num_matched)))
    cache.insert(key, slots)


def _leaf_times(cache: RadixCache) -> dict[tuple[int, ...], float]:
    out = {}
    stack = [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root:
            out[tuple(node.tokens.tolist())] = node.last_access
    return out


@pytest.mark.parametrize(
    ("mode", "lower_time", "victim"),
    [("keep", 3.0, (3, 4)), ("stamp", 7.0, (5, 6))],
)
def test_match_that_splits_an_edge(mode: str, lower_time: float, victim: tuple) -> None:
    cache, now = _cache(mode)
    now[0] = 3.0
    _put(cache, [1, 2, 3, 4])
    now[0] = 5.0
    _put(cache, [5, 6])
    now[0] = 7.0
    assert cache.match_prefix(np.asarray([1, 2, 9])).num_matched == 2
    assert _leaf_times(cache) == {(1, 2): 7.0, (3, 4): lower_time, (5, 6): 5.0}
    assert cache.structure() == {(1, 2): {(3, 4): {}}, (5, 6): {}}
    assert cache.evict(2) == 2
    remaining = {(1, 2): {(3, 4): {}}, (5, 6): {}}
    if victim == (3, 4):
        remaining[(1, 2)] = {}
    else:
        del remaining[(5, 6)]
    assert cache.structure() == remaining
    cache.check_invariants()


@pytest.mark.parametrize(("mode", "lower_time"), [("keep", 3.0), ("stamp", 7.0)])
def test_insert_that_splits_an_edge(mode: str, lower_time: float) -> None:
    cache, now = _cache(mode)
    now[0] = 3.0
    _put(cache, [1, 2, 3, 4])
    now[0] = 7.0
    cache.insert(np.asarray([1, 2, 8]), cache.allocator.alloc(3))
    times = _leaf_times(cache)
    assert times == {(1, 2): 7.0, (3, 4): lower_time, (8,): 7.0}
    cache.check_invariants()


def test_unknown_split_recency_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"split_recency.*keep.*stamp"):
        RadixCache(CacheConfig(split_recency="lru"), SlotAllocator(8))
