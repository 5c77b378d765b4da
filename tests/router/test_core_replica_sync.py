"""RouterCore's side of replica sync: its own picks go to a listener, the other replicas'
picks are counted (once) with their predicted prefixes, and forgotten when the peer goes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.core import RouterConfig, RouterCore, RouteRequest
from router.core_types import ReplicaEvent, ReplicaFinished, ReplicaFirstToken, ReplicaRouted

B = 16
BACKENDS = ("numba", "dict")


def make_core(backend: str, replicas: int = 1, seed: int = 0) -> RouterCore:
    core = RouterCore(
        RouterConfig(block_size=B, replicas=replicas, index_backend=backend),
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
