"""bench.burst_split: per-burst worker split on a small cold-bursts trace."""

from __future__ import annotations

import ast
from collections import Counter

import pytest

from bench.burst_split import main
from fleetsim.replay.trace import TraceRecord, write_trace
from fleetsim.workload import ColdBurstsConfig, generate_cold_bursts


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


def test_a_unique_request_in_the_bursts_instant_is_not_part_of_it(tmp_path, capsys):
    """A request arriving in a burst's millisecond on a prefix of its own is counted apart
    (the burst stays a burst), and --worst names it next to the burst's requests on its
    worker; --replay-args reaches the simulator (several routers with replica sync)."""
    config = ColdBurstsConfig(
        rate_rps=2.0, duration_s=4.0, burst_size=8, burst_interval_s=2.0, burst_prefix_tokens=64
    )
    records = generate_cold_bursts(config)
    burst_at = Counter(r.timestamp_ms for r in records).most_common(1)[0][0]
    lone = TraceRecord(burst_at, 80, 4, (10**9, 10**9 + 1, 10**9 + 2, 10**9 + 3, 10**9 + 4))
    trace = tmp_path / "b.jsonl"
    write_trace(trace, sorted([*records, lone], key=lambda r: r.timestamp_ms))
    argv = ["--trace", str(trace), "--workers", "2", "--burst-size", "8", "--worst", "2"]
    argv += ["--routers", "2", "--replay-args=--replica-sync-delay-s 0.0005", "cache_aware"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    split = out.split("burst split (first 6): ")[1].splitlines()[0]
    assert [sum(s) for s in ast.literal_eval(split)] == [8, 8]  # both bursts, 8 requests each
    assert out.count("slowest first token") == 2
    lone_index = sorted([*records, lone], key=lambda r: r.timestamp_ms).index(lone)
    assert f"#{lone_index} (80 tokens, router " in out
    assert "by router {" in out


def test_bad_replay_args_are_refused(tmp_path, capsys):
    trace = tmp_path / "b.jsonl"
    write_trace(trace, generate_cold_bursts(ColdBurstsConfig(duration_s=2.0, burst_size=4)))
    argv = ["--trace", str(trace), "--replay-args=--no-such-option", "round_robin"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--replay-args '--no-such-option': not kvroute replay options" in capsys.readouterr().err
