"""EngineRunner races between the event loop and the engine thread."""

from __future__ import annotations

import numpy as np
from svc_harness import running_worker

from worker.engine.types import EngineRequest, FinishReason, SamplingParams


def engine_request(request_id: str, max_new_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id, np.arange(1, 33, dtype=np.int64), SamplingParams(max_new_tokens=max_new_tokens)
    )


async def test_reusing_a_released_request_id_gets_only_the_new_requests_outputs() -> None:
    # A caller that gives up on a request and resends it under the same id at once: the
    # abort of the old one (and any output of it already on its way) must not reach the new
    # stream, which would otherwise end with ABORT while the new request runs on unread.
    async with running_worker() as w:
        runner = w.server.runner
        old = await runner.submit(engine_request("again", 400))
        runner.release(old)
        new = await runner.submit(engine_request("again", 5))
        outs = [await new.get()]
        for _ in range(10):  # bounded: 5 tokens come in at most 5 outputs
            if outs[-1].finish_reason is not None:
                break
            outs.append(await new.get())
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.new_token_ids) for o in outs) == 5
        assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 5
        await w.assert_no_leak()
