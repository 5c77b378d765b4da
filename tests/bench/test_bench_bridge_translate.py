"""bench_bridge_translate on a few batches: every stage is timed, the whole loop is at least
its slowest batch, the slowest once the cache is full is among them, and the JSON says
so."""

from __future__ import annotations

import json

from bench import bench_bridge_translate


def test_stages_and_the_longest_batch_are_reported(tmp_path) -> None:
    out = tmp_path / "result.json"
    argv = ["--batches", "12", "--chains-per-batch", "2", "--blocks-per-chain", "8"]
    argv += ["--keep-chains", "8"]  # full from the fifth batch on
    assert bench_bridge_translate.main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["stored_blocks"] == 12 * 2 * 8
    for stage in ("decode", "translate", "encode"):
        assert result[f"{stage}_us_per_block"] > 0
    whole_ms = result["whole_gc_on_us_per_block"] * result["stored_blocks"] / 1e3
    assert 0 < result["longest_frame_ms"] <= whole_ms + 0.01
    assert 0 < result["longest_full_frame_ms"] <= result["longest_frame_ms"]
