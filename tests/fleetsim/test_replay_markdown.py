"""fleetsim.replay.markdown: replay JSON reports as BENCHMARKS.md tables."""

from __future__ import annotations

import json

import pytest

from fleetsim.replay import markdown


def _policy(name: str, hit: float, ttft99: float, **extra) -> dict:
    row = {
        "policy": name,
        "hit_rate": hit,
        "load_imbalance": 1.04,
        "busy_imbalance": 1.2,
        "ttft_p50_s": 0.05,
        "ttft_p99_s": ttft99,
        "e2e_p50_s": 1.25,
        "e2e_p99_s": 3.5,
        "itl_mean_s": 0.0125,
        "itl_p99_s": 0.04,
        "errors": 0,
    }
    row.update(extra)
    return row


def _report(policies: list[dict], **refs) -> dict:
    setup = {"trace": "t.jsonl", "workers": 8, "kv_capacity_tokens": 450_000}
    return {"setup": setup, "policies": policies, **refs}


def test_table_marks_the_lowest_ttft_p99_and_the_share_of_the_pooled_reference():
    report = _report(
        [_policy("cache_aware", 0.7, 0.29), _policy("round_robin", 0.5, 0.31, errors=3)],
        pooled_reference_hit_rate=0.8,
        infinite_hit_rate=0.81,
    )
    text = markdown.table(report)
    lines = text.splitlines()
    assert lines[0] == "**8 workers** — pooled reference 80.0%, infinite ceiling 81.0%"
    tail = "| 1.25 s | 3.50 s | 12.5 ms | 40.0 ms |"
    assert f"| cache_aware | 70.0% | 87.5% | 1.04 | 1.20 | 50 ms | **290 ms** {tail} 0 |" in text
    assert f"| round_robin | 50.0% | 62.5% | 1.04 | 1.20 | 50 ms | 310 ms {tail} 3 |" in text


def test_merge_takes_each_policy_once_and_refuses_another_fleet():
    a = _report([_policy("cache_aware", 0.7, 0.29)], pooled_reference_hit_rate=0.8)
    b = _report([_policy("sglang", 0.71, 0.3), _policy("cache_aware", 0.1, 9.0)])
    merged = markdown.merge([b, a])
    assert [p["policy"] for p in merged["policies"]] == ["sglang", "cache_aware"]
    assert merged["policies"][1]["hit_rate"] == 0.1  # the first report's row wins
    assert merged["pooled_reference_hit_rate"] == 0.8
    other = _report([])
    other["setup"]["workers"] = 16
    with pytest.raises(ValueError, match=r"setup\.workers differs"):
        markdown.merge([a, other])


def test_main_prints_tables_and_reports_bad_input(tmp_path, capsys):
    good = tmp_path / "r.json"
    good.write_text(json.dumps(_report([_policy("cache_aware", 0.7, 1.5)])))
    assert markdown.main([str(good)]) == 0
    assert "**1.50 s**" in capsys.readouterr().out
    assert markdown.main([str(tmp_path / "missing.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_routers_table_compares_each_policy_with_its_own_one_router_run(tmp_path, capsys):
    one = _report(
        [_policy("cache_aware", 0.7, 0.30), _policy("sglang", 0.69, 0.40)],
        pooled_reference_hit_rate=0.8,
    )
    four = _report([_policy("cache_aware", 0.68, 0.33), _policy("sglang", 0.6, 0.30)])
    four["setup"]["routers"] = 4
    text = markdown.routers_table([four, one])
    lines = text.splitlines()
    assert lines[0] == "**8 workers** — pooled reference 80.0%"
    rows = [line for line in lines if line.startswith("| cache_aware") or "| sglang" in line]
    assert rows == [
        "| cache_aware | 1 | 70.0% | 87.5% | 50 ms | 300 ms | +0% | 1.04 | 1.20 | 0 |",
        "| cache_aware | 4 | 68.0% | 85.0% | 50 ms | 330 ms | +10% | 1.04 | 1.20 | 0 |",
        "| sglang | 1 | 69.0% | 86.2% | 50 ms | 400 ms | +0% | 1.04 | 1.20 | 0 |",
        "| sglang | 4 | 60.0% | 75.0% | 50 ms | 300 ms | -25% | 1.04 | 1.20 | 0 |",
    ]
    with pytest.raises(ValueError, match="no report with one router"):
        markdown.routers_table([four])
    with pytest.raises(ValueError, match="two reports with 4 router"):
        markdown.routers_table([one, four, four])
    paths = []
    for i, report in enumerate((one, four)):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    assert markdown.main(["--by-routers", *paths]) == 0
    assert "| sglang | 4 |" in capsys.readouterr().out
    assert markdown.main(["--by-routers", paths[1]]) == 2
    assert "no report with one router" in capsys.readouterr().err
