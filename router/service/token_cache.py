"""Tokenize long prompts once: a chunk cache in front of the fleet's tokenizer.

Tokenizing is nearly all of what a text prompt costs the router (an 8k-token prompt: a few
milliseconds in HF ``tokenizers``, against ~0.2 ms to hash, match and score it), and the
prompts a cache-aware router sees repeat their long parts: system prompts, few-shot blocks,
documents, the earlier turns of a conversation. So the text is cut into chunks at fixed
places, each chunk is tokenized on its own and remembered, and a prompt that shares a prefix
with an earlier one pays only for its new chunks::

    text   |<- ~chunk_chars ->|<- ~chunk_chars ->|<- ~chunk_chars ->|<- rest ->|
    cuts                      ^ " word"          ^ " word"          ^ " word"
    ids    [specials] + ids(chunk 0) + ids(chunk 1) + ids(chunk 2) + ids(rest)
                        (cached)       (cached)       (new)          (new)

A cut is placed at the first single space at or after each multiple of ``chunk_chars``
that sits between a non-space character and an ASCII letter or digit. Byte-level BPE
tokenizers (GPT-2's ByteLevel pre-tokenizer; Llama-3/Qwen-style Split regex + ByteLevel)
always start a pre-token at such a space (" word" is one pre-token) and merge only inside
pre-tokens, so the concatenated ids equal the ids of the whole text: the result is exact,
not an approximation. That is checked when the cache is built -- the tokenizer's structure
(pre-tokenizer kind, no normaliser beyond NFC, no added token containing whitespace, the
special tokens a bare ``encode`` adds) and a self-test comparing chunked and whole encodings
of varied text with very small chunks -- and any tokenizer that fails either is used
unchanged (``CachedTokenizer.reason`` says why).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_CHUNK_CHARS = 512
MAX_HEAD_BATCH = 4  # encode_head: new chunks tokenized per question, at most
DEFAULT_MAX_CHUNKS = 16_384  # ~20 MB of chunks and ids at 512 characters each

_SELF_TEST_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159 -- isn't it? Yes: 42, 1999.",
    "Café naïve über résumé: e-mail me at a@b.c! Numbers 1234567 and 12,345.67 ok",
    "Line one.\nLine two,  two spaces.\n\n  indented\tTabbed text x1 y2 z3 end",
    "mixedCase CamelCase snake_case kebab-case UPPER lower 1st 2nd 3rd 4th ... done",
    "你好 世界 and emoji 🙂 ok, ünïcödé ŧęxt with ß and Ω, then plain words again here",
)


def _pre_tokenizer_kind(spec: Any) -> str | None:
    """'byte_level' or 'split_byte_level' for the structures the cut rule is exact for."""
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    if kind == "ByteLevel" and spec.get("use_regex", True):
        return "byte_level"
    if kind == "Sequence":
        parts = spec.get("pretokenizers") or []
        if (
            len(parts) == 2
            and parts[0].get("type") == "Split"
            and parts[0].get("behavior") == "Isolated"
            and parts[1].get("type") == "ByteLevel"
            and not parts[1].get("use_regex", True)
        ):
            return "split_byte_level"
    return None


# a space after a non-space (str.isspace's whitespace, as re's \S) before an ASCII letter
# or digit
_CUT = re.compile(r"(?<=\S) (?=[A-Za-z0-9])")


def piece_end(text: str, start: int, chunk_chars: int) -> int:
    """Where the piece of ``text`` that begins at ``start`` (0 or a cut) ends: the first
    single space at or after ``start + chunk_chars`` between a non-space and an ASCII letter
    or digit, else the end of the text."""
    pos = start + chunk_chars
    if pos >= len(text):
        return len(text)
    m = _CUT.search(text, pos)
    return len(text) if m is None else m.start()


def cut_points(text: str, chunk_chars: int) -> list[int]:
    """Positions (of a space) where ``text`` is cut (:func:`piece_end`, piece after piece)."""
    cuts: list[int] = []
    end = piece_end(text, 0, chunk_chars)
    while end < len(text):
        cuts.append(end)
        end = piece_end(text, end, chunk_chars)
    return cuts


def chunk_cache_problem(tokenizer: Any) -> str | None:
    """Why chunked encoding could differ from whole encoding for ``tokenizer`` (None: it
    cannot): its structure, then a self-test of chunked against whole encodings."""
    raw = getattr(tokenizer, "_tok", None)
    if raw is None or not hasattr(raw, "to_str"):
        return "not an HF tokenizers tokenizer"
    spec = json.loads(raw.to_str())
    pre = spec.get("pre_tokenizer")
    if _pre_tokenizer_kind(pre) is None:
        kind = pre.get("type") if isinstance(pre, dict) else pre
        return f"pre-tokenizer {kind!r} is not byte-level"
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"normalizer {normalizer.get('type')!r} may change text across a cut"
    for added in spec.get("added_tokens") or ():
        if any(c.isspace() for c in added.get("content", "")):
            return f"added token {added.get('content')!r} contains whitespace"
    try:
        _specials(tokenizer)
    except ValueError as exc:
        return str(exc)
    batch_fast = getattr(raw, "encode_batch_fast", None)
    for text in _SELF_TEST_TEXTS:
        plain = list(tokenizer.encode(text, add_special_tokens=False))
        for size in (16, 23, 40):
            pieces = _split(text, cut_points(text, size))
            chunked = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
            if batch_fast is not None:
                fast = [i for e in batch_fast(pieces, add_special_tokens=False) for i in e.ids]
                if fast != chunked:
                    return "encode_batch_fast differs from encode in the self-test"
            if chunked != plain:
                return f"chunked ids differ from the whole text's in the self-test ({text[:20]!r})"
    return None


def _specials(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``encode`` puts before and after a text's own (the same for every text)."""
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for text in _SELF_TEST_TEXTS:
        full = list(tokenizer.encode(text))
        plain = list(tokenizer.encode(text, add_special_tokens=False))
        n = len(plain)
        k = next((i for i in range(len(full) - n + 1) if full[i : i + n] == plain), None)
        if k is None:
            raise ValueError("encode() adds special tokens inside the text")
        found.add((tuple(full[:k]), tuple(full[k + n :])))
    if len(found) != 1:
        raise ValueError("encode() adds different special tokens to different texts")
    return found.pop()


def with_chunk_cache(
    tokenizer: Any, *, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int = DEFAULT_MAX_CHUNKS
) -> Any:
    """``tokenizer`` behind a chunk cache when chunking is exact for it, else itself."""
    problem = chunk_cache_problem(tokenizer)
    if problem is not None:
        log.info("tokenizer chunk cache off: %s", problem)
        return tokenizer
    log.info("tokenizer chunk cache on (%d-character chunks)", chunk_chars)
    return CachedTokenizer(tokenizer, chunk_chars=chunk_chars, max_chunks=max_chunks)


class CachedTokenizer:
    """The fleet's tokenizer with a chunk cache on ``encode`` (exact: build it with
    :func:`with_chunk_cache`, which checks the tokenizer first). Everything else is the
    wrapped tokenizer's."""

    def __init__(
        self,
        inner: Any,
        *,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        if chunk_chars < 16:
            raise ValueError(f"chunk_chars must be >= 16, got {chunk_chars}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self._inner = inner
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._chunks: dict[str, np.ndarray] = {}  # piece -> its ids (uint32)
        self._prefix, self._suffix = _specials(inner)
        self._prefix_ids = np.asarray(self._prefix, dtype=np.uint32)
        # tokenizers >= 0.21: batch encoding that skips offsets (the self-test checks it)
        self._batch_fast = getattr(getattr(inner, "_tok", None), "encode_batch_fast", None)
        self.num_hits = 0
        self.num_misses = 0
        self.num_whole = 0  # encode_head: texts tokenized whole / with a tail left as text
        self.num_split = 0
        self._sample_chars = 0
        self._sample_tokens = 0

    def __getattr__(self, name: str) -> Any:  # fingerprint, decode, eos ids, vocab size ...
        return getattr(self._inner, name)

    @property
    def num_cached_chunks(self) -> int:
        return len(self._chunks)

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``, equal to the wrapped tokenizer's."""
        inner = self._inner
        if len(text) < 2 * self.chunk_chars:
            return list(inner.encode(text, add_special_tokens=add_special_tokens))
        specials = inner.add_special_tokens if add_special_tokens is None else add_special_tokens
        chunks = self._chunks
        pieces = _split(text, cut_points(text, self.chunk_chars))
        found = [chunks.pop(piece, None) for piece in pieces]  # re-inserted: LRU order
        missing = [piece for piece, got in zip(pieces, found, strict=True) if got is None]
        self.num_misses += len(missing)
        self.num_hits += len(pieces) - len(missing)
        new = iter(self._encode_plain(missing))
        parts = [self._prefix_ids] if specials else []
        for piece, got in zip(pieces, found, strict=True):
            if got is None:
                got = next(new)
            chunks[piece] = got
            parts.append(got)
        while len(chunks) > self.max_chunks:
            del chunks[next(iter(chunks))]
        ids: list[int] = np.concatenate(parts).tolist()
        if specials:
            ids.extend(self._suffix)
        return ids

    @property
    def splits_prompts(self) -> bool:
        """Whether :meth:`encode_head` may leave a tail to the worker: only when ``encode``
        adds no special token after the text (the tail's ids are the text's last ones)."""
        return not self._suffix

    def encode_head(
        self,
        text: str,
        may_continue: Callable[[np.ndarray], bool],
        *,
        add_special_tokens: bool | None = None,
    ) -> tuple[np.ndarray, str]:
        """``(ids, tail)``: the ids of ``text``'s head (a uint32 array) and its untokenized
        tail, where ``[*ids, *encode(tail, add_special_tokens=False)] == encode(text)``.

        Chunks this cache holds are free and always taken. The first chunk it does not
        hold is tokenized without asking (after a cached run it is most often the one where
        a shared text ends and the new text begins, which routing needs); before each later
        batch of new chunks, ``may_continue(ids)`` is asked whether any cache could still
        match past the ids so far (the router's index: False means every cached prefix
        ends inside them, so the rest cannot change where the request goes); when it says
        no, the rest is left as text. New chunks are tokenized 1, 2, then 4 at a time (one
        batch call each) while it says yes: fewer questions on long matches, and at most 4
        chunks tokenized past where the caches end. ``tail`` is "" when the whole text was
        tokenized, always so for short texts and for tokenizers that add specials after
        the text.
        """
        inner = self._inner
        if len(text) < 2 * self.chunk_chars or not self.splits_prompts:
            whole = self.encode(text, add_special_tokens=add_special_tokens)
            return np.asarray(whole, dtype=np.uint32), ""
        specials = inner.add_special_tokens if add_special_tokens is None else add_special_tokens
        chunks = self._chunks
        # pieces are cut as they are reached (piece_end): a tail left as text is never cut up
        size, n = self.chunk_chars, len(text)
        parts = [self._prefix_ids] if specials else []
        start, batch = 0, 1
        ask = False  # the first new chunk is tokenized without asking
        while start < n:
            end = piece_end(text, start, size)
            piece = text[start:end]
            got = chunks.pop(piece, None)  # re-inserted: LRU order
            if got is not None:
                self.num_hits += 1
                chunks[piece] = got
                parts.append(got)
                start = end
                continue
            if ask and not may_continue(np.concatenate(parts)):
                break
            ask = True
            new = [piece]  # a batch of consecutive chunks the cache does not hold
            while end < n and len(new) < batch:
                after = piece_end(text, end, size)
                nxt = text[end:after]
                if nxt in chunks:
                    break
                new.append(nxt)
                end = after
            self.num_misses += len(new)
            for p, ids in zip(new, self._encode_plain(new), strict=True):
                chunks[p] = ids
                parts.append(ids)
            start = end
            batch = min(2 * batch, MAX_HEAD_BATCH)
        while len(chunks) > self.max_chunks:
            del chunks[next(iter(chunks))]
        tail = text[start:]
        if not tail:
            self.num_whole += 1
        else:
            self.num_split += 1
        return np.concatenate(parts), tail

    def estimate_tokens(self, text: str) -> int:
        """About how many tokens ``text`` (with no specials) holds: its length at the mean
        characters per token of the chunks this cache has tokenized (4 before any)."""
        chars, tokens = self._sample_chars, self._sample_tokens
        per_char = tokens / chars if chars and tokens else 0.25
        return math.ceil(len(text) * per_char)

    def _encode_plain(self, pieces: list[str]) -> list[np.ndarray]:
        """Ids of each piece without special tokens: one batch call, without offsets, on the
        library's threads (``encode_batch_fast``) when the tokenizer has it."""
        if not pieces:
            return []
        u32 = np.uint32
        if self._batch_fast is not None:
            batch = self._batch_fast(pieces, add_special_tokens=False)
            out = [np.array(e.ids, dtype=u32) for e in batch]
        else:
            enc = self._inner.encode
            out = [np.array(enc(p, add_special_tokens=False), dtype=u32) for p in pieces]
        if self._sample_chars < 1 << 24:  # the characters-per-token sample (estimate_tokens)
            self._sample_chars += sum(map(len, pieces))
            self._sample_tokens += sum(map(len, out))
        return out

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """As the wrapped tokenizer's ``encode_chat`` (its rule for special tokens), through
        the cache."""
        text = self._inner.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=self._inner.chat_adds_special_tokens)


def _split(text: str, cuts: list[int]) -> list[str]:
    pieces = []
    start = 0
    for c in cuts:
        pieces.append(text[start:c])
        start = c
    pieces.append(text[start:])
    return pieces
