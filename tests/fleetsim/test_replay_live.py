"""Live replay: real worker and router processes on loopback gRPC (bounded timeouts)."""

from __future__ import annotations

import json
import os

import pytest

from fleetsim.replay.cli import main
from fleetsim.replay.live import LiveConfig, LiveReplayError, run_live
from fleetsim.replay.trace import write_trace
from fleetsim.workload import SupportAgentConfig, generate_support_agent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def small_workload():
    return generate_support_agent(
        SupportAgentConfig(rate_rps=10.0, duration_s=4.0, num_conversations=6, seed=2)
    )


def test_live_replay_through_real_processes(tmp_path):
    records = small_workload()
    assert 25 <= len(records) <= 60
    trace = tmp_path / "sa.jsonl"
    write_trace(trace, records)
    out = tmp_path / "live.json"
    argv = [
        "--trace",
        str(trace),
        "--trace-block-size",
        "16",
        "--mode",
        "live",
        "--workers",
        "2",
        "--policy",
        "cache_aware",
        "--speedup",
        "10",
        "--kv-capacity-tokens",
        "65536",
        "--timeout-s",
        "60",
        "--json",
        str(out),
        "--quiet",
        "--cost-weights",  # passed on to the router process, which would refuse bad ones
        "1,0.25,16,0.1",
        "--recent-window-s",
        "20",
        "--backlog-tokens",
        "20000",
        "--saturated-tokens",
        "8000",
        "--saturated-scale-tokens",
        "1500",
        "--recent-decode-ratio",
        "0.5",
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    p = data["policies"][0]
    assert p["policy"] == "cache_aware" and data["setup"]["mode"] == "live"
    assert data["setup"]["cost_weights"] == "1,0.25,16,0.1"
    assert data["setup"]["backlog_tokens"] == 20000.0
    assert (data["setup"]["saturated_tokens"], data["setup"]["saturated_scale_tokens"]) == (
        8000.0,
        1500.0,
    )
    assert p["requests"] == len(records) and p["errors"] == 0
    assert p["prompt_tokens"] == sum(r.input_length for r in records)
    assert p["completion_tokens"] == sum(r.output_length for r in records)
    assert set(p["requests_per_worker"]) == {"worker-0", "worker-1"}
    assert sum(p["requests_per_worker"].values()) == len(records)
    # every request shares the 2,048-token system + few-shot prefix: most of it is cached
    assert p["hit_rate"] > 0.4
    assert 0 < p["ttft_p50_s"] <= p["e2e_p99_s"]
    # the sim bounds are computed alongside
    assert p["hit_rate"] <= data["infinite_hit_rate"]


def test_a_process_that_never_listens_is_reported(tmp_path):
    config = LiveConfig(num_workers=1, startup_timeout_s=20, python="/bin/false")
    with pytest.raises(LiveReplayError, match="before listening"):
        run_live(small_workload()[:2], "round_robin", config)


def test_processes_that_never_listen_are_stopped(tmp_path, monkeypatch):
    """Every spawned process is ended when start-up fails, even one still starting."""
    pid_file = tmp_path / "pids"
    script = tmp_path / "silent.sh"
    script.write_text('#!/bin/sh\necho $$ >> "$KVROUTE_TEST_PID_FILE"\nexec sleep 60\n')
    script.chmod(0o755)
    monkeypatch.setenv("KVROUTE_TEST_PID_FILE", str(pid_file))
    config = LiveConfig(num_workers=2, startup_timeout_s=1.0, python=str(script))
    with pytest.raises(LiveReplayError, match="no 'listening on' line"):
        run_live(small_workload()[:2], "round_robin", config)
    pids = [int(line) for line in pid_file.read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # terminated and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("field", ["timeout_s", "startup_timeout_s"])
def test_live_config_timeout_error_names_the_field_and_value(field):
    with pytest.raises(ValueError, match=rf"^{field} must be > 0, got 0$"):
        LiveConfig(**{field: 0})
