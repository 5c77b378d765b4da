"""The bridge's HTTP/1.1 response parser (worker/bridge/http_response.py): bytes in, body
lines out, however the bytes are cut; the framings an engine uses; what it refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.bridge import http_response
from worker.bridge.http_response import HttpResponseError, ResponseParser

EVENTS = [
    b'data: {"choices":[{"index":0,"text":"","token_ids":[7]}]}',
    b"",
    b'data: {"choices":[{"index":0,"text":"\\u00e9","token_ids":[8],"finish_reason":"length"}]}',
    b"",
    b"data: [DONE]",
    b"",
]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked(body: bytes, sizes: list[int]) -> bytes:
    """``body`` as chunks of the given sizes (the rest in one), then the end."""
    out, i = b"", 0
    for size in [*sizes, len(body)]:
        part = body[i : i + size]
        if part:
            out += b"%x;ext=1\r\n%s\r\n" % (len(part), part)
        i += len(part)
    return out + b"0\r\nx-trailer: 1\r\n\r\n"


def feed_in_pieces(data: bytes, cuts: list[int]) -> tuple[ResponseParser, list[bytes]]:
    parser, lines, start = ResponseParser(), [], 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        lines += parser.feed(data[start:cut])
        start = cut
    return parser, lines


def test_a_streamed_answer_gives_its_lines_status_and_end():
    body = b"\n".join(EVENTS) + b"\n"
    parser, lines = feed_in_pieces(HEAD + chunked(body, [10, 3, 60]), [])
    assert parser.status == 200 and parser.headers["content-type"] == "text/event-stream"
    assert lines == EVENTS
    assert parser.done and parser.keep_alive
    assert parser.feed(b"") == [] and parser.eof() == []


@given(
    st.lists(st.integers(1, 40), max_size=12),
    st.lists(st.integers(0, 10_000), max_size=20),
    st.booleans(),
)
def test_any_cut_of_the_bytes_gives_the_same_lines(chunk_sizes, cuts, crlf):
    end = b"\r\n" if crlf else b"\n"
    body = end.join(EVENTS) + end
    parser, lines = feed_in_pieces(HEAD + chunked(body, chunk_sizes), cuts)
    assert lines == EVENTS and parser.done


def test_an_error_answer_with_a_content_length():
    text = b'{"error": {"message": "prompt too long"}}'
    data = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
    parser, lines = feed_in_pieces(data, [20, 60])
    assert parser.status == 400 and lines == [text] and parser.done and parser.keep_alive
    empty = ResponseParser()
    assert empty.feed(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n") == []
    assert empty.done and empty.status == 204


def test_a_body_to_the_connections_end_and_connection_close():
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.0 200 OK\r\n\r\nline 1\nline") == [b"line 1"]
    assert not parser.done and not parser.keep_alive
    assert parser.eof() == [b"line"] and parser.done
    closing = ResponseParser()
    closing.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 2\r\n\r\nok")
    assert closing.done and not closing.keep_alive


def test_an_answer_cut_short_is_an_error_at_the_connections_end():
    parser = ResponseParser()
    assert parser.feed(HEAD + b"20\r\ndata: 1\n") == [b"data: 1"]
    with pytest.raises(HttpResponseError, match="before the response did"):
        parser.eof()
    with pytest.raises(HttpResponseError, match="before the response did"):
        ResponseParser().eof()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 100 Continue\r\n\r\n", "informational"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "without a colon"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "content-length is not a number"),
        (HEAD + b"zz\r\n", "not a chunk size"),
        (HEAD + b"11111111111111111\r\n", "not a chunk size"),
        (HEAD + b"2\r\nabcd\r\n", "overran its size"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab", "after the response's end"),
    ],
)
def test_what_is_not_an_engine_answer_is_refused(data, message):
    with pytest.raises(HttpResponseError, match=message):
        ResponseParser().feed(data)


def test_bytes_after_the_end_and_sizes_past_the_bounds_are_refused(monkeypatch):
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\na")
    with pytest.raises(HttpResponseError, match="after the response's end"):
        parser.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(HttpResponseError, match="head over"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nx: " + b"a" * http_response.MAX_HEAD_BYTES)
    monkeypatch.setattr(http_response, "MAX_LINE_BYTES", 100)
    long_line = ResponseParser()
    long_line.feed(HEAD)
    with pytest.raises(HttpResponseError, match="body line over 100 bytes"):
        long_line.feed(b"80\r\n" + b"a" * 0x80 + b"\r\n")
