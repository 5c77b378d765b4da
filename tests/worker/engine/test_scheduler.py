"""Exact scheduler behaviour with the zero-cost sim executor: ordering, prefix reuse,
in-batch dedup, chunked prefill, eviction, retraction, abort, stop conditions, reports."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import (
    assert_baseline,
    check_accounting,
    collect,
    expected_tokens,
    make_engine,
    request,
    run,
)

from worker.engine.engine import EngineConfig
from worker.engine.sim_executor import SimExecutorConfig
from worker.engine.stats import ModelLimits
from worker.engine.types import FinishReason, Usage

PROMPT = list(range(1, 101))


def test_single_request_streams_expected_tokens_and_usage() -> None:
    engine, ex = make_engine(num_kv_slots=1000)
    engine.add_request(request("a", PROMPT, max_new_tokens=3))
    results = run(engine)
    a = results["a"]
    assert a.tokens == expected_tokens(engine, "a", 3)
    assert a.finish_reason is FinishReason.LENGTH
    assert a.usage == Usage(prompt_tokens=100, cached_prompt_tokens=0, completion_tokens=3)
    assert ex.steps == [
        [("p", "a", 0, 100, True)],
        [("d", "a", 100, 1, True)],
        [("d", "a", 101, 1, True)],
    ]
    assert_baseline(engine)


def test_second_request_reuses_cached_prefix() -> None:
    engine, ex = make_engine(num_kv_slots=1000)
    engine.add_request(request("a", PROMPT, max_new_tokens=3))
    run(engine)
    engine.add_request(request("b", PROMPT[:80] + [500] * 20, max_new_tokens=2))
    engine.add_request(request("c", PROMPT, max_new_tokens=2))
    results = run(engine)
    assert results["b"].usage == Usage(100, 80, 2)
    # The whole prompt is cached, but its last token is recomputed to get logits.
    assert results["c"].usage == Usage(100, 99, 2)
    assert ex.steps[3] == [("p", "b", 80, 20, True), ("p", "c", 99, 1, True)]
    stats = engine.stats()
    assert stats.prompt_tokens == 300
    assert stats.cached_prompt_tokens == 179
    assert stats.computed_prefill_tokens == 100 + 20 + 1
    assert stats.generated_tokens == 7
    assert_baseline(engine)


def test_fcfs_admits_in_arrival_order() -> None:
    engine, ex = make_engine(num_kv_slots=1000, max_running_requests=1)
    for rid in ("a", "b", "c"):
        engine.add_request(request(rid, [ord(rid)] * 10, max_new_tokens=2))
    run(engine)
    prefill_order = [s[0][1] for s in ex.steps if s[0][0] == "p"]
    assert prefill_order == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["x", "y", "z"]), ("lpm", ["z", "y", "x"]), ("lof", ["y", "z", "x"])],
)
def test_policy_order(policy: str, order: list[str]) -> None:
    engine, ex = make_engine(num_kv_slots=2000, max_running_requests=1, schedule_policy=policy)
    engine.add_request(request("warm", PROMPT, max_new_tokens=1))
    run(engine)
    ex.steps.clear()
    engine.add_request(request("x", [900] * 100, max_new_tokens=1))  # no match
    engine.add_request(request("y", PROMPT[:50] + [901] * 50, max_new_tokens=3))  # 50 cached
    engine.add_request(request("z", PROMPT[:90] + [902] * 10, max_new_tokens=2))  # 90 cached
    results = run(engine)
    prefill_order = [s[0][1] for s in ex.steps if s and s[0][0] == "p"]
    assert prefill_order == order
    assert results["z"].usage.cached_prompt_tokens == 90
    assert results["y"].usage.cached_prompt_tokens == 50


def test_dfs_weight_keeps_requests_on_one_cached_path_together() -> None:
    engine, ex = make_engine(
        num_kv_slots=4000, max_running_requests=2, schedule_policy="dfs-weight"
    )
    p1, p2 = [11] * 100, [12] * 100
    for rid, prompt in (("w1", p1), ("w2", p2)):
        engine.add_request(request(rid, prompt, max_new_tokens=1))
    run(engine)
    ex.steps.clear()
    engine.add_request(request("x", [13] * 50, max_new_tokens=1))
    engine.add_request(request("a", [*p1, 1, 2], max_new_tokens=1))
    engine.add_request(request("b", [*p2, 3, 4], max_new_tokens=1))
    engine.add_request(request("c", [*p2, 5, 6], max_new_tokens=1))
    run(engine)
    # b and c lie under the same cached node (weight 2): admitted together, before a
    # (weight 1); x matched nothing, so it is the root's own and comes after every subtree.
    prefills = [item[1] for step in ex.steps for item in step if item[0] == "p"]
    assert prefills == ["b", "c", "a", "x"]


def test_random_policy_is_seeded() -> None:
    def order(seed: int) -> list[str]:
        engine, ex = make_engine(max_running_requests=1, schedule_policy="random", seed=seed)
        for i in range(8):
            engine.add_request(request(f"r{i}", [i + 1] * 5, max_new_tokens=1))
        run(engine)
        return [s[0][1] for s in ex.steps]

    assert order(1) == order(1)
    assert sorted(order(1)) == [f"r{i}" for i in range(8)]
    assert order(1) != order(2)


def test_engine_rejects_a_config_larger_than_the_executor_pool() -> None:
    engine, ex = make_engine()
    ex.num_kv_slots = 100
    with pytest.raises(ValueError, match="num_kv_slots=4096"):
        type(engine)(EngineConfig(num_kv_slots=4096), ex, clock=lambda: 0.0)


def test_lpm_stays_on_with_a_long_queue() -> None:
    """Unlike SGLang (FCFS past 128 waiting), LPM keeps ordering by cached prefix."""
    engine, ex = make_engine(
        num_kv_slots=20_000, max_running_requests=1, schedule_policy="lpm", max_waiting_requests=500
    )
    engine.add_request(request("warm", PROMPT, max_new_tokens=1))
    run(engine)
    ex.steps.clear()
    for i in range(300):
        engine.add_request(request(f"cold{i}", [200 + i % 700] * 20, max_new_tokens=1))
    engine.add_request(request("hot", PROMPT[:95] + [7] * 5, max_new_tokens=1))
    engine.step()
    assert ex.steps[0][0][1] == "hot"
    assert engine.stats().num_lpm_stale_estimates == 0


def test_lpm_rematch_budget_is_counted_not_silent() -> None:
    engine, _ = make_engine(
        num_kv_slots=20_000, max_running_requests=1, schedule_policy="lpm", lpm_rematch_budget=8
    )
    shared = [300] * 32
    engine.add_request(request("p", [*shared, 7, 7, 7, 7], max_new_tokens=1))
    for i in range(20):
        engine.add_request(request(f"r{i}", [*shared, *[400 + i] * 20], max_new_tokens=1))
    engine.step()  # p runs and caches the shared blocks; r* were matched at add (empty tree)
    assert engine.stats().num_lpm_rematches == 0
    engine.step()  # the tree grew under every r*'s frontier: 8 re-matched, 12 left stale
    stats = engine.stats()
    assert stats.num_lpm_rematches == 8
    assert stats.num_lpm_stale_estimates == 12


def test_a_new_request_is_matched_at_add() -> None:
    engine, _ = make_engine(num_kv_slots=1000, schedule_policy="fcfs")
    engine.add_request(request("a", PROMPT, max_new_tokens=1))
    run(engine)
    engine.add_request(request("b", [*PROMPT[:64], *[9] * 30], max_new_tokens=1))
    # b's first 64 tokens are cached: the report counts only what b adds
    assert engine.load_report().num_queued_prefill_tokens == 30


def _lcp_blocks(a: list[int], b: list[int], bs: int) -> int:
    n = 0
    while (n + 1) * bs <= min(len(a), len(b)) and a[: (n + 1) * bs] == b[: (n + 1) * bs]:
        n += 1
    return n


def test_queued_prefill_counts_a_burst_prefix_once() -> None:
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(1, 999, 2000)]
    engine, _ = make_engine(num_kv_slots=200_000, max_running_requests=1)
    for i in range(64):
        engine.add_request(request(f"r{i}", [*shared, *rng.integers(1, 999, 100).tolist()]))
    # 2,000 shared tokens (125 whole blocks) once, then each request's 100 own tokens
    assert engine.load_report().num_queued_prefill_tokens == 2000 + 64 * 100
    engine.add_request(request("lone", [5] * 700))
    assert engine.load_report().num_queued_prefill_tokens == 2000 + 64 * 100 + 700


def test_queued_prefill_counts_the_chunked_rest_and_what_shares_it() -> None:
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(1, 999, 1024)]
    engine, _ = make_engine(num_kv_slots=20_000, max_running_requests=1, chunk_size=256)
    engine.add_request(request("a", [*shared, 1, 2, 3]))
    engine.add_request(request("b", [*shared, 4, 5, 6, 7]))
    engine.step()  # a's first chunk: 256 of 1,027 computed
    # a's rest (771) + b's own 4 (its 1,024 shared tokens come with a's prefill)
    assert engine.load_report().num_queued_prefill_tokens == 771 + 4


@given(
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=80), min_size=1, max_size=12)
)
@settings(max_examples=60, deadline=None)
def test_queued_prefill_matches_a_brute_force_count(prompts: list[list[int]]) -> None:
    """Empty tree: each waiting context costs its length less the whole blocks it shares with
    some context queued before it."""
    bs = 4
    engine, _ = make_engine(num_kv_slots=10_000, block_size=bs, max_running_requests=1)
    expected = 0
    for i, p in enumerate(prompts):
        engine.add_request(request(f"r{i}", p))
        shared = max((_lcp_blocks(p, q, bs) for q in prompts[:i]), default=0)
        expected += len(p) - shared * bs
    assert engine.load_report().num_queued_prefill_tokens == expected


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_in_batch_dedup_prefills_the_shared_prefix_once(policy: str) -> None:
    shared = [int(t) for t in np.random.default_rng(0).integers(1, 999, 2000)]
    rngs = [np.random.default_rng(i + 1) for i in range(64)]
    suffixes = [[int(t) for t in rng.integers(1, 999, 16)] for rng in rngs]

    def prefill_tokens(dedup: int) -> int:
        engine, _ = make_engine(
            num_kv_slots=200_000,
            max_prefill_tokens_per_step=200_000,
            chunk_size=4096,
            in_batch_dedup_min_tokens=dedup,
            schedule_policy=policy,
        )
        for i in range(64):
            engine.add_request(request(f"r{i}", shared + suffixes[i], max_new_tokens=1))
        results = run(engine)
        assert sum(r.usage.cached_prompt_tokens for r in results.values()) == (
            63 * 2000 if dedup else 0
        )
        assert_baseline(engine)
        return engine.stats().computed_prefill_tokens

    assert prefill_tokens(dedup=32) == 2000 + 64 * 16  # one copy of the prefix
    assert prefill_tokens(dedup=0) == 64 * 2016  # every request prefills it


def test_in_batch_dedup_holds_behind_a_chunked_prefill_of_a_partly_cached_prefix() -> None:
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(1, 999, 100)]
    doc = [int(t) for t in rng.integers(1, 999, 5000)]
    engine, ex = make_engine(num_kv_slots=50_000, chunk_size=2048)
    engine.add_request(request("warm", system, max_new_tokens=1))
    run(engine)
    for i in range(8):
        engine.add_request(request(f"r{i}", [*system, *doc, 1 + i, 2 + i], max_new_tokens=1))
    results = run(engine)
    # r0 prefills the 5,000-token document in three chunks while r1..r7 wait, then they
    # each prefill only their own 2-token tail.
    assert engine.stats().computed_prefill_tokens == 100 + 5002 + 7 * 2
    assert [r.usage.cached_prompt_tokens for r in results.values()] == [100] + [5100] * 7
    assert engine.stats().num_dedup_holds == 3 * 7
    assert ex.steps[1:4] == [
        [("p", "r0", 100, 2048, False)],
        [("p", "r0", 2148, 2048, False)],
        [("p", "r0", 4196, 906, True)],
    ]
    assert_baseline(engine)


def test_chunked_prefill_splits_and_caches_between_chunks() -> None:
    engine, ex = make_engine(num_kv_slots=10_000, chunk_size=2048)
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 999, 5000)]
    engine.add_request(request("long", prompt, max_new_tokens=2))
    engine.step()
    # The first chunk is in the tree already (cache_unfinished_req), locked by the request.
    assert engine.cache.match_prefix(np.asarray(prompt)).num_matched == 2048
    assert engine.cache.protected_size() == 2048
    results = run(engine)
    assert [s for s in ex.steps] == [
        [("p", "long", 0, 2048, False)],
        [("p", "long", 2048, 2048, False)],
        [("p", "long", 4096, 904, True)],
        [("d", "long", 5000, 1, True)],
    ]
    assert results["long"].tokens == expected_tokens(engine, "long", 2)
    assert engine.stats().computed_prefill_tokens == 5000
    assert_baseline(engine)


def test_chunked_prefill_shares_the_step_budget() -> None:
    engine, ex = make_engine(num_kv_slots=10_000, chunk_size=2048, max_prefill_tokens_per_step=3000)
    engine.add_request(request("a", [5] * 2500, max_new_tokens=2))
    engine.add_request(request("b", [6] * 2500, max_new_tokens=2))
    run(engine)
    assert ex.steps[:3] == [
        [("p", "a", 0, 2048, False)],  # b would need a second chunked prefill: waits
        [("p", "a", 2048, 452, True), ("p", "b", 0, 2048, False)],
        [("p", "b", 2048, 452, True), ("d", "a", 2500, 1, True)],
    ]


def test_eviction_makes_room_under_pressure() -> None:
    engine, _ = make_engine(num_kv_slots=1000)
    engine.add_request(request("a", [1] * 600, max_new_tokens=2))
    run(engine)
    assert engine.cache.evictable_size() == 601
    engine.add_request(request("b", [2] * 600, max_new_tokens=2))
    results = run(engine)
    assert results["b"].tokens == expected_tokens(engine, "b", 2)
    assert engine.stats().num_evicted_tokens == 601
    assert engine.cache.match_prefix(np.asarray([1] * 600)).num_matched == 0
    assert_baseline(engine)


def test_retraction_keeps_tokens_and_recomputes_little() -> None:
    # 420 slots: two 200-token prompts fit, their decode outgrows the pool.
    engine, _ = make_engine(num_kv_slots=420, new_token_reserve_ratio=0.0)
    engine.add_request(request("a", [3] * 200, max_new_tokens=20))
    engine.add_request(request("b", [4] * 200, max_new_tokens=20))
    results = run(engine)
    stats = engine.stats()
    assert stats.num_retractions == 1
    for rid in ("a", "b"):
        assert results[rid].tokens == expected_tokens(engine, rid, 20)
        assert results[rid].finish_reason is FinishReason.LENGTH
    # b was retracted after 11 tokens: its 200-token prompt stayed cached (only the leaf with
    # its generated tokens was evicted), so the retry recomputed 11 tokens, not 211.
    assert stats.computed_prefill_tokens == 400 + 11
    assert results["b"].usage == Usage(200, 0, 20)
    assert_baseline(engine)


def test_retraction_inserts_computed_kv_before_releasing() -> None:
    engine, _ = make_engine(num_kv_slots=1000, new_token_reserve_ratio=0.0)
    engine.add_request(request("a", [3] * 100, max_new_tokens=50))
    engine.add_request(request("b", [4] * 100, max_new_tokens=50))
    for _ in range(10):
        engine.step()
    victim = engine.scheduler._decoding["b"]
    engine.scheduler._retract(victim)
    # Prompt + the 9 generated tokens whose KV was computed are now in the tree.
    assert engine.cache.match_prefix(np.asarray([4] * 100 + victim.output_ids)).num_matched == 109
    results = run(engine)
    assert results["b"].tokens[-40:] == expected_tokens(engine, "b", 50)[-40:]
    check_accounting(engine)
    assert engine.stats().computed_prefill_tokens == 200 + 1


@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "decoding"])
def test_abort_at_each_stage_returns_allocator_to_baseline(stage: str) -> None:
    engine, _ = make_engine(num_kv_slots=10_000, chunk_size=2048)
    engine.add_request(request("other", [9] * 50, max_new_tokens=5))
    engine.add_request(request("x", [1 + i % 997 for i in range(5000)], max_new_tokens=10))
    steps = {"waiting": 0, "mid_prefill": 1, "decoding": 4}[stage]
    results: dict = {}
    for i in range(steps):
        collect(engine.step(), results, i)
    status = engine.scheduler._reqs["x"].status.value
    assert (
        status == {"waiting": "waiting", "mid_prefill": "prefilling", "decoding": "decoding"}[stage]
    )
    assert engine.abort("x") is True
    assert engine.abort("x") is False
    check_accounting(engine)
    run(engine, results)
    assert "x" not in results or results["x"].finish_reason is None
    assert results["other"].finish_reason is FinishReason.LENGTH
    assert engine.stats().num_aborted == 1
    assert_baseline(engine)


def test_abort_unknown_id_is_false() -> None:
    engine, _ = make_engine()
    assert engine.abort("nope") is False


def test_stop_token_ids_and_eos() -> None:
    sim = SimExecutorConfig(vocab_size=1000, max_context_tokens=8192, eos_token_id=0, eos_at=4)
    engine, _ = make_engine(sim=sim, num_kv_slots=1000)
    stop = expected_tokens(engine, "s", 3)[2]
    engine.add_request(request("s", [1] * 10, max_new_tokens=10, stop_token_ids=(stop,)))
    engine.add_request(request("e", [2] * 10, max_new_tokens=10))
    engine.add_request(request("i", [3] * 10, max_new_tokens=10, ignore_eos=True))
    results = run(engine)
    assert results["s"].tokens == expected_tokens(engine, "s", 3)
    assert results["s"].finish_reason is FinishReason.STOP
    assert results["e"].tokens[-1] == 0 and len(results["e"].tokens) == 5
    assert results["e"].finish_reason is FinishReason.STOP
    assert len(results["i"].tokens) == 10
    assert results["i"].finish_reason is FinishReason.LENGTH
    assert_baseline(engine)


@pytest.mark.parametrize("emitted", [0, 7])
def test_any_of_several_eos_ids_stops(emitted: int) -> None:
    # A Llama-3-Instruct checkpoint lists <|end_of_text|> and <|eot_id|>: either one stops.
    sim = SimExecutorConfig(
        vocab_size=1000, max_context_tokens=8192, eos_token_id=emitted, eos_at=4
    )
    engine, _ = make_engine(sim=sim, eos_token_ids=(0, 7), num_kv_slots=1000)
    assert (engine.eos_token_id, engine.eos_token_ids) == (0, (0, 7))
    assert engine.scheduler.limits.eos_token_ids == frozenset({0, 7})
    engine.add_request(request("e", [2] * 10, max_new_tokens=10))
    engine.add_request(request("i", [3] * 10, max_new_tokens=10, ignore_eos=True))
    results = run(engine)
    assert results["e"].tokens == expected_tokens(engine, "e", 5)
    assert results["e"].tokens[-1] == emitted
    assert results["e"].finish_reason is FinishReason.STOP
    assert results["i"].tokens == expected_tokens(engine, "i", 10)
    assert results["i"].tokens[4] == emitted  # ignore_eos: generated, and ignored
    assert results["i"].finish_reason is FinishReason.LENGTH
    assert_baseline(engine)


def test_no_eos_ids_never_stops_on_eos() -> None:
    sim = SimExecutorConfig(vocab_size=1000, max_context_tokens=8192, eos_token_id=5, eos_at=1)
    engine, _ = make_engine(sim=sim, eos_token_ids=(), num_kv_slots=1000)
    assert (engine.eos_token_id, engine.eos_token_ids) == (None, ())
    engine.add_request(request("e", [2] * 10, max_new_tokens=4))
    results = run(engine)
    assert results["e"].tokens[1] == 5
    assert results["e"].finish_reason is FinishReason.LENGTH


def test_model_limits_eos_ids_include_the_first_and_are_checked() -> None:
    limits = ModelLimits(vocab_size=10, max_context_tokens=8, eos_token_id=3)
    assert limits.eos_token_ids == frozenset({3})  # built with the single id only
    both = ModelLimits(10, 8, eos_token_id=3, eos_token_ids=frozenset({3, 4}))
    assert both.eos_token_ids == frozenset({3, 4})
    assert ModelLimits(10, 8, eos_token_id=None).eos_token_ids == frozenset()
    with pytest.raises(ValueError, match=r"ModelLimits\.eos_token_ids"):
        ModelLimits(10, 8, eos_token_id=None, eos_token_ids=frozenset({-1}))


def test_max_context_finish_when_clamped() -> None:
    sim = SimExecutorConfig(vocab_size=1000, max_context_tokens=64)
    engine, _ = make_engine(sim=sim, num_kv_slots=1000, clamp_max_new_tokens=True)
    engine.add_request(request("m", [1] * 60, max_new_tokens=100))
    results = run(engine)
    assert results["m"].finish_reason is FinishReason.MAX_CONTEXT
    assert len(results["m"].tokens) == 4
    assert_baseline(engine)


def test_seeded_requests_generate_the_seeded_stream() -> None:
    engine, _ = make_engine(num_kv_slots=1000)
    engine.add_request(request("a", [1] * 10, max_new_tokens=3, seed=7))
    engine.add_request(request("b", [2] * 10, max_new_tokens=3, seed=7))
    results = run(engine)
    assert results["a"].tokens == results["b"].tokens == expected_tokens(engine, "z", 3, seed=7)


def test_disabled_cache_runs_the_same_loop() -> None:
    engine, _ = make_engine(num_kv_slots=1000, enable_cache=False)
    engine.add_request(request("a", PROMPT, max_new_tokens=3))
    run(engine)
    engine.add_request(request("b", PROMPT, max_new_tokens=3))
    results = run(engine)
    assert results["b"].usage == Usage(100, 0, 3)
    assert results["b"].tokens == expected_tokens(engine, "b", 3)
    assert_baseline(engine)


def test_load_report_and_stats_gauges() -> None:
    engine, _ = make_engine(num_kv_slots=1000, max_running_requests=1)
    engine.add_request(request("a", [1] * 100, max_new_tokens=5))
    engine.add_request(request("b", [2] * 30, max_new_tokens=5))
    engine.step()
    report = engine.load_report()
    assert report.num_running == 1
    assert report.num_waiting == 1
    assert report.num_queued_prefill_tokens == 30
    assert report.num_total_kv_tokens == 1000
    assert report.num_free_kv_tokens == 1000 - 100
    assert report.num_evictable_kv_tokens == 0
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.num_protected_kv_tokens == 100
    assert stats.kv_usage == pytest.approx(0.1)


def test_a_lone_decoding_request_short_of_slots_is_retracted_not_fatal() -> None:
    """Something else pins the pool (a locked prefix): the only running request cannot get
    a slot for its next token. It is retracted and waits -- the loop never dies -- and it
    finishes with every token once the pin is released."""
    engine, _ = make_engine(num_kv_slots=64)
    engine.add_request(request("p", [7] * 40, max_new_tokens=1))
    run(engine)
    cache = engine.cache
    pinned = cache.match_prefix(np.asarray([7] * 40, dtype=np.int64)).last_node
    cache.inc_lock_ref(pinned)  # 40 of 64 slots protected
    engine.add_request(request("a", [9] * 20, max_new_tokens=10))  # needs 29 slots
    results: dict = {}
    for step in range(50):
        collect(engine.step(), results, step)
        check_accounting(engine)
    assert engine.stats().num_retractions >= 1
    assert results["a"].finish_reason is None  # waiting for slots, not failed
    assert engine.scheduler.num_waiting == 1
    cache.dec_lock_ref(pinned)
    run(engine, results)
    assert results["a"].finish_reason is FinishReason.LENGTH
    assert results["a"].tokens == expected_tokens(engine, "a", 10)
    assert_baseline(engine)


def test_dfs_weight_estimate_holds_the_matched_node_and_survives_a_reset() -> None:
    """The estimate keeps the matched node itself; after a reset detaches it, ordering still
    works (the request counts at the root) and the refreshed estimate names a live node."""
    engine, _ = make_engine(num_kv_slots=4000, schedule_policy="dfs-weight")
    engine.add_request(request("w", [11] * 100, max_new_tokens=1))
    run(engine)
    engine.add_request(request("a", [11] * 100 + [1], max_new_tokens=1))
    sched = engine.scheduler
    sched._refresh_estimates(list(sched._waiting.values()))
    node = engine.cache.match_prefix(np.asarray([11] * 100, dtype=np.int64)).last_node
    assert sched._reqs["a"].est_node is node
    engine.cache.reset()  # detaches every unlocked node
    assert engine.cache.parent_node(node) is None
    waiting = list(sched._waiting.values())
    assert [r.request_id for r in sched.policy.order(waiting, True)] == ["a"]
    results = run(engine)
    assert results["a"].usage.cached_prompt_tokens == 0
