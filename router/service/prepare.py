"""A client's GenerateRequest made ready to route and forward: fields checked, the partition
derived from the caller's tenancy, the prompt tokenized (as far as a cache may match it), a
request id assigned. BadRequest, naming the field, for anything wrong."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from edge.frontdoor import BadRequest, CallInfo
from edge.limits import RequestLimits
from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from router.core.router_core import RouterCore, RouteRequest
from router.service.tenancy import TenancyConfig, TenancyError, resolve_partition
from router.service.token_cache import CachedTokenizer
from router.service.validation import (
    RequestError,
    TextTokenizer,
    check_request,
    routing_tokens,
    tokenize_prompt,
)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request: what is forwarded, what the router routes on, and the pool it is
    routed in (its model's: router.core.pools)."""

    forward: pb.GenerateRequest
    route: RouteRequest
    model: str
    core: RouterCore


def prepare_request(
    request: pb.GenerateRequest,
    call: CallInfo,
    limits: RequestLimits,
    tenancy: TenancyConfig,
    tokenizer: TextTokenizer | None,
    pool: tuple[str, RouterCore],
    split: bool,
) -> Prepared:
    """``request`` checked and ready (BadRequest), to be routed in ``pool`` (model, core).
    With ``tokenizer`` (the pool's) a text prompt is
    forwarded as token ids; ``split``: its tail that no cache matches may be left to the
    worker (``prompt_text_suffix``), else it is tokenized whole."""
    model, core = pool
    try:
        check_request(request, limits)
        partition = resolve_partition(
            tenancy, call.metadata, codec.partition_from_pb(request.partition), call.tenant_id
        )
    except RequestError as exc:
        raise BadRequest(str(exc), param=exc.field) from None
    except TenancyError as exc:
        raise BadRequest(str(exc)) from None
    forward = pb.GenerateRequest()
    forward.CopyFrom(request)
    if not forward.request_id:
        forward.request_id = f"r-{uuid.uuid4().hex}"
    forward.partition.CopyFrom(codec.partition_to_pb(partition))
    prompt_tokens = None  # the whole prompt's length when only its head is tokenized
    if tokenizer is not None and forward.WhichOneof("prompt") == "prompt_text":
        tokens, tail = tokenize_prompt(
            tokenizer,
            forward.prompt_text,
            core,
            partition,
            limits.max_prompt_tokens,
            split=split,
            chat=forward.prompt_text_is_chat,
        )
        forward.prompt_text_is_chat = False  # ids now: the template's specials are in
        if not len(tokens):
            raise BadRequest("prompt_text encodes to no tokens", param="prompt_text")
        forward.prompt_token_ids.ids.extend(tokens.tolist())  # clears prompt_text (one oneof)
        if tail:  # only a chunk cache leaves a tail to the worker
            assert isinstance(tokenizer, CachedTokenizer)
            forward.prompt_text_suffix = tail
            prompt_tokens = len(tokens) + tokenizer.estimate_tokens(tail)
    else:
        tokens = routing_tokens(forward)
    route = RouteRequest(forward.request_id, tokens, partition, prompt_tokens=prompt_tokens)
    return Prepared(forward, route, model, core)
