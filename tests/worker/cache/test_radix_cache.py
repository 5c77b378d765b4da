"""RadixCache unit tests: exact trees, splits, locks, sizes, requests, partitions, bad input."""

import numpy as np
import pytest

from kvroute_proto.events import DEFAULT_PARTITION, Partition
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, CacheReq
from worker.cache.radix_cache import RadixCache


def make(page_size=1, num_slots=256, block_size=None, clock=None):
    alloc = SlotAllocator(num_slots)
    cache = RadixCache(CacheConfig(page_size=page_size, block_size=block_size), alloc, clock)
    return cache, alloc


def put(cache, alloc, tokens, partition=DEFAULT_PARTITION, priority=0):
    """The worker's step: match, allocate the miss, insert, free duplicate slots."""
    m = cache.match_prefix(tokens, partition)
    new = alloc.alloc(len(tokens) - m.num_matched)
    slots = np.concatenate((m.slots, new))
    prefix_len = cache.insert(tokens, slots, partition, priority)
    alloc.free(slots[m.num_matched : prefix_len])
    cache.check_invariants()
    return prefix_len, slots


def state(cache, alloc):
    return (
        cache.pretty_print(),
        cache.evictable_size(),
        cache.protected_size(),
        alloc.num_free,
        alloc.allocated_slots().tolist(),
    )


def test_sglang_demo_tree_page_size_1():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    assert put(cache, alloc, [1, 2, 3])[0] == 3
    assert cache.structure() == {(1, 2, 3): {}}
    put(cache, alloc, [1, 2, 4, 5])  # splits [1,2,3] into [1,2] -> [3]
    assert cache.structure() == {(1, 2): {(3,): {}, (4, 5): {}}}
    put(cache, alloc, [1, 2, 4, 5, 6, 7])
    put(cache, alloc, [8, 9, 10, 11, 12])
    assert cache.structure() == {
        (1, 2): {(3,): {}, (4, 5): {(6, 7): {}}},
        (8, 9, 10, 11, 12): {},
    }
    assert cache.evictable_size() == 12 and cache.protected_size() == 0
    assert alloc.num_allocated == 12
    m = cache.match_prefix([1, 2, 3, 13, 14])
    assert m.num_matched == 3
    assert m.slots.tolist() == [0, 1, 2]  # the first insert's slots, never moved
    assert m.last_node.tokens.tolist() == [3]
    assert "[2] [1, 2] r=0" in cache.pretty_print()


def test_insert_returns_cached_length_and_caller_frees_duplicates():
    cache, alloc = make()
    fresh = alloc.alloc(4)
    assert cache.insert([5, 6, 7, 8], fresh) == 0
    dup = alloc.alloc(6)
    prefix_len = cache.insert([5, 6, 7, 8, 9, 10], dup)
    assert prefix_len == 4
    alloc.free(dup[:prefix_len])  # the tree kept its own copy of [5,6,7,8]
    assert cache.match_prefix([5, 6, 7, 8, 9, 10]).slots.tolist() == [0, 1, 2, 3, 8, 9]
    assert alloc.num_allocated == 6 == cache.evictable_size()
    cache.check_invariants()


def test_match_splits_mid_edge_and_new_parent_inherits():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5], priority=7)
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    cache.inc_lock_ref(leaf)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.num_matched == 3 and m.slots.tolist() == [0, 1, 2]
    assert cache.structure() == {(1, 2, 3): {(4, 5): {}}}
    parent = m.last_node
    assert parent is leaf.parent and leaf.tokens.tolist() == [4, 5]
    assert (parent.lock_ref, parent.priority, parent.hit_count) == (1, 7, 1)
    assert leaf.value.tolist() == [3, 4] and parent.value.tolist() == [0, 1, 2]
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    cache.check_invariants()


def test_match_of_a_prefix_ending_mid_edge_splits_there():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    m = cache.match_prefix([1, 2])
    assert m.num_matched == 2
    assert cache.structure() == {(1, 2): {(3,): {}}}
    assert cache.match_prefix([]).num_matched == 0
    assert cache.match_prefix([7]).last_node is cache.root
    cache.check_invariants()


def test_page_size_4_keys_children_by_first_page():
    cache, alloc = make(page_size=4)
    put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    # Diverges at token 6: the match rounds down to the page boundary at 4.
    assert put(cache, alloc, [1, 2, 3, 4, 5, 6, 9, 9])[0] == 4
    assert cache.structure() == {(1, 2, 3, 4): {(5, 6, 7, 8): {}, (5, 6, 9, 9): {}}}
    # Two children share their first token (5): only a page-sized child key tells them apart.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).num_matched == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]).num_matched == 8
    assert cache.match_prefix([1, 2, 3]).num_matched == 0
    with pytest.raises(ValueError, match="multiple of page_size=4"):
        cache.insert([1, 2, 3, 4, 5], alloc.alloc(5))
    assert cache.evictable_size() == 12
    cache.check_invariants()


def test_page_size_4_split_inside_edge_lands_on_page_boundary():
    cache, alloc = make(page_size=4)
    put(cache, alloc, list(range(1, 13)))
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0])
    assert m.num_matched == 8
    assert cache.structure() == {(1, 2, 3, 4, 5, 6, 7, 8): {(9, 10, 11, 12): {}}}
    cache.check_invariants()


def test_match_refreshes_recency_along_the_whole_path():
    now = [100.0]
    cache, alloc = make(clock=lambda: now[0])
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [1, 2, 4, 5])
    now[0] = 200.0
    m = cache.match_prefix([1, 2, 4, 5, 6])
    node = m.last_node
    path = []
    while node is not cache.root:
        path.append(node)
        node = node.parent
    assert [n.last_access for n in path] == [200.0, 200.0, 200.0]
    sibling = cache.match_prefix([1, 2, 3]).last_node  # (refreshes it too, at 200)
    assert sibling.last_access == 200.0
    cache.check_invariants()


def test_locks_move_tokens_between_evictable_and_protected():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4, 5])
    leaf = cache.match_prefix([1, 2, 4, 5]).last_node
    cache.inc_lock_ref(leaf)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    cache.inc_lock_ref(leaf)
    assert leaf.lock_ref == 2 and leaf.parent.lock_ref == 2
    cache.dec_lock_ref(leaf)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    cache.dec_lock_ref(leaf)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 5)
    before = state(cache, alloc)
    with pytest.raises(ValueError, match="below 0"):
        cache.dec_lock_ref(leaf)
    assert state(cache, alloc) == before
    cache.inc_lock_ref(cache.root)  # the root: no-op both ways
    cache.dec_lock_ref(cache.root)
    cache.check_invariants()


def test_locked_path_survives_eviction_and_unlocked_parent_is_not_a_candidate():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4, 5])
    leaf = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(leaf)
    assert cache.evict(100) == 2  # only [4,5]
    assert cache.structure() == {(1, 2): {(3,): {}}}
    assert cache.evict(100) == 0
    cache.dec_lock_ref(leaf)
    assert cache.evict(1) == 1  # [3]; then [1,2] is a leaf but 1 token sufficed
    assert cache.evict(1) == 2
    assert cache.structure() == {} and alloc.num_free == alloc.num_slots
    cache.check_invariants()


def test_evicted_or_foreign_nodes_cannot_be_locked():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    leaf = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    assert leaf.evicted
    with pytest.raises(ValueError, match="not in this cache"):
        cache.inc_lock_ref(leaf)
    other, other_alloc = make()
    put(other, other_alloc, [1])
    with pytest.raises(ValueError, match="not in this cache"):
        cache.inc_lock_ref(other.match_prefix([1]).last_node)
    with pytest.raises(TypeError):
        cache.inc_lock_ref("node")


def test_partitions_never_share_nodes():
    cache, alloc = make()
    lora = Partition(extra_key="lora-a")
    salted = Partition(cache_salt="s1")
    put(cache, alloc, [1, 2, 3])
    assert cache.match_prefix([1, 2, 3], lora).num_matched == 0
    assert put(cache, alloc, [1, 2, 3], lora)[0] == 0
    put(cache, alloc, [1, 2, 9], salted)
    assert cache.structure() == {(1, 2, 3): {}}
    assert cache.structure(lora) == {(1, 2, 3): {}}
    assert cache.structure(salted) == {(1, 2, 9): {}}
    assert len(cache.root.children) == 3
    assert cache.match_prefix([1, 2, 3], lora).slots.tolist() == [3, 4, 5]
    with pytest.raises(TypeError, match="Partition"):
        cache.match_prefix([1], "lora-a")
    cache.check_invariants()


def test_request_with_a_node_of_another_partition_raises():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    extra = alloc.alloc(1)
    req = CacheReq(
        token_ids=np.array([1, 2, 3, 4]),
        slots=np.concatenate((m.slots, extra)),
        last_node=m.last_node,
        num_tree_tokens=3,
        partition=Partition(extra_key="other"),
    )
    before = state(cache, alloc)
    with pytest.raises(ValueError, match="partition"):
        cache.cache_finished_req(req)
    assert state(cache, alloc) == before


@pytest.mark.parametrize(
    ("tokens", "slots", "exc", "message"),
    [
        ([1, -2, 3], [0, 1, 2], ValueError, r"token_ids\[1\]=-2"),
        ([1, 2**32, 3], [0, 1, 2], ValueError, r"token_ids\[1\]"),
        ([1.0, 2.0], [0, 1], TypeError, "token_ids"),
        (["a"], [0], TypeError, "token_ids"),
        ([[1, 2]], [0, 1], ValueError, "1-D"),
        ([1, 2, 3], [0, 1], ValueError, "length 2"),
        ([1, 2], [0, 999], ValueError, r"slots\[1\]=999"),
        ([1, 2], [0.0, 1.0], TypeError, "slots"),
    ],
)
def test_bad_input_raises_clearly_and_changes_nothing(tokens, slots, exc, message):
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    before = state(cache, alloc)
    with pytest.raises(exc, match=message):
        cache.insert(tokens, np.asarray(slots))
    if message.startswith(("token_ids", "1-D")):  # match_prefix validates tokens alike
        with pytest.raises(exc, match=message):
            cache.match_prefix(tokens)
    assert state(cache, alloc) == before
    cache.check_invariants()


def test_non_int_priority_raises_before_any_change():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    before = state(cache, alloc)
    with pytest.raises(TypeError, match="priority must be an int"):
        cache.insert([1, 2, 4], np.array([0, 1, 5]), priority="high")
    assert state(cache, alloc) == before


def test_numpy_token_dtypes_are_accepted():
    cache, alloc = make()
    put(cache, alloc, np.array([1, 2, 3], dtype=np.uint32))
    assert cache.match_prefix(np.array([1, 2, 3], dtype=np.int32)).num_matched == 3
    assert cache.match_prefix(np.array([1, 2, 3], dtype=np.uint64)).num_matched == 3


def test_unknown_config_values_raise():
    alloc = SlotAllocator(4)
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        RadixCache(CacheConfig(eviction_policy="random"), alloc)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(CacheConfig(page_size=0), alloc)
    with pytest.raises(ValueError, match="block_size"):
        RadixCache(CacheConfig(block_size=0), alloc)


# --------------------------------------------------------------------------- requests


def start_req(cache, alloc, tokens, partition=DEFAULT_PARTITION):
    """Admit a request: match, lock, allocate and 'compute' every uncached token."""
    m = cache.match_prefix(tokens, partition)
    cache.inc_lock_ref(m.last_node)
    new = alloc.alloc(len(tokens) - m.num_matched)
    return CacheReq(
        token_ids=np.asarray(tokens, dtype=np.int64),
        slots=np.concatenate((m.slots, new)),
        last_node=m.last_node,
        num_tree_tokens=m.num_matched,
        partition=partition,
    )


def owned(req):
    return len(req.slots) - req.num_tree_tokens


def test_finished_request_is_cached_and_owns_nothing():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    req = start_req(cache, alloc, [1, 2, 3, 4, 5])
    assert (req.num_tree_tokens, cache.protected_size()) == (3, 3)
    cache.cache_finished_req(req)
    assert cache.structure() == {(1, 2, 3): {(4, 5): {}}}
    assert len(req.slots) == 0 and req.last_node is cache.root and req.num_tree_tokens == 0
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert alloc.num_allocated == 5
    cache.check_invariants()


def test_finished_request_frees_duplicates_computed_concurrently():
    cache, alloc = make()
    a = start_req(cache, alloc, [7, 8, 9, 10])
    b = start_req(cache, alloc, [7, 8, 9, 11])  # nothing cached yet: computes 7,8,9 too
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # [7,8,9] already cached: b's copies are freed
    assert cache.structure() == {(7, 8, 9): {(10,): {}, (11,): {}}}
    assert alloc.num_allocated == 5 == cache.evictable_size()
    cache.check_invariants()


def test_unfinished_request_page_4_keeps_partial_tail_then_finishes():
    cache, alloc = make(page_size=4)
    tokens = list(range(10, 23))  # 13 tokens
    req = start_req(cache, alloc, tokens[:10])  # first chunk: 10 tokens computed
    tail_slots = req.slots[8:10].copy()
    cache.cache_unfinished_req(req)
    assert cache.structure() == {(10, 11, 12, 13, 14, 15, 16, 17): {}}
    assert req.num_tree_tokens == 8 and req.last_node.end == 8
    assert req.slots[8:].tolist() == tail_slots.tolist()  # unaligned tail: still the request's
    assert alloc.is_allocated(tail_slots).all()
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert alloc.num_allocated == 8 + owned(req)
    cache.check_invariants()
    # second chunk: 3 more tokens
    req.token_ids = np.asarray(tokens, dtype=np.int64)
    req.slots = np.concatenate((req.slots, alloc.alloc(3)))
    cache.cache_unfinished_req(req)
    assert req.num_tree_tokens == 12 and owned(req) == 1
    assert cache.structure() == {(10, 11, 12, 13, 14, 15, 16, 17): {(18, 19, 20, 21): {}}}
    assert cache.protected_size() == 12
    cache.check_invariants()
    last_slot = req.slots[12]
    cache.cache_finished_req(req)
    assert not alloc.is_allocated([last_slot])[0]  # the partial page is freed
    assert (cache.protected_size(), cache.evictable_size(), alloc.num_allocated) == (0, 12, 12)
    cache.check_invariants()


def test_unfinished_requests_share_the_first_ones_copy():
    cache, alloc = make()
    a = start_req(cache, alloc, [1, 2, 3, 4])
    b = start_req(cache, alloc, [1, 2, 3, 5])
    cache.cache_unfinished_req(a)
    b_own = b.slots.copy()
    cache.cache_unfinished_req(b)
    assert b.slots[:3].tolist() == a.slots[:3].tolist()  # now pointing at the tree's copy
    assert not alloc.is_allocated(b_own[:3]).any()  # b's duplicates went back
    assert cache.structure() == {(1, 2, 3): {(4,): {}, (5,): {}}}
    assert cache.protected_size() == 5 and alloc.num_allocated == 5
    cache.check_invariants()
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5 == alloc.num_allocated
    cache.check_invariants()


def test_request_with_inconsistent_tree_tokens_raises():
    cache, alloc = make()
    req = start_req(cache, alloc, [1, 2, 3])
    req.num_tree_tokens = 2  # but last_node is the root (end 0)
    with pytest.raises(ValueError, match="num_tree_tokens"):
        cache.cache_finished_req(req)
    req.num_tree_tokens = 0
    req.slots = req.slots[:2]
    with pytest.raises(ValueError, match="length 2"):
        cache.cache_unfinished_req(req)


def test_reset_frees_everything_unlocked_and_keeps_locked_paths():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [5, 6])
    keep = cache.match_prefix([1, 2, 4]).last_node
    cache.inc_lock_ref(keep)
    cache.reset()
    assert cache.structure() == {(1, 2): {(4,): {}}}
    assert (cache.evictable_size(), cache.protected_size(), alloc.num_allocated) == (0, 3, 3)
    cache.check_invariants()
    cache.dec_lock_ref(keep)
    cache.reset()
    assert cache.structure() == {} and alloc.num_free == alloc.num_slots
    cache.check_invariants()


def test_matching_unknown_partitions_registers_nothing():
    cache = RadixCache(CacheConfig(), SlotAllocator(64))
    for i in range(200):
        assert cache.match_prefix([1, 2, 3], Partition(cache_salt=f"tenant-{i}")).num_matched == 0
    assert cache.num_partitions == 0
    with pytest.raises(TypeError, match="partition must be a Partition"):
        cache.match_prefix([1, 2], "salt")  # type: ignore[arg-type]


def test_partition_ids_of_evicted_partitions_are_recycled():
    alloc = SlotAllocator(4096)
    cache = RadixCache(CacheConfig(), alloc)
    for i in range(500):  # one short request per unique salt, evicted right away
        part = Partition(cache_salt=f"req-{i}")
        slots = alloc.alloc(3)
        assert cache.insert([7, 8, 9], slots, part) == 0
        assert cache.match_prefix([7, 8, 9], part).num_matched == 3
        assert cache.evict(3) == 3
        cache.check_invariants()
    assert cache.num_partitions <= 64 + 1
    assert alloc.num_free == 4096
    # a recycled id serves a new partition; old ones match nothing
    kept = Partition(cache_salt="kept")
    cache.insert([1, 2, 3, 4], alloc.alloc(4), kept)
    cache.check_invariants()
    assert cache.match_prefix([1, 2, 3, 4], kept).num_matched == 4
    assert cache.match_prefix([7, 8, 9], Partition(cache_salt="req-0")).num_matched == 0


def test_reset_keeps_the_partitions_of_locked_paths():
    alloc = SlotAllocator(64)
    cache = RadixCache(CacheConfig(), alloc)
    a, b = Partition(cache_salt="a"), Partition(cache_salt="b")
    cache.insert([1, 2], alloc.alloc(2), a)
    cache.insert([1, 2], alloc.alloc(2), b)
    locked = cache.match_prefix([1, 2], b).last_node
    cache.inc_lock_ref(locked)
    cache.reset()
    cache.check_invariants()
    assert cache.match_prefix([1, 2], a).num_matched == 0
    assert cache.match_prefix([1, 2], b).num_matched == 2
    cache.dec_lock_ref(locked)
