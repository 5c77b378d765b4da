"""StreamSequencer unit tests: exact apply lists and resubscribe requests."""

from __future__ import annotations

import pytest

from kvroute_proto.events import BlockRemoved, BlockStored, EventBatch, Snapshot
from router.core.sync import StreamSequencer, SyncConfig

W = "w0"


def batch(seq: int, epoch: int = 7, *events) -> EventBatch:
    return EventBatch(W, epoch, seq, 4, tuple(events))


def snap(seq: int, epoch: int = 7) -> Snapshot:
    return Snapshot(W, epoch, seq, 4, ())


def seqs(step) -> list[tuple[str, int, int]]:
    return [(type(m).__name__, m.epoch, m.seq) for m in step.apply]


def synced(seq: int = 0, epoch: int = 7, **config) -> StreamSequencer:
    s = StreamSequencer(W, SyncConfig(**config))
    s.receive(snap(seq, epoch))
    return s


def test_first_subscription_asks_for_a_snapshot() -> None:
    s = StreamSequencer(W)
    assert s.expected_subscription() == (0, 0)
    step = s.receive(snap(5))
    assert seqs(step) == [("Snapshot", 7, 5)] and step.resubscribe is None
    assert s.expected_subscription() == (7, 5)


def test_in_order_batches_apply_and_duplicates_drop() -> None:
    s = synced(5)
    assert seqs(s.receive(batch(6))) == [("EventBatch", 7, 6)]
    assert seqs(s.receive(batch(6))) == []
    assert seqs(s.receive(batch(3))) == []
    assert seqs(s.receive(batch(7))) == [("EventBatch", 7, 7)]
    assert s.counters["duplicate"] == 2 and s.counters["applied"] == 2


def test_gap_is_buffered_and_resubscribed_once() -> None:
    s = synced(5)
    step = s.receive(batch(8))
    assert seqs(step) == [] and step.resubscribe == (7, 5)
    step = s.receive(batch(9))
    assert seqs(step) == [] and step.resubscribe is None  # same gap: not asked again
    step = s.receive(batch(6))  # the replay starts
    assert seqs(step) == [("EventBatch", 7, 6)] and step.resubscribe is None
    step = s.receive(batch(7))
    assert seqs(step) == [("EventBatch", 7, 7), ("EventBatch", 7, 8), ("EventBatch", 7, 9)]
    assert s.awaiting is None and not s.pending


def test_live_removal_during_resync_is_not_overtaken_by_replayed_store() -> None:
    """The Mooncake bug: a replayed store applied after a live removal resurrects a block."""
    store = BlockStored((11,), None, (0, 0, 0, 0))
    remove = BlockRemoved((11,))
    s = synced(5)
    assert s.receive(batch(7, 7, remove)).resubscribe == (7, 5)  # live removal arrives early
    step = s.receive(batch(6, 7, store))  # replayed store
    assert [m.events for m in step.apply] == [(store,), (remove,)]


def test_resubscribe_is_asked_again_when_the_answer_seems_lost() -> None:
    s = synced(5, resubscribe_after=3)
    assert s.receive(batch(7)).resubscribe == (7, 5)
    assert [s.receive(batch(k)).resubscribe for k in (8, 9, 10, 11)] == [None, None, None, (7, 5)]


def test_expected_subscription_counts_as_the_request() -> None:
    s = synced(5)
    assert s.expected_subscription() == (7, 5)
    assert s.receive(batch(7)).resubscribe is None  # the reconnect is already asking


def test_new_epoch_purges_and_applies_seq_one_at_once() -> None:
    s = synced(5)
    step = s.receive(batch(1, epoch=9))
    assert seqs(step) == [("Snapshot", 9, 0), ("EventBatch", 9, 1)]
    assert step.apply[0].blocks == ()  # an empty snapshot: purge
    assert step.resubscribe is None
    assert s.expected_subscription() == (9, 1)


def test_new_epoch_mid_stream_purges_and_asks_from_zero() -> None:
    s = synced(5)
    step = s.receive(batch(4, epoch=9))
    assert seqs(step) == [("Snapshot", 9, 0)] and step.resubscribe == (9, 0)
    step = s.receive(snap(6, epoch=9))  # the worker's buffer no longer has seq 1
    assert seqs(step) == [("Snapshot", 9, 6)]  # batch 4 is older than the snapshot: dropped
    assert not s.pending


def test_a_late_message_of_the_old_epoch_costs_a_resync_not_a_deadlock() -> None:
    s = StreamSequencer(W)
    s.receive(snap(0, epoch=9))  # the restarted worker's snapshot arrives first ...
    step = s.receive(snap(3, epoch=7))  # ... then one of the dead process's
    assert seqs(step) == [("Snapshot", 7, 3)]  # followed: epochs are not ordered
    step = s.receive(batch(1, epoch=9))  # the live stream brings the router back
    assert seqs(step) == [("Snapshot", 9, 0), ("EventBatch", 9, 1)]
    assert s.counters["new_epoch"] == 3


def test_stale_snapshot_same_epoch_is_dropped() -> None:
    s = synced(5)
    s.receive(batch(6))
    assert seqs(s.receive(snap(6))) == []
    assert seqs(s.receive(snap(4))) == []
    assert seqs(s.receive(snap(8))) == [("Snapshot", 7, 8)]


def test_snapshot_drains_buffered_batches_after_it() -> None:
    s = synced(5)
    for k in (7, 8, 10, 11):
        s.receive(batch(k))
    step = s.receive(snap(9))
    assert seqs(step) == [("Snapshot", 7, 9), ("EventBatch", 7, 10), ("EventBatch", 7, 11)]
    assert step.resubscribe is None and not s.pending


def test_snapshot_with_a_gap_before_buffered_batches_asks_again() -> None:
    s = synced(5)
    s.receive(batch(12))
    step = s.receive(snap(9))
    assert seqs(step) == [("Snapshot", 7, 9)] and step.resubscribe == (7, 9)


def test_pending_overflow_clears_the_buffer_and_forces_a_resubscribe() -> None:
    s = synced(5, max_pending_batches=2)
    assert s.receive(batch(7)).resubscribe == (7, 5)
    assert s.receive(batch(8)).resubscribe is None
    step = s.receive(batch(9))
    assert step.resubscribe == (7, 5) and not s.pending
    assert s.counters["pending_overflow"] == 1


def test_reset_forgets_everything() -> None:
    s = synced(5)
    s.receive(batch(8))
    s.reset()
    assert s.expected_subscription() == (0, 0) and not s.pending


def test_bad_config_and_message() -> None:
    with pytest.raises(ValueError, match="max_pending_batches"):
        SyncConfig(max_pending_batches=0)
    with pytest.raises(ValueError, match="resubscribe_after"):
        SyncConfig(resubscribe_after=0)
    with pytest.raises(TypeError):
        StreamSequencer(W).receive("nope")  # type: ignore[arg-type]


def test_new_epoch_flag_marks_restarts_not_the_first_sync() -> None:
    s = StreamSequencer(W)
    assert s.receive(snap(3)).new_epoch is False
    assert s.receive(batch(4)).new_epoch is False
    assert s.receive(batch(2, epoch=8)).new_epoch is True
    assert s.receive(snap(5, epoch=9)).new_epoch is True
