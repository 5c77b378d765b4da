"""Step reports (worker/engine/load_reports.py): when a worker reports its load between the
periodic reports, and what a report taken inside a step counts."""

from __future__ import annotations

import numpy as np
from sched_harness import make_engine, request

from kvroute_proto.events import LoadReport
from worker.engine.load_reports import DRAIN_MIN_TOKENS, StepReports


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 999, n)]


def test_a_report_inside_a_step_counts_its_prefill_as_queued() -> None:
    engine, _ = make_engine(num_kv_slots=10_000, max_running_requests=4)
    engine.add_request(request("a", _tokens(0, 300), max_new_tokens=3))
    engine.add_request(request("b", _tokens(1, 200), max_new_tokens=3))
    before = engine.load_report()
    assert (before.num_running, before.num_waiting) == (0, 2)
    assert before.num_queued_prefill_tokens == 500
    inside: list[LoadReport] = []
    engine.step(lambda: inside.append(engine.load_report()))
    # both admitted and being prefilled: still 500 tokens to compute, two requests running
    assert inside[0].num_queued_prefill_tokens == 500
    assert (inside[0].num_running, inside[0].num_waiting) == (2, 0)
    after = engine.load_report()  # the step is done: nothing queued, both decoding
    assert after.num_queued_prefill_tokens == 0 and after.num_running == 2
    assert engine.step_prefill_tokens == 0


def test_a_continuing_chunk_is_counted_once() -> None:
    engine, _ = make_engine(num_kv_slots=10_000, chunk_size=256)
    engine.add_request(request("a", _tokens(0, 600), max_new_tokens=2))
    engine.step()  # first chunk: 256 of 600
    inside: list[LoadReport] = []
    engine.step(lambda: inside.append(engine.load_report()))  # the second chunk runs
    assert inside[0].num_queued_prefill_tokens == 600 - 256
    assert inside[0].num_running == 1


def test_step_start_reports_on_arrivals_and_prefills_only() -> None:
    engine, _ = make_engine(num_kv_slots=10_000)
    reports = StepReports(engine)
    sent: list[LoadReport] = []

    def start() -> None:
        load = reports.at_step_start()
        if load is not None:
            reports.published(load)
            sent.append(load)

    engine.add_request(request("a", _tokens(0, 400), max_new_tokens=4))
    engine.step(start)  # arrival and prefill: due, counting the prefill
    assert [s.num_queued_prefill_tokens for s in sent] == [400]
    engine.step(start)  # a decode step, nothing arrived: not due
    assert len(sent) == 1
    engine.add_request(request("b", _tokens(1, 100), max_new_tokens=4))
    engine.step(start)  # b arrived (and is prefilled now)
    assert [s.num_queued_prefill_tokens for s in sent] == [400, 100]
    assert sent[-1].num_running == 2


def test_after_step_reports_a_drained_queue_only() -> None:
    engine, _ = make_engine(num_kv_slots=20_000, chunk_size=512, max_prefill_tokens_per_step=512)
    reports = StepReports(engine)
    assert reports.after_step() is None  # nothing reported yet: nothing to drain from
    engine.add_request(request("a", _tokens(0, 3000), max_new_tokens=1))
    reports.published(engine.load_report())  # says 3,000 queued
    engine.step()  # 512 computed: 2,488 left, a drop of 512 -- not news
    assert reports.after_step() is None
    engine.step()  # 1,024 computed: 1,976 left -- still more than half of 3,000
    assert reports.after_step() is None
    engine.step()  # 1,536: 1,464 left, at most half of 3,000 and 1,536 less
    load = reports.after_step()
    assert load is not None and load.num_queued_prefill_tokens == 3000 - 1536
    reports.published(load)
    engine.step()  # 952 left: 512 less than the 1,464 just reported -- under the floor
    assert reports.after_step() is None
    assert DRAIN_MIN_TOKENS == 1024
