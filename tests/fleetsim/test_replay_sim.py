"""The discrete-event replay: known answers, references, determinism, the CLI end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sim_traces import BS, tiny_config, two_prefix_trace

from fleetsim.replay.cli import _sim_config, build_parser, main
from fleetsim.replay.references import infinite_capacity_tokens, simulate_reference
from fleetsim.replay.sim import SimConfig, simulate
from fleetsim.replay.trace import TokenExpander, TraceRecord, write_trace
from fleetsim.workload import SupportAgentConfig, generate_support_agent
from router.core.policy import CostWeights
from router.core.registry import policy_names
from router.core.router_core import RouterConfig


def test_cache_aware_reaches_the_pooled_reference_and_round_robin_does_not():
    records = two_prefix_trace()
    cfg = tiny_config()
    ex = TokenExpander(BS, cfg.vocab_size, seed=0)
    pooled = simulate_reference(records, "pooled", cfg, ex, trace_block_size=BS)
    infinite = simulate_reference(records, "infinite", cfg, ex, trace_block_size=BS)
    # one engine: only the first A and the first B miss their 256-token prefix
    assert pooled.cached_tokens == (len(records) - 2) * 4 * BS
    assert infinite.hit_rate == pooled.hit_rate  # nothing is evicted at this size
    aware = simulate(records, "cache_aware", cfg, ex)
    assert aware.errors == 0 and aware.requests == len(records)
    assert aware.hit_rate == pooled.hit_rate
    rr = simulate(records, "round_robin", cfg, ex)
    # A A B B alternates workers: each prefix misses once on each of the two workers
    assert rr.cached_tokens == (len(records) - 4) * 4 * BS
    assert rr.hit_rate < pooled.hit_rate
    assert aware.extra["router_predicted_hit_rate"] == pytest.approx(aware.hit_rate)
    assert aware.extra["event_batches"] > 0 and aware.extra["resubscribes"] == 0


def test_cache_flushes_reach_the_routers_through_events_only():
    """Every 1.7 s one worker in turn drops its cache: hits fall for every policy, the
    event-fed router knows which prefixes are gone (its predicted hit rate is what the
    workers realised) while the history-fed one keeps expecting them."""
    records = two_prefix_trace()
    ex = TokenExpander(BS, 128_256, seed=0)
    calm = simulate(records, "cache_aware", tiny_config(), ex)
    aware = simulate(records, "cache_aware", tiny_config(flush_interval_s=1.7), ex)
    approx = simulate(records, "approx_tree", tiny_config(flush_interval_s=1.7), ex)
    assert aware.extra["cache_flushes"] == approx.extra["cache_flushes"] == 6
    assert calm.extra["cache_flushes"] == 0
    assert aware.errors == approx.errors == 0
    assert aware.hit_rate < calm.hit_rate
    assert aware.extra["router_predicted_hit_rate"] == pytest.approx(aware.hit_rate)
    assert approx.extra["router_predicted_hit_rate"] > approx.hit_rate + 0.1
    with pytest.raises(ValueError, match="flush_interval_s must be >= 0"):
        tiny_config(flush_interval_s=-1.0)


def test_the_pooled_reference_loses_its_cache_as_often_as_the_fleet_does():
    """A fleet of n loses one worker's cache (1/n of it) every interval; the pooled cache
    all of it every n intervals: the same share per second, not n times more."""
    records = two_prefix_trace()
    ex = TokenExpander(BS, 128_256, seed=0)
    config = tiny_config(flush_interval_s=1.7)
    pooled = simulate_reference(records, "pooled", config, ex, trace_block_size=BS)
    fleet = simulate(records, "cache_aware", config, ex)
    n = config.num_workers
    assert n > 1 and fleet.extra["cache_flushes"] == 6
    assert pooled.extra["cache_flushes"] == fleet.extra["cache_flushes"] // n


def test_support_agent_in_miniature_keeps_its_hits_and_balances_prefill():
    # 245 requests on 4 workers far below saturation: conversations stay where their history
    # is cached, and the one-off RAG prefills spread instead of piling onto the workers that
    # hold the system prompt (without the recent-prefill term: imbalance 1.55)
    records = generate_support_agent(
        SupportAgentConfig(rate_rps=4.0, duration_s=60.0, num_conversations=20, seed=0)
    )
    cfg = SimConfig(num_workers=4)
    ex = TokenExpander(16, cfg.vocab_size, seed=0)
    aware = simulate(records, "cache_aware", cfg, ex)
    pooled = simulate_reference(records, "pooled", cfg, ex, trace_block_size=16)
    assert aware.errors == 0
    assert aware.hit_rate >= 0.97 * pooled.hit_rate
    assert aware.load_imbalance <= 1.2, aware.prefill_tokens_per_worker


def test_request_accounting_and_latencies_are_consistent():
    records = two_prefix_trace(8)
    p = simulate(records, "cache_aware", tiny_config(), TokenExpander(BS, 128_256))
    assert p.requests == 8 and p.errors == 0
    assert p.prompt_tokens == sum(r.input_length for r in records)
    assert p.completion_tokens == sum(r.output_length for r in records)
    assert sum(p.prefill_tokens_per_worker.values()) == p.prefill_tokens
    assert sum(p.requests_per_worker.values()) == 8
    assert 0 < p.ttft_p50_s <= p.ttft_p99_s <= p.e2e_p99_s
    assert p.e2e_p50_s > p.ttft_p50_s  # 4 tokens: 3 decode steps after the first


def test_too_long_request_is_an_error_not_a_crash():
    records = [*two_prefix_trace(2), TraceRecord(5000.0, 30 * BS, 2, tuple(range(50, 80)))]
    cfg = SimConfig(num_workers=2, kv_capacity_tokens=1024, max_context_tokens=1024)
    p = simulate(records, "round_robin", cfg, TokenExpander(BS, 128_256))
    assert p.requests == 3 and p.errors == 1
    assert p.errors_by_kind == {"InvalidRequestError": 1}


def test_infinite_capacity_counts_distinct_prefix_blocks():
    records = [TraceRecord(0, 3 * BS, 5, (1, 2, 3)), TraceRecord(1, 2 * BS, 7, (1, 9))]
    # prefixes (1), (1,2), (1,2,3), (1,9): 4 blocks; outputs 12; + 2 * longest context
    assert infinite_capacity_tokens(records, BS) == 4 * BS + 12 + 2 * (3 * BS + 5 + 1)


def test_same_seed_same_json(tmp_path):
    records = generate_support_agent(
        SupportAgentConfig(rate_rps=30, duration_s=4, num_conversations=8, seed=3)
    )
    trace = tmp_path / "sa.jsonl"
    write_trace(trace, records)
    outs = []
    for name in ("a.json", "b.json"):
        out = tmp_path / name
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
            "--seed",
            "5",
            "--kv-capacity-tokens",
            "30000",
            "--json",
            str(out),
            "--quiet",
        ]
        assert main(argv) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert [p["policy"] for p in data["policies"]] == ["cache_aware", "random"]
    aware = data["policies"][0]
    assert aware["requests"] == len(records) and aware["errors"] == 0
    for key in (
        "hit_rate",
        "prompt_tokens",
        "prefill_tokens",
        "ttft_p50_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "throughput_tok_s",
        "load_imbalance",
        "busy_imbalance",
    ):
        assert key in aware
    assert aware["busy_imbalance"] >= 1.0
    assert 0 < aware["hit_rate"] <= data["pooled_reference_hit_rate"] <= data["infinite_hit_rate"]


def test_cli_errors_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 10}\n'
    )
    assert main(["--trace", str(trace), "--trace-block-size", "16"]) == 2
    assert "line 2" in capsys.readouterr().err
    write_trace(trace, two_prefix_trace(6))
    assert main(["--trace", str(trace), "--policy", "nope", "--trace-block-size", "64"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--trace-block-size", "64", "--cost-weights", "1,2"]) == 2
    assert "--cost-weights: cost weights must be three to seven numbers" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--trace-block-size", "64", "--recent-window-s", "0"]) == 2
    assert "recent_window_s must be > 0" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--trace-block-size", "64", "--backlog-tokens", "-1"]) == 2
    assert "backlog_tokens must be >= 0" in capsys.readouterr().err
    png = tmp_path / "p.png"
    argv = [
        "--trace",
        str(trace),
        "--trace-block-size",
        "64",
        "--workers",
        "2",
        "--policy",
        "all",
        "--plot",
        str(png),
        "--quiet",
        "--limit",
        "4",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in (
        *policy_names(),
        "pooled reference",
        "infinite ceiling",
    ):  # --policy all: every registered policy
        assert name in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cost_settings_reach_the_router_and_the_report(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, two_prefix_trace(8))
    out = tmp_path / "r.json"
    base = ["--trace", str(trace), "--trace-block-size", "64", "--workers", "2", "--quiet"]
    argv = [*base, "--no-reference", "--json", str(out)]
    costs = ["--cost-weights", "1,0.25,16,0.5", "--recent-window-s", "5", "--backlog-tokens", "9"]
    assert main([*argv, *costs, "--recent-decode-ratio", "2"]) == 0
    setup = json.loads(out.read_text())["setup"]
    assert (setup["cost_weights"], setup["recent_window_s"]) == ("1,0.25,16,0.5", 5.0)
    assert (setup["backlog_tokens"], setup["recent_decode_ratio"]) == (9.0, 2.0)
    args = build_parser().parse_args([*base, "--backlog-tokens", "9", "--recent-decode-ratio", "2"])
    router = _sim_config(args).router
    assert (router.policy_config.backlog_tokens, router.recent_decode_ratio) == (9.0, 2.0)
    saturated = ["--saturated-tokens", "700", "--saturated-scale-tokens", "30"]
    router = _sim_config(build_parser().parse_args([*base, *saturated])).router
    policy = router.policy_config
    assert (policy.saturated_tokens, policy.saturated_scale_tokens) == (700.0, 30.0)
    router = _sim_config(build_parser().parse_args([*base, "--cost-weights", "2,0,1"])).router
    # RECENT keeps the router's default; the rest of the policy config too
    assert router.policy_config.weights == CostWeights(2.0, 0.0, 1.0)
    assert replace(router.policy_config, weights=CostWeights()) == RouterConfig().policy_config
    assert router.recent_window_s == RouterConfig().recent_window_s
    assert router.recent_decode_ratio == RouterConfig().recent_decode_ratio


def test_prefix_hash_blocks_reaches_consistent_hash(tmp_path, capsys):
    base = ["--trace", "t.jsonl", "--workers", "2"]
    args = build_parser().parse_args([*base, "--prefix-hash-blocks", "8"])
    assert _sim_config(args).router.policy_config.prefix_hash_blocks == 8
    trace = tmp_path / "t.jsonl"
    write_trace(trace, two_prefix_trace(4))
    argv = ["--trace", str(trace), "--trace-block-size", "64", "--prefix-hash-blocks", "0"]
    assert main(argv) == 2
    assert "prefix_hash_blocks must be >= 1" in capsys.readouterr().err
