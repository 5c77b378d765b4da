"""The replay progress display: a rich progress bar on a terminal, silent otherwise."""

from __future__ import annotations

import io
import re

from fleetsim.replay.progress import Progress

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal (as stderr in an interactive shell)."""

    def isatty(self) -> bool:
        return True


def test_silent_when_the_stream_is_not_a_terminal():
    stream = io.StringIO()  # a pipe, a log file, pytest's capture
    progress = Progress("cache_aware", 10, stream)
    for done in range(11):
        progress.update(done, done * 1.5, force=True)
    progress.close()
    assert stream.getvalue() == ""


def test_a_terminal_gets_a_bar_with_counts_and_times():
    stream = _Terminal()
    progress = Progress("cache_aware", 200, stream)
    progress.update(50, 12.5, force=True)
    mid = _ANSI.sub("", stream.getvalue())
    assert "cache_aware" in mid and "50/200" in mid and "sim 12.5 s" in mid
    progress.update(200, 40.0, force=True)
    progress.close()
    final = _ANSI.sub("", stream.getvalue()).splitlines()[-1]
    assert "cache_aware" in final and "200/200" in final and "sim 40.0 s" in final
    assert "\u2501" in final  # rich's bar


def test_none_stream_and_zero_total_are_fine():
    progress = Progress("x", 0, None)
    progress.update(0, 0.0, force=True)
    progress.close()
    stream = _Terminal()
    progress = Progress("empty", 0, stream)
    progress.update(0, 0.0, force=True)
    progress.close()
    assert "empty" in _ANSI.sub("", stream.getvalue())
