"""Bad input at the router and at a worker (issue 12): Hypothesis-generated
GenerateRequests (every field, extremes, unicode) and raw bytes sent as the message through
a generic client (wrong types, truncated and garbage messages). Only documented status
codes come back, never INTERNAL or UNKNOWN, and both servers keep serving and leak nothing.

The servers run on a background event loop (one router, one in-process sim worker, for the
whole module); the test talks to them with the synchronous gRPC client, so Hypothesis drives
plain functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_harness import router_config, running_router, sim_worker

from kvroute_proto import kvroute_pb2 as pb

# what a request may be answered with (docs: errors carry their status); DEADLINE_EXCEEDED
# is the client's own timeout
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
CALL_TIMEOUT_S = 10.0
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Servers:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = contextlib.AsyncExitStack()
        self.router = ""
        self.worker = ""
        self.worker_server = None
        self.frontend = None

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        w = await self.stack.enter_async_context(sim_worker("w0"))
        r = await self.stack.enter_async_context(
            running_router([w.address], router_config([w.address]))
        )
        await r.wait_synced(1)
        self.worker, self.router = w.address, r.address
        self.worker_server, self.frontend = w.server, r.server.frontend


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    s.thread.start()
    try:
        s.run(s.start())
        yield s
    finally:
        s.run(s.stack.aclose())
        s.loop.call_soon_threadsafe(s.loop.stop)
        s.thread.join(10)


# ---- strategies ----------------------------------------------------------------------------

U32 = st.one_of(st.integers(0, 300), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
U64 = st.one_of(st.integers(0, 1000), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, 1e-45, 3.4e38]),
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud7ff\ue000", "🦙" * 10, "a" * 300, "\u202e", "\n\t"]),
)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=draw(TEXT),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        routing_key=draw(TEXT),
    )
    match draw(st.sampled_from(["ids", "text", "none"])):
        case "ids":
            req.prompt_token_ids.ids.extend(draw(st.lists(U32, max_size=40)))
        case "text":
            req.prompt_text = draw(TEXT)
    if draw(st.booleans()):
        s = req.sampling
        s.max_new_tokens = draw(st.one_of(st.integers(0, 8), U32))
        s.temperature = draw(FLOATS)
        s.top_p = draw(FLOATS)
        s.top_k = draw(U32)
        if draw(st.booleans()):
            s.seed = draw(U64)
        s.stop_token_ids.extend(draw(st.lists(U32, max_size=5)))
        s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.partition.cache_salt = draw(TEXT)
        req.partition.extra_key = draw(TEXT)
    return req


def _call(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    """Send ``payload`` as the request message (no serializer: the bytes go out as they
    are), read the answer or the stream to its end."""
    try:
        if method in UNARY:
            channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)
        else:
            for _ in channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S):
                pass
    except grpc.RpcError as exc:
        assert exc.code() in DOCUMENTED, (method, payload[:80], exc.code(), exc.details())
        assert exc.details(), "an error says what was wrong"
        return exc.code()
    return grpc.StatusCode.OK


ROUTER_GENERATE = "/kvroute.v1.Router/Generate"
WORKER_GENERATE = "/kvroute.v1.Worker/Generate"
UNARY = ("/kvroute.v1.Router/Explain", "/kvroute.v1.Router/Abort", "/kvroute.v1.Worker/GetLoad")


@pytest.fixture(scope="module")
def channels(servers: Servers) -> Iterator[dict[str, grpc.Channel]]:
    with grpc.insecure_channel(servers.router) as r, grpc.insecure_channel(servers.worker) as w:
        yield {ROUTER_GENERATE: r, WORKER_GENERATE: w} | {
            m: r if ".Router/" in m else w for m in UNARY
        }


@FUZZ
@given(req=generate_requests(), target=st.sampled_from([ROUTER_GENERATE, WORKER_GENERATE]))
def test_generated_requests_get_documented_codes(req, target, channels) -> None:
    _call(channels[target], target, req.SerializeToString())


@FUZZ
@given(
    payload=st.one_of(
        st.binary(max_size=200),
        # a valid request with a field of the wrong wire type (e.g. request_id as varint)
        st.builds(
            lambda tag, value: bytes([tag]) + value,
            st.integers(0, 255),
            st.binary(min_size=0, max_size=30),
        ),
    ),
    target=st.sampled_from([ROUTER_GENERATE, WORKER_GENERATE, *UNARY]),
)
def test_raw_bytes_as_the_message_get_documented_codes(payload, target, channels) -> None:
    _call(channels[target], target, payload)


def test_both_keep_serving_and_leak_nothing(servers: Servers, channels) -> None:
    ok = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5]),
        sampling=pb.SamplingParams(max_new_tokens=3),
    ).SerializeToString()
    for target in (ROUTER_GENERATE, WORKER_GENERATE):
        assert _call(channels[target], target, ok) == grpc.StatusCode.OK

    async def idle() -> tuple[int, int, int, int]:
        runner = servers.worker_server.runner  # type: ignore[union-attr]
        await runner.wait_until_idle()
        stats = await runner.call(runner.engine.stats)
        return (
            stats.num_running + stats.num_waiting,
            stats.num_protected_kv_tokens,
            stats.num_free_kv_tokens + stats.num_evictable_kv_tokens - stats.num_total_kv_tokens,
            servers.frontend.num_inflight,  # type: ignore[union-attr]
        )

    assert servers.run(idle()) == (0, 0, 0, 0)
