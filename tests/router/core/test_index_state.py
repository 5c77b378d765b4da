"""Hypothesis state machine: PrefixIndex against a tiny reference model.

The model keeps, per worker, the set of confirmed block hashes and the set of predicted
(sparse: every STRIDE-th) ones, plus each predicted hash's deadline and how many holds it
has (a held hash outlives its deadline; releasing the last hold gives it a new one); a
worker's match is the longer of its leading confirmed blocks and STRIDE times its leading
probes that are confirmed or predicted.
Chains come from a two-token alphabet so prefixes overlap a lot.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored
from kvroute_proto.hashing import block_hash_list
from router.core.index import PrefixIndex
from router.core.index_api import IndexConfig

B = 2
STRIDE = 2
WORKERS = st.integers(0, 3)
TOKENS = st.lists(st.integers(0, 1), min_size=B, max_size=6 * B)


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hash_list(tokens, B, 0)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(IndexConfig(predict_stride=STRIDE))
        self.held: dict[int, set[int]] = {w: set() for w in range(4)}
        self.pred: dict[int, set[int]] = {w: set() for w in range(4)}
        self.until: dict[int, float] = {}
        self.holds: Counter[int] = Counter()  # hash -> holds not yet released
        self.handles: list[tuple[object, list[int]]] = []  # (index handle, hashes it holds)
        self.now = 0.0
        self.unknown_parent = 0
        self.unknown_block = 0

    def has(self, w: int) -> set[int]:
        return self.held[w]

    def forget_unpredicted(self) -> None:
        """A hash nobody predicts any more has no deadline."""
        predicted = set().union(*self.pred.values())
        self.until = {h: t for h, t in self.until.items() if h in predicted}

    @rule(w=WORKERS, tokens=TOKENS, data=st.data())
    def store(self, w: int, tokens: list[int], data: st.DataObject) -> None:
        chain = hashes_of(tokens)
        start = data.draw(st.integers(0, len(chain) - 1))
        end = data.draw(st.integers(start + 1, len(chain)))
        part = chain[start:end]
        parent = chain[start - 1] if start else None
        if parent is not None and parent not in self.has(w):
            self.unknown_parent += 1
        self.index.apply(w, BlockStored(tuple(part), parent, (0,) * (B * len(part))))
        self.held[w] |= set(part)

    @rule(w=WORKERS, data=st.data())
    def remove(self, w: int, data: st.DataObject) -> None:
        universe = sorted(set().union(*self.held.values(), *self.pred.values()) | {1, 2})
        victims = data.draw(st.lists(st.sampled_from(universe), min_size=1, max_size=4))
        for h in victims:
            if h in self.held[w]:
                self.held[w].discard(h)
            else:
                self.unknown_block += 1
        self.index.apply(w, BlockRemoved(tuple(victims)))

    @rule(w=WORKERS)
    def clear(self, w: int) -> None:
        self.index.apply(w, AllCleared())
        self.held[w].clear()
        self.pred[w].clear()
        self.forget_unpredicted()

    @rule(
        w=WORKERS,
        tokens=TOKENS,
        ttl=st.sampled_from([1.0, 2.0, 5.0]),
        hold=st.booleans(),
        data=st.data(),
    )
    def predict(
        self, w: int, tokens: list[int], ttl: float, hold: bool, data: st.DataObject
    ) -> None:
        chain = hashes_of(tokens)
        start = data.draw(st.integers(0, len(chain)))
        deadline = self.now + ttl
        handle = self.index.predict(w, chain, deadline, start, hold=hold)
        entered = []
        for pos in range(STRIDE - 1, len(chain), STRIDE):
            if pos < start:
                continue  # the caller says the worker has these already
            h = chain[pos]
            entered.append(h)
            self.pred[w].add(h)
            self.until[h] = max(self.until.get(h, deadline), deadline)  # never lowered
        assert list(handle) == entered
        if hold and entered:
            self.holds.update(entered)
            self.handles.append((handle, entered))

    @precondition(lambda self: self.handles)
    @rule(ttl=st.sampled_from([1.0, 2.0, 5.0]), data=st.data())
    def release(self, ttl: float, data: st.DataObject) -> None:
        handle, entered = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        deadline = self.now + ttl
        self.index.release_predicted(handle, deadline)
        predicted = set().union(*self.pred.values())
        for h in entered:
            self.holds[h] -= 1
            if not self.holds[h]:
                del self.holds[h]
                if h in predicted:
                    self.until[h] = max(self.until.get(h, deadline), deadline)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.index.expire(self.now)
        for h, t in list(self.until.items()):
            if t <= self.now and not self.holds[h]:
                del self.until[h]
                for w in range(4):
                    self.pred[w].discard(h)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        query = hashes_of(tokens)
        probes = query[STRIDE - 1 :: STRIDE]
        expected = {}
        confirmed, predicted = {}, {}  # each source alone (find_matches_by_source)
        for w in range(4):
            depth = 0
            while depth < len(query) and query[depth] in self.held[w]:
                depth += 1
            k = 0  # a probe counts if predicted, or inside the worker's confirmed prefix
            while k < len(probes) and (probes[k] in self.pred[w] or (k + 1) * STRIDE <= depth):
                k += 1
            if max(depth, k * STRIDE):
                expected[w] = max(depth, k * STRIDE)
            alone = 0
            while alone < len(probes) and probes[alone] in self.pred[w]:
                alone += 1
            if depth:
                confirmed[w] = depth
            if alone:
                predicted[w] = alone * STRIDE
        assert self.index.find_matches_by_source(query) == (confirmed, predicted)
        assert self.index.find_matches(query) == expected

    @precondition(lambda self: any(self.held.values()))
    @rule(w=WORKERS)
    def remove_worker(self, w: int) -> None:
        self.index.remove_worker(w)
        self.held[w].clear()
        self.pred[w].clear()
        self.forget_unpredicted()

    @invariant()
    def same_contents(self) -> None:
        for w in range(4):
            assert self.index.snapshot(w) == self.held[w]
            assert self.index.predicted(w) == self.pred[w]
        assert self.index.size() == len(set().union(*self.held.values()))
        assert self.index.num_entries == sum(len(self.held[w]) for w in range(4))
        assert self.index.num_predicted == sum(len(self.pred[w]) for w in range(4))
        assert self.index.errors["unknown_parent"] == self.unknown_parent
        assert self.index.errors["unknown_block"] == self.unknown_block
        self.index.check_invariants()


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
