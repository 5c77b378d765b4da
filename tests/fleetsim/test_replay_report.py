"""Replay report: metric definitions, JSON determinism, table and plot."""

from __future__ import annotations

import json
import math

import pytest

from fleetsim.replay.report import ReplayReport, RequestResult, summarize


def results() -> list[RequestResult]:
    return [
        RequestResult(0, 0.0, 100, "w0", 0.5, 1.0, cached_tokens=0, completion_tokens=10),
        RequestResult(1, 1.0, 100, "w1", 1.2, 2.0, cached_tokens=80, completion_tokens=10),
        RequestResult(2, 2.0, 200, "w0", 2.1, 3.0, cached_tokens=100, completion_tokens=20),
        RequestResult(3, 3.0, 50, "w1", error="QueueFullError: full"),
        RequestResult(4, 3.0, 50, "w1"),  # never finished: counted as an error
    ]


def test_summarize_definitions():
    p = summarize("cache_aware", results(), ["w0", "w1", "w2"])
    assert p.requests == 5 and p.errors == 2
    assert p.errors_by_kind == {"QueueFullError": 1, "unfinished": 1}
    assert p.prompt_tokens == 400 and p.cached_tokens == 180
    assert p.prefill_tokens == 220 and p.hit_rate == 0.45
    assert p.prefill_tokens_per_worker == {"w0": 200, "w1": 20, "w2": 0}
    assert p.requests_per_worker == {"w0": 2, "w1": 1, "w2": 0}
    # max / mean of per-worker prefill: 200 / (220 / 3)
    assert p.load_imbalance == round(200 / (220 / 3), 4)
    assert p.ttft_p50_s == 0.2  # TTFTs 0.5, 0.2, 0.1
    assert p.ttft_p99_s == pytest.approx(0.494)
    assert p.e2e_p50_s == 1.0
    # inter-token latency per request: (1.0-0.5)/9, (2.0-1.2)/9, (3.0-2.1)/19
    itl = [0.5 / 9, 0.8 / 9, 0.9 / 19]
    assert p.itl_mean_s == pytest.approx(sum(itl) / 3, abs=1e-6)
    # p99 interpolates between the two largest (linear, numpy's default)
    assert p.itl_p99_s == pytest.approx(0.5 / 9 + 0.98 * (0.8 / 9 - 0.5 / 9), abs=1e-6)
    assert p.throughput_tok_s == round(40 / 3.0, 3)  # 40 tokens, first arrival 0, last finish 3


def test_busy_imbalance_is_max_over_mean_busy_time_and_reported_everywhere():
    busy = {"w0": 3.0, "w1": 1.0, "w2": 2.0}
    p = summarize("cache_aware", results(), ["w0", "w1", "w2"], busy_s_per_worker=busy)
    assert p.busy_imbalance == 1.5  # 3 / mean 2
    assert p.busy_s_per_worker == busy
    q = summarize("live", results(), ["w0", "w1"])  # a mode that cannot measure it
    assert q.busy_imbalance is None
    r = ReplayReport(setup={}, policies=[p, q])
    data = json.loads(r.dumps())
    assert data["policies"][0]["busy_imbalance"] == 1.5
    assert data["policies"][1]["busy_imbalance"] is None
    table = r.format_table()
    assert "busy imb" in table and "prefill imb" in table and "errors" in table
    row = next(line for line in table.splitlines() if line.startswith("cache_aware"))
    assert row.split()[-4:-1] == ["1.50", "5", "2"]  # busy imbalance, requests, errors
    live_row = next(line for line in table.splitlines() if line.startswith("live"))
    assert live_row.split()[-4] == "-"


def test_no_completed_requests_gives_nan_not_crash():
    p = summarize("random", [RequestResult(0, 0.0, 10, error="x")], ["w0"])
    assert p.errors == 1 and p.hit_rate == 0.0 and p.load_imbalance == 1.0
    assert math.isnan(p.ttft_p99_s) and math.isnan(p.throughput_tok_s)
    text = ReplayReport(setup={}, policies=[p]).dumps()
    assert json.loads(text)["policies"][0]["ttft_p99_s"] is None


def test_json_is_deterministic_and_excludes_wall_time():
    a = ReplayReport(setup={"workers": 2}, pooled_reference_hit_rate=0.5, infinite_hit_rate=0.6)
    b = ReplayReport(setup={"workers": 2}, pooled_reference_hit_rate=0.5, infinite_hit_rate=0.6)
    a.policies.append(summarize("x", results(), ["w0", "w1"], wall_s=1.0))
    b.policies.append(summarize("x", results(), ["w0", "w1"], wall_s=2.0))
    assert a.dumps() == b.dumps()
    data = json.loads(a.dumps())
    assert "wall_s" not in data["policies"][0]
    assert data["pooled_reference_hit_rate"] == 0.5 and data["infinite_hit_rate"] == 0.6
    assert "bound" not in a.dumps()  # the pooled run is a reference, not a bound
    assert a.policy("x").hit_rate == 0.45
    with pytest.raises(KeyError):
        a.policy("y")


def test_table_lists_every_policy_and_the_references():
    r = ReplayReport(setup={}, pooled_reference_hit_rate=0.5, infinite_hit_rate=0.9)
    r.policies.append(summarize("cache_aware", results(), ["w0", "w1"]))
    r.policies.append(summarize("round_robin", results(), ["w0", "w1"]))
    table = r.format_table()
    assert "cache_aware" in table and "round_robin" in table
    assert "45.0%" in table and "90.0%" in table  # hit / pooled = 0.45 / 0.5
    assert "pooled reference" in table and "infinite ceiling" in table
    assert "bound" not in table
    assert "cache_aware errors: QueueFullError x1, unfinished x1" in table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from fleetsim.replay.plot import plot_report

    r = ReplayReport(setup={"trace": "t.jsonl", "workers": 2, "mode": "sim"})
    r.pooled_reference_hit_rate = 0.5
    r.policies.append(summarize("cache_aware", results(), ["w0", "w1"]))
    r.policies.append(summarize("random", [RequestResult(0, 0.0, 10, error="x")], ["w0"]))
    out = plot_report(r, tmp_path / "p.png")
    from fleetsim.replay.plot import policy_label

    assert [policy_label(p) for p in r.policies] == [
        "cache_aware\n(2 errors)",  # failed requests are counted on the figure, not dropped
        "random\n(1 error)",
    ]
    r.policies.append(summarize("ok", results()[:3], ["w0", "w1"]))
    assert policy_label(r.policies[-1]) == "ok"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
