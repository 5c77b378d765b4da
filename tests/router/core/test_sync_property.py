"""The sync invariant, property-tested: once the stream is quiet, the router's view of each
worker equals that worker's true block set -- under loss, duplication, reordering, a replay
buffer too small (snapshots), pending-buffer overflow and restarts (new epochs).

The worker is a small reference model written here (no dependency on the worker package):
a set of blocks that emits numbered batches into one stream, keeps a bounded replay buffer,
and answers subscribe(epoch, after_seq) with the missing batches or a snapshot. The stream
is a list the test delivers from, or drops, duplicates and swaps messages of; a router
Resubscribe appends the subscription's answer to it (messages of the old stream that were
already in flight still arrive first, as they would).
"""

from __future__ import annotations

import random
from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from kvroute_proto.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    LoadReport,
    Snapshot,
)
from kvroute_proto.hashing import block_hash_list
from router.core.router_core import Resubscribe, RouterConfig, RouterCore

B = 2
TOKENS = st.lists(st.integers(0, 2), min_size=B, max_size=5 * B)


class RefWorker:
    """A worker's cache as a set of blocks, and its event stream's numbering and replay."""

    def __init__(self, worker_id: str, epoch: int, buffer_size: int) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.seq = 0
        self.parents: dict[int, int | None] = {}
        self.buffer: deque[EventBatch] = deque(maxlen=buffer_size)

    @property
    def blocks(self) -> set[int]:
        return set(self.parents)

    def emit(self, *events, load: LoadReport | None = None) -> EventBatch:
        self.seq += 1
        batch = EventBatch(self.worker_id, self.epoch, self.seq, B, tuple(events), load)
        self.buffer.append(batch)
        return batch

    def store(self, tokens: list[int]) -> EventBatch | None:
        chain = block_hash_list(tokens, B)
        k = next((i for i, h in enumerate(chain) if h not in self.parents), len(chain))
        if k == len(chain):
            return None
        new = chain[k:]
        for i, h in enumerate(new):
            self.parents[h] = chain[k + i - 1] if k + i else None
        return self.emit(BlockStored(tuple(new), chain[k - 1] if k else None, (0,) * B * len(new)))

    def remove(self, victims: list[int]) -> EventBatch | None:
        gone = [h for h in dict.fromkeys(victims) if h in self.parents]
        if not gone:
            return None
        for h in gone:
            del self.parents[h]
        return self.emit(BlockRemoved(tuple(gone)))

    def clear(self) -> EventBatch:
        self.parents.clear()
        return self.emit(AllCleared())

    def heartbeat(self) -> EventBatch:
        return self.emit(load=LoadReport(num_running=len(self.parents)))

    def restart(self, epoch: int) -> None:
        self.epoch, self.seq = epoch, 0
        self.parents.clear()
        self.buffer.clear()

    def subscribe(self, epoch: int, after_seq: int) -> list[EventBatch | Snapshot]:
        if epoch == self.epoch and after_seq <= self.seq:
            if after_seq == self.seq:
                return []
            if self.buffer and self.buffer[0].seq <= after_seq + 1:
                return [b for b in self.buffer if b.seq > after_seq]
        blocks = tuple(BlockStored((h,), p, (0,) * B) for h, p in self.parents.items())
        return [Snapshot(self.worker_id, self.epoch, self.seq, B, blocks)]


class SyncMachine(RuleBasedStateMachine):
    @initialize(buffer_size=st.integers(1, 6), max_pending=st.integers(1, 6))
    def setup(self, buffer_size: int, max_pending: int) -> None:
        self.epochs = random.Random(0)
        self.worker = RefWorker("w0", self.new_epoch(), buffer_size)
        config = RouterConfig(block_size=B, max_pending_batches=max_pending)
        self.core = RouterCore(config, clock=lambda: 0.0, rng=random.Random(1))
        self.core.add_worker("w0", block_size=B)
        self.stream: list[EventBatch | Snapshot] = []
        self.reconnect()

    def new_epoch(self) -> int:
        return self.epochs.randrange(1, 2**63)

    def reconnect(self) -> None:
        self.stream.extend(self.worker.subscribe(*self.core.expected_subscription("w0")))

    def send(self, batch: EventBatch | None) -> None:
        if batch is not None:
            self.stream.append(batch)

    def receive(self, msg: EventBatch | Snapshot) -> None:
        for action in self.core.on_stream_message("w0", msg):
            assert isinstance(action, Resubscribe)
            self.stream.extend(self.worker.subscribe(action.epoch, action.after_seq))

    # ---- the worker changes ----

    @rule(tokens=TOKENS)
    def store(self, tokens: list[int]) -> None:
        self.send(self.worker.store(tokens))

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.worker.parents:
            pool = sorted(self.worker.parents)
            self.send(self.worker.remove(data.draw(st.lists(st.sampled_from(pool), max_size=3))))

    @rule()
    def clear(self) -> None:
        self.send(self.worker.clear())

    @rule()
    def heartbeat(self) -> None:
        self.send(self.worker.heartbeat())

    @rule()
    def restart(self) -> None:
        self.worker.restart(self.new_epoch())
        self.reconnect()  # the old stream broke; the shell subscribes again

    @rule()
    def stream_broke(self) -> None:
        self.stream.clear()
        self.reconnect()

    # ---- the network ----

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        if self.stream:
            self.receive(self.stream.pop(0))

    @rule()
    def lose(self) -> None:
        if self.stream:
            self.stream.pop(0)

    @rule()
    def duplicate(self) -> None:
        if self.stream:
            self.receive(self.stream[0])

    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        if len(self.stream) >= 2:
            i = data.draw(st.integers(1, len(self.stream) - 1))
            self.stream[0], self.stream[i] = self.stream[i], self.stream[0]

    # ---- quiet: everything delivered, heartbeats until nothing is missing ----

    @rule()
    def quiesce_and_check(self) -> None:
        for _ in range(100):
            while self.stream:
                self.receive(self.stream.pop(0))
            if self.core.stream_position("w0") == (self.worker.epoch, self.worker.seq):
                break
            self.send(self.worker.heartbeat())  # the worker's periodic load report
        else:
            raise AssertionError("the stream did not converge in 100 heartbeats")
        assert self.core.worker_blocks("w0") == self.worker.blocks


SyncMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestSyncMachine = SyncMachine.TestCase
