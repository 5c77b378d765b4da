"""Tenant isolation: tenant B never gets a cache hit or a routing advantage from tenant A's
prompts -- through the router (API keys name the tenants) and directly at a worker.

Positive controls run next to each negative check (A's own repeat hits the cache; A's
Explain shows the match), so the test fails if isolation is broken rather than if caching
is."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import grpc
import pytest
from secure_harness import WAIT_S, secure_worker

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.cli.client import GenerateOptions, RouterClient
from router.service.auth import ApiKeys, hash_key
from router.service.server import RouterServer
from router.service.tenancy import TenancyConfig, salt_for_tenant

HERE = Path(__file__).resolve().parent
KEY_A, KEY_B = "sk-tenant-a-key", "sk-tenant-b-key"
KEYS = ApiKeys.parse([f"tenant-a:{hash_key(KEY_A)}", f"tenant-b:{hash_key(KEY_B)}"], "test")
TOKEN = "router-to-worker-token"
TENANCY = TenancyConfig(salt_secret=b"deployment-salt-secret")
PROMPT = "Tenant A's confidential system prompt: the merger closes on Friday. " * 3
OTHER = "x" * len(PROMPT)  # the same length, never sent by anyone
PROMPT2 = "Tenant A's second secret: the codename of the new product is Bluebird. " * 3
OPTS = GenerateOptions(max_new_tokens=2)


def _router_config(workers, **overrides):
    sys.path.insert(0, str(HERE.parent / "router" / "service"))
    from router_harness import router_config

    return router_config(workers, **overrides)


async def _direct(address: str, prompt: str, salt: str) -> pb.Finished:
    """Generate at the worker itself (with the router's token), in partition ``salt``."""
    req = pb.GenerateRequest(prompt_text=prompt)
    req.sampling.max_new_tokens = 2
    req.partition.cache_salt = salt
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        md = (("authorization", f"Bearer {TOKEN}"),)
        finished = None
        async for msg in stub.Generate(req, metadata=md, timeout=WAIT_S):
            if msg.HasField("finished"):
                finished = msg.finished
    assert finished is not None
    return finished


async def test_tenant_b_gets_no_hit_and_no_routing_advantage_from_tenant_a():
    assert len(PROMPT) == len(OTHER)
    async with (
        secure_worker("w-0", router_token=TOKEN) as w0,
        secure_worker("w-1", router_token=TOKEN) as w1,
    ):
        base = _router_config([])
        service = dataclasses.replace(base.service, tenancy=TENANCY)
        connection = dataclasses.replace(base.connection, token=TOKEN)
        router = RouterServer(
            _router_config(
                [w0.address, w1.address], api_keys=KEYS, service=service, connection=connection
            )
        )
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 2, WAIT_S)
            a = RouterClient(router.address, api_key=KEY_A, timeout_s=WAIT_S)
            # B even claims to be A in the tenant header: ignored with API keys
            b = RouterClient(router.address, api_key=KEY_B, tenant="tenant-a", timeout_s=WAIT_S)
            try:
                first = await a.generate(PROMPT, OPTS)
                served_by = first.worker_id
                addresses = {"w-0": w0.address, "w-1": w1.address}
                # wait until the router's index holds A's blocks (from the worker's events)
                await router.pool.wait_for(lambda: router.core.index.size() > 0, WAIT_S)
                a_view = await a.explain(PROMPT)
                a_match = {w.worker_id: w.event_matched_tokens for w in a_view.workers}
                assert a_match[served_by] > 0  # control: A's prefix is indexed
                # a key holder sees worker ids, never where the workers are
                assert {w.worker_id for w in a_view.workers} == {"w-0", "w-1"}
                assert {w.address for w in a_view.workers} == {""}
                assert (await a.generate(PROMPT, OPTS)).cached_prompt_tokens > 0  # control

                # through the router: B sees no match anywhere, by events or by prediction
                b_view = await b.explain(PROMPT)
                for w in b_view.workers:
                    assert w.matched_tokens == 0, w
                    assert w.event_matched_tokens == 0 and w.predicted_matched_tokens == 0, w
                # ... and no routing advantage: B's costs for A's prompt are exactly its costs
                # for a prompt of the same length nobody has sent
                b_other = await b.explain(OTHER)
                # (equal up to the decay of the recent-prefill term between the two calls)
                costs = {w.worker_id: w.cost for w in b_view.workers}
                other = {w.worker_id: w.cost for w in b_other.workers}
                assert costs == pytest.approx(other, rel=1e-3)
                assert b_view.chosen_worker_id == b_other.chosen_worker_id
                result = await b.generate(PROMPT, OPTS)
                assert result.cached_prompt_tokens == 0

                # directly at a worker holding another of A's prompts: B's partition misses,
                # the anonymous one and the guessable unkeyed salt miss, only A's own salt
                # (derived with the deployment's secret) hits
                second = await a.generate(PROMPT2, OPTS)
                address = addresses[second.worker_id]
                salt_b = salt_for_tenant(TENANCY, "tenant-b")
                guessed = salt_for_tenant(TenancyConfig(), "tenant-a")  # "tenant:tenant-a"
                for salt in (salt_b, "", guessed):
                    finished = await _direct(address, PROMPT2, salt)
                    assert finished.usage.cached_prompt_tokens == 0, salt
                salt_a = salt_for_tenant(TENANCY, "tenant-a")
                finished = await _direct(address, PROMPT2, salt_a)
                assert finished.usage.cached_prompt_tokens > 0  # control
            finally:
                await a.close()
                await b.close()
        finally:
            await router.stop(grace_s=0.1)
