"""Per-tenant limits: in-flight requests and tokens per second, RESOURCE_EXHAUSTED / HTTP 429
with a retry hint, and one tenant flooding never starving another."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from secure_harness import WAIT_S, secure_worker

from edge.frontdoor import Overloaded
from edge.http_front import HttpFrontConfig
from edge.tokenizer import ByteTokenizer
from router.cli import router as router_cli
from router.cli.client import GenerateOptions, RouterClient
from router.service.quota import QuotaConfig, TenantLimit, TenantQuotas, parse_overrides
from router.service.server import RouterServer

HERE = Path(__file__).resolve().parent


def _router_config(workers, **overrides):
    sys.path.insert(0, str(HERE.parent / "router" / "service"))
    from router_harness import router_config

    return router_config(workers, **overrides)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- the quota state, exactly -----------------------------------------------------------


def test_inflight_cap_is_per_tenant_and_released():
    q = TenantQuotas(QuotaConfig(TenantLimit(max_inflight=2)), Clock())
    a1, a2 = q.acquire("a", 10), q.acquire("a", 10)
    with pytest.raises(Overloaded, match=r"tenant 'a' has 2 requests in flight; its limit is 2"):
        q.acquire("a", 10)
    b = q.acquire("b", 10)  # another tenant is untouched
    assert q.inflight("a") == 2 and q.inflight("b") == 1 and q.num_refused == {"a": 1}
    a1.release()
    a1.release()  # idempotent
    assert q.inflight("a") == 1
    q.acquire("a", 10)
    a2.release()
    b.release()
    assert q.inflight("b") == 0


def test_token_bucket_refuses_with_the_wait_until_it_refills():
    clock = Clock()
    q = TenantQuotas(QuotaConfig(TenantLimit(tokens_per_s=100, burst_tokens=200)), clock)
    q.acquire("a", 150).release()
    with pytest.raises(Overloaded) as info:
        q.acquire("a", 100)  # 50 left: 50 more tokens take 0.5 s
    assert info.value.retry_after_s == pytest.approx(0.5)
    assert "100 tokens/s with a burst of 200" in info.value.message
    q.acquire("b", 200).release()  # b has its own bucket
    clock.now = 0.5
    q.acquire("a", 100).release()
    # a request larger than the burst can never pass: refused with the reason, no retry hint
    clock.now = 10.0
    with pytest.raises(Overloaded, match=r"costs 10000 tokens .* its burst is 200") as info:
        q.acquire("a", 10_000)
    assert info.value.retry_after_s is None
    q.acquire("a", 200).release()  # and it took nothing from the full bucket
    with pytest.raises(Overloaded):
        q.acquire("a", 1)


def test_token_rate_holds_for_prompts_larger_than_the_default_burst():
    """7,000-token prompts against 200 tokens/s: refused whole at the default burst (one
    second's worth); with a burst that admits them, the tokens charged over 30 s stay within
    10% of burst + rate x 30 s, however fast the tenant sends."""
    clock = Clock()
    q = TenantQuotas(QuotaConfig(TenantLimit(tokens_per_s=200)), clock)
    with pytest.raises(Overloaded, match="its burst is 200 tokens"):
        q.acquire("a", 7_000)
    q = TenantQuotas(QuotaConfig(TenantLimit(tokens_per_s=200, burst_tokens=7_000)), clock)
    admitted = 0
    for step in range(3_000):  # a request every 10 ms for 30 s
        clock.now = step * 0.01
        with contextlib.suppress(Overloaded):
            q.acquire("a", 7_000).release()
            admitted += 7_000
    assert admitted <= 1.1 * (7_000 + 200 * 30)
    assert admitted == 7_000  # the refill after the first took 35 s: no second one in 30 s


def test_precheck_refuses_an_empty_bucket_and_a_refund_restores_it():
    clock = Clock()
    q = TenantQuotas(
        QuotaConfig(TenantLimit(max_inflight=1, tokens_per_s=100, burst_tokens=100)), clock
    )
    q.precheck("a")  # full bucket, nothing in flight: passes and charges nothing
    lease = q.acquire("a", 100)
    with pytest.raises(Overloaded, match="in flight"):
        q.precheck("a")
    lease.refund()  # refused before any worker saw it: the tokens come back
    lease.refund()  # once
    lease.release()
    q.acquire("a", 100).release()
    with pytest.raises(Overloaded, match="over its token rate: 0 are available") as info:
        q.precheck("a")
    assert info.value.retry_after_s == pytest.approx(0.01)  # one token at 100 tokens/s
    clock.now = 0.5
    with pytest.raises(Overloaded, match="needs 60 tokens"):
        q.charge("a", 60)  # Explain's prompt, 50 available
    q.charge("a", 50)
    assert q.inflight("a") == 0 and q.num_refused == {"a": 3}


def test_a_request_sure_to_pass_the_burst_is_charged_into_debt_one_burst_deep():
    """Refused before tokenizing when even its least possible cost passes the burst, and
    charged that: sent again and again, such requests would cost the router work for free."""
    clock = Clock()
    q = TenantQuotas(QuotaConfig(TenantLimit(tokens_per_s=100, burst_tokens=100)), clock)
    with pytest.raises(Overloaded, match="costs at least 250000 tokens"):
        q.precheck("a", 250_000)
    with pytest.raises(Overloaded, match="over its token rate") as info:
        q.precheck("a")  # in debt, one burst deep: refused at once
    assert info.value.retry_after_s == pytest.approx(1.01)  # from -100 to 1 at 100 tokens/s
    clock.now = 1.01
    q.precheck("a")  # repaid
    clock.now = 10.0
    q.acquire("a", 50).release()  # 50 left
    # sure of 30 before tokenizing, 80 after: refused, and charged the 30 it was sure of
    with pytest.raises(Overloaded, match="needs 80 tokens"):
        q.acquire("a", 80, sure=30)
    with pytest.raises(Overloaded):
        q.precheck("a", 21)
    q.precheck("a", 20)
    assert q.inflight("a") == 0 and q.num_refused == {"a": 4}


def test_overrides_and_defaults():
    cfg = QuotaConfig(
        TenantLimit(max_inflight=1),
        parse_overrides(["# c", "vip 5 - ", "slow - 10 20  # comment"], "f"),
    )
    assert cfg.limit_of("vip") == TenantLimit(5, None, None)
    assert cfg.limit_of("slow") == TenantLimit(None, 10.0, 20.0)
    assert cfg.limit_of("other") == TenantLimit(1)
    q = TenantQuotas(cfg, Clock())
    for _ in range(5):
        q.acquire("vip", 1)
    with pytest.raises(Overloaded):
        q.acquire("vip", 1)
    assert not QuotaConfig().enabled
    with pytest.raises(ValueError, match="f line 1: expected"):
        parse_overrides(["a 1"], "f")
    with pytest.raises(ValueError, match="f line 1: max_inflight 'x' is not an integer"):
        parse_overrides(["a x 1"], "f")
    with pytest.raises(ValueError, match="f line 1: tenant max_inflight must be >= 1"):
        parse_overrides(["a 0 1"], "f")
    with pytest.raises(ValueError, match="tokens_per_s must be a finite number > 0"):
        TenantLimit(tokens_per_s=float("nan"))


def test_router_flags_build_the_quota_config(tmp_path):
    f = tmp_path / "limits"
    f.write_text("vip 100 - \n")
    args = router_cli.build_parser().parse_args(
        [
            "--worker", "127.0.0.1:7001",
            "--tenant-max-inflight", "4",
            "--tenant-tokens-per-s", "1000",
            "--tenant-burst-tokens", "5000",
            "--tenant-limits", str(f),
        ]
    )  # fmt: skip
    quotas = router_cli.config_from_args(args).service.quotas
    assert quotas.default == TenantLimit(4, 1000.0, 5000.0)
    assert quotas.limit_of("vip") == TenantLimit(100)


# ---- through a real router ------------------------------------------------------------


@contextlib.asynccontextmanager
async def _router(worker_address: str, quotas: QuotaConfig, http: bool = False):
    base = _router_config([])
    service = dataclasses.replace(base.service, quotas=quotas, max_inflight=1000)
    router = RouterServer(
        _router_config([worker_address], service=service, http=HttpFrontConfig() if http else None)
    )
    await router.start()
    try:
        await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
        yield router
    finally:
        await router.stop(grace_s=0.1)


async def _hold(client: RouterClient, prompt: str) -> tuple[asyncio.Task, asyncio.Event]:
    """Start a long request and wait for its first message (admitted and in flight)."""
    started = asyncio.Event()

    async def run() -> None:
        async for _ in client.stream(prompt, GenerateOptions(max_new_tokens=900)):
            started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), WAIT_S)
    return task, started


async def test_a_flooding_tenant_cannot_starve_another():
    quotas = QuotaConfig(TenantLimit(max_inflight=2))
    async with (
        secure_worker("w-q", paced=True) as worker,
        _router(worker.address, quotas, http=True) as router,
    ):
        a = RouterClient(router.address, tenant="tenant-a", timeout_s=WAIT_S)
        b = RouterClient(router.address, tenant="tenant-b", timeout_s=WAIT_S)
        opts = GenerateOptions(max_new_tokens=4)
        held = []
        try:
            held = [await _hold(a, f"tenant a long request {i}") for i in range(2)]
            assert router.frontend.quotas.inflight("tenant-a") == 2

            async def tenant_a_floods() -> list:
                """20 more requests of A's at once: every one refused, with a retry hint."""
                calls = [a.generate(f"flood {i}", opts) for i in range(20)]
                return await asyncio.gather(*calls, return_exceptions=True)

            async def tenant_b() -> list:
                """Meanwhile B, within its own limit of 2 in flight: 3 rounds of 2."""
                out = []
                for round_ in range(3):
                    pair = [b.generate(f"tenant b {round_}/{i}", opts) for i in range(2)]
                    out += await asyncio.gather(*pair)
                return out

            refused, served = await asyncio.gather(tenant_a_floods(), tenant_b())
            assert len(served) == 6 and all(len(r.token_ids) == 4 for r in served)
            for r in refused:
                assert isinstance(r, grpc.aio.AioRpcError)
                assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "tenant 'tenant-a' has 2 requests in flight" in (r.details() or "")
                trailers = dict(r.trailing_metadata() or ())
                assert float(trailers["retry-after-s"]) == pytest.approx(1.0)
            assert router.frontend.quotas.num_refused == {"tenant-a": 20}
            # HTTP: 429, OpenAI's rate_limit_error, Retry-After
            assert router.http is not None
            url = f"http://127.0.0.1:{router.http.port}/v1/completions"
            body = {"model": "kvroute-tiny", "prompt": "hi", "max_tokens": 2}
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json=body, headers={"x-tenant-id": "tenant-a"}) as resp:
                    assert resp.status == 429
                    assert resp.headers["Retry-After"] == "1"
                    assert (await resp.json())["error"]["type"] == "rate_limit_error"
                async with s.post(url, json=body, headers={"x-tenant-id": "tenant-b"}) as resp:
                    assert resp.status == 200
        finally:
            for task, _ in held:
                task.cancel()
            for task, _ in held:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await a.close()
            await b.close()
        # the held requests' leases are released when they end
        await router.pool.wait_for(lambda: router.frontend.num_inflight == 0, WAIT_S)
        assert router.frontend.quotas.inflight("tenant-a") == 0


async def test_token_rate_refuses_the_tenant_over_it_only():
    quotas = QuotaConfig(TenantLimit(tokens_per_s=1.0, burst_tokens=60))
    async with secure_worker("w-rate") as worker, _router(worker.address, quotas) as router:
        async with RouterClient(router.address, tenant="a", timeout_s=WAIT_S) as a:
            opts = GenerateOptions(max_new_tokens=10)
            await a.generate("x" * 40, opts)  # 50 of 60 tokens
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await a.generate("x" * 40, opts)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 50 tokens (its prompt, plus max_new_tokens for a Generate), 10 are" in (
                info.value.details() or ""
            )
            # the refusal was held 1 s (the bucket refilling meanwhile): the hint counts
            # from the answer
            hint = float(dict(info.value.trailing_metadata() or ())["retry-after-s"])
            assert 38.0 < hint <= 39.0
        async with RouterClient(router.address, tenant="b", timeout_s=WAIT_S) as b:
            assert len((await b.generate("x" * 40, opts)).token_ids) == 10


async def test_explain_is_charged_like_generate():
    """Explain costs the router a tokenization and an index walk: its prompt is charged to
    the tenant's bucket, so a tenant cannot flood the router with it."""
    quotas = QuotaConfig(TenantLimit(tokens_per_s=0.1, burst_tokens=60))  # ~no refill
    async with secure_worker("w-explain") as worker, _router(worker.address, quotas) as router:
        async with RouterClient(router.address, tenant="a", timeout_s=WAIT_S) as a:
            await a.explain("x" * 40)  # 40 of 60 tokens
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await a.explain("x" * 40)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 40 tokens" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:  # 20 left: the prompt alone is 20
                await a.generate("x" * 20, GenerateOptions(max_new_tokens=1))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with RouterClient(router.address, tenant="b", timeout_s=WAIT_S) as b:
            assert (await b.explain("x" * 40)).prompt_tokens == 40  # b's own bucket


async def test_a_request_refused_before_any_worker_saw_it_gets_its_tokens_back():
    """No worker can take the request (the only one is unreachable): UNAVAILABLE, and the
    tokens it was charged return to the bucket, so the next try is not refused for rate."""
    quotas = QuotaConfig(TenantLimit(tokens_per_s=1.0, burst_tokens=60))
    base = _router_config([])
    service = dataclasses.replace(base.service, quotas=quotas)
    router = RouterServer(_router_config(["127.0.0.1:1"], service=service))
    await router.start()
    try:
        async with RouterClient(router.address, tenant="a", timeout_s=WAIT_S) as a:
            for _ in range(3):  # 50 tokens each against a 60-token bucket
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await a.generate("x" * 40, GenerateOptions(max_new_tokens=10))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert router.frontend.quotas.num_refused == {}
    finally:
        await router.stop(grace_s=0.1)


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the texts it was asked to encode."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        self.encoded += 1
        return super().encode(text, add_special_tokens=add_special_tokens)


async def test_a_prompt_sure_to_pass_the_burst_is_refused_before_tokenizing():
    quotas = QuotaConfig(TenantLimit(tokens_per_s=100, burst_tokens=1_000))
    tok = CountingTokenizer()
    base = _router_config([])
    service = dataclasses.replace(base.service, quotas=quotas)
    async with secure_worker("w-sure") as worker:
        router = RouterServer(_router_config([worker.address], service=service), tokenizer=tok)
        await router.start()
        try:
            async with RouterClient(router.address, tenant="a", timeout_s=WAIT_S) as a:
                opts = GenerateOptions(max_new_tokens=10)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await a.generate("x" * 1_000_000, opts)
                assert "costs at least 1000010 tokens" in (info.value.details() or "")
                for _ in range(3):  # in debt: refused at once, whatever the size
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await a.generate("x" * 10, opts)
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert tok.encoded == 0  # none of a's prompts was tokenized
            async with RouterClient(router.address, tenant="b", timeout_s=WAIT_S) as b:
                assert len((await b.generate("x" * 10, opts)).token_ids) == 10
            assert tok.encoded > 0
        finally:
            await router.stop(grace_s=0.1)


async def test_an_over_limit_refusal_is_held_while_other_tenants_are_served(monkeypatch):
    """A tenant refused for its own limits hears so only after up to a second (when it could
    be admitted, at most 1 s): a flood on a few connections then costs the router little.
    Other tenants are served meanwhile; beyond the cap, refusals are answered at once."""
    from router.service import frontend as frontend_module

    monkeypatch.setattr(frontend_module, "MAX_HELD_REFUSALS", 1)
    quotas = QuotaConfig(TenantLimit(tokens_per_s=10.0, burst_tokens=20))
    loop = asyncio.get_running_loop()
    async with (
        secure_worker("w-hold") as worker,
        _router(worker.address, quotas) as router,
        RouterClient(router.address, tenant="a", timeout_s=WAIT_S) as a,
        RouterClient(router.address, tenant="b", timeout_s=WAIT_S) as b,
    ):
        opts = GenerateOptions(max_new_tokens=1)

        async def refused(prompt: str) -> float:
            start = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await a.generate(prompt, opts)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return loop.time() - start

        held = asyncio.create_task(refused("x" * 100))  # past the burst: held 1 s
        await asyncio.sleep(0.2)
        assert not held.done()
        assert await refused("x" * 100) < 0.5  # the cap (1) is taken: answered at once
        served = await b.generate("x" * 5, opts)  # b is served during a's hold
        assert len(served.token_ids) == 1 and not held.done()
        assert await held >= 0.95


def test_an_output_left_to_the_worker_is_charged_when_it_finished():
    clock = Clock()
    q = TenantQuotas(QuotaConfig(TenantLimit(tokens_per_s=100, burst_tokens=200)), clock)
    q.acquire("a", 50).release()  # its prompt: 150 left
    q.charge_output("a", 450)  # what it generated: one burst of debt at most
    with pytest.raises(Overloaded) as info:
        q.acquire("a", 1)
    assert info.value.retry_after_s == pytest.approx(2.01)  # from -200 to 1 at 100/s
    q.charge_output("b", 10)  # another tenant's bucket
    q.acquire("b", 190).release()
