"""Byte and HF tokenizers, and the streaming detokenizer."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

TEXTS = ["", "hello", "héllo wörld", "日本語のテキスト", "emoji 🤖🚀 mix", "a\nb\tc"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> HFTokenizer:
    """A small byte-level BPE trained here (no network), saved and loaded as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer.from_file(path, eos_token_id=tok.token_to_id("</s>"))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials():
    tok = ByteTokenizer(add_bos=True)
    assert tok.vocab_size == 260
    assert tok.eos_token_id == ByteTokenizer.EOS == 258
    assert tok.encode("a") == [ByteTokenizer.BOS, 97]
    # Specials and ids beyond the byte range (a bigger model vocab) decode to nothing.
    assert tok.decode([ByteTokenizer.BOS, 104, 105, ByteTokenizer.EOS, 300]) == "hi"


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trips(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids) == text
    assert all(0 <= i < hf_tokenizer.vocab_size for i in ids)


def test_hf_tokenizer_metadata(hf_tokenizer):
    assert hf_tokenizer.eos_token_id == hf_tokenizer.token_to_id("</s>")
    assert hf_tokenizer.vocab_size <= 400
    assert hf_tokenizer.decode([hf_tokenizer.eos_token_id]) == ""


def stream(tok, ids: list[int], cuts: list[int]) -> list[str]:
    """Deltas from pushing ``ids`` in pieces split at ``cuts``, then flushing."""
    detok = IncrementalDetokenizer(tok)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    deltas = [detok.push(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*deltas, detok.flush()]


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_byte_stream_never_splits_a_character(text, cuts):
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text), cuts)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab é日🤖x\n"), max_size=30),
    cuts=st.lists(st.integers(0, 100), max_size=8),
)
def test_hf_stream_never_splits_a_character(hf_tokenizer, text, cuts):
    deltas = stream(hf_tokenizer, hf_tokenizer.encode(text), cuts)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stream_holds_partial_character_until_complete():
    detok = IncrementalDetokenizer(ByteTokenizer())
    euro = list("€".encode())  # 3 bytes
    assert detok.push([104]) == "h"
    assert detok.push(euro[:1]) == ""
    assert detok.push(euro[1:2]) == ""
    assert detok.push(euro[2:]) == "€"
    assert detok.flush() == ""


def test_stream_gives_up_holding_after_max_pending():
    """Invalid bytes cannot stall the stream forever: after max_pending ids they go out."""
    detok = IncrementalDetokenizer(ByteTokenizer(), max_pending=3)
    assert detok.push([0xE2]) == ""
    assert detok.push([0xFF]) == ""
    assert detok.push([0xE2]) == "\ufffd\ufffd\ufffd"
    assert detok.push([0xE2]) == ""
    assert detok.flush() == "\ufffd"
