"""OpenAI's ``n`` > 1: one backend request per choice, their answers merged into one response.

Each choice is its own ``GenerateRequest`` (id ``<id>-<index>``; with a ``seed``, choice i
draws from ``seed + i``, so the choices differ and the response is reproducible). They run
at once: a worker shares their prompt's KV (its radix cache, and in-batch prefill dedup for
ones that arrive together), and the router sends them where the first one's prefix is. The
usage counts the prompt once and the completion tokens of every choice, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web

from edge import openai_api as oa
from edge.frontdoor import CallInfo, GenerationBackend, Internal, ServiceError
from kvroute_proto import kvroute_pb2 as pb


def choice_requests(api: oa.ApiRequest) -> list[oa.ApiRequest]:
    """One request per choice (ids and seeds as the module says)."""
    out = []
    for i in range(api.n):
        request = pb.GenerateRequest()
        request.CopyFrom(api.request)
        request.request_id = f"{api.request.request_id}-{i}"
        if api.request.sampling.HasField("seed"):
            request.sampling.seed = (api.request.sampling.seed + i) % (1 << 64)
        out.append(dataclasses.replace(api, request=request))
    return out


class EventStream(web.StreamResponse):
    """An SSE response whose headers leave with its first event: aiohttp sends a
    StreamResponse's headers at ``prepare`` (one socket write of their own) unless told
    otherwise, and a write is a system call on the time to first token."""

    _send_headers_immediately = False


async def start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    resp = EventStream(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    return resp


async def merged(
    backend: GenerationBackend, apis: list[oa.ApiRequest], call: CallInfo
) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """The messages of every choice as they come, tagged with the choice's index. Leaving
    early (an error, a client gone) closes every backend stream, aborting its request."""
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, api: oa.ApiRequest) -> None:
        try:
            async with contextlib.aclosing(backend.generate(api.request, call)) as messages:
                async for msg in messages:
                    await queue.put((index, msg))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, api)) for i, api in enumerate(apis)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(outs: list[oa.ApiOutput]) -> dict[str, Any]:
    """The prompt once, every choice's completion tokens."""
    usage = outs[0].usage()
    completion = sum(out.usage()["completion_tokens"] for out in outs)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = usage["prompt_tokens"] + completion
    return usage


async def serve_n(
    request: web.Request,
    backend: GenerationBackend,
    api: oa.ApiRequest,
    call: CallInfo,
    headers: dict[str, str],
) -> web.StreamResponse:
    """The response of an ``n`` > 1 request, streamed or not (``headers``: the shell's)."""
    model, created = api.request.model or backend.model_name, int(time.time())
    apis = choice_requests(api)
    outs = [oa.ApiOutput(a, index=i) for i, a in enumerate(apis)]
    messages = merged(backend, apis, call)
    async with contextlib.aclosing(messages):
        if not api.stream:
            async for index, msg in messages:
                outs[index].push(msg)
            if any(out.finished is None for out in outs):
                raise Internal("a choice's stream ended without a Finished message")
            body = oa.full_response(outs[0], model, created)
            body["choices"] = [oa.full_response(out, model, created)["choices"][0] for out in outs]
            body["usage"] = total_usage(outs)
            return web.Response(
                body=oa.dumps(body), content_type="application/json", headers=headers
            )
        first = await anext(messages, None)  # a refusal is a plain HTTP error
        resp = await start_sse(request, headers)
        try:
            await _stream(resp, api, outs, first, messages, model, created)
        except ServiceError as exc:
            await resp.write(oa.sse_event(oa.error_body(exc)))
        await resp.write_eof(oa.SSE_DONE)
        return resp


async def _stream(
    resp: web.StreamResponse,
    api: oa.ApiRequest,
    outs: list[oa.ApiOutput],
    item: tuple[int, pb.GenerateResponse] | None,
    messages: AsyncIterator[tuple[int, pb.GenerateResponse]],
    model: str,
    created: int,
) -> None:
    if api.kind == "chat":
        for out in outs:
            await resp.write(oa.sse_event(oa.delta_chunk(out, model, created, "", first=True)))
    while item is not None:
        index, msg = item
        out = outs[index]
        text = out.push(msg)
        if text:
            await resp.write(oa.sse_event(oa.delta_chunk(out, model, created, text)))
        elif text is None:
            await resp.write(oa.sse_event(oa.finish_chunk(out, model, created)))
        item = await anext(messages, None)
    if any(out.finished is None for out in outs):
        raise Internal("a choice's stream ended without a Finished message")
    if api.include_usage:
        last = oa.usage_chunk(outs[0], model, created)
        last["usage"] = total_usage(outs)
        await resp.write(oa.sse_event(last))
