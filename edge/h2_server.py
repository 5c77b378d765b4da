"""The router's client-facing gRPC server: HTTP/2 framed on the event loop with ``h2``.

grpc.aio sends each message of a streamed answer as a batch of its own whose completion
crosses two threads (grpc's event engine, its completion-queue poller, then the event loop),
and accepts a call over several loop turns (decision 0043). Here a message is a DATA frame
written from the handler's own turn of the loop: ``h2`` keeps the protocol's state (streams,
flow control, HPACK, settings, pings), and the frames every stream wrote in one turn leave in
one socket write (decision 0054).

It serves what grpc's generated code registers (``add_generic_rpc_handlers`` and
``add_registered_method_handlers``, so ``add_RouterServicer_to_server``, the health and the
reflection services work unchanged), behind ``grpc.aio.ServerInterceptor``s, with a
``ServicerContext`` of the methods kvroute's services use (``invocation_metadata``,
``time_remaining``, ``abort``, ``set_trailing_metadata``, ``write``, ``peer``)::

    server = H2GrpcServer(interceptors=[...])
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_port("127.0.0.1:0", tls=None)   # bound now, as grpc binds
    await server.start()
    ...
    await server.stop(grace=5.0)

The wire, per the gRPC-over-HTTP/2 protocol: a request is a POST whose ``:path`` is the
method, ``content-type: application/grpc``, an optional ``grpc-timeout`` (the deadline);
messages are length-prefixed in DATA frames; the status leaves in trailers (``grpc-status``,
``grpc-message`` percent-encoded), or alone in a trailers-only answer when no message went
out. A client's RST_STREAM, a lost connection or a passed deadline cancels the method's task.
Compressed messages are refused (UNIMPLEMENTED; kvroute's clients never compress), a message
over ``max_receive_message_bytes`` is RESOURCE_EXHAUSTED, as grpc answers both.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import inspect
import logging
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from edge.tls import bind_error_reason

__all__ = ["H2GrpcServer"]

log = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG, a caller's API key included: never let it
logging.getLogger("hpack").setLevel(logging.INFO)

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 << 20  # grpc's default receive limit
# Streams one client connection may have open at once (advertised in SETTINGS; a client
# queues the rest). grpc's own clients open one connection per channel.
MAX_CONCURRENT_STREAMS = 1024
MAX_HEADER_LIST_BYTES = 16 << 10  # the metadata of one call, as grpc's hard limit
# How far a client may send ahead: a prompt of a few MB arrives without a round trip per
# 64 KiB window (what the server buffers is bounded per stream by the message limit).
STREAM_WINDOW_BYTES = 1 << 20
CONNECTION_WINDOW_BYTES = 16 << 20
# Request bytes one connection may have received and not yet handed to its methods (partial
# messages, mostly): past it the stream that went over is refused, so a client cannot make
# the router hold its message limit times its streams.
MAX_CONNECTION_PENDING_BYTES = 64 << 20
LISTEN_BACKLOG = 1024

_RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))
# request headers that are the protocol's, not the call's metadata
_RESERVED = frozenset(
    (b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding")
)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_H2_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,  # bytes in and out: no decode of every header
    validate_outbound_headers=False,  # ours are fixed or built here
    normalize_outbound_headers=False,
)


class _Details(NamedTuple):
    """grpc.HandlerCallDetails: what interceptors and generic handlers look at."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class _Abort(grpc.aio.AbortError):
    """Raised by ``context.abort``: ends the call with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Gone(Exception):
    """The stream was reset by the client, or its connection lost: nothing more to send."""


def _percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, every other byte %XX."""
    out = bytearray()
    for byte in text.encode("utf-8", "replace"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def _parse_timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (up to 8 digits and a unit) in seconds; None if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


def _metadata_value(key: bytes, value: bytes) -> str | bytes:
    if key.endswith(b"-bin"):  # binary metadata travels base64 (padding optional)
        try:
            return base64.b64decode(value + b"=" * (-len(value) % 4))
        except ValueError:
            return value
    return value.decode("utf-8", "replace")


def _encode_metadata(pairs: Iterable[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in pairs:
        name = key.lower().encode("ascii")
        if isinstance(value, bytes):
            out.append((name, base64.b64encode(value).rstrip(b"=")))
        else:
            out.append((name, value.encode("utf-8")))
    return out


class _Context:
    """The ``grpc.aio.ServicerContext`` methods kvroute's services call."""

    __slots__ = ("_metadata", "_stream", "code", "details", "trailing")

    def __init__(self, stream: _Stream, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self._stream = stream
        self._metadata = metadata
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        deadline = self._stream.deadline
        if deadline is None:
            return None
        return max(0.0, deadline - asyncio.get_running_loop().time())

    def peer(self) -> str:
        return self._stream.peer

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise _Abort(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def cancelled(self) -> bool:
        return self._stream.gone

    def done(self) -> bool:
        return self._stream.ended

    async def write(self, message: Any) -> None:
        """A message of a method that writes instead of yielding (health's Watch)."""
        await self._stream.send(self._stream.serialize(message))


class _Stream:
    """One call: its request messages as they come, its answer as it goes."""

    __slots__ = (
        "_buffer",
        "_conn",
        "_messages",
        "_request_ended",
        "_waiter",
        "deadline",
        "ended",
        "expired",
        "gone",
        "headers_sent",
        "id",
        "peer",
        "pending",
        "serialize",
        "task",
    )

    def __init__(self, conn: _Connection, stream_id: int, deadline: float | None) -> None:
        self._conn = conn
        self.id = stream_id
        self.deadline = deadline
        self.peer = conn.peer
        self._buffer = bytearray()
        self._messages: deque[bytes] = deque()
        self.pending = 0  # bytes received and not yet taken by the method
        self._request_ended = False
        self._waiter: asyncio.Future[None] | None = None
        self.headers_sent = False
        self.ended = False  # its status went out
        self.gone = False  # reset by the client, or the connection lost
        self.expired = False  # its deadline passed
        self.serialize: Callable[[Any], bytes] = _identity
        self.task: asyncio.Task[None] | None = None

    # the request side (called from the connection's data_received)

    def receive(self, data: bytes, limit: int) -> str | None:
        """Frame ``data`` into messages; a reason to refuse the call, or None."""
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 5:
            if buffer[0] != 0:
                return "compressed"
            length = int.from_bytes(buffer[1:5], "big")
            if length > limit:
                return f"Received message larger than max ({length} vs. {limit})"
            if len(buffer) < 5 + length:
                break
            self._messages.append(bytes(buffer[5 : 5 + length]))
            del buffer[: 5 + length]
        self._wake()
        return None

    def count(self) -> None:
        """Bring the connection's count of pending bytes up to date with this stream's."""
        now = len(self._buffer) + sum(map(len, self._messages))
        self._conn.pending += now - self.pending
        self.pending = now

    def end_request(self) -> None:
        self._request_ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_message(self) -> bytes | None:
        """The next request message; None once the client closed its side."""
        while not self._messages:
            if self._request_ended or self.gone:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._messages.popleft()
        self._conn.pending -= len(message)
        self.pending -= len(message)
        return message

    async def requests(self, deserialize: Callable[[bytes], Any]) -> AsyncIterator[Any]:
        while (message := await self.next_message()) is not None:
            yield deserialize(message)

    # the answer side

    async def send(self, payload: bytes) -> None:
        """One message, framed; waits only for the client's flow-control window or a
        full socket buffer."""
        conn = self._conn
        if self.gone or self.ended:
            raise _Gone
        h2conn = conn.h2
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        try:
            if not self.headers_sent:
                h2conn.send_headers(self.id, _RESPONSE_HEADERS)
                self.headers_sent = True
            while data:
                window = min(h2conn.local_flow_control_window(self.id), len(data))
                if window <= 0:
                    await conn.wait_window()
                    if self.gone:
                        raise _Gone
                    continue
                size = h2conn.max_outbound_frame_size
                while window > 0:
                    n = min(window, size)
                    h2conn.send_data(self.id, data[:n])
                    data = data[n:]
                    window -= n
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            raise _Gone from exc
        conn.schedule_flush()
        if conn.paused:
            await conn.drained()

    def finish(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: Iterable[tuple[str, str | bytes]] = (),
    ) -> None:
        """Send the call's status (trailers, or a trailers-only answer)."""
        if self.ended or self.gone:
            return
        self.ended = True
        headers = [] if self.headers_sent else list(_RESPONSE_HEADERS)
        headers.append((b"grpc-status", str(code.value[0]).encode()))
        if details:
            headers.append((b"grpc-message", _percent_encode(details)))
        headers.extend(_encode_metadata(trailing))
        conn = self._conn
        try:
            conn.h2.send_headers(self.id, headers, end_stream=True)
            if not self._request_ended:  # the client may still be sending: it need not
                conn.h2.reset_stream(self.id, h2.errors.ErrorCodes.NO_ERROR)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        conn.schedule_flush()

    def release(self) -> None:
        """Forget what it received and was not taken: the call is over."""
        self._buffer.clear()
        self._messages.clear()
        self.count()

    def lose(self) -> None:
        """Reset by the client or the connection went: the method is cancelled."""
        self.release()
        self.gone = True
        self._wake()
        if self.task is not None:
            self.task.cancel()

    def expire(self) -> None:
        """The deadline passed: the method is cancelled, the client told so."""
        self.expired = True
        if self.task is not None:
            self.task.cancel()


def _identity(message: Any) -> bytes:
    return message  # type: ignore[no-any-return]


class _Connection(asyncio.Protocol):
    """One client connection: h2's state, the streams open on it."""

    def __init__(self, server: H2GrpcServer) -> None:
        self._server = server
        self.h2 = h2.connection.H2Connection(_H2_CONFIG)
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, _Stream] = {}
        self._window_waiters: list[asyncio.Future[None]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._flush_pending = False
        self.pending = 0  # request bytes received, not yet taken by the methods
        self.paused = False
        self.closed = False
        self.peer = ""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.peer = _peer_name(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server.connections.add(self)
        conn = self.h2
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW_BYTES,
            },
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW_BYTES - 65535)
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.info("gRPC client %s: HTTP/2 protocol error, connection closed: %s", self.peer, exc)
            self._flush()
            self._close()
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self._on_data(event)
            elif isinstance(event, h2.events.RequestReceived):
                self._on_request(event)
            elif isinstance(event, h2.events.StreamEnded):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.end_request()
            elif isinstance(event, h2.events.StreamReset):
                stream = self._streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.lose()
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._wake_windows()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._flush()
                self._close()
                return
        self._flush()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        _wake_all(self._drain_waiters)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.paused = False
        self._server.connections.discard(self)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.lose()
        _wake_all(self._window_waiters)
        _wake_all(self._drain_waiters)

    # streams

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        method = path = b""
        content_type = b""
        timeout: float | None = None
        metadata: list[tuple[str, str | bytes]] = []
        bad_timeout = False
        for key, value in event.headers:
            if key[:1] == b":":
                if key == b":path":
                    path = value
                elif key == b":method":
                    method = value
            elif key == b"content-type":
                content_type = value
            elif key == b"grpc-timeout":
                timeout = _parse_timeout(value)
                bad_timeout = timeout is None
            elif key not in _RESERVED:
                metadata.append((key.decode("ascii", "replace"), _metadata_value(key, value)))
        if method != b"POST":
            self._refuse_http(stream_id, b"405")
            return
        if not content_type.startswith(b"application/grpc"):
            self._refuse_http(stream_id, b"415")
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        stream = _Stream(self, stream_id, deadline)
        self._streams[stream_id] = stream
        if self._server.stopping:
            stream.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            self.done(stream)
            return
        if bad_timeout:
            stream.finish(grpc.StatusCode.INVALID_ARGUMENT, "malformed grpc-timeout header")
            self.done(stream)
            return
        details = _Details(path.decode("ascii", "replace"), tuple(metadata))
        stream.task = loop.create_task(self._server.run_call(stream, details))
        if timeout is not None:
            timer = loop.call_later(timeout, stream.expire)
            stream.task.add_done_callback(lambda _task: timer.cancel())

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream_id = event.stream_id
        # acknowledged at once: what a stream may hold is bounded by the message limit
        self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            return
        refusal = stream.receive(event.data, self._server.max_receive_message_bytes)
        stream.count()
        if refusal is None and self.pending > MAX_CONNECTION_PENDING_BYTES:
            refusal = (
                f"this connection is sending more than {MAX_CONNECTION_PENDING_BYTES} bytes of "
                "requests at once"
            )
        if refusal == "compressed":
            stream.finish(
                grpc.StatusCode.UNIMPLEMENTED,
                "compressed messages are not accepted: send them uncompressed (identity)",
            )
            self.forget(stream)
        elif refusal is not None:
            stream.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            self.forget(stream)

    def _refuse_http(self, stream_id: int, status: bytes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.send_headers(stream_id, ((b":status", status),), end_stream=True)

    def forget(self, stream: _Stream) -> None:
        """The call is over before its method: its task (if still running) is cancelled."""
        self.done(stream)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def done(self, stream: _Stream) -> None:
        """The call is over: what it received is let go, its id forgotten."""
        stream.release()
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    # writing

    def schedule_flush(self) -> None:
        """Write what h2 has framed at the end of this turn of the loop: the messages every
        stream wrote in it leave in one write."""
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        data = self.h2.data_to_send()
        if data and self._transport is not None and not self.closed:
            self._transport.write(data)

    async def wait_window(self) -> None:
        """Until the client opens its flow-control window (or the connection goes)."""
        await self._wait(self._window_waiters)
        if self.closed:
            raise _Gone

    async def drained(self) -> None:
        """Until the socket's buffer drained below its mark (or the connection goes)."""
        await self._wait(self._drain_waiters)

    async def _wait(self, waiters: list[asyncio.Future[None]]) -> None:
        if self.closed:
            raise _Gone
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        await waiter

    def _wake_windows(self) -> None:
        _wake_all(self._window_waiters)

    # ending

    def go_away(self) -> None:
        """Tell the client no new calls are taken here; the open ones go on. (h2's own
        ``close_connection`` would close its state machine, ending them too; so the frame
        is written here, a call started meanwhile is answered UNAVAILABLE.)"""
        if not self.closed and self._transport is not None:
            self._flush()
            frame = GoAwayFrame(stream_id=0)
            frame.last_stream_id = self.h2.highest_inbound_stream_id
            self._transport.write(frame.serialize())

    def _close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.close()

    def abort(self) -> None:
        """Cancel every call and drop the connection."""
        for stream in list(self._streams.values()):
            stream.lose()
        self._close()

    @property
    def num_streams(self) -> int:
        return len(self._streams)


def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()


def _peer_name(peername: Any) -> str:
    """grpc's form: ``ipv4:HOST:PORT``, ``ipv6:[HOST]:PORT``, ``unix:PATH``."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        if ":" in host:
            return f"ipv6:[{host}]:{port}"
        return f"ipv4:{host}:{port}"
    return f"unix:{peername}" if peername else "unknown"


Continuation = Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]]


class H2GrpcServer:
    """A gRPC server on the event loop, with the surface of ``grpc.aio.Server`` that
    kvroute's router uses."""

    def __init__(
        self,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        reuse_port: bool = False,
        max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
    ) -> None:
        self.max_receive_message_bytes = max_receive_message_bytes
        self._reuse_port = reuse_port
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._servers: list[asyncio.base_events.Server] = []
        self.connections: set[_Connection] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self.stopping = False
        resolve: Continuation = self._lookup
        for interceptor in reversed(interceptors):  # the first one listed runs first
            resolve = functools.partial(interceptor.intercept_service, resolve)
        self._resolve = resolve

    # registration (what grpc's generated code calls)

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler

    async def _lookup(self, details: _Details) -> grpc.RpcMethodHandler | None:
        handler = self._methods.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)  # type: ignore[arg-type]
            if handler is not None:
                return handler
        return None

    # binding

    def add_port(self, address: str, tls: ssl.SSLContext | None = None) -> int:
        """Bind ``HOST:PORT`` now (every address the host resolves to, one port); the
        port. OSError saying why when it cannot be bound."""
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise OSError(f"could not bind {address}: not HOST:PORT")
        host = host.strip("[]") or None  # type: ignore[assignment]
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
        port = int(port_text)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise OSError(f"could not bind {address}: {exc.strerror}") from None
        bound: list[socket.socket] = []
        first_error: OSError | None = None
        seen = set()
        for family, kind, proto, _, sockaddr in infos:
            if (family, sockaddr[0]) in seen:
                continue
            seen.add((family, sockaddr[0]))
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self._reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((sockaddr[0], port, *sockaddr[2:]))
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                first_error = first_error or exc
                continue
            port = sock.getsockname()[1]  # port 0: the rest take the one the first got
            bound.append(sock)
        if not bound:
            assert first_error is not None
            raise OSError(f"could not bind {address}: {bind_error_reason(first_error)}")
        self._sockets.extend((sock, tls) for sock in bound)
        return port

    # serving

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock, tls in self._sockets:
            server = await loop.create_server(
                lambda: _Connection(self), sock=sock, ssl=tls, backlog=LISTEN_BACKLOG
            )
            self._servers.append(server)

    async def run_call(self, stream: _Stream, details: _Details) -> None:
        """Resolve the method (through the interceptors) and run it to its status."""
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        context = _Context(stream, details.invocation_metadata)
        code, message = grpc.StatusCode.OK, ""
        try:
            handler = await self._resolve(details)
            if handler is None:
                code, message = grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
            else:
                await self._serve(handler, stream, context)
                if context.code is not None:
                    code, message = context.code, context.details
        except _Abort as exc:
            code, message = exc.code, exc.details
        except _Gone:
            pass
        except asyncio.CancelledError:
            if stream.expired:
                code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            elif not stream.gone:
                code, message = grpc.StatusCode.CANCELLED, "the server is shutting down"
        except Exception as exc:
            log.exception("gRPC method %s failed", details.method)
            code, message = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
        finally:
            self._calls.discard(task)
            stream.finish(code, message, context.trailing)
            stream._conn.done(stream)

    async def _serve(
        self, handler: grpc.RpcMethodHandler, stream: _Stream, context: _Context
    ) -> None:
        deserialize = handler.request_deserializer or _identity
        serialize = handler.response_serializer or _identity
        stream.serialize = serialize
        if handler.request_streaming:
            requests = stream.requests(deserialize)
            if handler.response_streaming:
                result = handler.stream_stream(requests, context)
            else:
                result = handler.stream_unary(requests, context)
        else:
            message = await stream.next_message()
            if message is None:
                raise _Abort(grpc.StatusCode.INTERNAL, "the call ended without its request")
            request = deserialize(message)
            if handler.response_streaming:
                result = handler.unary_stream(request, context)
            else:
                result = handler.unary_unary(request, context)
        if handler.response_streaming:
            if inspect.isasyncgen(result):
                async with contextlib.aclosing(result) as messages:
                    async for item in messages:
                        await stream.send(serialize(item))
            elif inspect.isawaitable(result):  # writes with context.write
                await result
            else:  # a plain iterator
                for item in result:
                    await stream.send(serialize(item))
        else:
            response = await result if inspect.isawaitable(result) else result
            if response is not None and context.code in (None, grpc.StatusCode.OK):
                await stream.send(serialize(response))

    async def stop(self, grace: float | None) -> None:
        """Take no new calls (GOAWAY to every client); with ``grace`` the open calls have
        that long to finish, then every call left is cancelled and connections closed."""
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.go_away()
        if grace and self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        calls = set(self._calls)
        for conn in list(self.connections):
            conn.abort()
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls, timeout=1.0)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=1.0)
        for sock, _ in self._sockets:
            sock.close()
        self._stopped.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout)
        except TimeoutError:
            return False
        return True
