"""The parameters test_service_openai_client.py leaves out, through the official ``openai``
client against a worker's HTTP front over the torch executor and ``kvroute model init``'s
BPE model: greedy decoding, ``top_p`` / ``top_k``, ``max_completion_tokens``, stop strings
(lists, several tokens, ``"\\n\\n"``) streamed and not, the vLLM extensions, and the
refusals (bad values and types, tools, response formats) with the field named."""

from __future__ import annotations

import contextlib

import openai
import pytest
from svc_harness import WorkerSetup, running_worker

from edge.tokenizer import load_tokenizer
from worker.model_dir import write_model_dir

PROMPT = "The customer asked about the refund policy for the second order."
MESSAGES = [{"role": "user", "content": "Where is my refund?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("m") / "bpe-tiny"))


@contextlib.asynccontextmanager
async def served(model_dir: str):
    setup = WorkerSetup(http=True, executor_kind="torch", model_dir=model_dir)
    async with running_worker(setup) as w:
        client = openai.AsyncOpenAI(base_url=w.http_url + "/v1", api_key="unused", max_retries=0)
        try:
            model = (await client.models.list()).data[0].id
            yield w, client, model
        finally:
            await client.close()


async def test_greedy_and_the_samplers_that_keep_only_the_top_token(model_dir) -> None:
    async with served(model_dir) as (w, client, model):

        async def text(**kwargs) -> str:
            out = await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=16, **kwargs
            )
            assert out.choices[0].finish_reason == "length"
            return out.choices[0].text

        greedy = await text(temperature=0)
        assert await text(temperature=0) == greedy  # no randomness at temperature 0
        assert await text(temperature=0, seed=1) == greedy  # a seed changes nothing then
        # sampling left with the most likely token alone is greedy, whatever the seed
        assert await text(temperature=1, top_p=1e-9, seed=3) == greedy
        assert await text(temperature=1, extra_body={"top_k": 1}, seed=4) == greedy
        sampled = {await text(temperature=1, top_p=0.9, seed=s) for s in range(4)}
        assert len(sampled) > 1  # top_p 0.9 still samples
        chat = await client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_completion_tokens=5
        )
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        usage = await client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_completion_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in usage]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
            chat.choices[0].message.content
        )
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        await w.assert_no_leak()


async def test_stop_strings_through_the_client(model_dir) -> None:
    async with served(model_dir) as (w, client, model):
        greedy = {"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        free = (await client.completions.create(**greedy)).choices[0].text
        pieces = [free[i : i + 4] for i in range(6, len(free) - 4)]
        multi = next(p for p in pieces if p.isascii() and p.isprintable() and free.index(p) >= 6)
        # listed first, but it starts after the other one completes: the other one stops
        after = free.index(multi) + len(multi)
        later = next(p[:2] for p in pieces if p.isascii() and free.index(p[:2]) >= after)
        for stop in (multi, [later, multi], [multi, "never in it"]):
            expected = free[: free.index(multi)]
            out = await client.completions.create(**greedy, stop=stop)
            assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
            stream = await client.completions.create(**greedy, stop=stop, stream=True)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks) == expected
            assert chunks[-1].choices[0].finish_reason == "stop"
        # "\n\n" on the BPE model: "\n" pushed up until it comes twice in a row
        (newline,) = load_tokenizer(model_dir).encode("\n", add_special_tokens=False)
        nl = {"logit_bias": {str(newline): 4.0}}
        free_nl = (await client.completions.create(**greedy, **nl)).choices[0].text
        assert "\n\n" in free_nl
        expected = free_nl[: free_nl.index("\n\n")]
        out = await client.completions.create(**greedy, **nl, stop="\n\n")
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
        stream = await client.completions.create(**greedy, **nl, stop=["\n\n"], stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == expected
        # chat: the same rule on the reply
        chat = {"model": model, "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
        reply = (await client.chat.completions.create(**chat)).choices[0].message.content
        stop = next(
            reply[i : i + 3] for i in range(4, len(reply)) if reply[i : i + 3].isprintable()
        )
        stopped = await client.chat.completions.create(**chat, stop=[stop])
        assert stopped.choices[0].message.content == reply[: reply.index(stop)]
        assert stop not in stopped.choices[0].message.content
        await w.assert_no_leak()


async def test_vllm_extensions_through_extra_body(model_dir) -> None:
    async with served(model_dir) as (w, client, model):
        bpe = load_tokenizer(model_dir)
        out = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "top_k": -1},
        )  # fmt: skip
        assert out.usage.completion_tokens == 8
        first = bpe.encode(out.choices[0].text, add_special_tokens=False)[0]
        cut = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"stop_token_ids": [first]},
        )  # fmt: skip
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 1
        await w.assert_no_leak()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),  # OpenAI wants an integer (vLLM converts it)
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 7}, "stop"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"max_tokens": 5000}, "max_tokens"),  # past the model's context (4096)
        ({"best_of": 2}, "best_of"),
        ({"suffix": "done"}, "suffix"),
    ],
)
async def test_bad_completion_parameters_are_400_naming_the_field(model_dir, kwargs, param) -> None:
    async with served(model_dir) as (w, client, model):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=model, prompt=PROMPT, **kwargs)
        assert bad.value.status_code == 400
        assert bad.value.body["param"] == param, bad.value.body
        assert bad.value.body["type"] == "invalid_request_error"
        assert bad.value.body["message"].startswith(param), bad.value.body
        await w.assert_no_leak()


async def test_model_left_out_tools_and_response_formats(model_dir) -> None:
    async with served(model_dir) as (w, client, model):
        # no model: the served one (vLLM and SGLang do the same; OpenAI requires it)
        out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        anonymous = await client.completions.with_raw_response.create(
            model=openai.NOT_GIVEN, prompt=PROMPT, max_tokens=2
        )
        assert anonymous.parse().usage.completion_tokens == out.usage.completion_tokens == 2
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        refused = [
            ({"tools": tools}, "tools"),
            ({"tools": tools, "tool_choice": "required"}, "tools"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
        ]
        for kwargs, param in refused:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=2, **kwargs
                )
            assert bad.value.body["param"] == param
            assert "supported: model, messages" in bad.value.message
        # nothing to call: answered as if no tools were given
        plain = await client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, temperature=0
        )
        told_not_to = await client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, temperature=0, tools=tools,
            tool_choice="none", response_format={"type": "text"},
        )  # fmt: skip
        assert told_not_to.choices[0].message.content == plain.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user"}], max_tokens=2
            )
        assert bad.value.body["param"] == "messages[0].content"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        assert missing.value.body["code"] == "model_not_found"
        await w.assert_no_leak()
