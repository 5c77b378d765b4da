"""Trace parsing, validation and hash id expansion."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleetsim.replay.trace import (
    TokenExpander,
    TraceFormatError,
    TraceRecord,
    iter_records,
    parse_record,
    read_trace,
    write_trace,
)


def line(ts=0, inp=10, out=2, ids=(1, 2, 3), **extra) -> str:
    obj = {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids)}
    obj.update(extra)
    return json.dumps(obj)


def test_parse_valid_line():
    r = parse_record(line(ts=1250, inp=9, out=3, ids=(7, 8, 9)), 1, block_size=4)
    assert r == TraceRecord(1250.0, 9, 3, (7, 8, 9), 1)
    assert r.arrival_s == 1.25


def test_same_id_same_tokens_and_cut_to_input_length():
    ex = TokenExpander(block_size=4, vocab_size=1000, seed=3)
    a = ex.expand([5, 6, 7], 10)
    b = ex.expand([9, 6], 8)
    assert a.dtype == np.int64 and len(a) == 10 and len(b) == 8
    # id 6 sits at block 1 in both: same 4 tokens
    assert a[4:8].tolist() == b[4:8].tolist() == ex.block(6).tolist()
    # the last block is cut: a's third block is id 7's first two tokens
    assert a[8:].tolist() == ex.block(7)[:2].tolist()
    assert a[:4].tolist() != b[:4].tolist()  # different ids, different tokens
    assert ((a >= 0) & (a < 1000)).all()


def test_expansion_is_independent_of_order_and_cache():
    fresh = TokenExpander(block_size=8, seed=1, max_cached_blocks=1)
    warm = TokenExpander(block_size=8, seed=1)
    warm.expand([1, 2, 3, 4], 32)
    assert fresh.expand([4, 3], 16).tolist() == warm.expand([4, 3], 16).tolist()
    assert warm.num_hits >= 2
    other_seed = TokenExpander(block_size=8, seed=2)
    assert other_seed.block(4).tolist() != warm.block(4).tolist()


def test_expand_rejects_length_beyond_ids():
    ex = TokenExpander(block_size=4)
    with pytest.raises(ValueError, match="input_length 9"):
        ex.expand([1, 2], 9)


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("not json", None, "not valid JSON"),
        ("[1, 2]", None, "JSON object"),
        (line(ts="soon"), "timestamp", "number"),
        (line(ts=-1), "timestamp", ">= 0"),
        (line(inp=0), "input_length", ">= 1"),
        (line(inp=2.5), "input_length", "integer"),
        (line(out=True), "output_length", "integer"),
        (line().replace("[1, 2, 3]", '"1,2"'), "hash_ids", "list"),
        (line(ids=(1, -2, 3)), "hash_ids", "[1]=-2"),
        (line(inp=13, ids=(1, 2, 3)), "hash_ids", "needs 4 ids, got 3"),
        (
            json.dumps({"timestamp": 0, "input_length": 4, "hash_ids": [1]}),
            "output_length",
            "missing",
        ),
    ],
)
def test_malformed_lines_name_line_and_field(tmp_path, text, field, fragment):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n\n" + text + "\n" + line() + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, block_size=4)
    err = info.value
    assert err.line_no == 3  # blank line 2 still counts
    assert err.field == field
    assert "line 3" in str(err) and fragment in str(err)
    if field:
        assert repr(field) in str(err)


def test_read_sorts_limits_and_round_trips(tmp_path):
    records = [
        TraceRecord(20.0, 5, 1, (1, 2)),
        TraceRecord(10.0, 4, 2, (3,)),
        TraceRecord(30.5, 8, 3, (1, 2)),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, records) == 3
    back = read_trace(path, block_size=4)
    assert [r.timestamp_ms for r in back] == [10.0, 20.0, 30.5]
    assert [(r.input_length, r.output_length, r.hash_ids) for r in back] == [
        (4, 2, (3,)),
        (5, 1, (1, 2)),
        (8, 3, (1, 2)),
    ]
    assert len(read_trace(path, block_size=4, limit=2)) == 2
    assert '"timestamp": 20,' in path.read_text()  # integer ms stay integers


def test_empty_trace_and_bad_block_size(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        read_trace(path)
    with pytest.raises(ValueError, match="block_size"):
        list(iter_records([line()], block_size=0))


def test_real_mooncake_lines_parse():
    from pathlib import Path

    path = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
    records = read_trace(path)
    assert len(records) == 20
    assert (records[0].input_length, len(records[0].hash_ids)) == (40160, 79)
    assert records[2].arrival_s == 0.040
