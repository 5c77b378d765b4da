"""The simulator's stricter parts: several routers, the weight-read floor, routing and network
delay, event loss, the model's context limit (exact small cases)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sim_traces import BS, tiny_config, two_prefix_trace

from fleetsim.replay.cli import main
from fleetsim.replay.sim import FleetSim, SimConfig, simulate
from fleetsim.replay.trace import TokenExpander, TraceRecord, write_trace
from worker.engine.sim_executor import H100_LLAMA3_8B_WEIGHT_READ_S, SimCostModel, SimExecutor
from worker.engine.types import ForwardItem, SamplingParams


def _item(rid: str = "r", n: int = 1, start: int = 0) -> ForwardItem:
    tokens = np.ones(n, dtype=np.int64)
    return ForwardItem(rid, tokens, start, np.arange(start + n), SamplingParams(), True, 0)


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


def test_replica_sync_shares_each_routers_picks_with_the_others():
    # approx_tree again, 24 routers, but each pick, first token and finish reaches the other
    # routers 1 ms later: every router now knows where the others put each prefix
    records = two_prefix_trace(24)
    sim = run(records, "approx_tree", tiny_config(num_routers=24, replica_sync_delay_s=0.001))
    synced = sim.report("approx_tree")
    assert synced.extra["router_predicted_hit_rate"] > 0
    assert synced.cached_tokens == (24 - 2) * 4 * BS
    sim.settle(0.01)  # the last finish's messages were still on their way when run() ended
    # 24 requests x (routed, first token, finished) x 23 other routers
    assert sim.num_replica_events == 24 * 3 * 23
    for router in sim.routers:  # nothing counted forever: every end reached every router
        assert router.stats().num_replica_inflight == 0
        assert all(router.worker_view(w).num_active == 0 for w in sim.workers)
    with pytest.raises(ValueError, match="replica_sync_delay_s must be >= 0 or None"):
        SimConfig(replica_sync_delay_s=-1.0)


def test_with_sync_own_picks_stop_counting_r_times_once_the_others_picks_arrive():
    # a 64-request burst on a cold 2,048-token prefix, two routers, 16 workers, replica sync
    # 0.5 ms. When routing takes 0.2 ms a request, a router's burst share takes 6.4 ms, and
    # the other router's picks arrive through the sync within it: counting each own pick
    # twice for all that time (window inf) counts the burst twice and spreads it over twice
    # the workers, prefilling the prefix twice as often; a 0.5 ms window keeps it on two
    from router.core.core_types import ReplicaConfig
    from router.core.router_core import RouterConfig

    burst = [TraceRecord(0.0, 33 * BS, 4, (*range(32), 1000 + i)) for i in range(64)]

    def placed(window: float, decision_s: float) -> tuple[int, float]:
        cfg = SimConfig(
            num_workers=16,
            kv_capacity_tokens=200_000,
            num_routers=2,
            replica_sync_delay_s=0.0005,
            route_decision_s=decision_s,
            router=RouterConfig(replica=ReplicaConfig(sync_window_s=window)),
        )
        sim = run(burst, "cache_aware", cfg)
        return len({r.worker_id for r in sim.results}), sim.report("x").hit_rate

    (short_workers, short_hits), (inf_workers, inf_hits) = (
        placed(0.0005, 0.0002),
        placed(float("inf"), 0.0002),
    )
    assert short_workers == 2 and inf_workers == 4
    assert short_hits > inf_hits
    # routing in no time, a burst is placed in one instant: nothing arrives through the sync
    # before it is all placed, so each router places its share blind, starting it on a
    # worker of its own; inside the window each warm own pick stands for the other router's
    # in every load term (running requests and recent work too, not only queued prefill),
    # so each router moves on sooner than with window inf, where only queued prefill
    # counts twice: more workers, fewer hits (decision 0024)
    (blind_workers, blind_hits), (inf_blind_workers, inf_blind_hits) = (
        placed(0.0005, 0.0),
        placed(float("inf"), 0.0),
    )
    assert blind_workers > inf_blind_workers >= 2
    assert blind_hits < inf_blind_hits


def test_step_reports_reach_every_router_as_a_step_starts():
    """SimConfig.step_reports (kvroute worker --step-reports): with the periodic reports off,
    every router hears a worker's first step as it starts (an event delay later), with that
    step's prefill counted as queued -- and never without the setting."""
    records = [TraceRecord(0.0, 4 * BS, 4, (1, 2, 3, 4)) for _ in range(6)]  # one instant
    heard: dict[bool, list[tuple[float, object]]] = {}
    for on in (False, True):
        cfg = tiny_config(num_routers=2, load_interval_s=0.0, step_reports=on)
        sim = FleetSim(records, "cache_aware", cfg, TokenExpander(BS, cfg.vocab_size, seed=0))
        seen: list[tuple[float, object]] = []
        for router in sim.routers:
            deliver = router.on_stream_message

            def spy(worker_id, msg, deliver=deliver, seen=seen, sim=sim):
                if getattr(msg, "load", None) is not None:
                    seen.append((sim.now, msg.load))
                return deliver(worker_id, msg)

            router.on_stream_message = spy  # type: ignore[method-assign]
        sim.run()
        heard[on] = seen
        used = {r.worker_id for r in sim.results}
    assert heard[False] == []
    delay = tiny_config().event_delay_s
    first = [load for t, load in heard[True] if t == pytest.approx(delay)]
    assert len(first) == 2 * len(used)  # each worker that got requests, to both routers
    assert all(load.num_running == 1 for load in first)  # type: ignore[attr-defined]
    assert all(load.num_queued_prefill_tokens == 4 * BS for load in first)  # type: ignore[attr-defined]


def test_a_load_report_due_during_a_step_goes_out_when_the_step_ends():
    """The worker service builds a load report on its engine thread, behind the step in
    flight: a tick that falls inside a long prefill chunk is sent when that chunk ends and
    reports what the step left (the prompt less the chunk computed)."""
    records = [TraceRecord(0.0, 64 * BS, 3, tuple(range(1, 65)))]
    cfg = replace(tiny_config(load_interval_s=0.001), num_workers=1)
    sim = FleetSim(records, "cache_aware", cfg, TokenExpander(BS, cfg.vocab_size, seed=0))
    steps: list[tuple[float, float]] = []  # (start, end) of every step
    start_step, send = sim._start_step, sim._send

    def spy_step(worker):
        start_step(worker)
        steps.append((sim.now, sim.now + worker.engine.last_step_cost_s))

    sent: list[tuple[float, object]] = []

    def spy_send(worker, msg, to=None):
        if getattr(msg, "load", None) is not None:
            sent.append((sim.now, msg.load))
        send(worker, msg, to)

    sim._start_step, sim._send = spy_step, spy_send  # type: ignore[method-assign]
    sim.run()
    prefill_end = steps[0][1]
    assert prefill_end > 0.005  # the 1 ms ticks fall inside it
    assert sent and all(not (a < t < b) for t, _ in sent for a, b in steps)
    first_t, first = sent[0]
    assert first_t == pytest.approx(prefill_end)
    assert first.num_running == 1
    assert 0 < first.num_queued_prefill_tokens == 64 * BS - cfg.engine.chunk_size


def test_router_config_is_checked():
    with pytest.raises(ValueError, match="num_routers must be >= 1"):
        SimConfig(num_routers=0)


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
    # routers deciding in no time: said, since a burst is then placed in one instant
    assert "2 routers deciding in no time place requests" in capsys.readouterr().err
    assert main([*base, "--routers", "2", "--route-decision-s", "0.0002", "--no-reference"]) == 0
    assert "deciding in no time" not in capsys.readouterr().err
    setup = json.loads(out.read_text())["setup"]
    # several routers: the workers report load every 50 ms unless told otherwise
    assert setup["routers"] == 2 and setup["load_interval_s"] == 0.05
    assert main([*base, "--routers", "2", "--load-interval-s", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["load_interval_s"] == 1.0
    assert main([*base, "--no-reference", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["load_interval_s"] == 1.0
    # with replica sync the picks travel through the sync: the reports stay at 1 s
    synced = ["--routers", "2", "--replica-sync-delay-s", "0.001", "--no-reference"]
    assert main([*base, *synced, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["load_interval_s"] == 1.0
    assert main([*base, *synced, "--load-interval-s", "0.05", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["load_interval_s"] == 0.05
    assert main([*base, "--replica-sync-delay-s", "0.001", "--no-reference"]) == 2
    assert "--replica-sync-delay-s needs --routers 2 or more" in capsys.readouterr().err
    sync = ["--routers", "2", "--replica-sync-delay-s", "0.0005", "--no-reference"]
    assert main([*base, *sync, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["setup"]["replica_sync_delay_s"] == 0.0005
    assert report["policies"][0]["extra"]["replica_events"] > 0
    assert report["setup"]["replica_cold_picks"] == 2.0  # the router's default
    assert report["setup"]["replica_peer_view"] is True  # on unless turned off
    assert report["setup"]["replica_cold_window_picks"] == 3
    off = ["--no-replica-peer-view", "--replica-cold-window-picks", "0", "--json", str(out)]
    assert main([*base, *sync, *off]) == 0
    turned_off = json.loads(out.read_text())["setup"]
    assert turned_off["replica_peer_view"] is False
    assert turned_off["replica_cold_window_picks"] == 0
    assert main([*base, "--routers", "2", "--replica-peer-view"]) == 2
    assert "--replica-peer-view needs --replica-sync-delay-s" in capsys.readouterr().err
    assert main([*base, "--routers", "2", "--replica-cold-window-picks", "1"]) == 2
    assert "--replica-cold-window-picks needs --replica-sync-delay-s" in capsys.readouterr().err
    assert main([*base, *sync, "--replica-cold-window-picks", "-1"]) == 2
    assert "replica_cold_window_picks must be >= 0, got -1" in capsys.readouterr().err
    assert report["setup"]["replica_sync_window_s"] == 0.0005  # auto: the sync delay
    window = ["--replica-sync-window-s", "inf", "--json", str(out)]
    assert main([*base, *sync, *window]) == 0
    assert json.loads(out.read_text())["setup"]["replica_sync_window_s"] == "inf"
    assert main([*base, *sync, "--replica-sync-window-s", "-1"]) == 2
    assert "replica_sync_window_s must be >= 0 or None, got -1.0" in capsys.readouterr().err
    assert main([*base, "--routers", "2", "--replica-sync-window-s", "0.01"]) == 2
    assert "--replica-sync-window-s needs --replica-sync-delay-s" in capsys.readouterr().err
    assert main([*base, *sync, "--replica-cold-picks", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["replica_cold_picks"] == 1.0
    assert main([*base, *sync, "--replica-cold-picks", "0"]) == 2
    assert "replica_cold_picks must be finite and >= 1" in capsys.readouterr().err
    # the affinity term: on for routers without sync, off with it, or as told
    assert report["setup"]["replica_affinity_tokens"] == 0.0
    assert setup["replica_affinity_tokens"] == 1000.0  # --routers 2, no sync (above)
    tokens = ["--replica-affinity-tokens", "250"]
    assert main([*base, *sync, *tokens, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["replica_affinity_tokens"] == 250.0
    assert main([*base, *tokens, "--no-reference"]) == 2
    assert "--replica-affinity-tokens needs --routers 2 or more" in capsys.readouterr().err
    assert main([*base, "--routers", "2", "--step-reports", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["step_reports"] is True
    assert main([*base, "--step-reports", "--mode", "live"]) == 2
    assert "--step-reports needs --mode sim" in capsys.readouterr().err
    assert main([*base, *sync, "--replica-affinity-tokens", "-1"]) == 2
    assert "replica_affinity_tokens must be finite and >= 0" in capsys.readouterr().err


# ---- the stricter simulation ---------------------------------------------------------------


def one_shot(prompt_tokens: int, at_ms: float = 0.0, first_id: int = 0) -> TraceRecord:
    """A request of ``prompt_tokens`` (whole trace blocks) with one output token."""
    n = prompt_tokens // BS
    return TraceRecord(at_ms, n * BS, 1, tuple(range(first_id, first_id + n)))


def flat_cost(**kw) -> SimCostModel:
    """Prefill 1 ms per token, nothing else: step times that are easy to add up."""
    return SimCostModel(
        prefill_s_per_token=1e-3,
        prefill_s_per_attn_pair=0.0,
        decode_base_s=0.0,
        decode_s_per_seq=0.0,
        decode_s_per_context_token=0.0,
        **kw,
    )


def test_weight_read_floor_binds_short_prefill_only_steps():
    cm = SimCostModel(weight_read_s=H100_LLAMA3_8B_WEIGHT_READ_S)
    assert round(H100_LLAMA3_8B_WEIGHT_READ_S * 1e3, 2) == 4.79  # ms: 16.06 GB / 3.35 TB/s
    sim, plain = SimExecutor(cm), SimExecutor(SimCostModel())
    suffix = [_item(n=64, start=2048)]  # 64 new tokens after 2,048 cached: 2.6 ms of work
    assert plain.step_cost_s(suffix, []) == pytest.approx(64 * 40e-6 + (64 * 2048 + 2048) * 1.31e-9)
    assert sim.step_cost_s(suffix, []) == pytest.approx(16.06e9 / 3.35e12)
    cold = [_item(n=8192)]  # far above the floor: unchanged
    assert sim.step_cost_s(cold, []) == plain.step_cost_s(cold, [])
    decode = [_item(rid=f"r{i}", start=2047) for i in range(32)]  # 8 ms base: unchanged
    assert sim.step_cost_s([], decode) == plain.step_cost_s([], decode)
    assert sim.step_cost_s([], []) == 0.0  # nothing ran: no pass over the weights
    assert (sim.num_steps, sim.num_floor_steps) == (3, 1)  # only the suffix hit the floor


def test_weight_read_floor_in_the_replay():
    # one 64-token request, 1 output token: TTFT is the one prefill step, 64 ms of work, or
    # the 100 ms floor when the floor is set
    records = [one_shot(64)]
    base = tiny_config(cost_model=flat_cost())
    report = simulate(records, "round_robin", base)
    assert report.ttft_p50_s == pytest.approx(0.064)
    assert (report.extra["steps"], report.extra["steps_at_weight_floor"]) == (1, 0)
    floored = tiny_config(cost_model=flat_cost(weight_read_s=0.1))
    report = simulate(records, "round_robin", floored)
    assert report.ttft_p50_s == pytest.approx(0.1)
    assert report.extra["steps"] == report.extra["steps_at_weight_floor"] == 1


def test_route_decision_time_queues_a_burst_at_each_router():
    # two 64-token requests at the same instant, round_robin: two workers, so without a
    # decision time both first tokens come at 64 ms; one router deciding 10 ms each makes
    # them 74 and 84 ms. Two routers decide in parallel (both done at 10 ms), but each
    # round-robin cursor starts at worker-0: both go there (herding), the second waits for
    # the first's prefill: 74 and 138 ms
    records = [one_shot(64), one_shot(64, first_id=100)]

    def ttfts(**kw) -> list[float]:
        sim = run(records, "round_robin", tiny_config(cost_model=flat_cost(), **kw))
        return sorted(r.first_token_s - r.arrival_s for r in sim.results)

    assert ttfts() == pytest.approx([0.064, 0.064])
    assert ttfts(route_decision_s=0.01) == pytest.approx([0.074, 0.084])
    assert ttfts(route_decision_s=0.01, num_routers=2) == pytest.approx([0.074, 0.138])
    assert ttfts(network_delay_s=0.003) == pytest.approx([0.067, 0.067])
    assert ttfts(route_decision_s=0.01, network_delay_s=0.003) == pytest.approx([0.077, 0.087])
    sim = run(records, "round_robin", tiny_config(cost_model=flat_cost(), route_decision_s=0.01))
    assert sim.report("x").extra["route_decision_s_total"] == pytest.approx(0.02)


def test_applying_the_peers_picks_is_router_work_that_goes_before_queued_decisions():
    # two routers, 10 ms decisions, a 1 ms sync. At 0 each router decides its first
    # request (0-10 ms); a second request reaches each at 0.5 ms and queues; the other's
    # pick reaches it at 1 ms. With a 4 ms apply cost the pick is applied when the first
    # decision ends (10-14 ms), before the queued request -- a router's event loop reads its
    # subscription between two calls of a burst -- so that one is decided at 14-24 ms instead
    # of 10-20: its first token comes exactly 4 ms later, the first two's not at all
    records = [
        one_shot(64),
        one_shot(64, first_id=100),
        one_shot(64, at_ms=0.5, first_id=200),
        one_shot(64, at_ms=0.5, first_id=300),
    ]
    base = dict(
        cost_model=flat_cost(), num_routers=2, route_decision_s=0.01, replica_sync_delay_s=0.001
    )

    def first_tokens(**kw) -> tuple[list[float], FleetSim]:
        sim = run(records, "round_robin", tiny_config(**{**base, **kw}))
        return [r.first_token_s for r in sim.results], sim

    free, _ = first_tokens()
    charged, sim = first_tokens(replica_apply_s=0.004)
    assert [c - f for c, f in zip(charged, free, strict=True)] == pytest.approx(
        [0.0, 0.0, 0.004, 0.004]
    )
    sim.settle(1.0)
    # each router applied the other's two picks (4 ms each), first tokens and finishes (1 ms)
    assert sim.report("x").extra["replica_apply_s_total"] == pytest.approx(
        2 * (2 * 4 + 4 * 1) / 1e3
    )
    assert sim.num_replica_events == 2 * 2 * 3
    # without a decision time there is no router queue: the apply cost is not charged
    _, plain = first_tokens(route_decision_s=0.0, replica_apply_s=0.004)
    plain.settle(1.0)
    assert plain.report("x").extra["replica_apply_s_total"] == 0.0


def test_measured_route_time_is_charged():
    records = [one_shot(64), one_shot(64, first_id=100)]
    sim = run(records, "cache_aware", tiny_config(cost_model=flat_cost(), measure_route_time=True))
    total = sim.report("x").extra["route_decision_s_total"]
    assert total > 0
    ttft = sorted(r.first_token_s - r.arrival_s for r in sim.results)
    assert ttft[1] > 0.064  # the second waited for the first decision, then its own


def test_lost_event_batches_are_recovered_through_the_sequence_numbers():
    records = two_prefix_trace(24, gap_ms=200.0)
    cfg = tiny_config(num_routers=2, event_loss=0.3, load_interval_s=0.1)
    sim = run(records, "cache_aware", cfg)
    # load ticks after the last request: the last gaps are seen and filled (a lost replay
    # is asked again after 32 more out-of-order batches: 3.2 s of load ticks)
    sim.settle(10.0)
    report = sim.report("cache_aware")
    assert report.errors == 0
    assert report.extra["event_batches_lost"] > 0
    assert report.extra["resubscribes"] > 0
    for router in sim.routers:
        assert router.stats().sync_counters  # gaps were detected on the real sync path
        for wid, worker in sim.workers.items():
            cached = {h for s in worker.engine.snapshot(wid, 1, 0).blocks for h in s.block_hashes}
            assert router.worker_blocks(wid) == cached
    again = run(records, "cache_aware", cfg)  # the losses are seeded: the same run again
    again.settle(10.0)
    assert again.report("cache_aware") == report


def test_strict_config_is_checked():
    with pytest.raises(ValueError, match="event_loss must be in"):
        SimConfig(event_loss=1.0)
    with pytest.raises(ValueError, match="network_delay_s must be >= 0"):
        SimConfig(network_delay_s=-1.0)
    with pytest.raises(ValueError, match="route_decision_s must be >= 0"):
        SimConfig(route_decision_s=float("nan"))
    with pytest.raises(ValueError, match="replica_apply_s must be >= 0"):
        SimConfig(replica_apply_s=-1e-4)


def test_cli_strict_options(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    # the last request needs 30 blocks + 2 outputs: over a 1,024-token context
    write_trace(
        trace, [*two_prefix_trace(4), TraceRecord(5000.0, 30 * BS, 2, tuple(range(50, 80)))]
    )
    base = ["--trace", str(trace), "--trace-block-size", str(BS), "--workers", "2", "--quiet"]
    out = tmp_path / "o.json"
    assert main([*base, "--max-context", "1024", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["setup"]["max_context_tokens"] == 1024
    for p in data["policies"]:
        assert p["errors"] == 1 and p["errors_by_kind"] == {"InvalidRequestError": 1}
    # the references reject it too, and say so next to their hit rates
    assert data["reference_errors"] == {"pooled": 1, "infinite": 1}
    table = capsys.readouterr().out
    assert "pooled reference (1 cache x N capacity): " in table
    assert table.count("(1 error)") == 2
    assert main([*base, "--strict", "--no-reference", "--json", str(out)]) == 0
    setup = json.loads(out.read_text())["setup"]
    assert setup["weight_read_s"] == pytest.approx(16.06e9 / 3.35e12)
    assert setup["route_decision_s"] == 200e-6 and setup["network_delay_s"] == 0.5e-3
    assert setup["max_context_tokens"] == 131_072 and "event_loss" not in setup
    assert main([*base, "--strict", "--network-delay-s", "0", "--json", str(out)]) == 0
    assert "network_delay_s" not in json.loads(out.read_text())["setup"]
    assert "replica_apply_s" not in setup  # no sync, nothing to apply
    synced = [*base, "--routers", "2", "--replica-sync-delay-s", "0.001", "--no-reference"]
    assert main([*synced, "--strict", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["setup"]["replica_apply_s"] == 150e-6
    assert main([*synced, "--strict", "--replica-apply-s", "0", "--json", str(out)]) == 0
    assert "replica_apply_s" not in json.loads(out.read_text())["setup"]
    for bad, msg in (
        (["--event-loss", "1"], "--event-loss must be in [0, 1)"),
        (["--route-decision-s", "soon"], "--route-decision-s must be seconds or 'measured'"),
        (["--max-context", "1"], "--max-context must be >= 2"),
        (["--weight-read-s", "-1"], "--weight-read-s must be >= 0"),
        (["--strict", "--mode", "live"], "need --mode sim"),
        (["--replica-apply-s", "1e-4"], "--replica-apply-s needs --replica-sync-delay-s"),
        (
            ["--routers", "2", "--replica-sync-delay-s", "0.001", "--replica-apply-s", "1e-4"],
            "--replica-apply-s needs a decision time",
        ),
        (["--replica-apply-s", "-1"], "--replica-apply-s must be >= 0"),
    ):
        assert main([*base, *bad]) == 2
        assert msg in capsys.readouterr().err


def test_each_peer_policy_gets_its_production_load_freshness_unless_told(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, two_prefix_trace(8))
    base = ["--trace", str(trace), "--trace-block-size", str(BS), "--workers", "2", "--quiet"]
    policies = ["--policy", "cache_aware", "--policy", "llm_d", "--policy", "dynamo"]
    out = tmp_path / "o.json"

    def intervals(*extra: str) -> dict[str, float]:
        assert main([*base, *policies, "--no-reference", "--json", str(out), *extra]) == 0
        rows = json.loads(out.read_text())["policies"]
        return {p["policy"]: p["extra"]["load_interval_s"] for p in rows}

    # llm-d scrapes every 50 ms; Dynamo counts active blocks at once: 50 ms reports
    assert intervals() == {"cache_aware": 1.0, "llm_d": 0.05, "dynamo": 0.05}
    assert intervals("--load-interval-s", "0.5") == {
        "cache_aware": 0.5,
        "llm_d": 0.5,
        "dynamo": 0.5,
    }


def test_for_policy_keeps_the_config_unless_asked():
    cfg = tiny_config(load_interval_s=1.0)
    assert cfg.for_policy("llm_d") is cfg
    on = replace(cfg, policy_load_intervals=True)
    assert on.for_policy("llm_d").load_interval_s == 0.05
    assert on.for_policy("cache_aware") is on
