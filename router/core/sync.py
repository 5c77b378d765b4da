"""Per-worker KV event stream sequencing: duplicates, gaps, restarts, snapshots.

Sans-I/O: imports neither asyncio, grpc nor a clock. Messages in, (things to apply, a
resubscribe request) out; the router core applies and the shell resubscribes.

Contract (docs/ARCHITECTURE.md): a worker process has a random ``epoch`` and numbers its
batches 1, 2, 3, ... A subscriber asks for "everything after seq S of epoch E" and gets the
missing batches, or a snapshot at the worker's last seq, then the live stream.

State per worker: ``(epoch, last_seq)`` of the last applied batch or snapshot, a buffer of
batches that arrived ahead of a gap, and the subscription already asked for::

    batch (E, s)   E == epoch, s <= last_seq      -> duplicate, dropped
                   E == epoch, s == last_seq + 1  -> applied, then buffered s+1, s+2, ...
                   E == epoch, s  > last_seq + 1  -> buffered; Resubscribe(E, last_seq)
                   E other                        -> purge (empty snapshot at (E, 0)), then
                                                     as above: s == 1 applies at once
    snapshot (E, s) E == epoch, s <= last_seq     -> stale, dropped
                    otherwise                     -> replaces the worker's state; the
                                                     buffered batches > s are applied after it

Everything is applied in seq order, so a live removal that arrives while a resync is under
way waits in the buffer and can never be overtaken by a replayed store (the Mooncake bug).

Epochs are random, not ordered, so the sequencer cannot tell a late message of a dead
process from a restart: it always follows the epoch of the latest message. A stale message
costs one purge and one resubscribe, which the worker answers with its current epoch; a
"remember retired epochs and drop them" rule would instead deadlock when the stale message
arrives first (the new epoch would be the one retired).

Resubscribe is asked once per gap position; if the replay itself is lost, it is asked again
after ``resubscribe_after`` further out-of-order batches (the worker's periodic load reports
guarantee those keep coming). A full buffer is dropped and a resubscribe forced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvroute_proto.events import EventBatch, Snapshot

__all__ = ["StreamSequencer", "SyncConfig", "SyncStep"]


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """``max_pending_batches``: out-of-order batches kept while waiting for a gap to fill.

    ``resubscribe_after``: out-of-order batches after which an unanswered resubscribe is
    asked again.
    """

    max_pending_batches: int = 1024
    resubscribe_after: int = 32

    def __post_init__(self) -> None:
        if self.max_pending_batches < 1:
            raise ValueError(f"max_pending_batches must be >= 1, got {self.max_pending_batches}")
        if self.resubscribe_after < 1:
            raise ValueError(f"resubscribe_after must be >= 1, got {self.resubscribe_after}")


@dataclass(frozen=True, slots=True)
class SyncStep:
    """What one message led to.

    ``apply``: in order; an EventBatch's events are applied to the worker's entries, a
    Snapshot replaces them (an empty one purges). ``resubscribe``: (epoch, after_seq) to
    subscribe with, or None. ``reason``: why (for logs). ``new_epoch``: this message
    moved to another epoch than the one synced (a restart: predictions about the worker
    are stale too); False for the first sync.
    """

    apply: tuple[EventBatch | Snapshot, ...] = ()
    resubscribe: tuple[int, int] | None = None
    reason: str = ""
    new_epoch: bool = False  # the worker restarted: everything known about it is stale


_NOTHING = SyncStep()


@dataclass(slots=True)
class StreamSequencer:
    """Sequencing state of one worker's event stream (mutable; owned by the router core)."""

    worker_id: str
    config: SyncConfig = field(default_factory=SyncConfig)
    epoch: int = 0  # 0: nothing synced yet
    last_seq: int = 0
    pending: dict[int, EventBatch] = field(default_factory=dict)
    awaiting: tuple[int, int] | None = None  # subscription asked for and not yet answered
    num_out_of_order: int = 0  # out-of-order batches since the last resubscribe
    counters: Counter[str] = field(default_factory=Counter)

    def expected_subscription(self) -> tuple[int, int]:
        """(epoch, after_seq) to subscribe with now; (0, 0) asks for a snapshot.

        The shell calls it whenever it (re)opens the stream; it counts as the resubscribe.
        """
        self.awaiting = (self.epoch, self.last_seq)
        self.num_out_of_order = 0
        return self.awaiting

    def reset(self) -> None:
        """Forget everything (the worker was removed and may come back)."""
        self.epoch = self.last_seq = 0
        self.pending.clear()
        self.awaiting = None
        self.num_out_of_order = 0

    def receive(self, msg: EventBatch | Snapshot) -> SyncStep:
        """Sequence one stream message."""
        match msg:
            case EventBatch():
                return self._receive_batch(msg)
            case Snapshot():
                return self._receive_snapshot(msg)
        raise TypeError(f"not an EventBatch or Snapshot: {msg!r}")

    # ---- internals -----------------------------------------------------------------------

    def _switch_epoch(self, new_epoch: int) -> None:
        self.epoch = new_epoch
        self.last_seq = 0
        self.pending.clear()
        self.awaiting = None
        self.num_out_of_order = 0

    def _receive_batch(self, batch: EventBatch) -> SyncStep:
        apply: list[EventBatch | Snapshot] = []
        new_epoch = batch.epoch != self.epoch
        if new_epoch:
            new_epoch = self.epoch != 0  # a restart, not the first sync
            self.counters["new_epoch"] += 1
            self._switch_epoch(batch.epoch)
            apply.append(Snapshot(self.worker_id, batch.epoch, 0, batch.block_size))
        seq = batch.seq
        if seq <= self.last_seq:
            self.counters["duplicate"] += 1
            return SyncStep(tuple(apply), new_epoch=new_epoch)
        if seq == self.last_seq + 1:
            apply.append(batch)
            self.last_seq = seq
            self.counters["applied"] += 1
            self._drain(apply)
            if self.awaiting is not None and not self.pending:
                self.awaiting = None  # the gap is filled
            return SyncStep(tuple(apply), new_epoch=new_epoch)
        # A gap: keep the batch until the missing ones arrive.
        self.counters["out_of_order"] += 1
        if seq not in self.pending and len(self.pending) >= self.config.max_pending_batches:
            self.counters["pending_overflow"] += 1
            self.pending.clear()
            return self._ask(apply, "pending buffer overflow", new_epoch, force=True)
        self.pending[seq] = batch
        return self._ask(apply, f"gap after seq {self.last_seq} (got {seq})", new_epoch)

    def _receive_snapshot(self, snap: Snapshot) -> SyncStep:
        if snap.epoch == self.epoch and snap.seq <= self.last_seq:
            self.counters["stale_snapshot"] += 1
            return _NOTHING
        new_epoch = snap.epoch != self.epoch
        if new_epoch:
            new_epoch = self.epoch != 0  # a restart, not the first sync
            self.counters["new_epoch"] += 1
            self._switch_epoch(snap.epoch)
        self.counters["snapshot"] += 1
        self.last_seq = snap.seq
        apply: list[EventBatch | Snapshot] = [snap]
        for seq in [s for s in self.pending if s <= snap.seq]:
            del self.pending[seq]
        self._drain(apply)
        self.awaiting = None
        self.num_out_of_order = 0
        if self.pending:  # still a gap between the snapshot and the buffered live batches
            return self._ask(apply, f"gap after snapshot seq {snap.seq}", new_epoch)
        return SyncStep(tuple(apply), new_epoch=new_epoch)

    def _drain(self, apply: list[EventBatch | Snapshot]) -> None:
        pending = self.pending
        while pending:
            nxt = pending.pop(self.last_seq + 1, None)
            if nxt is None:
                break
            apply.append(nxt)
            self.last_seq += 1
            self.counters["applied"] += 1
        if pending and min(pending) <= self.last_seq:  # cannot happen; keep the buffer clean
            for seq in [s for s in pending if s <= self.last_seq]:
                del pending[seq]

    def _ask(
        self,
        apply: list[EventBatch | Snapshot],
        reason: str,
        new_epoch: bool = False,
        force: bool = False,
    ) -> SyncStep:
        want = (self.epoch, self.last_seq)
        self.num_out_of_order += 1
        awaiting = self.awaiting
        # An answer under way (same epoch, at or before where we are) is not asked again
        # until resubscribe_after more out-of-order batches suggest it was lost.
        progressing = awaiting is not None and awaiting[0] == want[0] and awaiting[1] <= want[1]
        if force or not progressing or self.num_out_of_order > self.config.resubscribe_after:
            self.awaiting = want
            self.num_out_of_order = 0
            self.counters["resubscribe"] += 1
            return SyncStep(tuple(apply), want, reason, new_epoch)
        return SyncStep(tuple(apply), new_epoch=new_epoch)
