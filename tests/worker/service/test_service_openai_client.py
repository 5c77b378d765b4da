"""The sampling parameters, driven by the official ``openai`` client against a worker's HTTP
front over the tiny torch model (byte tokenizer: token id 97 is "a", 98 is "b")."""

from __future__ import annotations

import contextlib

import openai
import pytest
from svc_harness import WorkerSetup, running_worker

TORCH = WorkerSetup(http=True, executor_kind="torch")
A, B = 97, 98


@contextlib.asynccontextmanager
async def client_of_worker():
    async with running_worker(TORCH) as w:
        client = openai.AsyncOpenAI(base_url=w.http_url + "/v1", api_key="unused", max_retries=0)
        try:
            yield w, client
        finally:
            await client.close()


async def text_of(client, **kwargs) -> str:
    out = await client.completions.create(model="kvroute-tiny", prompt="Hello", **kwargs)
    return out.choices[0].text


async def test_logit_bias_and_penalties() -> None:
    async with client_of_worker() as (w, client):
        greedy = {"temperature": 0, "max_tokens": 6}
        assert await text_of(client, **greedy, logit_bias={str(A): 100}) == "aaaaaa"
        # "b" ten below "a" (more than the model's own logits move them); each "a" costs 2
        both = {"temperature": 0, "max_tokens": 12, "logit_bias": {str(A): 100, str(B): 90}}
        assert await text_of(client, **both) == "a" * 12
        penalized = await text_of(client, **both, frequency_penalty=2)
        assert penalized.startswith("aaa") and set(penalized) == {"a", "b"}
        # one apart, the model's own logits alternate them; a negative presence penalty
        # (a reward for what occurred) keeps the first one
        close = {"temperature": 0, "max_tokens": 6, "logit_bias": {str(A): 100, str(B): 99}}
        assert await text_of(client, **close) == "ababab"
        assert await text_of(client, **close, presence_penalty=-2) == "aaaaaa"
        # chat takes them as well
        chat = await client.chat.completions.create(
            model="kvroute-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            logit_bias={str(B): 100},
        )
        assert chat.choices[0].message.content == "bbbb"
        await w.assert_no_leak()


async def test_seed_makes_sampling_reproducible() -> None:
    async with client_of_worker() as (_, client):
        sampled = {"temperature": 1.0, "max_tokens": 16}
        first = await text_of(client, **sampled, seed=7)
        assert await text_of(client, **sampled, seed=7) == first
        assert await text_of(client, **sampled, seed=8) != first


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"97": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),  # past the vocabulary: the worker's
        ({"echo": True}, "echo"),
    ],
)
async def test_out_of_range_and_unsupported_parameters_are_400(kwargs, param) -> None:
    async with client_of_worker() as (w, client):
        with pytest.raises(openai.BadRequestError) as bad:
            await text_of(client, max_tokens=2, **kwargs)
        assert bad.value.body["param"] == param, bad.value.body
        if param == "echo":
            assert "supported: model, prompt, max_tokens" in bad.value.message
        await w.assert_no_leak()


async def test_logprobs_and_top_logprobs() -> None:
    async with client_of_worker() as (w, client):
        kwargs = {"model": "kvroute-tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        full = await client.completions.create(**kwargs, logprobs=3)
        lp = full.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            # greedy: the argmax (the legacy dict keys tokens by text: two tokens decoding to
            # the same text, e.g. parts of one character, share a key)
            assert 1 <= len(top) <= 3 and chosen == max(top.values()) <= 0
        stream = await client.completions.create(**kwargs, logprobs=3, stream=True)
        streamed = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices]
        # (the second request reads the cached prompt: float sums in another order)
        got = [t for s in streamed if s for t in s.token_logprobs]
        assert got == pytest.approx(lp.token_logprobs, abs=1e-4)
        # a token forced by logit_bias is certain
        forced = await client.completions.create(**kwargs, logprobs=0, logit_bias={str(A): 100})
        assert forced.choices[0].logprobs.tokens == ["a"] * 5
        assert all(-1e-3 < v <= 0 for v in forced.choices[0].logprobs.token_logprobs)
        # a stop string keeps the logprobs of the tokens that made it
        stopped = await client.completions.create(
            **kwargs, logprobs=0, logit_bias={str(A): 100}, stop="aaa"
        )
        assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].logprobs.tokens[:3] == ["a"] * 3
        chat = await client.chat.completions.create(
            model="kvroute-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens == 4
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.logprob == entry.top_logprobs[0].logprob
            assert entry.bytes == list(entry.token.encode())
        plain = await client.chat.completions.create(
            model="kvroute-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert plain.choices[0].logprobs is None
        await w.assert_no_leak()


async def test_n_choices_streamed_and_not() -> None:
    async with client_of_worker() as (w, client):
        kwargs = {"model": "kvroute-tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1}
        full = await client.completions.create(**kwargs, n=3, seed=11)
        texts = [c.text for c in sorted(full.choices, key=lambda c: c.index)]
        assert [c.index for c in full.choices] == [0, 1, 2] and len(set(texts)) == 3
        assert full.usage.completion_tokens == 3 * 8
        assert full.usage.prompt_tokens == len(b"Hello")  # counted once
        again = await client.completions.create(**kwargs, n=3, seed=11)
        assert [c.text for c in again.choices] == texts  # seeds 11, 12, 13
        stream = await client.completions.create(
            **kwargs, n=3, seed=11, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        streamed = ["", "", ""]
        finished = set()
        for c in chunks:
            for choice in c.choices:
                streamed[choice.index] += choice.text
                if choice.finish_reason:
                    finished.add(choice.index)
        assert streamed == texts and finished == {0, 1, 2}
        assert chunks[-1].usage.completion_tokens == 24
        chat = await client.chat.completions.create(
            model="kvroute-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2
        )
        assert [c.index for c in chat.choices] == [0, 1]
        await w.assert_no_leak()


async def test_the_readme_chat_example_gets_a_whole_answer() -> None:
    # the README's call: no max_tokens; the tiny model ends its answer with EOS
    async with client_of_worker() as (w, client):
        reply = await client.chat.completions.create(
            model="kvroute-tiny", messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens > 16
        await w.assert_no_leak()
