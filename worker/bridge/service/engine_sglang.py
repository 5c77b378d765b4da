"""The bridge's request side for SGLang: kvroute Generate calls as SGLang's ``/generate``.

A GenerateRequest with token ids becomes one streamed ``POST /generate``::

    {"input_ids": [ids], "stream": true, "cache_salt": salt,
     "sampling_params": {"max_new_tokens": n, "temperature": t, "top_p": p, "top_k": k,
                         "sampling_seed": s, "stop": [...], "stop_token_ids": [...],
                         "ignore_eos": b, "presence_penalty": .., "frequency_penalty": ..,
                         "logit_bias": {...}}}

Its server-sent events are ``{"text", "output_ids", "meta_info": {"prompt_tokens",
"completion_tokens", "cached_tokens", "finish_reason": null | {"type": "length" | "stop" |
"abort", ...}}}``, then ``[DONE]``. By default (``--incremental-streaming-output`` off) text
and output_ids are the whole output so far; with it, only the new part. The parser tells the
two apart by ``meta_info.completion_tokens`` (always the running total), so both work.
Closing the HTTP response aborts the request: SGLang aborts a request whose client left.

Load: SGLang's ``/metrics`` (``--enable-metrics``): ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:max_total_num_tokens``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from edge.frontdoor import Unavailable
from kvroute_proto import kvroute_pb2 as pb
from worker.bridge.service.engine_http import Completion, completion_body, decode_event
from worker.bridge.service.engine_state import EngineLoad, metric_lines

__all__ = ["SglangStream", "generate_body", "parse_sglang_metrics"]

_FINISH = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}
_SGLANG_LOAD = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:max_total_num_tokens",
)
# /v1/completions body keys -> SGLang sampling_params keys (the same checks apply first)
_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "sampling_seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
}


def generate_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The /generate body for ``request``: the completions body's checks and sampling
    (BadRequest for what the engine cannot take), in SGLang's names. max_new_tokens 0
    leaves the length to the engine (its default)."""
    completion = completion_body(request, model="")
    params = {
        ours: completion[theirs]
        for theirs, ours in _SAMPLING.items()
        if completion.get(theirs) is not None
    }
    body: dict[str, Any] = {
        "input_ids": completion["prompt"],
        "sampling_params": params,
        "stream": True,
    }
    if "cache_salt" in completion:
        body["cache_salt"] = completion["cache_salt"]
    return body


class SglangStream:
    """One /generate stream's events as :class:`Completion` deltas."""

    def __init__(self) -> None:
        self.num_tokens = 0  # tokens handed on so far
        self.text_len = 0  # characters of text handed on so far (cumulative mode)

    def parse(self, data: str) -> Completion | None:
        """One SSE ``data:`` payload; None for ``[DONE]``. Raises Unavailable when it is not
        a /generate event."""
        chunk = decode_event(data)
        if chunk is None:
            return None
        meta = chunk.get("meta_info")
        ids = chunk.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise Unavailable(f"the engine sent an event without output_ids: {data[:80]!r}")
        total = int(meta.get("completion_tokens") or 0)
        text = str(chunk.get("text") or "")
        cumulative = len(ids) == total  # the whole output so far (incremental: the new part)
        new = max(total - self.num_tokens, 0)
        delta = ids[len(ids) - new :] if new else []
        if cumulative:
            text, self.text_len = text[self.text_len :], len(text)
        self.num_tokens = max(total, self.num_tokens)
        reason = meta.get("finish_reason")
        finish = None
        usage = None
        if isinstance(reason, dict):
            finish = _FINISH.get(str(reason.get("type")), pb.FINISH_REASON_STOP)
            usage = pb.Usage(
                prompt_tokens=int(meta.get("prompt_tokens") or 0),
                completion_tokens=total,
                cached_prompt_tokens=int(meta.get("cached_tokens") or 0),
            )
        return Completion(tuple(int(t) for t in delta), text, finish, usage)


def parse_sglang_metrics(text: str) -> EngineLoad | None:
    """The load in an SGLang ``/metrics`` page; None when it has none of SGLang's names."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metric_lines(text, _SGLANG_LOAD)):
        for sample in family.samples:
            if sample.name in _SGLANG_LOAD:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    if not values:
        return None
    return EngineLoad(
        running=int(values.get("sglang:num_running_reqs", 0)),
        waiting=int(values.get("sglang:num_queue_reqs", 0)),
        kv_usage=min(max(values.get("sglang:token_usage", 0.0), 0.0), 1.0),
        kv_total_tokens=int(values.get("sglang:max_total_num_tokens", 0)),
    )
