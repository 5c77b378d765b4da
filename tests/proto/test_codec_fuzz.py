"""Random bytes at the KV event decoder: a ContractError naming what is wrong, or a decoded
batch/snapshot -- never another exception (issue 12's bad-input suite)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.codec import decode_stream_message, encode_stream_message
from kvroute_proto.errors import ContractError
from kvroute_proto.events import BlockRemoved, BlockStored, EventBatch

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode(data: bytes) -> None:
    try:
        item = decode_stream_message(data)
    except ContractError as exc:
        assert str(exc)  # says what was wrong
        return
    # what decodes re-encodes to a message that decodes to the same thing
    assert decode_stream_message(encode_stream_message(item)) == item


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode(data)


def _valid_wire() -> bytes:
    batch = EventBatch(
        "w0",
        7,
        3,
        4,
        (BlockStored((11, 12), None, tuple(range(8))), BlockRemoved((11,))),
    )
    return encode_stream_message(batch)


@FUZZ
@given(st.data())
def test_mutated_valid_messages(data: st.DataObject) -> None:
    """Flip, drop and insert bytes of a valid message: closer to the decoder's edge cases
    than pure noise."""
    wire = bytearray(_valid_wire())
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        i = data.draw(st.integers(0, max(len(wire) - 1, 0)))
        if op == "flip" and wire:
            wire[i] ^= data.draw(st.integers(1, 255))
        elif op == "drop" and wire:
            del wire[i]
        else:
            wire.insert(i, data.draw(st.integers(0, 255)))
    _decode(bytes(wire))


@FUZZ
@given(
    worker_id=st.text(max_size=20),
    epoch=st.integers(0, 2**64 - 1),
    seq=st.integers(0, 2**64 - 1),
    block_size=st.integers(0, 2**32 - 1),
    hashes=st.binary(max_size=40),
    token_ids=st.binary(max_size=40),
    parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_structured_but_wrong_fields(worker_id, epoch, seq, block_size, hashes, token_ids, parent):
    stored = pb.BlockStored(block_hashes=hashes, token_ids=token_ids)
    if parent is not None:
        stored.has_parent, stored.parent_hash = True, parent
    msg = pb.KvStreamMessage(
        batch=pb.EventBatch(
            worker_id=worker_id,
            epoch=epoch,
            seq=seq,
            block_size=block_size,
            events=[pb.KvEvent(stored=stored)],
        )
    )
    _decode(msg.SerializeToString())
