"""RouterCore's side of replica sync: its own picks go to a listener, the other replicas'
picks are counted (once) with their predicted prefixes, and forgotten when the peer goes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.core.core_types import (
    DEFAULT_REPLICA_COLD_PICKS,
    IndexConfig,
    ReplicaConfig,
    ReplicaEvent,
    ReplicaFinished,
    ReplicaFirstToken,
    ReplicaRouted,
)
from router.core.router_core import RouterConfig, RouterCore, RouteRequest

B = 16
COLD = DEFAULT_REPLICA_COLD_PICKS  # a cold pick's count with R = 4 replicas
BACKENDS = ("numba", "dict")


def make_core(
    backend: str, replicas: int = 1, seed: int = 0, peer_view: bool = False
) -> RouterCore:
    core = RouterCore(
        RouterConfig(
            block_size=B,
            index=IndexConfig(backend=backend),
            replica=ReplicaConfig(count=replicas, peer_view=peer_view),
        ),
        clock=lambda: 0.0,
        rng=random.Random(seed),
    )
    for i in range(4):
        core.add_worker(f"w{i}", block_size=B)
    return core


def prompt(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_routers_own_requests_reach_its_listener_in_order(backend):
    core = make_core(backend)
    heard: list[ReplicaEvent] = []
    core.set_replica_listener(heard.append)
    d = core.route(RouteRequest("r1", prompt(100)))
    core.on_first_token("r1")
    core.on_first_token("r1")  # a second first token is not news
    core.on_finished("r1", generated_tokens=7)
    core.on_finished("r1")  # nor a second end
    routed, first, finished = heard
    assert isinstance(routed, ReplicaRouted)
    assert (routed.request_id, routed.worker_id) == ("r1", d.worker_id)
    assert (routed.prompt_tokens, routed.matched_tokens) == (100, d.matched_tokens)
    assert len(routed.block_hashes) == 100 // B  # full blocks only
    assert first == ReplicaFirstToken("r1")
    assert finished == ReplicaFinished("r1", 7)
    core.on_routed("r2", "w3", prompt_tokens=50, matched_tokens=10)  # placed by the shell
    assert heard[-1] == ReplicaRouted("r2", "w3", 50, 10)
    core.set_replica_listener(None)
    core.route(RouteRequest("r3", prompt(40)))
    assert len(heard) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retry_tells_the_peers_the_old_placement_ended(backend):
    core = make_core(backend)
    heard: list[ReplicaEvent] = []
    core.set_replica_listener(heard.append)
    first = core.route(RouteRequest("r", prompt(64)))
    core.route(RouteRequest("r", prompt(64), exclude=frozenset({first.worker_id})))
    assert [type(e) for e in heard] == [ReplicaRouted, ReplicaFinished, ReplicaRouted]
    assert heard[2].worker_id != first.worker_id  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peers_pick_counts_once_with_its_prefix_predicted_until_it_ends(backend):
    a = make_core(backend, replicas=4)
    b = make_core(backend, replicas=4, seed=1)
    heard: list[ReplicaEvent] = []
    a.set_replica_listener(heard.append)
    tokens = prompt(320)
    d = a.route(RouteRequest("x", tokens))
    (routed,) = heard
    assert b.apply_replica("router-a", routed)
    view = b.worker_view(d.worker_id)
    # what happened counts once (replicas scales only a router's own anticipation)
    assert view.inflight_prefill_tokens == 320 and view.num_active == 1
    assert b.stats().num_replica_inflight == 1
    # b now expects the prefix on that worker, before any KV event
    follower = b.explain(RouteRequest("y", np.concatenate([tokens, prompt(32, 9000)])))
    matched = {s.worker_id: s.matched_tokens for s in follower.workers}
    assert matched[d.worker_id] == 320
    assert all(m == 0 for w, m in matched.items() if w != d.worker_id)
    assert b.apply_replica("router-a", ReplicaFirstToken("x"))
    assert view.inflight_prefill_tokens == 0 and view.num_active == 1
    assert not b.apply_replica("router-a", ReplicaFirstToken("x"))  # already started
    assert b.apply_replica("router-a", ReplicaFinished("x", 5))
    assert view.num_active == 0 and b.stats().num_replica_inflight == 0
    assert not b.apply_replica("router-a", ReplicaFinished("x"))  # already ended


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_cannot_be_applied_changes_nothing(backend):
    core = make_core(backend)
    before = [
        (v.inflight_prefill_tokens, v.num_active) for v in map(core.worker_view, ["w0", "w1"])
    ]
    assert not core.apply_replica("p", ReplicaRouted("r", "no-such-worker", 10, 0))
    assert not core.apply_replica("p", ReplicaFirstToken("never-placed"))
    assert not core.apply_replica("p", ReplicaFinished("never-placed"))
    assert core.apply_replica("p", ReplicaRouted("r", "w0", 10, 0))
    assert not core.apply_replica("p", ReplicaRouted("r", "w1", 10, 0))  # already counted
    # the same request id from another router is another request
    assert core.apply_replica("q", ReplicaRouted("r", "w1", 20, 0))
    after = [(v.inflight_prefill_tokens, v.num_active) for v in map(core.worker_view, ["w0", "w1"])]
    assert after == [(before[0][0] + 10, 1), (before[1][0] + 20, 1)]
    # a peer's request never collides with this router's own of the same id
    d = core.route(RouteRequest("r", prompt(48)))
    core.on_finished("r")
    assert core.stats().num_replica_inflight == 2
    assert core.worker_view(d.worker_id).num_active == (1 if d.worker_id in ("w0", "w1") else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropping_a_peer_or_its_worker_forgets_its_requests(backend):
    core = make_core(backend)
    core.apply_replica("p", ReplicaRouted("r1", "w0", 100, 0, np.arange(6, dtype=np.uint64)))
    core.apply_replica("p", ReplicaRouted("r2", "w1", 50, 0))
    core.apply_replica("p", ReplicaFirstToken("r2"))
    core.apply_replica("q", ReplicaRouted("r3", "w2", 70, 0))
    assert core.drop_replica("p") == 2
    assert core.drop_replica("p") == 0
    for w in ("w0", "w1"):
        view = core.worker_view(w)
        assert (view.inflight_prefill_tokens, view.num_active) == (0, 0)
    core.remove_worker("w2")
    assert core.stats().num_replica_inflight == 0
    assert not core.apply_replica("q", ReplicaFinished("r3"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("peer_view", [False, True])
def test_a_peers_cold_pick_of_a_prefix_this_router_started_there(backend, peer_view):
    """A burst's same-instant picks: a and b both start the same new prefix on one worker,
    each cold in its own view. By default b counts a's pick as a saw it (all of it); with
    replica_peer_view by what b already expects there (the worker computes the prefix
    once): the suffix only. Either way its first token takes off exactly what it added."""
    a = make_core(backend, replicas=2)
    b = make_core(backend, replicas=2, seed=1, peer_view=peer_view)
    heard: list[ReplicaEvent] = []
    a.set_replica_listener(heard.append)
    shared = prompt(320)
    mine = b.route(RouteRequest("b1", np.concatenate([shared, prompt(48, 70_000)])))
    theirs = a.route(
        RouteRequest(
            "a1",
            np.concatenate([shared, prompt(64, 80_000)]),
            exclude=frozenset(f"w{i}" for i in range(4)) - {mine.worker_id},
        )
    )
    assert theirs.worker_id == mine.worker_id and theirs.matched_tokens == 0  # cold at a
    view = b.worker_view(mine.worker_id)
    before = view.inflight_prefill_tokens
    (routed,) = heard
    assert b.apply_replica("router-a", routed)
    assert view.inflight_prefill_tokens == before + (64 if peer_view else 384)
    assert b.apply_replica("router-a", ReplicaFirstToken("a1"))
    assert view.inflight_prefill_tokens == before
    # where this router expects nothing, the peer's own match is what counts
    other = next(f"w{i}" for i in range(4) if f"w{i}" != mine.worker_id)
    assert b.apply_replica(
        "router-a", ReplicaRouted("a2", other, prompt_tokens=384, matched_tokens=128)
    )
    assert b.worker_view(other).inflight_prefill_tokens == 256


def test_the_burst_a_peer_started_is_where_this_router_sends_the_next_request():
    """The point of it: router b has no event yet, only a's pick, and follows it."""
    a = make_core("numba")
    b = make_core("numba", seed=7)
    heard: list[ReplicaEvent] = []
    a.set_replica_listener(heard.append)
    shared = prompt(2048, 100)
    first = a.route(RouteRequest("a1", np.concatenate([shared, prompt(64, 50_000)])))
    for event in heard:
        b.apply_replica("a", event)
    second = b.route(RouteRequest("b1", np.concatenate([shared, prompt(64, 60_000)])))
    assert second.worker_id == first.worker_id
    assert second.matched_tokens == 2048


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def synced_core(
    backend: str,
    window: float | None,
    replicas: int = 4,
    sync: bool = True,
    peer_view: bool = False,
    cold_window_picks: int = 3,
):
    clock = _Clock()
    core = RouterCore(
        RouterConfig(
            block_size=B,
            index=IndexConfig(backend=backend),
            replica=ReplicaConfig(
                count=replicas,
                sync=sync,
                sync_window_s=window,
                peer_view=peer_view,
                cold_window_picks=cold_window_picks,
            ),
        ),
        clock=clock,
        rng=random.Random(0),
    )
    for i in range(4):
        core.add_worker(f"w{i}", block_size=B)
    return core, clock


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_sync_an_own_pick_counts_replicas_times_only_for_the_window(backend):
    core, clock = synced_core(backend, window=0.005)
    # a warm pick (its prefix predicted on the worker): R = 4 times while the others' picks
    # of the same moment cannot have arrived yet
    first = core.route(RouteRequest("cold", prompt(320)))
    view = core.worker_view(first.worker_id)
    cold_counted = view.inflight_prefill_tokens
    assert cold_counted == round(320 * COLD)  # a cold pick: replica_cold_picks times
    clock.t = 0.001
    warm = core.route(RouteRequest("warm", prompt(400)))
    assert warm.worker_id == first.worker_id and warm.matched_tokens == 320
    assert view.inflight_prefill_tokens == cold_counted + 4 * 80
    # explain() sees what route() would: nothing settles before the window ends
    clock.t = 0.0049
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.inflight_prefill_tokens == cold_counted + 4 * 80
    # past the first pick's window it counts once; the second still R times
    clock.t = 0.0051
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.inflight_prefill_tokens == 320 + 4 * 80
    clock.t = 0.0061
    away = frozenset({first.worker_id})
    core.route(RouteRequest("other", prompt(16, start=20_000), exclude=away))
    assert view.inflight_prefill_tokens == 320 + 80
    # the first token takes off exactly what is still counted: nothing goes negative
    core.on_first_token("cold")
    core.on_first_token("warm")
    assert view.inflight_prefill_tokens == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_its_window_a_warm_own_pick_stands_for_the_replicas_as_running_and_recent_work(backend):
    """With sync, until its window ends an own pick that found its prefix on the worker
    counts R times as running requests and as recent work too, then once; a cold pick
    counts once there (only its queued prefill is counted more); a finish inside the window
    takes off all it counted, and the window's end nothing more."""
    core, clock = synced_core(backend, window=0.005)
    first = core.route(RouteRequest("cold", prompt(320)))
    view = core.worker_view(first.worker_id)
    assert (view.num_active, view.num_running) == (1, 1)
    assert view.recent_prefill == pytest.approx(320)  # the scale is 1 at t = 0
    clock.t = 0.001
    warm = core.route(RouteRequest("warm", prompt(400)))
    assert warm.worker_id == first.worker_id and warm.matched_tokens == 320
    assert view.num_running == 1 + 4
    scale = core._flights.recent_scale(0.001)
    assert view.recent_prefill == pytest.approx(320 + 4 * 80 * scale)
    # past the warm pick's window it counts once
    clock.t = 0.0061
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.num_running == 2
    assert view.recent_prefill == pytest.approx(320 + 80 * scale)
    # a request that ends inside its window takes off all it counted as running
    clock.t = 0.01
    again = core.route(RouteRequest("again", prompt(480)))
    assert again.worker_id == first.worker_id and again.matched_tokens >= 320
    assert view.num_running == 2 + 4
    core.on_finished("again")
    assert view.num_running == 2
    clock.t = 0.02
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.num_running == 2  # the window's end took nothing more
    core.on_finished("cold")
    core.on_finished("warm")
    assert all(core.worker_view(f"w{i}").num_active == 0 for i in range(4))
    assert view.recent_prefill > 0  # what was routed stays recent work; no extra is left


def _cold_router(backend: str):
    """A synced four-router core with the peer view (5 ms window, replica_cold_window_picks
    3) and a way to route a prompt nothing holds at a given time: it returns all the
    fleet's queued prefill after."""
    core, clock = synced_core(backend, window=0.005, peer_view=True, cold_window_picks=3)
    names = iter(range(1, 1_000))

    def cold(at: float) -> int:
        clock.t = at
        d = core.route(RouteRequest(f"r{at}", prompt(320, start=next(names) * 10_000)))
        assert d.matched_tokens == 0
        return sum(core.worker_view(f"w{i}").inflight_prefill_tokens for i in range(4))

    return cold


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_the_peer_view_a_cold_pick_is_capped_once_a_window_held_the_window_picks(backend):
    """With sync and the peer view a cold pick counts R times until the router has found
    replica_cold_window_picks own picks inside their window at once; from then on (for one
    to two REPLICA_WINDOW_PICKS_PERIOD_S) min(R, the cap) times."""
    from router.core.core_types import REPLICA_WINDOW_PICKS_PERIOD_S as PERIOD

    cold = _cold_router(backend)
    capped = round(COLD * 320)
    assert cold(0.000) == 4 * 320  # none in the window: R times
    assert cold(0.001) == 2 * 4 * 320  # one
    assert cold(0.002) == 3 * 4 * 320  # two: still under 3
    assert cold(0.003) == 3 * 4 * 320 + capped  # three: the cap
    # the first three picks' windows have ended (they count once), one is left in its
    # window: the cap still holds -- this router's windows have held three
    assert cold(0.0071) == 3 * 320 + 2 * capped
    # a period later it is still remembered (the period before)
    assert cold(PERIOD + 0.5) == 5 * 320 + capped
    # two periods on, with no window holding three since: R times again
    assert cold(2 * PERIOD + 1.0) == 6 * 320 + 4 * 320
    # after a silence of two periods nothing is remembered
    cold = _cold_router(backend)
    for k in range(4):
        cold(0.001 * k)
    assert cold(2 * PERIOD + 0.1) == 4 * 320 + 4 * 320


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("peer_view", "cold_window_picks", "sync"),
    [(False, 3, True), (True, 0, True), (True, 3, False)],
)
def test_the_cold_cap_always_holds_without_the_peer_view_or_sync_or_with_0(
    backend, peer_view, cold_window_picks, sync
):
    core, _ = synced_core(
        backend, window=0.005, peer_view=peer_view, cold_window_picks=cold_window_picks, sync=sync
    )
    assert RouterConfig().replica.peer_view and RouterConfig().replica.cold_window_picks == 3
    d = core.route(RouteRequest("x", prompt(320)))
    assert core.worker_view(d.worker_id).inflight_prefill_tokens == round(COLD * 320)


def test_the_cold_window_picks_are_checked():
    with pytest.raises(ValueError, match="replica_cold_window_picks must be >= 0, got -1"):
        RouterConfig(replica=ReplicaConfig(cold_window_picks=-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pick_that_ended_or_started_in_its_window_is_not_settled_twice(backend):
    core, clock = synced_core(backend, window=0.002)
    a = core.route(RouteRequest("a", prompt(320)))
    b = core.route(RouteRequest("b", prompt(320, start=5_000), exclude=frozenset({a.worker_id})))
    core.on_first_token("a")  # all it counted leaves with its first token
    core.on_finished("b")
    # a retry reuses the id in the window: the new placement is settled, not the old one
    c = core.route(RouteRequest("a", prompt(320, start=9_000)))
    clock.t = 0.0021  # a's first placement and b are due but gone; c too
    core.route(RouteRequest("d", prompt(16, start=30_000), exclude=frozenset({c.worker_id})))
    assert core.worker_view(b.worker_id).inflight_prefill_tokens == (
        0 if b.worker_id != c.worker_id else 320
    )
    assert core.worker_view(c.worker_id).inflight_prefill_tokens == 320
    core.on_finished("a")
    core.on_finished("d")
    assert all(core.worker_view(f"w{i}").inflight_prefill_tokens == 0 for i in range(4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("window", "sync", "replicas"), [(float("inf"), True, 4), (0.0, False, 4), (0.0, True, 1)]
)
def test_the_window_changes_nothing_without_sync_one_router_or_inf(backend, window, sync, replicas):
    core, clock = synced_core(backend, window=window, replicas=replicas, sync=sync)
    d = core.route(RouteRequest("x", prompt(320)))
    counted = core.worker_view(d.worker_id).inflight_prefill_tokens
    assert counted == round(320 * min(replicas, COLD))
    clock.t = 10.0
    core.route(RouteRequest("y", prompt(16, start=7_000), exclude=frozenset({d.worker_id})))
    assert core.worker_view(d.worker_id).inflight_prefill_tokens == counted


def test_the_window_is_checked():
    with pytest.raises(ValueError, match="replica_sync_window_s must be >= 0 or None, got -1"):
        RouterConfig(replica=ReplicaConfig(sync_window_s=-1.0))
    with pytest.raises(ValueError, match="replica_sync_window_s must be >= 0 or None, got nan"):
        RouterConfig(replica=ReplicaConfig(sync_window_s=float("nan")))


def test_an_auto_window_follows_the_measured_delivery_time():
    from router.core.core_types import INITIAL_REPLICA_SYNC_WINDOW_S, REPLICA_SYNC_WINDOW_DECAY

    core, clock = synced_core("numba", window=None)
    assert core.replica_sync_window_s == INITIAL_REPLICA_SYNC_WINDOW_S
    fresh, _ = synced_core("numba", window=None)
    fresh.observe_replica_sync_delay(0.001)  # the first measurement replaces the guess
    assert fresh.replica_sync_window_s == 0.001
    core.observe_replica_sync_delay(0.02)  # a slower sync: up at once
    assert core.replica_sync_window_s == 0.02
    core.observe_replica_sync_delay(0.0)  # a faster one: down by a share of the difference
    assert core.replica_sync_window_s == pytest.approx(0.02 * (1 - REPLICA_SYNC_WINDOW_DECAY))
    for bad in (-1.0, float("nan"), float("inf")):
        core.observe_replica_sync_delay(bad)
    assert core.replica_sync_window_s == pytest.approx(0.02 * (1 - REPLICA_SYNC_WINDOW_DECAY))
    # the window a pick gets is the one in force when it is placed
    d = core.route(RouteRequest("x", prompt(320)))
    view = core.worker_view(d.worker_id)
    clock.t = 0.018
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.inflight_prefill_tokens == round(COLD * 320)  # a cold pick, inside its window
    clock.t = 0.02
    core.explain(RouteRequest("probe", prompt(16, start=10_000)))
    assert view.inflight_prefill_tokens == 320
    # a fixed window, one router, or no sync: measurements change nothing
    for kw in ({"window": 0.001}, {"window": None, "replicas": 1}, {"window": None, "sync": False}):
        other, _ = synced_core("numba", **kw)
        before = other.replica_sync_window_s
        other.observe_replica_sync_delay(0.5)
        assert other.replica_sync_window_s == before
