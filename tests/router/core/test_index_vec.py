"""VecPrefixIndex (numpy) against PrefixIndex (dicts, the reference): the shared agreement
state machine (index_agreement.py) on generated histories, and the table's collisions."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_agreement import B, IndexAgreement

from kvroute_proto.events import BlockRemoved, BlockStored
from router.core.index import IndexConfig, PrefixIndex, _depths
from router.core.index_vec import VecPrefixIndex


class VecAgreement(IndexAgreement):
    make_other = VecPrefixIndex


VecAgreement.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestVecAgreesWithDictIndex = VecAgreement.TestCase


def test_held_prediction_with_a_repeated_hash_releases() -> None:
    """A prompt whose sparse probes repeat a hash (a collision): held once, freed once
    (release raised KeyError before), on both indexes."""
    for index in (PrefixIndex(IndexConfig(predict_stride=1)), VecPrefixIndex()):
        index = type(index)(IndexConfig(predict_stride=1))
        handle = index.predict(3, [5, 5, 6], 1.0, hold=True)
        index.release_predicted(handle, 2.0)
        assert index.predicted(3) == {5, 6}
        assert index.expire(2.0) == 2 and index.predicted(3) == set()


@given(st.lists(st.integers(0, 2**70), min_size=1, max_size=30))
def test_depths_is_the_leading_run_per_slot(masks: list[int]) -> None:
    """router.core.index._depths (find_matches' depths) against its definition: a slot's depth is
    how many leading bitsets contain it; the running AND stops where it reaches 0."""
    masks = [m or 1 for m in masks]  # the walk's bitsets are nonzero
    run, depths = _depths(masks)
    expect = {}
    for slot in range(71):
        n = 0
        while n < len(masks) and masks[n] >> slot & 1:
            n += 1
        if n:
            expect[slot] = n
    assert depths == expect
    acc, want = -1, []
    for m in masks:
        acc &= m
        if not acc:
            break
        want.append(acc)
    assert run == want


def _same_home(home: int, count: int, cap: int = 1024) -> list[int]:
    """``count`` distinct hashes whose home slot in a table of ``cap`` slots is ``home``."""
    shift = 64 - (cap.bit_length() - 1)
    inv = pow(0x9E3779B97F4A7C15, -1, 1 << 64)
    return [((home << shift) + j + 1) * inv % (1 << 64) for j in range(count)]


def test_long_probe_runs_agree_with_the_dict_index() -> None:
    """Keys crowding one home slot (windows full: the slot-by-slot path), stored in one
    event with others, across workers, removed and stored again."""
    crowd = _same_home(5, 20) + _same_home(6, 6) + _same_home(1023, 12)
    ref, vec = PrefixIndex(), VecPrefixIndex()
    for w, part in enumerate((crowd[:10], crowd, crowd[5:30], crowd[::-1])):
        event = BlockStored(tuple(part), None, (0,) * (B * len(part)))
        ref.apply(w, event)
        vec.apply(w, event)
    removed = BlockRemoved(tuple(crowd[3:17]))
    for index in (ref, vec):
        index.apply(1, removed)
        index.apply(0, BlockStored(tuple(crowd[::2]), None, (0,) * (B * 19)))
    vec.check_invariants()
    assert vec.size() == ref.size() and vec.num_entries == ref.num_entries
    for w in range(4):
        assert vec.snapshot(w) == ref.snapshot(w)
    for q in (crowd, crowd[::-1], crowd[5:], crowd[::2]):
        assert vec.find_matches(q) == ref.find_matches(q)


def test_crowded_homes_in_one_event_agree_with_the_dict_index() -> None:
    """Events whose keys share a few neighbouring homes: keys race for the same empty
    slots while others, their window full, claim slot by slot in the same round."""
    rng = random.Random(0)
    pool = [h for home in (40, 41, 42, 44) for h in _same_home(home, 14)]
    for _ in range(30):
        ref, vec = PrefixIndex(), VecPrefixIndex()
        for w in range(3):
            part = rng.sample(pool, rng.randint(5, len(pool)))
            event = BlockStored(tuple(part), None, (0,) * (B * len(part)))
            ref.apply(w, event)
            vec.apply(w, event)
            vec.check_invariants()
            assert vec.num_entries == ref.num_entries
            for v in range(3):
                assert vec.snapshot(v) == ref.snapshot(v)
