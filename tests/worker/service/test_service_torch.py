"""One end-to-end check with the real torch executor (the tiny random Llama on CPU)."""

from __future__ import annotations

import pytest
from svc_harness import (
    HeldBlocks,
    WorkerSetup,
    read_item,
    read_until,
    running_worker,
    settle,
    subscribe,
    text_request,
)

from kvroute_proto import kvroute_pb2 as pb
from worker.engine.engine import EngineConfig

pytest.importorskip("torch")


async def test_torch_worker_streams_text_caches_the_prefix_and_announces_it() -> None:
    setup = WorkerSetup(
        engine=EngineConfig(worker_id="w-torch", num_kv_slots=1024, block_size=4),
        executor_kind="torch",
    )
    async with running_worker(setup) as w:
        info = await w.stub.GetLoad(pb.GetLoadRequest())
        assert (info.executor, info.vocab_size) == ("torch", 512)
        call = subscribe(w)
        model = HeldBlocks()
        model.apply(await read_item(call))
        prompt = "You are a helpful assistant. Answer briefly."
        runs = []
        for _ in range(2):
            msgs = await w.generate(text_request(prompt, max_new_tokens=6, ignore_eos=True))
            chunks, fin = msgs[:-1], msgs[-1].finished
            ids = [t for m in chunks for t in m.chunk.token_ids]
            assert len(ids) == fin.usage.completion_tokens == 6
            assert "".join(m.chunk.text for m in chunks) == w.server.servicer.tokenizer.decode(ids)
            runs.append((ids, fin.usage))
        assert runs[0][0] == runs[1][0]  # greedy: the cached prefix changes nothing
        assert runs[0][1].cached_prompt_tokens == 0
        assert runs[1][1].cached_prompt_tokens >= len(prompt) - 4
        last_seq, truth = await settle(w)
        await read_until(call, model, last_seq)
        assert model.blocks == HeldBlocks.of(truth).blocks
        assert len(model.blocks) >= len(prompt) // 4
        await w.assert_no_leak()
        call.cancel()
