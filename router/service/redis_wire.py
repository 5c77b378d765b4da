"""A small RESP2 client for the replica sync: a command is written to the socket at once, and
a pushed message is handled in the read callback that receives it.

redis-py's asyncio client makes every publish an awaited round trip in a task of its own and
every received message a task wake-up. During a burst of routing calls those tasks queue behind
the calls, and a pick reached the other routers milliseconds late (measured: decision 0025).
Here a publish is one non-blocking socket write from inside ``route()``, and a peer's batch is
applied in the callback that read it.

Only what the sync needs: AUTH, CLIENT SETNAME, PUBLISH, SUBSCRIBE, PING. Addresses and
options are redis-py's: ``redis://``, ``rediss://`` and ``unix://`` URLs (parsed by redis-py's
own ``parse_url``) and the keywords of ``RedisAuth.client_kwargs()`` (ACL user, password, TLS
files); as in redis-py, what the URL says wins over the keywords.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.connection import parse_url
from redis.exceptions import RedisError

MAX_BULK_BYTES = 512 * 1024 * 1024  # Redis' own proto-max-bulk-len default
MAX_ARRAY_ITEMS = 1024 * 1024
MAX_DEPTH = 4  # a pushed message is an array of bulk strings: depth 2
# past this many bytes waiting in the transport, sends queue instead (write() never blocks,
# so without a limit a stalled Redis would grow this process without bound)
MAX_WRITE_BUFFER = 4 * 1024 * 1024
_TLS_KEYS = {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
_ADDRESS_KEYS = {"host", "port", "path", "username", "password"}
# redis-py keywords with no meaning for these connections: pub/sub spans every database, and
# the sync keeps its own timeouts, connections and (RESP2) protocol
_IGNORED_KEYS = {
    "db",
    "connection_class",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "health_check_interval",
    "retry_on_timeout",
    "max_connections",
    "client_name",
    "decode_responses",
    "encoding",
    "protocol",
}
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


class RespError(RedisError):
    """An error reply from Redis (its own text)."""


class RespProtocolError(RedisError):
    """Bytes that are not RESP2, or past this client's limits (names which)."""


def encode_command(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(b"$%d\r\n" % len(arg))
        parts.append(arg)
        parts.append(b"\r\n")
    return b"".join(parts)


class RespParser:
    """Incremental RESP2: :meth:`feed` bytes, get every value now complete. Simple strings
    and bulk strings come as bytes, integers as int, a null as None, an error as a
    :class:`RespError` instance (not raised), arrays as lists."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        values: list[Any] = []
        pos = 0
        while pos < len(buf):
            parsed = self._parse(pos, 0)
            if parsed is None:
                break
            value, pos = parsed
            values.append(value)
        if pos:
            del buf[:pos]
        return values

    def _line(self, pos: int) -> tuple[bytes, int] | None:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            if len(self._buf) - pos > 64 * 1024:
                raise RespProtocolError("a RESP header line is over 64 KiB")
            return None
        return bytes(self._buf[pos + 1 : end]), end + 2

    def _int(self, text: bytes, what: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise RespProtocolError(f"{what} {text[:32]!r} is not an integer") from None

    def _parse(self, pos: int, depth: int) -> tuple[Any, int] | None:
        buf = self._buf
        kind = buf[pos]
        line = self._line(pos)
        if line is None:
            return None
        text, pos = line
        if kind == 0x24:  # $ bulk string
            n = self._int(text, "bulk length")
            if n < 0:
                return None, pos
            if n > MAX_BULK_BYTES:
                raise RespProtocolError(f"bulk string of {n} bytes, limit {MAX_BULK_BYTES}")
            if len(buf) < pos + n + 2:
                return None
            return bytes(buf[pos : pos + n]), pos + n + 2
        if kind == 0x2A:  # * array
            n = self._int(text, "array length")
            if n < 0:
                return None, pos
            if n > MAX_ARRAY_ITEMS:
                raise RespProtocolError(f"array of {n} items, limit {MAX_ARRAY_ITEMS}")
            if depth >= MAX_DEPTH:
                raise RespProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
            items: list[Any] = []
            for _ in range(n):
                if pos >= len(buf):
                    return None
                parsed = self._parse(pos, depth + 1)
                if parsed is None:
                    return None
                item, pos = parsed
                items.append(item)
            return items, pos
        if kind == 0x2B:  # + simple string
            return text, pos
        if kind == 0x3A:  # : integer
            return self._int(text, "integer"), pos
        if kind == 0x2D:  # - error
            return RespError(text.decode(errors="replace")), pos
        raise RespProtocolError(f"unknown RESP type byte {bytes([kind])!r}")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where and how to connect: a TCP host and port (with TLS for ``rediss://``) or a unix
    socket path, and the ACL user."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None
    connect_timeout_s: float = 5.0

    @classmethod
    def from_url(
        cls,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        connect_timeout_s: float = 5.0,
    ) -> RedisTarget:
        """redis-py's URL forms and TLS/ACL keywords (ValueError names what it cannot use)."""
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"Redis URL must start with redis://, rediss:// or unix://, got {url!r}"
            )
        merged: dict[str, Any] = dict(options or {})
        merged.update(parse_url(url))  # the URL wins, as in redis-py
        unknown = sorted(set(merged) - _TLS_KEYS - _IGNORED_KEYS - _ADDRESS_KEYS)
        if unknown:
            raise ValueError(f"replica sync: Redis options not supported here: {unknown}")
        tls = None
        if url.startswith("rediss://"):
            tls = _tls_context(merged)
        elif any(key in merged for key in _TLS_KEYS):
            raise ValueError(
                f"Redis TLS options need a rediss:// URL, got {url.split('://')[0]}://"
            )
        return cls(
            host=merged.get("host", "127.0.0.1"),
            port=int(merged.get("port", 6379)),
            path=merged.get("path") if url.startswith("unix://") else None,
            tls=tls,
            username=merged.get("username"),
            password=merged.get("password"),
            connect_timeout_s=connect_timeout_s,
        )


def _tls_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    reqs = options.get("ssl_cert_reqs", "required")
    if isinstance(reqs, str):
        if reqs not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be one of {sorted(_CERT_REQS)}, got {reqs!r}")
        reqs = _CERT_REQS[reqs]
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.get("ssl_ca_certs"))
    # as redis-py: no host name check without a certificate check
    ctx.check_hostname = bool(options.get("ssl_check_hostname", True)) and reqs != ssl.CERT_NONE
    ctx.verify_mode = ssl.VerifyMode(reqs)
    if options.get("ssl_certfile") is not None:
        ctx.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return ctx


ReplyHandler = Callable[[Any], None]  # gets the reply, a RespError, or a ConnectionError


class RespConnection(asyncio.Protocol):
    """One connection. :meth:`send` writes a command now and hands its reply to a callback;
    :meth:`call` awaits it. With ``on_message``, pushed ``message`` arrays (a subscription's)
    go to ``on_message(channel, data)`` from the read callback, in order (it must not raise:
    an exception there would close the connection)."""

    def __init__(self, on_message: Callable[[bytes, bytes], None] | None = None) -> None:
        self._on_message = on_message
        self._parser = RespParser()
        self._replies: deque[ReplyHandler | None] = deque()
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.close_reason: BaseException | None = None

    @classmethod
    async def open(
        cls,
        target: RedisTarget,
        *,
        name: str | None = None,
        on_message: Callable[[bytes, bytes], None] | None = None,
    ) -> RespConnection:
        """Connect, authenticate and name the connection, within the connect timeout."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(target.connect_timeout_s):
            if target.path is not None:
                _, conn = await loop.create_unix_connection(lambda: cls(on_message), target.path)
            else:
                _, conn = await loop.create_connection(
                    lambda: cls(on_message),
                    target.host,
                    target.port,
                    ssl=target.tls,
                    server_hostname=target.host if target.tls is not None else None,
                )
            try:
                if target.username is not None or target.password is not None:
                    if target.username is not None:
                        await conn.call("AUTH", target.username, target.password or "")
                    else:
                        await conn.call("AUTH", target.password or "")
                if name is not None:  # a label for CLIENT LIST; an ACL may forbid it
                    with contextlib.suppress(RespError):
                        await conn.call("CLIENT", "SETNAME", name)
            except BaseException:
                conn.close()
                raise
        return conn

    # ---- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            values = self._parser.feed(data)
        except RespProtocolError as exc:
            self._abort(exc)
            return
        for value in values:
            if (
                self._on_message is not None
                and isinstance(value, list)
                and len(value) == 3
                and value[0] == b"message"
            ):
                self._on_message(value[1], value[2])
                continue
            if not self._replies:
                self._abort(RespProtocolError(f"a reply nobody asked for: {value!r:.80}"))
                return
            handler = self._replies.popleft()
            if handler is not None:
                handler(value)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = self.close_reason or exc or ConnectionError("Redis closed the connection")
        self.close_reason = reason
        lost = ConnectionError(f"connection to Redis lost: {reason}")
        replies, self._replies = self._replies, deque()
        for handler in replies:
            if handler is not None:
                handler(lost)
        self._writable.set()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- commands ----------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    @property
    def write_buffer_size(self) -> int:
        return 0 if self._transport is None else self._transport.get_write_buffer_size()

    def can_send_now(self) -> bool:
        """Open, and little enough waiting in the transport that a send will not pile up."""
        return self.is_open and self.write_buffer_size < MAX_WRITE_BUFFER

    def send(self, *args: bytes | str | int, on_reply: ReplyHandler | None = None) -> None:
        """Write one command now (never blocks); its reply goes to ``on_reply``."""
        if not self.is_open:
            raise ConnectionError("the connection to Redis is closed")
        assert self._transport is not None
        self._replies.append(on_reply)
        self._transport.write(encode_command(*args))

    async def call(self, *args: bytes | str | int) -> Any:
        """Send one command and await its reply (a RespError reply is raised)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(value: Any) -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        self.send(*args, on_reply=done)
        return await future

    async def wait_writable(self) -> None:
        await self._writable.wait()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _abort(self, exc: BaseException) -> None:
        self.close_reason = exc
        if self._transport is not None:
            self._transport.abort()
