"""Policies: exact costs, seeded tie-breaks, baselines, registry."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvroute_proto.events import LoadReport
from router.core.policy import (
    CostWeights,
    PolicyConfig,
    RouteQuery,
    WorkerView,
)
from router.core.registry import make_policy, policy_names

B = 16


def views(n: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", i) for i in range(n)]


def query(prompt: int = 320, hashes: list[int] | None = None, rid: str = "r") -> RouteQuery:
    return RouteQuery(rid, prompt, B, hashes if hashes is not None else list(range(prompt // B)))


def test_registry() -> None:
    assert policy_names() == [
        "cache_aware",
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "approx_tree",
        "sglang",
        "dynamo",
        "llm_d",
        "aibrix",
        "consistent_hash",
    ]
    assert make_policy("prefix_hash").name == "consistent_hash"  # the old name, an alias
    with pytest.raises(ValueError, match="policy must be one of cache_aware, round_robin"):
        make_policy("fastest")
    assert make_policy("approx_tree").uses_events is False
    assert make_policy("cache_aware").uses_events is True


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"CostWeights\.decode must be >= 0"):
        CostWeights(decode=-1)
    with pytest.raises(ValueError, match=r"CostWeights\.recent_prefill must be >= 0, got nan"):
        CostWeights(recent_prefill=float("nan"))
    with pytest.raises(ValueError, match="prefix_hash_blocks"):
        PolicyConfig(prefix_hash_blocks=0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="backlog_tokens must be >= 0"):
            PolicyConfig(backlog_tokens=bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="saturated_tokens must be finite and >= 0"):
            PolicyConfig(saturated_tokens=bad)
        with pytest.raises(ValueError, match="saturated_scale_tokens must be finite and >= 0"):
            PolicyConfig(saturated_scale_tokens=bad)


def test_cache_aware_costs_are_exact() -> None:
    ws = views(4)
    ws[1].inflight_prefill_tokens = 100
    ws[2].load = LoadReport(num_running=2, num_waiting=1, num_queued_prefill_tokens=50)
    ws[2].inflight_prefill_tokens = 30  # the worker's report (50) is larger: it wins
    ws[3].num_active = 2
    for w in ws:
        w.refresh()
    # a knee of 3.2 prompts of 320 tokens: 1,024 queued tokens
    weights = CostWeights(1.0, 0.5, 10.0, queued_knee=3.2)
    policy = make_policy("cache_aware", PolicyConfig(weights=weights))
    matched = {0: 4, 1: 20, 3: 25}  # worker 3: more blocks than the prompt has
    costs = policy.costs(query(320), ws, matched)
    assert costs == pytest.approx(
        [
            320 - 64,
            0 + 0.5 * 100 * (1 + 100 / 1024),
            320 + 0.5 * 50 * (1 + 50 / 1024) + 10.0 * 3,
            0 + 10.0 * 2,
        ],
        rel=1e-15,
    )
    i, cost = policy.select(query(320), ws, matched, random.Random(0))
    assert (i, cost) == (3, 20.0)


def queued_views(*queued: int) -> list[WorkerView]:
    """Workers with these prefill tokens in flight (the cost's queued term)."""
    ws = views(len(queued))
    for w, tokens in zip(ws, queued, strict=True):
        w.inflight_prefill_tokens = tokens
        w.refresh()
    return ws


LINEAR_QUEUED = CostWeights(1.0, 0.25, 0.0, 0.0, queued_knee=0.0)  # a linear queued term


def test_backlog_factor_weighs_a_miss_more_only_when_every_worker_is_queued() -> None:
    ws = queued_views(30_000, 10_000)  # w0 holds half the prompt, busier
    weights = LINEAR_QUEUED
    q, matched = query(8000), {0: 250}  # 4,000 of 8,000 tokens cached on w0

    def pick(backlog: float) -> tuple[list[float], int]:
        # the linear factor alone: the saturated part (its own test) off
        config = PolicyConfig(weights=weights, backlog_tokens=backlog, saturated_scale_tokens=0)
        policy = make_policy("approx_tree", config)
        return policy.costs(q, ws, matched), policy.select(q, ws, matched, random.Random(0))[0]

    # the least loaded worker has 10k queued: at backlog 10k a miss counts double
    assert pick(10_000) == ([7500 + 2 * 4000, 2500 + 2 * 8000], 0)
    assert pick(0) == ([7500 + 4000, 2500 + 8000], 1)  # off: the idler worker wins
    ws[1].inflight_prefill_tokens = 0  # one worker is idle: no backlog, factor 1
    ws[1].refresh()
    assert pick(10_000) == ([7500 + 4000, 8000], 1)


def test_saturated_fleet_counts_a_miss_steeply_past_the_saturated_floor() -> None:
    ws = queued_views(30_000, 14_000)  # w0 holds half the prompt, busier
    weights = LINEAR_QUEUED
    q, matched = query(8000), {0: 250}  # 4,000 of 8,000 tokens cached on w0

    def pick(**settings: float) -> tuple[list[float], int]:
        config = PolicyConfig(weights=weights, backlog_tokens=0, **settings)
        policy = make_policy("approx_tree", config)
        return policy.costs(q, ws, matched), policy.select(q, ws, matched, random.Random(0))[0]

    # off (scale 0), or the least loaded worker's 14k under the 20k floor: factor 1, the
    # idler worker wins
    assert pick(saturated_scale_tokens=0) == ([7500 + 4000, 3500 + 8000], 1)
    assert pick(saturated_tokens=20_000) == ([7500 + 4000, 3500 + 8000], 1)
    # past the floor: (14k - 10k) / 2k = 2 more misses' worth, factor 3; the holder wins
    assert pick(saturated_tokens=10_000, saturated_scale_tokens=2_000) == (
        [7500 + 3 * 4000, 3500 + 3 * 8000],
        0,
    )
    # with the backlog factor too: 1 + 14k / 14k + 2 = 4
    config = PolicyConfig(
        weights=weights,
        backlog_tokens=14_000,
        saturated_tokens=10_000,
        saturated_scale_tokens=2_000,
    )
    assert make_policy("cache_aware", config).costs(q, ws, matched) == [
        7500 + 4 * 4000,
        3500 + 4 * 8000,
    ]
    ws[1].inflight_prefill_tokens = 0  # one worker is idle: the fleet is not saturated
    ws[1].refresh()
    assert pick(saturated_tokens=10_000, saturated_scale_tokens=2_000) == ([7500 + 4000, 8000], 1)


def test_cost_weights_parse() -> None:
    assert CostWeights.parse("1,0.5,8") == CostWeights(1.0, 0.5, 8.0, CostWeights().recent_prefill)
    assert CostWeights.parse(" 2, 0, 4 ,0.3") == CostWeights(2.0, 0.0, 4.0, 0.3)
    assert CostWeights.parse("2,0,4,0.3,64") == CostWeights(2.0, 0.0, 4.0, 0.3, 64.0)
    six = CostWeights.parse("2,0,4,0.3,64,8000")
    assert six == CostWeights(2.0, 0.0, 4.0, 0.3, 64.0, 8000.0)
    for bad in ("", "1,2", "1,2,3,4,5,6,7,8", "1,,3", "a,b,c"):
        form = r"PREFILL,QUEUED,DECODE\[,RECENT\[,SLOT_WAIT\[,KNEE\[,DECODE_TIME\]\]\]\], got"
        with pytest.raises(ValueError, match=form):
            CostWeights.parse(bad)
    with pytest.raises(ValueError, match=r"CostWeights\.prefill must be >= 0"):
        CostWeights.parse("-1,0,0")
    with pytest.raises(ValueError, match=r"CostWeights\.queued_knee must be >= 0"):
        CostWeights.parse("1,0.25,16,0.1,1024,-5")
    for bad in ("0.0001", "inf"):
        with pytest.raises(ValueError, match=r"queued_knee must be 0 \(off\) or a finite"):
            CostWeights.parse(f"1,0.25,16,0.1,1024,{bad}")


def test_queued_term_grows_past_its_knee_and_a_burst_leaves_the_holder_sooner() -> None:
    ws = views(2)
    q, held = query(3000), {0: 187}  # worker 0 holds 2,992 of the 3,000 tokens
    linear = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(1.0, 0.25, 0.0, 0.0, queued_knee=0.0))
    )
    # a knee of two prompts: 6,000 queued tokens for this 3,000-token request
    kneed = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(1.0, 0.25, 0.0, 0.0, queued_knee=2.0))
    )
    ws[0].inflight_prefill_tokens = 6000  # a burst's requests queued on the holder
    ws[0].refresh()
    assert linear.costs(q, ws, held) == [0.25 * 6000 + 8, 3000]
    assert kneed.costs(q, ws, held) == [0.25 * 6000 * 2 + 8, 3000]
    ws[0].inflight_prefill_tokens = 8000
    ws[0].refresh()
    # linear: the holder keeps the burst until ~12,000 tokens queued; with the knee it is
    # already dearer than a cold worker at 8,000 (cost 0.25 * 8000 * (1 + 8000 / 6000) + 8)
    assert linear.select(q, ws, held, random.Random(0))[0] == 0
    assert kneed.select(q, ws, held, random.Random(0))[0] == 1
    # an empty queue costs nothing either way: a trickle stays where its prefix is
    ws[0].inflight_prefill_tokens = 0
    ws[0].refresh()
    assert kneed.costs(q, ws, held) == linear.costs(q, ws, held) == [8, 3000]


def test_recent_prefill_term_is_exact_and_scaled() -> None:
    ws = views(3)
    ws[1].recent_prefill = 1000.0  # stored values are in the core's scaled units
    ws[2].recent_prefill = 4000.0
    policy = make_policy("cache_aware", PolicyConfig(weights=CostWeights(1.0, 0.0, 0.0, 0.5)))
    q = RouteQuery("r", 320, B, list(range(20)), recent_scale=0.25)
    assert policy.costs(q, ws, {}) == [320.0, 320.0 + 0.5 * 0.25 * 1000, 320.0 + 0.5 * 0.25 * 4000]
    # with a match the term is added the same way
    assert policy.costs(q, ws, {2: 20}) == [320.0, 445.0, 0.0 + 500.0]
    assert policy.select(q, ws, {2: 20}, random.Random(0)) == (0, 320.0)


def test_cache_aware_ties_are_broken_at_random_and_reproducibly() -> None:
    policy = make_policy("cache_aware")
    ws = views(4)

    def picks(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [policy.select(query(), ws, {}, rng)[0] for _ in range(200)]

    assert picks(1) == picks(1)
    assert set(picks(1)) == {0, 1, 2, 3}
    assert Counter(picks(2))[0] < 100  # not "always worker 0"


def test_cache_aware_only_breaks_ties_among_the_cheapest() -> None:
    policy = make_policy("cache_aware")
    ws = views(3)
    rng = random.Random(3)
    got = {policy.select(query(), ws, {0: 5, 2: 5}, rng)[0] for _ in range(50)}
    assert got == {0, 2}


def test_round_robin_cycles() -> None:
    policy = make_policy("round_robin")
    rng = random.Random(0)
    assert [policy.select(query(), views(3), {}, rng)[0] for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded() -> None:
    policy = make_policy("random")
    a = [policy.select(query(), views(5), {}, random.Random(9))[0] for _ in range(3)]
    assert len(set(a)) == 1
    rng = random.Random(9)
    assert len({policy.select(query(), views(5), {}, rng)[0] for _ in range(100)}) == 5


def test_least_load() -> None:
    ws = views(3)
    ws[0].inflight_prefill_tokens = 10
    ws[1].load = LoadReport(num_running=1)
    ws[2].num_active = 3
    for w in ws:
        w.refresh()
    policy = make_policy("least_load")
    assert policy.costs(query(), ws, {}) == [10, 1, 3]
    assert policy.select(query(), ws, {}, random.Random(0)) == (1, 1)


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    ws = views(4)
    for i, w in enumerate(ws):
        w.num_active = 10 * i
        w.refresh()
    policy = make_policy("power_of_two")
    rng = random.Random(5)
    picks = Counter(policy.select(query(), ws, {}, rng)[0] for _ in range(600))
    assert 3 not in picks  # the busiest can never beat the other one drawn
    assert picks[0] > picks[1] > picks[2] > 0
    assert make_policy("power_of_two").select(query(), ws[:1], {}, rng) == (0, 0.0)


def test_consistent_hash_is_sticky_and_consistent() -> None:
    policy = make_policy("consistent_hash", PolicyConfig(prefix_hash_blocks=2))
    ws = views(8)
    rng = random.Random(0)

    def pick(hashes: list[int], candidates: list[WorkerView]) -> str:
        return candidates[policy.select(query(320, hashes), candidates, {}, rng)[0]].worker_id

    # only the first 2 blocks count
    assert pick([1, 2, 3], ws) == pick([1, 2, 99, 100], ws)
    keys = [[k, k + 1] for k in range(0, 400, 2)]
    before = {tuple(k): pick(k, ws) for k in keys}
    assert len(set(before.values())) == 8
    survivors = [w for w in ws if w.worker_id != "w3"]
    after = {tuple(k): pick(k, survivors) for k in keys}
    moved = [k for k in keys if before[tuple(k)] != after[tuple(k)]]
    assert moved and all(before[tuple(k)] == "w3" for k in moved)  # only w3's keys move


def test_consistent_hash_without_full_block_uses_request_id() -> None:
    policy = make_policy("consistent_hash")
    ws = views(8)
    rng = random.Random(0)
    picks = {policy.select(query(5, [], rid=f"r{i}"), ws, {}, rng)[0] for i in range(50)}
    assert len(picks) > 1
    same = {policy.select(query(5, [], rid="x"), ws, {}, rng)[0] for _ in range(5)}
    assert len(same) == 1


def test_queued_prefill_spreads_a_hot_prefix_in_a_burst() -> None:
    """Policy-level: 100 same-prefix requests before any completes; prefix cached on w0."""
    policy = make_policy("cache_aware")
    ws = views(4)
    rng = random.Random(0)
    matched = {0: 120}  # 1,920 cached tokens of 2,000 on w0
    chosen = []
    for _ in range(100):
        i, _ = policy.select(query(2000), ws, matched, rng)
        w = ws[i]
        w.inflight_prefill_tokens += 2000 - matched.get(w.slot, 0) * B
        w.refresh()
        matched[w.slot] = 120  # after routing, that worker will hold the prefix too
        chosen.append(i)
    assert len(set(chosen)) > 1
    assert chosen[:24] == [0] * 24  # the holder takes requests while its queue is short
