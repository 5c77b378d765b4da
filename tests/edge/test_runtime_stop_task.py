"""stop_task: a background loop ends even when one cancel is swallowed on the way."""

from __future__ import annotations

import asyncio

import pytest

from edge.runtime import stop_task


async def _swallowing_loop(iterations: list[int], swallow: int, where: list[str]) -> None:
    """A ``while True`` loop whose 'client call' swallows the first ``swallow`` cancels, as
    redis-py's asyncio client can when a cancel lands inside a command."""
    swallowed = 0
    while True:
        iterations[0] += 1
        where[0] = "call"
        try:
            await asyncio.sleep(0.001)  # the client call
        except asyncio.CancelledError:
            if swallowed >= swallow:
                raise
            swallowed += 1  # ... returns as if the call had completed
        where[0] = "wait"
        await asyncio.sleep(0.002)  # the loop's own wait: a cancel here ends it


async def test_one_cancel_swallowed_one_cancel_is_not_enough():
    iterations, where = [0], [""]
    task = asyncio.create_task(_swallowing_loop(iterations, 1, where))
    await asyncio.sleep(0.005)
    # what the old stop did: cancel once and wait -- the loop goes on
    for _ in range(10_000):  # land the cancel inside the 'client call'
        await asyncio.sleep(0)
        if where[0] == "call":
            break
    assert where[0] == "call"
    task.cancel()
    done, _ = await asyncio.wait((task,), timeout=0.2)
    assert not done and iterations[0] > 3  # still looping after the cancel
    assert await stop_task(task, timeout_s=2.0)
    assert task.cancelled()


async def test_stop_task_ends_a_loop_that_swallows_several_cancels():
    iterations, where = [0], [""]
    task = asyncio.create_task(_swallowing_loop(iterations, 3, where))
    await asyncio.sleep(0.01)
    assert await stop_task(task, timeout_s=2.0)
    assert task.done()


async def test_stop_task_gives_up_on_a_task_that_never_ends():
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                continue  # swallows every cancel

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0.005)
    assert not await stop_task(task, timeout_s=0.2)  # bounded: it returns, the task runs on
    assert not task.done()
    release.set()  # end it for the test's sake
    await asyncio.wait_for(task, 1.0)


async def test_stop_task_reports_a_task_that_had_failed():
    async def broken() -> None:
        raise ValueError("the loop's own bug")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="own bug"):
        await stop_task(task)


async def test_stop_task_on_a_finished_task_returns_at_once():
    task = asyncio.create_task(asyncio.sleep(0))
    await task
    assert await stop_task(task, timeout_s=0.0)
