"""router.service.redis_wire: the RESP2 parser against a reference encoder (any split of the bytes),
its limits, the URL and option handling, and a connection to the real Redis at
127.0.0.1:6379 (commands, error replies, a subscription's pushes, a lost connection)."""

from __future__ import annotations

import asyncio
import ssl
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.service.redis_wire import (
    MAX_DEPTH,
    RedisTarget,
    RespConnection,
    RespError,
    RespParser,
    RespProtocolError,
    encode_command,
)

# ---- the parser against a reference encoder --------------------------------------------


def _encode(value: Any) -> bytes:
    """The reference: RESP2 as the protocol's specification writes each type."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, RespError):
        return b"-" + str(value).encode() + b"\r\n"
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, tuple):  # a simple string, marked so the strategy can tell
        return b"+" + value[0] + b"\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    return b"*%d\r\n" % len(value) + b"".join(_encode(v) for v in value)


def _expected(value: Any) -> Any:
    if isinstance(value, tuple):
        return value[0]
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return value


line_text = st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)
scalars = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(max_size=64),
    st.tuples(line_text),
    line_text.map(lambda b: RespError(b.decode("latin-1"))),
)


def _nested(levels: int) -> st.SearchStrategy[Any]:
    """Scalars and arrays of at most ``levels`` levels (the parser's MAX_DEPTH)."""
    if levels == 0:
        return scalars
    return st.one_of(scalars, st.lists(_nested(levels - 1), max_size=4))


values = _nested(MAX_DEPTH)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, RespError):
        return isinstance(got, RespError) and str(got) == str(want)
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=6), st.data())
def test_any_split_of_the_bytes_parses_to_the_same_values(batch, data):
    wire = b"".join(_encode(v) for v in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    parser = RespParser()
    got: list[Any] = []
    last = 0
    for cut in [*cuts, len(wire)]:
        got.extend(parser.feed(wire[last:cut]))
        last = cut
    want = [_expected(v) for v in batch]
    assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    assert parser.feed(b"") == []  # nothing left over


def test_a_command_is_an_array_of_bulk_strings():
    assert encode_command("PUBLISH", "ch", b"a\r\nb", 7) == (
        b"*4\r\n$7\r\nPUBLISH\r\n$2\r\nch\r\n$4\r\na\r\nb\r\n$1\r\n7\r\n"
    )
    assert RespParser().feed(encode_command("SET", b"k", 1)) == [[b"SET", b"k", b"1"]]


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"?what\r\n", "unknown RESP type byte"),
        (b"$abc\r\n", "bulk length b'abc' is not an integer"),
        (b"$999999999999\r\n", "bulk string of 999999999999 bytes, limit"),
        (b"*2\r\n" * (MAX_DEPTH + 1), f"arrays nested deeper than {MAX_DEPTH}"),
        (b"+" + b"x" * (65 * 1024), "a RESP header line is over 64 KiB"),
    ],
)
def test_bytes_that_are_not_resp_are_refused_naming_what(wire, message):
    with pytest.raises(RespProtocolError, match=message):
        RespParser().feed(wire)


# ---- addresses and options ---------------------------------------------------------------


def test_urls_and_options_as_redis_py_takes_them():
    t = RedisTarget.from_url("redis://db.example:6380/3", {"username": "u", "password": "p"})
    assert (t.host, t.port, t.path, t.tls) == ("db.example", 6380, None, None)
    assert (t.username, t.password) == ("u", "p")
    # the URL's own user wins over the keywords (as in redis-py)
    t = RedisTarget.from_url("redis://me:secret@127.0.0.1/0", {"username": "u", "password": "p"})
    assert (t.username, t.password, t.port) == ("me", "secret", 6379)
    assert RedisTarget.from_url("unix:///run/redis.sock").path == "/run/redis.sock"
    tls = RedisTarget.from_url("rediss://127.0.0.1:6390/0", {"ssl_cert_reqs": "required"}).tls
    assert tls is not None and tls.verify_mode == ssl.CERT_REQUIRED and tls.check_hostname
    off = RedisTarget.from_url("rediss://h/0?ssl_cert_reqs=none").tls
    assert off is not None and off.verify_mode == ssl.CERT_NONE and not off.check_hostname


def test_what_the_sync_cannot_use_is_refused_naming_it():
    with pytest.raises(ValueError, match="must start with redis://, rediss:// or unix://"):
        RedisTarget.from_url("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match=r"not supported here: \['ssl_ca_data'\]"):
        RedisTarget.from_url("rediss://h/0", {"ssl_ca_data": "x"})
    with pytest.raises(ValueError, match="TLS options need a rediss:// URL"):
        RedisTarget.from_url("redis://h/0", {"ssl_ca_certs": "/ca.pem"})
    with pytest.raises(ValueError, match="ssl_cert_reqs must be one of"):
        RedisTarget.from_url("rediss://h/0", {"ssl_cert_reqs": "maybe"})


# ---- a connection to the real Redis ------------------------------------------------------


async def test_commands_replies_and_error_replies(redis_url):
    conn = await RespConnection.open(RedisTarget.from_url(redis_url), name="kvroute-test")
    try:
        assert await conn.call("PING") == b"PONG"
        assert await conn.call("ECHO", b"a\r\nb") == b"a\r\nb"
        with pytest.raises(RespError, match="unknown command"):
            await conn.call("NO-SUCH-COMMAND")
        assert await conn.call("PING") == b"PONG"  # replies stay matched after an error
        replies: list[Any] = []
        for i in range(3):  # sent without waiting: replies come back in order
            conn.send("ECHO", i, on_reply=replies.append)
        assert await conn.call("CLIENT", "GETNAME") == b"kvroute-test"
        assert replies == [b"0", b"1", b"2"]
    finally:
        conn.close()
    await asyncio.wait_for(conn.closed, 5)
    with pytest.raises(ConnectionError, match="closed"):
        conn.send("PING")


async def test_a_subscription_hands_each_message_over_in_order(redis_url):
    channel = f"kvroute-test-{uuid.uuid4().hex[:8]}"
    got: list[tuple[bytes, bytes]] = []
    target = RedisTarget.from_url(redis_url)
    sub = await RespConnection.open(target, on_message=lambda ch, data: got.append((ch, data)))
    pub = await RespConnection.open(target)
    try:
        assert await sub.call("SUBSCRIBE", channel) == [b"subscribe", channel.encode(), 1]
        counts: list[Any] = []
        for i in range(50):
            pub.send("PUBLISH", channel, b"m%d" % i, on_reply=counts.append)
        async with asyncio.timeout(5):
            while len(got) < 50:
                await asyncio.sleep(0.01)
        assert got == [(channel.encode(), b"m%d" % i) for i in range(50)]
        assert counts == [1] * 50  # one subscriber heard each
    finally:
        sub.close()
        pub.close()


async def test_replies_still_owed_when_redis_drops_the_connection_are_failed_not_lost(
    redis_url,
):
    target = RedisTarget.from_url(redis_url)
    conn = await RespConnection.open(target)
    killer = await RespConnection.open(target)
    try:
        conn_id = await conn.call("CLIENT", "ID")
        owed: list[Any] = []
        # blocks in Redis for 5 s: its reply is owed when the connection is killed
        conn.send("BLPOP", f"kvroute-test-{uuid.uuid4().hex}", 5, on_reply=owed.append)
        await asyncio.sleep(0.05)
        assert await killer.call("CLIENT", "KILL", "ID", conn_id) == 1
        await asyncio.wait_for(conn.closed, 5)
        assert len(owed) == 1 and isinstance(owed[0], ConnectionError), owed
        assert not conn.is_open and not conn.can_send_now()
    finally:
        conn.close()
        killer.close()


async def test_nothing_listening_is_an_os_error_within_the_timeout():
    with pytest.raises(OSError):
        await RespConnection.open(RedisTarget.from_url("redis://127.0.0.1:1/0"))
