"""Unit tests of RequestStream: in-order outputs, merged when the reader lags."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from worker.engine.types import EngineRequest, FinishReason, RequestOutput, Usage
from worker.service.engine_runner import EngineStoppedError, RequestStream


def make() -> RequestStream:
    return RequestStream(EngineRequest("r", np.array([1, 2, 3])))


async def test_a_lagging_reader_gets_one_merged_output() -> None:
    stream = make()
    usage = Usage(3, 0, 3)
    stream.put(RequestOutput("r", (7,)))
    stream.put(RequestOutput("r", (8,)))
    stream.put(RequestOutput("r", (9,), FinishReason.LENGTH, usage))
    assert await stream.get() == RequestOutput("r", (7, 8, 9), FinishReason.LENGTH, usage)
    assert (stream.num_prompt, stream.num_generated) == (3, 3)


async def test_a_waiting_reader_gets_each_output() -> None:
    stream = make()
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0)  # let it block on the empty stream
    stream.put(RequestOutput("r", (7,)))
    assert await waiter == RequestOutput("r", (7,))


async def test_outputs_before_a_failure_come_first() -> None:
    stream = make()
    stream.put(RequestOutput("r", (7,)))
    stream.put(EngineStoppedError("gone"))
    assert await stream.get() == RequestOutput("r", (7,))
    with pytest.raises(EngineStoppedError, match="gone"):
        await stream.get()


def test_a_diverted_stream_hands_the_unread_outputs_then_each_new_one_to_its_sink() -> None:
    stream = make()
    stream.put(RequestOutput("r", (7,)))
    got: list[object] = []
    stream.divert(got.append)
    assert got == [RequestOutput("r", (7,))]  # what was not read yet, first
    stream.put(RequestOutput("r", (8,)))
    failure = EngineStoppedError("gone")
    stream.put(failure)
    assert got == [RequestOutput("r", (7,)), RequestOutput("r", (8,)), failure]
    assert stream.num_generated == 2
