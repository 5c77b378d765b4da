"""The OpenAI API, sans I/O: request JSON in, our ``GenerateRequest`` out; our response
messages in, OpenAI JSON (responses, stream chunks, errors) and SSE frames out.

No HTTP stack here (``http_front.py`` is the aiohttp shell): everything is a plain function
of its arguments, so the whole mapping is tested without a socket.

What is supported, and what is refused with a 400 that names the field:

* ``POST /v1/completions``: ``prompt`` as a string, a list of token ids, or a one-element
  list of either (several prompts in one call: 400, send one request per prompt).
* ``POST /v1/chat/completions``: ``messages`` with string content or a list of ``text``
  parts, rendered with the backend tokenizer's ``apply_chat_template`` (a plain default
  template when the tokenizer has none).
* ``max_tokens`` left out: chat generates up to what is left of the model's context (the
  worker's default), completions 16 tokens (OpenAI's and vLLM's defaults for each).
* Sampling: ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (default 1.0 as
  OpenAI's), ``top_p``, ``seed``, ``stop`` (up to 4 strings, matched by the worker on the
  decoded text across tokens; the output ends before the stop, as OpenAI's), penalties,
  ``logit_bias``, ``logprobs`` / ``top_logprobs``, and the vLLM/SGLang extensions ``top_k``,
  ``ignore_eos``, ``stop_token_ids``; ``n`` (1..16: n requests). ``echo``, ``best_of`` > 1,
  tools and response formats are refused (docs/openai-api.md: every parameter).
* ``model`` may be left out (the served model, as vLLM and SGLang do; OpenAI requires it).
  A message needs ``content`` unless it is the assistant's (OpenAI's rule).
* Unknown fields are ignored, as vLLM does (peer routers add their own defaults to forwarded
  bodies); fields OpenAI defines that we do not support are refused (docs/openai-api.md).
* Errors name the OpenAI API's fields (``max_tokens``, ``prompt`` / ``messages``) in their
  message and ``param``, whichever of the router or the worker refused the request
  (:func:`in_public_terms`); each field has one bound (``edge.limits``).
* ``finish_reason``: ``stop`` (a stop token or EOS), ``length`` (``max_tokens`` or the
  model's context), and ``abort`` for a request aborted on the worker: OpenAI has no value
  for that; ``abort`` is what vLLM's and SGLang's OpenAI servers send.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edge.frontdoor import BadRequest, ModelNotFound, ServiceError
from edge.limits import RequestLimits
from edge.openai_logprobs import LogprobsCollector
from edge.openai_params import (
    MAX_UINT32,
    Kind,
    is_int,
    parse_sampling,
    refuse_unsupported,
)
from kvroute_proto import kvroute_pb2 as pb

MAX_PROMPT_TOKENS = RequestLimits().max_prompt_tokens  # one bound per field (edge.limits)
MAX_PROMPT_BYTES = RequestLimits().max_prompt_text_bytes
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_MAX_CONTEXT: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_UNSPECIFIED: "stop",
}


class ChatTokenizer(Protocol):
    """What the API mapping may use of a backend's tokenizer (its chat template, when it
    has ``apply_chat_template``)."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A parsed OpenAI request: what goes to the backend and how to answer."""

    kind: Kind
    request: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: n requests to the backend (edge.http_n)


# ---- request parsing ---------------------------------------------------------------------


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 naming the problem otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_request_id(value: str) -> str:
    """A client-chosen request id (X-Request-Id): 1..128 characters of [A-Za-z0-9-_.:]."""
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not set(value) <= _REQUEST_ID_CHARS:
        raise BadRequest(
            f"X-Request-Id must be 1..{MAX_REQUEST_ID_CHARS} characters of "
            f"[A-Za-z0-9-_.:], got {value[:40]!r}{'...' if len(value) > 40 else ''}",
            param="X-Request-Id",
        )
    return value


def check_model(body: Mapping[str, Any], model_name: str | Sequence[str]) -> None:
    """``model`` must be absent or a served model (404 model_not_found otherwise, naming
    them); ``model_name``: the served model, or each model a router's pools serve."""
    model = body.get("model")
    if model is None:  # as vLLM and SGLang: the served model (OpenAI requires it)
        return
    if not isinstance(model, str):
        raise BadRequest(f"model: must be a string, got {type(model).__name__}", param="model")
    served = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if model not in served:
        names = ", ".join(repr(name) for name in served)
        raise ModelNotFound(
            f"The model {model!r} does not exist: this server serves {names}", param="model"
        )


def parse_completion(
    body: Mapping[str, Any],
    *,
    model_name: str | Sequence[str],
    request_id: str,
    tokenizer: ChatTokenizer | None,
) -> ApiRequest:
    """``POST /v1/completions`` body -> ApiRequest (raises BadRequest / ModelNotFound)."""
    check_model(body, model_name)
    refuse_unsupported(body, "completion")
    request = pb.GenerateRequest(request_id=request_id, model=body.get("model") or "")
    prompt = _one_prompt(body.get("prompt"))
    if isinstance(prompt, str):
        request.prompt_text = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    return ApiRequest("completion", request, *parse_sampling("completion", body, request))


def parse_chat(
    body: Mapping[str, Any],
    *,
    model_name: str | Sequence[str],
    request_id: str,
    tokenizer: ChatTokenizer | None,
) -> ApiRequest:
    """``POST /v1/chat/completions`` body -> ApiRequest; the messages are rendered into one
    text prompt with the tokenizer's chat template."""
    check_model(body, model_name)
    refuse_unsupported(body, "chat")
    messages = parse_messages(body.get("messages"))
    request = pb.GenerateRequest(request_id=request_id, model=body.get("model") or "")
    # the rendered conversation as text, marked as such: whoever encodes it (the router's
    # front end, which may tokenize only the part a cache can match, or a worker) applies
    # the template's rule for special tokens
    request.prompt_text = render_chat(messages, tokenizer)
    size = len(request.prompt_text.encode("utf-8"))
    _check_prompt_size(size, MAX_PROMPT_BYTES, "UTF-8 bytes once rendered", "messages")
    request.prompt_text_is_chat = True
    return ApiRequest("chat", request, *parse_sampling("chat", body, request))


def chat_prompt(messages: Sequence[Mapping[str, str]], tokenizer: object | None) -> str | list[int]:
    """What a conversation is served as: the token ids when the tokenizer renders and
    encodes chats itself (``encode_chat``: special tokens exactly as the template puts
    them, no second BOS), else the rendered text (:func:`render_chat`)."""
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if callable(encode_chat):
        return [int(t) for t in encode_chat([dict(m) for m in messages])]
    return render_chat(messages, tokenizer)


def parse_messages(value: object) -> list[dict[str, str]]:
    """Chat messages as ``[{"role", "content"}]`` with string content (text parts joined)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: must be a non-empty list of messages", param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where}: must be an object with role and content", param=where)
        role = msg.get("role")
        if role not in _ROLES:
            raise BadRequest(
                f"{where}.role: must be one of {sorted(_ROLES)}, got {role!r}",
                param=f"{where}.role",
            )
        if msg.get("content") is None and role != "assistant":  # OpenAI: 400 as well
            raise BadRequest(
                f"{where}.content: required for a {role!r} message", param=f"{where}.content"
            )
        out.append({"role": role, "content": _content_text(msg.get("content"), where)})
    return out


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content: must be a string or a list of text parts",
            param=f"{where}.content",
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f"{where}.content[{j}]: only parts of type 'text' are supported, got {got!r}",
                param=f"{where}.content[{j}]",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest(
                f"{where}.content[{j}].text: must be a string", param=f"{where}.content[{j}]"
            )
        texts.append(text)
    return "".join(texts)


def render_chat(messages: Sequence[Mapping[str, str]], tokenizer: object | None) -> str:
    """The prompt text of a conversation, ending where the assistant's reply starts.

    With a tokenizer that has ``apply_chat_template(messages) -> str`` (the model's Jinja
    template), that; otherwise a plain default::

        <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n
    """
    apply = getattr(tokenizer, "apply_chat_template", None)
    if callable(apply):
        rendered = apply([dict(m) for m in messages])
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, not str")
        return rendered
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _one_prompt(prompt: object) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (or a one-element list of one)."""
    if isinstance(prompt, list) and prompt and not is_int(prompt[0]):
        if len(prompt) != 1:
            raise BadRequest(
                f"prompt: one prompt per request is supported, got a list of {len(prompt)}; "
                "send one request per prompt",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_prompt_size(len(prompt.encode("utf-8")), MAX_PROMPT_BYTES, "UTF-8 bytes", "prompt")
        return prompt
    if isinstance(prompt, list) and all(is_int(t) and 0 <= t <= MAX_UINT32 for t in prompt):
        _check_prompt_size(len(prompt), MAX_PROMPT_TOKENS, "tokens", "prompt")
        return list(prompt)
    raise BadRequest(
        "prompt: must be a string or a list of token ids (integers in 0..2^32-1)",
        param="prompt",
    )


def _check_prompt_size(n: int, limit: int, unit: str, param: str) -> None:
    if not 0 < n <= limit:
        raise BadRequest(f"{param}: must hold 1..{limit} {unit}, got {n}", param=param)


# ---- responses ---------------------------------------------------------------------------


class ApiOutput:
    """The output of one request as it streams in: text deltas (stop strings cut), then the
    finish. Streamed deltas concatenate to exactly ``text``."""

    def __init__(self, api: ApiRequest, index: int = 0) -> None:
        self.api = api
        self.index = index  # the choice's index (n > 1)
        self.parts: list[str] = []
        self.finished: pb.Finished | None = None
        s = api.request.sampling
        self.logprobs = LogprobsCollector(api.kind, s.top_logprobs) if s.logprobs else None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def push(self, msg: pb.GenerateResponse) -> str | None:
        """Take one backend message: the text delta of a chunk, None for the Finished."""
        if msg.HasField("finished"):
            self.finished = msg.finished
            return None
        text = msg.chunk.text  # the worker cut stop strings from it already
        self.parts.append(text)
        if self.logprobs is not None:
            self.logprobs.add(msg.chunk.logprobs)
        return text

    @property
    def finish_reason(self) -> str | None:
        return None if self.finished is None else FINISH_REASONS[self.finished.reason]

    def usage(self) -> dict[str, Any]:
        u = self.finished.usage if self.finished is not None else pb.Usage()
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        }

    def extension(self) -> dict[str, Any]:
        """Our own fields (``kvroute``): which worker served it, after how many attempts."""
        f = self.finished
        return {"worker_id": f.worker_id if f else "", "attempts": f.attempts if f else 0}


def response_id(kind: Kind, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def _envelope(api: ApiRequest, model: str, created: int, *, chunk: bool) -> dict[str, Any]:
    if api.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {
        "id": response_id(api.kind, api.request.request_id),
        "object": obj,
        "created": created,
        "model": model,
    }


def full_response(out: ApiOutput, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streamed response body."""
    api = out.api
    body = _envelope(api, model, created or int(time.time()), chunk=False)
    choice: dict[str, Any] = {"index": out.index}
    if api.kind == "chat":
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    choice["logprobs"] = None if out.logprobs is None else out.logprobs.whole()
    choice["finish_reason"] = out.finish_reason
    body["choices"] = [choice]
    body["usage"] = out.usage()
    body["kvroute"] = out.extension()
    return body


def delta_chunk(
    out: ApiOutput, model: str, created: int, text: str, *, first: bool = False
) -> dict[str, Any]:
    """A streamed chunk carrying ``text`` (chat: the first one also carries the role)."""
    body = _envelope(out.api, model, created, chunk=True)
    choice: dict[str, Any] = {"index": out.index}
    if out.api.kind == "chat":
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None if out.logprobs is None else out.logprobs.take()
    choice["finish_reason"] = None
    body["choices"] = [choice]
    if out.api.include_usage:
        body["usage"] = None
    return body


class DeltaEvents:
    """The SSE events of a stream's text deltas, byte for byte ``sse_event(delta_chunk(...))``
    (bar a chat's first, role-carrying one), from two byte strings made once per request:
    only the text is encoded per event (JSON's string escaping, in C), no dict is built
    (decision 0030: the relay's cost per message)."""

    __slots__ = ("_head", "_tail")

    def __init__(self, out: ApiOutput, model: str, created: int) -> None:
        marker = "\x00"  # a string JSON always escapes, so it cannot occur in the envelope
        frame = sse_event(delta_chunk(out, model, created, marker))
        head, _, tail = frame.partition(dumps(marker))
        self._head, self._tail = head, tail

    def event(self, text: str) -> bytes:
        """The SSE event carrying ``text``."""
        return b"".join((self._head, _encode_string(text).encode(), self._tail))


def finish_chunk(out: ApiOutput, model: str, created: int) -> dict[str, Any]:
    """The streamed chunk with the finish reason and our ``kvroute`` extension."""
    body = _envelope(out.api, model, created, chunk=True)
    choice: dict[str, Any] = {"index": out.index}
    if out.api.kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    choice["logprobs"] = None if out.logprobs is None else out.logprobs.take()
    choice["finish_reason"] = out.finish_reason
    body["choices"] = [choice]
    if out.api.include_usage:
        body["usage"] = None
    body["kvroute"] = out.extension()
    return body


def usage_chunk(out: ApiOutput, model: str, created: int) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
    body = _envelope(out.api, model, created, chunk=True)
    body["choices"] = []
    body["usage"] = out.usage()
    return body


def models_list(
    model: str | Sequence[str], created: int, *, owned_by: str = "kvroute"
) -> dict[str, Any]:
    """``GET /v1/models``: the served model, or each model a router's pools serve."""
    models = (model,) if isinstance(model, str) else model
    data = [{"id": m, "object": "model", "created": created, "owned_by": owned_by} for m in models]
    return {"object": "list", "data": data}


# ---- errors and SSE ----------------------------------------------------------------------


def error_body(exc: ServiceError) -> dict[str, Any]:
    """OpenAI's error JSON for one of our errors."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": getattr(exc, "code", None),
        }
    }


def plain_error_body(
    message: str, error_type: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON for an HTTP-level error (no route, wrong method, body too big)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


_encode_string = json.encoder.encode_basestring  # what dumps(ensure_ascii=False) uses for a str


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse_event(obj: object) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
