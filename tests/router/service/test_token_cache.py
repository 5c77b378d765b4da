"""The tokenizer chunk cache: exact (same ids as the whole text), bounded, and used only
for tokenizers whose structure and self-test allow it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bpe import BOS, CHAT_TEMPLATE, EOS, english_like_text, train_bpe
from edge.tokenizer import ByteTokenizer, HFTokenizer, TokenizerSettings
from router.service.token_cache import (
    CachedTokenizer,
    chunk_cache_problem,
    cut_points,
    with_chunk_cache,
)

_BPE = train_bpe(512, seed=0)


def hf(add_bos: bool | None = True, chat: bool = True) -> HFTokenizer:
    return HFTokenizer(
        _BPE,
        settings=TokenizerSettings(
            bos_token=BOS,
            eos_token=EOS,
            add_bos_token=add_bos,
            chat_template=CHAT_TEMPLATE if chat else None,
        ),
    )


WORDS = st.sampled_from(
    ["the", "cache", "Router", "x1", "42", "3.14", "café", "über", "e-mail", "it's", "🙂", "ß"]
)
SEPARATORS = st.sampled_from([" ", " ", " ", "  ", "\n", ", ", ". ", "\t", " - ", "!\n\n"])
TEXTS = st.lists(st.tuples(WORDS, SEPARATORS), min_size=1, max_size=120).map(
    lambda parts: "".join(w + s for w, s in parts)
)


@settings(max_examples=150, deadline=None)
@given(TEXTS, st.sampled_from([16, 24, 40, 64]), st.sampled_from([None, True, False]))
def test_chunked_ids_equal_the_whole_texts(text, chunk_chars, specials):
    inner = hf()
    cached = CachedTokenizer(inner, chunk_chars=chunk_chars)
    expected = inner.encode(text, add_special_tokens=specials)
    assert cached.encode(text, add_special_tokens=specials) == expected
    assert cached.encode(text, add_special_tokens=specials) == expected  # from the cache


@settings(max_examples=150, deadline=None)
@given(
    TEXTS,
    st.sampled_from([16, 24, 40]),
    st.sampled_from([None, True, False]),
    st.lists(st.booleans(), max_size=12),
    st.booleans(),
)
def test_head_and_tail_make_the_whole_texts_ids(text, chunk_chars, specials, answers, warm):
    """Wherever encode_head stops, the head's ids and the tail's own ids (no specials, as
    the worker encodes prompt_text_suffix) are the whole text's ids."""
    inner = hf()
    cached = CachedTokenizer(inner, chunk_chars=chunk_chars)
    if warm:  # some chunks cached: taken for free, without asking
        cached.encode(text[: len(text) // 2])
    asked: list[list[int]] = []
    replies = iter(answers)

    def may_continue(head: list[int]) -> bool:
        asked.append(head.tolist())
        return next(replies, False)

    ids, tail = cached.encode_head(text, may_continue, add_special_tokens=specials)
    assert [*ids.tolist(), *inner.encode(tail, add_special_tokens=False)] == inner.encode(
        text, add_special_tokens=specials
    )
    if tail:  # it stopped only where it was told to, after tokenizing at least one chunk
        assert asked and asked[-1] == ids.tolist()
        assert answers[len(asked) - 1 :][:1] in ([], [False])
        assert tail != text and cached.num_misses >= 1
    # each question saw a prefix of the final ids, longer each time
    for before, after in itertools.pairwise(asked):
        assert len(before) < len(after)
    for head in asked:
        assert ids[: len(head)].tolist() == head


def test_encode_head_leaves_unmatchable_text_to_the_worker():
    inner = hf()
    cached = CachedTokenizer(inner, chunk_chars=64)
    system = english_like_text(400, seed=5)
    cached.encode(system)  # the system text's chunks are cached
    text = system + " " + english_like_text(900, seed=6)
    cut = len(cached.encode(system, add_special_tokens=True))
    hits, misses = cached.num_hits, cached.num_misses
    ids, tail = cached.encode_head(text, lambda head: len(head) < cut)
    assert tail and len(tail) > 500  # most of the new text was not tokenized
    # the system text's pieces (cut as encode cuts them) came from the cache: all but the
    # one where the system text ends; one new chunk was tokenized
    system_pieces = len(cut_points(system, 64)) + 1
    assert cached.num_hits - hits == system_pieces - 1
    assert cached.num_misses - misses == 1
    assert [*ids.tolist(), *inner.encode(tail, add_special_tokens=False)] == inner.encode(text)
    assert cached.num_split == 1
    # told that caches go on, it tokenizes everything, a growing batch at a time
    ids, tail = cached.encode_head(text, lambda head: True)
    assert (ids.tolist(), tail) == (inner.encode(text), "")
    assert cached.num_whole == 1


def test_no_split_for_tokenizers_that_add_specials_after_the_text():
    class WithEos:  # encode() appends an eos: a tail's ids would not end the prompt
        add_special_tokens = True

        def __init__(self, inner):
            self._inner = inner

        def encode(self, text, add_special_tokens=None):
            ids = self._inner.encode(text, add_special_tokens=False)
            specials = self.add_special_tokens if add_special_tokens is None else add_special_tokens
            return [*ids, 2] if specials else ids

    cached = CachedTokenizer(WithEos(hf()), chunk_chars=16)
    assert not cached.splits_prompts
    text = english_like_text(200, seed=2)
    ids, tail = cached.encode_head(text, lambda head: False)
    assert tail == "" and ids.tolist() == cached.encode(text) and ids[-1] == 2


def test_estimate_tokens_follows_what_was_tokenized():
    inner = hf()
    cached = CachedTokenizer(inner, chunk_chars=64)
    assert cached.estimate_tokens("x" * 400) == 100  # 4 characters a token before any sample
    text = english_like_text(2000, seed=9)
    cached.encode(text)
    true = len(inner.encode(english_like_text(2000, seed=10), add_special_tokens=False))
    assert abs(cached.estimate_tokens(english_like_text(2000, seed=10)) - true) < 0.15 * true


def test_a_shared_prefix_is_tokenized_once():
    inner = hf()
    cached = CachedTokenizer(inner, chunk_chars=128)
    system = english_like_text(600, seed=3)
    first = cached.encode(system + " First question about refunds?")
    misses = cached.num_misses
    second = cached.encode(system + " Second question about shipping?")
    assert first == inner.encode(system + " First question about refunds?")
    assert second == inner.encode(system + " Second question about shipping?")
    assert cached.num_hits >= misses - 1  # every chunk of the system text came from the cache
    assert cached.num_misses - misses <= 2


def test_the_cache_is_bounded():
    cached = CachedTokenizer(hf(), chunk_chars=16, max_chunks=8)
    for seed in range(5):
        cached.encode(english_like_text(200, seed=seed))
        assert cached.num_cached_chunks <= 8


def test_chat_goes_through_the_cache_with_the_wrapped_rule_for_specials():
    messages = [
        {"role": "system", "content": english_like_text(300, seed=1)},
        {"role": "user", "content": "How do I reset my password?"},
    ]
    for inner in (hf(chat=True), hf(chat=False)):
        cached = CachedTokenizer(inner, chunk_chars=32)
        assert cached.encode_chat(messages) == inner.encode_chat(messages)


def test_everything_else_is_the_wrapped_tokenizers():
    inner = hf()
    cached = CachedTokenizer(inner)
    assert cached.fingerprint == inner.fingerprint
    assert cached.eos_token_ids == inner.eos_token_ids
    assert cached.decode(inner.encode("hello world")) == inner.decode(inner.encode("hello world"))


def _reference_cuts(text: str, chunk_chars: int) -> list[int]:
    """The cut rule spelled out character by character."""
    cuts, pos = [], chunk_chars
    while True:
        found = next(
            (
                i
                for i in range(pos, len(text) - 1)
                if text[i] == " "
                and not text[i - 1].isspace()
                and text[i + 1].isascii()
                and text[i + 1].isalnum()
            ),
            None,
        )
        if found is None:
            return cuts
        cuts.append(found)
        pos = found + chunk_chars


SPACEY = st.text(alphabet=st.sampled_from(list("ab Z9_é\t\n\x1c\u3000\xa0 .,")), max_size=300)


@settings(max_examples=300, deadline=None)
@given(st.one_of(TEXTS, SPACEY), st.sampled_from([16, 17, 40]))
def test_cut_points_follow_the_rule(text, chunk_chars):
    assert cut_points(text, chunk_chars) == _reference_cuts(text, chunk_chars)


def test_cut_points_sit_before_a_word_and_at_least_a_chunk_apart():
    text = english_like_text(2000, seed=5)
    cuts = cut_points(text, 100)
    assert cuts
    for a, b in zip([0, *cuts], cuts, strict=False):
        assert b - a >= 100 or a == 0
    for c in cuts:
        assert text[c] == " " and not text[c - 1].isspace()
        assert text[c + 1].isascii() and text[c + 1].isalnum()
    assert cut_points("short", 100) == []
    assert cut_points("a" * 500, 100) == []  # no space: one piece


def test_only_eligible_tokenizers_are_wrapped():
    assert isinstance(with_chunk_cache(hf()), CachedTokenizer)
    byte = ByteTokenizer()
    assert with_chunk_cache(byte) is byte
    assert chunk_cache_problem(byte) == "not an HF tokenizers tokenizer"
    from tokenizers import Tokenizer, models, pre_tokenizers

    ws = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    ws.pre_tokenizer = pre_tokenizers.Metaspace()
    other = HFTokenizer(ws)
    assert with_chunk_cache(other) is other
    assert "not byte-level" in (chunk_cache_problem(other) or "")


@pytest.mark.parametrize(("field", "value"), [("chunk_chars", 8), ("max_chunks", 0)])
def test_bad_sizes_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        CachedTokenizer(hf(), **{field: value})
