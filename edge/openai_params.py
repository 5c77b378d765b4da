"""The OpenAI API's request parameters, sans I/O: which exist, which we support, how each
maps onto our ``SamplingParams``, and our refusals said in the API's own field names.

docs/openai-api.md lists every completions / chat parameter and what we do with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from edge.frontdoor import BadRequest, ServiceError
from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb

Kind = Literal["completion", "chat"]

MAX_UINT32 = (1 << 32) - 1
MAX_STOP_SEQUENCES = RequestLimits().max_stop_strings  # OpenAI's limit
MAX_TOKENS = RequestLimits().max_new_tokens  # one bound per field: the router's (edge.limits)
MAX_TOP_LOGPROBS = RequestLimits().max_top_logprobs
MAX_N = 16  # choices per request (each one request to the backend)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI, vLLM)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SUPPORTED: dict[Kind, tuple[str, ...]] = {
    "completion": ("model", "prompt", "max_tokens"),
    "chat": ("model", "messages", "max_tokens", "max_completion_tokens"),
}
_SAMPLING = (
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "n", "stream", "stream_options", "user",
    "top_k", "ignore_eos", "stop_token_ids",
)  # fmt: skip

# OpenAI parameters we do not serve: (field, kind, the values that mean "off") -> 400 when
# set to anything else. Fields that change nothing we return (metadata, store, service_tier)
# are accepted and ignored, as are fields OpenAI does not define.
_UNSUPPORTED: tuple[tuple[str, Kind | None, tuple[object, ...]], ...] = (
    ("echo", "completion", (None, False)),
    ("suffix", "completion", (None, "")),
    ("best_of", "completion", (None, 1)),
    ("tools", "chat", (None, [])),
    ("tool_choice", "chat", (None, "none", "auto")),
    ("functions", "chat", (None, [])),
    ("function_call", "chat", (None, "none", "auto")),
    ("response_format", "chat", (None, {"type": "text"})),
    ("audio", "chat", (None,)),
    ("modalities", "chat", (None, ["text"])),
    ("prediction", "chat", (None,)),
    ("reasoning_effort", "chat", (None,)),
    ("web_search_options", "chat", (None,)),
)


# tool definitions the request itself says not to call (``tool_choice: "none"``): nothing
# to serve, so accepted (vLLM accepts them too) and left out of the prompt
_TOOLS_OFF = {"tools": "tool_choice", "functions": "function_call"}


def refuse_unsupported(body: Mapping[str, Any], kind: Kind) -> None:
    """400 for an OpenAI parameter we do not serve, listing the ones we do."""
    supported = ", ".join((*SUPPORTED[kind], *_SAMPLING))
    for name, only_for, off in _UNSUPPORTED:
        if only_for not in (None, kind) or name not in body:
            continue
        if name in _TOOLS_OFF and body.get(_TOOLS_OFF[name]) == "none":
            continue
        if body[name] not in off:
            raise BadRequest(
                f"{name}: not supported by this server; supported: {supported} "
                "(docs/openai-api.md)",
                param=name,
            )


def parse_sampling(
    kind: Kind, body: Mapping[str, Any], request: pb.GenerateRequest
) -> tuple[bool, bool, int]:
    """The sampling fields of ``body`` into ``request.sampling``; ``(stream,
    include_usage, n)``."""
    s = request.sampling
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is not None:
            s.max_new_tokens = _int_field(body, name, 1, MAX_TOKENS)
            break
    else:
        # absent: chat leaves it to the worker (what is left of the context); completions
        # take OpenAI's and vLLM's documented default (docs/decisions/0032)
        s.max_new_tokens = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else 0
    s.temperature = _float_field(body, "temperature", 0.0, 2.0, default=1.0)
    s.top_p = _float_field(body, "top_p", 0.0, 1.0, default=1.0, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:  # -1: vLLM's "off"
        s.top_k = _int_field(body, "top_k", 0, MAX_UINT32)
    if body.get("seed") is not None:
        s.seed = _int_field(body, "seed", 0, (1 << 64) - 1)
    s.ignore_eos = _bool_field(body, "ignore_eos")
    s.presence_penalty = _float_field(body, "presence_penalty", -2.0, 2.0, default=0.0)
    s.frequency_penalty = _float_field(body, "frequency_penalty", -2.0, 2.0, default=0.0)
    for token_id, bias in _logit_bias(body.get("logit_bias")).items():
        s.logit_bias[token_id] = bias
    _parse_logprobs(kind, body, s)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
            is_int(t) and 0 <= t <= MAX_UINT32 for t in stop_ids
        ):
            raise BadRequest("stop_token_ids: must be a list of token ids", param="stop_token_ids")
        s.stop_token_ids.extend(stop_ids)
    s.stop.extend(_stop_strings(body.get("stop")))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("user: must be a string", param="user")
    stream = _bool_field(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options: must be an object", param="stream_options")
        include_usage = _bool_field(options, "include_usage", where="stream_options.")
    n = 1 if body.get("n") is None else _int_field(body, "n", 1, MAX_N)
    return stream, include_usage and stream, n


def _parse_logprobs(kind: Kind, body: Mapping[str, Any], s: pb.SamplingParams) -> None:
    """Completions: ``logprobs`` = how many top tokens (0..20); chat: ``logprobs`` true and
    ``top_logprobs`` 0..20."""
    top = MAX_TOP_LOGPROBS
    if kind == "completion":
        if body.get("logprobs") is not None:
            s.logprobs = True
            s.top_logprobs = _int_field(body, "logprobs", 0, top)
        return
    s.logprobs = _bool_field(body, "logprobs")
    if body.get("top_logprobs") is not None:
        s.top_logprobs = _int_field(body, "top_logprobs", 0, top)
        if not s.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")


def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"token id": bias in [-100, 100]}``, at most 300."""
    if value is None:
        return {}
    limit = RequestLimits().max_logit_bias
    if not isinstance(value, dict) or len(value) > limit:
        raise BadRequest(
            f"logit_bias: must be an object of at most {limit} token ids", param="logit_bias"
        )
    out = {}
    for key, bias in value.items():
        ok_bias = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (str(key).isdigit() and int(key) <= MAX_UINT32 and ok_bias and -100 <= bias <= 100):
            raise BadRequest(
                f"logit_bias: maps token ids to numbers in [-100, 100], got {key!r}: {bias!r}",
                param="logit_bias",
            )
        out[int(key)] = float(bias)
    return out


def _stop_strings(value: object) -> list[str]:
    """Stop strings: matched by the worker on the decoded text, across tokens and chunks
    (edge.stop_strings; docs/decisions/0032)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest("stop: must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequest(
            f"stop: at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop"
        )
    return stops


def _int_field(body: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = body[name]
    if not is_int(value) or not low <= value <= high:
        raise BadRequest(f"{name}: must be an integer in {low}..{high}, got {value!r}", param=name)
    return int(value)


def _float_field(
    body: Mapping[str, Any],
    name: str,
    low: float,
    high: float,
    *,
    default: float,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bracket = "(" if low_open else "["
        raise BadRequest(
            f"{name}: must be a number in {bracket}{low:g}, {high:g}], got {value!r}", param=name
        )
    return float(value)


def _bool_field(body: Mapping[str, Any], name: str, *, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(
            f"{where}{name}: must be true or false, got {value!r}", param=f"{where}{name}"
        )
    return value


# our wire names -> the OpenAI API's (chat: the prompt is the messages); longest first
_PUBLIC_NAMES: tuple[tuple[str, str], ...] = (
    ("sampling.max_new_tokens", "max_tokens"),
    ("sampling.stop_token_ids", "stop_token_ids"),
    ("sampling.temperature", "temperature"),
    ("prompt_token_ids", "prompt"),
    ("max_new_tokens", "max_tokens"),
    ("sampling.top_p", "top_p"),
    ("sampling.top_k", "top_k"),
    ("sampling.stop", "stop"),
    ("prompt_text", "prompt"),
)
_WIRE_NAME = re.compile(
    r"(?<![\w.])(" + "|".join(re.escape(w) for w, _ in _PUBLIC_NAMES) + r")(?![\w])"
)
_CONTEXT = re.compile(r"max_context_tokens=(\d+)")
_LEADING_FIELD = re.compile(r"(\w+): ")
_KV_POOL = re.compile(r"num_kv_slots=(\d+) tokens")


def in_public_terms(exc: ServiceError, kind: Kind) -> ServiceError:
    """A bad request refused by the router or a worker (in the gRPC API's field names), said
    in the OpenAI API's: ``max_tokens``, ``prompt`` / ``messages``, and ``param`` filled."""
    if type(exc) is not BadRequest:
        return exc
    names = dict(_PUBLIC_NAMES)
    if kind == "chat":
        names.update({"prompt_token_ids": "messages", "prompt_text": "messages"})
    message = _WIRE_NAME.sub(lambda m: names[m.group(1)], exc.message)
    message = _CONTEXT.sub(r"the model's context length of \1 tokens", message)
    message = _KV_POOL.sub(r"the worker's KV pool of \1 tokens", message)
    param = exc.param
    if param is not None:
        param = names.get(param, "messages" if kind == "chat" and param == "prompt" else param)
    else:  # a worker's refusal crossed gRPC as text: its field leads the message
        lead = _LEADING_FIELD.match(message)
        param = lead.group(1) if lead and lead.group(1) in set(names.values()) else None
    return BadRequest(message, param=param, retry_after_s=exc.retry_after_s)
