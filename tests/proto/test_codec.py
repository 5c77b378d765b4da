"""Codec: dataclass <-> protobuf round trips and clear errors on malformed batches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.codec import (
    PackedHashes,
    batch_to_pb,
    decode_stream_message,
    encode_stream_message,
    snapshot_to_pb,
)
from kvroute_proto.errors import ContractError
from kvroute_proto.events import (
    DEFAULT_PARTITION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    LoadReport,
    Partition,
    Snapshot,
)

BLOCK = 4
u64 = st.integers(0, 2**64 - 1)
partitions = st.builds(Partition, st.text(max_size=4), st.text(max_size=4))


@st.composite
def stored(draw):
    n = draw(st.integers(1, 3))
    hashes = tuple(draw(st.lists(u64, min_size=n, max_size=n)))
    tokens = tuple(
        draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * BLOCK, max_size=n * BLOCK))
    )
    parent = draw(st.one_of(st.none(), u64))
    return BlockStored(hashes, parent, tokens, draw(partitions))


events = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(u64, min_size=1, max_size=4).map(tuple)),
    st.just(AllCleared()),
)
loads = st.one_of(st.none(), st.builds(LoadReport, *[st.integers(0, 2**31)] * 6))
batches = st.builds(
    EventBatch,
    worker_id=st.text(min_size=1, max_size=8),
    epoch=st.integers(1, 2**64 - 1),
    seq=st.integers(1, 2**64 - 1),
    block_size=st.just(BLOCK),
    events=st.lists(events, max_size=5).map(tuple),
    load=loads,
)
snapshots = st.builds(
    Snapshot,
    worker_id=st.text(min_size=1, max_size=8),
    epoch=st.integers(1, 2**64 - 1),
    seq=st.integers(0, 2**64 - 1),
    block_size=st.just(BLOCK),
    blocks=st.lists(stored(), max_size=4).map(tuple),
)


@given(st.one_of(batches, snapshots))
@settings(max_examples=300, deadline=None)
def test_round_trip(item):
    assert decode_stream_message(encode_stream_message(item)) == item


def test_parent_zero_is_not_no_parent():
    ev = BlockStored((1,), 0, (1, 2, 3, 4))
    batch = EventBatch("w", 1, 1, BLOCK, (ev,))
    assert decode_stream_message(encode_stream_message(batch)).events[0].parent_hash == 0


def _wire(msg: pb.EventBatch) -> bytes:
    return pb.KvStreamMessage(batch=msg).SerializeToString()


def _good_batch() -> pb.EventBatch:
    ev = BlockStored((1, 2), None, tuple(range(2 * BLOCK)))
    return batch_to_pb(EventBatch("w0", 3, 1, BLOCK, (ev,)))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m, "worker_id", ""), "worker_id must not be empty"),
        (lambda m: setattr(m, "epoch", 0), "epoch must be >= 1"),
        (lambda m: setattr(m, "seq", 0), "seq must be >= 1"),
        (lambda m: setattr(m, "block_size", 0), "block_size must be >= 1"),
        (lambda m: setattr(m.events[0].stored, "block_hashes", b"123"), "multiple of 8 bytes"),
        (lambda m: setattr(m.events[0].stored, "block_hashes", b""), "non-empty"),
        (
            lambda m: setattr(m.events[0].stored, "token_ids", b"\0" * 12),
            r"events\[0\]\.stored\.token_ids",
        ),
        (lambda m: m.events.add(), r"events\[1\] has no event kind"),
    ],
)
def test_malformed_batches_are_rejected_with_the_field_named(mutate, message):
    msg = _good_batch()
    mutate(msg)
    with pytest.raises(ContractError, match=message):
        decode_stream_message(_wire(msg))


def test_malformed_snapshot_block():
    msg = snapshot_to_pb(Snapshot("w", 1, 0, BLOCK, (BlockStored((1,), None, (1, 2, 3, 4)),)))
    msg.blocks[0].token_ids = b"\0" * 4
    with pytest.raises(ContractError, match=r"Snapshot\.blocks\[0\]\.token_ids"):
        decode_stream_message(pb.KvStreamMessage(snapshot=msg).SerializeToString())


def test_garbage_bytes_and_empty_message():
    with pytest.raises(ContractError, match="does not parse"):
        decode_stream_message(b"\xff\xff\xff")
    with pytest.raises(ContractError, match="neither batch nor snapshot"):
        decode_stream_message(b"")


def test_contract_error_is_a_value_error():
    assert issubclass(ContractError, ValueError)


def test_block_stored_packs_token_ids_as_little_endian_uint32():
    from_tuple = BlockStored((1,), None, (1, 2, 3, 2**32 - 1))
    assert from_tuple.token_ids == b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\xff\xff\xff\xff"
    assert from_tuple.token_array.tolist() == [1, 2, 3, 2**32 - 1]
    assert from_tuple == BlockStored((1,), None, from_tuple.token_ids)
    assert from_tuple.block_size == 4
    with pytest.raises(ValueError, match=r"token_ids\[0\]=-1"):
        BlockStored((1,), None, (-1, 0, 0, 0))


@given(batches)
@settings(max_examples=200, deadline=None)
def test_decoded_hashes_keep_the_wire_words_as_an_array(batch):
    """Decoded hashes (PackedHashes) read as the tuple of ints the events were built with
    and hold the wire's uint64 words as an array (what router.core.index_nb takes as it is)."""
    decoded = decode_stream_message(encode_stream_message(batch))
    for ev, sent in zip(decoded.events, batch.events, strict=True):
        if isinstance(ev, AllCleared):
            continue
        hashes = ev.block_hashes
        assert type(hashes) is PackedHashes
        assert hashes == sent.block_hashes and hash(hashes) == hash(sent.block_hashes)
        assert tuple(hashes) == sent.block_hashes and len(hashes) == len(sent.block_hashes)
        assert hashes.array.dtype == np.uint64
        assert hashes.array.tolist() == list(sent.block_hashes)


def test_default_partition_is_shared_and_others_decoded():
    ev = BlockStored((1,), None, (1, 2, 3, 4))
    salted = BlockStored((2,), None, (1, 2, 3, 4), Partition("tenant", ""))
    decoded = decode_stream_message(
        encode_stream_message(EventBatch("w", 1, 1, BLOCK, (ev, salted)))
    )
    assert decoded.events[0].partition is DEFAULT_PARTITION
    assert decoded.events[1].partition == Partition("tenant", "")
