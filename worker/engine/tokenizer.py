"""Tokenizers: a byte-level one that always works, and a wrapper over HF ``tokenizers``.

Both answer the same small interface (``Tokenizer``): encode, decode, eos_token_id,
vocab_size. ``IncrementalDetokenizer`` turns a growing id list into text deltas for
streaming without ever emitting half a character.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the worker needs of a tokenizer."""

    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; a few specials follow. Ids it does not know (specials,
    or ids a larger model vocab produces) decode to nothing."""

    PAD = 256
    BOS = 257
    EOS = 258
    UNK = 259
    NUM_SPECIALS = 4

    def __init__(self, *, add_bos: bool = False) -> None:
        self.add_bos = add_bos
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.pad_token_id = self.PAD
        self.vocab_size = 256 + self.NUM_SPECIALS

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (tokenizer.json) behind the worker's interface."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_id: int | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_file(cls, path: str | Path, *, eos_token_id: int | None = None) -> HFTokenizer:
        """Load tokenizer.json (needs the optional ``tokenizers`` package)."""
        from tokenizers import Tokenizer as _HF  # optional dependency, imported on use

        return cls(_HF.from_file(str(path)), eos_token_id=eos_token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Streams text for a growing list of generated ids.

    Decoding token by token breaks multi-byte characters and, for BPE/SentencePiece
    tokenizers, spacing that depends on neighbours. So it decodes a small window: the ids
    since ``prefix`` (already emitted) and compares with the emitted part of the window.
    Trailing ids whose text ends in U+FFFD (an incomplete UTF-8 sequence) are held back
    until later ids complete them, at most ``max_pending`` ids (so invalid bytes cannot
    stall the stream); ``flush`` emits whatever is left.

        ids:   [ ... emitted ... | prefix .. read) | read .. end ]
                                  emitted context     pending
    """

    def __init__(self, tokenizer: Tokenizer, *, max_pending: int = 8) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.max_pending = max_pending

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Add ids; return the newly complete text (possibly empty)."""
        self._ids.extend(int(i) for i in new_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit the held-back tail (at end of stream), replacement characters included."""
        return self._emit(force=True)

    def _emit(self, *, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        # Try the whole window, then back off over a trailing incomplete character
        # (a few ids at most) so a large push still emits its complete part at once.
        lowest = max(self._read + 1, len(self._ids) - self.max_pending + 1)
        for end in range(len(self._ids), lowest - 1, -1):
            window = self._tok.decode(self._ids[self._prefix : end])
            if (
                not window.endswith("\ufffd")
                and len(window) > len(done)
                and window.startswith(done)
            ):
                self._prefix, self._read = self._read, end
                return window[len(done) :]
        if not force and len(self._ids) - self._read < self.max_pending:
            return ""  # incomplete, or nothing visible yet (e.g. a special token)
        window = self._tok.decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(done) :]
