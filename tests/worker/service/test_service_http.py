"""The worker's HTTP front on a real aiohttp server (127.0.0.1, port 0) over a real engine:
the OpenAI routes, their errors, client disconnects, and the SGLang/vLLM compat routes."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from svc_harness import BYTE_VOCAB, MAX_CONTEXT, ByteTokenizer, Worker, WorkerSetup, running_worker

from worker.engine.sim_executor import SimCostModel
from worker.service.engine_runner import RunnerConfig

HTTP = WorkerSetup(http=True)
PACED = WorkerSetup(
    http=True, cost=SimCostModel(), runner=RunnerConfig(pace_speedup=1.0, load_interval_s=0)
)
MODEL = "kvroute-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


async def post(w: Worker, path: str, body: object, **kwargs) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(w.http_url + path, json=body, **kwargs) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.json()


async def sse_events(w: Worker, path: str, body: dict, **kwargs) -> tuple[dict, list]:
    """The parsed events of a streamed response (``[DONE]`` kept as the string)."""
    events: list = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(w.http_url + path, json=body, **kwargs) as r,
    ):
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
        headers = {k.lower(): v for k, v in r.headers.items()}
    for frame in raw.split("\n\n"):
        if frame:
            assert frame.startswith("data: "), frame
            data = frame[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return headers, events


# ---- completions -------------------------------------------------------------------------


async def test_completion_answers_text_usage_and_the_serving_worker() -> None:
    async with running_worker(HTTP) as w:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "seed": 7}
        status, headers, out = await post(
            w, "/v1/completions", body, headers={"X-Request-Id": "r-1"}
        )
        assert status == 200, out
        assert headers["x-request-id"] == "r-1" and headers["x-kvroute-worker-id"] == "w-test"
        assert out["id"] == "cmpl-r-1" and out["object"] == "text_completion"
        assert out["model"] == MODEL
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "length"
        usage = out["usage"]
        assert usage["prompt_tokens"] == len(PROMPT.encode())
        assert usage["completion_tokens"] == 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 5
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        # the same prompt again is served from the radix cache
        _, _, again = await post(w, "/v1/completions", body)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["text"] == choice["text"]
        await w.assert_no_leak()


async def test_streamed_text_concatenates_to_the_non_streamed_text() -> None:
    async with running_worker(HTTP) as w:
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "seed": 7}
        _, _, full = await post(w, "/v1/completions", body)
        headers, events = await sse_events(
            w,
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
            headers={"X-Request-Id": "s-1"},
        )
        assert headers["x-request-id"] == "s-1"
        assert events[-1] == "[DONE]"
        *chunks, finish, usage = events[:-1]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
        assert finish["choices"][0]["finish_reason"] == "length"
        assert finish["kvroute"]["worker_id"] == "w-test"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
        assert {e["id"] for e in events[:-1]} == {"cmpl-s-1"}


async def test_token_id_prompts_are_served_as_given() -> None:
    async with running_worker(HTTP) as w:
        status, _, out = await post(
            w, "/v1/completions", {"prompt": [[1, 2, 3, 4, 5]], "max_tokens": 2}
        )
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == 5


async def test_stop_strings_stop_and_are_cut_from_the_text() -> None:
    async with running_worker(HTTP) as w:
        base = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "seed": 7, "ignore_eos": True}
        _, _, free = await post(w, "/v1/completions", base)
        text = free["choices"][0]["text"]
        stop = next(ch for ch in text[3:] if ch.isprintable() and ord(ch) < 128)
        _, _, stopped = await post(w, "/v1/completions", {**base, "stop": [stop]})
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["choices"][0]["text"] == text[: text.index(stop)]


# ---- chat --------------------------------------------------------------------------------


async def test_chat_renders_the_messages_and_streams_the_same_content() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    async with running_worker(HTTP) as w:
        body = {
            "model": MODEL,
            "messages": messages,
            "max_completion_tokens": 6,
            "temperature": 0,
            "seed": 7,
        }
        status, _, full = await post(w, "/v1/chat/completions", body)
        assert status == 200, full
        assert full["object"] == "chat.completion"
        message = full["choices"][0]["message"]
        assert message["role"] == "assistant"
        rendered = w.server.generation.tokenizer.encode(
            "<|system|>\nYou are terse.\n<|user|>\nHi there\n<|assistant|>\n"
        )
        if not hasattr(w.server.generation.tokenizer, "apply_chat_template"):
            assert full["usage"]["prompt_tokens"] == len(rendered)
        _, events = await sse_events(w, "/v1/chat/completions", {**body, "stream": True})
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert content == message["content"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["object"] == "chat.completion.chunk"


async def test_chat_without_max_tokens_generates_to_the_end_of_the_context() -> None:
    # the sim never emits EOS: the answer runs to the context's end, not to 16 tokens
    async with running_worker(HTTP) as w:
        body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
        status, _, full = await post(w, "/v1/chat/completions", body)
        assert status == 200, full
        usage = full["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_CONTEXT
        assert full["choices"][0]["finish_reason"] == "length"
        # completions keep OpenAI's documented default of 16
        _, _, short = await post(w, "/v1/completions", {"prompt": "Hi"})
        assert short["usage"]["completion_tokens"] == 16
        await w.assert_no_leak()


async def test_the_sim_answers_logprobs_with_uniform_stand_ins() -> None:
    async with running_worker(HTTP) as w:
        body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}
        _, _, out = await post(w, "/v1/completions", body)
        lp = out["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [pytest.approx(-math.log(BYTE_VOCAB))] * 3
        assert all(len(top) >= 1 for top in lp["top_logprobs"])
        await w.assert_no_leak()


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        ({"prompt": "x", "n": 17}, 400, "n", "1..16"),
        ({"prompt": "x", "model": "gpt-4o"}, 404, "model", "does not exist"),
        ({"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
        ({"prompt": "x", "echo": True}, 400, "echo", "not supported"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "1.."),
        ({"prompt": "x", "temperature": 3}, 400, "temperature", "[0, 2]"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"prompt": ""}, 400, "prompt", "1..4194304 UTF-8 bytes, got 0"),
    ],
)
async def test_bad_requests_get_openai_errors(body, status, param, needle) -> None:
    async with running_worker(HTTP) as w:
        got, _, out = await post(w, "/v1/completions", body)
        assert got == status, out
        err = out["error"]
        assert needle in err["message"] and err["param"] == param
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if status == 404:
            assert err["code"] == "model_not_found"
        await w.assert_no_leak()


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 600},
            "max_tokens",
            "max_tokens (600) exceeds the model's context length of 512 tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x" * 600, "max_tokens": 1},
            "prompt",
            "exceeds the model's context length of 512 tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 600}]},
            "messages",
            "the model's context length of 512 tokens",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1 << 21}, "max_tokens", "1..1048576"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}]},
            "messages[0].content",
            "required",
        ),
        ("/v1/completions", {"prompt": "x", "model": 3}, "model", "must be a string"),
    ],
)
async def test_refusals_use_the_openai_field_names(path, body, param, needle) -> None:
    async with running_worker(HTTP) as w:
        status, _, out = await post(w, path, body)
        assert status == 400, out
        err = out["error"]
        assert err["param"] == param and needle in err["message"], err
        for wire in ("max_new_tokens", "prompt_token_ids", "prompt_text", "sampling."):
            assert wire not in err["message"]
        await w.assert_no_leak()


async def test_missing_model_and_unknown_fields_are_accepted() -> None:
    async with running_worker(HTTP) as w:
        body = {"prompt": "x", "max_tokens": 2, "vendor_extension": {"a": 1}}
        status, _, out = await post(w, "/v1/completions", body)
        assert status == 200 and out["model"] == MODEL, out


async def test_http_level_errors_are_openai_json() -> None:
    setup = WorkerSetup(http=True, max_body_bytes=4096)
    async with running_worker(setup) as w, aiohttp.ClientSession() as s:
        async with s.post(w.http_url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with s.get(w.http_url + "/v1/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        async with s.get(w.http_url + "/v2/nothing") as r:
            assert r.status == 404 and "/v2/nothing" in (await r.json())["error"]["message"]
        big = {"prompt": "x" * 8000}
        async with s.post(w.http_url + "/v1/completions", json=big) as r:
            assert r.status == 413 and "4096 bytes" in (await r.json())["error"]["message"]
        headers = {"X-Request-Id": "bad id with spaces"}
        async with s.post(
            w.http_url + "/v1/completions", json={"prompt": "x"}, headers=headers
        ) as r:
            assert r.status == 400 and "X-Request-Id" in (await r.json())["error"]["message"]


async def test_a_full_queue_is_429_with_retry_after() -> None:
    from worker.engine.engine import EngineConfig

    engine = EngineConfig(
        worker_id="w-test",
        num_kv_slots=4096,
        block_size=4,
        max_running_requests=1,
        max_waiting_requests=1,
    )
    setup = WorkerSetup(http=True, engine=engine, cost=PACED.cost, runner=PACED.runner)
    async with running_worker(setup) as w, aiohttp.ClientSession() as s:
        body = {"prompt": PROMPT, "max_tokens": 300, "stream": True}
        # one request running, then one waiting (their headers wait for their first token)
        held = []
        for i, (running, waiting) in enumerate(((1, 0), (1, 1))):
            url = w.http_url + "/v1/completions"
            held.append(asyncio.create_task(s.post(url, json={**body, "seed": i})))
            async with asyncio.timeout(10):
                while (st := await w.stats()).num_running < running or st.num_waiting < waiting:
                    await asyncio.sleep(0.01)
        async with s.post(w.http_url + "/v1/completions", json=body) as r3:
            assert r3.status == 429
            assert r3.headers["Retry-After"] == "1"
            assert (await r3.json())["error"]["type"] == "rate_limit_error"
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await until_idle(w)


async def until_idle(w: Worker, timeout: float = 10.0) -> None:
    """The server notices a closed connection on its own time: wait (bounded) for the
    request to be released, then check nothing leaked."""
    async with asyncio.timeout(timeout):
        while w.server.generation.num_generating or w.server.runner.num_in_flight:
            await asyncio.sleep(0.01)
    await w.assert_no_leak()


async def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_kv() -> None:
    async with running_worker(PACED) as w:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 300, "stream": True}
            r = await s.post(w.http_url + "/v1/completions", json=body)
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            stats = await w.stats()
            assert stats.num_running == 1 and stats.num_protected_kv_tokens > 0
            r.close()  # drop the connection mid-stream
        await until_idle(w)
        stats = await w.stats()
        assert stats.num_aborted == 1
        assert (
            stats.num_free_kv_tokens + stats.num_evictable_kv_tokens + stats.num_protected_kv_tokens
            == stats.num_total_kv_tokens
        )


async def test_client_disconnect_while_waiting_for_a_non_streamed_answer() -> None:
    async with running_worker(PACED) as w:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 300}
            task = asyncio.create_task(s.post(w.http_url + "/v1/completions", json=body))
            async with asyncio.timeout(10):
                while (await w.stats()).num_running == 0:
                    await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await until_idle(w)
        assert (await w.stats()).num_aborted == 1


# ---- models, health ----------------------------------------------------------------------


async def test_models_and_health() -> None:
    async with running_worker(HTTP) as w, aiohttp.ClientSession() as s:
        async with s.get(w.http_url + "/v1/models") as r:
            (model,) = (await r.json())["data"]
            assert model["id"] == MODEL and model["object"] == "model"
        async with s.get(w.http_url + "/health") as r:
            assert r.status == 200
        await w.server.begin_shutdown()
        async with s.get(w.http_url + "/health") as r:
            assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        status, _, out = await post(w, "/v1/completions", {"prompt": "x"})
        assert status == 503 and out["error"]["type"] == "service_unavailable"


# ---- SGLang / vLLM compat ----------------------------------------------------------------


async def test_sglang_generate_text_and_ids_streamed_and_not() -> None:
    async with running_worker(HTTP) as w:
        sp = {"max_new_tokens": 6, "temperature": 0, "sampling_seed": 7}
        status, headers, out = await post(w, "/generate", {"text": PROMPT, "sampling_params": sp})
        assert status == 200, out
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(PROMPT.encode()) and meta["completion_tokens"] == 6
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert len(out["output_ids"]) == 6 and headers["x-kvroute-worker-id"] == "w-test"
        ids = list(PROMPT.encode())
        _, _, by_ids = await post(
            w, "/generate", {"input_ids": ids, "sampling_params": sp, "rid": "g-2"}
        )
        assert by_ids["meta_info"]["id"] == "g-2"
        assert by_ids["meta_info"]["cached_tokens"] > 0
        assert by_ids["output_ids"] == out["output_ids"] and by_ids["text"] == out["text"]
        _, events = await sse_events(
            w, "/generate", {"text": PROMPT, "sampling_params": sp, "stream": True}
        )
        assert events[-1] == "[DONE]"
        assert events[-2]["text"] == out["text"] and events[-2]["output_ids"] == out["output_ids"]
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
        status, _, err = await post(w, "/generate", {"text": ["a", "b"]})
        assert status == 400 and "batches" in err["error"]["message"]
        status, _, err = await post(w, "/generate", {"text": "a", "sampling_params": {"n": 2}})
        assert status == 400 and err["error"]["param"] == "n"


async def test_tokenize_and_render_give_the_served_token_ids() -> None:
    async with running_worker(HTTP) as w:
        ids = ByteTokenizer().encode(PROMPT)
        _, _, tok = await post(w, "/tokenize", {"prompt": PROMPT})
        assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 512
        _, _, rendered = await post(w, "/v1/completions/render", {"model": MODEL, "prompt": PROMPT})
        assert rendered[0]["token_ids"] == ids
        messages = [{"role": "user", "content": "Hi"}]
        _, _, chat = await post(w, "/v1/chat/completions/render", {"messages": messages})
        _, _, served = await post(
            w, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
        )
        assert len(chat["token_ids"]) == served["usage"]["prompt_tokens"]
        _, _, tok_chat = await post(w, "/tokenize", {"messages": messages})
        assert tok_chat["tokens"] == chat["token_ids"]


async def test_model_and_server_info_and_flush_cache() -> None:
    async with running_worker(HTTP) as w, aiohttp.ClientSession() as s:
        async with s.get(w.http_url + "/model_info") as r:
            info = await r.json()
            assert info["served_model_name"] == MODEL
            assert "model_path" not in info and "tokenizer_path" not in info
        async with s.get(w.http_url + "/server_info") as r:
            server = await r.json()
            assert server["worker_id"] == "w-test" and server["max_total_num_tokens"] == 4096
        body = {"prompt": PROMPT, "max_tokens": 2}
        await post(w, "/v1/completions", body)
        _, _, warm = await post(w, "/v1/completions", body)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        async with s.post(w.http_url + "/flush_cache") as r:
            assert r.status == 200
        _, _, cold = await post(w, "/v1/completions", body)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await w.assert_no_leak()
