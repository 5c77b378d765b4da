"""Process runtime shared by the worker, bridge and router commands: their log format, the
event loop they run on, the signals that stop them, and stopping background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine, Iterator
from typing import Any


def configure_logging(level: str) -> None:
    """Log lines to stderr at ``level``, one format for every kvroute process."""
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGINT or SIGTERM while the block runs (on the running loop); the
    handlers are removed when it ends."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows: uvloop is not a dependency there
        return asyncio.run(coro)
    return uvloop.run(coro)


# how often stop_task repeats a cancel that did not end the task
RECANCEL_S = 0.05


async def stop_task(task: asyncio.Task[Any], *, timeout_s: float = 5.0) -> bool:
    """Cancel ``task`` and wait until it has ended; True when it did within ``timeout_s``.

    One ``cancel()`` is not always enough: a cancel that lands while a client library is
    inside a call can be swallowed there (redis-py's asyncio client can return from a
    command as if nothing happened), and a ``while True`` loop then goes on forever while
    its owner waits for it. So the cancel is repeated every ``RECANCEL_S`` until the task
    ends: the next one lands in the loop's own sleep or wait, where nothing swallows it.
    A task still running after ``timeout_s`` is left (False); the caller logs it.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        task.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        await asyncio.wait((task,), timeout=min(RECANCEL_S, left))
    if not task.cancelled():
        exc = task.exception()  # it ended by itself meanwhile: a failure is the caller's
        if exc is not None:
            raise exc
    return True
