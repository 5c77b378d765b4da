"""The compiled decode of event batches (kvroute_proto.wire_nb's scan, codec.
enable_compiled_decode): the same events as the protobuf runtime's decode for every valid
message, and the same answer -- events or the contract's error naming the field -- for
malformed or unusual bytes (which it hands to the protobuf decode)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import BLOCK, loads, u64

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.codec import (
    PackedHashes,
    batch_to_pb,
    decode_stream_message,
    decode_with_protobuf,
    encode_stream_message,
    stream_message_from_pb,
)
from kvroute_proto.errors import ContractError
from kvroute_proto.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    LoadReport,
    Partition,
    Snapshot,
)


@pytest.fixture(autouse=True)
def compiled() -> Iterator[None]:
    """The compiled scan on for each test here, and back as it was after."""
    before = codec._SCAN
    assert codec.enable_compiled_decode()
    yield
    codec._SCAN = before


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(1, 4))
    hashes = tuple(draw(st.lists(u64, min_size=n, max_size=n)))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * BLOCK, max_size=n * BLOCK))
    parent = draw(st.one_of(st.none(), u64))
    partition = draw(
        st.one_of(
            st.just(Partition()), st.builds(Partition, st.text(max_size=4), st.text(max_size=4))
        )
    )
    return BlockStored(hashes, parent, tokens, partition)


events = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(u64, min_size=1, max_size=5).map(tuple)),
    st.just(AllCleared()),
)
batches = st.builds(
    EventBatch,
    worker_id=st.text(min_size=1, max_size=8),
    epoch=st.integers(1, 2**64 - 1),
    seq=st.integers(1, 2**64 - 1),
    block_size=st.just(BLOCK),
    events=st.lists(events, max_size=6).map(tuple),
    load=loads,
)


def _same(data: bytes) -> object:
    """decode_stream_message (compiled) and decode_with_protobuf agree on ``data``: equal
    results or ContractErrors with equal messages. Returns the result (or the error)."""
    try:
        expect: object = decode_with_protobuf(data)
    except ContractError as exc:
        with pytest.raises(ContractError) as got:
            decode_stream_message(data)
        assert str(got.value) == str(exc)
        return exc
    assert decode_stream_message(data) == expect
    return expect


@given(batches)
@settings(max_examples=300, deadline=None)
def test_batches_decode_as_the_protobuf_runtime_decodes_them(batch: EventBatch) -> None:
    data = encode_stream_message(batch)
    decoded = decode_stream_message(data)
    assert decoded == batch == decode_with_protobuf(data)
    # the service's path: a message its gRPC stream parsed
    assert stream_message_from_pb(pb.KvStreamMessage.FromString(data)) == batch
    assert isinstance(decoded, EventBatch)
    for ev, sent in zip(decoded.events, batch.events, strict=True):
        if isinstance(ev, BlockStored | BlockRemoved):
            assert isinstance(sent, BlockStored | BlockRemoved)
            assert type(ev.block_hashes) is PackedHashes
            assert ev.block_hashes.array.dtype == np.uint64
            assert ev.block_hashes.array.tolist() == list(sent.block_hashes)
        if isinstance(ev, BlockStored):
            assert isinstance(ev.token_ids, bytes) and ev.token_ids == sent.token_ids


def test_many_events_and_a_snapshot() -> None:
    """More events than the scan's first layout holds; a snapshot (left to protobuf)."""
    evs = tuple(BlockRemoved((i, i + 1)) for i in range(300))
    batch = EventBatch("w", 2, 3, BLOCK, evs, LoadReport(1, 2, 3, 4, 5, 6))
    assert decode_stream_message(encode_stream_message(batch)) == batch
    snap = Snapshot("w", 1, 0, BLOCK, (BlockStored((1, 2), None, (0,) * 2 * BLOCK),))
    assert decode_stream_message(encode_stream_message(snap)) == snap


def _wire(msg: pb.EventBatch) -> bytes:
    return pb.KvStreamMessage(batch=msg).SerializeToString()


def _good() -> pb.EventBatch:
    ev = BlockStored((1, 2), 9, tuple(range(2 * BLOCK)), Partition("salt", "lora"))
    return batch_to_pb(EventBatch("w0", 3, 1, BLOCK, (ev, BlockRemoved((5,)))))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m, "worker_id", ""), "worker_id must not be empty"),
        (lambda m: setattr(m, "epoch", 0), "epoch must be >= 1"),
        (lambda m: setattr(m, "seq", 0), "seq must be >= 1"),
        (lambda m: setattr(m, "block_size", 0), "block_size must be >= 1"),
        (
            lambda m: setattr(m.events[0].stored, "block_hashes", b"123"),
            r"events\[0\]\.stored\.block_hashes must be a non-empty multiple of 8 bytes",
        ),
        (
            lambda m: setattr(m.events[1].removed, "block_hashes", b""),
            r"events\[1\]\.removed\.block_hashes must be a non-empty",
        ),
        (
            lambda m: setattr(m.events[0].stored, "token_ids", b"\0" * 12),
            r"events\[0\]\.stored\.token_ids must hold block_size=4",
        ),
        (lambda m: m.events.add(), r"events\[2\] has no event kind"),
    ],
)
def test_malformed_batches_give_the_contracts_error(mutate: object, message: str) -> None:
    msg = _good()
    mutate(msg)  # type: ignore[operator]
    data = _wire(msg)
    with pytest.raises(ContractError, match=message):
        decode_stream_message(data)
    _same(data)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _len(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


def _batch(*fields: bytes) -> bytes:
    """A KvStreamMessage whose batch holds these raw fields."""
    return _len(1, b"".join(fields))


HEAD = _len(1, b"w") + b"\x10\x01\x18\x01"  # worker w, epoch 1, seq 1
BS = b"\x20\x01"  # block size 1
REMOVED = _len(5, _len(2, _len(1, bytes(8))))  # an event: removed, one hash


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x0a",  # a batch field with no length
        b"\x0a\x05\x0a\x03w",  # a length past the end
        _batch(HEAD, BS, REMOVED),  # valid: the scan takes it
        _batch(_len(1, b"\xff\xfe"), b"\x10\x01\x18\x01", BS),  # worker_id not UTF-8
        _batch(HEAD, BS, b"\x10\xff\xff"),  # a truncated varint
        _batch(HEAD, BS, b"\x10" + b"\xff" * 10 + b"\x01"),  # a varint past 64 bits
        _batch(b"\x08\x01", HEAD, BS),  # field 1 (worker_id) with a varint wire type
        _batch(HEAD, BS, REMOVED) + _batch(REMOVED),  # the batch twice: protobuf merges them
        _batch(HEAD, BS, b"\x10\x02", REMOVED),  # epoch twice: protobuf keeps the last
        _batch(HEAD, BS, b"\x78\x01", REMOVED),  # an unknown field (15)
        _batch(HEAD, BS, _len(5, _len(3, b"\x08\x01"))),  # cleared, not empty
        _batch(HEAD, BS, _len(5, _len(2, _len(1, bytes(8))) + _len(3, b""))),  # two kinds
        _batch(HEAD, BS, _len(5, _len(2, _len(1, bytes(8)) + _len(1, bytes(16))))),  # twice
        _batch(HEAD, b"\x20" + _varint(2**32), REMOVED),  # block_size past uint32: 0
        _batch(HEAD, b"\x20" + _varint(2**32 + 1), REMOVED),  # ... its low bits 1
        _batch(HEAD, BS, _len(6, b"\x08" + _varint(2**32 + 1)), REMOVED),  # num_running
        _batch(HEAD, BS, _len(6, b"\x18" + _varint(2**40)), REMOVED),  # a uint64 load field
        _batch(HEAD, BS, _len(6, b"\x08\x01"), _len(6, b"\x10\x02"), REMOVED),  # load twice
        _batch(HEAD, BS, b"\x18\x00", REMOVED),  # seq written as 0
    ],
)
def test_unusual_bytes_answer_as_protobuf_answers(data: bytes) -> None:
    _same(data)


def test_invalid_utf8_in_a_partition_does_not_parse() -> None:
    msg = _good()
    msg.events[0].stored.partition.cache_salt = "s"
    data = _wire(msg).replace(b"\x0a\x01s", b"\x0a\x01\xff")
    with pytest.raises(ContractError, match="does not parse"):
        decode_stream_message(data)


@given(st.binary(max_size=64))
@settings(max_examples=500, deadline=None)
def test_random_bytes(data: bytes) -> None:
    _same(data)


@given(batches, st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_messages(batch: EventBatch, data: st.DataObject) -> None:
    wire = bytearray(encode_stream_message(batch))
    for _ in range(data.draw(st.integers(1, 3))):
        if not wire:
            break
        i = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["flip", "drop", "dup"]))
        if op == "flip":
            wire[i] = data.draw(st.integers(0, 255))
        elif op == "drop":
            del wire[i]
        else:
            wire[i:i] = wire[i : i + data.draw(st.integers(1, 8))]
    _same(bytes(wire))


def test_the_fast_constructors_build_what_the_classes_build() -> None:
    """codec builds decoded events by setting their slots; the classes' fields must still
    be the ones it sets, in this order."""
    names = {
        EventBatch: ["worker_id", "epoch", "seq", "block_size", "events", "load"],
        BlockStored: ["block_hashes", "parent_hash", "token_ids", "partition"],
        BlockRemoved: ["block_hashes"],
    }
    for cls, expect in names.items():
        assert [f.name for f in dataclasses.fields(cls)] == expect
    hashes = codec._packed(np.array([3, 4], dtype=np.uint64))
    stored = codec._block_stored(hashes, 7, b"\0" * 32, Partition("a", "b"))
    assert stored == BlockStored((3, 4), 7, (0,) * 8, Partition("a", "b"))
    batch = codec._event_batch("w", 1, 2, 4, (stored,), None)
    assert batch == EventBatch(
        "w", 1, 2, 4, (BlockStored((3, 4), 7, (0,) * 8, Partition("a", "b")),)
    )
    assert codec._block_removed(hashes) == BlockRemoved((3, 4))


def test_packed_hashes_read_as_the_tuple_of_their_ints() -> None:
    h = PackedHashes(np.array([1, 2**64 - 1, 0], dtype=np.uint64))
    t = (1, 2**64 - 1, 0)
    assert h == t and t == h and hash(h) == hash(t) and h != (1, 2)
    assert len(h) == 3 and list(h) == list(t) and h[1] == 2**64 - 1 and h[1:] == t[1:]
    assert h == PackedHashes(np.array(t, dtype=np.uint64)) and 0 in h
    assert BlockRemoved(h) == BlockRemoved(t) and hash(BlockRemoved(h)) == hash(BlockRemoved(t))
    assert np.asarray(h, dtype=np.uint64) is h.array
    back = pickle.loads(pickle.dumps(h))
    assert back == t and type(back) is PackedHashes
