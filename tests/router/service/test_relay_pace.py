"""The relay stream's pace (decision 0043): the next batch is read once the requests the last
one woke from idle have passed their messages on; a request still writing when its messages
arrive is not waited for (they merge), and one that never comes back is waited for at most
``PACE_BOUND_S``, once (never again for that request)."""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto import kvroute_pb2 as pb
from router.service import relay_mux
from router.service.relay_mux import Inbox, Pace, RelayMux


def chunk(rid: str, token: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, chunk=pb.TokenChunk(token_ids=[token]))


async def idle_reader(inbox: Inbox) -> asyncio.Task[list]:
    """A task waiting in ``inbox.take()`` (run until it waits)."""
    task = asyncio.create_task(inbox.take())
    await asyncio.sleep(0)
    return task


async def test_drain_waits_for_the_readers_a_batch_woke_until_they_come_back():
    pace = Pace()
    a, b = Inbox(pace), Inbox(pace)
    ta, tb = await idle_reader(a), await idle_reader(b)
    a.push(chunk("a", 1))
    b.push(chunk("b", 1))
    assert pace.owed == {a, b}
    drain = asyncio.create_task(pace.drain())
    assert [m.chunk.token_ids[0] for m in await ta] == [1]  # taken, being written
    await asyncio.sleep(0)
    assert not drain.done()
    next_a = await idle_reader(a)  # a's write done: back for more
    assert pace.owed == {b} and not drain.done()
    b.settle()  # b ended (its Finished relayed, or cancelled)
    await asyncio.wait_for(drain, 1.0)
    assert not pace.owed
    await tb
    next_a.cancel()


async def test_a_reader_still_writing_is_not_waited_for():
    pace = Pace()
    inbox = Inbox(pace)
    inbox.push(chunk("r", 1))  # nobody waiting: the reader is busy with its last message
    inbox.push(chunk("r", 2))
    assert not pace.owed
    await asyncio.wait_for(pace.drain(), 1.0)  # nothing owed: at once
    assert [m.chunk.token_ids[0] for m in await inbox.take()] == [1, 2]


async def test_a_reader_that_never_comes_back_is_waited_for_once(monkeypatch):
    monkeypatch.setattr(relay_mux, "PACE_BOUND_S", 0.0)
    pace = Pace()
    stuck = Inbox(pace)
    reader = await idle_reader(stuck)
    stuck.push(chunk("s", 1))
    await reader  # took it, and its write never completes
    assert pace.owed == {stuck}
    await asyncio.wait_for(pace.drain(), 1.0)
    assert not pace.owed
    stuck.push(chunk("s", 2))  # not idle: merges, not owed again
    assert not pace.owed
    again = await idle_reader(stuck)  # its write done at last, idle again
    assert [m.chunk.token_ids[0] for m in await again] == [2]
    waiting = await idle_reader(stuck)
    stuck.push(chunk("s", 3))  # woken from idle, but a slow reader once: not owed
    assert not pace.owed
    await waiting


async def test_the_mux_reads_on_once_its_requests_passed_their_messages_on():
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        mux = RelayMux(channel, "test")
        calls = [mux.start(pb.GenerateRequest(request_id=r), 30.0, (), 2) for r in "ab"]
        streams = [aiter(call) for call in calls]
        first = [asyncio.create_task(anext(s)) for s in streams]
        await asyncio.sleep(0)
        mux._take(pb.RelayBatch(responses=[chunk("a", 1), chunk("b", 1)]))
        assert mux.pace.owed == {c.inbox for c in calls}
        assert [t.chunk.token_ids[0] for t in await asyncio.gather(*first)] == [1, 1]
        drain = asyncio.create_task(mux.pace.drain())
        second = [asyncio.create_task(anext(s)) for s in streams]  # both written: back
        await asyncio.wait_for(drain, 1.0)
        mux._take(
            pb.RelayBatch(
                responses=[chunk("a", 2), chunk("b", 2)],
                ends=[pb.RelayEnd(request_id="a"), pb.RelayEnd(request_id="b")],
            )
        )
        assert [t.chunk.token_ids[0] for t in await asyncio.gather(*second)] == [2, 2]
        for s in streams:
            assert [m async for m in s] == []  # ended without a Finished
        assert not mux.pace.owed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("push take settle")), max_size=40))
def test_drain_always_ends_and_owes_only_idle_readers(ops):
    """Whatever the order of pushes, takes and ends, a drain ends (at once when nobody is
    owed) and only a reader that was waiting when its message came is owed."""

    async def run() -> None:
        pace = Pace()
        inboxes = [Inbox(pace) for _ in range(4)]
        readers: dict[int, asyncio.Task[list]] = {}
        for i, op in ops:
            inbox = inboxes[i]
            if op == "push":
                was_idle = i in readers and not readers[i].done()
                inbox.push(chunk(str(i), 1))
                assert (inbox in pace.owed) or not was_idle
            elif op == "take" and (i not in readers or readers[i].done()):
                readers[i] = await idle_reader(inbox)
            elif op == "settle":
                inbox.settle()
                assert inbox not in pace.owed
            await asyncio.sleep(0)
        for task in readers.values():
            task.cancel()
        await asyncio.wait_for(pace.drain(), 1.0)
        assert not pace.owed

    asyncio.run(run())
