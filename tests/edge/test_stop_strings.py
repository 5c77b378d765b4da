"""The stop matcher against a reference that sees the whole text at once: random stop strings
over a small alphabet (so stops overlap, repeat and straddle chunks) and random chunkings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.stop_strings import StopMatcher

ALPHABET = "ab\n"
stops_st = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4)
chunks_st = st.lists(st.text(ALPHABET, max_size=6), max_size=12)


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The output and whether it stopped, one character at a time: the text before the
    first stop string to be complete."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def longest_partial(text: str, stops: list[str]) -> int:
    suffixes = (text[len(text) - k :] for k in range(1, len(text) + 1))
    return max((len(t) for t in suffixes for s in stops if s.startswith(t) and s != t), default=0)


@given(stops_st, chunks_st)
def test_streamed_output_is_the_text_before_the_first_stop(stops, chunks) -> None:
    m = StopMatcher(stops)
    out = ""
    seen = ""
    for chunk in chunks:
        out += m.push(chunk)
        seen += chunk
        expected, stopped = reference(seen, stops)
        assert m.stopped == stopped
        if stopped:
            assert out == expected  # stopped as soon as the stop was complete
        else:
            # only what could still start a stop string is held back, nothing more
            assert seen == out + seen[len(out) :]
            assert len(seen) - len(out) == longest_partial(seen, stops)
    out += m.flush()
    assert (out, m.stopped) == reference("".join(chunks), stops)


@pytest.mark.parametrize(
    ("chunks", "stops", "expected"),
    [
        (["Hello\n", "\nBye"], ["\n\n"], ("Hello", True)),
        (["omese", "x"], ["e"], ("om", True)),  # a stop inside a merged token
        (["ab", "c"], ["abd", "bc"], ("a", True)),  # the first stop to complete wins
        (["b\nb"], ["\n", "b\nb"], ("b", True)),  # ... even if another starts earlier
        (["xab"], ["ab", "xab"], ("", True)),  # of two complete at once, the longer
        (["a\n"], ["\n\n"], ("a\n", False)),  # a held "\n" is output at the end
    ],
)
def test_examples(chunks, stops, expected) -> None:
    m = StopMatcher(stops)
    out = "".join(m.push(c) for c in chunks) + m.flush()
    assert (out, m.stopped) == expected


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["a", ""])
