"""What both index implementations share (router.core.index_api): the interface's capability
attributes, apply_wire's plain path (the dict index's) against the compiled one and against
the decoded events, and the dict index's depth rule (router.core.index._depths)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute_proto import wire_nb
from kvroute_proto.codec import encode_stream_message
from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, EventBatch, KvEvent
from router.core.index import PrefixIndex, _depths
from router.core.index_api import INDEX_BACKENDS, IndexConfig, PrefixIndexAPI
from router.core.index_factory import make_index

B = 2


@pytest.mark.parametrize("backend", INDEX_BACKENDS)
def test_capabilities_are_plain_attributes(backend: str) -> None:
    index: PrefixIndexAPI = make_index(IndexConfig(backend=backend))
    compiled = backend == "numba"
    assert index.takes_arrays is compiled and index.prefers_wire is compiled


def _batch(rng: random.Random, chains: list[list[int]]) -> tuple[KvEvent, ...]:
    events: list[KvEvent] = []
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if op < 0.55 or not chains:
            head = rng.choice(chains) if chains and rng.random() < 0.5 else []
            tail = [rng.choice([0, rng.getrandbits(64)]) for _ in range(rng.randint(1, 5))]
            chains.append(head + tail)
            parent = head[-1] if head else rng.choice([None, 7])
            events.append(BlockStored(tuple(tail), parent, (1,) * (B * len(tail))))
        elif op < 0.9:
            chain = rng.choice(chains)
            events.append(BlockRemoved((*chain[rng.randrange(len(chain)) :], 12345)))
        else:
            events.append(AllCleared())
    return tuple(events)


def test_apply_wire_plain_and_compiled_agree_with_the_events() -> None:
    """Scanned batches applied by the dict index's apply_wire (the plain path of
    index_api.AppliesEvents), by the numba index's kernel, and as decoded events one by
    one: the same entries, errors and evictions."""
    rng = random.Random(4)
    config = IndexConfig(max_blocks=40, predict_stride=2)
    wire_dict, events_dict = PrefixIndex(config), PrefixIndex(config)
    wire_nb_index = make_index(IndexConfig(max_blocks=40, predict_stride=2, backend="numba"))
    chains: list[list[int]] = []
    for seq in range(200):
        slot = rng.choice([0, 1, 70])
        events = _batch(rng, chains)
        layout = wire_nb.scan_batch(encode_stream_message(EventBatch("w", 1, seq + 1, B, events)))
        assert layout is not None
        wire_dict.apply_wire(slot, layout)
        wire_nb_index.apply_wire(slot, layout)
        for event in events:
            events_dict.apply(slot, event)
        for index in (wire_dict, wire_nb_index):
            assert index.size() == events_dict.size()
            assert dict(index.errors) == dict(events_dict.errors)
            assert index.num_evicted == events_dict.num_evicted
            for w in (0, 1, 70):
                assert index.snapshot(w) == events_dict.snapshot(w)
    wire_dict.check_invariants()
    wire_nb_index.check_invariants()


def test_apply_wire_refuses_to_skip_hash_verification() -> None:
    index = PrefixIndex(IndexConfig(verify_hashes=True))
    layout = wire_nb.scan_batch(
        encode_stream_message(EventBatch("w", 1, 1, B, (BlockStored((1,), None, (1, 2)),)))
    )
    with pytest.raises(ValueError, match="verify"):
        index.apply_wire(0, layout)


@given(st.lists(st.integers(0, 2**70), min_size=1, max_size=30))
def test_depths_is_the_leading_run_per_slot(masks: list[int]) -> None:
    """router.core.index._depths (find_matches' depths) against its definition: a slot's depth is
    how many leading bitsets contain it; the running AND stops where it reaches 0."""
    masks = [m or 1 for m in masks]  # the walk's bitsets are nonzero
    run, depths = _depths(masks)
    expect = {}
    for slot in range(71):
        n = 0
        while n < len(masks) and masks[n] >> slot & 1:
            n += 1
        if n:
            expect[slot] = n
    assert depths == expect
    acc, want = -1, []
    for m in masks:
        acc &= m
        if not acc:
            break
        want.append(acc)
    assert run == want
