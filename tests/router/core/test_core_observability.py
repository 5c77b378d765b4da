"""What RouterCore exposes for metrics: the best match behind each decision, per-worker
stats and the index size estimate (plain values; the service shell exports them)."""

from __future__ import annotations

import numpy as np
from test_core import B, give, make_core, stored, tokens

from kvroute_proto.events import EventBatch, LoadReport
from router.core.router_core import CostWeights, RouteRequest


def test_decision_records_the_best_match_it_passed_over() -> None:
    # recent-prefill weighs heavily: the worker holding the prefix is "busy"
    core, _ = make_core(2, weights=CostWeights(1.0, 0.25, 16.0, 10.0))
    prompt = tokens(8 * B)
    give(core, "w0", stored(prompt))
    core.worker_view("w0").recent_prefill = 1e6
    d = core.route(RouteRequest("r1", prompt))
    assert d.worker_id == "w1"
    assert d.matched_tokens == 0
    assert d.best_matched_tokens == 8 * B


def test_best_match_is_the_chosen_one_when_the_cache_wins() -> None:
    core, _ = make_core(3)
    prompt = tokens(8 * B)
    give(core, "w2", stored(prompt))
    d = core.route(RouteRequest("r1", prompt))
    assert d.worker_id == "w2"
    assert d.best_matched_tokens == d.matched_tokens == 8 * B


def test_best_match_ignores_excluded_and_unhealthy_workers() -> None:
    core, _ = make_core(3)
    prompt = tokens(8 * B)
    give(core, "w0", stored(prompt))
    give(core, "w1", stored(prompt[: 4 * B]))
    d = core.route(RouteRequest("r1", prompt, exclude=frozenset({"w0"})))
    assert d.worker_id == "w1"
    assert d.best_matched_tokens == d.matched_tokens == 4 * B
    core.on_finished("r1")
    core.set_health("w1", False)
    d = core.route(RouteRequest("r2", prompt, exclude=frozenset({"w0"})))
    assert d.worker_id == "w2"
    assert d.best_matched_tokens == 0


def test_decision_splits_the_match_into_event_confirmed_and_predicted() -> None:
    core, _ = make_core(2)
    system = tokens(8 * B)
    give(core, "w0", stored(system[: 4 * B]))  # w0's events hold the first 4 blocks
    d = core.route(RouteRequest("r1", system))  # predicts all 8 blocks on w0
    assert d.worker_id == "w0"
    assert (d.matched_tokens, d.event_matched_tokens) == (4 * B, 4 * B)
    # a second prompt sharing all 8 blocks: 4 from w0's events, 4 more from r1's prediction
    longer = np.concatenate([system, tokens(2 * B, start=9000)])
    d = core.route(RouteRequest("r2", longer))
    assert d.worker_id == "w0"
    assert (d.matched_tokens, d.event_matched_tokens) == (8 * B, 4 * B)
    # no events at all: a match that only predictions know of
    core2, _ = make_core(2)
    core2.route(RouteRequest("a", system))
    d = core2.route(RouteRequest("b", system))
    assert d.matched_tokens > 0 and d.event_matched_tokens == 0


def test_worker_stats_report_stream_position_lag_and_blocks() -> None:
    # r1 below goes to the worker holding its prefix: no decode-time term to weigh the
    # three requests there against 64 cached tokens
    core, clock = make_core(2, CostWeights(decode_time=0.0))
    before = {s.worker_id: s for s in core.worker_stats()}
    assert before["w0"].seconds_since_message is None
    give(core, "w0", stored(tokens(4 * B)))
    load = LoadReport(num_running=1, num_waiting=2)
    core.on_stream_message("w0", EventBatch("w0", 1, 2, B, (), load))
    core.on_stream_message("w0", EventBatch("w0", 1, 2, B, (), load))  # a duplicate
    clock.now += 2.5
    core.route(RouteRequest("r1", tokens(4 * B)))
    stats = {s.worker_id: s for s in core.worker_stats()}
    w0 = stats["w0"]
    assert w0.seconds_since_message == 2.5
    assert (w0.epoch, w0.last_seq) == (1, 2)
    assert w0.num_indexed_blocks == 4
    assert w0.num_active_requests == 1
    assert w0.load == load
    assert w0.sync_counters["applied"] == 1
    assert w0.sync_counters["duplicate"] == 1
    assert w0.sync_counters["snapshot"] == 1
    assert stats["w1"].num_indexed_blocks == 0


def test_index_bytes_grow_with_the_index() -> None:
    core, _ = make_core(1)
    empty = core.stats().index_bytes
    give(core, "w0", stored(tokens(1000 * B)))
    assert core.stats().index_bytes > empty + 1000 * 36
