"""Router and worker /metrics over real HTTP while requests go through a real router and
real sim workers on 127.0.0.1: counters and histograms move as the requests say they should,
including cache forgone when load makes the router pick a worker with a shorter match."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
from metrics_scrape import Scrape, scrape
from router_harness import RunningRouter, router_config, running_router, sim_worker

from router.cli.client import GenerateOptions
from router.core.core_types import PolicyConfig
from router.core.policy import CostWeights
from router.core.router_core import RouterConfig
from router.service.metrics import RouterMetricsEndpoint
from worker.engine.engine_config import EngineConfig

PROMPT = "You are a helpful agent. " * 16  # 400 bytes: 100 blocks of 4 byte tokens
OPTS = GenerateOptions(max_new_tokens=3)


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[RunningRouter, RouterMetricsEndpoint, list]]:
    from worker.service.metrics import WorkerMetricsEndpoint

    async with sim_worker("w0") as w0, sim_worker("w1") as w1:
        # a large recent-prefill weight: the worker that just prefilled a prompt is "loaded"
        # for a while, so the same prompt again goes to the other one (cache forgone)
        config = router_config(
            [w0.address, w1.address],
            core=RouterConfig(
                policy="cache_aware",
                policy_config=PolicyConfig(weights=CostWeights(1.0, 0.25, 16.0, 10.0)),
            ),
        )
        async with running_router([], config) as router:
            endpoint = RouterMetricsEndpoint(router.server, "127.0.0.1", 0)
            endpoint.start()
            workers = []
            for w in (w0, w1):
                we = WorkerMetricsEndpoint(w.server, "127.0.0.1", 0)
                we.start()
                workers.append(we)
            try:
                await router.wait_synced(2)
                yield router, endpoint, workers
            finally:
                endpoint.stop()
                for we in workers:
                    we.stop()


async def test_requests_decisions_and_forgone_cache(fleet) -> None:
    router, endpoint, _ = fleet
    before = await scrape(endpoint.url)
    assert before.total("kvroute_router_requests_total") == 0
    assert before.get("kvroute_router_worker_healthy", worker="w0") == 1.0
    assert before.get("kvroute_router_worker_healthy", worker="w1") == 1.0
    # the engine's default cap, as the workers state it in GetLoad
    cap = EngineConfig().max_running_requests
    assert before.get("kvroute_router_worker_max_running_requests", worker="w0") == cap

    first = await router.client.generate(PROMPT, OPTS)
    second = await router.client.generate(PROMPT, OPTS)
    # the load term sent the repeat away from the worker that holds the prompt
    assert second.worker_id != first.worker_id
    assert second.cached_prompt_tokens == 0

    after = await scrape(endpoint.url)
    assert after.get("kvroute_router_requests_total", outcome="OK", worker=first.worker_id) == 1
    assert after.get("kvroute_router_requests_total", outcome="OK", worker=second.worker_id) == 1
    assert after.get("kvroute_router_requests_total", worker=first.worker_id)
    assert after.get("kvroute_router_route_decision_duration_seconds_count") == 2
    assert after.get("kvroute_router_route_decision_duration_seconds_sum") > 0
    assert after.total("kvroute_router_time_to_first_token_seconds_count") == 2
    assert after.total("kvroute_router_e2e_request_latency_seconds_count") == 2
    # the second decision: the best match (the first worker's, 400 tokens minus at most the
    # last partial block / one predicted stride) was forgone for load
    forgone = after.get("kvroute_router_forgone_cached_tokens_total")
    assert 300 <= forgone <= 400
    assert after.get("kvroute_router_forgone_decisions_total") == 1
    assert after.get("kvroute_router_decision_best_matched_tokens_total") == forgone
    assert after.total("kvroute_router_decision_matched_tokens_total") == 0
    assert after.total("kvroute_router_prompt_tokens_total") == 800
    assert after.total("kvroute_router_cached_prompt_tokens_total") == 0
    assert after.total("kvroute_router_completion_tokens_total") == 6
    # the index holds what the first worker's events confirmed
    assert after.get("kvroute_router_index_blocks") >= 99
    assert after.get("kvroute_router_worker_index_blocks", worker=first.worker_id) >= 99
    assert after.get("kvroute_router_index_bytes") > 0
    for w in ("w0", "w1"):
        assert after.get("kvroute_router_event_batches_total", worker=w, outcome="applied") >= 1
        assert after.get("kvroute_router_event_snapshots_total", worker=w, outcome="applied") == 1
        assert after.get("kvroute_router_event_lag_seconds", worker=w) >= 0
        assert after.get("kvroute_router_worker_inflight_requests", worker=w) == 0
    assert after.get("kvroute_router_inflight_requests") == 0
    # a series a worker connection (it counts only while the router reads behind a stream)
    runs = [ls for n, ls in after.samples if n == "kvroute_router_event_runs_total"]
    assert {dict(ls)["worker"] for ls in runs} == {"w0", "w1"}
    assert after.get("kvroute_router_workers", state="healthy") == 2


async def test_realised_hits_follow_the_prediction(fleet) -> None:
    router, endpoint, _ = fleet
    # an even load term: a repeat goes where its prefix is cached
    await router.client.generate(PROMPT, OPTS)
    core = router.server.core
    await router.wait_for(lambda: core.stats().num_indexed_blocks >= 99)
    # clear the recent-prefill balance so the cache decides (the test's own setup)
    for wid in core.workers():
        core.worker_view(wid).recent_prefill = 0.0
    repeat = await router.client.generate(PROMPT, OPTS)
    assert repeat.cached_prompt_tokens > 0
    after = await scrape(endpoint.url)
    w = repeat.worker_id
    predicted = after.get("kvroute_router_predicted_cached_tokens_total", worker=w)
    realised = after.get("kvroute_router_cached_prompt_tokens_total", worker=w)
    assert realised == repeat.cached_prompt_tokens
    assert predicted > 0
    assert abs(predicted - realised) <= 4  # one block: the worker keeps the last token
    # the repeat's match came from the worker's own events (the first request finished)
    by_source = "kvroute_router_decision_matched_tokens_by_source_total"
    events = after.get(by_source, worker=w, source="events")
    assert events == after.get("kvroute_router_decision_matched_tokens_total", worker=w) > 0
    assert after.get(by_source, worker=w, source="predicted") == 0


async def test_refusals_are_counted_by_code(fleet) -> None:
    router, endpoint, _ = fleet
    too_many = dataclasses.replace(OPTS, max_new_tokens=(1 << 20) + 1)
    with pytest.raises(grpc.aio.AioRpcError, match=r"max_new_tokens must be at most"):
        await router.client.generate(PROMPT, too_many)
    after = await scrape(endpoint.url)
    assert after.get("kvroute_router_requests_total", outcome="INVALID_ARGUMENT") == 1
    assert after.get("kvroute_router_requests_total", outcome="INVALID_ARGUMENT", worker="none")


async def test_worker_metrics_move(fleet) -> None:
    router, _, workers = fleet
    result = await router.client.generate(PROMPT, OPTS)
    endpoint = workers[0] if result.worker_id == "w0" else workers[1]
    s: Scrape = await scrape(endpoint.url)
    w = result.worker_id
    assert s.get("kvroute_worker_requests_total", worker=w, outcome="length") == 1
    assert s.get("kvroute_worker_time_to_first_token_seconds_count", worker=w) == 1
    assert s.get("kvroute_worker_inter_token_latency_seconds_count", worker=w) == 2
    assert s.get("kvroute_worker_e2e_request_latency_seconds_count", worker=w) == 1
    assert s.get("kvroute_worker_queue_wait_seconds_count", worker=w) == 1
    assert s.get("kvroute_worker_prompt_tokens_total", worker=w) == 400
    assert s.get("kvroute_worker_prefix_cache_queried_tokens_total", worker=w) == 400
    assert s.get("kvroute_worker_prefix_cache_hit_tokens_total", worker=w) == 0
    assert s.get("kvroute_worker_generation_tokens_total", worker=w) == 3
    assert s.get("kvroute_worker_running_requests", worker=w) == 0
    assert s.get("kvroute_worker_waiting_requests", worker=w) == 0
    assert s.get("kvroute_worker_kv_total_tokens", worker=w) == 4096
    # the prompt stays cached, unused: evictable, not protected
    assert s.get("kvroute_worker_kv_evictable_tokens", worker=w) >= 396
    assert s.get("kvroute_worker_kv_protected_tokens", worker=w) == 0
    assert s.get("kvroute_worker_event_batches_published_total", worker=w) >= 1
    assert s.get("kvroute_worker_event_replay_misses_total", worker=w) == 0


def test_tokenizer_chunk_and_text_prompt_counters() -> None:
    """The router's chunk cache counts reach /metrics: chunks hit / tokenized, and long text
    prompts tokenized whole or only as far as a cache could match them."""
    import random

    from prometheus_client import CollectorRegistry, generate_latest

    from bench.bpe import english_like_text, train_bpe
    from edge.tokenizer import HFTokenizer
    from router.core.router_core import RouterCore
    from router.service.metrics_state import RouterSnapshot, RouterStateCollector, _tokenizer_counts
    from router.service.token_cache import CachedTokenizer

    cached = CachedTokenizer(HFTokenizer(train_bpe(512, seed=0)), chunk_chars=64)
    text = english_like_text(300, seed=4)
    cached.encode_head(text, lambda head: False)  # the tail left to the worker
    cached.encode_head(text, lambda head: True)  # whole; the first chunk from the cache
    counts = _tokenizer_counts(cached)
    assert counts["text_prompts"] == (1, 1)
    hits, misses = counts["chunks"]
    assert hits >= 1 and misses > hits
    assert _tokenizer_counts(None) == {}

    core = RouterCore(clock=lambda: 0.0, rng=random.Random(0))
    snap = RouterSnapshot("cache_aware", core.stats(), (), (), frozenset(), 0, 0, 0, **counts)
    registry = CollectorRegistry()
    registry.register(RouterStateCollector(lambda: snap))
    text_out = generate_latest(registry).decode()
    assert f'kvroute_router_tokenizer_chunks_total{{result="hit"}} {float(hits)}' in text_out
    assert f'kvroute_router_tokenizer_chunks_total{{result="miss"}} {float(misses)}' in text_out
    assert 'kvroute_router_text_prompts_total{tokenized="head"} 1.0' in text_out
    assert 'kvroute_router_text_prompts_total{tokenized="whole"} 1.0' in text_out
