"""One HTTP/1.1 response, bytes in, body lines out: the engine's streamed completion.

Sans-I/O (as h11): no sockets, no event loop, no clock. :class:`ResponseParser` takes the
bytes of one response as they arrive and gives back its body split into lines, which is
what a server-sent-event stream is made of::

    HTTP/1.1 200 OK\\r\\n              head: status, keep-alive, the body's framing
    transfer-encoding: chunked\\r\\n
    \\r\\n
    5a\\r\\ndata: {...}\\n\\n\\r\\n      chunks: their data joined, then cut at each \\n
    e\\r\\ndata: [DONE]\\n\\n\\r\\n
    0\\r\\n\\r\\n                       the end: the connection may carry the next request

Bodies framed by ``content-length`` (an engine's error answers) and bodies that run to the
connection's end are read too. Only what an engine's streamed answer to a POST needs:
no 1xx, no upgrades, no pipelining. Malformed input and sizes past the bounds raise
:class:`HttpResponseError`.
"""

from __future__ import annotations

__all__ = ["MAX_HEAD_BYTES", "MAX_LINE_BYTES", "HttpResponseError", "ResponseParser"]

MAX_HEAD_BYTES = 64 * 1024  # status line and headers
MAX_LINE_BYTES = 16 * 1024 * 1024  # one body line (one server-sent event's data)
_MAX_CHUNK_SIZE_DIGITS = 16

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _LENGTH, _TO_CLOSE, _DONE = range(8)


class HttpResponseError(ValueError):
    """The bytes are not an HTTP/1.1 response this parser reads."""


class ResponseParser:
    """Feed the bytes of one response with :meth:`feed`; it returns the body lines they
    completed (without their ``\\n`` / ``\\r\\n``). ``status`` is set once the head is in;
    ``done`` once the body's end is; ``keep_alive`` says whether the connection may carry
    another request after it."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.done = False
        self._state = _HEAD
        self._buf = bytearray()  # framing bytes not parsed yet
        self._line = bytearray()  # body bytes of the line being completed
        self._left = 0  # bytes left in the chunk, or in a content-length body

    @property
    def head_done(self) -> bool:
        return self._state != _HEAD

    def feed(self, data: bytes) -> list[bytes]:
        """The body lines ``data`` completes (raises HttpResponseError)."""
        if self._state == _DONE:
            if data:
                raise HttpResponseError("bytes after the response's end")
            return []
        self._buf += data
        lines: list[bytes] = []
        while self._step(lines):
            pass
        return lines

    def eof(self) -> list[bytes]:
        """The connection ended: the last line of a body that runs to the end; raises
        HttpResponseError when the response was not complete."""
        if self._state == _TO_CLOSE:
            self._state, self.done = _DONE, True
            last = bytes(self._line)
            self._line.clear()
            return [last] if last else []
        if self._state != _DONE:
            raise HttpResponseError("the connection ended before the response did")
        return []

    def _step(self, lines: list[bytes]) -> bool:
        """Parse what one state can from the buffer; False when it needs more bytes."""
        state, buf = self._state, self._buf
        if state in (_CHUNK_DATA, _LENGTH):
            if not buf:
                return False
            take = min(self._left, len(buf))
            self._body(bytes(buf[:take]), lines)
            del buf[:take]
            self._left -= take
            if self._left == 0:
                if state == _LENGTH:
                    self._finish(lines)
                else:
                    self._state = _CHUNK_END
            return True
        if state == _TO_CLOSE:
            if buf:
                self._body(bytes(buf), lines)
                buf.clear()
            return False
        if state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise HttpResponseError(f"response head over {MAX_HEAD_BYTES} bytes")
                return False
            head = bytes(buf[:end])
            del buf[: end + 4]
            self._head(head, lines)
            return True
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise HttpResponseError(f"chunk framing line over {MAX_HEAD_BYTES} bytes")
            return False
        line = bytes(buf[:end])
        del buf[: end + 2]
        if state == _CHUNK_SIZE:
            self._chunk_size(line, lines)
        elif state == _CHUNK_END:
            if line:
                raise HttpResponseError(f"a chunk overran its size: {line[:40]!r}")
            self._state = _CHUNK_SIZE
        elif not line:  # _TRAILERS: an empty line ends them
            self._finish(lines)
        return True

    def _head(self, head: bytes, lines: list[bytes]) -> None:
        status_line, *fields = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpResponseError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        self.status = int(parts[1])
        if 100 <= self.status < 200:
            raise HttpResponseError(f"informational responses are not read: {self.status}")
        for field in fields:
            name, sep, value = field.partition(":")
            if not sep:
                raise HttpResponseError(f"a header line without a colon: {field[:80]!r}")
            self.headers[name.strip().lower()] = value.strip()
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = parts[0] != "HTTP/1.0" and "close" not in connection
        encoding = self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        if "chunked" in encoding:
            self._state = _CHUNK_SIZE
        elif length is not None:
            if not length.isdigit():
                raise HttpResponseError(f"content-length is not a number: {length[:40]!r}")
            self._left = int(length)
            self._state = _LENGTH
            if self._left == 0:
                self._finish(lines)
        else:  # the body runs to the connection's end, which then cannot be reused
            self._state, self.keep_alive = _TO_CLOSE, False

    def _chunk_size(self, line: bytes, lines: list[bytes]) -> None:
        digits = line.split(b";", 1)[0].strip()
        if not digits or len(digits) > _MAX_CHUNK_SIZE_DIGITS:
            raise HttpResponseError(f"not a chunk size: {line[:40]!r}")
        try:
            size = int(digits, 16)
        except ValueError:
            raise HttpResponseError(f"not a chunk size: {line[:40]!r}") from None
        if size == 0:
            self._state = _TRAILERS
        else:
            self._left, self._state = size, _CHUNK_DATA

    def _body(self, data: bytes, lines: list[bytes]) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if self._line:
                self._line += data[start:end]
                line = bytes(self._line)
                self._line.clear()
            else:
                line = data[start:end]
            lines.append(line[:-1] if line.endswith(b"\r") else line)
            start = end + 1
        self._line += data[start:]
        if len(self._line) > MAX_LINE_BYTES:
            raise HttpResponseError(f"a body line over {MAX_LINE_BYTES} bytes")

    def _finish(self, lines: list[bytes]) -> None:
        if self._line:  # a last line without its \n
            lines.append(bytes(self._line))
            self._line.clear()
        self._state, self.done = _DONE, True
        if self._buf:
            raise HttpResponseError("bytes after the response's end")
