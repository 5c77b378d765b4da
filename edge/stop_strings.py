"""Stop strings matched on generated text as it streams in, sans I/O.

A stop string may span tokens and chunks ("\\n\\n" is often two tokens, and a merged BPE
token may hold a one-character stop in its middle), so it is matched on the decoded text,
not on token ids. Text that could still be the start of a stop string is held back until
the next chunk says whether it is; everything else is released at once::

    pushed:   "Hello\\n"      stops: ["\\n\\n"]
    released: "Hello"         held: "\\n"      (may become "\\n\\n")
    pushed:   "\\nBye"
    released: ""              stopped: the text ends before "\\n\\n"

Pure: imports neither asyncio, grpc nor a clock (docs/decisions/0032).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Releases generated text up to (never including) the first stop string to complete."""

    __slots__ = ("_held", "_longest", "_stops", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False  # a stop string was found: push releases nothing more

    def push(self, text: str) -> str:
        """The part of ``text`` (after what was held) that is certainly output."""
        if self.stopped:
            return ""
        buf = self._held + text
        # the stop completed first wins (as when text arrives a character at a time); of two
        # completed at the same place, the longer
        found = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            self.stopped = True
            self._held = ""
            return buf[: min(found)[1]]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the output: what was held back is output after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that some stop string starts with."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[len(buf) - k :]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
