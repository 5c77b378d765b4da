"""bench_relay_worker end to end, briefly: a real `kvroute worker` process, requests kept in
flight on one relay stream, every figure taken from what came back and from /proc."""

from __future__ import annotations

import json

from bench import bench_relay_worker


def test_the_worker_streams_every_started_request_and_its_cpu_is_counted(tmp_path) -> None:
    out = tmp_path / "result.json"
    argv = ["--seconds", "1", "--warmup-s", "0.5", "--concurrency", "8", "--max-tokens", "32"]
    assert bench_relay_worker.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # requests finished and new ones started in the window (8 in flight, 32 tokens each)
    assert row["requests_started"] >= 8
    assert row["output_tokens_per_s"] > 0 and row["batches_per_s"] > 0
    assert 0 < row["worker_cpu_s"] < 10
    assert row["worker_cpu_us_per_token"] > 0
    assert 0 < row["first_chunk_p50_ms"] <= row["first_chunk_p99_ms"]
