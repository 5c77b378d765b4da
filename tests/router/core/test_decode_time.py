"""The cost's decode-time term (decision 0031): the time a request's decode and prefill add
to its own and to the running requests' time, from the worker's step profile."""

from __future__ import annotations

import random

import pytest

from kvroute_proto.events import LoadReport
from router.core.flights import DEFAULT_OUTPUT_TOKENS, OUTPUT_MEAN_WEIGHT
from router.core.policy import CostWeights, PolicyConfig, RouteQuery, WorkerView
from router.core.registry import make_policy
from router.core.router_core import RouterConfig, RouterCore, RouteRequest
from router.core.step_profile import DEFAULT_STEP_PROFILE, StepProfile

# seq 5 and ctx 0.01 prefill tokens: easy numbers
PROFILE = StepProfile(
    decode_base_s=0.01,
    decode_s_per_seq=1e-4,
    decode_s_per_context_token=2e-7,
    prefill_s_per_token=2e-5,
)


def _view(slot: int, running: int, kv_per_running: int = 0) -> WorkerView:
    v = WorkerView(f"w{slot}", slot)
    v.step_profile = PROFILE
    total = 1_000_000
    v.load = LoadReport(
        num_running=running,
        num_total_kv_tokens=total,
        num_free_kv_tokens=total - running * kv_per_running,
    )
    v.refresh()
    return v


def test_the_term_is_the_decode_time_in_prefill_tokens():
    policy = make_policy("cache_aware", PolicyConfig(weights=CostWeights(decode_time=1.0)))
    base = make_policy("cache_aware", PolicyConfig(weights=CostWeights(decode_time=0.0)))
    busy, idle = _view(0, running=4, kv_per_running=1000), _view(1, running=0)
    query = RouteQuery("r", 320, 16, list(range(20)), 1.0, 100.0)
    matched = {0: 10}  # 160 tokens cached on the busy worker
    with_term = policy.costs(query, [busy, idle], matched)
    without = base.costs(query, [busy, idle], matched)
    seq, ctx = 5.0, 0.01
    own_kv = 320 + 50
    # its decode at a batch of 4 holding 4,000 KV tokens, and 4 requests' steps slowed by it
    decode = 100 * (4 * (2 * seq + own_kv * ctx) + 4000 * ctx)
    assert with_term[0] - without[0] == pytest.approx(decode)
    assert with_term[1] == without[1]  # nothing running there: it adds nobody's time
    # requests still waiting for their first token are the queued term's, not this one's
    busy.num_prefilling = 3
    busy.refresh()
    decode_one = 100 * (1 * (2 * seq + own_kv * ctx) + 1000 * ctx)
    after = policy.costs(query, [busy, idle], matched)[0]
    assert after - base.costs(query, [busy, idle], matched)[0] == pytest.approx(decode_one)


def test_a_hit_on_a_crowded_worker_loses_to_an_idle_one_only_with_the_term():
    crowded, idle = (
        _view(0, running=60, kv_per_running=3000),
        _view(1, running=2, kv_per_running=3000),
    )
    query = RouteQuery("r", 3000, 16, list(range(187)), 1.0, 200.0)
    matched = {0: 150}  # 2,400 of 3,000 tokens cached on the crowded worker
    rng = random.Random(0)
    plain = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(decode=0.0, decode_time=0.0))
    )
    aware = make_policy(
        "cache_aware", PolicyConfig(weights=CostWeights(decode=0.0, decode_time=0.1))
    )
    assert plain.select(query, [crowded, idle], matched, rng)[0] == 0
    assert aware.select(query, [crowded, idle], matched, rng)[0] == 1


def test_no_expected_output_or_no_weight_leaves_the_cost_as_it_was():
    busy = _view(0, running=8, kv_per_running=500)
    aware = make_policy("cache_aware", PolicyConfig(weights=CostWeights(decode_time=0.5)))
    plain = make_policy("cache_aware", PolicyConfig())
    query = RouteQuery("r", 64, 16, [1, 2, 3, 4], 1.0, 0.0)
    assert aware.costs(query, [busy], {}) == plain.costs(query, [busy], {})


def test_the_core_keeps_a_running_mean_of_outputs_and_each_workers_profile():
    core = RouterCore(RouterConfig(), clock=lambda: 0.0, rng=random.Random(0))
    core.add_worker("a", block_size=16)
    assert core.worker_view("a").step_profile is DEFAULT_STEP_PROFILE
    core.set_step_profile("a", PROFILE)
    assert core.worker_view("a").step_profile == PROFILE
    assert core._query(RouteRequest("r", [1] * 40)).expected_output_tokens == DEFAULT_OUTPUT_TOKENS
    core.route(RouteRequest("r", [1] * 40))
    core.on_finished("r", generated_tokens=1000)
    mean = DEFAULT_OUTPUT_TOKENS + (1000 - DEFAULT_OUTPUT_TOKENS) * OUTPUT_MEAN_WEIGHT
    assert core._query(RouteRequest("s", [1] * 40)).expected_output_tokens == pytest.approx(mean)
    core.route(RouteRequest("s", [1] * 40))
    core.on_finished("s")  # no usage (aborted): the mean stays
    assert core._query(RouteRequest("t", [1] * 40)).expected_output_tokens == pytest.approx(mean)


def test_the_core_counts_requests_not_yet_past_their_prefill():
    core = RouterCore(RouterConfig(), clock=lambda: 0.0, rng=random.Random(0))
    core.add_worker("a", block_size=16)
    view = core.worker_view("a")
    core.route(RouteRequest("r", [1] * 40))
    core.route(RouteRequest("s", [2] * 40))
    assert (view.num_active, view.num_prefilling) == (2, 2)
    core.on_first_token("r")
    assert (view.num_active, view.num_prefilling) == (2, 1)
    core.on_finished("s")  # ended before its first token
    core.on_finished("r")
    assert (view.num_active, view.num_prefilling) == (0, 0)


def test_step_profile_checks_and_the_default_for_a_worker_that_states_none():
    assert StepProfile.stated(0.0, 0.0, 0.0, 0.0) is DEFAULT_STEP_PROFILE
    assert StepProfile.stated(0.02, 1e-4, 1e-7, 5e-5) == StepProfile(0.02, 1e-4, 1e-7, 5e-5)
    assert PROFILE.seq_tokens() == pytest.approx(5.0)
    assert PROFILE.context_tokens() == pytest.approx(0.01)
    with pytest.raises(ValueError, match="decode_s_per_seq must be finite and >= 0"):
        StepProfile(decode_s_per_seq=-1.0)
    with pytest.raises(ValueError, match="prefill_s_per_token must be finite and > 0"):
        StepProfile(prefill_s_per_token=float("nan"))


def test_cost_weights_take_a_seventh_number():
    w = CostWeights.parse("1,0.25,16,0.1,1024,14,0.3")
    assert w.decode_time == 0.3
    assert CostWeights.parse(w.form()) == w
    with pytest.raises(ValueError, match="decode_time must be >= 0"):
        CostWeights.parse("1,0.25,16,0.1,1024,14,-1")
    with pytest.raises(ValueError, match="three to seven numbers"):
        CostWeights.parse("1,0.25,16,0.1,1024,14,1,2")


def test_a_report_keeps_counting_a_request_that_ended_until_the_next_one():
    """The router's view takes the larger of its own count and the worker's last report, and
    does not take ended requests off a report: a report still counting them predicts the
    next turns of sessions that stay on that worker (decision 0035: the correction lost held
    out on agentic sessions)."""
    core = RouterCore(RouterConfig(), clock=lambda: 0.0, rng=random.Random(0))
    core.add_worker("a", block_size=16)
    view = core.worker_view("a")
    core.route(RouteRequest("r", [1] * 40))
    core.route(RouteRequest("s", [2] * 40))
    view.load = LoadReport(num_running=0, num_waiting=3, num_queued_prefill_tokens=120)
    view.refresh()
    core.on_first_token("r")
    core.on_finished("r")
    core.on_finished("s")
    assert (view.num_active, view.queued_prefill_tokens, view.num_running) == (0, 120, 3)
    view.load = LoadReport(num_running=1)
    view.refresh()
    assert (view.queued_prefill_tokens, view.num_running) == (0, 1)
