"""bench.replay_targets: issue 40's targets on replay reports."""

from __future__ import annotations

import json

import pytest

from bench.replay_targets import (
    frontier_row,
    frontier_table,
    main,
    pair_table,
    routers_row,
    routers_summary,
    summary,
    verdict,
)


def _policy(name: str, hit: float, ttft99: float, e2e50: float, e2e99: float, itl: float):
    return {
        "policy": name,
        "hit_rate": hit,
        "ttft_p50_s": ttft99 / 4,
        "ttft_p99_s": ttft99,
        "e2e_p50_s": e2e50,
        "e2e_p99_s": e2e99,
        "itl_mean_s": itl,
        "load_imbalance": 1.05,
        "busy_imbalance": 1.02,
        "errors": 0,
    }


def _report(*policies) -> dict:
    return {"pooled_reference_hit_rate": 0.50, "policies": list(policies)}


def test_each_target_against_the_best_other_policy_with_its_margin():
    report = _report(
        _policy("cache_aware", 0.49, 0.300, 2.00, 5.00, 0.0104),
        # faster on TTFT p99 by 1% (inside 2%), e2e p99 by 10% at 96% of pooled
        _policy("sglang", 0.48, 0.297, 2.50, 4.50, 0.0120),
        # faster on e2e p50 by 5% but at 80% of pooled; ITL 4% better (inside 5%)
        _policy("dynamo", 0.40, 0.400, 1.90, 6.00, 0.0100),
        # the same cost: never the yardstick, however fast
        _policy("approx_tree", 0.49, 0.100, 1.00, 1.00, 0.0010),
    )
    v = verdict(report, "run")
    figs = {f.label: f for f in v.figures}
    assert v.of_pooled == pytest.approx(0.98)
    assert figs["TTFT p99"].met and figs["TTFT p99"].best_policy == "sglang"
    assert not figs["e2e p50"].met and figs["e2e p50"].conflict  # only dynamo, at 80%
    assert not figs["e2e p99"].met and not figs["e2e p99"].conflict  # sglang at 96%
    assert figs["ITL"].met and figs["ITL"].best_policy == "dynamo"
    assert not v.all_met
    assert "e2e p99 (within 2%) on 0/1 (conflicts: 0)" in summary([v])
    assert "e2e p50 (within 2%) on 0/1 (conflicts: 1)" in summary([v])


def test_hit_rate_and_errors_are_targets_too():
    ours = _policy("cache_aware", 0.45, 0.3, 2.0, 5.0, 0.01)
    ours["errors"] = 3
    v = verdict(_report(ours, _policy("round_robin", 0.3, 0.4, 3.0, 6.0, 0.02)), "r")
    assert all(f.met for f in v.figures)
    assert not v.hit_met and not v.all_met


def test_a_report_without_the_pooled_reference_is_refused():
    report = _report(_policy("cache_aware", 0.4, 0.3, 2, 5, 0.01), _policy("x", 0.4, 1, 2, 5, 1))
    del report["pooled_reference_hit_rate"]
    with pytest.raises(ValueError, match="pooled reference"):
        verdict(report, "r")


def test_pair_table_shows_changes_only_where_a_figure_moved():
    a = _report(_policy("cache_aware", 0.49, 0.300, 2.0, 5.0, 0.0104))
    b = _report(_policy("cache_aware", 0.49, 0.310, 2.0, 5.5, 0.0104))
    row = pair_table(a, b, []).splitlines()[-1]
    assert row.startswith("| cache_aware | 49.0% | 75 ms -> 78 ms | 300 ms -> 310 ms | 2.00 s |")
    assert "5.00 s -> 5.50 s | 10.4 ms |" in row


def test_routers_row_is_points_and_ratios():
    one = _report(_policy("cache_aware", 0.49, 0.300, 2.0, 5.0, 0.010))
    many = _report(_policy("cache_aware", 0.48, 0.330, 2.0, 5.5, 0.010))
    row = routers_row(one, many)
    assert row["hit_points"] == pytest.approx(-1.0)
    assert row["ttft_p99_s"] == pytest.approx(1.10)
    assert row["e2e_p99_s"] == pytest.approx(1.10)
    worse = routers_row(one, _report(_policy("cache_aware", 0.46, 0.340, 2.0, 5.0, 0.010)))
    assert routers_summary([row, worse]) == (
        "1 / 2 within, -3.00..-1.00 points, TTFT p99 +10.0%..+13.3%, e2e p50 +0.0%..+0.0%, "
        "e2e p99 +0.0%..+10.0%, ITL +0.0%..+0.0%"
    )


def test_cli_prints_the_rows_and_the_count(tmp_path, capsys):
    path = tmp_path / "cb1300_4.json"
    report = _report(
        _policy("cache_aware", 0.49, 0.30, 2.0, 5.0, 0.010),
        _policy("dynamo", 0.40, 0.20, 2.0, 5.0, 0.010),
    )
    path.write_text(json.dumps(report))
    assert main(["runs", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| cb1300_4 | 98.0% | 1.05 / 1.02 | **300 ms (+50% dynamo)** |" in out
    assert "missed: TTFT p99 (conflict)" in out
    assert "all targets on 0/1" in out
    assert main(["runs", str(tmp_path / "missing.json")]) == 2


def test_the_frontier_and_where_cache_aware_sits_on_it():
    report = _report(
        _policy("cache_aware", 0.49, 0.3, 2.0, 5.0, 0.01),  # 98% of pooled
        _policy("sglang", 0.50, 0.3, 2.0, 9.0, 0.01),  # 100%, slower: on the frontier
        _policy("dynamo", 0.44, 0.3, 2.0, 4.0, 0.01),  # 88%, faster: on it, a conflict
        _policy("round_robin", 0.40, 0.3, 2.0, 4.5, 0.01),  # behind dynamo on both
        _policy("approx_tree", 0.49, 0.3, 2.0, 5.0, 0.01),  # equal to ours: beats nobody
    )
    row = frontier_row(report, "run")
    assert [p.policy for p in row.frontier] == ["sglang", "cache_aware", "approx_tree", "dynamo"]
    assert row.beaten_by is None and row.fastest_at_target
    # a policy at the target and faster: cache_aware is behind it, and not the fastest
    report["policies"].append(_policy("aibrix", 0.495, 0.3, 2.0, 4.8, 0.01))
    row = frontier_row(report, "run")
    assert row.beaten_by is not None and row.beaten_by.policy == "aibrix"
    assert not row.fastest_at_target
    table = frontier_table([row])
    assert "behind aibrix 99.0% / 4.80 s" in table
    assert (
        "cache_aware on the frontier in 0/1 runs; the fastest policy at >= 95% of pooled in 0/1"
        in table
    )


def test_frontier_cli(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_report(_policy("cache_aware", 0.49, 0.3, 2.0, 5.0, 0.01))))
    assert main(["frontier", str(path)]) == 0
    assert (
        "| run | cache_aware 98.0% / 5.00 s | cache_aware 98.0% / 5.00 s: on it; the fastest"
        in capsys.readouterr().out
    )
    (tmp_path / "bad.json").write_text(json.dumps({"policies": []}))
    assert main(["frontier", str(tmp_path / "bad.json")]) == 2
