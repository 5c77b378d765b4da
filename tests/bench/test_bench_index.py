"""Smoke test of bench/bench_index.py: it runs in --quick mode and writes every key (the
numbers themselves are not checked: timing does not go into tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_index

KEYS = {
    "ingest_blocks_s",
    "find_full_q_s",
    "find_partial_q_s",
    "remove_blocks_s",
    "hash_seq_s",
    "route_p50_us",
    "route_p99_us",
    "bytes_per_entry",
    "route_text_p50_us",
    "route_text_p99_us",
}


def test_quick_run_writes_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert bench_index.main(["--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results.keys() >= KEYS
    assert all(results[k] > 0 for k in KEYS)
    assert results["meta"]["quick"] is True
    assert "route_p50_us" in capsys.readouterr().out
    # the text prompts are tokenized with a real BPE: fewer tokens than bytes, and the
    # system-prompt text's ids are matched in the index
    assert results["route_text_mean_prompt_tokens"] > 0
    assert results["route_text_mean_matched_tokens"] > 0


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_index.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_route_only_with_the_metrics_hook(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench_index.main(["--quick", "--route-only", "--route-metrics", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["route_p50_us"] > 0
    assert results["route_hooked_cpu_p50_us"] > 0  # every second route ran with the hook
    assert "find_full_q_s" not in results
    assert "bytes_per_entry" not in results
    assert results["meta"]["route_metrics"] is True
    assert results["route_text_p50_us"] > 0


def test_no_text_skips_the_text_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench_index.main(["--quick", "--route-only", "--no-text", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert "route_p50_us" in results
    assert "route_text_p50_us" not in results
