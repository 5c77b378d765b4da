"""The cost's affinity term (router.core.policy): router replicas that cannot see each other's
picks get the same order of preference for a new prefix, whatever their slots and candidate
order; the config that turns it on (ReplicaConfig.policy_affinity_tokens) and its checks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto.events import DEFAULT_PARTITION, BlockStored, Snapshot
from kvroute_proto.hashing import block_hash_list
from router.core.affinity_nb import RANKED_MAX
from router.core.core_types import DEFAULT_REPLICA_AFFINITY_TOKENS, ReplicaConfig
from router.core.cost import affinity_terms
from router.core.policy import (
    CandidateSet,
    PolicyConfig,
    RouteQuery,
    WorkerTable,
    WorkerView,
    worker_id_hash,
)
from router.core.registry import make_policy
from router.core.router_core import RouterConfig, RouterCore, RouteRequest

B = 16


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (arithmetic mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def affinity_terms_reference(
    block_hashes: Sequence[int] | np.ndarray, depths: np.ndarray, ids: np.ndarray, tokens: float
) -> np.ndarray | None:
    """router.core.policy.affinity_terms in numpy: the definition its compiled kernel
    (router.core.affinity_nb) is checked against.

    A candidate matching less than the deepest (every one, when none matches) is ranked,
    among the candidates of its depth, by a hash of the first block it lacks and its id,
    highest first, and pays ``tokens * rank / (m - 1)`` (m: the group's size)."""
    n = len(block_hashes)
    if n == 0 or len(depths) < 2:
        return None
    deepest = min(int(depths.max()), n)  # past the request's blocks: it holds them all
    at = np.flatnonzero(depths < deepest) if deepest else np.arange(len(depths))
    if len(at) < 2:
        return None
    d = depths[at]
    keys = np.asarray(block_hashes, dtype=np.uint64)[d]
    score = _mix64(keys ^ ids[at])
    order = np.lexsort((~score, d))  # by depth, then highest score first
    d = d[order]
    starts = np.flatnonzero(np.concatenate(([True], d[1:] != d[:-1])))
    sizes = np.diff(np.append(starts, len(d)))
    group = np.repeat(np.arange(len(starts)), sizes)
    rank = np.arange(len(d)) - starts[group]
    extra = np.zeros(len(depths))
    extra[at[order]] = tokens * rank / np.maximum(sizes - 1, 1)[group]
    big = sizes[group] > RANKED_MAX  # no ranks there: the score's place in [0, 2**64)
    if big.any():
        place = (~score[order][big] >> np.uint64(11)).astype(np.float64)
        extra[at[order][big]] = tokens * place / float(2**53)
    return extra


def _ids(names: list[str]) -> np.ndarray:
    return np.array([worker_id_hash(n) for n in names], dtype=np.uint64)


def test_worker_id_hash_is_the_same_in_every_process() -> None:
    """Not Python's salted hash: another process, with another hash seed, computes the same
    value (replicas are separate processes); distinct ids get distinct values."""
    code = "from router.core.policy import worker_id_hash; print(worker_id_hash('worker-0'))"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        assert int(out.stdout) == worker_id_hash("worker-0")
    assert len({worker_id_hash(f"worker-{i}") for i in range(1000)}) == 1000


def test_cold_candidates_are_ranked_evenly_and_the_deepest_pay_nothing() -> None:
    names = [f"w{i}" for i in range(5)]
    hashes = [11, 12, 13, 14]
    cold = affinity_terms(hashes, np.zeros(5, dtype=np.intp), _ids(names), 1000.0)
    assert cold is not None
    assert sorted(cold.tolist()) == [0.0, 250.0, 500.0, 750.0, 1000.0]
    # two hold 3 blocks: they pay nothing; the other three, ranked by block 0 (the first
    # they lack), pay 0, 500 and 1000
    depths = np.array([3, 0, 3, 0, 0], dtype=np.intp)
    warm = affinity_terms(hashes, depths, _ids(names), 1000.0)
    assert warm is not None
    assert warm[0] == warm[2] == 0.0
    assert sorted(warm[[1, 3, 4]].tolist()) == [0.0, 500.0, 1000.0]
    # two depths below the deepest: each group ranked apart, by the block it lacks
    depths = np.array([4, 1, 1, 0, 0], dtype=np.intp)
    groups = affinity_terms(hashes, depths, _ids(names), 1000.0)
    assert groups is not None
    assert sorted(groups[[1, 2]].tolist()) == sorted(groups[[3, 4]].tolist()) == [0.0, 1000.0]
    # nothing to rank: one candidate below the deepest, one candidate, no blocks
    assert affinity_terms(hashes, np.array([2, 2, 0]), _ids(names[:3]), 1000.0) is None
    assert affinity_terms(hashes, np.zeros(1, dtype=np.intp), _ids(names[:1]), 1.0) is None
    assert affinity_terms([], np.zeros(5, dtype=np.intp), _ids(names), 1.0) is None


def test_the_order_depends_on_the_prefix_not_on_slots_or_candidate_order() -> None:
    """Each worker's term is a function of (first block it lacks, its id): permuting the
    candidates permutes the terms; different prefixes put different workers first."""
    names = [f"worker-{i}" for i in range(8)]
    rng = random.Random(5)
    firsts = set()
    for _ in range(200):
        hashes = [rng.getrandbits(64) for _ in range(6)]
        depths = np.array([rng.choice([0, 0, 2]) for _ in names], dtype=np.intp)
        terms = affinity_terms(hashes, depths, _ids(names), 700.0)
        perm = rng.sample(range(8), 8)
        permuted = affinity_terms(hashes, depths[perm], _ids([names[i] for i in perm]), 700.0)
        if terms is None:
            assert permuted is None
            continue
        assert permuted is not None
        assert permuted.tolist() == terms[perm].tolist()
        cold = [i for i in range(8) if depths[i] == 0]
        firsts.add(min(cold, key=lambda i: terms[i]))
    assert len(firsts) == 8  # every worker comes first for some prefix


def _fleet(order: list[int], slots: list[int]) -> tuple[list[WorkerView], WorkerTable]:
    table = WorkerTable(capacity=4)
    views = []
    for name, slot in zip(order, slots, strict=True):
        v = WorkerView(f"worker-{name}", slot)
        table.attach(v)
        views.append(v)
    return views, table


@pytest.mark.parametrize("vectorised", [True, False])
def test_replicas_with_other_slots_pick_the_same_worker_for_a_new_prefix(vectorised) -> None:
    """Two replicas that registered the same idle workers in other orders (other slots,
    other candidate order) send a cold request to the same worker; with the term off, a
    tie among idle workers is broken by each replica's own random draw."""
    policy = make_policy("cache_aware", PolicyConfig(affinity_tokens=1000.0))
    agreed = 0
    for seed in range(60):
        rng = random.Random(seed)
        hashes = [rng.getrandbits(64) for _ in range(8)]
        query = RouteQuery("r", 8 * B, B, hashes)
        picks = []
        for order, slots in (
            ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),
            ([5, 3, 1, 0, 4, 2], [7, 2, 9, 0, 4, 1]),
        ):
            views, table = _fleet(order, slots)
            if vectorised:
                i, _ = policy.select_set(
                    query, CandidateSet.of(views, table), {}, random.Random(seed + 1)
                )
            else:
                i, _ = policy.select(query, views, {}, random.Random(seed + 2))
            picks.append(views[i].worker_id)
        agreed += picks[0] == picks[1]
    assert agreed == 60


def test_load_still_decides_past_the_term() -> None:
    """The term is at most affinity_tokens: a first-ranked worker with more queued work than
    that (in cost) loses to an idle one."""
    policy = make_policy("cache_aware", PolicyConfig(affinity_tokens=1000.0))
    hashes = [3, 4, 5]
    views, table = _fleet([0, 1], [0, 1])
    terms = affinity_terms(hashes, np.zeros(2, dtype=np.intp), table.ids[:2], 1000.0)
    assert terms is not None
    first = int(terms.argmin())
    query = RouteQuery("r", 3 * B, B, hashes)
    i, cost = policy.select_set(query, CandidateSet.of(views, table), {}, random.Random(0))
    assert i == first and cost == 3 * B
    views[first].inflight_prefill_tokens = 4 * 1000 + 8  # 0.25 a token: 1,002 > 1,000
    views[first].refresh()
    i, cost = policy.select_set(query, CandidateSet.of(views, table), {}, random.Random(0))
    assert i == 1 - first and cost == 3 * B + 1000.0


def test_affinity_is_on_for_replicas_without_sync_only() -> None:
    assert ReplicaConfig().policy_affinity_tokens == 0.0
    assert ReplicaConfig(affinity_tokens=500.0).policy_affinity_tokens == 0.0  # one router
    assert ReplicaConfig(count=2).policy_affinity_tokens == DEFAULT_REPLICA_AFFINITY_TOKENS
    assert ReplicaConfig(count=4, sync=True).policy_affinity_tokens == 0.0
    assert ReplicaConfig(count=4, affinity_tokens=250.0).policy_affinity_tokens == 250.0
    assert ReplicaConfig(count=4, sync=True, affinity_tokens=9.0).policy_affinity_tokens == 9.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="replica_affinity_tokens must be finite and >= 0"):
            RouterConfig(replica=ReplicaConfig(affinity_tokens=bad))
        with pytest.raises(ValueError, match="affinity_tokens must be finite and >= 0"):
            PolicyConfig(affinity_tokens=bad)


def test_two_router_cores_start_a_new_prefix_on_the_same_worker() -> None:
    """RouterCore replicas (R = 2, no sync) that registered the fleet in other orders send
    the first request of a new prefix to the same worker; then each routes the rest of it
    by its own view, as before."""
    clock = [0.0]
    cores = []
    for k, order in enumerate(([0, 1, 2, 3], [3, 1, 0, 2])):
        core = RouterCore(
            RouterConfig(block_size=B, replica=ReplicaConfig(count=2)),
            clock=lambda: clock[0],
            rng=random.Random(100 + k),
        )
        for w in order:
            core.add_worker(f"worker-{w}", address=f"sim://{w}", block_size=B)
        cores.append(core)
    for n in range(30):
        tokens = [n * 1000 + t for t in range(6 * B)]
        a = cores[0].route(RouteRequest(f"a{n}", tokens))
        b = cores[1].route(RouteRequest(f"b{n}", tokens))
        assert a.worker_id == b.worker_id, n
        for core, rid in ((cores[0], f"a{n}"), (cores[1], f"b{n}")):
            core.on_finished(rid, 0)


def test_a_stored_prefix_is_not_ranked_away() -> None:
    """A worker holding the request's prefix pays no term: the term only orders the
    workers that lack it, so the holder the order ranks last still gets the request."""
    core = RouterCore(
        RouterConfig(block_size=B, replica=ReplicaConfig(count=4)),
        clock=lambda: 0.0,
        rng=random.Random(0),
    )
    for w in range(4):
        core.add_worker(f"worker-{w}", address=f"sim://{w}", block_size=B)
    tokens = np.arange(1, 8 * B + 1, dtype=np.uint32)
    cold = core.explain(RouteRequest("x", tokens))
    costs = {s.worker_id: s.cost for s in cold.workers}
    assert sorted(c - min(costs.values()) for c in costs.values()) == pytest.approx(
        [0, 1000 / 3, 2000 / 3, 1000]
    )
    last = max(costs, key=lambda w: costs[w])
    assert cold.chosen_worker_id == min(costs, key=lambda w: costs[w])
    hashes = block_hash_list(tokens, B, DEFAULT_PARTITION.seed)
    stored = BlockStored(tuple(hashes), None, tuple(int(t) for t in tokens), DEFAULT_PARTITION)
    assert core.on_stream_message(last, Snapshot(last, 1, 1, B, (stored,))) == []
    assert core.route(RouteRequest("y", tokens)).worker_id == last


@given(
    hashes=st.lists(st.integers(0, 2**64 - 1), max_size=12),
    depths=st.lists(st.sampled_from([0, 0, 1, 2, 5, 12, 14]), min_size=1, max_size=24)
    | st.lists(st.sampled_from([0, 0, 0, 3, 12]), min_size=60, max_size=150),
    names=st.integers(0, 2**32),
    tokens=st.sampled_from([1000.0, 1.0, 333.3, 0.0]),
)
@settings(max_examples=500, deadline=None)
def test_the_compiled_kernel_is_the_numpy_definition(hashes, depths, names, tokens) -> None:
    """affinity_terms (router.core.affinity_nb's kernel) against affinity_terms_reference (numpy)
    on generated requests and fleets: the same terms, bit for bit (None: all 0)."""
    ids = _ids([f"w{names}-{i}" for i in range(len(depths))])
    d = np.array(depths, dtype=np.intp)
    got = affinity_terms(hashes, d, ids, tokens)
    want = affinity_terms_reference(hashes, d, ids, tokens)
    zeros = [0.0] * len(depths)
    assert (zeros if got is None else got.tolist()) == (zeros if want is None else want.tolist())


def test_a_large_group_is_spread_by_the_hash_without_ranks() -> None:
    """Past 64 candidates of one depth the term is the hash's place in [0, 2**64) times
    affinity_tokens: all different, within [0, 1,000), spread over the range, and still the
    same on every replica (a function of block and id alone)."""
    names = [f"worker-{i}" for i in range(1024)]
    terms = affinity_terms([7, 8, 9], np.zeros(1024, dtype=np.intp), _ids(names), 1000.0)
    assert terms is not None
    assert len(set(terms.tolist())) == 1024 and terms.min() >= 0 and terms.max() < 1000
    assert 450 < terms.mean() < 550 and terms.min() < 5 and terms.max() > 995
    again = affinity_terms([7, 8, 9], np.zeros(3, dtype=np.intp), _ids(names[:3]), 1000.0)
    assert again is not None and again.tolist() != terms[:3].tolist()  # 3: ranked instead
    perm = list(range(1023, -1, -1))
    flipped = affinity_terms(
        [7], np.zeros(1024, dtype=np.intp), _ids([names[i] for i in perm]), 1000.0
    )
    first = affinity_terms([7], np.zeros(1024, dtype=np.intp), _ids(names), 1000.0)
    assert flipped is not None and first is not None
    assert flipped.tolist() == first[perm].tolist()
