"""Process runtime shared by the worker and router commands: the event loop they run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows: uvloop is not a dependency there
        return asyncio.run(coro)
    return uvloop.run(coro)
