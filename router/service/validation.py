"""Router-side checks of a GenerateRequest, and the token ids the router routes on.

The router rejects what is wrong whatever worker would serve it (INVALID_ARGUMENT, with the
field and the limit in the message) before spending a route on it; the worker still checks
what only it knows (vocabulary, context length).

Text prompts: the router has no tokenizer of the workers' model. To route a text prompt it
takes the prompt's UTF-8 bytes as token ids (byte value = id) and hashes those blocks; the
text itself is forwarded unchanged and the worker tokenizes it. For workers with a byte
tokenizer (the tiny default model, the sim executor) this is exact; for a real tokenizer it
is approximate: two texts sharing a byte prefix share routing blocks, so they still land on
the same worker through the router's predicted entries, but those entries are never
confirmed by the worker's events (which carry real token ids), so they lapse after the
prediction TTL. Clients that want exact cache-aware routing send token ids.

With the fleet's tokenizer (``kvroute router --model DIR``) the front end encodes a text
prompt itself (``tokenize_prompt``), only as far as some worker's cache may match it when the
tokenizer has a chunk cache, and forwards the ids.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edge.frontdoor import BadRequest
from edge.limits import RequestLimits
from edge.tokenizer import chat_specials
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import Partition
from router.service.token_cache import CachedTokenizer

if TYPE_CHECKING:
    from router.core.router_core import RouterCore


class RequestError(ValueError):
    """A request field the router rejects (INVALID_ARGUMENT); the message names field + limit,
    ``field`` is the field's name (the error's ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_request(req: pb.GenerateRequest, limits: RequestLimits) -> None:
    """Raise RequestError for a field no worker could accept."""
    if len(req.request_id) > limits.max_request_id_chars:
        raise RequestError(
            f"request_id must be at most {limits.max_request_id_chars} characters, "
            f"got {len(req.request_id)}",
            field="request_id",
        )
    if req.prompt_text_suffix:
        raise RequestError(
            "prompt_text_suffix is set by the router only (for the worker); send the whole "
            "prompt as prompt_text or prompt_token_ids",
            field="prompt_text_suffix",
        )
    if req.prompt_text_is_chat and req.WhichOneof("prompt") != "prompt_text":
        raise RequestError(
            "prompt_text_is_chat is set, but the prompt is not prompt_text",
            field="prompt_text_is_chat",
        )
    _check_prompt(req, limits)
    _check_sampling(req.sampling, limits)


def _check_prompt(req: pb.GenerateRequest, limits: RequestLimits) -> None:
    match req.WhichOneof("prompt"):
        case "prompt_token_ids":
            n = len(req.prompt_token_ids.ids)
            if n == 0:
                raise RequestError("prompt_token_ids must not be empty", field="prompt_token_ids")
            if n > limits.max_prompt_tokens:
                raise RequestError(
                    f"prompt_token_ids must hold at most {limits.max_prompt_tokens} tokens, "
                    f"got {n}",
                    field="prompt_token_ids",
                )
        case "prompt_text":
            n = len(req.prompt_text.encode("utf-8"))
            if n == 0:
                raise RequestError("prompt_text must not be empty", field="prompt_text")
            if n > limits.max_prompt_text_bytes:
                raise RequestError(
                    f"prompt_text must be at most {limits.max_prompt_text_bytes} UTF-8 bytes, "
                    f"got {n}",
                    field="prompt_text",
                )
        case _:
            raise RequestError(
                "prompt must be set: prompt_token_ids or prompt_text", field="prompt"
            )


def _check_sampling(s: pb.SamplingParams, limits: RequestLimits) -> None:
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise RequestError(
            f"sampling.temperature must be finite and >= 0, got {s.temperature}",
            field="sampling.temperature",
        )
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise RequestError(
            f"sampling.top_p must be in [0, 1], got {s.top_p}", field="sampling.top_p"
        )
    _at_most("sampling.max_new_tokens", s.max_new_tokens, limits.max_new_tokens)
    _at_most("sampling.stop_token_ids", len(s.stop_token_ids), limits.max_stop_token_ids, "ids")
    _at_most("sampling.stop", len(s.stop), limits.max_stop_strings, "strings")
    _at_most("sampling.logit_bias", len(s.logit_bias), limits.max_logit_bias, "entries")
    _at_most("sampling.top_logprobs", s.top_logprobs, limits.max_top_logprobs)
    for text in s.stop:
        if not 0 < len(text) <= limits.max_stop_chars:
            raise RequestError(
                f"sampling.stop strings must be 1..{limits.max_stop_chars} characters, "
                f"got {len(text)}",
                field="sampling.stop",
            )


def routing_tokens(req: pb.GenerateRequest) -> np.ndarray:
    """The token ids the router hashes for ``req`` (UTF-8 bytes for a text prompt).

    uint32, what the proto field holds, so RouterCore takes them without re-validating.
    """
    if req.WhichOneof("prompt") == "prompt_text":
        return np.frombuffer(req.prompt_text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
    return np.fromiter(
        req.prompt_token_ids.ids, dtype=np.uint32, count=len(req.prompt_token_ids.ids)
    )


class TextTokenizer(Protocol):
    """What the front end needs of the fleet's tokenizer (kvroute_proto's tokenizers)."""

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def tokenize_prompt(
    tok: TextTokenizer,
    text: str,
    core: RouterCore,
    partition: Partition,
    limit: int,
    *,
    split: bool = True,
    chat: bool = False,
) -> tuple[np.ndarray, str]:
    """``(ids, tail)`` of a text prompt for routing (uint32 ids; BadRequest past ``limit``
    tokens). ``chat``: the text is a rendered chat template (its special tokens as
    ``encode_chat`` adds them: :func:`edge.tokenizer.chat_specials`).

    With ``split`` and a chunk cache (:class:`CachedTokenizer`), only the head that some
    worker's cache may still match (``core.may_match_past``) is tokenized, and ``tail`` is
    the text the worker tokenizes (``prompt_text_suffix``); otherwise all of it."""
    specials = chat_specials(tok) if chat else None
    if split and isinstance(tok, CachedTokenizer):
        ids, tail = tok.encode_head(
            text, lambda head: core.may_match_past(head, partition), add_special_tokens=specials
        )
        # a byte-level BPE token holds at least one byte: a tail of b bytes holds at most
        # b tokens; if that bound could pass the limit, count exactly
        if not tail or len(ids) + len(tail.encode("utf-8")) <= limit:
            return _checked(ids, limit), tail
    whole = tok.encode(text) if specials is None else tok.encode(text, add_special_tokens=specials)
    return _checked(np.asarray(whole, dtype=np.uint32), limit), ""


def _checked(ids: np.ndarray, limit: int) -> np.ndarray:
    if len(ids) > limit:
        raise BadRequest(
            f"prompt_text encodes to {len(ids)} tokens; the limit is {limit}",
            param="prompt_text",
        )
    return ids


def _at_most(field: str, got: int, limit: int, unit: str = "") -> None:
    """RequestError naming ``field`` when ``got`` (a value, or a count of ``unit``) is over
    ``limit``."""
    if got > limit:
        bound = f"hold at most {limit} {unit}" if unit else f"be at most {limit}"
        raise RequestError(f"{field} must {bound}, got {got}", field=field)
