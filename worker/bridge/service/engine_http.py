"""The bridge's request side: kvroute Generate calls as the engine's OpenAI completions.

A GenerateRequest with token ids becomes one streamed ``POST /v1/completions``::

    {"model": M, "prompt": [ids], "max_tokens": n, "temperature": t, "top_p": p,
     "top_k": k, "seed": s, "stop_token_ids": [...], "ignore_eos": b, "cache_salt": salt,
     "stream": true, "stream_options": {"include_usage": true}, "return_token_ids": true}

and its server-sent events come back as TokenChunk messages (each chunk's ``token_ids``;
``text`` when the engine detokenizes), then one Finished with the usage the engine's last
event reports (``prompt_tokens_details.cached_tokens`` is the cached prompt: vLLM sends it
with ``--enable-prompt-tokens-details``). Closing the HTTP response is how a request is
aborted: the engine aborts a request whose client went away.

Engine answers map to the service errors of :mod:`edge.frontdoor`: a 4xx is the caller's
mistake (INVALID_ARGUMENT, the engine's message), anything else -- a 5xx, a refused
connection, a stream that ends without a finish reason -- is UNAVAILABLE, so the router
may retry elsewhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from edge.frontdoor import BadRequest, ServiceError, Unavailable
from kvroute_proto import kvroute_pb2 as pb
from worker.bridge.service.engine_stream import EnginePool, EngineResponse

log = logging.getLogger("kvroute.bridge.http")

MAX_SSE_EVENTS = 10_000_000  # events read from one response at most (a loop bound)
MAX_READS_AFTER_DONE = 16  # lines read for the body's end after [DONE] (then it is closed)

_FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}


@dataclass(frozen=True, slots=True)
class Completion:
    """One engine stream event, in kvroute's terms."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: int | None = None  # pb.FinishReason once the engine says why it stopped
    usage: pb.Usage | None = None


@dataclass(slots=True)
class EngineModel:
    """What the engine's ``/v1/models`` says of the model it serves."""

    name: str = ""
    max_model_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def completion_body(request: pb.GenerateRequest, model: str) -> dict[str, Any]:
    """The /v1/completions body for ``request`` (BadRequest for what the engine cannot take
    through this API: a text prompt, an extra_key partition). A request that leaves
    max_new_tokens 0 leaves max_tokens to the engine (vLLM: what is left of the context)."""
    if request.WhichOneof("prompt") != "prompt_token_ids":
        raise BadRequest(
            "prompt: this bridge has no tokenizer; send prompt_token_ids (a router in front "
            "of bridges runs without --model)",
            param="prompt",
        )
    if request.prompt_text_suffix:
        raise BadRequest(
            "prompt_text_suffix: this bridge has no tokenizer; send the whole prompt as "
            "token ids (kvroute router --tokenize-whole)",
            param="prompt_text_suffix",
        )
    ids = list(request.prompt_token_ids.ids)
    if not ids:
        raise BadRequest("prompt: must contain at least 1 token, got 0", param="prompt")
    if request.partition.extra_key:
        raise BadRequest(
            "partition.extra_key: adapters are not forwarded by the bridge",
            param="partition.extra_key",
        )
    s = request.sampling
    if s.logprobs:
        raise BadRequest("logprobs: not forwarded by the bridge yet", param="logprobs")
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "temperature": float(s.temperature),
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    # 0: what is left of the context (an explicit null: vLLM's completions default is 16)
    body["max_tokens"] = int(s.max_new_tokens) if s.max_new_tokens else None
    if s.stop:
        body["stop"] = list(s.stop)  # the engine matches them on its text
    if 0 < s.top_p < 1:
        body["top_p"] = float(s.top_p)
    if s.top_k:
        body["top_k"] = int(s.top_k)
    if s.HasField("seed"):
        body["seed"] = int(s.seed)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.presence_penalty or s.frequency_penalty:
        body["presence_penalty"] = float(s.presence_penalty)
        body["frequency_penalty"] = float(s.frequency_penalty)
    if s.logit_bias:
        body["logit_bias"] = {str(t): float(b) for t, b in s.logit_bias.items()}
    if request.partition.cache_salt:
        body["cache_salt"] = request.partition.cache_salt
    return body


def decode_event(data: str) -> dict[str, Any] | None:
    """One SSE ``data:`` payload as a JSON object; None for ``[DONE]``. Raises Unavailable
    when it is not an object, or when it carries the engine's ``error``."""
    if data == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise Unavailable(
            f"the engine sent a stream event that is not JSON: {data[:80]!r}"
        ) from None
    if not isinstance(chunk, dict):
        raise Unavailable(f"the engine sent a stream event that is not an object: {data[:80]!r}")
    if "error" in chunk:
        raise Unavailable(f"the engine failed the request: {chunk['error']}")
    return chunk


def parse_event(data: str) -> Completion | None:
    """One SSE ``data:`` payload; None for ``[DONE]``. Raises Unavailable when it is not
    a completions chunk."""
    chunk = decode_event(data)
    if chunk is None:
        return None
    usage = _usage(chunk.get("usage"))
    choices = chunk.get("choices") or []
    if not choices:
        return Completion(usage=usage)
    choice = choices[0]
    ids = choice.get("token_ids") or ()
    reason = choice.get("finish_reason")
    finish = None
    if reason is not None:
        finish = _FINISH.get(reason, pb.FINISH_REASON_ABORT if reason == "abort" else None)
        if finish is None:
            finish = pb.FINISH_REASON_STOP
    return Completion(tuple(int(t) for t in ids), choice.get("text") or "", finish, usage)


def _usage(u: Any) -> pb.Usage | None:
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details") or {}
    return pb.Usage(
        prompt_tokens=int(u.get("prompt_tokens") or 0),
        completion_tokens=int(u.get("completion_tokens") or 0),
        cached_prompt_tokens=int(details.get("cached_tokens") or 0),
    )


class EngineHttp:
    """The engine's HTTP API: its GETs over one aiohttp session, the streamed completions
    over connections of the bridge's own (:mod:`.engine_stream`, decision 0038)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._pool: EnginePool | None = None

    def _streams(self) -> EnginePool:
        pool = self._pool
        if pool is None or pool.base_url != self.base_url:
            if pool is not None:
                pool.close()
            pool = self._pool = EnginePool(self.base_url, connect_timeout_s=self._connect_timeout_s)
        return pool

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, path: str, timeout_s: float = 2.0) -> Any:
        """GET ``path`` as JSON (aiohttp / OSError / TimeoutError when it cannot)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._http().get(self.base_url + path, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def get_text(self, path: str, timeout_s: float = 2.0) -> str:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._http().get(self.base_url + path, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def model(self) -> EngineModel:
        """The first model ``/v1/models`` lists."""
        data = await self.get_json("/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            raise ValueError(f"{self.base_url}/v1/models lists no model")
        first = models[0]
        return EngineModel(str(first.get("id", "")), int(first.get("max_model_len") or 0), first)

    async def open_completion(
        self, body: dict[str, Any], path: str = "/v1/completions"
    ) -> EngineResponse:
        """POST the completion (SGLang: ``path`` /generate); the response once its head
        arrived (ServiceError when the engine refuses or cannot be reached). The caller reads
        it with :func:`events` and must close it (before its end, that aborts the request on
        the engine)."""
        try:
            resp = await self._streams().open(path, body)
        except OSError as exc:  # ConnectionError, TimeoutError
            raise Unavailable(f"the engine at {self.base_url} cannot be reached: {exc!r}") from None
        if resp.status >= 400:
            try:
                text = await resp.text()
            finally:
                resp.close()
            if 400 <= resp.status < 500:
                raise BadRequest(f"the engine refused the request ({resp.status}): {text}")
            raise Unavailable(f"the engine failed the request ({resp.status}): {text}")
        return resp


async def events(
    resp: EngineResponse, parse: Callable[[str], Completion | None] = parse_event
) -> AsyncIterator[Completion]:
    """The completions of one streamed response, until ``[DONE]`` or its end (``parse``:
    one ``data:`` payload; SGLang's is :class:`.engine_sglang.SglangStream`'s). After
    ``[DONE]`` the body's end is read too, so that the connection can serve the next
    request (decision 0038)."""
    n = 0
    async for line in resp.lines():
        if not line.startswith(b"data:"):
            continue
        n += 1
        if n > MAX_SSE_EVENTS:
            raise Unavailable(f"the engine sent more than {MAX_SSE_EVENTS} stream events")
        event = parse(line[5:].decode("utf-8", "replace").strip())
        if event is None:
            await resp.finish(MAX_READS_AFTER_DONE)
            return
        yield event


__all__ = [
    "Completion",
    "EngineHttp",
    "EngineModel",
    "ServiceError",
    "completion_body",
    "events",
    "parse_event",
]
