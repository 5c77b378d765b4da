"""The peers' algorithms: the exact pick in each case their rules distinguish."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from kvroute_proto.events import LoadReport
from router.core.peer_policies import ConsistentHash
from router.core.policy import PolicyConfig, RouteQuery, WorkerView
from router.core.registry import make_policy
from router.core.router_core import RouterConfig, RouterCore, RouteRequest

B = 16


def views(n: int, active: list[int] | None = None) -> list[WorkerView]:
    ws = [WorkerView(f"w{i}", i) for i in range(n)]
    for w, a in zip(ws, active or [0] * n, strict=True):
        w.num_active = a
        w.refresh()
    return ws


def query(prompt: int = 320, hashes: list[int] | None = None, rid: str = "r") -> RouteQuery:
    return RouteQuery(rid, prompt, B, hashes if hashes is not None else list(range(prompt // B)))


def pick(name: str, ws: list[WorkerView], matched: dict[int, int], **kw) -> str:
    policy = kw.pop("policy", None) or make_policy(name)
    i, _ = policy.select(query(**kw), ws, matched, random.Random(0))
    return ws[i].worker_id


# ---- sglang ------------------------------------------------------------------------------


def test_sglang_imbalance_gate_goes_to_shortest_queue_over_a_full_match() -> None:
    ws = views(4, [100, 10, 30, 70])  # max - min = 90 > 64 and 100 > 1.5 * 10
    assert pick("sglang", ws, {0: 20}) == "w1"


@pytest.mark.parametrize("active", [[60, 0, 0, 0], [300, 210, 250, 280]])
def test_sglang_balanced_when_either_threshold_holds(active: list[int]) -> None:
    # [60, 0]: the gap 60 is not > 64; [300, 210]: 300 is not > 1.5 * 210
    ws = views(4, active)
    assert pick("sglang", ws, {2: 10, 3: 4}) == "w2"  # 160/320 = 0.5 > 0.3: highest match


def test_sglang_low_match_rate_goes_to_the_smallest_tree_and_grows_it() -> None:
    policy = make_policy("sglang")
    policy.tree_tokens.update({"w0": 100, "w1": 50, "w2": 10, "w3": 80})  # type: ignore[attr-defined]
    ws = views(4)
    # w0 matches 96 of 320 tokens = 0.3, not above the threshold
    assert pick("sglang", ws, {0: 6}, policy=policy) == "w2"
    assert policy.tree_tokens["w2"] == 10 + 320  # type: ignore[attr-defined]
    # a high match inserts only the unmatched tail into the chosen worker's tree
    assert pick("sglang", ws, {1: 15}, policy=policy) == "w1"
    assert policy.tree_tokens["w1"] == 50 + 320 - 240  # type: ignore[attr-defined]


def test_sglang_copy_does_not_share_the_trees() -> None:
    policy = make_policy("sglang")
    clone = copy.copy(policy)
    clone.select(query(), views(2), {}, random.Random(0))
    assert policy.tree_tokens == {}  # type: ignore[attr-defined]
    assert sum(clone.tree_tokens.values()) == 320  # type: ignore[attr-defined]


# ---- dynamo ------------------------------------------------------------------------------


def _dynamo_views() -> list[WorkerView]:
    ws = views(4)
    ws[2].inflight_prefill_tokens = 480
    ws[3].load = LoadReport(
        num_free_kv_tokens=500, num_evictable_kv_tokens=180, num_total_kv_tokens=1000
    )  # 320 tokens held = 20 blocks
    for w in ws:
        w.refresh()
    return ws


def test_dynamo_cost_is_prefill_blocks_plus_decode_blocks() -> None:
    policy = make_policy("dynamo")
    ws = _dynamo_views()
    matched = {0: 10, 2: 20}
    # w0: (0 + 160)/16 + (0 + 20 - 10) = 20; w1: 20 + 20 = 40; w2: (480 + 0)/16 + 0 = 30;
    # w3: 320/16 + (20 active + 20 new) = 60
    assert policy.costs(query(), ws, matched) == [20.0, 40.0, 30.0, 60.0]
    assert pick("dynamo", ws, matched) == "w0"
    ws[0].inflight_prefill_tokens = 800  # (800 + 160)/16 + 10 = 70: the holder of all loses
    assert pick("dynamo", ws, matched) == "w2"


def test_dynamo_counts_its_own_picks_until_the_next_load_report() -> None:
    policy = make_policy("dynamo")
    ws = views(2)
    report = LoadReport(num_free_kv_tokens=1000, num_total_kv_tokens=1000)
    for w in ws:
        w.load = report
    rng = random.Random(0)
    assert policy.costs(query(), ws, {}) == [40.0, 40.0]
    first, _ = policy.select(query(), ws, {}, rng)
    # the pick added its 20 blocks to the chosen worker's active blocks: the next goes elsewhere
    assert policy.costs(query(), ws, {})[first] == 60.0
    second, _ = policy.select(query(), ws, {}, rng)
    assert second != first
    ws[first].load = LoadReport(num_free_kv_tokens=1000, num_total_kv_tokens=1000)  # fresh
    assert policy.costs(query(), ws, {})[first] == 40.0  # the report supersedes the count
    assert policy.costs(query(), ws, {})[second] == 60.0


# ---- llm-d -------------------------------------------------------------------------------


def test_llm_d_weighted_scores_and_max_score_pick() -> None:
    policy = make_policy("llm_d")
    ws = views(4)
    ws[1].load = LoadReport(num_waiting=4, num_free_kv_tokens=100, num_total_kv_tokens=1000)
    matched = {0: 10, 1: 20, 3: 15}
    # prefix (min-max over matching pods): w0 0, w1 1, w2 0 (no match), w3 0.5
    # kv: w1 1 - 0.9, others 1; queue: w1 (4 - 4) / 4 = 0, others 1
    costs = policy.costs(query(), ws, matched)
    assert costs == pytest.approx([-2.0, -2.1, -2.0, -3.0])
    assert pick("llm_d", ws, matched) == "w3"


def test_llm_d_a_single_matching_pod_scores_full_prefix() -> None:
    policy = make_policy("llm_d")
    ws = views(3)
    ws[0].load = LoadReport(num_waiting=2, num_free_kv_tokens=0, num_total_kv_tokens=100)
    # w0: 2 * 1 + 0 (full) + 0 (longest queue) = 2; w1, w2: 0 + 1 + 1 = 2 -> a tie
    assert policy.costs(query(), ws, {0: 3}) == pytest.approx([-2.0, -2.0, -2.0])
    ws[0].load = LoadReport(num_waiting=2, num_free_kv_tokens=50, num_total_kv_tokens=100)
    assert pick("llm_d", ws, {0: 3}) == "w0"  # 2.5 against 2


# ---- aibrix ------------------------------------------------------------------------------


def test_aibrix_load_gate_restricts_matching_to_the_least_loaded() -> None:
    # mean 7.5: 20 > 2 * (7.5 + 1) and 20 - 2 >= 8 -> only w1, w2 (2 each) may match
    ws = views(4, [20, 2, 2, 6])
    assert pick("aibrix", ws, {0: 20, 2: 10}) == "w2"
    ws = views(4, [20, 2, 3, 6])  # only w1 may match; w2 (3 running) is shut out
    assert pick("aibrix", ws, {0: 20, 2: 10}) == "w1"  # no allowed match: least loaded


def test_aibrix_best_match_within_mean_plus_one_sigma() -> None:
    ws = views(4, [6, 0, 0, 0])  # no gate (6 <= 2 * 2.5); mean 1.5, sigma 2.6: limit 4.1
    assert pick("aibrix", ws, {0: 20, 1: 10}) == "w1"  # w0 matches more but is over the limit
    ws = views(4, [3, 3, 1, 1])  # mean 2, sigma 1: limit 3
    assert pick("aibrix", ws, {0: 20, 1: 10, 2: 10}) == "w0"  # 100% beats 50%, count 3 <= 3
    assert pick("aibrix", ws, {1: 10, 2: 10}) == "w2"  # equal match: fewer running first


def test_aibrix_without_match_takes_the_least_loaded() -> None:
    assert pick("aibrix", views(4, [3, 1, 2, 5]), {}) == "w1"


# ---- consistent_hash ---------------------------------------------------------------------


def test_consistent_hash_bounded_load_spills_along_the_ring_and_comes_back() -> None:
    policy = make_policy("consistent_hash")
    ws = views(4)
    home = pick("consistent_hash", ws, {}, policy=policy)
    slot = int(home[1:])
    ws[slot].num_active = 5  # total 5: cap = ceil(1.25 * 6 / 4) = 2
    spill = pick("consistent_hash", ws, {}, policy=policy)
    assert spill != home
    assert pick("consistent_hash", ws, {}, policy=policy) == spill  # deterministic
    ws[slot].num_active = 1  # total 1: cap = ceil(1.25 * 2 / 4) = 1, and 1 is not below it
    assert pick("consistent_hash", ws, {}, policy=policy) == spill
    ws[slot].num_active = 0
    assert pick("consistent_hash", ws, {}, policy=policy) == home


def test_consistent_hash_spreads_one_shared_prefix_within_the_bound() -> None:
    """prefix_hash sent every request sharing the first blocks to one worker."""
    policy = make_policy("consistent_hash")
    ws = views(4)
    rng = random.Random(0)
    for i in range(100):  # nothing finishes: in-flight counts only grow
        j, _ = policy.select(query(320, rid=f"r{i}"), ws, {}, rng)
        ws[j].num_active += 1
    counts = [w.num_active for w in ws]
    assert max(counts) <= 32  # ceil(1.25 * 100 / 4)
    assert min(counts) > 0


def test_consistent_hash_keys_on_the_configured_prefix_length() -> None:
    short = ConsistentHash(PolicyConfig(prefix_hash_blocks=2))
    long = ConsistentHash(PolicyConfig(prefix_hash_blocks=3))
    a, b = query(hashes=[1, 2, 3]), query(hashes=[1, 2, 4])
    assert short.key(a) == short.key(b)
    assert long.key(a) != long.key(b)


# ---- through the core --------------------------------------------------------------------


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("name", ["sglang", "dynamo", "llm_d", "aibrix", "consistent_hash"])
def test_peer_policies_route_through_the_core(name: str) -> None:
    clock = _Clock()
    core = RouterCore(RouterConfig(policy=name), clock=clock, rng=random.Random(0))
    for i in range(4):
        core.add_worker(f"w{i}", block_size=B)
    toks = np.arange(320, dtype=np.uint32)
    first = core.route(RouteRequest("r0", toks))
    core.on_first_token("r0")
    core.on_finished("r0", 10)
    clock.now += 1.0
    again = core.route(RouteRequest("r1", toks))
    assert again.policy == name
    if name != "consistent_hash":  # the cache-aware peers follow the predicted prefix
        assert (again.worker_id, again.matched_tokens) == (first.worker_id, 320)
    else:
        assert again.worker_id == first.worker_id and again.matched_tokens == 0
    explanation = core.explain(RouteRequest("r2", toks))
    assert explanation.chosen_worker_id is not None
