"""Waiting-queue orderings on hand-built radix trees: dfs-weight's DFS over subtree weights
(where it differs from grouping by matched node) and routing-key's running-batch counts."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sched_harness import make_engine, request, run

from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig
from worker.cache.disabled import DisabledCache
from worker.cache.radix_cache import RadixCache
from worker.engine.request import Req
from worker.engine.schedule_policy import DfsWeightPolicy, make_policy
from worker.engine.types import EngineRequest, SamplingParams

S = [7] * 100  # a shared "system prompt"
U1 = [21] * 20
U2 = [22] * 20
T = [8] * 100  # an unrelated prefix


def _tree() -> RadixCache:
    """root ─┬─ S(100) ─┬─ U1(20)
    │          └─ U2(20)
    └─ T(100)"""
    cache = RadixCache(CacheConfig(), SlotAllocator(1000))
    for key in (S + U1, S + U2, T):
        m = cache.match_prefix(np.asarray(key))
        assert m.num_matched in (0, 100)
        n = len(key) - m.num_matched
        slots = np.concatenate((m.slots, cache.allocator.alloc(n)))
        cache.insert(np.asarray(key), slots)
    assert cache.structure() == {
        tuple(S): {tuple(U1): {}, tuple(U2): {}},
        tuple(T): {},
    }
    return cache


def _req(cache: RadixCache, rid: str, seq: int, tokens: list[int]) -> Req:
    er = EngineRequest(rid, np.asarray(tokens, dtype=np.int64), SamplingParams())
    r = Req(er, seq, 4, cache.root)
    m = cache.match_prefix(np.asarray(tokens))
    r.est_match = m.num_matched
    r.est_node = m.last_node
    return r


def _ids(reqs: list[Req]) -> list[str]:
    return [r.request_id for r in reqs]


def test_dfs_weight_orders_by_subtree_weight_not_by_matched_node() -> None:
    cache = _tree()
    arrivals = [("x1", [*T, 1]), ("a", S + U1 + [2]), ("x2", [*T, 3]), ("b", S + U2 + [4])]
    arrivals.append(("c", [*S, 5]))
    waiting = [_req(cache, rid, seq, toks) for seq, (rid, toks) in enumerate(arrivals)]
    # Grouping by matched node would put T's pair first (the only node with two requests);
    # the S subtree holds three waiting requests, so it goes first: U1 (oldest) before U2,
    # then c, whose match ends at S itself, after S's children.
    assert _ids(DfsWeightPolicy(cache).order(waiting, True)) == ["a", "b", "c", "x1", "x2"]


def test_dfs_weight_heavier_child_first_and_ties_by_oldest_request() -> None:
    cache = _tree()
    arrivals = [("b1", S + U2 + [1]), ("a1", S + U1 + [2]), ("b2", S + U2 + [3])]
    arrivals += [("t1", [*T, 4]), ("r", [99, 98])]
    waiting = [_req(cache, rid, seq, toks) for seq, (rid, toks) in enumerate(arrivals)]
    # S (3) before T (1); in S, U2 (2) before U1 (1); r matched nothing: the root's own, last.
    assert _ids(DfsWeightPolicy(cache).order(waiting, True)) == ["b1", "b2", "a1", "t1", "r"]
    # Equal weights: the subtree holding the oldest request goes first.
    tie = [_req(cache, "t", 0, [*T, 1]), _req(cache, "u", 1, S + U1 + [1])]
    assert _ids(DfsWeightPolicy(cache).order(tie, True)) == ["t", "u"]
    tie = [_req(cache, "u", 0, S + U1 + [1]), _req(cache, "t", 1, [*T, 1])]
    assert _ids(DfsWeightPolicy(cache).order(tie, True)) == ["u", "t"]


def test_dfs_weight_counts_a_request_whose_node_was_evicted_at_the_root() -> None:
    cache = _tree()
    waiting = [_req(cache, "u", 0, S + U1 + [1])]
    cache.match_prefix(np.asarray(S + U2))  # U1 is now the least recent leaf
    waiting += [_req(cache, "t", 1, [*T, 1]), _req(cache, "t2", 2, [*T, 2])]
    u_node = waiting[0].est_node
    assert cache.evict(20) == 20
    assert cache.parent_node(u_node) is None
    # T (2) first; u's node is gone, so it waits with the root's own requests.
    assert _ids(DfsWeightPolicy(cache).order(waiting, True)) == ["t", "t2", "u"]


def test_dfs_weight_walks_nothing_but_the_root_of_a_disabled_cache() -> None:
    cache = DisabledCache(CacheConfig(), SlotAllocator(100))
    reqs = []
    for seq, rid in enumerate(["b", "a"]):
        r = Req(EngineRequest(rid, np.asarray([1, 2])), seq, 4, cache.root)
        reqs.append(r)
    assert _ids(DfsWeightPolicy(cache).order(reqs[::-1], False)) == ["b", "a"]


def test_parent_node_is_read_only() -> None:
    cache = _tree()
    node = cache.match_prefix(np.asarray(S + U1)).last_node
    before = cache.pretty_print(), node.last_access
    parent = cache.parent_node(node)
    assert parent is cache.match_prefix(np.asarray(S)).last_node
    assert cache.parent_node(parent) is cache.root
    assert cache.parent_node(cache.root) is None
    node2 = cache.match_prefix(np.asarray(S + U1)).last_node
    assert node2 is node and cache.pretty_print() == before[0]


def test_engine_admits_in_dfs_weight_order() -> None:
    engine, ex = make_engine(num_kv_slots=4000, schedule_policy="dfs-weight")
    for rid, prompt in (("w1", S + U1), ("w2", S + U2), ("w3", T)):
        engine.add_request(request(rid, prompt, max_new_tokens=1))
        run(engine)
    ex.steps.clear()
    for rid, prompt in [
        ("x1", [*T, 1]),
        ("a", S + U1 + [2]),
        ("x2", [*T, 3]),
        ("b", S + U2 + [4]),
        ("c", [*S, 5]),
    ]:
        engine.add_request(request(rid, prompt, max_new_tokens=1))
    results = run(engine)
    # All five fit one step: the step's prefill order is the admission order.
    assert [item[1] for item in ex.steps[0]] == ["a", "b", "c", "x1", "x2"]
    assert results["c"].usage.cached_prompt_tokens == 100
    assert results["a"].usage.cached_prompt_tokens == 120


def test_make_policy_gives_dfs_weight_the_tree() -> None:
    cache = _tree()
    policy = make_policy("dfs-weight", random.Random(0), cache)
    assert isinstance(policy, DfsWeightPolicy)
    with pytest.raises(ValueError, match="dfs-weight"):
        make_policy("nope", random.Random(0), cache)


def _keyed(rid: str, seq: int, key: str) -> Req:
    er = EngineRequest(rid, np.asarray([1, 2, 3], dtype=np.int64), routing_key=key)
    return Req(er, seq, 4, None)


def test_routing_key_orders_by_frequency_in_the_running_batch() -> None:
    running = [_keyed(f"r{i}", i, k) for i, k in enumerate(["k1", "k2", "k1", "k1", "", "k2"])]
    waiting = [
        _keyed("none", 10, ""),
        _keyed("k3", 11, "k3"),
        _keyed("k2a", 12, "k2"),
        _keyed("k1a", 13, "k1"),
        _keyed("k2b", 14, "k2"),
        _keyed("k1b", 15, "k1"),
    ]
    order = make_policy("routing-key", random.Random(0), _tree()).order(waiting, True, running)
    # k1 (3 running) then k2 (2), one key's requests together; the rest in arrival order.
    assert _ids(order) == ["k1a", "k1b", "k2a", "k2b", "none", "k3"]


def test_routing_key_without_keys_running_is_arrival_order() -> None:
    waiting = [_keyed("b", 5, "k1"), _keyed("a", 2, "k2")]
    policy = make_policy("routing-key", random.Random(0), _tree())
    assert _ids(policy.order(waiting, True, [_keyed("r", 0, "")])) == ["b", "a"]
    assert _ids(policy.order(waiting, False, [])) == ["a", "b"]  # a retracted one is older


def test_engine_admits_the_running_batchs_key_first() -> None:
    engine, ex = make_engine(
        num_kv_slots=4000, schedule_policy="routing-key", max_running_requests=2
    )

    def keyed(rid: str, prompt: list[int], key: str, n: int) -> EngineRequest:
        return EngineRequest(
            rid,
            np.asarray(prompt, dtype=np.int64),
            SamplingParams(max_new_tokens=n),
            routing_key=key,
        )

    engine.add_request(keyed("conv-1", [1] * 10, "tenant-a", 20))
    engine.step()  # tenant-a decodes from now on
    engine.add_request(keyed("other", [2] * 10, "tenant-b", 1))
    engine.add_request(keyed("none", [3] * 10, "", 1))
    engine.add_request(keyed("conv-2", [4] * 10, "tenant-a", 1))
    run(engine)
    prefills = [item[1] for step in ex.steps for item in step if item[0] == "p"]
    assert prefills == ["conv-1", "conv-2", "other", "none"]


def test_routing_key_is_validated_and_decoded_from_the_wire() -> None:
    from edge.limits import RequestLimits
    from kvroute_proto import kvroute_pb2 as pb
    from worker.errors import InvalidRequestError
    from worker.service.convert import request_from_pb

    msg = pb.GenerateRequest(
        request_id="r", prompt_token_ids=pb.TokenIds(ids=[1, 2]), routing_key="tenant-7"
    )
    er = request_from_pb(msg, tokenizer=None, limits=RequestLimits(), new_request_id=str)
    assert er.routing_key == "tenant-7"
    engine, _ = make_engine()
    bad = EngineRequest("x", np.asarray([1, 2], dtype=np.int64), routing_key="k" * 257)
    with pytest.raises(InvalidRequestError, match=r"routing_key.*256"):
        engine.add_request(bad)
    assert engine.scheduler.num_waiting == 0
