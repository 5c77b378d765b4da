"""PrefixIndex unit tests: exact matches, errors counted, predictions, the size cap."""

from __future__ import annotations

import pytest

from kvroute_proto.events import DEFAULT_PARTITION, AllCleared, BlockRemoved, BlockStored, Partition
from kvroute_proto.hashing import block_hash_list
from router.core.index import PrefixIndex
from router.core.index_api import ERROR_KINDS, IndexConfig

B = 4


def chain(tokens: list[int], partition: Partition = DEFAULT_PARTITION) -> list[int]:
    return block_hash_list(tokens, B, partition.seed)


def stored(hashes: list[int], start: int = 0, end: int | None = None, tokens=None) -> BlockStored:
    """BlockStored of hashes[start:end] with the right parent (token ids are dummies)."""
    part = hashes[start:end]
    parent = hashes[start - 1] if start else None
    toks = tuple(tokens) if tokens is not None else (0,) * (B * len(part))
    return BlockStored(tuple(part), parent, toks)


A = chain(list(range(40)))  # 10 blocks
C = chain(list(range(16)) + [99] * 24)  # shares 4 blocks with A


def test_empty_index_matches_nothing() -> None:
    index = PrefixIndex()
    assert index.find_matches(A) == {}
    assert index.find_matches([]) == {}
    assert index.size() == 0 and index.num_entries == 0


def test_match_depth_per_worker() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A))  # worker 0: all 10 blocks
    index.apply(1, stored(A, 0, 6))  # worker 1: first 6
    index.apply(2, stored(C))  # worker 2: C (first 4 shared with A)
    assert index.find_matches(A) == {0: 10, 1: 6, 2: 4}
    assert index.find_matches(A[:3]) == {0: 3, 1: 3, 2: 3}
    assert index.find_matches(C) == {0: 4, 1: 4, 2: 10}
    assert index.size() == 16
    assert index.num_entries == 10 + 6 + 10
    assert index.snapshot(1) == set(A[:6])


def test_match_stops_at_first_missing_block_even_if_later_ones_are_held() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A, 0, 3))
    index.apply(0, stored(A, 4, 8))  # block 3 missing: parent unknown
    assert index.errors["unknown_parent"] == 1
    assert index.find_matches(A) == {0: 3}
    index.apply(0, stored(A, 3, 4))  # the missing link arrives: the chain is whole
    assert index.find_matches(A) == {0: 8}


def test_chain_stored_with_unknown_parent_is_kept_and_counted() -> None:
    index = PrefixIndex()
    index.apply(3, stored(A, 5, 10))
    assert index.errors["unknown_parent"] == 1
    assert index.snapshot(3) == set(A[5:])
    assert index.find_matches(A) == {}  # cannot match from position 0
    assert index.find_matches(A[5:]) == {3: 5}  # but its blocks are indexed


def test_partitions_never_share_blocks() -> None:
    tokens = list(range(40))
    index = PrefixIndex()
    index.apply(0, stored(chain(tokens, Partition("tenant-a"))))
    assert index.find_matches(chain(tokens, Partition("tenant-b"))) == {}
    assert index.find_matches(chain(tokens, Partition("tenant-a"))) == {0: 10}


def test_duplicate_store_is_idempotent() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A))
    index.apply(0, stored(A))
    assert index.num_entries == 10
    assert index.num_worker_blocks(0) == 10


def test_remove_blocks_and_unknown_blocks() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A))
    index.apply(1, stored(A, 0, 4))
    index.apply(0, BlockRemoved(tuple(A[6:])))
    assert index.find_matches(A) == {0: 6, 1: 4}
    index.apply(1, BlockRemoved((A[3], A[9], 12345)))  # A[9]: not held by 1; 12345: unknown
    assert index.errors["unknown_block"] == 2
    assert index.find_matches(A) == {0: 6, 1: 3}
    assert index.size() == 6
    assert index.num_entries == 6 + 3


def test_remove_same_hash_twice_in_one_event() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A))
    index.apply(0, BlockRemoved((A[9], A[9])))
    assert index.size() == 9 and index.num_entries == 9
    index.apply(1, stored(A))
    index.apply(1, BlockRemoved((A[8], A[8])))
    assert index.errors["unknown_block"] == 2  # one repeat per event
    assert index.snapshot(1) == set(A) - {A[8]}


def test_all_cleared_and_remove_worker() -> None:
    index = PrefixIndex()
    index.apply(0, stored(A))
    index.apply(1, stored(C))
    index.apply(0, AllCleared())
    assert index.find_matches(A) == {1: 4}
    assert index.size() == 10 and index.num_entries == 10
    assert index.remove_worker(1) == 10
    assert index.size() == 0 and index.num_entries == 0
    assert index.remove_worker(1) == 0


def test_error_kinds_start_at_zero() -> None:
    assert dict(PrefixIndex().errors) == dict.fromkeys(ERROR_KINDS, 0)


def test_verify_hashes_rejects_wrong_partition_and_bad_chain() -> None:
    tokens = list(range(40))
    good = chain(tokens)
    index = PrefixIndex(IndexConfig(verify_hashes=True))
    index.apply(0, stored(good, 0, 5, tokens[:20]))
    other = chain(tokens, Partition("x"))
    index.apply(1, BlockStored(tuple(other[:5]), None, tuple(tokens[:20])))  # default partition
    index.apply(2, BlockStored(tuple(good[5:]), good[4], tuple([7] * 20)))  # wrong tokens
    index.apply(0, stored(good, 5, 10, tokens[20:]))
    assert index.errors["wrong_partition"] == 1
    assert index.errors["hash_mismatch"] == 1
    assert index.find_matches(good) == {0: 10}
    assert index.snapshot(1) == set() and index.snapshot(2) == set()


def test_predicted_entries_match_until_they_expire() -> None:
    index = PrefixIndex()  # stride 4: blocks 3 and 7 of A's 10 are kept
    index.predict(2, A, deadline=10.0)
    assert index.predicted(2) == {A[3], A[7]}
    assert index.num_predicted == 2
    assert index.find_matches(A) == {2: 8}  # a multiple of the stride
    assert index.find_matches(A[:6]) == {2: 4}
    assert index.find_matches(C) == {2: 4}  # C shares A's first 4 blocks
    assert index.snapshot(2) == set() and index.size() == 0  # not confirmed
    assert index.expire(9.9) == 0
    assert index.expire(10.0) == 2
    assert index.find_matches(A) == {}
    assert index.num_predicted == 0


def test_stride_one_predicts_every_block() -> None:
    index = PrefixIndex(IndexConfig(predict_stride=1))
    index.predict(0, A, deadline=1.0)
    assert index.find_matches(A) == {0: 10}
    assert index.find_matches(A[:3]) == {0: 3}


def test_match_is_the_longer_of_confirmed_and_predicted() -> None:
    index = PrefixIndex()
    index.apply(2, stored(A, 0, 6))
    index.predict(2, A, deadline=10.0)
    index.predict(1, A[:4], deadline=10.0)
    index.apply(0, stored(A, 0, 2))
    assert index.find_matches(A) == {2: 8, 1: 4, 0: 2}
    index.apply(2, stored(A, 6, 10))
    assert index.find_matches(A) == {2: 10, 1: 4, 0: 2}
    index.expire(10.0)
    assert index.find_matches(A) == {2: 10, 0: 2}


def test_matches_by_source_keep_events_and_predictions_apart() -> None:
    index = PrefixIndex()  # stride 4
    index.apply(2, stored(A, 0, 6))
    index.predict(2, A, deadline=10.0)  # probes 3 and 7
    index.predict(1, A[:4], deadline=10.0)  # probe 3
    index.apply(0, stored(A, 0, 2))
    assert index.find_matches_by_source(A) == ({2: 6, 0: 2}, {2: 8, 1: 4})
    assert index.find_matches(A) == {2: 8, 1: 4, 0: 2}
    index.expire(10.0)  # the predictions lapse, the events stay
    assert index.find_matches_by_source(A) == ({2: 6, 0: 2}, {})
    # a prediction that only continues a confirmed prefix is not a predicted match alone
    index.predict(0, A, deadline=20.0, start=4)  # enters probe 7 only
    assert index.find_matches_by_source(A) == ({2: 6, 0: 2}, {})
    assert index.find_matches(A)[0] == 2  # probe 3 is neither confirmed nor predicted for 0
    assert PrefixIndex().find_matches_by_source(A) == ({}, {})


def test_events_do_not_touch_predictions() -> None:
    index = PrefixIndex()
    index.predict(0, A, deadline=5.0)
    index.apply(0, BlockRemoved((A[3],)))  # not confirmed: an unknown block
    assert index.errors["unknown_block"] == 1
    assert index.find_matches(A) == {0: 8}
    index.apply(0, AllCleared())  # but a cleared worker's predictions go with it
    assert index.find_matches(A) == {}


def test_refreshed_predictions_outlive_their_first_deadline() -> None:
    index = PrefixIndex()
    index.predict(0, A, deadline=5.0)
    index.predict(1, A[:4], deadline=8.0)  # extends block 3 for both workers
    assert index.expire(5.0) == 1  # block 7 only
    assert index.find_matches(A) == {0: 4, 1: 4}
    index.refresh_predicted(A, deadline=12.0)
    assert index.expire(8.0) == 0
    assert index.expire(12.0) == 1
    assert index.find_matches(A) == {}


def test_out_of_order_deadlines_never_shorten_a_prediction() -> None:
    index = PrefixIndex()
    index.predict(0, A, deadline=5.0)
    index.predict(0, A, deadline=2.0)
    assert index.expire(2.0) == 0
    assert index.find_matches(A) == {0: 8}
    assert index.expire(5.0) == 2


def test_remove_worker_drops_its_predictions_only() -> None:
    index = PrefixIndex()
    index.predict(0, A, deadline=5.0)
    index.predict(1, A, deadline=5.0)
    index.remove_worker(0)
    assert index.find_matches(A) == {1: 8}
    assert index.predicted(0) == set()


def test_size_cap_evicts_least_recently_matched_leaves() -> None:
    a = chain([1] * 16)  # 4 blocks each, disjoint
    b = chain([2] * 16)
    c = chain([3] * 16)
    index = PrefixIndex(IndexConfig(max_blocks=8))  # evicts down to 8 - 8 // 16 = 8
    index.apply(0, stored(a))
    index.apply(0, stored(b))
    index.find_matches(a[:2])  # a's block 1 is matched, its blocks 2-3 are not
    index.find_matches(b)  # b's leaf is matched after that
    # (snapshot() and find_matches(touch=False) read without refreshing what they read)
    assert index.find_matches(a, touch=False) == {0: 4}
    index.apply(1, stored(c, 0, 1))  # 9 blocks: a's leaf is the least recently used
    assert (index.size(), index.num_evicted) == (8, 1)
    assert index.snapshot(0) == set(a[:3]) | set(b)
    index.apply(1, stored(c, 1, 2))  # a's block 2 is now a leaf, still the oldest
    assert index.snapshot(0) == set(a[:2]) | set(b)
    index.apply(1, stored(c, 2, 3))  # a's block 1 (matched before b) goes before b
    assert index.snapshot(0) == set(a[:1]) | set(b)
    assert index.snapshot(1) == set(c[:3])
    assert index.num_entries == index.size() == 8


def test_eviction_walks_up_a_chain_and_keeps_hot_prefix() -> None:
    a = chain([1] * 32)  # 8 blocks
    index = PrefixIndex(IndexConfig(max_blocks=8))
    index.apply(0, stored(a))
    index.find_matches(a[:3])  # prefix of 3 blocks is hot
    for k in range(4):
        index.apply(1, stored(chain([50 + k] * 4)))  # 1 new block each, newest stamps
    # each new block pushes the size to 9: a's cold tail (blocks 7, 6, 5, 4) goes leaf by
    # leaf, each parent inheriting its evicted child's recency; the newer chains stay.
    assert index.size() == 8
    assert index.find_matches(a) == {0: 4}
    assert index.num_evicted == 4
    assert index.num_entries == 8


def test_rejects_bad_config_and_slot() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        IndexConfig(max_blocks=0)
    with pytest.raises(ValueError, match="slot"):
        PrefixIndex().apply(-1, stored(A))
