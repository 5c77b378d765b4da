"""RouterCore with the numba index (router.core.index_nb) decides as with the dict index (the
reference): two cores, one per backend, run the same generated histories in lockstep --
routes with and without exclusions, stored and removed blocks, snapshots, first tokens,
finishes, time passing past the predictions' TTL, workers leaving and coming back -- and
every decision, explanation, may_match_past answer and index count must be equal."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core import B, Clock, stored

from kvroute_proto.events import DEFAULT_PARTITION, BlockRemoved, EventBatch, Snapshot
from router.cli import router as cli
from router.core.index import PrefixIndex
from router.core.index_api import IndexConfig
from router.core.index_factory import make_index
from router.core.index_nb import NumbaPrefixIndex
from router.core.router_core import NoWorkerAvailable, RouterConfig, RouterCore, RouteRequest

OPS = "route route route exclude first finish store store remove snapshot time add drop probe"


@given(
    data=st.data(),
    n=st.integers(1, 5),
    policy=st.sampled_from(["cache_aware", "cache_aware", "approx_tree", "prefix_hash"]),
    cap=st.sampled_from([40, 4_000_000]),
)
@settings(max_examples=60, deadline=None)
def test_numba_index_core_decides_as_the_dict_one(data, n, policy, cap) -> None:
    clock = Clock()
    seed = data.draw(st.integers(0, 99))
    cores = []
    for backend in ("dict", "numba"):
        config = RouterConfig(
            policy=policy, predicted_ttl_s=2.0, index=IndexConfig(backend=backend, max_blocks=cap)
        )
        cores.append(RouterCore(config, clock=clock, rng=random.Random(seed)))
    ref, nb = cores
    assert isinstance(ref.index, PrefixIndex) and isinstance(nb.index, NumbaPrefixIndex)
    seqs: dict[str, int] = {}
    next_id = 0

    def add() -> None:
        nonlocal next_id
        wid = f"w{next_id}"
        next_id += 1
        for core in cores:
            core.add_worker(wid, block_size=B)
        seqs[wid] = 0

    def send(wid: str, kind: type[EventBatch] | type[Snapshot], event) -> None:
        seqs[wid] += 1
        for core in cores:
            core.on_stream_message(wid, kind(wid, 1, seqs[wid], B, (event,)))

    for _ in range(n):
        add()
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1000, 8 * B, dtype=np.uint32) for _ in range(3)]
    inflight: list[str] = []
    for step in range(data.draw(st.integers(1, 50))):
        op = data.draw(st.sampled_from(OPS.split()))
        workers = ref.workers()
        wid = data.draw(st.sampled_from(workers)) if workers else None
        prefix = prefixes[data.draw(st.integers(0, 2))]
        cut = data.draw(st.integers(1, 8)) * B
        if op in ("route", "exclude"):
            tail = np.full(data.draw(st.integers(0, 3 * B)), step, dtype=np.uint32)
            exclude = frozenset({wid}) if op == "exclude" and wid else frozenset()
            req = RouteRequest(f"r{step}", np.concatenate([prefix[:cut], tail]), exclude=exclude)
            assert nb.explain(req) == ref.explain(req)
            try:
                expect = ref.route(req)
            except NoWorkerAvailable:
                expect = None
            try:
                got = nb.route(req)
            except NoWorkerAvailable:
                got = None
            assert got == expect
            if expect is not None:
                inflight.append(req.request_id)
        elif op == "first" and inflight:
            rid = data.draw(st.sampled_from(inflight))
            for core in cores:
                core.on_first_token(rid)
        elif op == "finish" and inflight:
            rid = inflight.pop(data.draw(st.integers(0, len(inflight) - 1)))
            for core in cores:
                core.on_finished(rid, 10)
        elif op == "store" and wid:
            ev = stored(prefix[:cut])
            send(wid, EventBatch, ev)
        elif op == "remove" and wid:
            gone = BlockRemoved(stored(prefix[:cut]).block_hashes[data.draw(st.integers(0, 7)) :])
            send(wid, EventBatch, gone)
        elif op == "snapshot" and wid:
            ev = stored(prefix[:cut])
            send(wid, Snapshot, ev)
        elif op == "time":
            clock.now += data.draw(st.sampled_from([0.5, 3.0]))
        elif op == "add":
            add()
        elif op == "drop" and wid:
            for core in cores:
                core.remove_worker(wid)
        elif op == "probe":
            toks = prefix[:cut]
            assert nb.may_match_past(toks, DEFAULT_PARTITION) == ref.may_match_past(
                toks, DEFAULT_PARTITION
            )
        a, b = ref.index, nb.index
        assert (a.size(), a.num_entries, a.num_predicted) == (
            b.size(),
            b.num_entries,
            b.num_predicted,
        )
        assert a.num_evicted == b.num_evicted and dict(a.errors) == dict(b.errors)
        nb.index.check_invariants()
    # the stats agree but for the index's memory estimate (each backend's own)
    assert replace(ref.stats(), index_bytes=0) == replace(nb.stats(), index_bytes=0)


def test_index_backend_from_the_command_line_and_config() -> None:
    """kvroute router --index-backend picks the core's index; bad names are refused."""
    for name, kind in (("dict", PrefixIndex), ("numba", NumbaPrefixIndex)):
        args = cli.build_parser().parse_args(["--worker", "127.0.0.1:1", "--index-backend", name])
        config = cli.config_from_args(args).core
        assert config.index.backend == name
        core = RouterCore(config, clock=Clock(), rng=random.Random(0))
        assert isinstance(core.index, kind)
        assert isinstance(make_index(IndexConfig(backend=name)), kind)
    with pytest.raises(ValueError, match="backend"):
        IndexConfig(backend="tree")
