"""bench.bench_replica_apply: a quick run times apply_replica next to route and checks
that every peer event was counted and every peer pick ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_replica_apply


def test_a_quick_run_applies_every_event_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "apply.json"
    argv = ["--events", "40", "--workers", "4", "--blocks", "3000", "--json", str(out)]
    assert bench_replica_apply.main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert results["events_applied"] == 3 * 40  # pick, first token, finish each
    for key in ("apply_routed", "apply_first_token_and_finish", "route"):
        assert 0 < results[f"{key}_p50_us"] <= results[f"{key}_p99_us"]
    assert report["config"]["num_workers"] == 4 and report["config"]["events"] == 40
    assert report["config"]["peer_view"] is True  # the router's default


def test_without_the_peer_view_every_event_is_still_counted(tmp_path: Path) -> None:
    out = tmp_path / "apply.json"
    argv = ["--events", "20", "--workers", "4", "--blocks", "3000", "--no-peer-view"]
    assert bench_replica_apply.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["peer_view"] is False
    assert report["results"]["events_applied"] == 3 * 20


@pytest.mark.parametrize("argv", [["--events", "5"], ["--workers", "0"]])
def test_bad_sizes_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_replica_apply.main(argv)
    assert exc.value.code == 2
    assert "--events must be >= 10" in capsys.readouterr().err
