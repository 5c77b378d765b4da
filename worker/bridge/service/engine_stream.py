"""The bridge's streamed requests to its engine: HTTP/1.1 keep-alive connections of its own.

Every forwarded request is one POST whose answer streams back as server-sent events. A
general client (aiohttp) spends more of the bridge's time on a request's way out than the
whole rest of the bridge does (decision 0038); this one writes the request's head and body
in one write on a pooled connection and hands each body line over as it arrives::

    EnginePool.open(path, body) ──► a connection from the pool (or a new one), one write
    EngineResponse.lines()      ◄── ResponseParser (worker/bridge/http_response.py) in
                                    data_received; reading pauses while lines pile up
    EngineResponse.close()      ──► at the body's end: back to the pool; before it: the
                                    connection is closed, which aborts the engine's request

A pooled connection the engine closed while it was idle (its keep-alive timeout) is found
out by the request sent on it: when it ends without a byte of answer, the request is sent
once more on a new connection (as Go's HTTP client does). Failures are ``ConnectionError``
(an OSError), as aiohttp's are OSErrors, for the caller to map.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from worker.bridge.http_response import HttpResponseError, ResponseParser

MAX_IDLE = 256  # idle connections kept for later requests
PAUSE_LINES = 256  # body lines waiting to be taken before reading pauses
MAX_ERROR_BODY_LINES = 1000  # lines of an error answer read for its message at most


class EngineStreamError(ConnectionError):
    """The engine's answer broke off or is not HTTP this client reads."""


class _Connection(asyncio.Protocol):
    """One connection to the engine: a request at a time, its answer's lines queued."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.lines: deque[bytes] = deque()
        self.num_bytes = 0  # of the current answer
        self.error: Exception | None = None
        self.lost = False
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.num_bytes += len(data)
        if self.parser is None or self.error is not None:
            self._fail(EngineStreamError("the engine sent bytes no request asked for"))
            return
        try:
            self.lines.extend(self.parser.feed(data))
        except HttpResponseError as exc:
            self._fail(EngineStreamError(f"the engine's answer is not HTTP/1.1: {exc}"))
            return
        if len(self.lines) > PAUSE_LINES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        parser = self.parser
        if parser is not None and not parser.done and self.error is None:
            try:
                self.lines.extend(parser.eof())
            except HttpResponseError:
                when = "the end of its answer" if parser.head_done else "answering"
                self.error = EngineStreamError(f"the engine closed the connection before {when}")
        self._wake()

    def _fail(self, error: Exception) -> None:
        self.error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something arrives, or the connection ends."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.parser = ResponseParser()
        self.lines.clear()
        self.num_bytes = 0
        self.transport.write(request)

    def take(self) -> bytes:
        line = self.lines.popleft()
        if self.paused and len(self.lines) < PAUSE_LINES // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return line

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()
        self._wake()


class EngineResponse:
    """One streamed answer: ``status`` once its head is in, then its body's lines. The
    owner must ``close()`` it: at the body's end that hands the connection back."""

    def __init__(self, pool: EnginePool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = 0
        self.closed = False

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without their line ends) until its end; raises
        EngineStreamError when the answer breaks off."""
        conn = self._conn
        parser = conn.parser
        assert parser is not None
        while not self.closed:
            if conn.lines:
                yield conn.take()
            elif conn.error is not None:
                raise conn.error
            elif parser.done:
                return
            elif conn.lost:
                raise EngineStreamError("the engine's connection closed mid-answer")
            else:
                await conn.wait()

    async def wait_head(self) -> None:
        conn = self._conn
        parser = conn.parser
        assert parser is not None
        while not parser.head_done:
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise EngineStreamError("the engine closed the connection before answering")
            await conn.wait()
        self.status = parser.status

    async def finish(self, max_lines: int) -> None:
        """Read up to ``max_lines`` more lines for the body's end (so close() can hand the
        connection back)."""
        n = 0
        async for _ in self.lines():
            n += 1
            if n >= max_lines:
                return

    async def text(self, limit: int = 500) -> str:
        """The start of a (short) answer's body, as text."""
        lines: list[bytes] = []
        n = 0
        try:
            async for line in self.lines():
                lines.append(line)
                n += 1
                if n >= MAX_ERROR_BODY_LINES:
                    break
        except EngineStreamError:
            pass
        return b"\n".join(lines).decode("utf-8", "replace")[:limit]

    def close(self) -> None:
        """Hand the connection back when its answer ended (and it may be reused); close it
        otherwise, which aborts what the engine still runs for it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        conn = self._conn
        parser = conn.parser
        if parser is not None and parser.done and parser.keep_alive and not conn.lost:
            conn.parser = None
            self._pool.release(conn)
        else:
            conn.close()


class EnginePool:
    """Keep-alive connections to one engine, for streamed POSTs."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self.base_url = base_url
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the engine's URL must be http(s)://HOST[:PORT], got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        self._authority = url.netloc.rpartition("@")[2]
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self.num_connects = 0

    async def open(self, path: str, body: dict[str, Any]) -> EngineResponse:
        """POST ``body`` as JSON to ``path``; the answer once its head arrived (raises
        ConnectionError / OSError / TimeoutError when the engine cannot be reached)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"POST {self._prefix}{path} HTTP/1.1\r\nHost: {self._authority}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode("latin-1")
        request = head + data
        while True:
            conn, reused = self._take_idle(), True
            if conn is None:
                conn, reused = await self._connect(), False
            conn.send(request)
            resp = EngineResponse(self, conn)
            try:
                await resp.wait_head()
                return resp
            except EngineStreamError:
                resp.close()
                if not (reused and conn.lost and conn.num_bytes == 0):
                    raise
            except BaseException:  # cancelled while waiting: the engine aborts it
                resp.close()
                raise
            # an idle connection the engine had closed: once more, on another idle one or a
            # new one (bounded: each round takes one idle connection, a new one never loops)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        self.num_connects += 1
        async with asyncio.timeout(self._connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self._ssl)
        return conn

    def release(self, conn: _Connection) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close the idle connections (those in use close with their responses)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
