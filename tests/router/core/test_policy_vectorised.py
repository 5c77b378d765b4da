"""CacheAware.select_set (every candidate scored at once from the WorkerTable) against
CacheAware.select over the views (the reference): the same pick, cost and random draws."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto.events import LoadReport
from router.core.cost import affinity_terms
from router.core.policy import (
    CandidateSet,
    CostWeights,
    PolicyConfig,
    RouteQuery,
    WorkerTable,
    WorkerView,
)
from router.core.registry import make_policy
from router.core.step_profile import StepProfile

# small values make equal costs (ties) common; inf weights make NaN costs (inf * 0), which
# select_set leaves to select()
weight = st.sampled_from([0.0, 0.1, 0.25, 1.0, 16.0, 1e6, math.inf])
count = st.integers(0, 5) | st.integers(0, 10**6)
# the queued term's knee, in prompts: 0 is linear; the smallest allowed makes q * q count most
knee = st.sampled_from([0.0, 1e-3, 0.5, 14.0, 1e6]) | st.floats(1e-3, 1e9)
recent = st.sampled_from([0.0, 0.5, 3.0]) | st.floats(0, 1e12)


@st.composite
def fleets(draw, weights: CostWeights):
    n = draw(st.integers(1, 40))
    slots = draw(st.permutations(range(n + draw(st.integers(0, 5)))))[:n]
    if draw(st.booleans()):
        slots = sorted(slots)
    # the table keeps the load part under its weights: the policy's, or others (then the
    # policy computes it from the rows); attach grows the capacity
    table_weights = draw(st.sampled_from([weights, CostWeights(*weights_of(weights)), None]))
    table = WorkerTable(capacity=draw(st.integers(1, 8)), weights=table_weights)
    views = []
    for s in slots:
        v = WorkerView(f"w{s}", s)
        table.attach(v)
        v.inflight_prefill_tokens = draw(count)
        v.num_active = draw(st.integers(0, 4))
        v.num_prefilling = draw(st.integers(0, v.num_active))
        if draw(st.booleans()):
            v.load = LoadReport(
                num_running=draw(st.integers(0, 3)),
                num_waiting=draw(st.integers(0, 3)),
                num_queued_prefill_tokens=draw(count),
                num_total_kv_tokens=draw(st.sampled_from([0, 1000, 450_000])),
                num_free_kv_tokens=draw(st.sampled_from([0, 500])),
            )
        v.refresh()
        v.recent_prefill = draw(recent)
        if draw(st.booleans()):  # a stated running cap, often at or under the load
            v.max_running = draw(st.integers(0, 8))
        if draw(st.booleans()):  # a step profile of its own (decision 0031)
            v.step_profile = StepProfile(0.01, draw(st.sampled_from([0.0, 2e-4])), 1e-7, 2e-5)
        views.append(v)
    # a candidate subset, in fleet order (as the core's exclude filter leaves it)
    keep = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    candidates = [v for v, k in zip(views, keep, strict=True) if k] or views[:1]
    all_slots = list(range(max(slots) + 3))
    matched = draw(
        st.dictionaries(st.sampled_from(all_slots), st.integers(1, 40), max_size=len(all_slots))
    )
    return table, candidates, matched


def weights_of(w: CostWeights) -> tuple[float, ...]:
    return (
        w.prefill,
        w.queued_prefill,
        w.decode,
        w.recent_prefill,
        w.slot_wait,
        w.queued_knee,
        w.decode_time,
    )


@given(
    data=st.data(),
    weights=st.builds(
        CostWeights, weight, weight, weight, weight, weight, knee, st.sampled_from([0.0, 0.1, 1.0])
    ),
    out=st.sampled_from([0.0, 1.0, 200.0]),
    backlog=st.sampled_from([0.0, 1.0, 50_000.0]),
    saturated=st.sampled_from([(0.0, 0.0), (0.0, 1.0), (10_000.0, 2_000.0), (5.0, 1e-300)]),
    affinity=st.sampled_from([0.0, 1000.0, 1e-300]),
    prompt=st.integers(0, 700),
    scale=st.sampled_from([1.0, 0.5, 1e-30]),
    policy_name=st.sampled_from(["cache_aware", "approx_tree"]),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=400, deadline=None)
def test_select_set_equals_select(
    data, weights, out, backlog, saturated, affinity, prompt, scale, policy_name, seed
):
    table, candidates, matched = data.draw(fleets(weights))
    config = PolicyConfig(
        weights=weights,
        backlog_tokens=backlog,
        affinity_tokens=affinity,
        saturated_tokens=saturated[0],
        saturated_scale_tokens=saturated[1],
    )
    policy = make_policy(policy_name, config)
    query = RouteQuery("r", prompt, 16, list(range(prompt // 16)), scale, out)
    rng_ref, rng_new = random.Random(seed), random.Random(seed)
    i_ref, cost_ref = policy.select(query, candidates, matched, rng_ref)
    i_new, cost_new = policy.select_set(query, CandidateSet.of(candidates, table), matched, rng_new)
    assert i_new == i_ref
    assert cost_new == cost_ref or (math.isnan(cost_new) and math.isnan(cost_ref))
    assert type(cost_new) is float
    assert rng_new.getstate() == rng_ref.getstate()  # the same draws
    if policy._finite:  # the formula, bit for bit, against its plain-Python definition
        got = policy.costs(query, candidates, matched)
        want = reference_costs(policy, query, candidates, matched)
        # NaN where both are NaN (an overflowing factor times no missed tokens: a scale of
        # 1e-300 tokens and an empty prompt), else the same float
        pairs = zip(got, want, strict=True)
        assert all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in pairs)


def decode_parts_of(c: WorkerView) -> tuple[float, float]:
    """The decode-time term's per-worker parts (router.core.cost's module docstring), from
    their definition: with r requests past their prefill and K their KV, the term is
    L * (A + (P + L / 2) * B), A = r * 2 * seq + K * ctx, B = r * ctx."""
    r = c.num_running - c.num_prefilling
    if r <= 0:
        return 0.0, 0.0
    seq, ctx = c.step_profile.seq_tokens(), c.step_profile.context_tokens()
    if c.kv_per_running > 0:  # K = r x the reported KV per running request
        return r * (2.0 * seq) + r * c.kv_per_running * ctx, r * ctx
    return r * (2.0 * seq), 2.0 * (r * ctx)  # K = r x its own KV, P + L / 2


def reference_costs(policy, query, candidates, matched) -> list[float]:
    """The cache-aware cost written out per candidate in plain Python (router.core.cost's
    module docstring), in the float operations' order: ((wq*q + wd*r + wc*s) + wr*recent)
    + prefill, then the knee, then the decode-time term's two parts, then the affinity term."""
    w = policy.config.weights
    wp = w.prefill * policy.miss_factor(candidates)
    wr = w.recent_prefill * query.recent_scale
    wqk = w.queued_prefill * w.per_knee(query.prompt_tokens)
    prompt, bs = query.prompt_tokens, query.block_size
    out = []
    for c in candidates:
        q = c.queued_prefill_tokens
        x = w.queued_prefill * q + w.decode * c.num_running + w.slot_wait * c.slot_queue
        x += wr * c.recent_prefill
        x += wp * max(prompt - matched.get(c.slot, 0) * bs, 0) if c.slot in matched else wp * prompt
        if wqk:
            x += q * (q * wqk)
        gen = query.expected_output_tokens
        if w.decode_time and gen > 0:
            a, b = decode_parts_of(c)
            per_part = w.decode_time * gen
            x += a * per_part
            x += b * (per_part * (query.prompt_tokens + 0.5 * gen))
        out.append(x)
    if policy.config.affinity_tokens:
        depths = np.array([matched.get(c.slot, 0) for c in candidates], dtype=np.intp)
        ids = np.array([c.id_hash for c in candidates], dtype=np.uint64)
        extra = affinity_terms(query.block_hashes, depths, ids, policy.config.affinity_tokens)
        if extra is not None:
            out = [x + e for x, e in zip(out, extra.tolist(), strict=True)]
    return out


def test_table_follows_every_change_of_an_attached_view() -> None:
    table = WorkerTable(capacity=1, weights=CostWeights(queued_knee=0.0))  # linear queued term
    a, b = WorkerView("a", 0), WorkerView("b", 5)
    for v in (a, b):
        table.attach(v)
    b.inflight_prefill_tokens, b.num_active = 40, 2
    b.refresh()
    assert table.fields[:5, 5].tolist() == [40.0, 2.0, 0.0, 0.25 * 40 + 16.0 * 2, 0.0]
    b.load = LoadReport(num_running=3, num_waiting=4, num_queued_prefill_tokens=90)
    b.refresh()
    b.recent_prefill = 7.5
    assert table.fields[:5, 5].tolist() == [90.0, 7.0, 7.5, 0.25 * 90 + 16.0 * 7, 0.0]
    b.queued_prefill_tokens, b.num_running = 1, 2  # direct assignment writes through too
    assert table.fields[:5, 5].tolist() == [1.0, 2.0, 7.5, 0.25 + 32.0, 0.0]
    wc = table.weights.slot_wait
    b.max_running = 2  # at its cap: a new request waits behind one running request
    assert b.slot_queue == 1
    assert table.fields[:5, 5].tolist() == [1.0, 2.0, 7.5, 0.25 + 32.0 + wc, 1.0]
    b.load = LoadReport(num_running=2, num_waiting=3)
    b.refresh()  # two running, three waiting: four ahead of a new one
    assert table.fields[:5, 5].tolist() == [40.0, 5.0, 7.5, 10.0 + 80.0 + 4 * wc, 4.0]
    b.max_running = 0  # no cap stated: no wait charged
    assert table.fields[:5, 5].tolist() == [40.0, 5.0, 7.5, 10.0 + 80.0, 0.0]
    WorkerTable.detach(b)
    b.recent_prefill = 99.0
    assert table.fields[2, 5] == 7.5  # a detached view no longer writes
    c = WorkerView("c", 5, recent_prefill=3.0)  # a new worker in the freed slot
    table.attach(c)
    assert table.fields[:5, 5].tolist() == [0.0, 0.0, 3.0, 0.0, 0.0]
    assert table.fields[:5, 0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="max_running must be >= 0, got -1"):
        c.max_running = -1


def test_table_keeps_the_linear_load_part_and_the_knee_is_added_per_route() -> None:
    weights = CostWeights(1.0, 0.25, 16.0, 0.0, queued_knee=2.0)
    table = WorkerTable(weights=weights)
    v = WorkerView("a", 0)
    table.attach(v)
    v.inflight_prefill_tokens, v.num_active = 512, 1
    v.refresh()  # the knee depends on the request: not in the table
    assert table.fields[:5, 0].tolist() == [512.0, 1.0, 0.0, 0.25 * 512 + 16.0, 0.0]
    policy = make_policy("cache_aware", PolicyConfig(weights=weights, backlog_tokens=0))
    query = RouteQuery("r", 256, 16, [])  # knee: 2 prompts of 256 tokens, 512 queued
    _, cost = policy.select_set(query, CandidateSet.of([v], table), {}, random.Random(0))
    assert cost == 0.25 * 512 * 2 + 16.0 + 256


def test_a_subclass_with_its_own_cost_is_scored_by_it() -> None:
    from router.core.cost import CacheAware

    class Reversed(CacheAware):
        def costs(self, query, candidates, matched):
            return [-c for c in super().costs(query, candidates, matched)]

    table = WorkerTable()
    views = [WorkerView(f"w{i}", i) for i in range(3)]
    for v in views:
        table.attach(v)
    views[1].recent_prefill = 100.0
    policy = Reversed(PolicyConfig())
    q = RouteQuery("r", 320, 16, list(range(20)))
    got = policy.select_set(q, CandidateSet.of(views, table), {}, random.Random(0))
    assert got == policy.select(q, views, {}, random.Random(0)) == (1, -330.0)
