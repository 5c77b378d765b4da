"""The new-token reserve ratio: adaptive as SGLang's (the default; constants in
EngineConfig.adaptive_reserve) or fixed (EngineConfig.new_token_reserve_ratio = R): exact
decay, the jump after a retraction, the reset when the engine goes idle, and the retraction
it prevents."""

from __future__ import annotations

import pytest
from sched_harness import assert_baseline, expected_tokens, make_engine, request, run

from worker.engine.engine_config import AdaptiveReserve, EngineConfig
from worker.engine.types import FinishReason


def test_sglang_defaults() -> None:
    a = AdaptiveReserve()
    assert (a.init_ratio, a.decay_steps, a.retract_decode_steps) == (0.7, 600, 20)
    assert a.min_ratio == pytest.approx(0.098)
    assert a.decay == pytest.approx((0.7 - 0.098) / 600)


def test_fixed_ratio_never_moves() -> None:
    engine, _ = make_engine(num_kv_slots=2000, new_token_reserve_ratio=0.25)
    engine.add_request(request("a", [3] * 50, max_new_tokens=30))
    for _ in range(10):
        engine.step()
        assert engine.scheduler.new_token_ratio == 0.25


def test_adaptive_ratio_decays_per_decode_step_to_its_floor() -> None:
    reserve = AdaptiveReserve(init_ratio=0.5, min_ratio_factor=0.5, decay_steps=5)
    engine, _ = make_engine(num_kv_slots=2000, adaptive_reserve=reserve)
    sched = engine.scheduler
    engine.add_request(request("a", [3] * 50, max_new_tokens=30))
    engine.step()  # prefill only: no decode step yet
    assert sched.new_token_ratio == 0.5
    seen = []
    for _ in range(7):
        engine.step()  # one decode step each
        seen.append(round(sched.new_token_ratio, 9))
    assert seen == [0.45, 0.4, 0.35, 0.3, 0.25, 0.25, 0.25]


def test_retraction_raises_the_ratio_to_what_the_survivors_need() -> None:
    # A tiny initial reserve admits both 200-token prompts into 420 slots; their decode then
    # outgrows the pool and b (newest, fewest tokens) is retracted.
    reserve = AdaptiveReserve(init_ratio=0.01, decay_steps=600, retract_decode_steps=2)
    engine, _ = make_engine(num_kv_slots=420, adaptive_reserve=reserve)
    sched = engine.scheduler
    engine.add_request(request("a", [3] * 200, max_new_tokens=20))
    engine.add_request(request("b", [4] * 200, max_new_tokens=20))
    while engine.stats().num_retractions == 0:
        before = sched.new_token_ratio
        engine.step()
    a = sched._reqs["a"]
    # Decided before this step's token was appended: (generated + 2 * 1 survivor) / 20.
    generated = len(a.output_ids) - 1
    assert generated == 11
    assert before < 0.01
    assert sched.new_token_ratio == pytest.approx((generated + 2) / 20)
    results = run(engine)  # the rest of both streams, b's after its retry
    for rid in ("a", "b"):
        rest = results[rid].tokens
        assert rest == expected_tokens(engine, rid, 20)[20 - len(rest) :]
        assert results[rid].finish_reason is FinishReason.LENGTH
    assert_baseline(engine)


def test_adaptive_ratio_resets_when_the_engine_was_idle() -> None:
    reserve = AdaptiveReserve(init_ratio=0.5, min_ratio_factor=0.2, decay_steps=4)
    engine, _ = make_engine(num_kv_slots=2000, adaptive_reserve=reserve)
    engine.add_request(request("a", [3] * 20, max_new_tokens=10))
    run(engine)
    assert engine.scheduler.new_token_ratio == pytest.approx(0.1)
    engine.add_request(request("b", [5] * 20, max_new_tokens=10))
    assert engine.scheduler.new_token_ratio == 0.5


def test_adaptive_reserve_avoids_the_retraction_a_greedy_admission_causes() -> None:
    def retractions(**config: object) -> int:
        engine, _ = make_engine(num_kv_slots=420, **config)
        engine.add_request(request("a", [3] * 200, max_new_tokens=20))
        engine.add_request(request("b", [4] * 200, max_new_tokens=20))
        results = run(engine)
        assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
        return engine.stats().num_retractions

    assert retractions(new_token_reserve_ratio=0.0) == 1
    # SGLang's defaults: 0.7 * 20 tokens kept for a, 14 for b -> b waits, nothing retracted.
    assert retractions(adaptive_reserve=AdaptiveReserve()) == 0


def test_adaptive_reserve_is_validated() -> None:
    with pytest.raises(ValueError, match="init_ratio"):
        AdaptiveReserve(init_ratio=0.0)
    with pytest.raises(ValueError, match="decay_steps"):
        AdaptiveReserve(decay_steps=0)
    with pytest.raises(ValueError, match="adaptive_reserve"):
        EngineConfig(adaptive_reserve=0.7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"new_token_reserve_ratio must be None \(adaptive\)"):
        EngineConfig(new_token_reserve_ratio=1.5)


def test_adaptive_is_the_default_and_a_fixed_ratio_turns_it_off() -> None:
    assert EngineConfig().new_token_reserve_ratio is None
    engine, _ = make_engine()
    assert engine.scheduler.new_token_ratio == 0.7
    engine, _ = make_engine(new_token_reserve_ratio=0.3, adaptive_reserve=AdaptiveReserve(0.9))
    assert engine.scheduler.new_token_ratio == 0.3
