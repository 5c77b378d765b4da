"""kvroute replay --cost-profile: the simulated executor's step costs by profile name or
fitted from a bench_gpu --json result; the report's setup says which (sim mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_gpu
from fleetsim.replay.cli import _sim_config, build_parser, main
from fleetsim.replay.trace import TraceRecord, write_trace
from worker.engine.sim_executor import COST_PROFILES, SimCostModel


def _trace(path: Path) -> Path:
    records = [TraceRecord(i * 100.0, 192, 8, (0, 1, 2 + i), line_no=i + 1) for i in range(6)]
    write_trace(path, records)
    return path


def _sim_s(tmp_path: Path, *extra: str) -> tuple[float, dict]:
    out = tmp_path / "r.json"
    trace = _trace(tmp_path / "t.jsonl")
    argv = ["--trace", str(trace), "--trace-block-size", "64", "--workers", "1", "--quiet"]
    argv += ["--no-reference", "--policy", "round_robin", "--json", str(out), *extra]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    return data["policies"][0]["extra"]["sim_duration_s"], data["setup"]


def test_profiles_change_the_modelled_time_and_are_reported(tmp_path: Path) -> None:
    h100_s, setup = _sim_s(tmp_path)
    assert setup["cost_profile"] == "h100"
    ours_s, setup = _sim_s(tmp_path, "--cost-profile", "kvroute-h200")
    assert setup["cost_profile"] == "kvroute-h200"
    assert ours_s > h100_s  # every step pays a 65 ms floor in the measured profile
    args = build_parser().parse_args(["--trace", "t", "--cost-profile", "kvroute-h200"])
    assert _sim_config(args).cost_model == COST_PROFILES["kvroute-h200"]


def test_unknown_profile_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    assert main(["--trace", str(trace), "--cost-profile", "a100"]) == 2
    err = capsys.readouterr().err
    assert "cost profile must be one of ['h100', 'kvroute-h200', 'kvroute-h200-fused']" in err
    assert "Traceback" not in err


def test_a_bench_gpu_result_is_fitted(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--smoke", "--json", str(out)]) == 0
    args = build_parser().parse_args(["--trace", "t", "--cost-profile", str(out)])
    model = _sim_config(args).cost_model
    result = json.loads(out.read_text())
    assert model == SimCostModel.from_bench_gpu(result)
    assert model.step_overhead_s > 0 or model.prefill_s_per_token > 0


def test_measured_profile_reproduces_issue_14s_table() -> None:
    m = COST_PROFILES["kvroute-h200"]
    assert m.step_overhead_s + m.decode_cost_s(1, 2048) == pytest.approx(0.065)
    assert m.step_overhead_s + m.decode_cost_s(128, 128 * 2048) == pytest.approx(0.081)
    assert m.step_overhead_s + m.prefill_cost_s(8064, 0) == pytest.approx(1.80)
    assert m.step_overhead_s + m.prefill_cost_s(64, 8000) == pytest.approx(0.152)
    h = COST_PROFILES["h100"]  # the simulator column of the same table
    assert h.decode_cost_s(1, 2048) == pytest.approx(0.0082, abs=5e-5)
    assert h.prefill_cost_s(64, 8000) == pytest.approx(0.0032, abs=5e-5)


def test_fused_profile_reproduces_the_2026_12_04_h200_run() -> None:
    """kvroute-h200-fused is the fit of the shipped bench_gpu result's default-path columns
    (cold prefill: paged+fused; decode and the cached step: paged+graphs+fused): it gives
    back the measured steps."""
    result = json.loads(
        (
            Path(bench_gpu.__file__).parent / "results/gpu/h200_2026-12-04_5_graphs_fused.json"
        ).read_text()
    )
    by = result["steps_by_attention"]
    median = {m["name"]: m["median_s"] for m in by["paged+fused"] if "cold" in m["name"]}
    median |= {m["name"]: m["median_s"] for m in by["paged+graphs+fused"]}
    m = COST_PROFILES["kvroute-h200-fused"]
    floor = m.step_overhead_s
    assert floor + m.decode_cost_s(1, 2048) == pytest.approx(median["decode_b1"], rel=1e-3)
    assert floor + m.decode_cost_s(128, 128 * 2048) == pytest.approx(
        median["decode_b128"], rel=1e-3
    )
    for n in (2048, 8064):
        assert floor + m.prefill_cost_s(n, 0) == pytest.approx(
            median[f"prefill_cold_{n}"], rel=1e-3
        )
    assert floor + m.prefill_cost_s(64, 8000) == pytest.approx(
        median["prefill_cached_64_after_8000"], rel=1e-3
    )
    old = COST_PROFILES["kvroute-h200"]  # issue 14's first measurement of the same executor
    assert (
        floor + m.decode_cost_s(1, 2048) < (old.step_overhead_s + old.decode_cost_s(1, 2048)) / 10
    )
