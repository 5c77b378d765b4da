"""RouterCore.route scores candidates with CacheAware.select_set (the WorkerTable the views
write through to); at every route of random histories -- workers joining, leaving and
coming back in freed slots, health changes, load reports, excluded workers, finished
requests, time passing, recent_prefill set from outside -- its pick, cost and random draws
must be those of CacheAware.select over the views (the reference)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core import B, Clock, stored

from kvroute_proto.events import EventBatch, LoadReport
from router.core.core_types import PolicyConfig
from router.core.policy import CandidateSet, Policy
from router.core.router_core import (
    CostWeights,
    NoWorkerAvailable,
    RouterConfig,
    RouterCore,
    RouteRequest,
)


class Checked:
    """Wraps the core's policy: each select_set is compared with select on a copied rng."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.checked = 0

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def select_set(self, query, candidates: CandidateSet, matched, rng):
        ref_rng = random.Random()
        ref_rng.setstate(rng.getstate())
        expect = self.policy.select(query, list(candidates.views), matched, ref_rng)
        got = self.policy.select_set(query, candidates, matched, rng)
        assert got == expect
        assert rng.getstate() == ref_rng.getstate()
        self.checked += 1
        return got


OPS = "route route route exclude first finish load store time add remove health recent"
ops = st.sampled_from(OPS.split())  # routes three times as often as the rest


@given(
    data=st.data(),
    n=st.integers(1, 6),
    weights=st.sampled_from([CostWeights(), CostWeights(1.0, 0.25, 16.0, 0.0)]),
    backlog=st.sampled_from([0.0, 300.0, 50_000.0]),
)
@settings(max_examples=60, deadline=None)
def test_route_picks_what_select_over_the_views_picks(data, n, weights, backlog) -> None:
    clock = Clock()
    config = RouterConfig(
        recent_window_s=5.0, policy_config=PolicyConfig(weights=weights, backlog_tokens=backlog)
    )
    core = RouterCore(config, clock=clock, rng=random.Random(data.draw(st.integers(0, 99))))
    checked = Checked(core._policy)
    core._policy = checked  # type: ignore[assignment]
    seqs: dict[str, int] = {}
    next_id = 0

    def add() -> None:
        nonlocal next_id
        wid = f"w{next_id}"
        next_id += 1
        core.add_worker(wid, block_size=B)
        seqs[wid] = 0

    for _ in range(n):
        add()
    prefixes = [np.arange(k * 1000, k * 1000 + 4 * B, dtype=np.uint32) for k in range(3)]
    inflight: list[str] = []
    routed = 0
    for step in range(data.draw(st.integers(1, 40))):
        op = data.draw(ops)
        workers = core.workers()
        wid = data.draw(st.sampled_from(workers)) if workers else None
        if op in ("route", "exclude"):
            prefix = prefixes[data.draw(st.integers(0, 2))]
            tail = np.full(data.draw(st.integers(0, 3 * B)), step, dtype=np.uint32)
            exclude = frozenset({wid}) if op == "exclude" and wid else frozenset()
            req = RouteRequest(f"r{step}", np.concatenate([prefix, tail]), exclude=exclude)
            try:
                core.route(req)
                inflight.append(req.request_id)
                routed += 1
            except NoWorkerAvailable:
                pass
        elif op == "first" and inflight:
            core.on_first_token(data.draw(st.sampled_from(inflight)))
        elif op == "finish" and inflight:
            rid = inflight.pop(data.draw(st.integers(0, len(inflight) - 1)))
            core.on_finished(rid, data.draw(st.integers(0, 500)))
        elif op in ("load", "store") and wid:
            seqs[wid] += 1
            events = (stored(prefixes[data.draw(st.integers(0, 2))]),) if op == "store" else ()
            load = None
            if op == "load":
                load = LoadReport(
                    num_running=data.draw(st.integers(0, 4)),
                    num_waiting=data.draw(st.integers(0, 4)),
                    num_queued_prefill_tokens=data.draw(st.integers(0, 2000)),
                )
            core.on_stream_message(wid, EventBatch(wid, 1, seqs[wid], B, events, load))
        elif op == "time":
            clock.now += data.draw(st.sampled_from([0.001, 1.0, 30.0, 2000.0]))
        elif op == "add":
            add()
        elif op == "remove" and wid:
            core.remove_worker(wid)
        elif op == "health" and wid:
            core.set_health(wid, data.draw(st.booleans()))
        elif op == "recent" and wid:
            core.worker_view(wid).recent_prefill = data.draw(st.sampled_from([0.0, 1e6]))
    assert checked.checked == routed  # every route went through select_set
