"""``kvroute replay --jobs N``: the same report as one process, only from several."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetsim.replay import parallel
from fleetsim.replay.cli import main
from fleetsim.replay.parallel import REFERENCE_KINDS, resolve_jobs, run_replays
from fleetsim.replay.sim import SimConfig
from fleetsim.replay.trace import write_trace
from fleetsim.workload import ColdBurstsConfig, generate_cold_bursts


@pytest.fixture(scope="module")
def burst_trace(tmp_path_factory):
    records = generate_cold_bursts(
        ColdBurstsConfig(
            duration_s=3, burst_size=12, burst_interval_s=1.0, burst_prefix_tokens=256, seed=7
        )
    )
    path = tmp_path_factory.mktemp("parallel") / "cb.jsonl"
    write_trace(path, records)
    return path, records


def _replay(trace, out, *extra: str) -> dict:
    argv = [
        "--trace",
        str(trace),
        "--trace-block-size",
        "16",
        "--workers",
        "3",
        "--policy",
        "cache_aware",
        "--policy",
        "random",
        "--policy",
        "dynamo",
        "--routers",
        "2",
        "--replica-sync-delay-s",
        "0.001",
        "--strict",
        "--seed",
        "4",
        "--json",
        str(out),
        *extra,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_two_processes_write_the_report_one_process_writes(burst_trace, tmp_path, capsys):
    trace, records = burst_trace
    one = _replay(trace, tmp_path / "one.json", "--quiet")
    capsys.readouterr()
    two = _replay(trace, tmp_path / "two.json", "--jobs", "2")
    err = capsys.readouterr().err
    assert (tmp_path / "one.json").read_text() == (tmp_path / "two.json").read_text()
    # the policies in the order asked for, then both references, whatever finished first
    assert [p["policy"] for p in two["policies"]] == ["cache_aware", "random", "dynamo"]
    assert two["policies"][0]["requests"] == len(records)
    assert one["pooled_reference_hit_rate"] and one["infinite_hit_rate"]
    # one progress line per replay, the references included
    for name in ("cache_aware", "random", "dynamo", "pooled", "infinite"):
        assert f"kvroute replay: {name} done in " in err
    assert "(5/5," in err


def test_no_reference_runs_only_the_policies(burst_trace, tmp_path):
    trace, _ = burst_trace
    data = _replay(trace, tmp_path / "p.json", "--jobs", "0", "--no-reference", "--quiet")
    assert [p["policy"] for p in data["policies"]] == ["cache_aware", "random", "dynamo"]
    assert data["pooled_reference_hit_rate"] is None and data["infinite_hit_rate"] is None


def test_jobs_errors_name_the_option(burst_trace, capsys):
    trace, _ = burst_trace
    base = ["--trace", str(trace), "--trace-block-size", "16", "--quiet"]
    assert main([*base, "--jobs", "-1"]) == 2
    assert "--jobs must be >= 0" in capsys.readouterr().err
    assert main([*base, "--jobs", "2", "--mode", "live"]) == 2
    assert "--jobs 2: only sim mode runs replays in parallel" in capsys.readouterr().err


def test_resolve_jobs_caps_at_the_replays_and_the_cpus(monkeypatch):
    monkeypatch.setattr(parallel, "available_cpus", lambda: 6)
    assert resolve_jobs(0, 13) == 6
    assert resolve_jobs(0, 2) == 2
    assert resolve_jobs(4, 13) == 4
    assert resolve_jobs(8, 3) == 3
    assert resolve_jobs(1, 13) == 1
    assert resolve_jobs(3, 0) == 1
    with pytest.raises(ValueError, match="--jobs must be >= 0"):
        resolve_jobs(-2, 5)


def test_a_failing_replay_raises_its_own_error(burst_trace):
    _, records = burst_trace
    config = SimConfig(num_workers=2)
    with pytest.raises(ValueError, match=r"policy must be one of .*; got 'nope'"):
        run_replays(records[:20], config, 16, ["round_robin", "nope"], (), jobs=2)
    with pytest.raises(ValueError, match="reference kind"):
        run_replays(records[:20], config, 16, [], ["pooled", "huge"], jobs=2)
    assert run_replays(records, config, 16, [], (), jobs=2) == []
    assert set(REFERENCE_KINDS) == {"pooled", "infinite"}


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return {int(c) for c in path.read_text().split()}
    except OSError:  # the process is gone
        return set()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux only")
def test_a_killed_replay_leaves_no_worker_replaying(tmp_path):
    records = generate_cold_bursts(ColdBurstsConfig(duration_s=40, seed=11))
    trace = tmp_path / "long.jsonl"
    write_trace(trace, records)
    argv = [sys.executable, "-m", "fleetsim.replay.cli", "--trace", str(trace)]
    argv += ["--trace-block-size", "16", "--workers", "8", "--policy", "all", "--jobs", "2"]
    replay = subprocess.Popen([*argv, "--quiet"], stdout=subprocess.DEVNULL)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and replay.poll() is None:
            workers = {
                c
                for c in _children(replay.pid)
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
            }
            time.sleep(0.05)
        assert len(workers) == 2, "the replay did not start its two worker processes"
        replay.kill()  # SIGKILL: nothing in the replay runs to shut its pool down
        replay.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "a worker went on replaying for nobody"
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
