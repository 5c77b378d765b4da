"""The numba index applies a plain batch straight from its scanned wire bytes
(codec.decode_stream_lazy -> codec.WireBatch -> NumbaPrefixIndex.apply_wire), without
event objects, and RouterCore must end up exactly where the object path leaves it: three
cores run the same generated wire bytes in lockstep -- the numba index fed lazily decoded
batches (the service's path), the numba index fed decoded events, and the dict index
(the reference) fed protobuf's decode -- through stored chains with known, unknown and
zero parents, removals of unknown blocks, clears, non-default partitions, load reports,
duplicates, gaps, new epochs, snapshots, the size cap and malformed bytes; every
answer, error, index entry, count and route decision must be equal."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core import B, Clock, stored

from kvroute_proto import codec
from kvroute_proto.errors import ContractError
from kvroute_proto.events import (
    DEFAULT_PARTITION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    LoadReport,
    Partition,
    Snapshot,
)
from router.core.core_types import IndexConfig
from router.core.index import PrefixIndex
from router.core.index_nb import NumbaPrefixIndex
from router.core.router_core import NoWorkerAvailable, RouterConfig, RouterCore, RouteRequest

_RNG = np.random.default_rng(7)
PREFIXES = [_RNG.integers(0, 1000, 6 * B, dtype=np.uint32) for _ in range(2)]
CHAINS = [stored(p) for p in PREFIXES]  # real hashes: routes match them
HASHES = sorted(
    {h for c in CHAINS for h in c.block_hashes} | {0, 1, 2, 3, 2**64 - 1, *range(40, 52)}
)


def _decoders() -> tuple:
    assert codec.enable_compiled_decode()
    return (codec.decode_stream_lazy, codec.decode_stream_message, codec.decode_with_protobuf)


@st.composite
def events(draw: st.DrawFn) -> KvEvent:
    kind = draw(
        st.sampled_from(["stored", "stored", "stored", "real", "removed", "removed", "cleared"])
    )
    if kind == "cleared":
        return AllCleared()
    if kind == "real":  # a true chain: verify_hashes accepts it, routes match it
        chain = CHAINS[draw(st.integers(0, 1))]
        cut = draw(st.integers(1, len(chain.block_hashes)))
        n = len(chain.block_hashes)
        start = draw(st.integers(0, cut - 1))
        parent = chain.block_hashes[start - 1] if start else None
        return BlockStored(
            chain.block_hashes[start:cut],
            parent,
            chain.token_ids[start * B : cut * B] if n else (),
            DEFAULT_PARTITION,
        )
    hashes = tuple(draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=5)))
    if kind == "removed":
        return BlockRemoved(hashes)
    parent = draw(st.sampled_from([None, None, 0, 1, 7, *HASHES[:4]]))
    partition = draw(
        st.sampled_from(
            [DEFAULT_PARTITION, DEFAULT_PARTITION, Partition("s", ""), Partition("", "x")]
        )
    )
    short = draw(st.sampled_from([0] * 9 + [1]))  # one id short: a contract error
    return BlockStored(hashes, parent, tuple(range(len(hashes) * B - short)), partition)


def _wire(batch: EventBatch | Snapshot, damage: str) -> bytes:
    data = codec.encode_stream_message(batch)
    if damage == "truncate":
        return data[:-1]
    if damage == "trailing":  # an unknown field after the batch: protobuf takes it
        return data + b"\x98\x06\x01"
    return data


def _state(core: RouterCore, workers: list[str]) -> tuple:
    index = core.index
    slots = {w: core.worker_view(w).slot for w in workers if w in core.workers()}
    return (
        {w: index.snapshot(s) for w, s in slots.items()},
        {w: index.num_worker_blocks(s) for w, s in slots.items()},
        index.size(),
        index.num_entries,
        index.num_evicted,
        dict(index.errors),
        {w: core.stream_position(w) for w in slots},
    )


@given(
    data=st.data(),
    cap=st.sampled_from([6, 4_000_000]),
    verify=st.sampled_from([False, False, True]),
)
@settings(max_examples=80, deadline=None)
def test_wire_batches_apply_as_decoded_events(data, cap, verify) -> None:
    lazy, eager, reference = _decoders()
    clock = Clock()
    cores = []
    for backend in ("numba", "numba", "dict"):
        config = RouterConfig(
            index=IndexConfig(backend=backend, max_blocks=cap, verify_hashes=verify)
        )
        cores.append(RouterCore(config, clock=clock, rng=random.Random(3)))
    assert isinstance(cores[0].index, NumbaPrefixIndex)
    assert isinstance(cores[2].index, PrefixIndex)
    decoders = (lazy, eager, reference)
    workers = ["w0", "w1", "w2"]
    for core in cores:
        for w in workers:
            core.add_worker(w, block_size=B)
    seqs = dict.fromkeys(workers, 0)
    epochs = dict.fromkeys(workers, 1)
    for step in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["batch", "batch", "batch", "batch", "snapshot", "route"]))
        wid = data.draw(st.sampled_from(workers))
        if op == "route":
            prefix = PREFIXES[data.draw(st.integers(0, 1))]
            req = RouteRequest(f"r{step}", prefix[: data.draw(st.integers(1, 6)) * B])
            got = []
            for core in cores:
                try:
                    got.append(core.route(req))
                except NoWorkerAvailable:
                    got.append(None)
            assert got[0] == got[1] == got[2]
            continue
        move = data.draw(st.sampled_from(["next", "next", "next", "next", "dup", "gap", "epoch"]))
        if move == "epoch":
            epochs[wid] += 1
            seqs[wid] = 0
        seq = {"next": seqs[wid] + 1, "dup": max(seqs[wid], 1), "gap": seqs[wid] + 2}.get(move, 1)
        seqs[wid] = max(seqs[wid], seq)
        msg: EventBatch | Snapshot
        if op == "snapshot":
            blocks = [
                e for e in data.draw(st.lists(events(), max_size=2)) if type(e) is BlockStored
            ]
            msg = Snapshot(wid, epochs[wid], seq, B, tuple(blocks))
        else:
            evs = tuple(data.draw(st.lists(events(), min_size=0, max_size=4)))
            load = data.draw(st.sampled_from([None, LoadReport(1, 2, 30, 400, 5, 600)]))
            msg = EventBatch(wid, epochs[wid], seq, B, evs, load)
        damage = data.draw(st.sampled_from(["", "", "", "", "", "", "truncate", "trailing"]))
        wire = _wire(msg, damage)
        answers = []
        for core, decode in zip(cores, decoders, strict=True):
            try:
                decoded = decode(wire)
            except ContractError as exc:
                answers.append(("error", str(exc)))
                continue
            if core is cores[0] and type(decoded) is codec.WireBatch:
                assert decoded == eager(wire)  # its events, built, are the decoded ones
            answers.append(core.on_stream_message(wid, decoded))
        assert answers[0] == answers[1] == answers[2]
        states = [_state(core, workers) for core in cores]
        assert states[0] == states[1] == states[2]
        for core in cores[:2]:
            core.index.check_invariants()
    stats = [replace(core.stats(), index_bytes=0) for core in cores]
    assert stats[0] == stats[1] == stats[2]


def test_plain_batches_decode_lazily_and_others_do_not() -> None:
    """What decode_stream_lazy leaves in the scan's layout (and apply_wire then applies):
    batches whose stored events have the default partition and the right token count."""
    lazy, eager, _ = _decoders()
    plain = EventBatch(
        "w",
        1,
        1,
        B,
        (BlockStored((5, 6), 4, tuple(range(2 * B))), BlockRemoved((9,)), AllCleared()),
    )
    wire = codec.encode_stream_message(plain)
    decoded = lazy(wire)
    assert type(decoded) is codec.WireBatch and decoded == plain == eager(wire)
    assert decoded.events == plain.events
    salted = replace(plain, events=(BlockStored((5,), None, tuple(range(B)), Partition("s", "")),))
    assert type(lazy(codec.encode_stream_message(salted))) is EventBatch
    snap = Snapshot("w", 1, 1, B, ())
    assert lazy(codec.encode_stream_message(snap)) == snap
    short = BlockStored((5,), None, tuple(range(B - 1)))
    with pytest.raises(ContractError, match="token_ids"):
        lazy(codec.encode_stream_message(replace(plain, events=(short,))))


def test_apply_wire_refuses_to_skip_hash_verification() -> None:
    from router.core.index_api import IndexConfig

    index = NumbaPrefixIndex(IndexConfig(verify_hashes=True))
    batch = EventBatch("w", 1, 1, B, (BlockStored((5,), None, tuple(range(B))),))
    decoded = codec.decode_stream_lazy(codec.encode_stream_message(batch))
    assert isinstance(decoded, codec.WireBatch)
    with pytest.raises(ValueError, match="verify"):
        index.apply_wire(0, decoded.layout)
