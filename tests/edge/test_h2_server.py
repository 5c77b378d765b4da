"""The h2 gRPC server (edge/h2_server.py) against grpc's own client, on 127.0.0.1 port 0.

A small service of generic handlers (bytes in, bytes out) exercises what the router's
services rely on: metadata both ways, streamed answers past the flow-control window and
the frame size, statuses with any text, deadlines, a client's cancel, limits, interceptors,
shutdown; a raw HTTP/2 client checks the answers to requests that are not gRPC.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import socket
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge import h2_server
from edge.h2_server import H2GrpcServer

SERVICE = "test.v1.Echo"
SEEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("SEEN", default=None)


class Echo:
    """The methods; what happened to them, for the tests to read."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()  # a streaming method's generator was closed
        self.cancelled = asyncio.Event()  # a method saw its task cancelled
        self.release = asyncio.Event()
        self.metadata: tuple[tuple[str, Any], ...] = ()
        self.peer = ""
        self.tenant: str | None = None

    async def unary(self, request: bytes, context: Any) -> bytes:
        self.metadata = tuple(context.invocation_metadata())
        self.peer = context.peer()
        self.tenant = SEEN.get()
        if request == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "100% ne\u00efve: no")
        if request == b"raise":
            raise RuntimeError("boom")
        if request == b"remaining":
            return f"{context.time_remaining()}".encode()
        context.set_trailing_metadata((("retry-after-s", "1.500"), ("blob-bin", b"\x00\xff")))
        return request[::-1]

    async def stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        count, _, size = request.partition(b"x")
        try:
            for i in range(int(count)):
                yield i.to_bytes(4, "big") + b"\xab" * int(size or 0)
            if request.endswith(b"x0") and context.time_remaining() is not None:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, "after the messages")
        finally:
            self.closed.set()

    async def hang(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.closed.set()

    async def slow(self, request: bytes, context: Any) -> bytes:
        await self.release.wait()
        return b"done"

    async def watch(self, request: bytes, context: Any) -> None:
        for i in range(3):
            await context.write(bytes([i]))

    async def chat(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request.upper()


def _handlers(echo: Echo) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "Unary": grpc.unary_unary_rpc_method_handler(echo.unary),
        "Stream": grpc.unary_stream_rpc_method_handler(echo.stream),
        "Hang": grpc.unary_stream_rpc_method_handler(echo.hang),
        "Slow": grpc.unary_unary_rpc_method_handler(echo.slow),
        "Watch": grpc.unary_stream_rpc_method_handler(echo.watch),
        "Chat": grpc.stream_stream_rpc_method_handler(echo.chat),
    }


class TenantInterceptor(grpc.aio.ServerInterceptor):
    """Sets a context variable from the metadata, as the auth interceptor does."""

    def __init__(self, order: list[str], name: str) -> None:
        self.order, self.name = order, name

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.order.append(self.name)
        for key, value in details.invocation_metadata:
            if key == "x-tenant":
                SEEN.set(value)
        return await continuation(details)


async def _serve(echo: Echo, **kwargs: Any) -> tuple[H2GrpcServer, str]:
    server = H2GrpcServer(**kwargs)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, _handlers(echo)),)
    )
    port = server.add_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def served() -> AsyncIterator[tuple[Echo, H2GrpcServer, grpc.aio.Channel]]:
    echo = Echo()
    server, address = await _serve(echo, max_receive_message_bytes=1 << 20)
    channel = grpc.aio.insecure_channel(address)
    try:
        yield echo, server, channel
    finally:
        await channel.close()
        await server.stop(None)


def _unary(channel: grpc.aio.Channel, name: str = "Unary") -> Any:
    return channel.unary_unary(f"/{SERVICE}/{name}")


def _stream(channel: grpc.aio.Channel, name: str = "Stream") -> Any:
    return channel.unary_stream(f"/{SERVICE}/{name}")


async def test_unary_metadata_both_ways(served: Any) -> None:
    echo, _, channel = served
    call = _unary(channel)(
        b"hello", metadata=(("x-tenant", "acme"), ("trace-bin", b"\x01\x02\x03")), timeout=10
    )
    assert await call == b"olleh"
    assert await call.code() == grpc.StatusCode.OK
    trailing = dict(await call.trailing_metadata())
    assert trailing["retry-after-s"] == "1.500"
    assert trailing["blob-bin"] == b"\x00\xff"
    seen = dict(echo.metadata)
    assert seen["x-tenant"] == "acme"
    assert seen["trace-bin"] == b"\x01\x02\x03"
    assert "grpc-timeout" not in seen and "content-type" not in seen
    assert echo.peer.startswith("ipv4:127.0.0.1:")


async def test_streamed_messages_in_order_past_the_window_and_frame_size(served: Any) -> None:
    _, _, channel = served
    # 300 messages of 40 KiB: 12 MB, far past the client's initial windows and 16 KiB frames
    got = [m async for m in _stream(channel)(b"300x40960", timeout=30)]
    assert [int.from_bytes(m[:4], "big") for m in got] == list(range(300))
    assert all(len(m) == 4 + 40960 and m[4:] == b"\xab" * 40960 for m in got)


async def test_one_message_larger_than_the_window(served: Any) -> None:
    _, _, channel = served
    got = [m async for m in _stream(channel)(b"1x3000000", timeout=30)]
    assert len(got) == 1 and len(got[0]) == 3_000_004


async def test_status_text_survives_percent_encoding(served: Any) -> None:
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(channel)(b"abort", timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "100% ne\u00efve: no"


async def test_status_after_messages(served: Any) -> None:
    _, _, channel = served
    call = _stream(channel)(b"3x0", timeout=10)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for message in call:
            got.append(message)
    assert len(got) == 3
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert err.value.details() == "after the messages"


async def test_a_failing_method_is_unknown_and_the_connection_goes_on(served: Any) -> None:
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(channel)(b"raise", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "RuntimeError: boom" in (err.value.details() or "")
    assert await _unary(channel)(b"ab", timeout=10) == b"ba"


async def test_unknown_method_is_unimplemented(served: Any) -> None:
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary("/test.v1.Echo/Nope")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_message_over_the_limit_is_resource_exhausted(served: Any) -> None:
    _, server, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(channel)(b"x" * ((1 << 20) + 1), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {1 << 20}" in (err.value.details() or "")
    assert await _unary(channel)(b"x" * (1 << 20), timeout=10) == b"x" * (1 << 20)
    await _until(lambda: not server._calls)


async def test_compressed_message_is_refused(served: Any) -> None:
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(channel)(b"hello" * 100, timeout=10, compression=grpc.Compression.Gzip)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "uncompressed" in (err.value.details() or "")


async def test_deadline_cancels_the_method(served: Any) -> None:
    echo, server, channel = served
    call = _stream(channel, "Hang")(b"", timeout=0.5)
    assert await call.read() == b"first"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(echo.cancelled.wait(), 5)
    await _until(lambda: not server._calls)


async def test_time_remaining_is_the_clients_deadline(served: Any) -> None:
    _, _, channel = served
    remaining = float(await _unary(channel)(b"remaining", timeout=30))
    assert 25 < remaining <= 31  # the client rounds its grpc-timeout header up
    assert await _unary(channel)(b"remaining") == b"None"


async def test_client_cancel_closes_the_method(served: Any) -> None:
    echo, server, channel = served
    call = _stream(channel, "Hang")(b"", timeout=30)
    assert await call.read() == b"first"
    call.cancel()
    await asyncio.wait_for(echo.closed.wait(), 5)
    assert echo.cancelled.is_set()
    await _until(lambda: not server._calls)
    assert await _unary(channel)(b"ok", timeout=10) == b"ko"  # the connection goes on


async def test_a_method_that_writes(served: Any) -> None:
    _, _, channel = served
    assert [m async for m in _stream(channel, "Watch")(b"", timeout=10)] == [
        b"\x00",
        b"\x01",
        b"\x02",
    ]


async def test_bidirectional_stream(served: Any) -> None:
    _, _, channel = served
    call = channel.stream_stream(f"/{SERVICE}/Chat")(timeout=10)
    for word in (b"a", b"bc", b"def"):
        await call.write(word)
        assert await call.read() == word.upper()
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_many_concurrent_streams_on_one_channel(served: Any) -> None:
    _, server, channel = served

    async def one(i: int) -> int:
        return len([m async for m in _stream(channel)(b"20x100", timeout=30)])

    assert await asyncio.gather(*(one(i) for i in range(300))) == [20] * 300
    await _until(lambda: not server._calls)


async def test_interceptors_run_in_order_and_reach_the_method() -> None:
    echo, order = Echo(), []
    interceptors = [TenantInterceptor(order, "first"), TenantInterceptor(order, "second")]
    server, address = await _serve(echo, interceptors=interceptors)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await _unary(channel)(b"x", metadata=(("x-tenant", "t1"),), timeout=10)
        assert order == ["first", "second"]
        assert echo.tenant == "t1"  # a context variable the interceptor set
    finally:
        await server.stop(None)


async def test_stop_lets_calls_finish_in_the_grace_and_refuses_new_ones() -> None:
    echo = Echo()
    server, address = await _serve(echo)
    async with grpc.aio.insecure_channel(address) as channel:
        slow = asyncio.ensure_future(_unary(channel, "Slow")(b"", timeout=10))
        await _until(lambda: bool(server._calls))
        stopping = asyncio.ensure_future(server.stop(5.0))
        await asyncio.sleep(0.1)
        assert not stopping.done()
        echo.release.set()
        assert await slow == b"done"
        await asyncio.wait_for(stopping, 5)
        assert await server.wait_for_termination(timeout=1)
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _unary(channel)(b"x", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_stop_after_the_grace_cancels_what_is_left() -> None:
    echo = Echo()
    server, address = await _serve(echo)
    async with grpc.aio.insecure_channel(address) as channel:
        call = _stream(channel, "Hang")(b"", timeout=30)
        assert await call.read() == b"first"
        await asyncio.wait_for(server.stop(0.2), 5)
        await asyncio.wait_for(echo.closed.wait(), 5)
        assert not server._calls
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()


async def test_a_taken_port_says_so() -> None:
    echo = Echo()
    server, address = await _serve(echo)
    try:
        second = H2GrpcServer()
        with pytest.raises(OSError, match=r"could not bind .*is another kvroute"):
            second.add_port(address)
    finally:
        await server.stop(None)


async def _raw_h2(address: str, headers: list[tuple[str, str]]) -> dict[bytes, bytes]:
    """One request by a bare HTTP/2 client; the answer's headers."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, headers, end_stream=True)
    writer.write(conn.data_to_send())
    answer: dict[bytes, bytes] = {}
    try:
        while not answer:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "the server closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    answer = dict(event.headers)
            writer.write(conn.data_to_send())
    finally:
        writer.close()
    return answer


async def test_requests_that_are_not_grpc_get_http_errors(served: Any) -> None:
    _, server, _ = served
    address = f"127.0.0.1:{server._sockets[0][0].getsockname()[1]}"
    base = [(":scheme", "http"), (":authority", address), (":path", f"/{SERVICE}/Unary")]
    get = await _raw_h2(address, [(":method", "GET"), *base])
    assert get[b":status"] == b"405"
    text = await _raw_h2(address, [(":method", "POST"), *base, ("content-type", "text/plain")])
    assert text[b":status"] == b"415"


async def test_garbage_closes_that_connection_only(served: Any) -> None:
    _, server, channel = served
    port = server._sockets[0][0].getsockname()[1]
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        sock.setblocking(False)
        rest = b""
        while True:  # the server answers with its settings and a GOAWAY, then closes
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            if not chunk:
                break
            rest += chunk
    assert rest  # it said something before closing
    assert await _unary(channel)(b"still", timeout=10) == b"llits"


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_a_connection_cannot_pile_up_request_bytes(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server, channel = served
    monkeypatch.setattr(h2_server, "MAX_CONNECTION_PENDING_BYTES", 100_000)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(channel)(b"y" * 500_000, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 100000 bytes" in (err.value.details() or "")
    assert await _unary(channel)(b"small", timeout=10) == b"llams"
    assert [conn.pending for conn in server.connections] == [0]


async def test_no_header_reaches_a_debug_log(served: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, _, channel = served
    secret = "sk-never-in-a-log-7f3a"
    with caplog.at_level(logging.DEBUG):  # the root logger, as `--log-level DEBUG` sets it
        call = _unary(channel)(b"x", metadata=(("authorization", f"Bearer {secret}"),))
        assert await call == b"x"
    assert caplog.records  # grpc's and asyncio's debug lines were captured
    assert not [r for r in caplog.records if secret in r.getMessage()]


async def test_a_malformed_timeout_is_invalid_argument(served: Any) -> None:
    _, server, _ = served
    address = f"127.0.0.1:{server._sockets[0][0].getsockname()[1]}"
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", address),
        (":path", f"/{SERVICE}/Unary"),
        ("content-type", "application/grpc"),
        ("grpc-timeout", "soon"),
    ]
    answer = await _raw_h2(address, headers)
    assert answer[b":status"] == b"200"
    assert answer[b"grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0]).encode()
    assert b"grpc-timeout" in answer[b"grpc-message"]


class _FakeConn:
    """What a stream asks of its connection when it receives (the pending count)."""

    pending = 0
    peer = "ipv4:127.0.0.1:1"


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_request_framing_survives_any_chunking(messages: list[bytes], cuts: list[int]) -> None:
    """Length-prefixed messages cut into DATA chunks anywhere come out whole and in order,
    and the connection's pending count is what was received and not taken."""
    wire = b"".join(b"\x00" + len(m).to_bytes(4, "big") + m for m in messages)
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    conn = _FakeConn()
    stream = h2_server._Stream(conn, 1, None)  # type: ignore[arg-type]
    for lo, hi in itertools.pairwise(bounds):
        assert stream.receive(wire[lo:hi], limit=1 << 20) is None
        stream.count()
        assert conn.pending == len(stream._buffer) + sum(map(len, stream._messages))
    assert list(stream._messages) == messages
    assert conn.pending == sum(map(len, messages))
    stream.release()
    assert conn.pending == 0


@given(st.integers(min_value=0, max_value=2000), st.integers(min_value=2001, max_value=1 << 24))
def test_a_message_over_the_limit_is_refused_from_its_prefix(limit: int, size: int) -> None:
    stream = h2_server._Stream(_FakeConn(), 1, None)  # type: ignore[arg-type]
    refusal = stream.receive(b"\x00" + size.to_bytes(4, "big") + b"x", limit=limit)
    assert refusal == f"Received message larger than max ({size} vs. {limit})"


@given(st.text(max_size=200))
@example("50%2F of it, 100% sure")  # a '%' left as is would decode as '/'
def test_status_text_percent_encoding_round_trips(text: str) -> None:
    encoded = h2_server._percent_encode(text)
    assert all(0x20 <= b <= 0x7E for b in encoded)  # a valid header value
    assert urllib.parse.unquote(encoded.decode("ascii"), errors="replace") == text.encode(
        "utf-8", "replace"
    ).decode("utf-8", "replace")


@given(st.integers(min_value=0, max_value=99_999_999), st.sampled_from("HMSmun"))
def test_grpc_timeout_values(value: int, unit: str) -> None:
    scale = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}[unit]
    assert h2_server._parse_timeout(f"{value}{unit}".encode()) == value * scale
    assert h2_server._parse_timeout(f"{value}x".encode()) is None
    assert h2_server._parse_timeout(b"123456789S") is None  # more than 8 digits
