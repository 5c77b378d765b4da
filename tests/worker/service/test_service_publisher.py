"""Unit tests of the sans-I/O event publisher: numbering and the replay buffer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute_proto.events import AllCleared, BlockRemoved, LoadReport
from worker.service.publisher import EventPublisher, PublisherConfig

EPOCH = 77


def make(buffer: int = 3) -> EventPublisher:
    return EventPublisher(PublisherConfig("w0", EPOCH, 4, replay_buffer_size=buffer))


def test_numbering_starts_at_one_and_skips_empty_batches() -> None:
    pub = make()
    assert pub.last_seq == 0
    assert pub.publish([]) is None
    b1 = pub.publish([AllCleared()])
    b2 = pub.publish([], LoadReport(num_running=2))
    assert (b1.seq, b2.seq) == (1, 2)
    assert b1.events == (AllCleared(),) and b1.load is None
    assert b2.events == () and b2.load == LoadReport(num_running=2)
    assert (b1.worker_id, b1.epoch, b1.block_size) == ("w0", EPOCH, 4)
    assert pub.last_seq == 2


def test_resume_replays_the_missing_suffix() -> None:
    pub = make(buffer=3)
    batches = [pub.publish([BlockRemoved((i,))]) for i in range(5)]  # seqs 1..5, buffer 3..5
    assert pub.oldest_buffered_seq == 3
    assert pub.resume(EPOCH, 5) == []
    assert pub.resume(EPOCH, 4) == [batches[4]]
    assert pub.resume(EPOCH, 2) == batches[2:]
    assert pub.resume(EPOCH, 1) is None  # seq 2 fell out of the buffer


@pytest.mark.parametrize(("epoch", "after_seq"), [(0, 0), (0, 5), (EPOCH + 1, 5), (EPOCH, 6)])
def test_resume_needs_a_snapshot(epoch: int, after_seq: int) -> None:
    pub = make()
    for i in range(5):
        pub.publish([BlockRemoved((i,))])
    assert pub.resume(epoch, after_seq) is None


def test_fresh_stream_resume() -> None:
    pub = make()
    assert pub.resume(EPOCH, 0) == []  # nothing happened yet: up to date
    assert pub.resume(0, 0) is None  # "no state" always means a snapshot


def test_zero_buffer_only_serves_up_to_date_subscribers() -> None:
    pub = make(buffer=0)
    pub.publish([AllCleared()])
    assert pub.resume(EPOCH, 1) == []
    assert pub.resume(EPOCH, 0) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"epoch": 0}, "epoch"),
        ({"epoch": 2**64}, "epoch"),
        ({"block_size": 0}, "block_size"),
        ({"replay_buffer_size": -1}, "replay_buffer_size"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    base = {"worker_id": "w", "epoch": 1, "block_size": 16}
    with pytest.raises(ValueError, match=field):
        PublisherConfig(**(base | kwargs))


@given(
    num_batches=st.integers(0, 30),
    buffer=st.integers(0, 10),
    after_seq=st.integers(0, 35),
)
def test_resume_is_exact_or_none(num_batches: int, buffer: int, after_seq: int) -> None:
    pub = make(buffer=buffer)
    published = [pub.publish([BlockRemoved((i,))]) for i in range(num_batches)]
    got = pub.resume(EPOCH, after_seq)
    if after_seq > num_batches:
        assert got is None
    elif got is not None:
        assert got == published[after_seq:]
    else:
        # Only a gap the buffer cannot fill forces a snapshot.
        assert num_batches - after_seq > buffer
