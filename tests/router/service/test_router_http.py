"""The router's OpenAI-compatible HTTP front over its Frontend, driven by the official
``openai`` client: real router and real sim workers in this process, 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import aiohttp
import openai
import pytest
from router_harness import WAIT_S, router_config, running_router, sim_worker

from edge.http_front import HttpFrontConfig

MODEL = "kvroute-tiny"
PROMPT = "You are a helpful support agent for ExampleCorp. Answer briefly. " * 2


@contextlib.asynccontextmanager
async def http_fleet(num_workers: int = 2, *, pace_speedup: float = 0.0):
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(sim_worker(f"w{i}", pace_speedup=pace_speedup))
            for i in range(num_workers)
        ]
        addresses = [w.address for w in workers]
        config = dataclasses.replace(router_config(addresses), http=HttpFrontConfig())
        router = await stack.enter_async_context(running_router(addresses, config))
        await router.wait_synced(num_workers)
        assert router.server.http is not None
        url = f"http://{router.server.http.address}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stack.push_async_callback(client.close)
        yield router, workers, client, url


async def test_openai_completions_streamed_and_not() -> None:
    async with http_fleet() as (_, workers, client, _):
        kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 3}
        raw = await client.completions.with_raw_response.create(**kwargs)
        full = raw.parse()
        assert raw.headers["x-kvroute-worker-id"] in {w.worker_id for w in workers}
        assert full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 8
        assert full.usage.prompt_tokens == len(PROMPT.encode())
        stream = await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8
        # the same prompt again: routed to the worker that caches it, and served from cache
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        finish = chunks[-2]
        assert finish.choices[0].finish_reason == "length"
        assert finish.model_extra["kvroute"]["worker_id"] == raw.headers["x-kvroute-worker-id"]


async def test_openai_chat_streamed_and_not() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Where are my invoices?"},
    ]
    async with http_fleet() as (_, _, client, _):
        kwargs = {"model": MODEL, "messages": messages, "max_tokens": 6, "seed": 5}
        full = await client.chat.completions.create(**kwargs)
        assert full.object == "chat.completion"
        assert full.choices[0].message.role == "assistant"
        assert full.usage.total_tokens == full.usage.prompt_tokens + 6
        stream = await client.chat.completions.create(**kwargs, stream=True)
        chunks = [c async for c in stream]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert content == full.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"


async def test_openai_errors_carry_our_messages() -> None:
    async with http_fleet(1) as (_, _, client, _):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="x", n=17)
        assert "1..16" in bad.value.message
        assert bad.value.body["param"] == "n"
        # n choices through the router: one request each, the usage counts the prompt once
        both = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
        assert [c.index for c in both.choices] == [0, 1]
        assert both.usage.completion_tokens == 8
        assert both.usage.prompt_tokens == len(PROMPT.encode())
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert missing.value.body["code"] == "model_not_found"
        # the router's own bound, said in the API's words (one bound per field)
        with pytest.raises(openai.BadRequestError) as big:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1 << 21)
        assert big.value.body["param"] == "max_tokens" and "1..1048576" in big.value.message
        # a worker's refusal (prompt + max_tokens past its context) names the field too
        with pytest.raises(openai.BadRequestError) as long:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1 << 20)
        assert long.value.body["param"] == "max_tokens", long.value.body
        assert "context length" in long.value.message
        with pytest.raises(openai.BadRequestError) as empty:
            await client.completions.create(model=MODEL, prompt="")
        assert empty.value.body["param"] == "prompt" and "1..4194304" in empty.value.message
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_no_healthy_worker_is_503_and_health_says_so() -> None:
    config = dataclasses.replace(router_config(["127.0.0.1:1"]), http=HttpFrontConfig())
    async with running_router(["127.0.0.1:1"], config) as router, aiohttp.ClientSession() as s:
        url = f"http://{router.server.http.address}"
        async with s.get(url + "/health") as r:
            assert r.status == 503
            assert "no healthy worker" in (await r.json())["error"]["message"]
        async with s.post(url + "/v1/completions", json={"prompt": "hello"}) as r:
            assert r.status == 503, await r.text()
            assert (await r.json())["error"]["type"] == "service_unavailable"


async def test_client_disconnect_through_the_router_aborts_on_the_worker() -> None:
    async with http_fleet(1, pace_speedup=1.0) as (router, (worker,), _, url):
        wserver = worker.server
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 500, "stream": True}
            r = await s.post(url + "/v1/completions", json=body)
            assert r.status == 200
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: {")
            assert wserver.runner.num_in_flight == 1
            r.close()  # the client goes away mid-stream
        async with asyncio.timeout(WAIT_S):
            while wserver.runner.num_in_flight or router.server.frontend.num_inflight:
                await asyncio.sleep(0.01)
        await wserver.runner.wait_until_idle()
        stats = await wserver.runner.call(wserver.engine.stats)
        assert stats.num_aborted == 1 and stats.num_running == 0
        assert (
            stats.num_free_kv_tokens + stats.num_evictable_kv_tokens + stats.num_protected_kv_tokens
            == stats.num_total_kv_tokens
        )


async def test_stop_strings_and_sampling_parameters_through_the_router() -> None:
    async with http_fleet(1) as (router, _, client, _):
        kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "seed": 3}
        free = (await client.completions.create(**kwargs)).choices[0].text
        stop = next(free[i : i + 2] for i in range(4, len(free) - 2) if free[i : i + 2].isascii())
        expected = free[: free.index(stop)]
        out = await client.completions.create(**kwargs, stop=[stop], logprobs=1)
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        assert len(out.choices[0].logprobs.tokens) >= len(expected)  # a token per byte at most
        stream = await client.completions.create(**kwargs, stop=stop, stream=True)
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == expected
        # the client can read the stream's end before the handler has returned: released soon
        async with asyncio.timeout(WAIT_S):
            while router.server.frontend.num_inflight:
                await asyncio.sleep(0.01)
