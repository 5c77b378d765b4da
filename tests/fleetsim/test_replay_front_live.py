"""replay --mode live --front kvroute: real workers with their HTTP API and our router's
OpenAI front, as processes on loopback (bounded timeouts)."""

from __future__ import annotations

import json

import pytest

from fleetsim.replay.cli import main
from fleetsim.replay.trace import write_trace
from fleetsim.workload import SupportAgentConfig, generate_support_agent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


def test_live_replay_through_the_kvroute_http_front(tmp_path):
    records = generate_support_agent(
        SupportAgentConfig(rate_rps=8.0, duration_s=1.5, num_conversations=3, seed=4)
    )
    assert 5 <= len(records) <= 25
    trace = tmp_path / "sa.jsonl"
    write_trace(trace, records)
    out = tmp_path / "front.json"
    argv = [
        "--trace",
        str(trace),
        "--trace-block-size",
        "16",
        "--mode",
        "live",
        "--workers",
        "2",
        "--front",
        "kvroute:cache_aware",
        "--front",
        "kvroute:round_robin",
        "--speedup",
        "5",
        "--timeout-s",
        "60",
        "--no-reference",
        "--json",
        str(out),
        "--requests-dir",
        str(tmp_path / "requests"),
        "--quiet",
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["setup"]["fronts"] == ["kvroute:cache_aware", "kvroute:round_robin"]
    for row in data["policies"]:
        assert row["requests"] == len(records) and row["errors"] == 0, row["errors_by_kind"]
        # the text prompts are exactly the trace's tokens on the worker
        assert row["extra"]["prompt_token_mismatches"] == 0
        assert row["prompt_tokens"] == sum(r.input_length for r in records)
        assert row["completion_tokens"] == sum(r.output_length for r in records)
        # every response named its worker (the stream's kvroute.worker_id)
        assert row["extra"]["requests_without_worker_id"] == 0
        assert sum(row["requests_per_worker"].values()) == len(records)
        assert set(row["requests_per_worker"]) == {"worker-0", "worker-1"}
        # every request shares the system + few-shot prefix: later ones hit the cache
        assert row["hit_rate"] > 0.3
        assert 0 < row["ttft_p50_s"] <= row["e2e_p99_s"]
    rows = (tmp_path / "requests" / "kvroute_round_robin.jsonl").read_text().splitlines()
    per_request = [json.loads(line) for line in rows]
    assert [r["index"] for r in per_request] == list(range(len(records)))
    assert all(r["error"] is None and 0 < r["ttft_s"] <= r["e2e_s"] for r in per_request)
    assert sum(r["cached_tokens"] for r in per_request) == data["policies"][1]["cached_tokens"]
    rr = data["policies"][1]["requests_per_worker"]
    assert abs(rr["worker-0"] - rr["worker-1"]) <= 1  # round-robin alternates
