"""Deadline-aware admission: the step model, slow start, exclusions, and the in-flight
accounting against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.admission import Admission, AdmissionConfig


def feed(adm: Admission, worker: str, k: int, itl_s: float, chunks: int, t0: float = 0.0):
    """k requests in flight on ``worker``, each relaying ``chunks`` one-token chunks
    ``itl_s`` apart (after a first chunk 0.5 s after dispatch)."""
    rids = [f"{worker}-{k}-{i}" for i in range(k)]
    for rid in rids:
        adm.on_dispatch(rid, worker, t0)
    for rid in rids:
        adm.on_tokens(rid, 1, t0 + 0.5)
    for c in range(1, chunks + 1):
        for rid in rids:
            adm.on_tokens(rid, 1, t0 + 0.5 + c * itl_s)
    for rid in rids:
        adm.on_done(rid)


def test_unknown_worker_is_admitted_up_to_the_initial_window():
    adm = Admission(AdmissionConfig(initial_window=2))
    assert adm.estimate_s("w0", 100) is None
    assert adm.excluded(["w0"], 100, 0.001) == frozenset()  # no model: no time estimate
    adm.on_dispatch("a", "w0", 0.0)
    adm.on_dispatch("b", "w0", 0.0)
    assert adm.excluded(["w0", "w1"], 100, 60.0) == {"w0"}  # window full
    adm.on_done("a")
    assert adm.excluded(["w0", "w1"], 100, 60.0) == frozenset()


def test_step_model_fits_a_line_and_extrapolates():
    adm = Admission(AdmissionConfig(min_samples=8, halflife_samples=1e9))
    for k in (2, 4, 8, 16):
        feed(adm, "w0", k, 0.01 + 0.002 * k, chunks=4)
    model = adm._models["w0"]
    assert model.step_s(16) == pytest.approx(0.042, rel=1e-6)
    assert model.step_s(32) == pytest.approx(0.074, rel=1e-6)
    assert model.ttft_s == pytest.approx(0.5)
    # 20 in flight: a 100-token request joins as the 21st -> 0.5 + 100 * (0.01 + 0.042)
    for i in range(20):
        adm.on_dispatch(f"x{i}", "w0", 10.0)
    assert adm.estimate_s("w0", 100) == pytest.approx(0.5 + 100 * 0.052, rel=1e-6)


def test_constant_concurrency_uses_the_mean_step():
    adm = Admission(AdmissionConfig(min_samples=4))
    feed(adm, "w0", 4, 0.03, chunks=10)
    assert adm._models["w0"].step_s(5) == pytest.approx(0.03)


def test_workers_that_cannot_finish_in_time_are_excluded_and_counted():
    adm = Admission(AdmissionConfig(min_samples=4, margin=1.0, initial_window=64))
    feed(adm, "slow", 4, 0.1, chunks=10)  # 0.5 + n * 0.1
    feed(adm, "fast", 4, 0.01, chunks=10)  # 0.5 + n * 0.01
    # 100 tokens: slow needs 10.5 s, fast 1.5 s
    assert adm.excluded(["slow", "fast"], 100, 5.0) == {"slow"}
    assert adm.excluded(["slow", "fast"], 100, 1.0) == {"slow", "fast"}
    assert adm.excluded(["slow", "fast"], 100, 11.0) == frozenset()
    assert adm.stats.num_excluded == 3
    # max_new_tokens 0 (the worker's default) is estimated at default_new_tokens
    assert adm.excluded(["fast"], 0, 0.5 + 256 * 0.01 - 0.01) == {"fast"}


def test_an_idle_fleet_that_is_too_slow_is_told_apart_from_a_busy_one():
    """A refusal on an idle fleet says waiting will not help: the fastest idle estimate;
    with anything in flight, or a worker without a model, there is no such figure."""
    adm = Admission(AdmissionConfig(min_samples=4, margin=1.0, initial_window=64))
    feed(adm, "slow", 4, 0.1, chunks=10)
    feed(adm, "fast", 4, 0.01, chunks=10)
    assert adm.idle_estimate_s(["slow", "fast"], 100) == pytest.approx(0.5 + 100 * 0.01)
    assert adm.idle_estimate_s(["fast"], 0) == pytest.approx(0.5 + 256 * 0.01)
    assert adm.idle_estimate_s(["fast", "new"], 100) is None  # "new" has no model yet
    adm.on_dispatch("r", "slow", 0.0)
    assert adm.idle_estimate_s(["slow", "fast"], 100) is None  # not idle
    assert adm.idle_estimate_s([], 100) is None


def test_slow_start_window_doubles_what_was_sampled():
    adm = Admission(AdmissionConfig(initial_window=4, min_samples=2))
    assert adm.window("w0") == 4
    feed(adm, "w0", 3, 0.01, chunks=2)
    assert adm.window("w0") == 6
    feed(adm, "w0", 6, 0.01, chunks=2)
    assert adm.window("w0") == 12


def test_prefill_ahead_and_the_prompt_count_against_the_deadline():
    """Time to first token grows with the prefill queued on the worker: a long prompt behind
    other long prompts is excluded where a short one is not, and the queue empties as the
    requests begin to stream."""
    adm = Admission(AdmissionConfig(min_samples=4, margin=1.0, halflife_samples=1e9))
    feed(adm, "w0", 4, 0.01, chunks=10)  # the decode step: 0.01 s
    t = 10.0
    for i, ahead in enumerate((1_000, 4_000, 8_000, 16_000, 2_000, 12_000)):
        adm.on_dispatch(f"p{i}", "w0", t, prefill_tokens=ahead)
        adm.on_tokens(f"p{i}", 1, t + 0.5 + ahead * 1e-4)  # ttft = 0.5 s + 0.1 ms a token
        adm.on_done(f"p{i}")
        t += 10.0
    assert adm.queued_prefill("w0") == 0
    # idle: an 8,000-token prompt needs 0.5 + 0.8 s to its first token, 4 new tokens 0.04
    # (feed's samples had no prefill and 0.5 s: on the same line)
    assert adm.estimate_s("w0", 4, 8_000) == pytest.approx(0.5 + 0.8 + 0.04, rel=1e-6)
    # two 16,000-token prompts queued there: 3.2 s more before it starts
    adm.on_dispatch("q0", "w0", t, prefill_tokens=16_000)
    adm.on_dispatch("q1", "w0", t, prefill_tokens=16_000)
    assert adm.queued_prefill("w0") == 32_000
    assert adm.excluded(["w0"], 4, 4.0, 8_000) == {"w0"}  # 4.54 s
    assert adm.excluded(["w0"], 4, 4.0, 100) == frozenset()  # 3.75 s
    adm.on_tokens("q0", 1, t + 1.0)  # q0 streams: its prefill is done
    assert adm.queued_prefill("w0") == 16_000
    adm.on_done("q1")  # q1 ended before streaming (an error, a cancel)
    assert adm.queued_prefill("w0") == 0
    assert adm.excluded(["w0"], 4, 2.0, 8_000) == frozenset()


def test_a_cold_worker_queues_long_prompts_one_step_budget_at_a_time():
    """Before its first token the worker's prefill rate is unknown: a second long prompt
    waits (it could queue past every deadline); short prompts are not held back; the first
    token lifts the limit."""
    adm = Admission(AdmissionConfig(initial_window=32))
    assert adm.excluded(["w0"], 4, 4.0, 20_000) == frozenset()  # one prompt: always
    adm.on_dispatch("a", "w0", 0.0, prefill_tokens=8_000)
    assert adm.excluded(["w0"], 4, 4.0, 8_000) == {"w0"}
    assert adm.excluded(["w0"], 4, 4.0, 100) == frozenset()
    adm.on_tokens("a", 1, 1.0)  # its first token: a prefill sample, the queue is empty
    adm.on_dispatch("b", "w0", 1.0, prefill_tokens=8_000)
    assert adm.excluded(["w0"], 4, 60.0, 8_000) == frozenset()


def test_the_first_decode_samples_count_before_the_slope_is_trusted():
    """A prefill-bound request is estimated with the decode it will still do: before
    min_samples inter-token times, their mean step stands in for the fitted line."""
    adm = Admission(AdmissionConfig(min_samples=32, margin=1.0))
    adm.on_dispatch("a", "w0", 0.0, prefill_tokens=8_000)
    adm.on_tokens("a", 1, 1.0)  # first token after 1 s: 8,000 tokens a second
    assert adm.estimate_s("w0", 4, 8_000) == pytest.approx(1.0)  # no decode sample yet
    adm.on_tokens("a", 1, 1.5)
    adm.on_tokens("a", 1, 2.0)  # two steps of 0.5 s
    adm.on_done("a")
    assert adm.estimate_s("w0", 4, 8_000) == pytest.approx(1.0 + 4 * 0.5)
    assert adm.excluded(["w0"], 4, 2.9, 8_000) == {"w0"}
    assert adm.estimate_s("other", 4, 8_000) is None


def test_disabled_admission_excludes_nothing():
    adm = Admission(AdmissionConfig(enabled=False, initial_window=1))
    adm.on_dispatch("a", "w0", 0.0)
    assert adm.excluded(["w0"], 10, 0.0) == frozenset()


def test_retry_moves_the_request_and_done_is_idempotent():
    adm = Admission()
    adm.on_dispatch("r", "w0", 0.0)
    adm.on_dispatch("r", "w1", 1.0)  # retried elsewhere
    assert (adm.num_inflight("w0"), adm.num_inflight("w1")) == (0, 1)
    adm.on_done("r")
    adm.on_done("r")
    assert adm.num_inflight("w1") == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("initial_window", 0, r"initial_window \(--admission-window\) must be >= 1"),
        ("min_samples", 1, "min_samples must be >= 2"),
        ("halflife_samples", 0, "halflife_samples must be > 0"),
        ("margin", 0.5, "margin must be a finite number >= 1"),
        ("margin", float("nan"), "margin must be a finite number >= 1"),
        ("default_new_tokens", 0, "default_new_tokens must be >= 1"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        AdmissionConfig(**{field: value})


ops = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "tokens", "done"]),
        st.integers(0, 5),  # request
        st.integers(0, 2),  # worker
        st.integers(0, 3),  # tokens
    ),
    max_size=60,
)


@given(ops)
def test_inflight_counts_match_a_reference_model(seq):
    adm = Admission()
    where: dict[str, str] = {}  # reference: request -> worker
    queued: dict[str, int] = {}  # reference: request -> prefill tokens not yet streaming
    now = 0.0
    for op, r, w, n in seq:
        rid, wid = f"r{r}", f"w{w}"
        now += 0.01
        if op == "dispatch":
            adm.on_dispatch(rid, wid, now, prefill_tokens=100 * n)
            where[rid] = wid
            queued[rid] = 100 * n
        elif op == "tokens":
            adm.on_tokens(rid, n, now)
            if n > 0 and rid in where:
                queued[rid] = 0
        else:
            adm.on_done(rid)
            where.pop(rid, None)
            queued.pop(rid, None)
        for worker in ("w0", "w1", "w2"):
            expected = sum(1 for v in where.values() if v == worker)
            assert adm.num_inflight(worker) == expected
            ahead = sum(queued[x] for x, v in where.items() if v == worker)
            assert adm.queued_prefill(worker) == ahead
    for model in adm._models.values():
        assert model.n >= 0 and model.ttft_s >= 0
