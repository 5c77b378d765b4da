"""Router Generate/Abort/Explain against scripted fake workers: retries, pass-through,
ejection, deadlines, cancellation, admission and tenancy -- exact outcomes."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import aiohttp
import grpc
import numpy as np
import pytest
from router_fake_worker import FakeWorker, running_fake
from router_harness import FAST_CONN, WAIT_S, router_config, running_router

from bench.bpe import BOS, CHAT_TEMPLATE, EOS, english_like_text, train_bpe
from edge.http_front import HttpFrontConfig
from edge.limits import RequestLimits
from edge.tokenizer import HFTokenizer, TokenizerSettings
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import BlockStored, EventBatch, Partition
from kvroute_proto.hashing import block_hash_list
from router.cli.client import GenerateOptions, build_request, format_explain
from router.core.admission import AdmissionConfig
from router.service.frontend import FrontendConfig
from router.service.resilience import EjectionConfig
from router.service.server import RegistryConfig, RouterServer
from router.service.tenancy import TenancyConfig
from router.service.validation import routing_tokens

PROMPT = list(range(1, 17))  # 4 blocks of 4


@pytest.fixture(params=[False, True], ids=["own-streams", "relay-stream"])
def relay(request) -> bool:
    """Whether the fake workers offer the relay stream and take requests started on it
    (decisions 0033, 0034): every test of the request path runs both ways."""
    return request.param


@pytest.fixture
async def fleet(request, relay):
    """Two fake workers w0, w1 behind a router; ``request.param`` overrides FrontendConfig."""
    overrides = getattr(request, "param", {})
    a, b = FakeWorker("w0", relay=relay), FakeWorker("w1", relay=relay)
    async with running_fake(a) as ra, running_fake(b) as rb:
        config = router_config([ra.address, rb.address])
        if overrides:
            config = dataclasses.replace(
                config, service=dataclasses.replace(config.service, **overrides)
            )
        async with running_router([ra.address, rb.address], config) as router:
            await router.wait_synced(2)
            conns = router.server.pool.conns.values()
            await router.wait_for(lambda: all(c.relay.ready == relay for c in conns))
            yield router, a, b


async def hold(router, fake: FakeWorker, tokens: list[int], seq: int = 1) -> None:
    """Make ``fake`` announce that it holds ``tokens``' blocks; wait until indexed."""
    hashes = tuple(block_hash_list(tokens, fake.block_size, Partition().seed))
    stored = BlockStored(hashes, None, tuple(tokens[: len(hashes) * fake.block_size]))
    fake.push(EventBatch(fake.worker_id, fake.epoch, seq, fake.block_size, (stored,)))
    core = router.server.core
    await router.wait_for(lambda: set(hashes) <= core.worker_blocks(fake.worker_id))


def fakes_by_id(a: FakeWorker, b: FakeWorker) -> dict[str, FakeWorker]:
    return {a.worker_id: a, b.worker_id: b}


async def test_generate_relays_stream_and_reports_worker_and_usage(fleet):
    router, a, b = fleet
    a.cached_prompt_tokens = b.cached_prompt_tokens = 8
    r = await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
    assert r.request_id == "r1"
    assert r.token_ids == (1, 2, 3)
    assert r.worker_id in ("w0", "w1") and r.attempts == 1
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens) == (16, 8, 3)
    served = fakes_by_id(a, b)[r.worker_id]
    assert [x.request.request_id for x in served.received] == ["r1"]
    # in-flight accounting is back to zero
    assert router.server.core.stats().num_inflight_requests == 0
    assert router.server.frontend.num_inflight == 0


async def test_router_assigns_a_request_id_when_empty(fleet):
    router, a, b = fleet
    r = await router.client.generate(PROMPT)
    assert r.request_id.startswith("r-")
    served = fakes_by_id(a, b)[r.worker_id]
    assert served.received[0].request.request_id == r.request_id


async def test_same_prefix_goes_to_the_same_worker(fleet):
    router, _, _ = fleet
    first = await router.client.generate(PROMPT)
    for i in range(3):
        r = await router.client.generate([*PROMPT, 100 + i])
        assert r.worker_id == first.worker_id


async def test_failure_before_first_token_retries_once_on_the_other_worker(fleet):
    router, a, b = fleet
    await hold(router, a, PROMPT)  # w0 is the first choice
    assert (await router.client.explain(PROMPT)).chosen_worker_id == "w0"
    a.behaviour = "fail_before"
    r = await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
    assert (r.worker_id, r.attempts) == ("w1", 2)
    assert [x.request.request_id for x in a.received] == ["r1"]
    assert [x.request.request_id for x in b.received] == ["r1"]
    assert router.server.frontend.num_retries == 1
    assert router.server.core.stats().num_inflight_requests == 0


async def test_both_workers_failing_gives_unavailable_naming_both(fleet):
    router, a, b = fleet
    a.behaviour = b.behaviour = "fail_before"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.client.generate(PROMPT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "w0" in err.value.details() and "w1" in err.value.details()
    assert "max_attempts=2" in err.value.details()
    assert len(a.received) == len(b.received) == 1


async def _stream_until_error(router, a, b, behaviour: str):
    """Both workers misbehave as ``behaviour``; stream PROMPT until the RPC fails.
    Returns (the error, the messages received before it)."""
    a.behaviour = b.behaviour = behaviour
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for msg in router.client.stream(PROMPT):
            received.append(msg)
    return err.value, received


async def test_failure_after_first_token_is_not_retried(fleet):
    router, a, b = fleet
    err, received = await _stream_until_error(router, a, b, "fail_after")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "after the response had started" in err.details()
    assert [list(m.chunk.token_ids) for m in received] == [[1]]
    assert len(a.received) + len(b.received) == 1  # no duplicate attempt


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ],
)
async def test_request_errors_pass_through_uncounted(fleet, code):
    router, a, b = fleet
    a.behaviour = b.behaviour = "fail_before"
    a.fail_code = b.fail_code = code
    for _ in range(4):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.client.generate(PROMPT)
        assert err.value.code() == code
        assert "scripted failure" in err.value.details()
    assert len(a.received) + len(b.received) == 4  # never retried
    assert router.server.frontend.ejector.ejected() == frozenset()


@pytest.mark.parametrize(
    "fleet",
    [{"ejection": EjectionConfig(max_consecutive_failures=2, cooldown_s=60.0)}],
    indirect=True,
)
async def test_consecutive_internal_errors_eject_the_worker(fleet):
    router, a, _ = fleet
    a.behaviour = "fail_before"
    a.fail_code = grpc.StatusCode.INTERNAL
    # w0 fails twice (each time the request is retried on w1 and succeeds) -> ejected
    for i in range(2):
        prompt = [*PROMPT, 50 + i, 50, 50, 50]
        await hold(router, a, prompt, seq=i + 1)  # w0 holds the longest prefix: first choice
        r = await router.client.generate(prompt, GenerateOptions(request_id=f"x{i}"))
        assert (r.worker_id, r.attempts) == ("w1", 2)
    assert router.server.frontend.ejector.ejected() == {"w0"}
    expl = await router.client.explain(PROMPT)
    assert {w.worker_id: w.healthy for w in expl.workers} == {"w0": False, "w1": True}
    for i in range(4):
        r = await router.client.generate(PROMPT, GenerateOptions(request_id=f"y{i}"))
        assert (r.worker_id, r.attempts) == ("w1", 1)
    assert len(a.received) == 2


@pytest.mark.parametrize("fleet", [{"max_inflight": 1}], indirect=True)
async def test_max_inflight_gives_resource_exhausted(fleet):
    router, a, b = fleet
    _, call = await _hanging_call(router, a, b, "long")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.client.generate(PROMPT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_inflight=1" in err.value.details()
    call.cancel()


async def test_client_cancel_cancels_the_worker_call(fleet):
    router, a, b = fleet
    _, call = await _hanging_call(router, a, b, "c1")
    call.cancel()
    # the cancellation crosses two gRPC hops
    await asyncio.wait_for(_either(a.cancelled_event, b.cancelled_event), WAIT_S)
    assert a.cancelled + b.cancelled == ["c1"]
    await router.wait_for(lambda: router.server.frontend.num_inflight == 0)
    assert router.server.core.stats().num_inflight_requests == 0


async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
    wa = asyncio.ensure_future(a.wait())
    wb = asyncio.ensure_future(b.wait())
    await asyncio.wait((wa, wb), return_when=asyncio.FIRST_COMPLETED)
    wa.cancel()
    wb.cancel()


async def _hanging_call(router, a: FakeWorker, b: FakeWorker, request_id: str):
    """Both workers hang; start ``request_id`` and wait until one of them holds it."""
    a.behaviour = b.behaviour = "hang"
    stub = pb_grpc.RouterStub(router.client._channel)
    call = stub.Generate(build_request(PROMPT, GenerateOptions(request_id=request_id)))
    await asyncio.wait_for(_either(a.hanging, b.hanging), WAIT_S)
    return stub, call


async def test_deadline_is_propagated_and_capped(fleet):
    router, a, b = fleet
    stub = pb_grpc.RouterStub(router.client._channel)
    req = build_request(PROMPT, GenerateOptions(request_id="d1"))
    [m async for m in stub.Generate(req, timeout=3.0)]
    got = [x.time_remaining for x in a.received + b.received]
    assert len(got) == 1 and 0 < got[0] <= 3.5
    # no client deadline: the router's cap applies
    req = build_request(PROMPT, GenerateOptions(request_id="d2"))
    [m async for m in stub.Generate(req)]
    got = [x.time_remaining for x in a.received + b.received if x.request.request_id == "d2"]
    cap = router.server.config.service.max_deadline_s
    assert len(got) == 1 and cap - 5 < got[0] <= cap + 1.5  # the wire rounds timeouts up


@pytest.mark.parametrize("fleet", [{"max_deadline_s": 0.5}], indirect=True)
async def test_a_deadline_passing_on_the_worker_ends_the_request_and_cancels_it(fleet):
    router, a, b = fleet
    a.behaviour = b.behaviour = "hang"
    stub = pb_grpc.RouterStub(router.client._channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(build_request(PROMPT, GenerateOptions(request_id="x")))]
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(_either(a.cancelled_event, b.cancelled_event), WAIT_S)
    assert a.cancelled + b.cancelled == ["x"]
    await router.wait_for(lambda: router.server.frontend.num_inflight == 0)
    assert router.server.core.stats().num_inflight_requests == 0


@pytest.mark.parametrize("fleet", [{"max_deadline_s": 2.0}], indirect=True)
async def test_client_deadline_above_the_cap_is_capped(fleet):
    router, a, b = fleet
    stub = pb_grpc.RouterStub(router.client._channel)
    [m async for m in stub.Generate(build_request(PROMPT, GenerateOptions()), timeout=30)]
    (got,) = [x.time_remaining for x in a.received + b.received]
    assert 0 < got <= 2.5  # the wire rounds timeouts up


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "prompt must be set"),
        (pb.GenerateRequest(prompt_text=""), "prompt_text must not be empty"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds()), "prompt_token_ids must not be empty"),
        (
            pb.GenerateRequest(prompt_text="x", sampling=pb.SamplingParams(temperature=-1)),
            "sampling.temperature must be finite and >= 0",
        ),
        (
            pb.GenerateRequest(prompt_text="x", sampling=pb.SamplingParams(top_p=1.5)),
            "sampling.top_p must be in [0, 1]",
        ),
        (
            pb.GenerateRequest(prompt_text="x", request_id="r" * 257),
            "request_id must be at most 256 characters, got 257",
        ),
    ],
)
async def test_bad_input_is_rejected_at_the_router(fleet, request_, message):
    router, a, b = fleet
    stub = pb_grpc.RouterStub(router.client._channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(request_)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert a.received == b.received == []


async def test_duplicate_inflight_request_id_is_rejected(fleet):
    router, a, b = fleet
    stub, call = await _hanging_call(router, a, b, "dup")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(build_request(PROMPT, GenerateOptions(request_id="dup")))]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'dup' is already in flight" in err.value.details()
    call.cancel()


async def test_abort_is_forwarded_to_the_serving_worker(fleet):
    router, a, b = fleet
    _, call = await _hanging_call(router, a, b, "ab")
    assert await router.client.abort("ab") is True
    assert a.aborted + b.aborted == ["ab"]
    assert await router.client.abort("unknown") is False
    call.cancel()


async def test_no_healthy_worker_gives_unavailable():
    async with running_router(["127.0.0.1:1"]) as router:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.client.generate(PROMPT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker available" in err.value.details()


async def test_tenant_salt_overwrites_the_body_salt():
    a = FakeWorker("w0")
    async with running_fake(a) as ra:
        config = router_config(
            [ra.address],
            service=FrontendConfig(tenancy=TenancyConfig(salt_secret=b"k")),
        )
        async with running_router([ra.address], config, tenant="acme") as router:
            await router.wait_synced(1)
            req = build_request(PROMPT, GenerateOptions(extra_key="lora-a"))
            req.partition.cache_salt = "forged"
            stub = pb_grpc.RouterStub(router.client._channel)
            [m async for m in stub.Generate(req, metadata=(("x-tenant-id", "acme"),))]
            [m async for m in stub.Generate(req)]  # anonymous
    salts = [(x.request.partition.cache_salt, x.request.partition.extra_key) for x in a.received]
    assert salts[0][0].startswith("t:") and "acme" not in salts[0][0]
    assert salts[0][1] == "lora-a"
    assert salts[1] == ("", "lora-a")


async def test_explain_lists_every_worker_and_the_pick(fleet):
    router, _, _ = fleet
    expl = await router.client.explain(PROMPT)
    assert expl.policy == "cache_aware" and expl.prompt_tokens == 16
    assert sorted(w.worker_id for w in expl.workers) == ["w0", "w1"]
    assert expl.chosen_worker_id in ("w0", "w1")
    assert all(w.healthy and w.cost is not None and math.isfinite(w.cost) for w in expl.workers)
    assert all(w.not_candidate_reason == "" for w in expl.workers)
    addresses = {w.address for w in expl.workers}
    assert addresses == set(router.server.config.workers)


async def test_explain_shows_the_recent_work_a_request_left(fleet):
    router, _, _ = fleet
    result = await router.client.generate(PROMPT)
    expl = await router.client.explain(PROMPT)
    recent = {w.worker_id: w.recent_prefill_tokens for w in expl.workers}
    # 16 uncached tokens plus half a token per generated one (the Finished usage the router
    # relayed), decayed over the milliseconds since (30 s window)
    assert result.completion_tokens > 0
    left = 16 + 0.5 * result.completion_tokens
    assert 0.95 * left < recent[result.worker_id] <= left
    assert [v for k, v in recent.items() if k != result.worker_id] == [0.0]


async def test_abort_from_another_tenant_does_not_find_the_request():
    a = FakeWorker("w0", behaviour="hang")
    async with running_fake(a) as ra, running_router([ra.address], tenant="acme") as router:
        await router.wait_synced(1)
        stub = pb_grpc.RouterStub(router.client._channel)
        md = (("x-tenant-id", "acme"),)
        call = stub.Generate(build_request(PROMPT, GenerateOptions(request_id="t1")), metadata=md)
        await asyncio.wait_for(a.hanging.wait(), WAIT_S)
        other = await stub.Abort(pb.AbortRequest(request_id="t1"), metadata=(("x-tenant-id", "b"),))
        assert other.found is False and a.aborted == []
        assert await router.client.abort("t1") is True  # the client's tenant is acme
        assert a.aborted == ["t1"]
        call.cancel()


async def test_request_ids_are_each_tenants_own():
    a = FakeWorker("w0", behaviour="hang")
    async with running_fake(a) as ra, running_router([ra.address], tenant="acme") as router:
        await router.wait_synced(1)
        stub = pb_grpc.RouterStub(router.client._channel)
        acme, b = (("x-tenant-id", "acme"),), (("x-tenant-id", "b"),)
        req = build_request(PROMPT, GenerateOptions(request_id="t1"))
        held = stub.Generate(req, metadata=acme)
        await asyncio.wait_for(a.hanging.wait(), WAIT_S)
        a.behaviour = "ok"
        # another tenant's request of the same id is served, and its answers carry its id
        answers = [m async for m in stub.Generate(req, metadata=b)]
        assert answers and {m.request_id for m in answers} == {"t1"}
        sent = [r.request.request_id for r in a.received]
        assert sent[0] == "t1" and sent[1].startswith("t1~")  # the workers see distinct ids
        # the same tenant may not reuse an id in flight
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(req, metadata=acme)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already in flight" in err.value.details()
        # b's request is over: b's Abort finds nothing and touches acme's request not at all
        assert (await stub.Abort(pb.AbortRequest(request_id="t1"), metadata=b)).found is False
        assert a.aborted == []
        assert (await stub.Abort(pb.AbortRequest(request_id="t1"), metadata=acme)).found
        assert a.aborted == ["t1"]
        held.cancel()


async def test_explain_of_a_policy_without_cost_reports_no_cost():
    a = FakeWorker("w0")
    async with running_fake(a) as ra:
        config = router_config([ra.address])
        config = dataclasses.replace(
            config, core=dataclasses.replace(config.core, policy="round_robin")
        )
        async with running_router([ra.address], config) as router:
            await router.wait_synced(1)
            expl = await router.client.explain(PROMPT)
    assert expl.policy == "round_robin" and expl.chosen_worker_id == "w0"
    assert [(w.cost, w.not_candidate_reason) for w in expl.workers] == [(None, "")]
    assert "nan" not in format_explain(expl)


async def test_redis_outage_keeps_routing_to_static_workers():
    a = FakeWorker("w0")
    async with running_fake(a) as ra:
        config = router_config(
            [ra.address], registry=RegistryConfig("redis://127.0.0.1:1/0", poll_s=0.05)
        )
        async with running_router([ra.address], config) as router:
            await router.wait_synced(1)
            assert router.server.watcher is not None and router.server.watcher.redis_down
            r = await router.client.generate(PROMPT)
            assert r.worker_id == "w0"


async def test_trace_context_is_passed_on_to_the_worker(fleet):
    router, a, b = fleet
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    stub = pb_grpc.RouterStub(router.client._channel)
    req = build_request(PROMPT, GenerateOptions(request_id="tr"))
    [m async for m in stub.Generate(req, metadata=(("traceparent", traceparent),))]
    (got,) = [x.metadata.get("traceparent", "") for x in a.received + b.received]
    assert got.split("-")[1] == trace_id


async def test_duplicate_worker_id_and_block_size_mismatch_are_refused(caplog):
    a, dup, odd = FakeWorker("w0"), FakeWorker("w0"), FakeWorker("w2", block_size=8)
    async with running_fake(a) as ra, running_fake(dup) as rd, running_fake(odd) as ro:
        config = router_config([ra.address, rd.address, ro.address])
        config = dataclasses.replace(config, core=dataclasses.replace(config.core, block_size=4))
        async with running_router([ra.address, rd.address, ro.address], config) as router:
            await router.wait_synced(1)
            pool = router.server.pool
            conn_a, conn_d, conn_o = (pool.conns[x.address] for x in (ra, rd, ro))
            winner = pool.by_worker_id("w0")  # whichever of the two answered first
            loser = conn_d if winner is conn_a else conn_a
            assert winner in (conn_a, conn_d)
            await router.wait_for(lambda: loser.num_failures >= 2 and conn_o.num_failures >= 2)
            assert router.server.core.workers() == ["w0"]
            assert pool.by_worker_id("w0") is winner and winner.healthy
            assert not loser.healthy and not conn_o.healthy
    refusals = [r.getMessage() for r in caplog.records if "not routing to" in r.getMessage()]
    assert len(refusals) == 2  # once per address, not once per retry
    assert any("already served by" in m for m in refusals)
    assert any("block_size=8" in m for m in refusals)


async def test_closed_worker_channel_is_a_disconnect_not_an_internal_error(fleet):
    """A connection the pool is closing (its channel closed, its worker id not yet released)
    is skipped like a disconnected one: UNAVAILABLE naming both, nothing left in flight."""
    router, a, b = fleet
    closed = grpc.aio.insecure_channel("127.0.0.1:1")
    await closed.close()
    for conn in router.server.pool.conns.values():
        # what a call sees during WorkerConnection.close (Generate goes on the relay channel)
        conn.stub = conn.relay_stub = pb_grpc.WorkerStub(closed)
        conn.relay.ready = False  # close() ends the relay stream before the channels
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "w0: disconnected" in err.value.details()
    assert "w1: disconnected" in err.value.details()
    assert a.received == [] and b.received == []
    assert router.server.core.stats().num_inflight_requests == 0
    assert router.server.frontend.num_inflight == 0


async def test_failed_start_leaves_no_worker_connection_running():
    config = router_config(["127.0.0.1:1"], registry=RegistryConfig("bogus://127.0.0.1:1"))
    server = RouterServer(config)
    with pytest.raises(ValueError, match="Redis URL"):
        await server.start()
    assert server.pool.conns == {}
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("worker-conn-")] == []


async def test_stream_ending_without_finished_is_a_worker_failure(fleet):
    router, a, b = fleet
    err, received = await _stream_until_error(router, a, b, "no_finished")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "after the response had started" in err.details()
    assert "without a Finished message" in err.details()
    # (on the relay stream the three chunks, put at once, travel as one)
    assert [t for m in received for t in m.chunk.token_ids] == [1, 2, 3]
    assert len(a.received) + len(b.received) == 1  # chunks were relayed: no second attempt
    assert router.server.core.stats().num_inflight_requests == 0


async def test_empty_stream_without_finished_is_retried_on_the_other_worker(fleet):
    router, a, b = fleet
    await hold(router, a, PROMPT)  # w0 is the first choice
    a.behaviour, a.num_chunks = "no_finished", 0
    r = await router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
    assert (r.worker_id, r.attempts) == ("w1", 2)
    assert [x.request.request_id for x in b.received] == ["r1"]
    assert router.server.frontend.num_retries == 1
    assert router.server.core.stats().num_inflight_requests == 0


async def test_request_on_a_removed_worker_is_retried_not_cancelled(fleet):
    """Removing a worker (it left the registry) closes its channel under the calls in flight
    there; grpc.aio raises CancelledError for those, which is not the client's cancel."""
    router, a, b = fleet
    await hold(router, a, PROMPT)  # w0 is the first choice
    a.behaviour = "hang"
    request = router.client.generate(PROMPT, GenerateOptions(request_id="r1"))
    task = asyncio.create_task(request)
    await asyncio.wait_for(a.hanging.wait(), WAIT_S)
    await router.server.pool.remove(router.server.pool.by_worker_id("w0").address)
    r = await asyncio.wait_for(task, WAIT_S)
    assert (r.worker_id, r.attempts) == ("w1", 2)
    assert [x.request.request_id for x in b.received] == ["r1"]
    assert router.server.core.stats().num_inflight_requests == 0
    assert router.server.frontend.num_inflight == 0


async def test_unexpected_error_in_a_subscription_reconnects_instead_of_ending_it(
    fleet, monkeypatch
):
    router, a, _b = fleet
    core = router.server.core
    real = core.on_stream_message
    raised: list[str] = []

    def flaky(worker_id, msg):
        if not raised:
            raised.append(worker_id)
            raise RuntimeError("scripted bug")
        return real(worker_id, msg)

    monkeypatch.setattr(core, "on_stream_message", flaky)
    conn = router.server.pool.by_worker_id("w0")
    await hold(router, a, PROMPT)  # the replay after the reconnect applies it
    assert raised == ["w0"]
    assert conn.num_connects == 2 and conn.last_error == "RuntimeError: scripted bug"
    assert conn.healthy


def test_routing_tokens_are_uint32_as_on_the_wire():
    """The dtype RouterCore takes without re-validating (the proto field is uint32)."""
    ids = build_request([0, 7, 2**32 - 1], GenerateOptions())
    text = build_request("hé", GenerateOptions())
    assert routing_tokens(ids).dtype == np.uint32
    assert routing_tokens(ids).tolist() == [0, 7, 2**32 - 1]
    assert routing_tokens(text).dtype == np.uint32
    assert routing_tokens(text).tolist() == list("hé".encode())


class WordTokenizer:
    """A stand-in for the fleet's tokenizer: one id per whitespace-separated word."""

    def encode(self, text: str) -> list[int]:
        return [100 + int(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i - 100) for i in ids)


async def test_text_prompt_is_tokenized_by_the_router_and_forwarded_as_ids():
    """With the fleet's tokenizer the router routes a text prompt on its real token ids
    (the ids the workers' events report) and forwards those ids, not the text."""
    text = " ".join(str(i) for i in range(16))
    ids = WordTokenizer().encode(text)
    a, b = FakeWorker("w0"), FakeWorker("w1")
    async with running_fake(a) as ra, running_fake(b) as rb:
        workers = [ra.address, rb.address]
        async with running_router(workers, tokenizer=WordTokenizer()) as router:
            await router.wait_synced(2)
            await hold(router, b, ids)  # only w1 caches the prompt's real blocks
            r = await router.client.generate(text, GenerateOptions(request_id="t1"))
            assert r.worker_id == "w1"
            forwarded = b.received[0].request
            assert forwarded.WhichOneof("prompt") == "prompt_token_ids"
            assert list(forwarded.prompt_token_ids.ids) == ids
            assert a.received == []


async def test_text_prompt_that_encodes_past_the_limit_is_refused():
    a = FakeWorker("w0")
    async with running_fake(a) as ra:
        config = router_config([ra.address])
        config = dataclasses.replace(
            config,
            service=dataclasses.replace(config.service, limits=RequestLimits(max_prompt_tokens=4)),
        )
        async with running_router([ra.address], config, tokenizer=WordTokenizer()) as router:
            await router.wait_synced(1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await router.client.generate("1 2 3 4 5", GenerateOptions())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "encodes to 5 tokens; the limit is 4" in err.value.details()
            assert a.received == []


def _bpe() -> HFTokenizer:
    return HFTokenizer(
        train_bpe(512, seed=0),
        settings=TokenizerSettings(bos_token=BOS, eos_token=EOS, add_bos_token=True),
    )


async def test_a_text_prompts_unmatchable_tail_is_left_to_the_worker():
    """A real byte-level BPE: the router tokenizes the head of a long text prompt as far as
    a worker's cache goes on (here w1's events: the system text), routes on it, and sends
    the rest as prompt_text_suffix; head + the tail's own ids are the whole text's ids."""
    tok = _bpe()
    system = english_like_text(3000, seed=1)
    new = english_like_text(4000, seed=2)
    text = f"{system} {new}"
    a, b = FakeWorker("w0"), FakeWorker("w1")
    async with (
        running_fake(a) as ra,
        running_fake(b) as rb,
        running_router([ra.address, rb.address], tokenizer=tok) as router,
    ):
        await router.wait_synced(2)
        await hold(router, b, tok.encode(system))  # w1 caches the system text
        r = await router.client.generate(text, GenerateOptions(request_id="t1"))
        assert r.worker_id == "w1" and a.received == []
        forwarded = b.received[0].request
        head, tail = list(forwarded.prompt_token_ids.ids), forwarded.prompt_text_suffix
        # the router stopped within 4 chunks (512 characters each) past the system text
        assert len(new) - 4 * 600 < len(tail) < len(new)
        assert head + tok.encode(tail, add_special_tokens=False) == tok.encode(text)
        # a client may not send the router-only field
        request = build_request(list(range(20)), GenerateOptions())
        request.prompt_text_suffix = "x"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RouterStub(router.client._channel).Generate(request).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_text_suffix is set by the router only" in err.value.details()
        # the chat mark belongs to a text prompt
        request = build_request(list(range(20)), GenerateOptions())
        request.prompt_text_is_chat = True
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RouterStub(router.client._channel).Generate(request).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_text_is_chat is set, but the prompt is not prompt_text" in (
            err.value.details()
        )


async def test_a_long_chat_is_encoded_by_the_templates_rule_and_its_tail_left_to_the_worker():
    """OpenAI chat through the router's HTTP front: the rendered template is tokenized with
    encode_chat's rule for special tokens (no second bos), only as far as a worker's cache
    goes on; head + tail are the ids of encode_chat."""
    tok = HFTokenizer(
        train_bpe(512, seed=0),
        settings=TokenizerSettings(
            bos_token=BOS, eos_token=EOS, add_bos_token=True, chat_template=CHAT_TEMPLATE
        ),
    )
    messages = [
        {"role": "system", "content": english_like_text(3000, seed=1)},
        {"role": "user", "content": english_like_text(3000, seed=2)},
    ]
    whole = tok.encode_chat(messages)
    assert whole.count(tok.bos_token_id) == 1  # the template's own bos, no second one
    a, b = FakeWorker("w0"), FakeWorker("w1")
    async with running_fake(a) as ra, running_fake(b) as rb:
        addresses = [ra.address, rb.address]
        config = dataclasses.replace(router_config(addresses), http=HttpFrontConfig())
        async with running_router(addresses, config, tokenizer=tok) as router:
            await router.wait_synced(2)
            await hold(router, b, whole[: len(whole) // 3])  # w1 caches the conversation's start
            url = f"http://{router.server.http.address}/v1/chat/completions"
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, json={"messages": messages, "max_tokens": 2}) as resp,
            ):
                assert resp.status == 200, await resp.text()
            assert a.received == []
            forwarded = b.received[0].request
            head, tail = list(forwarded.prompt_token_ids.ids), forwarded.prompt_text_suffix
            assert tail and not forwarded.prompt_text_is_chat
            assert head + tok.encode(tail, add_special_tokens=False) == whole


@pytest.mark.parametrize("fleet", [{"admission": AdmissionConfig(initial_window=1)}], indirect=True)
async def test_a_deadline_no_worker_can_meet_is_refused_at_once(fleet):
    """Every worker's admission window is full: a request with a deadline is refused with
    RESOURCE_EXHAUSTED before it reaches a worker; one without a deadline still goes (its
    caller is willing to wait); ending the held calls frees the windows."""
    router, a, b = fleet
    a.behaviour = b.behaviour = "hang"
    stub = pb_grpc.RouterStub(router.client._channel)

    async def until(check, what: str) -> None:
        for _ in range(1000):  # bounded: state other tasks change, nothing to await
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    async def received(n: int) -> None:
        await until(lambda: len(a.received) + len(b.received) >= n, f"never {n} requests")

    def call(rid: str, timeout: float | None):
        opts = GenerateOptions(request_id=rid)
        return stub.Generate(build_request(PROMPT, opts), timeout=timeout)

    held = [call("h0", 30)]
    await received(1)
    held.append(call("h1", 30))
    await received(2)
    assert (len(a.received), len(b.received)) == (1, 1)  # one each: the windows are full
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call("late", 30).read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "within its deadline" in err.value.details()
    assert len(a.received) + len(b.received) == 2
    assert router.server.frontend.admission.stats.num_refused == 1
    patient = call("patient", None)
    await received(3)
    for c in (*held, patient):
        c.cancel()
    await until(lambda: router.server.frontend.num_inflight == 0, "calls never released")
    admission = router.server.frontend.admission
    assert admission.num_inflight("w0") == admission.num_inflight("w1") == 0


async def test_explain_says_why_a_dead_static_worker_is_no_candidate():
    a, b = FakeWorker("w0"), FakeWorker("w1")
    async with running_fake(a) as ra, running_fake(b) as rb:
        addresses = [ra.address, rb.address]
        keep = dataclasses.replace(FAST_CONN, purge_after_s=60.0)  # still listed
        config = router_config(addresses, connection=keep)
        async with running_router(addresses, config) as router:
            await router.wait_synced(2)
            await rb.server.stop(0)
            await router.wait_healthy(1)
            expl = await router.client.explain(PROMPT)
    by_id = {w.worker_id: w for w in expl.workers}
    assert expl.chosen_worker_id == "w0" and by_id["w0"].not_candidate_reason == ""
    assert by_id["w0"].cost is not None and math.isfinite(by_id["w0"].cost)
    dead = by_id["w1"]  # a static worker stays listed: no cost, and why (its last error)
    assert not dead.healthy and dead.cost is None
    assert dead.not_candidate_reason.startswith("unhealthy: UNAVAILABLE"), dead
    assert "nan" not in format_explain(expl)
