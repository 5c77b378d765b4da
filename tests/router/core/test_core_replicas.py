"""RouterConfig.replicas: with R router replicas, each pick counts R times in the worker's
queued-prefill estimate until its first token (the others are likely placing alike); a
cold pick at most replica_cold_picks times (the others' same-instant picks would mostly
find its prefix predicted there)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvroute_proto.events import EventBatch, LoadReport
from router.core.core_types import ReplicaConfig
from router.core.router_core import RouterConfig, RouterCore, RouteRequest

B = 16


def make_core(replicas: int, cold: float = 8.0) -> RouterCore:
    config = RouterConfig(block_size=B, replica=ReplicaConfig(count=replicas, cold_picks=cold))
    core = RouterCore(config, clock=lambda: 0.0, rng=random.Random(0))
    for i in range(2):
        core.add_worker(f"w{i}", block_size=B)
    return core


def test_a_pick_counts_replicas_times_until_its_first_token():
    core = make_core(replicas=3)
    d = core.route(RouteRequest("r", np.arange(320, dtype=np.uint32)))
    view = core.worker_view(d.worker_id)
    assert view.queued_prefill_tokens == 3 * 320
    assert view.num_active == 1  # requests are counted once: only the prefill estimate scales
    core.on_first_token("r")
    assert view.queued_prefill_tokens == 0
    core.on_finished("r")
    assert view.num_active == 0 and view.inflight_prefill_tokens == 0


def test_a_cold_pick_counts_at_most_the_cold_picks_and_a_warm_one_replicas_times():
    core = make_core(replicas=4, cold=2.5)
    shared = np.arange(320, dtype=np.uint32)
    cold = core.route(RouteRequest("a", shared))
    view = core.worker_view(cold.worker_id)
    assert cold.matched_tokens == 0
    assert view.queued_prefill_tokens == 800  # 2.5 x 320
    # the next request of the burst finds the prefix predicted there: its own suffix,
    # and each other replica's alike, count R times
    suffix = np.arange(10_000, 10_048, dtype=np.uint32)
    warm = core.route(RouteRequest("b", np.concatenate([shared, suffix])))
    assert warm.worker_id == cold.worker_id and warm.matched_tokens == 320
    assert view.queued_prefill_tokens == 800 + 4 * 48
    core.on_first_token("a")
    assert view.queued_prefill_tokens == 4 * 48
    core.on_finished("b")
    core.on_finished("a")
    assert view.inflight_prefill_tokens == 0 and view.num_active == 0


@pytest.mark.parametrize(("cold", "picks"), [(1.0, 1.0), (2.5, 2.5), (8.0, 3.0)])
def test_the_cold_picks_are_capped_by_the_replicas(cold, picks):
    core = make_core(replicas=3, cold=cold)
    d = core.route(RouteRequest("r", np.arange(320, dtype=np.uint32)))
    assert core.worker_view(d.worker_id).queued_prefill_tokens == round(320 * picks)
    # a shell's own placement (on_routed) is accounted the same way
    core.on_routed("s", d.worker_id, prompt_tokens=100, matched_tokens=0)
    assert core.worker_view(d.worker_id).queued_prefill_tokens == round(320 * picks) + round(
        100 * picks
    )


def test_one_replica_counts_each_pick_once_and_a_larger_report_wins():
    core = make_core(replicas=1)
    d = core.route(RouteRequest("r", np.arange(320, dtype=np.uint32)))
    view = core.worker_view(d.worker_id)
    assert view.queued_prefill_tokens == 320
    report = LoadReport(num_running=0, num_waiting=2, num_queued_prefill_tokens=5000)
    core.on_stream_message(
        d.worker_id, EventBatch(d.worker_id, epoch=1, seq=1, block_size=B, events=(), load=report)
    )
    assert view.queued_prefill_tokens == 5000  # the other routers' work, from the report
    core.on_finished("r")
    assert view.inflight_prefill_tokens == 0


def test_replicas_must_be_positive():
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        RouterConfig(replica=ReplicaConfig(count=0))


@pytest.mark.parametrize("bad", [0.5, float("inf"), float("nan")])
def test_the_cold_picks_must_be_at_least_one(bad):
    with pytest.raises(ValueError, match="replica_cold_picks must be finite and >= 1"):
        RouterConfig(replica=ReplicaConfig(cold_picks=bad))
