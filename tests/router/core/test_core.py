"""RouterCore: membership, streams, routing, predicted entries, in-flight accounting."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from kvroute_proto.events import (
    DEFAULT_PARTITION,
    BlockRemoved,
    BlockStored,
    EventBatch,
    LoadReport,
    Partition,
    Snapshot,
)
from kvroute_proto.hashing import block_hash_list
from router.core.policy_config import PolicyConfig
from router.core.router_core import (
    BlockSizeMismatchError,
    CostWeights,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    NoWorkerAvailable,
    Resubscribe,
    RouterConfig,
    RouterCore,
    RouteRequest,
    UnknownWorkerError,
)

B = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_core(n: int = 4, weights: CostWeights | None = None, **config) -> tuple[RouterCore, Clock]:
    clock = Clock()
    if weights is not None:
        config["policy_config"] = PolicyConfig(weights=weights)
    core = RouterCore(RouterConfig(**config), clock=clock, rng=random.Random(0))
    for i in range(n):
        core.add_worker(f"w{i}", f"10.0.0.{i}:50051", block_size=B)
    return core, clock


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def stored(toks: np.ndarray, partition: Partition = DEFAULT_PARTITION) -> BlockStored:
    n = len(toks) // B * B
    hashes = block_hash_list(toks[:n], B, partition.seed)
    return BlockStored(tuple(hashes), None, tuple(int(t) for t in toks[:n]), partition)


def give(core: RouterCore, worker_id: str, *blocks: BlockStored, seq: int = 1) -> None:
    """Sync ``worker_id`` from a snapshot holding ``blocks``."""
    assert core.on_stream_message(worker_id, Snapshot(worker_id, 1, seq, B, blocks)) == []


# ---- membership ------------------------------------------------------------------------


def test_first_worker_sets_the_block_size_and_others_must_match() -> None:
    core = RouterCore(clock=Clock(), rng=random.Random(0))
    assert core.block_size is None
    core.add_worker("a")
    assert core.block_size is None
    core.add_worker("b", block_size=32)
    assert core.block_size == 32
    with pytest.raises(BlockSizeMismatchError, match="block_size=16 but the fleet uses"):
        core.add_worker("c", block_size=16)
    assert not core.has_worker("c")
    with pytest.raises(BlockSizeMismatchError):
        core.on_stream_message("a", Snapshot("a", 1, 0, 16, ()))


def test_block_size_from_the_first_stream_message() -> None:
    core = RouterCore(clock=Clock(), rng=random.Random(0))
    core.add_worker("a")
    core.on_stream_message("a", Snapshot("a", 1, 0, 8, ()))
    assert core.block_size == 8


def test_membership_errors() -> None:
    core, _ = make_core(1)
    with pytest.raises(DuplicateWorkerError, match="'w0' is already registered"):
        core.add_worker("w0")
    with pytest.raises(UnknownWorkerError, match="unknown worker 'zz'"):
        core.set_health("zz", False)
    with pytest.raises(UnknownWorkerError):
        core.on_stream_message("zz", Snapshot("zz", 1, 0, B, ()))
    with pytest.raises(InvalidRouteRequestError, match="worker_id"):
        core.add_worker("")


def test_remove_worker_purges_and_reuses_its_slot() -> None:
    core, _ = make_core(3)
    give(core, "w1", stored(tokens(64)))
    core.route(RouteRequest("r1", tokens(64), exclude=frozenset({"w0", "w2"})))
    core.remove_worker("w1")
    assert core.workers() == ["w0", "w2"]
    assert core.stats().num_indexed_blocks == 0
    assert core.stats().num_inflight_requests == 0
    core.add_worker("w9", block_size=B)
    assert core.worker_view("w9").slot == 1
    assert core.worker_blocks("w9") == set()
    assert core.expected_subscription("w9") == (0, 0)


# ---- streams ---------------------------------------------------------------------------


def test_snapshot_then_batches_feed_the_index() -> None:
    core, _ = make_core(2)
    a = stored(tokens(64))
    give(core, "w0", a, seq=3)
    assert core.worker_blocks("w0") == set(a.block_hashes)
    load = LoadReport(num_running=2, num_queued_prefill_tokens=700)

    removal = EventBatch("w0", 1, 4, B, (BlockRemoved(a.block_hashes[2:]),), load)
    assert core.on_stream_message("w0", removal) == []
    assert core.worker_blocks("w0") == set(a.block_hashes[:2])
    assert core.worker_view("w0").load == load
    assert core.worker_view("w0").queued_prefill_tokens == 700


def test_gap_returns_a_resubscribe_action() -> None:
    core, _ = make_core(1)
    give(core, "w0", seq=3)
    actions = core.on_stream_message("w0", EventBatch("w0", 1, 6, B))
    assert actions == [Resubscribe("w0", 1, 3, "gap after seq 3 (got 6)")]
    assert core.stream_position("w0") == (1, 3)


def test_new_epoch_purges_the_worker() -> None:
    core, _ = make_core(1)
    give(core, "w0", stored(tokens(64)))
    core.on_stream_message("w0", EventBatch("w0", 2, 1, B))
    assert core.worker_blocks("w0") == set()
    assert core.stats().sync_counters["new_epoch"] == 2


def test_apply_errors_are_counted_not_raised() -> None:
    core, _ = make_core(1)
    give(core, "w0")

    core.on_stream_message("w0", EventBatch("w0", 1, 2, B, (BlockRemoved((1, 2)),)))
    assert core.stats().apply_errors["unknown_block"] == 2


# ---- routing ---------------------------------------------------------------------------


def test_no_worker_available() -> None:
    core, _ = make_core(0)
    with pytest.raises(NoWorkerAvailable, match="0 registered, 0 healthy, 0 excluded"):
        core.route(RouteRequest("r", tokens(10)))
    core, _ = make_core(2)
    core.set_health("w0", False)
    with pytest.raises(NoWorkerAvailable, match="2 registered, 1 healthy, 1 excluded"):
        core.route(RouteRequest("r", tokens(10), exclude=frozenset({"w1"})))


def test_unhealthy_workers_are_never_picked_even_with_the_best_match() -> None:
    core, _ = make_core(3)
    give(core, "w0", stored(tokens(320)))
    core.set_health("w0", False)
    picks = {core.route(RouteRequest(f"r{i}", tokens(320))).worker_id for i in range(30)}
    assert "w0" not in picks
    core.set_health("w0", True)
    core2, _ = make_core(3)
    give(core2, "w0", stored(tokens(320)))
    assert core2.route(RouteRequest("x", tokens(320))).worker_id == "w0"


def test_route_prefers_the_holder_and_reports_exact_match() -> None:
    core, _ = make_core(4)
    give(core, "w2", stored(tokens(200)))  # 12 full blocks = 192 tokens
    d = core.route(RouteRequest("r1", tokens(300)))
    assert (d.worker_id, d.address, d.prompt_tokens, d.matched_tokens) == (
        "w2",
        "10.0.0.2:50051",
        300,
        192,
    )
    assert d.cost == 108.0 and d.policy == "cache_aware"
    assert core.worker_view("w2").inflight_prefill_tokens == 108


def test_route_on_a_prefix_charges_the_whole_prompt() -> None:
    """A text prompt routed on its routable prefix: matches come from the prefix, the cost
    and the in-flight accounting from the whole prompt's length."""
    core, _ = make_core(4)
    give(core, "w2", stored(tokens(200)))
    d = core.route(RouteRequest("r1", tokens(256), prompt_tokens=1000))
    assert (d.worker_id, d.prompt_tokens, d.matched_tokens) == ("w2", 1000, 192)
    assert core.worker_view("w2").inflight_prefill_tokens == 1000 - 192
    assert d.cost == 808.0
    with pytest.raises(InvalidRouteRequestError, match=r"prompt_tokens.* = 256, got 100"):
        core.route(RouteRequest("r2", tokens(256), prompt_tokens=100))


def test_may_match_past_says_whether_any_cache_goes_on() -> None:
    core, _ = make_core(4)
    give(core, "w1", stored(tokens(320)))  # 20 blocks
    p = DEFAULT_PARTITION
    assert core.may_match_past(tokens(160), p)  # w1 holds more than these 10 blocks
    assert core.may_match_past(tokens(320), p)  # all 20: the worker may hold more later
    assert not core.may_match_past(tokens(400), p)  # w1's 20 end inside these 25
    assert not core.may_match_past(tokens(336), p)  # ... and inside these 21
    assert not core.may_match_past(tokens(320, start=7), p)  # nobody holds the first block
    assert not core.may_match_past(tokens(160), Partition("tenant-b"))
    assert core.may_match_past(tokens(8), p)  # no full block yet: not known to end
    # a prediction (probed every predict_stride=4 blocks) counts as going on
    core.route(RouteRequest("r", tokens(480, start=1000)))  # 30 blocks, probes at 4, 8 ..
    assert core.may_match_past(tokens(480, start=1000), p)
    assert core.may_match_past(tokens(496, start=1000), p)  # last probe (28) predicted
    assert not core.may_match_past(tokens(512, start=1000), p)  # probe 32 is not
    # policies that ignore caches never need more of a prompt
    rr, _ = make_core(2, policy="round_robin")
    give(rr, "w1", stored(tokens(320)))
    assert not rr.may_match_past(tokens(160), p)


def test_partition_separates_caches() -> None:
    core, _ = make_core(2)
    give(core, "w1", stored(tokens(320), Partition("tenant-a")))
    d = core.route(RouteRequest("r", tokens(320), Partition("tenant-b")))
    assert d.matched_tokens == 0
    core.on_finished("r")
    d = core.route(RouteRequest("r2", tokens(320), Partition("tenant-a")))
    assert (d.worker_id, d.matched_tokens) == ("w1", 320)


def test_invalid_tokens() -> None:
    core, _ = make_core(1)
    with pytest.raises(InvalidRouteRequestError, match="token_ids"):
        core.route(RouteRequest("r", np.array([1, -5])))
    with pytest.raises(InvalidRouteRequestError, match="token_ids"):
        core.route(RouteRequest("r", np.array([0.5])))


def test_a_prediction_is_held_until_every_request_that_made_it_has_its_first_token() -> None:
    core, clock = make_core(2, predicted_ttl_s=1.0)

    def best_match(n: int) -> int:  # explain() also drops lapsed predictions
        return max(w.matched_tokens for w in core.explain(RouteRequest("x", tokens(n))).workers)

    a = core.route(RouteRequest("a", tokens(320)))
    b = core.route(RouteRequest("b", tokens(320)))  # follows a: nothing new to hold
    c = core.route(RouteRequest("c", tokens(640)))  # follows too, holds blocks 20-39
    assert (b.worker_id, c.worker_id, c.matched_tokens) == (a.worker_id, a.worker_id, 320)
    clock.now += 10.0
    assert best_match(640) == 640
    core.on_first_token("a")
    clock.now += 1.0
    # a's blocks lapsed; c's deeper ones are still held, but a match walks from block 0
    assert best_match(320) == 0
    assert core.stats().num_predicted_entries == 5
    core.on_finished("c")  # a request that fails before its first token releases too
    clock.now += 1.0
    assert best_match(640) == 0
    assert core.stats().num_predicted_entries == 0


def test_removing_a_worker_releases_the_holds_of_its_requests() -> None:
    core, clock = make_core(2, predicted_ttl_s=1.0)
    d = core.route(RouteRequest("d", tokens(320)))
    core.remove_worker(d.worker_id)
    core.add_worker("w9", "10.0.0.9:50051", block_size=B)
    e = core.route(RouteRequest("e", tokens(320)))
    core.on_first_token("e")
    clock.now += 1.0
    explained = core.explain(RouteRequest("x", tokens(320)))
    assert [w.matched_tokens for w in explained.workers] == [0, 0]  # not held by d
    assert core.stats().num_inflight_requests == 1 and e.worker_id != d.worker_id


def test_burst_with_a_new_prefix_follows_the_first_request_before_any_event() -> None:
    core, _ = make_core(4)
    prefix = tokens(1024)
    first = core.route(RouteRequest("r0", np.concatenate([prefix, tokens(40, 5000)])))
    assert first.matched_tokens == 0
    for i in range(1, 5):
        d = core.route(RouteRequest(f"r{i}", np.concatenate([prefix, tokens(40, 5000 + 100 * i)])))
        assert (d.worker_id, d.matched_tokens) == (first.worker_id, 1024)


def test_predictions_expire_a_ttl_after_the_first_token_unless_confirmed() -> None:
    core, clock = make_core(4, predicted_ttl_s=2.0)
    d = core.route(RouteRequest("r0", tokens(320)))
    assert core.stats().num_predicted_entries == 5  # 20 blocks, every 4th kept
    clock.now += 30.0  # r0 still queued there: its blocks are still coming
    d1 = core.route(RouteRequest("r1", tokens(320)))
    assert (d1.worker_id, d1.matched_tokens) == (d.worker_id, 320)
    core.on_finished("r1")
    core.on_first_token("r0")  # the TTL starts now
    clock.now += 1.9
    assert core.route(RouteRequest("r1b", tokens(320))).matched_tokens == 320
    core.on_finished("r1b")
    clock.now += 0.1
    core.on_finished("r0")
    d2 = core.route(RouteRequest("r1", tokens(320)))
    assert d2.matched_tokens == 0
    core.on_finished("r1")
    # confirmed entries outlive the TTL
    give(core, d.worker_id, stored(tokens(320)))
    clock.now += 50
    assert core.route(RouteRequest("r2", tokens(320))).matched_tokens == 320


def test_in_flight_accounting() -> None:
    core, _ = make_core(1)
    core.route(RouteRequest("a", tokens(100)))
    core.route(RouteRequest("b", tokens(50, 1000)))
    view = core.worker_view("w0")
    assert (view.inflight_prefill_tokens, view.num_active) == (150, 2)
    core.on_first_token("a")
    core.on_first_token("a")  # idempotent
    assert (view.inflight_prefill_tokens, view.num_active) == (50, 2)
    core.on_finished("a")
    core.on_finished("b")  # finished without a first token (aborted in prefill)
    core.on_finished("nope")
    assert (view.inflight_prefill_tokens, view.num_active) == (0, 0)


def test_rerouting_an_in_flight_request_moves_its_accounting() -> None:
    core, _ = make_core(2)
    d = core.route(RouteRequest("a", tokens(100)))
    other = "w1" if d.worker_id == "w0" else "w0"
    d2 = core.route(RouteRequest("a", tokens(100), exclude=frozenset({d.worker_id})))
    assert d2.worker_id == other
    assert core.worker_view(d.worker_id).num_active == 0
    assert core.worker_view(other).num_active == 1
    assert core.stats().num_inflight_requests == 1


def _hot_prefix_run(trickle: bool) -> Counter[str]:
    # default weights: what one worker "cannot keep up with" is its queued prefill plus the
    # requests it is decoding, both of which a burst piles up
    core, _ = make_core(4)
    system = tokens(2048)
    give(core, "w0", stored(system))
    rng = np.random.default_rng(0)
    picks: Counter[str] = Counter()
    for i in range(100):
        prompt = np.concatenate([system, rng.integers(0, 30000, 64).astype(np.uint32)])
        picks[core.route(RouteRequest(f"r{i}", prompt)).worker_id] += 1
        if trickle:  # each request is through prefill and done before the next arrives
            core.on_first_token(f"r{i}")
            core.on_finished(f"r{i}")
    return picks


def test_hot_prefix_burst_spreads_but_a_trickle_stays_on_the_holder() -> None:
    burst = _hot_prefix_run(trickle=False)
    assert len(burst) > 1
    assert 50 < burst["w0"] < 100  # the holder keeps most of it; the overflow spreads
    assert _hot_prefix_run(trickle=True) == Counter({"w0": 100})


def test_ties_are_not_always_the_first_worker() -> None:
    core, _ = make_core(4)
    picks = Counter()
    for i in range(40):
        picks[core.route(RouteRequest(f"r{i}", tokens(8, 1000 * i))).worker_id] += 1
        core.on_finished(f"r{i}")
    assert len(picks) == 4


def _one_off_requests(core: RouterCore, clock: Clock, n: int) -> Counter[str]:
    """``n`` requests, one a second, each [the 512-token system prompt][4,000 unique tokens],
    each done before the next arrives (a fleet far below saturation)."""
    system = tokens(512)
    rng = np.random.default_rng(1)
    picks: Counter[str] = Counter()
    for i in range(n):
        prompt = np.concatenate([system, rng.integers(0, 30000, 4000).astype(np.uint32)])
        picks[core.route(RouteRequest(f"r{i}", prompt)).worker_id] += 1
        core.on_first_token(f"r{i}")
        core.on_finished(f"r{i}")
        clock.now += 1.0
    return picks


def test_one_off_requests_spread_over_an_idle_fleet_despite_a_shared_system_prompt() -> None:
    # Every worker but w0 is idle and cold; w0 holds the system prompt. Queues are empty at
    # each arrival, so only the recent-prefill term can move work off the holder.
    core, clock = make_core(4)
    give(core, "w0", stored(tokens(512)))
    picks = _one_off_requests(core, clock, 200)
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert max(picks.values()) <= 1.25 * min(picks.values()), picks
    # without the term every request stays on the holder (the 512 cached tokens win)
    core, clock = make_core(4, weights=CostWeights(recent_prefill=0.0))
    give(core, "w0", stored(tokens(512)))
    assert _one_off_requests(core, clock, 50) == Counter({"w0": 50})


def test_recent_prefill_decays_with_the_window() -> None:
    core, clock = make_core(2, weights=CostWeights(1.0, 0.0, 0.0, 1.0), recent_window_s=10.0)
    first = core.route(RouteRequest("r1", tokens(1600)))  # idle fleet: a random worker
    core.on_finished("r1")
    other = {"w0": "w1", "w1": "w0"}[first.worker_id]

    def costs() -> dict[str, float]:
        e = core.explain(RouteRequest("probe", tokens(160, 50_000)))
        return {w.worker_id: w.cost for w in e.workers}

    assert costs() == {first.worker_id: 160 + 1600.0, other: 160.0}
    e = core.explain(RouteRequest("probe", tokens(160, 50_000)))
    assert {w.worker_id: w.recent_prefill_tokens for w in e.workers} == {
        first.worker_id: 1600.0,
        other: 0.0,
    }
    clock.now += 10.0 * math.log(2)  # one half-life
    assert costs()[first.worker_id] == pytest.approx(160 + 800.0)
    assert core.route(RouteRequest("r2", tokens(800, 60_000))).worker_id == other
    core.on_finished("r2")
    got = costs()
    assert got[first.worker_id] == pytest.approx(160 + 800.0)
    assert got[other] == pytest.approx(160 + 800.0)


def test_generated_tokens_of_a_finished_request_count_toward_its_worker() -> None:
    weights = CostWeights(1.0, 0.0, 0.0, 1.0)
    core, clock = make_core(2, weights=weights, recent_window_s=10.0, recent_decode_ratio=0.5)
    d = core.route(RouteRequest("r1", tokens(320)))
    core.on_first_token("r1")
    core.on_finished("r1", generated_tokens=400)
    core.on_finished("r1", generated_tokens=400)  # a second report of the same id: ignored

    def recent() -> float:
        e = core.explain(RouteRequest("probe", tokens(16, 50_000)))
        return {w.worker_id: w.recent_prefill_tokens for w in e.workers}[d.worker_id]

    assert recent() == pytest.approx(320 + 0.5 * 400)
    clock.now += 10.0 * math.log(2)  # decays like the rest of the sum
    assert recent() == pytest.approx((320 + 200) / 2)
    off, _ = make_core(2, weights=weights, recent_decode_ratio=0.0)
    d = off.route(RouteRequest("r1", tokens(320)))
    off.on_finished("r1", generated_tokens=400)
    e = off.explain(RouteRequest("probe", tokens(16, 50_000)))
    assert {w.worker_id: w.recent_prefill_tokens for w in e.workers}[d.worker_id] == 320.0
    with pytest.raises(ValueError, match="recent_decode_ratio must be >= 0"):
        make_core(1, recent_decode_ratio=-1.0)


def test_recent_prefill_survives_long_runs_without_overflow() -> None:
    # exp(t / window) would overflow a float after 7,100 s at a 10 s window: the core rebases
    core, clock = make_core(2, weights=CostWeights(1.0, 0.0, 0.0, 1.0), recent_window_s=10.0)
    for i, gap in enumerate((1000.0, 2000.0, 3000.0, 10 * 3600.0, 5.0)):
        clock.now += gap
        picked = core.route(RouteRequest(f"r{i}", tokens(320, 1000 * i))).worker_id
        core.on_finished(f"r{i}")
        e = core.explain(RouteRequest("probe", tokens(16, 99_000)))
        assert {w.worker_id: w.cost for w in e.workers}[picked] == pytest.approx(16 + 320.0)
        assert all(math.isfinite(w.cost) for w in e.workers)


# ---- explain ---------------------------------------------------------------------------


def test_explain_reports_every_worker_and_changes_nothing() -> None:
    core, _ = make_core(3, policy="round_robin")
    give(core, "w1", stored(tokens(64)))
    core.set_health("w2", False)
    before = core.stats()
    e = core.explain(RouteRequest("r", tokens(70)))
    assert e.policy == "round_robin" and e.prompt_tokens == 70
    assert e.chosen_worker_id == "w0"
    assert [(w.worker_id, w.healthy, w.matched_tokens, w.cost) for w in e.workers] == [
        ("w0", True, 0, None),
        ("w1", True, 64, None),
        ("w2", False, 0, None),
    ]
    assert [w.not_candidate_reason for w in e.workers] == ["", "", "unhealthy"]
    excluded = core.explain(RouteRequest("r", tokens(70), exclude=frozenset({"w0"})))
    assert [w.not_candidate_reason for w in excluded.workers] == [
        "excluded by the request",
        "",
        "unhealthy",
    ]
    assert excluded.chosen_worker_id == "w1"
    assert core.explain(RouteRequest("r", tokens(70))).chosen_worker_id == "w0"
    assert core.stats() == before
    assert core.route(RouteRequest("r", tokens(70))).worker_id == "w0"


def test_explain_ignores_lapsed_predictions_like_route() -> None:
    core, clock = make_core(2, predicted_ttl_s=2.0)
    first = core.route(RouteRequest("r1", tokens(64)))
    core.on_finished("r1")
    assert core.explain(RouteRequest("r2", tokens(64))).chosen_worker_id == first.worker_id
    clock.now += 2.0  # the prediction lapses unconfirmed
    e = core.explain(RouteRequest("r2", tokens(64)))
    assert [w.matched_tokens for w in e.workers] == [0, 0]
    assert core.route(RouteRequest("r2", tokens(64))).matched_tokens == 0


def test_explain_reports_event_and_predicted_matches_apart() -> None:
    core, clock = make_core(2, predicted_ttl_s=2.0)
    first = core.route(RouteRequest("r1", tokens(64)))
    core.on_finished("r1")
    other = "w1" if first.worker_id == "w0" else "w0"
    give(core, other, stored(tokens(48)))  # 3 blocks confirmed by events
    by_id = {w.worker_id: w for w in core.explain(RouteRequest("r2", tokens(64))).workers}
    pred, conf = by_id[first.worker_id], by_id[other]
    assert (pred.event_matched_tokens, pred.predicted_matched_tokens) == (0, 64)
    assert (conf.event_matched_tokens, conf.predicted_matched_tokens) == (48, 0)
    assert (pred.matched_tokens, conf.matched_tokens) == (64, 48)
    clock.now += 2.0  # the prediction lapses; the events stay
    by_id = {w.worker_id: w for w in core.explain(RouteRequest("r2", tokens(64))).workers}
    assert by_id[first.worker_id].predicted_matched_tokens == 0
    assert by_id[other].event_matched_tokens == 48
    # a shorter prompt matches its own whole blocks only
    short = {w.worker_id: w for w in core.explain(RouteRequest("r3", tokens(40))).workers}
    assert short[other].event_matched_tokens == 32


def test_explain_costs_for_cache_aware() -> None:
    core, _ = make_core(2)
    give(core, "w1", stored(tokens(64)))
    e = core.explain(RouteRequest("r", tokens(70)))
    assert e.chosen_worker_id == "w1"
    assert [(w.matched_tokens, w.cost) for w in e.workers] == [(0, 70.0), (64, 6.0)]
    core.set_health("w0", False)
    core.set_health("w1", False)
    assert core.explain(RouteRequest("r", tokens(70))).chosen_worker_id is None


def test_explain_reports_the_miss_factor_of_a_queued_and_a_saturated_fleet() -> None:
    config = PolicyConfig(backlog_tokens=10_000.0, saturated_tokens=2_000.0)
    core, _ = make_core(2, policy_config=config)
    assert core.explain(RouteRequest("x", tokens(70))).miss_factor == 1.0  # an idle fleet
    # 3,000 uncached tokens routed to each worker, none at its first token yet
    for k in range(2):
        core.route(RouteRequest(f"r{k}", tokens(3000, start=10_000 * (k + 1))))
    queued = [
        w.inflight_prefill_tokens for w in core.explain(RouteRequest("x", tokens(70))).workers
    ]
    assert sorted(queued) == [3000, 3000]
    # 1 + 3,000 / 10,000 + (3,000 - 2,000) / 2,000 (the default scale)
    assert core.explain(RouteRequest("x", tokens(70))).miss_factor == 1.0 + 0.3 + 0.5
    core.on_first_token("r0")  # one worker's queue is gone: not every candidate is queued
    assert core.explain(RouteRequest("x", tokens(70))).miss_factor == 1.0
    rr, _ = make_core(2, policy="round_robin")
    assert rr.explain(RouteRequest("x", tokens(70))).miss_factor == 0.0  # no such factor


# ---- approx_tree ---------------------------------------------------------------------------


def test_approx_tree_uses_routing_history_not_events() -> None:
    core, clock = make_core(4, policy="approx_tree", approx_ttl_s=60.0)
    give(core, "w3", stored(tokens(320)))
    assert core.worker_blocks("w3") == set()  # events are not applied
    first = core.route(RouteRequest("r0", tokens(320)))
    core.on_finished("r0")
    clock.now += 50
    again = core.route(RouteRequest("r1", tokens(320)))
    assert (again.worker_id, again.matched_tokens) == (first.worker_id, 320)
    core.on_finished("r1")
    clock.now += 50  # r1 refreshed the entries at t+50: still alive at t+100
    assert core.route(RouteRequest("r2", tokens(320))).matched_tokens == 320


def test_baselines_route_and_report_matches() -> None:
    for name in ("round_robin", "random", "least_load", "power_of_two", "consistent_hash"):
        core, _ = make_core(4, policy=name)
        give(core, "w1", stored(tokens(64)))
        seen = set()
        for i in range(20):
            d = core.route(RouteRequest(f"r{i}", tokens(64)))
            assert d.policy == name
            assert d.matched_tokens == (64 if d.worker_id == "w1" else 0)
            seen.add(d.worker_id)
        assert core.stats().num_predicted_entries == 0  # baselines do not predict
        assert len(seen) >= 1


def test_resync_snapshot_keeps_predictions_but_a_restart_drops_them() -> None:
    core, _ = make_core(2)
    d = core.route(RouteRequest("r0", tokens(320)))
    give(core, d.worker_id, stored(tokens(64)), seq=5)  # a resync of the same epoch
    assert core.stats().num_predicted_entries == 5
    assert core.worker_blocks(d.worker_id) == set(stored(tokens(64)).block_hashes)
    core.on_stream_message(d.worker_id, EventBatch(d.worker_id, 99, 1, B))  # restarted
    assert core.stats().num_predicted_entries == 0
    assert core.worker_blocks(d.worker_id) == set()


def test_approx_tree_keeps_its_history_across_a_resync() -> None:
    core, _ = make_core(1, policy="approx_tree")
    core.route(RouteRequest("r0", tokens(320)))
    give(core, "w0", stored(tokens(64)), seq=3)
    assert core.stats().num_predicted_entries == 5


@pytest.mark.parametrize("field", ["predicted_ttl_s", "approx_ttl_s"])
def test_router_config_ttl_error_names_the_field_and_value(field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be >= 0, got -1\.0$"):
        RouterConfig(**{field: -1.0})


# ---- the running cap -------------------------------------------------------------------


def test_a_worker_at_its_running_cap_is_charged_the_wait_for_a_slot() -> None:
    # the slot wait alone: the decode-time term would move these requests off w0 anyway
    core, _ = make_core(2, CostWeights(decode_time=0.0))
    prefix = tokens(2048)
    give(core, "w0", stored(prefix))  # w0 holds the prompt's 2,048-token prefix
    # w0 runs 32 requests with 20 waiting; w1 is idle
    full = LoadReport(num_running=32, num_waiting=20, num_total_kv_tokens=1 << 20)
    core.on_stream_message("w0", EventBatch("w0", 1, 2, B, (), full))
    prompt = np.concatenate([prefix, tokens(64, start=50_000)])

    # no cap stated: the cached prefix outweighs 52 requests of decode load
    assert core.route(RouteRequest("a", prompt)).worker_id == "w0"
    core.on_finished("a")
    # a cap w0 is far from charges nothing
    core.set_max_running("w0", 256)
    assert core.worker_view("w0").slot_queue == 0
    assert core.route(RouteRequest("b", prompt)).worker_id == "w0"
    core.on_finished("b")
    # w0 states a cap of 32: a new request would wait behind 21 requests for a slot
    core.set_max_running("w0", 32)
    assert core.worker_view("w0").slot_queue == 53 - 32
    assert core.route(RouteRequest("c", prompt)).worker_id == "w1"


def test_a_worker_decoding_for_many_is_left_for_an_idle_one_despite_its_cache() -> None:
    def pick(num_running: int, kv_used: int) -> str:
        core, _ = make_core(2)  # the default cost, decode-time term included (decision 0031)
        prefix = tokens(2048)
        give(core, "w0", stored(prefix))
        total = 1 << 20
        load = LoadReport(
            num_running=num_running, num_total_kv_tokens=total, num_free_kv_tokens=total - kv_used
        )
        core.on_stream_message("w0", EventBatch("w0", 1, 2, B, (), load))
        prompt = np.concatenate([prefix, tokens(64, start=50_000)])
        return core.route(RouteRequest("a", prompt)).worker_id

    # 52 requests decoding there would each be slowed, and it would decode at their pace
    assert pick(52, 1 << 19) == "w1"
    # a few: the cached prefix is worth more
    assert pick(4, 8000) == "w0"


def test_set_max_running_rejects_what_no_worker_states() -> None:
    core, _ = make_core(1)
    with pytest.raises(InvalidRouteRequestError, match="max_running_requests: must be >= 0"):
        core.set_max_running("w0", -1)
    with pytest.raises(UnknownWorkerError):
        core.set_max_running("w9", 8)
