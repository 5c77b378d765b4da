"""RouterConfig.replicas: with R router replicas, each pick counts R times in the worker's
queued-prefill estimate until its first token (the others are likely placing alike)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvroute_proto.events import EventBatch, LoadReport
from router.core import RouterConfig, RouterCore, RouteRequest

B = 16


def make_core(replicas: int) -> RouterCore:
    core = RouterCore(
        RouterConfig(block_size=B, replicas=replicas), clock=lambda: 0.0, rng=random.Random(0)
    )
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
        RouterConfig(replicas=0)
