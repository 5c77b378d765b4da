"""bench.burst_split: per-burst worker split on a small cold-bursts trace."""

from __future__ import annotations

from bench.burst_split import main
from bench.replay.trace import write_trace
from bench.workload import ColdBurstsConfig, generate_cold_bursts


def test_round_robin_splits_each_burst_evenly(tmp_path, capsys):
    config = ColdBurstsConfig(
        rate_rps=2.0, duration_s=4.0, burst_size=8, burst_interval_s=2.0, burst_prefix_tokens=64
    )
    trace = tmp_path / "b.jsonl"
    write_trace(trace, generate_cold_bursts(config))
    argv = ["--trace", str(trace), "--workers", "2", "--burst-size", "8", "round_robin"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "round_robin: burst split (first 6): [[4, 4], [4, 4]]" in out
    assert "round_robin: burst TTFT p50" in out
