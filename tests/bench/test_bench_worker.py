"""Smoke test of bench/bench_worker.py: it runs in --quick mode and writes every key (the
numbers themselves are not checked: timing does not go into tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import bench_worker

KEYS = {
    "sched_req_s",
    "sched_req_s_fcfs",
    "sched_req_per_cpu_s",
    "prefill_cold_s",
    "prefill_cached_s",
}


def test_quick_run_writes_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--quick", "--json", str(out)]
    has_torch = importlib.util.find_spec("torch") is not None
    if not has_torch:
        argv.append("--no-torch")
    assert bench_worker.main(argv) == 0
    results = json.loads(out.read_text())
    assert results.keys() >= KEYS
    assert results["sched_req_s"] > 0
    if has_torch:
        assert results["prefill_cold_s"] > 0
        assert results["prefill_cached_s"] > 0
        assert results["prefill_cached_tokens"] == results["prefill_prefix_tokens"]
    assert "sched_req_s" in capsys.readouterr().out


def test_help_exits_cleanly() -> None:
    with pytest.raises(SystemExit) as info:
        bench_worker.main(["--help"])
    assert info.value.code == 0
