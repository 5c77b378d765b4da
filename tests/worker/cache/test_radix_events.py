"""Event outbox: which blocks are held, exact events, split silence, replay == snapshot."""

import numpy as np

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, Partition
from kvroute_proto.hashing import block_hash_list, chain_block_hash
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig
from worker.cache.radix_cache import RadixCache

P0 = Partition()


def make(block_size, page_size=1):
    alloc = SlotAllocator(4096)
    return RadixCache(CacheConfig(page_size=page_size, block_size=block_size), alloc), alloc


def put(cache, alloc, tokens, partition=P0):
    m = cache.match_prefix(tokens, partition)
    slots = np.concatenate((m.slots, alloc.alloc(len(tokens) - m.num_matched)))
    prefix_len = cache.insert(tokens, slots, partition)
    alloc.free(slots[m.num_matched : prefix_len])
    cache.check_invariants()


def replay(events, held):
    for ev in events:
        match ev:
            case BlockStored(block_hashes=hashes):
                assert not held & set(hashes), "stored twice"
                held |= set(hashes)
            case BlockRemoved(block_hashes=hashes):
                assert set(hashes) <= held, "removed a block not held"
                held -= set(hashes)
            case AllCleared():
                held.clear()
    return held


def snapshot_hashes(cache):
    return {h for b in cache.snapshot("w", 1, 0).blocks for h in b.block_hashes}


def test_insert_announces_full_blocks_only():
    cache, alloc = make(block_size=4)
    tokens = list(range(100, 110))  # 10 tokens: blocks 0 and 1, partial tail
    put(cache, alloc, tokens)
    (ev,) = cache.take_events()
    assert ev == BlockStored(
        block_hashes=tuple(block_hash_list(tokens, 4, P0.seed)),
        parent_hash=None,
        token_ids=tuple(tokens[:8]),
        partition=P0,
    )
    assert cache.take_events() == []


def test_split_emits_nothing_and_spanning_block_belongs_to_the_child():
    cache, alloc = make(block_size=4)
    first = list(range(100, 110))
    put(cache, alloc, first)
    cache.take_events()
    # Diverge at position 6, inside block 1 ([4, 8)): the split at 6 emits nothing ...
    cache.match_prefix([*first[:6], 7])
    assert cache.take_events() == []
    assert cache.structure() == {tuple(first[:6]): {tuple(first[6:]): {}}}
    parent = cache.match_prefix(first[:6]).last_node
    assert len(parent.hashes) == 1 and len(next(iter(parent.children.values())).hashes) == 1
    # ... and a new branch announces its own block 1, chained to block 0.
    second = [*first[:6], 1, 2, 3]
    put(cache, alloc, second)
    (ev,) = cache.take_events()
    h = block_hash_list(second, 4, P0.seed)
    assert ev.block_hashes == (h[1],)
    assert ev.parent_hash == h[0]
    assert ev.token_array.tolist() == list(second[4:8])
    assert chain_block_hash(ev.parent_hash, ev.token_array, P0.seed) == h[1]


def test_short_nodes_chain_through_several_ancestors():
    cache, alloc = make(block_size=5)
    seqs = [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    held = set()
    for seq in seqs:
        put(cache, alloc, seq)
        held = replay(cache.take_events(), held)
    # Reinsert branches so nodes end at 2, 4, 6: block 0 ([0,5)) is held by the node [5,6].
    put(cache, alloc, [1, 2, 9])
    put(cache, alloc, [1, 2, 3, 4, 9])
    put(cache, alloc, [1, 2, 3, 4, 5, 6, 9])
    held = replay(cache.take_events(), held)
    expect = set(block_hash_list(seqs[-1], 5, P0.seed))
    expect |= set(block_hash_list([1, 2, 3, 4, 9], 5, P0.seed))
    assert held == expect == snapshot_hashes(cache)


def test_eviction_removes_exactly_the_leafs_blocks():
    cache, alloc = make(block_size=2)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4, 5, 6])
    cache.take_events()
    assert cache.evict(1) == 1  # [3] (LRU): its path has no full block 1
    assert cache.take_events() == []
    assert cache.evict(1) == 3  # [4,5,6]: holds block 1 ([2,4))
    h = block_hash_list([1, 2, 4, 5], 2, P0.seed)
    assert cache.take_events() == [BlockRemoved((h[1],))]
    assert cache.evict(1) == 2
    assert cache.take_events() == [BlockRemoved((h[0],))]


def test_reset_emits_all_cleared_then_the_locked_remainder():
    cache, alloc = make(block_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [5, 6])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.take_events()
    cache.reset()
    events = cache.take_events()
    assert events[0] == AllCleared()
    assert (
        replay(events, {123})
        == snapshot_hashes(cache)
        == set(block_hash_list([1, 2, 3, 4], 2, P0.seed))
    )


def test_partitions_hash_with_their_own_seed():
    cache, alloc = make(block_size=2)
    lora = Partition(extra_key="lora")
    put(cache, alloc, [1, 2])
    put(cache, alloc, [1, 2], lora)
    a, b = cache.take_events()
    assert a.partition == P0 and b.partition == lora
    assert a.block_hashes != b.block_hashes
    assert b.block_hashes == tuple(block_hash_list([1, 2], 2, lora.seed))


def test_snapshot_lists_parents_first_and_matches_replay():
    cache, alloc = make(block_size=3, page_size=2)
    rng = np.random.default_rng(7)
    held = set()
    for _ in range(60):
        n = 2 * int(rng.integers(1, 8))
        put(cache, alloc, rng.integers(0, 3, size=n).tolist())
        if rng.random() < 0.3:
            cache.evict(int(rng.integers(1, 8)))
        held = replay(cache.take_events(), held)
        snap = cache.snapshot("w", 1, 5)
        assert held == snapshot_hashes(cache)
        seen = set()
        for block in snap.blocks:
            assert block.parent_hash is None or block.parent_hash in seen
            seen |= set(block.block_hashes)
    assert snap.block_size == 3 and (snap.worker_id, snap.epoch, snap.seq) == ("w", 1, 5)


def test_events_off_means_empty_outbox_and_snapshot():
    cache, alloc = make(block_size=None)
    put(cache, alloc, [1, 2, 3, 4])
    cache.evict(4)
    cache.reset()
    assert cache.take_events() == []
    assert cache.snapshot("w", 0, 0).blocks == ()


def test_block_shared_by_siblings_is_announced_once_and_removed_last():
    # page 4, block 3: children [7,1,0,0] and [7,1,2,2] of [5,5,5,5] both hold block 1,
    # positions [3,6) = (5, 7, 1).
    cache, alloc = make(block_size=3, page_size=4)
    a = [5, 5, 5, 5, 7, 1, 0, 0]
    b = [5, 5, 5, 5, 7, 1, 2, 2]
    ha = block_hash_list(a, 3, P0.seed)
    hb = block_hash_list(b, 3, P0.seed)
    assert ha[1] == hb[1]
    put(cache, alloc, a)
    assert [ev.block_hashes for ev in cache.take_events()] == [(ha[0], ha[1])]
    put(cache, alloc, b)
    assert cache.take_events() == []  # block 1 already held; block 2 = [6,9) is not full
    assert cache.structure() == {(5, 5, 5, 5): {(7, 1, 0, 0): {}, (7, 1, 2, 2): {}}}
    c = [5, 5, 5, 5, 7, 1, 2, 2, 3, 3, 3, 3]
    put(cache, alloc, c)
    (ev,) = cache.take_events()
    hc = block_hash_list(c, 3, P0.seed)
    assert ev.block_hashes == (hc[2], hc[3]) and ev.parent_hash == hc[1]
    assert cache.evict(4) == 4  # LRU leaf [7,1,0,0]: block 1 still held by its sibling
    assert cache.take_events() == []
    assert cache.evict(8) == 8  # [3,3,3,3] then [7,1,2,2]
    assert cache.take_events() == [BlockRemoved((hc[2], hc[3])), BlockRemoved((hc[1],))]
    assert snapshot_hashes(cache) == {ha[0]}
    cache.check_invariants()
