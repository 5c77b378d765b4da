"""VecPrefixIndex (numpy) against PrefixIndex (dicts, the reference) on generated histories.

A Hypothesis state machine drives both indexes with the same operations -- stored chains
with and without their parents, partial prefixes, repeated and unknown hashes, removals,
clears, worker removal, predictions with holds and expiry, and a small size cap -- and after
every step asserts they answer alike: find_matches (with and without touch, so the LRU stamps
must agree for evictions to), find_matches_by_source, snapshots, sizes, counters. Worker
slots go past 64 so the second bitmask word is exercised; a hash of 0 is drawn too.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored
from kvroute_proto.hashing import block_hash_list
from router.index import IndexConfig, PrefixIndex, _depths
from router.index_vec import VecPrefixIndex

B = 2
STRIDE = 2
WORKERS = st.sampled_from([0, 1, 2, 63, 64, 130])
TOKENS = st.lists(st.integers(0, 1), min_size=B, max_size=7 * B)


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hash_list(tokens, B, 0)


class AgreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cap = 0
        self.ref: PrefixIndex | None = None
        self.vec: VecPrefixIndex | None = None
        self.chains: list[list[int]] = [[0, 1, 2]]
        self.handles: list[tuple[object, object]] = []
        self.now = 0.0

    @precondition(lambda self: self.ref is None)
    @rule(cap=st.sampled_from([6, 12, 40, 10_000]))
    def start(self, cap: int) -> None:
        config = IndexConfig(max_blocks=cap, predict_stride=STRIDE)
        self.ref, self.vec = PrefixIndex(config), VecPrefixIndex(config)

    def both(self) -> tuple[PrefixIndex, VecPrefixIndex]:
        if self.ref is None or self.vec is None:
            config = IndexConfig(predict_stride=STRIDE)
            self.ref, self.vec = PrefixIndex(config), VecPrefixIndex(config)
        return self.ref, self.vec

    @rule(w=WORKERS, tokens=TOKENS, data=st.data())
    def store(self, w: int, tokens: list[int], data: st.DataObject) -> None:
        ref, vec = self.both()
        chain = hashes_of(tokens)
        self.chains.append(chain)
        start = data.draw(st.integers(0, len(chain) - 1))
        end = data.draw(st.integers(start + 1, len(chain)))
        part = chain[start:end]
        if data.draw(st.booleans()):  # a repeated hash within the event
            part = part + part[:1]
        parent = chain[start - 1] if start else data.draw(st.sampled_from([None, None, 0, 7]))
        event = BlockStored(tuple(part), parent, (0,) * (B * len(part)))
        ref.apply(w, event)
        vec.apply(w, event)

    @rule(w=WORKERS, data=st.data())
    def store_raw(self, w: int, data: st.DataObject) -> None:
        """Arbitrary small hashes (0 included), not chained."""
        ref, vec = self.both()
        part = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        self.chains.append(part)
        event = BlockStored(tuple(part), None, (0,) * (B * len(part)))
        ref.apply(w, event)
        vec.apply(w, event)

    @rule(w=WORKERS, data=st.data())
    def remove(self, w: int, data: st.DataObject) -> None:
        ref, vec = self.both()
        universe = sorted({h for c in self.chains for h in c} | {12345})
        victims = tuple(data.draw(st.lists(st.sampled_from(universe), min_size=1, max_size=6)))
        ref.apply(w, BlockRemoved(victims))
        vec.apply(w, BlockRemoved(victims))

    @rule(w=WORKERS)
    def clear(self, w: int) -> None:
        ref, vec = self.both()
        ref.apply(w, AllCleared())
        vec.apply(w, AllCleared())

    @rule(w=WORKERS, predictions=st.booleans())
    def remove_worker(self, w: int, predictions: bool) -> None:
        ref, vec = self.both()
        assert ref.remove_worker(w, predictions) == vec.remove_worker(w, predictions)

    @rule(w=WORKERS, data=st.data(), hold=st.booleans(), ttl=st.sampled_from([1.0, 3.0]))
    def predict(self, w: int, data: st.DataObject, hold: bool, ttl: float) -> None:
        ref, vec = self.both()
        chain = data.draw(st.sampled_from(self.chains))
        start = data.draw(st.integers(0, len(chain)))
        a = ref.predict(w, chain, self.now + ttl, start, hold)
        b = vec.predict(w, chain, self.now + ttl, start, hold)
        assert list(a) == list(b)
        if hold and a:
            self.handles.append((a, b))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ref, vec = self.both()
        a, b = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        ref.release_predicted(a, self.now + 1.0)  # type: ignore[arg-type]
        vec.release_predicted(b, self.now + 1.0)  # type: ignore[arg-type]

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        ref, vec = self.both()
        self.now += dt
        assert ref.expire(self.now) == vec.expire(self.now)

    @rule(data=st.data(), touch=st.booleans())
    def find(self, data: st.DataObject, touch: bool) -> None:
        ref, vec = self.both()
        chain = data.draw(st.sampled_from(self.chains))
        n = data.draw(st.integers(0, len(chain)))
        query = chain[:n]
        assert ref.find_matches(query, touch) == vec.find_matches(query, touch), query
        assert ref.last_confirmed == vec.last_confirmed
        assert ref.find_matches_by_source(query) == vec.find_matches_by_source(query)

    @invariant()
    def agree(self) -> None:
        if self.ref is None or self.vec is None:
            return
        ref, vec = self.ref, self.vec
        vec.check_invariants()
        ref.check_invariants()
        assert ref.size() == vec.size()
        assert ref.num_entries == vec.num_entries
        assert ref.num_predicted == vec.num_predicted
        assert ref.num_evicted == vec.num_evicted
        assert dict(ref.errors) == dict(vec.errors)
        for w in (0, 1, 2, 63, 64, 130):
            assert ref.num_worker_blocks(w) == vec.num_worker_blocks(w)
            assert ref.snapshot(w) == vec.snapshot(w), w
            assert ref.predicted(w) == vec.predicted(w)
        for chain in self.chains[-4:]:
            assert ref.find_matches(chain, touch=False) == vec.find_matches(chain, touch=False)


AgreeMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestVecAgreesWithDictIndex = AgreeMachine.TestCase


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
    """router.index._depths (find_matches' depths) against its definition: a slot's depth is
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
