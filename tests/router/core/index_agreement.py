"""The index agreement state machine: a Hypothesis machine that drives the router's
reference prefix index (router.core.index.PrefixIndex, dicts) and another implementation with the
same operations -- stored chains with and without their parents, partial prefixes, repeated
and unknown hashes, removals, clears, worker removal, predictions with holds, refreshes and
expiry, and a small size cap -- and after every step asserts they answer alike:
find_matches (with and without touch, so the LRU stamps must agree for evictions to),
match_depth (one worker's find_matches answer), find_matches_by_source, snapshots, sizes,
counters. Worker slots go past 64 so a second bitmask word is exercised; a hash of 0 is
drawn too. test_index_nb.py subclasses it, for each of find_matches' paths (the C-API
one, router.core.index_capi, and the plain one). Both sides are driven through the
interface they share (router.core.index_api.PrefixIndexAPI).
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute_proto.codec import decode_stream_message, encode_stream_message
from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, EventBatch, KvEvent
from kvroute_proto.hashing import block_hash_list
from router.core.index import PrefixIndex
from router.core.index_api import IndexConfig, PrefixIndexAPI

B = 2
STRIDE = 2
WORKERS = st.sampled_from([0, 1, 2, 63, 64, 130])
TOKENS = st.lists(st.integers(0, 1), min_size=B, max_size=7 * B)


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hash_list(tokens, B, 0)


def maybe_wire(event: KvEvent, data: st.DataObject) -> KvEvent:
    """The event itself, or (as drawn) as the router receives it: encoded into an
    EventBatch's wire bytes and decoded (hashes as kvroute_proto.codec.PackedHashes, whose
    array an index may take as it is)."""
    if not data.draw(st.booleans()):
        return event
    batch = decode_stream_message(encode_stream_message(EventBatch("w", 1, 1, B, (event,))))
    assert isinstance(batch, EventBatch)
    return batch.events[0]


class IndexAgreement(RuleBasedStateMachine):
    """Drives the reference (dict) index and ``make_other``'s with the same operations and
    asserts after every step that they answer alike. Subclass it with ``make_other``."""

    make_other: Callable[[IndexConfig], PrefixIndexAPI]

    def __init__(self) -> None:
        super().__init__()
        self.cap = 0
        self.ref: PrefixIndexAPI | None = None
        self.other: PrefixIndexAPI | None = None
        self.chains: list[list[int]] = [[0, 1, 2]]
        self.handles: list[tuple[object, object]] = []
        self.now = 0.0

    @precondition(lambda self: self.ref is None)
    @rule(cap=st.sampled_from([6, 12, 40, 10_000]))
    def start(self, cap: int) -> None:
        config = IndexConfig(max_blocks=cap, predict_stride=STRIDE)
        self.ref, self.other = PrefixIndex(config), type(self).make_other(config)

    def both(self) -> tuple[PrefixIndexAPI, PrefixIndexAPI]:
        if self.ref is None or self.other is None:
            config = IndexConfig(predict_stride=STRIDE)
            self.ref, self.other = PrefixIndex(config), type(self).make_other(config)
        return self.ref, self.other

    @rule(w=WORKERS, tokens=TOKENS, data=st.data())
    def store(self, w: int, tokens: list[int], data: st.DataObject) -> None:
        ref, other = self.both()
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
        other.apply(w, maybe_wire(event, data))

    @rule(w=WORKERS, data=st.data())
    def store_raw(self, w: int, data: st.DataObject) -> None:
        """Arbitrary small hashes (0 included), not chained."""
        ref, other = self.both()
        part = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        self.chains.append(part)
        event = BlockStored(tuple(part), None, (0,) * (B * len(part)))
        ref.apply(w, event)
        other.apply(w, maybe_wire(event, data))

    @rule(w=WORKERS, data=st.data())
    def remove(self, w: int, data: st.DataObject) -> None:
        ref, other = self.both()
        universe = sorted({h for c in self.chains for h in c} | {12345})
        victims = tuple(data.draw(st.lists(st.sampled_from(universe), min_size=1, max_size=6)))
        ref.apply(w, BlockRemoved(victims))
        other.apply(w, maybe_wire(BlockRemoved(victims), data))

    @rule(w=WORKERS)
    def clear(self, w: int) -> None:
        ref, other = self.both()
        ref.apply(w, AllCleared())
        other.apply(w, AllCleared())

    @rule(w=WORKERS, predictions=st.booleans())
    def remove_worker(self, w: int, predictions: bool) -> None:
        ref, other = self.both()
        assert ref.remove_worker(w, predictions) == other.remove_worker(w, predictions)

    @rule(w=WORKERS, data=st.data(), hold=st.booleans(), ttl=st.sampled_from([1.0, 3.0]))
    def predict(self, w: int, data: st.DataObject, hold: bool, ttl: float) -> None:
        ref, other = self.both()
        # recent chains more often: predictions overlapping, refreshed and outliving others
        chain = data.draw(st.sampled_from(self.chains[-2:]) | st.sampled_from(self.chains))
        start = data.draw(st.integers(0, len(chain)))
        a = ref.predict(w, chain, self.now + ttl, start, hold)
        b = other.predict(w, chain, self.now + ttl, start, hold)
        assert list(a) == list(b)
        if hold and a:
            self.handles.append((a, b))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ref, other = self.both()
        a, b = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        ref.release_predicted(a, self.now + 1.0)  # type: ignore[arg-type]
        other.release_predicted(b, self.now + 1.0)  # type: ignore[arg-type]

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))  # deadlines: now + 1 or 3
    def advance(self, dt: float) -> None:
        ref, other = self.both()
        self.now += dt
        assert ref.expire(self.now) == other.expire(self.now)

    @rule(data=st.data(), deadline=st.sampled_from([0.5, 2.0]))
    def refresh(self, data: st.DataObject, deadline: float) -> None:
        ref, other = self.both()
        chain = data.draw(st.sampled_from(self.chains[-2:]) | st.sampled_from(self.chains))
        ref.refresh_predicted(chain, self.now + deadline)
        other.refresh_predicted(chain, self.now + deadline)

    @rule(data=st.data(), touch=st.booleans())
    def find(self, data: st.DataObject, touch: bool) -> None:
        ref, other = self.both()
        chain = data.draw(st.sampled_from(self.chains))
        n = data.draw(st.integers(0, len(chain)))
        query = chain[:n]
        answer = ref.find_matches(query, touch)
        assert answer == other.find_matches(query, touch), query
        assert ref.last_confirmed == other.last_confirmed
        assert ref.find_matches_by_source(query) == other.find_matches_by_source(query)
        # one worker's depth: find_matches' answer for it, leaving last_confirmed alone
        seen = dict(ref.last_confirmed), dict(other.last_confirmed)
        for w in (0, 1, 2, 63, 64, 130):
            assert ref.match_depth(w, query) == other.match_depth(w, query) == answer.get(w, 0)
        assert (ref.last_confirmed, other.last_confirmed) == seen

    @invariant()
    def agree(self) -> None:
        if self.ref is None or self.other is None:
            return
        ref, other = self.ref, self.other
        other.check_invariants()
        ref.check_invariants()
        assert ref.size() == other.size()
        assert ref.num_entries == other.num_entries
        assert ref.num_predicted == other.num_predicted
        assert ref.num_evicted == other.num_evicted
        assert dict(ref.errors) == dict(other.errors)
        for w in (0, 1, 2, 63, 64, 130):
            assert ref.num_worker_blocks(w) == other.num_worker_blocks(w)
            assert ref.snapshot(w) == other.snapshot(w), w
            assert ref.predicted(w) == other.predicted(w)
        for chain in self.chains[-4:]:
            answer = ref.find_matches(chain, touch=False)
            assert answer == other.find_matches(chain, touch=False)
            for w in (0, 1, 2, 63, 64, 130):
                assert ref.match_depth(w, chain) == other.match_depth(w, chain) == answer.get(w, 0)
