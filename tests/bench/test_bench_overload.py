"""bench_overload's capacity model (the figure its goodput is compared with)."""

from __future__ import annotations

import pytest

from bench.bench_overload import OverloadConfig, capacity_rps
from worker.engine.sim_executor import SimCostModel


def test_capacity_is_the_best_rate_among_concurrencies_that_meet_the_deadline():
    # step(k) = 10 ms + 1 ms * k, no prefill cost, real time: 10 tokens by a 1 s deadline
    # allow k <= 90 (10 * (0.01 + 0.001 k) <= 1); rate k / (10 * step) peaks at k = 90.
    cost = SimCostModel(0.0, 0.0, 0.01, 0.001, 0.0, 0.0)
    config = OverloadConfig(
        num_workers=2, deadline_s=1.0, new_tokens=10, prompt_tokens=4, sim_speedup=1.0
    )
    rate, k = capacity_rps(config, cost)
    assert k == 90
    assert rate == pytest.approx(2 * 90 / (10 * (0.01 + 0.09)))


def test_long_prompts_are_bound_by_prefill():
    """Prefills do not overlap: a worker starts at most one prompt per prefill time, however
    many requests the decode could carry."""
    config = OverloadConfig(
        num_workers=2, deadline_s=4.0, new_tokens=4, prompt_tokens=8000, sim_speedup=1.0
    )
    rate, _ = capacity_rps(config)
    assert rate == pytest.approx(2 / SimCostModel().prefill_cost_s(8000, 0))


def test_pacing_slows_the_fleet():
    config = OverloadConfig(sim_speedup=1.0)
    fast, _ = capacity_rps(config)
    slow, _ = capacity_rps(OverloadConfig(sim_speedup=0.25))
    assert slow < fast


def test_a_deadline_nothing_meets_gives_no_capacity():
    assert capacity_rps(OverloadConfig(deadline_s=0.001)) == (0.0, 0)
