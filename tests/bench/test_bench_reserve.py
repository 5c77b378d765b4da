"""bench/bench_reserve.py: each reserve setting replays the whole trace through the sim
fleet, and a pool that decode outgrows shows retractions under a greedy (0) reserve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_reserve
from fleetsim.replay.trace import TraceRecord, write_trace


def _trace(path: Path) -> Path:
    # 24 requests at once: a shared 256-token prefix, a unique 64-token tail, 200 outputs.
    records = [TraceRecord(0.0, 320, 200, (0, 1, 2, 3, 100 + i), line_no=i + 1) for i in range(24)]
    write_trace(path, records)
    return path


def test_settings_replay_the_whole_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    argv = ["--trace", str(trace), "--trace-block-size", "64", "--workers", "1"]
    argv += ["--kv-capacity-tokens", "3000", "--json", str(out)]
    assert bench_reserve.main(argv) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fixed:0.0", "fixed:0.25", "adaptive"}
    for row in rows.values():
        assert row["errors"] == 0
        assert row["throughput_tok_s"] > 0
    assert rows["fixed:0.0"]["retractions"] > 0
    assert rows["adaptive"]["retractions"] < rows["fixed:0.0"]["retractions"]


@pytest.mark.parametrize("bad", ["fixed", "fixed:2", "fixed:x", "lru", "split:lru"])
def test_bad_setting_is_a_usage_error(bad: str, tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    with pytest.raises(SystemExit) as exc:
        bench_reserve.main(["--trace", str(trace), "--trace-block-size", "64", "--setting", bad])
    assert exc.value.code == 2


def test_settings_map_to_engine_config() -> None:
    from worker.engine.engine import EngineConfig

    base = EngineConfig()
    assert bench_reserve.engine_config_for("split:stamp", base).split_recency == "stamp"
    assert bench_reserve.engine_config_for("split:keep", base).split_recency == "keep"
    fixed = bench_reserve.engine_config_for("fixed:0.5", base)
    assert fixed.new_token_reserve_ratio == 0.5
    assert bench_reserve.engine_config_for("adaptive", base).new_token_reserve_ratio is None
