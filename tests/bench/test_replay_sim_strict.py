"""The simulator's stricter parts: several routers, the weight-read floor, routing and network
delay, event loss, the model's context limit (exact small cases)."""

from __future__ import annotations

import pytest

from bench.replay.cli import main
from bench.replay.sim import FleetSim, SimConfig, simulate
from bench.replay.trace import TokenExpander, TraceRecord, write_trace

BS = 64  # trace block size of the tiny traces


def two_prefix_trace(num_requests: int = 24, gap_ms: float = 500.0) -> list[TraceRecord]:
    """Prefixes A (ids 0-3) and B (ids 10-13) in the order A A B B A A B B ...; each request
    adds one unique block. Requests are far apart, so each finishes before the next."""
    records = []
    for i in range(num_requests):
        prefix = (0, 1, 2, 3) if (i // 2) % 2 == 0 else (10, 11, 12, 13)
        ids = (*prefix, 1000 + i)
        records.append(TraceRecord(i * gap_ms, len(ids) * BS, 4, ids))
    return records


def tiny_config(**kw) -> SimConfig:
    return SimConfig(num_workers=2, kv_capacity_tokens=20_000, **kw)


def run(records, policy, cfg) -> FleetSim:
    sim = FleetSim(records, policy, cfg, TokenExpander(BS, cfg.vocab_size, seed=0))
    sim.run()
    return sim


# ---- several routers -----------------------------------------------------------------------


def test_each_router_routes_its_share_and_sees_every_workers_events():
    records = two_prefix_trace(24)
    sim = run(records, "cache_aware", tiny_config(num_routers=3))
    assert [r.stats().num_routed for r in sim.routers] == [8, 8, 8]  # i % 3
    assert all(r.stats().num_inflight_requests == 0 for r in sim.routers)
    for wid, worker in sim.workers.items():
        cached = {h for s in worker.engine.snapshot(wid, 1, 0).blocks for h in s.block_hashes}
        assert cached  # both prefixes were stored somewhere; each router indexes all of it
        for router in sim.routers:
            assert router.worker_blocks(wid) == cached
    report = sim.report("cache_aware")
    assert report.errors == 0 and report.extra["routers"] == 3


def test_events_keep_several_routers_as_good_as_one_on_spaced_requests():
    # requests far apart: each router learns the others' placements from the events, so
    # three routers hit exactly what one does (every prefix misses once)
    records = two_prefix_trace(24)
    ex = TokenExpander(BS, 128_256, seed=0)
    one = simulate(records, "cache_aware", tiny_config(), ex)
    three = simulate(records, "cache_aware", tiny_config(num_routers=3), ex)
    assert one.cached_tokens == three.cached_tokens == (24 - 2) * 4 * BS


def test_approx_tree_routers_know_only_their_own_history():
    # the same trace with history only: router k has never seen what the others placed, so
    # with 24 routers (one request each) nothing is ever predicted -- each router's single
    # decision is blind, and router_predicted_hit_rate is 0 while events know better
    records = two_prefix_trace(24)
    ex = TokenExpander(BS, 128_256, seed=0)
    blind = simulate(records, "approx_tree", tiny_config(num_routers=24), ex)
    assert blind.extra["router_predicted_hit_rate"] == 0.0
    aware = simulate(records, "cache_aware", tiny_config(num_routers=24), ex)
    assert aware.cached_tokens == (24 - 2) * 4 * BS


def test_random_assignment_is_seeded_and_covers_every_router():
    records = two_prefix_trace(40)
    a = run(records, "round_robin", tiny_config(num_routers=4, router_assignment="random"))
    b = run(records, "round_robin", tiny_config(num_routers=4, router_assignment="random"))
    counts = [r.stats().num_routed for r in a.routers]
    assert counts == [r.stats().num_routed for r in b.routers]
    assert sum(counts) == 40 and min(counts) > 0 and counts != [10, 10, 10, 10]


def test_router_config_is_checked():
    with pytest.raises(ValueError, match="num_routers must be >= 1"):
        SimConfig(num_routers=0)
    with pytest.raises(ValueError, match="router_assignment must be one of"):
        SimConfig(router_assignment="sticky")


def test_cli_routers(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, two_prefix_trace(8))
    base = ["--trace", str(trace), "--trace-block-size", str(BS), "--workers", "2", "--quiet"]
    assert main([*base, "--routers", "0"]) == 2
    assert "num_routers must be >= 1" in capsys.readouterr().err
    assert main([*base, "--routers", "2", "--mode", "live"]) == 2
    assert "--routers needs --mode sim" in capsys.readouterr().err
    out = tmp_path / "o.json"
    assert main([*base, "--routers", "2", "--no-reference", "--json", str(out)]) == 0
    assert '"routers": 2' in out.read_text()
