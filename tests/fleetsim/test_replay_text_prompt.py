"""Text prompts from trace hash ids: exact lengths, shared prefixes, byte-tokenizer ids."""

from __future__ import annotations

import pytest

from fleetsim.replay.text_prompt import FIRST_CHAR, LAST_CHAR, TextExpander
from fleetsim.replay.trace import TraceRecord
from worker.engine.tokenizer import ByteTokenizer


def record(hash_ids, input_length):
    return TraceRecord(0.0, input_length, 1, tuple(hash_ids))


@pytest.mark.parametrize("input_length", [1, 15, 16, 17, 47, 48])
def test_text_has_exactly_one_byte_token_per_requested_token(input_length):
    expander = TextExpander(block_size=16, seed=3)
    text = expander.expand([5, 9, 2], input_length)
    assert len(text) == input_length
    ids = ByteTokenizer().encode(text)
    assert len(ids) == input_length
    assert all(FIRST_CHAR <= i <= LAST_CHAR for i in ids)  # printable ASCII, no whitespace


def test_requests_sharing_hash_ids_share_exactly_that_prefix():
    expander = TextExpander(block_size=16, seed=0)
    a = expander.expand_record(record([1, 2, 3, 4], 64))
    b = expander.expand_record(record([1, 2, 7], 40))
    c = expander.expand_record(record([8, 2, 3], 48))
    assert a[:32] == b[:32]
    # they diverge where the ids do: the third block differs (here from its first char on)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 32 <= common < 48
    assert a[:32] != c[:32] and a[16:48] == c[16:48]  # same blocks, not a shared prefix
    tok = ByteTokenizer()
    assert tok.encode(a)[:32] == tok.encode(b)[:32]


def test_same_id_same_text_whatever_the_order_or_instance():
    first = TextExpander(16, seed=1, max_cached_blocks=1)
    second = TextExpander(16, seed=1)
    forward = [first.block(h) for h in (4, 5, 6, 4)]
    assert forward[0] == forward[3] == second.block(4)  # recomputed after the LRU dropped it
    assert [second.block(h) for h in (6, 5)] == [forward[2], forward[1]]
    assert TextExpander(16, seed=2).block(4) != forward[0]  # the seed changes every block
    assert len({first.block(h) for h in range(200)}) == 200


def test_a_whole_mooncake_block_is_512_characters():
    text = TextExpander(512, seed=0).expand([10, 11], 700)
    assert len(text) == 700 and len(text.encode("utf-8")) == 700


@pytest.mark.parametrize(
    ("hash_ids", "input_length", "message"),
    [([1, 2], 0, "input_length 0 must be in"), ([1], 17, "input_length 17 must be in")],
)
def test_bad_lengths_name_the_limit(hash_ids, input_length, message):
    with pytest.raises(ValueError, match=message):
        TextExpander(16).expand(hash_ids, input_length)


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        TextExpander(0)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        TextExpander(16, seed=-1)
