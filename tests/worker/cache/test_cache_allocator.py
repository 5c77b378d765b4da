"""SlotAllocator: order, exhaustion, and every misuse raising without changing state."""

import numpy as np
import pytest

from worker.cache.allocator import SlotAllocator


def test_fresh_allocator_hands_out_ascending_slots():
    alloc = SlotAllocator(8)
    assert alloc.num_slots == 8 and alloc.num_free == 8
    first = alloc.alloc(3)
    assert first.dtype == np.int64
    assert first.tolist() == [0, 1, 2]
    assert alloc.alloc(2).tolist() == [3, 4]
    assert alloc.num_free == 3 and alloc.num_allocated == 5


def test_alloc_returns_none_when_short_and_changes_nothing():
    alloc = SlotAllocator(4)
    alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1
    assert alloc.alloc(1).tolist() == [3]
    assert alloc.alloc(0).tolist() == []


def test_freed_slots_are_reused_lifo():
    alloc = SlotAllocator(6)
    slots = alloc.alloc(6)
    alloc.free(slots[[4, 1]])
    assert alloc.num_free == 2
    assert sorted(alloc.alloc(2).tolist()) == [1, 4]
    assert alloc.alloc(1) is None


def test_free_accepts_lists_and_empty():
    alloc = SlotAllocator(4)
    alloc.alloc(4)
    alloc.free([])
    alloc.free(np.array([], dtype=np.int64))
    alloc.free([2, 0])
    assert alloc.allocated_slots().tolist() == [1, 3]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 1], "more than once"),
        ([5], "not allocated"),
        ([9], "outside"),
        ([-1], "outside"),
    ],
)
def test_misuse_raises_and_frees_nothing(bad, message):
    alloc = SlotAllocator(9)
    alloc.alloc(5)  # 0..4 allocated
    before = alloc.allocated_slots().tolist()
    with pytest.raises(ValueError, match=message):
        alloc.free(np.array([0, *bad], dtype=np.int64))
    assert alloc.allocated_slots().tolist() == before
    assert alloc.num_free == 4


def test_double_free_across_calls_raises():
    alloc = SlotAllocator(3)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(slots[:1])
    assert alloc.num_free == 3


def test_non_integer_slots_raise_type_error():
    alloc = SlotAllocator(3)
    alloc.alloc(3)
    with pytest.raises(TypeError):
        alloc.free(np.array([0.0]))
    with pytest.raises(ValueError, match="n must be >= 0"):
        alloc.alloc(-1)
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator(-2)
