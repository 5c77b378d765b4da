"""The simulated executor: cost model calibration, zero mode, deterministic tokens."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sim_executor import (
    SimCostModel,
    SimExecutor,
    SimExecutorConfig,
    cost_profile,
)
from worker.engine.types import EngineRequest, ForwardItem, SamplingParams

_EMPTY = np.empty(0, dtype=np.int64)


def _item(rid: str = "r", n: int = 1, start: int = 0, k: int = 0, **sp) -> ForwardItem:
    tokens = np.ones(n, dtype=np.int64)
    slots = np.arange(start + n, dtype=np.int64)
    return ForwardItem(rid, tokens, start, slots, SamplingParams(**sp), True, k)


def test_prefill_is_calibrated_to_22k_tokens_per_second() -> None:
    cost = SimExecutor().step_cost_s([_item(n=8192)], [])
    assert 8192 / cost == pytest.approx(22_000, rel=0.03)


def test_cached_prefix_makes_prefill_cheaper_but_not_free() -> None:
    cm = SimCostModel()
    cold = cm.prefill_cost_s(2112, 0)
    warm = cm.prefill_cost_s(64, 2048)
    assert warm < cold / 20
    assert warm > 64 * cm.prefill_s_per_token


def test_decode_step_of_a_modest_batch_is_tens_of_ms() -> None:
    decode = [_item(rid=f"r{i}", start=2047) for i in range(32)]
    cost = SimExecutor().step_cost_s([], decode)
    assert 0.010 <= cost <= 0.050
    bigger = SimExecutor().step_cost_s([], [_item(rid=f"r{i}", start=4095) for i in range(64)])
    assert cost < bigger <= 0.1


def test_zero_cost_mode() -> None:
    sim = SimExecutor(SimCostModel.zero())
    assert sim.step_cost_s([_item(n=8192)], [_item(start=100)]) == 0.0
    assert SimExecutor().step_cost_s([], []) == 0.0


def test_tokens_are_deterministic_in_range_and_never_eos() -> None:
    sim = SimExecutor(config=SimExecutorConfig(vocab_size=50, eos_token_id=7))
    tokens = [sim.token_for(_item(rid="a", k=k)) for k in range(2000)]
    assert tokens == [sim.token_for(_item(rid="a", k=k, n=5, start=9)) for k in range(2000)]
    assert all(0 <= t < 50 for t in tokens)
    assert 7 not in tokens
    assert len(set(tokens)) == 49
    assert tokens != [sim.token_for(_item(rid="b", k=k)) for k in range(2000)]
    seeded = [sim.token_for(_item(rid="a", k=k, seed=3)) for k in range(20)]
    assert seeded == [sim.token_for(_item(rid="b", k=k, seed=3)) for k in range(20)]


def test_eos_at_and_non_sampling_items() -> None:
    sim = SimExecutor(config=SimExecutorConfig(vocab_size=50, eos_token_id=7, eos_at=3))
    assert sim.token_for(_item(k=3)) == 7
    chunk = ForwardItem("r", np.ones(4, dtype=np.int64), 0, np.arange(4), SamplingParams(), False)
    assert sim.forward([chunk], [_item(k=3)]) == [-1, 7]


@pytest.mark.parametrize(
    "kwargs", [{"vocab_size": 1}, {"eos_token_id": 50}, {"eos_at": 2, "eos_token_id": None}]
)
def test_bad_sim_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SimExecutorConfig(**{"vocab_size": 50, **kwargs})


def test_engine_reports_modelled_step_cost_for_a_virtual_clock() -> None:
    now = [0.0]
    engine = Engine(EngineConfig(num_kv_slots=10_000), SimExecutor(), clock=lambda: now[0])
    engine.add_request(EngineRequest("a", np.ones(2048, dtype=np.int64), SamplingParams(4)))
    costs = []
    while engine.has_work():
        engine.step()
        costs.append(engine.last_step_cost_s)
        now[0] += engine.last_step_cost_s
    cm = SimCostModel()
    assert costs[0] == pytest.approx(cm.prefill_cost_s(2048, 0))
    assert costs[1] == pytest.approx(cm.decode_cost_s(1, 2049))
    assert len(costs) == 4
    assert engine.step() == [] and engine.last_step_cost_s == 0.0
    assert now[0] == pytest.approx(sum(costs))


def _bench_result(model: SimCostModel, ctx: int = 2048) -> dict:
    """What bench_gpu would report for an engine that costs exactly ``model``."""
    steps = []
    for n in (2048, 8064):
        steps.append((f"prefill_cold_{n}", model.step_overhead_s + model.prefill_cost_s(n, 0)))
    cached = model.step_overhead_s + model.prefill_cost_s(64, 8000)
    steps.append(("prefill_cached_64_after_8000", cached))
    for b in (1, 8, 128):
        steps.append((f"decode_b{b}", model.step_overhead_s + model.decode_cost_s(b, b * ctx)))
    return {"decode_context": ctx, "steps": [{"name": n, "median_s": t} for n, t in steps]}


def test_from_bench_gpu_recovers_the_coefficients() -> None:
    truth = SimCostModel(
        prefill_s_per_token=2e-4,
        prefill_s_per_attn_pair=3e-9,
        decode_base_s=0.0,
        decode_s_per_seq=0.0,
        decode_s_per_context_token=5e-8,
        step_overhead_s=0.04,
        prefill_s_per_context_token=7e-6,
    )
    fitted = SimCostModel.from_bench_gpu(_bench_result(truth))
    for name in SimCostModel.__dataclass_fields__:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-15)


def test_from_bench_gpu_needs_the_steps() -> None:
    with pytest.raises(ValueError, match="need decode_b"):
        SimCostModel.from_bench_gpu({"decode_context": 2048, "steps": []})


def test_cost_model_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError, match="step_overhead_s must be >= 0"):
        SimCostModel(step_overhead_s=-1.0)


def test_cost_profile_by_name() -> None:
    assert cost_profile("h100") == SimCostModel()
    with pytest.raises(ValueError, match="kvroute-h200"):
        cost_profile("nope")
