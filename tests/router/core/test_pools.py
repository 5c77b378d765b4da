"""The pool map (router.core.pools): one RouterCore per served model, workers by the model
they announce, requests by the model they name (decision 0036)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvroute_proto.events import DEFAULT_PARTITION, BlockStored, Snapshot
from kvroute_proto.hashing import block_hash_list
from router.core.core_types import ReplicaFinished, ReplicaFirstToken, ReplicaRouted
from router.core.errors import BlockSizeMismatchError, DuplicateWorkerError, UnknownWorkerError
from router.core.pools import PoolsConfig, RouterPools, UnknownModelError, UnservedModelError
from router.core.router_core import RouterConfig, RouterCore, RouteRequest

B = 16


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def pools(*names: str, open: bool = False) -> RouterPools:
    clock = Clock()
    seeds = random.Random(0)
    return RouterPools(
        PoolsConfig(names, open=open),
        lambda: RouterCore(RouterConfig(), clock=clock, rng=random.Random(seeds.getrandbits(64))),
    )


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def give(p: RouterPools, worker_id: str, toks: np.ndarray, block_size: int = B) -> None:
    """Sync ``worker_id`` from a snapshot holding ``toks``' full blocks."""
    n = len(toks) // block_size * block_size
    hashes = block_hash_list(toks[:n], block_size, DEFAULT_PARTITION.seed)
    block = BlockStored(tuple(hashes), None, tuple(int(t) for t in toks[:n]), DEFAULT_PARTITION)
    assert p.on_stream_message(worker_id, Snapshot(worker_id, 1, 1, block_size, (block,))) == []


def route(core: RouterCore, rid: str, toks: np.ndarray) -> str:
    return core.route(RouteRequest(rid, toks, DEFAULT_PARTITION)).worker_id


def test_each_model_routes_by_its_own_index() -> None:
    p = pools("a", "b")
    for w, model in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")):
        assert p.add_worker(w, f"{w}:1", B, model=model) == model
    prompt = tokens(64)
    give(p, "a1", prompt)  # the same tokens cached in both pools, on different workers
    give(p, "b0", prompt)
    name_a, core_a = p.resolve("a")
    name_b, core_b = p.resolve("b")
    assert (name_a, name_b) == ("a", "b")
    assert core_a is not core_b
    assert core_a.workers() == ["a0", "a1"] and core_b.workers() == ["b0", "b1"]
    assert route(core_a, "r1", prompt) == "a1"
    assert route(core_b, "r2", prompt) == "b0"
    explained = core_a.explain(RouteRequest("x", prompt, DEFAULT_PARTITION))
    assert explained.chosen_worker_id == "a1"
    assert {s.worker_id for s in explained.workers} == {"a0", "a1"}
    assert p.worker_blocks("b0") and not p.worker_blocks("a0")
    assert set(p.stats()) == {"a", "b"}
    assert [s.worker_id for s in p.worker_stats()] == ["a0", "a1", "b0", "b1"]


def test_unknown_and_missing_models_name_the_served_ones() -> None:
    p = pools("a", "b")
    with pytest.raises(UnknownModelError, match=r"'c' does not exist: this server serves 'a', 'b'"):
        p.resolve("c")
    with pytest.raises(UnknownModelError, match="model is required: this server serves 'a', 'b'"):
        p.resolve(None)
    single = pools("m")
    assert single.resolve(None)[0] == "m" and single.resolve("")[0] == "m"
    with pytest.raises(UnknownModelError, match=r"this server serves 'm'$"):
        single.resolve("other")


def test_a_fixed_router_refuses_workers_of_other_models() -> None:
    p = pools("a", "b")
    with pytest.raises(UnservedModelError, match="'c', which this router does not serve"):
        p.add_worker("c0", "c:1", B, model="c")
    assert not p.has_worker("c0") and p.workers() == []
    assert p.add_worker("n0", "n:1", B, model="") == "a"  # a worker naming none: the default
    assert p.served_models() == ["a", "b"]  # configured: listed with or without workers


def test_a_single_model_router_takes_every_worker_whatever_it_announces() -> None:
    p = pools("served")
    assert p.add_worker("w0", "w:1", B, model="what-the-worker-calls-it") == "served"
    assert p.add_worker("w1", "w:2", B, model="served") == "served"
    assert list(p.pools) == ["served"] and p.core.workers() == ["w0", "w1"]
    assert p.served_models() == ["served"]


def test_an_open_router_forms_pools_from_announced_names() -> None:
    p = pools("kvroute-tiny", open=True)
    assert p.served_models() == ["kvroute-tiny"]  # no worker yet: its own name, as before
    assert p.resolve(None)[0] == "kvroute-tiny"
    p.add_worker("x0", "x:1", B, model="x")
    p.add_worker("y0", "y:1", 32, model="y")  # each pool has its own block size
    assert p.served_models() == ["x", "y"]
    assert p.pool_of("y0").block_size == 32 and p.pool_of("x0").block_size == B
    with pytest.raises(BlockSizeMismatchError):
        p.add_worker("x1", "x:2", 32, model="x")
    assert not p.has_worker("x1")
    with pytest.raises(UnknownModelError, match="model is required"):
        p.resolve(None)
    p.remove_worker("y0")
    assert p.served_models() == ["x"]  # a pool without workers is no longer listed
    assert p.resolve("y")[0] == "y"  # but still routes (503: no worker), not 404
    p.add_worker("t0", "t:1", B, model="kvroute-tiny")
    assert p.served_models() == ["kvroute-tiny", "x"]


def test_worker_calls_go_to_the_workers_pool() -> None:
    p = pools("a", "b")
    p.add_worker("a0", "a:1", B, model="a")
    p.add_worker("b0", "b:1", B, model="b")
    with pytest.raises(DuplicateWorkerError):
        p.add_worker("a0", "a:2", B, model="b")  # worker ids are one namespace
    p.set_health("b0", False)
    assert not p.worker_view("b0").healthy and p.worker_view("a0").healthy
    p.set_max_running("a0", 7)
    assert p.worker_view("a0").max_running == 7
    assert p.expected_subscription("b0") == (0, 0)
    assert p.model_of("b0") == "b"
    p.remove_worker("a0")
    assert not p.has_worker("a0") and p.resolve("a")[1].workers() == []
    with pytest.raises(UnknownWorkerError):
        p.set_health("a0", True)


def test_replica_picks_carry_their_pool_and_land_in_it() -> None:
    here, there = pools("a", "b"), pools("a", "b")
    for p in (here, there):
        p.add_worker("a0", "a:1", B, model="a")
        p.add_worker("b0", "b:1", B, model="b")
    sent: list[object] = []
    here.set_replica_listener(sent.append)
    route(here.resolve("b")[1], "r1", tokens(64))
    (picked,) = sent
    assert isinstance(picked, ReplicaRouted) and picked.model == "b"
    assert there.apply_replica("peer", picked)
    assert there.num_replica_inflight == 1
    assert there.pools["b"].num_replica_inflight == 1
    assert there.apply_replica("peer", ReplicaFirstToken("r1"))
    assert there.apply_replica("peer", ReplicaFinished("r1", 3))
    assert there.num_replica_inflight == 0
    # a pick in a pool this router does not hold changes nothing
    assert not there.apply_replica("peer", ReplicaRouted("r2", "c0", 10, 0, model="c"))
    assert there.drop_replica("peer") == 0


def test_configuration_is_checked() -> None:
    with pytest.raises(ValueError, match="must differ"):
        PoolsConfig(("a", "a"))
    with pytest.raises(ValueError, match="non-empty"):
        PoolsConfig(())
