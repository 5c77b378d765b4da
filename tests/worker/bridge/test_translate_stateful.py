"""The translator against a small reference model, under random engine histories.

A fake engine (vLLM's contract: one BlockStored per cached copy of a block, one
BlockRemoved per evicted copy, AllBlocksCleared on a reset, seq from 0 per process) stores
chains of blocks from a tiny vocabulary (so prefixes are shared and copies duplicated),
evicts copies in any order, clears, restarts, and loses live batches that its replay
buffer returns later, after more live batches (which may be lost too). The reference
holds, per partition, the multiset of engine blocks (token prefixes) cached; our block j
of a prefix is held while the engine block holding its last token is. After every step
the blocks the translator announced (applied to a plain set, strictly) equal the
reference's, and its own view agrees.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvroute_proto.events import Partition
from kvroute_proto.hashing import block_hash_list
from tests.worker.bridge.recorded import Announced
from worker.bridge.engine_wire import (
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)
from worker.bridge.translate import EventTranslator, ReplayFrom, TranslatorConfig

B = 8
SALTS = ["", "tenant-a"]
Prefix = tuple[str, tuple[int, ...]]  # (salt, tokens up to the end of an engine block)


def engine_hash(prefix: Prefix) -> int:
    """The fake engine's name for a block: opaque to the translator, like vLLM's."""
    return hash(("engine", prefix)) & (2**64 - 1)


class TranslatorMachine(RuleBasedStateMachine):
    @initialize(engine_block_size=st.sampled_from([1, 4, 8, 16]))
    def setup(self, engine_block_size: int) -> None:
        self.ebs = engine_block_size
        self.tr = EventTranslator(TranslatorConfig("w", block_size=B), random.Random(7))
        self.seen = Announced()
        self.copies: Counter[Prefix] = Counter()  # the reference: cached copies per block
        self.seq = 0  # the engine's next seq in this process
        self.log: list[EngineBatch] = []  # this process's batches (its replay buffer)
        self.num_to_lose = 0  # the next live batches the subscriber misses
        self.undelivered = False  # a lost batch no later live batch has revealed yet
        self.replay: tuple[int, int] | None = None  # a replay asked for: (from, buffer end)

    # ---- the engine publishes --------------------------------------------------------------

    def publish(self, *events: EngineEvent) -> None:
        batch = EngineBatch(self.seq, 0.0, events)
        self.seq += 1
        self.log.append(batch)
        if self.num_to_lose:
            self.num_to_lose -= 1
            self.undelivered = True
            return
        self.ask(self.tr.feed(batch))
        self.undelivered = False
        self.seen.apply(self.tr.take_batches())

    def ask(self, ask: ReplayFrom | None) -> None:
        """The subscriber asks the replay endpoint, which answers with what its buffer
        holds now; the answer arrives later (answer_replay), after more live batches."""
        if ask is not None:
            self.replay = (ask.seq, len(self.log))

    @precondition(lambda self: getattr(self, "replay", None) is not None)
    @rule()
    def answer_replay(self) -> None:
        start, stop = self.replay
        self.replay = None
        for old in self.log[start:stop]:
            self.tr.feed_replay(old)
        self.ask(self.tr.end_replay())
        self.seen.apply(self.tr.take_batches())

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        data=st.data(),
        salt=st.sampled_from(SALTS),
        num_blocks=st.integers(1, 3),
    )
    def store(self, data: st.DataObject, salt: str, num_blocks: int) -> None:
        """Store a run of engine blocks, extending a held block of the partition or from
        the root; blocks already cached are stored again as another copy."""
        held = sorted(p for p, n in self.copies.items() if n and p[0] == salt)
        parent: tuple[int, ...] = ()
        if held and data.draw(st.booleans()):
            parent = data.draw(st.sampled_from(held))[1]
        tokens = data.draw(
            st.lists(
                st.integers(1, 2), min_size=num_blocks * self.ebs, max_size=num_blocks * self.ebs
            )
        )
        prefixes = [(salt, parent + tuple(tokens[: (i + 1) * self.ebs])) for i in range(num_blocks)]
        extra = None
        if salt and not parent:
            extra = (("tenant-a",),) + (None,) * (num_blocks - 1)
        ev = EngineBlockStored(
            tuple(engine_hash(p) for p in prefixes),
            engine_hash((salt, parent)) if parent else None,
            tuple(tokens),
            self.ebs,
            medium="GPU",
            extra_keys=extra,
            group_idx=0,
        )
        self.copies.update(prefixes)
        self.publish(ev)

    @precondition(lambda self: any(self.copies.values()))
    @rule(data=st.data(), num=st.integers(1, 3))
    def evict(self, data: st.DataObject, num: int) -> None:
        """Evict some cached copies, in any order (vLLM evicts by LRU, not leaves first)."""
        held = sorted(p for p, n in self.copies.items() if n)
        victims = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=num))
        gone = []
        for p in victims:
            if self.copies[p]:
                self.copies[p] -= 1
                gone.append(engine_hash(p))
        self.publish(*(EngineBlockRemoved((h,), "GPU", 0) for h in gone))

    @rule()
    def clear(self) -> None:
        self.copies.clear()
        self.publish(EngineAllCleared())

    @rule()
    def restart(self) -> None:
        """The engine process is replaced: its cache and seq start over, silently (the
        translator learns of it from the new process's first batch)."""
        self.copies.clear()
        self.seq = 0
        self.log = []
        self.num_to_lose = 0
        self.undelivered = True
        self.replay = None  # a dead process answers nothing

    @precondition(lambda self: self.seq >= 1)  # a process's first batch always arrives
    @rule(num=st.integers(1, 3))
    def lose_live_batches(self, num: int) -> None:
        self.num_to_lose = num

    # ---- the invariant ---------------------------------------------------------------------

    @invariant()
    def announced_equals_reference(self) -> None:
        if not hasattr(self, "tr") or self.undelivered or self.replay is not None:
            return
        expected: set[int] = set()
        for (salt, tokens), n in self.copies.items():
            if not n:
                continue
            ours = block_hash_list(tokens, B, Partition(cache_salt=salt).seed)
            end = len(tokens)
            expected.update(ours[(end - self.ebs) // B : end // B])
        assert self.seen.blocks == set(self.tr.held_blocks()) == expected
        stats = self.tr.stats()
        assert stats.num_batches_lost == 0 and stats.dropped_unknown_parent == 0


TranslatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_translator_against_reference = TranslatorMachine.TestCase
