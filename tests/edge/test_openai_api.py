"""edge.openai_api without a socket: request JSON -> GenerateRequest, our messages
-> OpenAI JSON, errors, SSE framing."""

from __future__ import annotations

import json

import pytest

from edge import openai_api as oa
from edge import openai_params as oa_params
from edge.frontdoor import BadRequest, NotFound, Overloaded
from kvroute_proto import kvroute_pb2 as pb


class CharTokenizer:
    """One token per character (ord), enough for the stop-string rule."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


TOK = CharTokenizer()


def completion(body: dict, tokenizer=TOK) -> oa.ApiRequest:
    return oa.parse_completion(body, model_name="m", request_id="r1", tokenizer=tokenizer)


def chat(body: dict, tokenizer=TOK) -> oa.ApiRequest:
    return oa.parse_chat(body, model_name="m", request_id="r1", tokenizer=tokenizer)


# ---- parsing -----------------------------------------------------------------------------


def test_a_completion_maps_every_sampling_field() -> None:
    api = completion(
        {
            "model": "m",
            "prompt": "hello",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 11,
            "stop": ["!", "?"],
            "stop_token_ids": [2],
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u",
            "echo": False,  # peers (sglang-router) send the defaults of what we refuse
            "logprobs": None,
        }
    )
    r = api.request
    assert (r.request_id, r.prompt_text) == ("r1", "hello")
    s = r.sampling
    assert (s.max_new_tokens, s.top_k, s.seed, s.ignore_eos) == (7, 40, 11, True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert list(s.stop_token_ids) == [2]
    assert list(s.stop) == ["!", "?"]  # matched by the worker on the decoded text
    assert api.stream and api.include_usage and api.kind == "completion"


def test_defaults_follow_openai() -> None:
    s = completion({"prompt": "x"}).request.sampling
    assert s.max_new_tokens == 16  # OpenAI's and vLLM's completions default
    chat_sampling = chat({"messages": [{"role": "user", "content": "hi"}]}).request.sampling
    assert chat_sampling.max_new_tokens == 0  # the worker's: what is left of the context
    assert s.temperature == 1.0 and s.top_p == 1.0 and not s.HasField("seed")
    assert not completion({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("a", "a"), (["a"], "a"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])],
)
def test_prompt_forms(prompt, expected) -> None:
    r = completion({"prompt": prompt}).request
    got = r.prompt_text if r.WhichOneof("prompt") == "prompt_text" else list(r.prompt_token_ids.ids)
    assert got == expected


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"prompt": [1, -1]}, "prompt", "token ids"),
        ({"prompt": 5}, "prompt", "string or a list"),
        ({"prompt": "x", "n": 0}, "n", "integer in 1..16, got 0"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "best_of": 2}, "best_of", "supported: model, prompt, max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "0..20"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "integer in 1.."),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "integer in 1.."),
        ({"prompt": "x", "temperature": -1}, "temperature", "[0, 2]"),
        ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "x", "seed": -1}, "seed", "integer in 0.."),
        ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
        ({"prompt": "x", "stop": ["ab", ""]}, "stop", "non-empty string"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"prompt": "x", "stop": 3}, "stop", "string or a list of them"),
        ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids", "token ids"),
        ({"prompt": "x", "user": 3}, "user", "string"),
    ],
)
def test_bad_completion_fields_name_the_field(body, param, needle) -> None:
    with pytest.raises(BadRequest) as info:
        completion(body)
    assert info.value.param == param and needle in info.value.message


def test_multi_token_stop_strings_go_to_the_worker_without_a_tokenizer_here() -> None:
    assert list(
        completion({"prompt": "x", "stop": "\n\n"}, tokenizer=None).request.sampling.stop
    ) == ["\n\n"]


def test_an_unknown_model_is_404_model_not_found() -> None:
    with pytest.raises(NotFound) as info:
        completion({"prompt": "x", "model": "gpt-4o"})
    body = oa.error_body(info.value)["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert info.value.http_status == 404 and "'gpt-4o'" in body["message"]


def test_chat_renders_text_parts_with_the_default_template() -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    api = chat({"messages": messages, "max_completion_tokens": 3, "max_tokens": 9})
    assert api.request.prompt_text == "<|system|>\nBe terse.\n<|user|>\nab\n<|assistant|>\n"
    assert api.request.sampling.max_new_tokens == 3  # max_completion_tokens wins


def test_chat_uses_the_tokenizers_template() -> None:
    class Templated(CharTokenizer):
        def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
            return "|".join(f"{m['role']}={m['content']}" for m in messages) + "|bot="

    api = chat({"messages": [{"role": "user", "content": "hi"}]}, tokenizer=Templated())
    assert api.request.prompt_text == "user=hi|bot="


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only parts of type 'text'"),
        ([{"role": "user", "content": 5}], "string or a list of text parts"),
        (["hi"], "must be an object"),
    ],
)
def test_bad_messages(messages, needle) -> None:
    with pytest.raises(BadRequest) as info:
        chat({"messages": messages})
    assert needle in info.value.message


def test_json_body_and_request_id_checks() -> None:
    assert oa.parse_json_body(b'{"a": 1}') == {"a": 1}
    with pytest.raises(BadRequest, match="not valid JSON"):
        oa.parse_json_body(b"{")
    with pytest.raises(BadRequest, match="JSON object, got list"):
        oa.parse_json_body(b"[1]")
    assert oa.check_request_id("req-1.a:b_c") == "req-1.a:b_c"
    for bad in ("", "x" * 129, "has space", "ünï"):
        with pytest.raises(BadRequest, match="X-Request-Id"):
            oa.check_request_id(bad)


# ---- responses ---------------------------------------------------------------------------


def chunk(ids: list[int], text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r1", chunk=pb.TokenChunk(token_ids=ids, text=text))


def finished(reason: int = pb.FINISH_REASON_LENGTH) -> pb.GenerateResponse:
    usage = pb.Usage(prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=3)
    return pb.GenerateResponse(
        request_id="r1",
        finished=pb.Finished(reason=reason, usage=usage, worker_id="w7", attempts=2),
    )


def test_output_deltas_join_to_the_full_text_and_usage_maps() -> None:
    out = oa.ApiOutput(completion({"prompt": "x"}))
    deltas = [out.push(chunk([1], "ab")), out.push(chunk([2, 3], "c")), out.push(finished())]
    assert deltas == ["ab", "c", None]
    body = oa.full_response(out, "m", created=5)
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert body["kvroute"] == {"worker_id": "w7", "attempts": 2}


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (pb.FINISH_REASON_STOP, "stop"),
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_MAX_CONTEXT, "length"),
        (pb.FINISH_REASON_ABORT, "abort"),
    ],
)
def test_finish_reasons(reason, name) -> None:
    out = oa.ApiOutput(completion({"prompt": "x"}))
    out.push(finished(reason))
    assert out.finish_reason == name


def test_chat_stream_chunks() -> None:
    api = chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    out = oa.ApiOutput(api)
    first = oa.delta_chunk(out, "m", 1, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-r1"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # include_usage: every chunk has the key, null
    out.push(finished())
    end = oa.finish_chunk(out, "m", 1)
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "length"
    assert end["kvroute"]["worker_id"] == "w7"
    usage = oa.usage_chunk(out, "m", 1)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 13


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_delta_events_are_the_delta_chunks_byte_for_byte(kind: str, include_usage: bool) -> None:
    body: dict = {"stream": True, "stream_options": {"include_usage": include_usage}}
    if kind == "chat":
        api = chat({**body, "messages": [{"role": "user", "content": "x"}]})
    else:
        api = completion({**body, "prompt": "x"})
    out = oa.ApiOutput(api)
    events = oa.DeltaEvents(out, 'a "model"', 1733450000)
    for text in ["h", 'say "hi"\n', "\x00\x1f\\", "é漢字🙂", "\u2028", "data: {}"]:
        expected = oa.sse_event(oa.delta_chunk(out, 'a "model"', 1733450000, text))
        assert events.event(text) == expected


def test_errors_and_sse_framing() -> None:
    exc = Overloaded("queue full: max_waiting_requests=4", retry_after_s=1.0)
    assert oa.error_body(exc) == {
        "error": {
            "message": "queue full: max_waiting_requests=4",
            "type": "rate_limit_error",
            "param": None,
            "code": None,
        }
    }
    frame = oa.sse_event({"text": "é"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"text": "é"}
    assert oa.SSE_DONE == b"data: [DONE]\n\n"
    models = oa.models_list("m", 3)
    assert models["data"] == [{"id": "m", "object": "model", "created": 3, "owned_by": "kvroute"}]


def test_chat_is_sent_as_the_rendered_template_marked_as_chat() -> None:
    """The conversation goes on as the model's rendered template, marked prompt_text_is_chat:
    whoever encodes it (the router's front end, or a worker) applies the template's rule for
    special tokens (no second bos)."""

    class Templated(CharTokenizer):
        chat_adds_special_tokens = False

        def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    api = chat({"messages": [{"role": "user", "content": "hi"}]}, tokenizer=Templated())
    assert api.request.prompt_text == "<user>hi<assistant>"
    assert api.request.prompt_text_is_chat
    plain = chat({"messages": [{"role": "user", "content": "hi"}]}, tokenizer=None)
    assert plain.request.prompt_text == "<|user|>\nhi\n<|assistant|>\n"
    assert plain.request.prompt_text_is_chat


@pytest.mark.parametrize(
    ("kind", "message", "param", "expected", "expected_param"),
    [
        (
            "completion",
            "sampling.max_new_tokens must be at most 1048576, got 2000000",
            "sampling.max_new_tokens",
            "max_tokens must be at most 1048576, got 2000000",
            "max_tokens",
        ),
        (
            "completion",
            "prompt_text must not be empty",
            "prompt_text",
            "prompt must not be empty",
            "prompt",
        ),
        (
            "chat",
            "prompt (9 tokens) + max_new_tokens (9) exceeds max_context_tokens=16",
            "prompt_token_ids",
            "prompt (9 tokens) + max_tokens (9) exceeds the model's context length of 16 tokens",
            "messages",
        ),
        ("chat", "prompt_token_ids: too long", "prompt", "messages: too long", "messages"),
        # a worker's refusal through the router: no param, the field leads the message
        (
            "completion",
            "max_new_tokens: prompt (3 tokens) + max_new_tokens (2000) exceeds "
            "max_context_tokens=1024",
            None,
            "max_tokens: prompt (3 tokens) + max_tokens (2000) exceeds the model's context "
            "length of 1024 tokens",
            "max_tokens",
        ),
        ("chat", "prompt_token_ids: too long", None, "messages: too long", "messages"),
        ("completion", "worker: out of memory", None, "worker: out of memory", None),
    ],
)
def test_refusals_are_said_in_the_apis_field_names(kind, message, param, expected, expected_param):
    got = oa_params.in_public_terms(BadRequest(message, param=param), kind)
    assert (got.message, got.param) == (expected, expected_param)


def test_chat_top_logprobs_need_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match="needs logprobs: true") as info:
        chat({"messages": messages, "top_logprobs": 2})
    assert info.value.param == "top_logprobs"
    s = chat({"messages": messages, "logprobs": True, "top_logprobs": 2}).request.sampling
    assert s.logprobs and s.top_logprobs == 2
    s = completion({"prompt": "x", "logprobs": 0}).request.sampling
    assert s.logprobs and s.top_logprobs == 0


def test_tools_are_refused_unless_the_request_says_not_to_call_them() -> None:
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        with pytest.raises(BadRequest, match="tools: not supported") as info:
            chat({"messages": messages, "tools": tools, **extra})
        assert info.value.param == "tools"
    # tool_choice "none": nothing to call, the definitions are left out of the prompt
    plain = chat({"messages": messages}).request
    assert chat({"messages": messages, "tools": tools, "tool_choice": "none"}).request == plain
    assert chat({"messages": messages, "functions": [{}], "function_call": "none"}).request == plain
