"""router.service.convert: Explain values to protobuf, and the client's table."""

from __future__ import annotations

import math

from kvroute_proto.events import LoadReport
from router.cli.client import ExplainResult, WorkerScoreView, format_explain
from router.core.core_types import Explanation, WorkerScore
from router.service.convert import explanation_to_pb, worker_score_to_pb


def _score(**kw) -> WorkerScore:
    base = dict(
        worker_id="w0",
        address="",
        healthy=True,
        matched_tokens=96,
        inflight_prefill_tokens=7,
        num_active_requests=1,
        cost=1.5,
        load=None,
        recent_prefill_tokens=12.0,
        event_matched_tokens=64,
        predicted_matched_tokens=96,
    )
    base.update(kw)
    return WorkerScore(**base)  # type: ignore[arg-type]


def test_worker_score_carries_both_sources():
    msg = worker_score_to_pb(_score(), address="10.0.0.1:1")
    assert (msg.matched_tokens, msg.event_matched_tokens, msg.predicted_matched_tokens) == (
        96,
        64,
        96,
    )
    assert (msg.address, msg.healthy, msg.cost, msg.recent_prefill_tokens) == (
        "10.0.0.1:1",
        True,
        1.5,
        12.0,
    )
    assert not msg.HasField("load")


def test_explanation_fills_address_ejection_no_cost_and_load():
    expl = Explanation(
        "cache_aware",
        100,
        "w1",
        (
            _score(worker_id="w0", cost=None),
            _score(worker_id="w1", address="own:1", load=LoadReport(num_running=3)),
        ),
    )
    resp = explanation_to_pb(expl, address_of=lambda wid: f"pool-{wid}", ejected={"w0"})
    assert (resp.policy, resp.prompt_tokens, resp.chosen_worker_id) == ("cache_aware", 100, "w1")
    w0, w1 = resp.workers
    assert (w0.address, w0.healthy) == ("pool-w0", False) and not w0.HasField("cost")
    assert w0.not_candidate_reason.startswith("ejected") and w1.not_candidate_reason == ""
    assert w1.HasField("cost") and w1.cost == 1.5
    assert (w1.address, w1.healthy, w1.load.num_running) == ("own:1", True, 3)
    assert explanation_to_pb(Explanation("random", 0, None, ())).chosen_worker_id == ""
    assert explanation_to_pb(Explanation("cache_aware", 5, None, (), 4.25)).miss_factor == 4.25


def test_explain_table_prints_events_and_predicted_columns():
    view = WorkerScoreView("w0", "a:1", True, 96, 0, 1.0, 0, 0, 0.0, 64, 32)
    table = format_explain(ExplainResult("cache_aware", 100, "w0", (view,)))
    assert "miss_factor" not in table.splitlines()[0]  # 0: the policy has no such factor
    saturated = format_explain(ExplainResult("cache_aware", 100, "w0", (view,), 6.5))
    assert saturated.splitlines()[0].endswith("chosen=w0 miss_factor=6.5")
    header, row = table.splitlines()[1:]
    assert "events" in header and "predicted" in header
    cols = row.split()
    assert cols[cols.index("yes") + 1 : cols.index("yes") + 4] == ["96", "64", "32"]


def test_unhealthy_worker_says_why_with_the_connection_error_and_no_nan():
    expl = Explanation(
        "cache_aware",
        10,
        None,
        (_score(worker_id="w0", healthy=False, cost=None, not_candidate_reason="unhealthy"),),
    )
    resp = explanation_to_pb(expl, last_error_of=lambda wid: f"{wid}: connect failed (UNAVAILABLE)")
    (w0,) = resp.workers
    assert w0.not_candidate_reason == "unhealthy: w0: connect failed (UNAVAILABLE)"
    assert not w0.HasField("cost") and not w0.healthy
    assert not worker_score_to_pb(_score(cost=math.nan)).HasField("cost")


def test_the_slot_queue_travels_to_the_explain_table():
    msg = worker_score_to_pb(_score(worker_id="w0", slot_queue=7))
    assert msg.slot_queue == 7
    view = WorkerScoreView("w0", "a:1", True, 0, 0, 1.0, 256, 7, slot_queue=7)
    header, row = format_explain(ExplainResult("cache_aware", 100, "w0", (view,))).splitlines()[1:]
    cols, names = row.split(), header.split()
    assert names[names.index("wait") + 1] == "slotq"
    assert cols[cols.index("256") + 1 : cols.index("256") + 3] == ["7", "7"]  # wait, slotq
