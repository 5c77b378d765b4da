"""The bridge's own connections to its engine (worker/bridge/service/engine_stream.py),
against scripted HTTP servers on 127.0.0.1 port 0: keep-alive reuse, an idle connection the
engine closed, an answer that breaks off, reading paused while lines pile up, and close()
before the end closing the connection (the engine's abort)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from worker.bridge.service import engine_stream
from worker.bridge.service.engine_stream import EnginePool, EngineStreamError

WAIT_S = 10.0
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def sse(*events: bytes, end: bool = True) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\ndata: %s\n\n\r\n" % (len(e) + 8, e) for e in events)
    return head + body + (b"0\r\n\r\n" if end else b"")


async def read_request(reader: asyncio.StreamReader) -> dict | None:
    """One request's JSON body (None when the client closed the connection)."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return json.loads(await reader.readexactly(length))


class Server:
    """Runs ``handler(reader, writer, n)`` for each connection (n: 0, 1, ...)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.bodies: list[dict] = []
        self.closed_by_client = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = self.num_connections
        self.num_connections += 1
        try:
            await self.handler(reader, writer, n)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Server, EnginePool]]:
    server = Server(handler)
    srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = EnginePool(f"http://127.0.0.1:{port}/prefix")
    try:
        async with asyncio.timeout(WAIT_S):
            yield server, pool
    finally:
        pool.close()
        srv.close()
        await srv.wait_closed()


async def lines_of(pool: EnginePool, body: dict) -> list[bytes]:
    resp = await pool.open("/v1/completions", body)
    try:
        return [line async for line in resp.lines()]
    finally:
        resp.close()


async def test_requests_one_after_another_share_one_connection():
    async def answer(reader, writer, n):
        while (body := await read_request(reader)) is not None:
            writer.write(sse(b'{"n": %d}' % body["n"], b"[DONE]"))

    async with serving(answer) as (server, pool):
        for i in range(4):
            assert await lines_of(pool, {"n": i}) == [
                b'data: {"n": %d}' % i,
                b"",
                b"data: [DONE]",
                b"",
            ]
        assert pool.num_connects == 1 and server.num_connections == 1


async def test_the_request_goes_out_as_json_to_the_path_under_the_base_url():
    seen: list[bytes] = []

    async def answer(reader, writer, n):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        seen.append(await reader.readexactly(length))
        writer.write(sse(b"[DONE]"))
        await reader.read()

    async with serving(answer) as (_server, pool):
        await lines_of(pool, {"prompt": [1, 2], "stream": True})
        head, body = seen
        assert head.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
        assert b"\r\nContent-Type: application/json\r\n" in head
        assert json.loads(body) == {"prompt": [1, 2], "stream": True}


async def test_an_idle_connection_the_engine_closed_is_not_used_again():
    async def one_each(reader, writer, n):
        await read_request(reader)
        writer.write(sse(b"[DONE]"))
        await writer.drain()  # then closes: as a keep-alive timeout does

    async with serving(one_each) as (server, pool):
        await lines_of(pool, {})
        await asyncio.sleep(0.05)  # the close reaches the idle connection
        assert await lines_of(pool, {}) == [b"data: [DONE]", b""]
        assert pool.num_connects == 2 and server.num_connections == 2


async def test_a_request_on_an_idle_connection_closed_without_an_answer_goes_on_a_new_one():
    async def drop_second(reader, writer, n):
        while (body := await read_request(reader)) is not None:
            if body["n"] == 1 and n == 0:
                return  # closes as the request arrives: no byte of answer
            writer.write(sse(b"ok %d" % body["n"]))

    async with serving(drop_second) as (server, pool):
        assert await lines_of(pool, {"n": 0}) == [b"data: ok 0", b""]
        assert await lines_of(pool, {"n": 1}) == [b"data: ok 1", b""]  # sent once more
        assert pool.num_connects == 2 and server.num_connections == 2


async def test_a_new_connection_closed_without_an_answer_is_an_error():
    async def drop(reader, writer, n):
        await read_request(reader)

    async with serving(drop) as (server, pool):
        with pytest.raises(EngineStreamError, match="before answering"):
            await pool.open("/v1/completions", {})
        assert server.num_connections == 1  # not sent again


async def test_an_answer_that_breaks_off_is_an_error_and_its_connection_is_not_reused():
    async def cut(reader, writer, n):
        await read_request(reader)
        writer.write(sse(b"1", b"2", end=False)[:-5])  # half of the last chunk

    async with serving(cut) as (_server, pool):
        resp = await pool.open("/v1/completions", {})
        got = []
        with pytest.raises(EngineStreamError, match="before the end of its answer"):
            async for line in resp.lines():
                got.append(line)
        assert got == [b"data: 1", b""]
        resp.close()
        assert pool._take_idle() is None


async def test_close_before_the_end_closes_the_connection():
    ended = asyncio.Event()

    async def endless(reader, writer, n):
        await read_request(reader)
        writer.write(sse(end=False))
        try:
            while True:
                writer.write(b"8\r\ndata: x\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        finally:
            ended.set()

    async with serving(endless) as (server, pool):
        resp = await pool.open("/v1/completions", {})
        async for line in resp.lines():
            assert line == b"data: x"
            break
        resp.close()
        await ended.wait()  # the engine saw its client go away
        assert server.closed_by_client == 1 and pool._take_idle() is None


async def test_reading_pauses_while_lines_pile_up_and_every_line_arrives(monkeypatch):
    monkeypatch.setattr(engine_stream, "PAUSE_LINES", 8)
    sent = 2000

    async def flood(reader, writer, n):
        await read_request(reader)
        writer.write(sse(*(b"%d" % i for i in range(sent))))
        await writer.drain()

    async with serving(flood) as (_server, pool):
        resp = await pool.open("/v1/completions", {})
        await asyncio.sleep(0.1)  # the answer arrived while nobody took its lines
        assert resp._conn.paused
        got = [line async for line in resp.lines() if line]
        assert got == [b"data: %d" % i for i in range(sent)]
        assert not resp._conn.paused
        resp.close()
        assert pool._take_idle() is not None  # its end was read: reusable


async def test_an_error_answer_is_read_as_text_and_its_connection_kept():
    async def refuse_first(reader, writer, n):
        first = True
        while await read_request(reader) is not None:
            if first:
                text = b'{"error": {"message": "too long"}}'
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(text))
                writer.write(text)
                first = False
            else:
                writer.write(sse(b"[DONE]"))

    async with serving(refuse_first) as (_server, pool):
        resp = await pool.open("/v1/completions", {})
        assert resp.status == 400
        assert await resp.text(20) == '{"error": {"message"'
        resp.close()
        assert await lines_of(pool, {}) == [b"data: [DONE]", b""]
        assert pool.num_connects == 1
