"""edge.http_front over a scripted backend, on a real aiohttp server (127.0.0.1,
port 0): what reaches the backend, and how each backend outcome becomes HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp

from edge.frontdoor import CallInfo, Overloaded, ServiceError, Unavailable
from edge.http_front import HttpFront, HttpFrontConfig, build_app
from kvroute_proto import kvroute_pb2 as pb


class ScriptedBackend:
    """Yields ``script`` (messages; an exception is raised where it stands) per request and
    records what it was called with and whether the iterator was closed early."""

    model_name = "m"
    tokenizer = None

    def __init__(self, script: list[pb.GenerateResponse | ServiceError], hang: bool = False):
        self.script = script
        self.hang = hang
        self.calls: list[tuple[pb.GenerateRequest, CallInfo]] = []
        self.closed_early = asyncio.Event()

    async def generate(
        self, request: pb.GenerateRequest, call: CallInfo
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls.append((request, call))
        done = False
        try:
            for item in self.script:
                if isinstance(item, ServiceError):
                    raise item
                yield item
            if self.hang:
                await asyncio.Event().wait()
            done = True
        finally:
            if not done:
                self.closed_early.set()


def chunk(text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[1], text=text))


FINISHED = pb.GenerateResponse(
    finished=pb.Finished(
        reason=pb.FINISH_REASON_STOP,
        usage=pb.Usage(prompt_tokens=2, completion_tokens=1),
        worker_id="w1",
    )
)


@contextlib.asynccontextmanager
async def serving(backend: ScriptedBackend, health=lambda: None):
    front = HttpFront(build_app(backend, health), HttpFrontConfig())
    await front.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield session, f"http://{front.address}"
    finally:
        await front.stop()


async def test_headers_reach_the_backend_and_a_request_id_is_made_up() -> None:
    backend = ScriptedBackend([chunk("a"), FINISHED])
    async with serving(backend) as (s, url):
        headers = {"X-Tenant-Id": "acme", "traceparent": "00-ab-cd-01"}
        async with s.post(url + "/v1/completions", json={"prompt": "p"}, headers=headers) as r:
            body = await r.json()
            rid = r.headers["X-Request-Id"]
        (request, call) = backend.calls[0]
        assert request.request_id == rid and len(rid) == 32 and body["id"] == f"cmpl-{rid}"
        assert ("x-tenant-id", "acme") in call.metadata
        assert ("traceparent", "00-ab-cd-01") in call.metadata
        assert body["choices"][0]["text"] == "a" and body["choices"][0]["finish_reason"] == "stop"


async def test_a_refusal_before_the_first_message_is_an_http_error_even_when_streaming() -> None:
    backend = ScriptedBackend(
        [Overloaded("router has 9 in flight, the limit is 8", retry_after_s=2)]
    )
    async with serving(backend) as (s, url):
        body = {"prompt": "p", "stream": True}
        async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "q1"}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
            assert r.headers["X-Request-Id"] == "q1"
            assert (await r.json())["error"]["message"] == "router has 9 in flight, the limit is 8"


async def test_a_failure_mid_stream_is_an_error_event_then_done() -> None:
    backend = ScriptedBackend([chunk("a"), Unavailable("worker w1 went away mid-stream")])
    async with serving(backend) as (s, url):
        async with s.post(url + "/v1/completions", json={"prompt": "p", "stream": True}) as r:
            assert r.status == 200
            frames = [f for f in (await r.text()).split("\n\n") if f]
        assert json.loads(frames[0][6:])["choices"][0]["text"] == "a"
        error = json.loads(frames[1][6:])["error"]
        assert error["type"] == "service_unavailable" and "went away" in error["message"]
        assert frames[2] == "data: [DONE]"


async def test_a_stream_without_finished_is_500() -> None:
    backend = ScriptedBackend([chunk("a")])
    async with (
        serving(backend) as (s, url),
        s.post(url + "/v1/completions", json={"prompt": "p"}) as r,
    ):
        assert r.status == 500
        assert "without a Finished" in (await r.json())["error"]["message"]


async def test_a_client_that_goes_away_closes_the_backend_iterator() -> None:
    backend = ScriptedBackend([chunk("a")], hang=True)
    async with serving(backend) as (s, url):
        r = await s.post(url + "/v1/completions", json={"prompt": "p", "stream": True})
        assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
        r.close()
        await asyncio.wait_for(backend.closed_early.wait(), 10)


async def test_health_reports_the_check() -> None:
    problem: list[str | None] = [None]
    async with serving(ScriptedBackend([]), health=lambda: problem[0]) as (s, url):
        async with s.get(url + "/health") as r:
            assert r.status == 200
        problem[0] = "no healthy worker to route to"
        async with s.get(url + "/health") as r:
            assert r.status == 503
            assert (await r.json())["error"]["message"] == "no healthy worker to route to"
