"""EventBatchRun (decision 0056): a run's bytes cut into its batches' stream messages, the
same batches whatever layout protobuf allows, clear errors for what does not parse."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import batches, snapshots

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.codec import (
    decode_stream_lazy,
    decode_stream_message,
    encode_stream_message,
    run_to_pb,
    stream_message_to_pb,
    stream_parts,
)
from kvroute_proto.errors import ContractError
from kvroute_proto.events import BlockRemoved, EventBatch

ONE = EventBatch("w-1", 7, 3, 4, (BlockRemoved((1, 2)),), None)


@given(st.lists(batches, min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_a_run_is_cut_into_its_batches_messages_in_order(items):
    messages = [stream_message_to_pb(b) for b in items]
    parts = stream_parts(run_to_pb(messages).SerializeToString())
    assert parts == [m.SerializeToString() for m in messages]
    assert [decode_stream_lazy(p) for p in parts] == items


@given(st.one_of(batches, snapshots))
@settings(max_examples=100, deadline=None)
def test_any_other_message_is_its_own_only_part(item):
    data = encode_stream_message(item)
    assert stream_parts(data) == [data]


@given(st.lists(batches, min_size=1, max_size=6), st.integers(0, 5))
@settings(max_examples=100, deadline=None)
def test_a_run_in_another_layout_gives_the_same_batches(items, split):
    # Protobuf merges a message field that occurs twice: two runs back to back are one run
    # of both lists. The cut declines that layout and protobuf splits it.
    messages = [stream_message_to_pb(b) for b in items]
    split = min(split, len(messages))
    data = (
        run_to_pb(messages[:split]).SerializeToString()
        + run_to_pb(messages[split:]).SerializeToString()
    )
    assert [decode_stream_message(p) for p in stream_parts(data)] == items


def test_an_empty_run_has_no_parts():
    assert stream_parts(pb.KvStreamMessage(run=pb.EventBatchRun()).SerializeToString()) == []


def test_a_run_that_does_not_parse_is_a_contract_error():
    good = run_to_pb([stream_message_to_pb(ONE)]).SerializeToString()
    with pytest.raises(ContractError, match="does not parse"):
        stream_parts(good[:-1])  # truncated: the run's length runs past the end
    with pytest.raises(ContractError, match="does not parse"):
        stream_parts(b"\x1a\xff")


def test_a_run_not_split_is_refused_by_the_decoder():
    data = run_to_pb([stream_message_to_pb(ONE)]).SerializeToString()
    with pytest.raises(ContractError, match="EventBatchRun: split it"):
        decode_stream_message(data)
