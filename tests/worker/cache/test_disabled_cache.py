"""DisabledCache: same interface, caches nothing, frees everything it is handed."""

import numpy as np
import pytest

from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, CacheReq, PrefixCache
from worker.cache.disabled import DisabledCache


def test_disabled_cache_caches_nothing_and_leaks_nothing():
    alloc = SlotAllocator(16)
    cache = DisabledCache(CacheConfig(block_size=4), alloc)
    assert isinstance(cache, PrefixCache)
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert alloc.num_free == 16  # the cache took the slots and dropped them
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.num_matched == 0 and m.last_node is cache.root
    cache.inc_lock_ref(m.last_node)
    req = CacheReq(np.array([1, 2, 3]), alloc.alloc(3), m.last_node)
    cache.cache_unfinished_req(req)
    assert alloc.num_free == 13 and len(req.slots) == 3  # still the request's
    cache.cache_finished_req(req)
    assert alloc.num_free == 16 and len(req.slots) == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(10) == 0
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)
    cache.reset()
    assert cache.take_events() == []
    assert cache.snapshot("w", 2, 3).blocks == ()


def test_disabled_cache_validates_like_the_radix_cache():
    alloc = SlotAllocator(4)
    cache = DisabledCache(CacheConfig(), alloc)
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix([-1])
    with pytest.raises(ValueError, match="length"):
        cache.insert([1, 2], alloc.alloc(1))
    with pytest.raises(ValueError, match="root"):
        cache.inc_lock_ref(object())
