"""Protobuf <-> engine types for the worker service.

With :mod:`kvroute_proto.codec`, the only worker module that touches generated protobuf
classes. Decoding validates what the proto allows but the engine cannot take (an unset
prompt, a text too long to tokenize, non-finite sampling values) and raises
:class:`~worker.errors.InvalidRequestError` naming the field and the limit; the engine
validates the rest (vocabulary, context length, duplicate ids).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.limits import RequestLimits
from edge.tokenizer import chat_specials
from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import EventBatch, LoadReport, Snapshot
from worker.engine.types import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenLogprobs,
    Usage,
)
from worker.errors import InvalidRequestError


class TextEncoder(Protocol):
    """The part of a tokenizer that request decoding needs."""

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What GetLoad answers: the worker's identity, geometry and current load."""

    worker_id: str
    epoch: int
    block_size: int
    page_size: int
    kv_capacity_tokens: int
    max_context_tokens: int
    vocab_size: int
    executor: str
    load: LoadReport
    model_name: str = ""  # the model directory's name, or "kvroute-tiny"
    tokenizer_fingerprint: str = ""  # edge.tokenizer; routers check it matches theirs
    hash_key_fingerprint: str = ""  # kvroute_proto.hashing; routers check it matches theirs
    max_running_requests: int = 0  # the engine's running-batch cap (0: not stated)
    # (decode base, per sequence, per context token, per prefill token) seconds: the step
    # profile the router's decode-time term uses (decision 0031); zeros: not stated
    step_profile_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.MAX_CONTEXT: pb.FINISH_REASON_MAX_CONTEXT,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


# ---- decoding ----------------------------------------------------------------------------


def sampling_from_pb(msg: pb.SamplingParams, limits: RequestLimits) -> SamplingParams:
    """Decode sampling settings; 0 means "default/off" where the proto says so."""
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidRequestError(
            "sampling.temperature", f"must be a finite number >= 0, got {msg.temperature}"
        )
    if not math.isfinite(msg.top_p) or not 0 <= msg.top_p <= 1:
        raise InvalidRequestError("sampling.top_p", f"must be in [0, 1], got {msg.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(msg, name)
        if not math.isfinite(value) or not -2 <= value <= 2:
            raise InvalidRequestError(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    if not all(math.isfinite(b) and -100 <= b <= 100 for b in msg.logit_bias.values()):
        raise InvalidRequestError("sampling.logit_bias", "biases must be in [-100, 100]")
    if msg.top_logprobs > limits.max_top_logprobs:
        raise InvalidRequestError(
            "sampling.top_logprobs",
            f"must be at most {limits.max_top_logprobs}, got {msg.top_logprobs}",
        )
    return SamplingParams(
        # 0: the worker's default; its default 0: what is left of the context
        max_new_tokens=msg.max_new_tokens or limits.default_max_new_tokens or None,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.top_logprobs if msg.logprobs else None,
    )


def request_from_pb(
    msg: pb.GenerateRequest,
    *,
    tokenizer: TextEncoder | None,
    limits: RequestLimits,
    new_request_id: Callable[[], str],
) -> EngineRequest:
    """Decode a GenerateRequest into an EngineRequest (empty request_id -> a new one)."""
    request_id = msg.request_id or new_request_id()
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidRequestError(
            "request_id",
            f"at most {limits.max_request_id_chars} characters, got {len(request_id)}",
        )
    match msg.WhichOneof("prompt"):
        case "prompt_token_ids":
            token_ids = np.asarray(msg.prompt_token_ids.ids, dtype=np.int64)
        case "prompt_text":
            # a rendered chat template: its special tokens as encode_chat adds them
            chat = msg.prompt_text_is_chat and tokenizer is not None
            specials = chat_specials(tokenizer) if chat else None
            token_ids = _encode_text(msg.prompt_text, tokenizer, limits, specials=specials)
        case _:
            raise InvalidRequestError(
                "prompt", "set one of prompt_token_ids or prompt_text (neither was set)"
            )
    if msg.prompt_text_suffix:
        token_ids = _append_suffix(token_ids, msg, tokenizer, limits)
    if msg.prompt_text_is_chat and msg.WhichOneof("prompt") != "prompt_text":
        raise InvalidRequestError("prompt_text_is_chat", "set, but the prompt is not prompt_text")
    if token_ids.size == 0:
        raise InvalidRequestError("prompt", "must contain at least 1 token, got 0")
    _check_stop(msg.sampling.stop, tokenizer, limits)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling=sampling_from_pb(msg.sampling, limits),
        partition=codec.partition_from_pb(msg.partition),
        priority=msg.priority,
        routing_key=msg.routing_key,
    )


def _check_stop(stops: Sequence[str], tokenizer: TextEncoder | None, limits: RequestLimits) -> None:
    """Stop strings are matched on the decoded text: they need a tokenizer."""
    if not stops:
        return
    if tokenizer is None:
        raise InvalidRequestError("stop", "this worker has no tokenizer; use stop_token_ids")
    if len(stops) > limits.max_stop_strings:
        raise InvalidRequestError(
            "stop", f"at most {limits.max_stop_strings} strings, got {len(stops)}"
        )
    if not all(0 < len(text) <= limits.max_stop_chars for text in stops):
        raise InvalidRequestError("stop", f"each must be 1..{limits.max_stop_chars} characters")


def _append_suffix(
    token_ids: np.ndarray,
    msg: pb.GenerateRequest,
    tokenizer: TextEncoder | None,
    limits: RequestLimits,
) -> np.ndarray:
    """``token_ids`` + the ids of ``prompt_text_suffix`` (no special tokens): a router
    that tokenized only the routable head of a text prompt sends the rest as text."""
    if msg.WhichOneof("prompt") != "prompt_token_ids":
        raise InvalidRequestError(
            "prompt_text_suffix", "only follows prompt_token_ids, not prompt_text"
        )
    tail = _encode_text(msg.prompt_text_suffix, tokenizer, limits, "prompt_text_suffix", False)
    return np.concatenate((token_ids, tail))


def _encode_text(
    text: str,
    tokenizer: TextEncoder | None,
    limits: RequestLimits,
    field: str = "prompt_text",
    specials: bool | None = None,
) -> np.ndarray:
    """The ids of ``field``'s text; ``specials``: ``add_special_tokens`` (None: the
    tokenizer's default)."""
    if tokenizer is None:
        raise InvalidRequestError(field, "this worker has no tokenizer; send prompt_token_ids")
    if len(text) > limits.max_prompt_text_chars:
        raise InvalidRequestError(
            field, f"at most {limits.max_prompt_text_chars} characters, got {len(text)}"
        )
    if specials is None:
        return np.asarray(tokenizer.encode(text), dtype=np.int64)
    return np.asarray(tokenizer.encode(text, add_special_tokens=specials), dtype=np.int64)


# ---- encoding ----------------------------------------------------------------------------


def chunk_to_pb(
    request_id: str,
    token_ids: Sequence[int],
    text: str,
    logprobs: Sequence[TokenLogprobs] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> pb.GenerateResponse:
    """A chunk of tokens, their text and, when asked, their logprobs (each token's text
    by ``decode``)."""
    chunk = pb.TokenChunk(token_ids=token_ids, text=text)
    if logprobs:
        name = decode or (lambda ids: "")
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            chunk.logprobs.append(
                pb.TokenLogprob(
                    token_id=token_id,
                    token=name([token_id]),
                    logprob=lp.logprob,
                    top=[pb.TopLogprob(token_id=t, token=name([t]), logprob=v) for t, v in lp.top],
                )
            )
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def finished_to_pb(
    request_id: str, reason: FinishReason, usage: Usage | None, worker_id: str
) -> pb.GenerateResponse:
    finished = pb.Finished(reason=_FINISH_REASONS[reason], worker_id=worker_id)
    if usage is not None:
        finished.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=usage.prompt_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens,
                completion_tokens=usage.completion_tokens,
            )
        )
    return pb.GenerateResponse(request_id=request_id, finished=finished)


def abort_response_to_pb(found: bool) -> pb.AbortResponse:
    return pb.AbortResponse(found=found)


def worker_info_to_pb(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=info.worker_id,
        epoch=info.epoch,
        block_size=info.block_size,
        page_size=info.page_size,
        kv_capacity_tokens=info.kv_capacity_tokens,
        max_context_tokens=info.max_context_tokens,
        vocab_size=info.vocab_size,
        executor=info.executor,
        load=codec.load_to_pb(info.load),
        model_name=info.model_name,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        hash_key_fingerprint=info.hash_key_fingerprint,
        max_running_requests=info.max_running_requests,
        step_decode_base_s=info.step_profile_s[0],
        step_decode_s_per_seq=info.step_profile_s[1],
        step_decode_s_per_context_token=info.step_profile_s[2],
        step_prefill_s_per_token=info.step_profile_s[3],
    )


def stream_message_to_pb(item: EventBatch | Snapshot) -> pb.KvStreamMessage:
    """One KV stream message (encoded once, shared by every subscriber)."""
    return codec.stream_message_to_pb(item)


def run_to_pb(messages: list[pb.KvStreamMessage]) -> pb.KvStreamMessage:
    """Consecutive batch messages of one subscriber as one message (decision 0056)."""
    return codec.run_to_pb(messages)
