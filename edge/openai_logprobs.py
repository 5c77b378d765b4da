"""OpenAI's ``logprobs`` objects from the worker's per-token logprobs, sans I/O.

Completions (the legacy shape)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
     "text_offset": [...]}

Chat::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
     "refusal": None}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvroute_proto import kvroute_pb2 as pb


class LogprobsCollector:
    """The logprobs of a request's tokens as they stream in; each streamed chunk takes those
    not sent yet (a chunk whose text is held back sends its logprobs with the next)."""

    def __init__(self, kind: str, top_k: int) -> None:
        self.kind = kind
        self.top_k = top_k
        self.entries: list[pb.TokenLogprob] = []
        self._sent = 0
        self._offset = 0  # completions' text_offset of the next entry sent

    def add(self, entries: Sequence[pb.TokenLogprob]) -> None:
        self.entries.extend(entries)

    def take(self) -> dict[str, Any]:
        """The logprobs object of the entries not taken yet."""
        new, self._sent = self.entries[self._sent :], len(self.entries)
        return self._json(new)

    def whole(self) -> dict[str, Any]:
        """The logprobs object of every entry (a non-streamed response)."""
        self._offset = 0
        return self._json(self.entries)

    def _json(self, entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_by_text(e.top) for e in entries] if self.top_k else None,
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_entry(e: pb.TokenLogprob) -> dict[str, Any]:
        return {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                for t in e.top
            ],
        }


def _by_text(top: Sequence[pb.TopLogprob]) -> dict[str, float]:
    """The legacy ``{token text: logprob}``; tokens of the same text (parts of one character)
    keep the most likely one's logprob."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t.token, t.logprob)
    return out
