"""The translator on frames vLLM and SGLang made: after every batch, the blocks we
announced are the blocks the producer's cache held (in our hashes)."""

from __future__ import annotations

import random

import pytest

from kvroute_proto.events import AllCleared, BlockStored, Partition
from kvroute_proto.hashing import block_hash_list
from tests.worker.bridge.recorded import (
    Announced,
    B,
    batches,
    expected_sglang,
    expected_vllm,
    load,
)
from worker.bridge.engine_wire import EngineBatch, EngineBlockStored
from worker.bridge.translate import EventTranslator, ReplayFrom, TranslatorConfig

VLLM = ["0.34.0", "0.32.0", "0.23.0"]  # tagged maps (0.34, 0.32); positional arrays (0.23)
SGLANG = ["0.5.23", "0.5.18"]  # tagged maps; positional arrays, the salt in a metadata map


def make() -> tuple[EventTranslator, Announced]:
    return EventTranslator(TranslatorConfig("w0", block_size=B), random.Random(0)), Announced()


def run_live(name: str, expected) -> tuple[EventTranslator, Announced]:
    doc = load(name)
    tr, seen = make()
    for i, batch in enumerate(batches(doc)):
        assert tr.feed(batch) is None
        seen.apply(tr.take_batches())
        assert seen.blocks == set(tr.held_blocks()) == expected(doc, i), f"after batch {i}"
    return tr, seen


@pytest.mark.parametrize("version", VLLM)
def test_vllm_16_token_blocks(version: str) -> None:
    tr, seen = run_live(f"vllm-{version}_b16", expected_vllm)
    st = tr.stats()
    assert st.num_engine_duplicate_stores == 2  # the shared prefix, stored by b and c
    assert st.num_batches_applied == 7 and st.num_restarts == st.num_gaps == 0
    assert st.num_removed_unknown == 0
    assert seen.epoch == tr.epoch and seen.seq == 7  # one batch of ours per engine batch


@pytest.mark.parametrize("version", VLLM)
def test_vllm_duplicate_store_survives_one_removal(version: str) -> None:
    """Batch 3 evicts b's copy of the shared prefix; c's copy stays held, and batch 4 stores
    a block on top of it."""
    doc = load(f"vllm-{version}_b16")
    live = batches(doc)
    tr, seen = make()
    for b in live[:4]:
        tr.feed(b)
    seen.apply(tr.take_batches())
    shared = block_hash_list(doc["requests"]["b"]["token_ids"][:32], B, Partition().seed)
    assert set(shared) <= seen.blocks
    tr.feed(live[4])
    out = tr.take_batches()
    stored = [e for e in out[0].events if isinstance(e, BlockStored)]
    assert stored[0].parent_hash == shared[-1]


@pytest.mark.parametrize("version", VLLM)
def test_vllm_salt_is_our_partition(version: str) -> None:
    doc = load(f"vllm-{version}_b16")
    tr, _ = make()
    for b in batches(doc)[:3]:
        tr.feed(b)
    out = tr.take_batches()
    salted = out[2].events[0]
    assert isinstance(salted, BlockStored)
    assert salted.partition == Partition(cache_salt="tenant-a")
    toks = doc["requests"]["s"]["token_ids"][:32]
    assert list(salted.block_hashes) == block_hash_list(toks, B, Partition("tenant-a").seed)


@pytest.mark.parametrize("version", VLLM)
def test_vllm_32_token_blocks_are_two_of_ours(version: str) -> None:
    tr, seen = run_live(f"vllm-{version}_b32", expected_vllm)
    first = tr.stats()
    assert first.dropped_block_size == 0 and first.num_blocks == len(seen.blocks)


@pytest.mark.parametrize("version", ["0.34.0", "0.32.0"])
def test_vllm_what_we_cannot_name_is_dropped_and_counted(version: str) -> None:
    tr, _ = run_live(f"vllm-{version}_drops", expected_vllm)
    st = tr.stats()
    assert (st.dropped_lora, st.dropped_multimodal, st.dropped_medium) == (2, 2, 2)
    assert st.num_removed_unknown == 4  # the LoRA and embedding blocks' evictions


def test_vllm_023_drops() -> None:
    tr, _ = run_live("vllm-0.23.0_drops", expected_vllm)
    st = tr.stats()
    assert (st.dropped_lora, st.dropped_multimodal) == (2, 2)


@pytest.mark.parametrize("version", VLLM)
def test_vllm_restart_starts_a_new_epoch(version: str) -> None:
    doc = load(f"vllm-{version}_restart")
    live = batches(doc)
    assert [b.seq for b in live] == [0, 1, 0]
    tr, seen = make()
    tr.feed(live[0])
    tr.feed(live[1])
    seen.apply(tr.take_batches())
    old_epoch = tr.epoch
    assert tr.feed(live[2]) is None
    out = tr.take_batches()
    assert tr.epoch != old_epoch and tr.stats().num_restarts == 1
    assert out[0].epoch == tr.epoch and out[0].seq == 1 and out[0].events == (AllCleared(),)
    seen.apply(out)
    assert seen.blocks == set(tr.held_blocks()) == expected_vllm(doc, 2)


@pytest.mark.parametrize("version", VLLM)
def test_vllm_gap_is_replayed_from_the_engines_buffer(version: str) -> None:
    """Live batches 2 and 3 are lost; the engine's replay answer (recorded: seq 2..6) fills
    the gap; live 5, 6 held meanwhile are applied after it, once."""
    doc = load(f"vllm-{version}_b16")
    live, replay = batches(doc), batches(doc, "replay")
    assert [b.seq for b in replay] == [2, 3, 4, 5, 6]
    tr, seen = make()
    tr.feed(live[0])
    tr.feed(live[1])
    assert tr.feed(live[4]) == ReplayFrom(2)
    assert tr.feed(live[5]) is None  # asked once per gap
    seen.apply(tr.take_batches())
    assert seen.seq == 2  # 4 and 5 are held, not applied
    for b in replay:
        tr.feed_replay(b)
    tr.end_replay()
    tr.feed(live[6])  # live copy of a batch the replay brought: a duplicate
    seen.apply(tr.take_batches())
    assert seen.blocks == set(tr.held_blocks()) == expected_vllm(doc, 6)
    st = tr.stats()
    assert st.num_gaps == 1 and st.num_batches_lost == 0 and st.num_batches_duplicate == 3
    assert seen.epoch == tr.epoch  # nothing was lost: the same epoch throughout


def test_replay_that_starts_too_late_loses_and_starts_over() -> None:
    """The engine's buffer no longer holds seq 2: a new epoch, AllCleared, and only what
    comes after is announced."""
    doc = load("vllm-0.32.0_b16")
    live, replay = batches(doc), batches(doc, "replay")
    tr, seen = make()
    tr.feed(live[0])
    tr.feed(live[1])
    assert tr.feed(live[4]) == ReplayFrom(2)
    epoch = tr.epoch
    for b in replay[1:]:  # 3, 4, 5, 6: 2 is gone
        tr.feed_replay(b)
    tr.end_replay()
    out = tr.take_batches()
    seen.apply(out)
    assert tr.epoch != epoch and tr.stats().num_batches_lost == 1
    assert any(b.events[0] == AllCleared() for b in out if b.epoch == tr.epoch)
    assert seen.blocks == set(tr.held_blocks()) <= expected_vllm(doc, 6)


def test_replay_that_never_comes() -> None:
    doc = load("vllm-0.32.0_b16")
    live = batches(doc)
    tr, seen = make()
    tr.feed(live[0])
    assert tr.feed(live[3]) == ReplayFrom(1)
    tr.end_replay()  # the shell gave up: 1 and 2 are lost, 3 applies in a new epoch
    seen.apply(tr.take_batches())
    assert tr.stats().num_batches_lost == 2 and seen.seq == 2


def test_a_late_first_batch_asks_for_the_engines_start() -> None:
    live = batches(load("vllm-0.32.0_b16"))
    tr, _ = make()
    assert tr.feed(live[2]) == ReplayFrom(0)


def test_held_batches_overflow() -> None:
    live = batches(load("vllm-0.32.0_b16"))
    tr = EventTranslator(TranslatorConfig("w0", max_held_batches=2), random.Random(1))
    tr.feed(live[0])
    assert tr.feed(live[2]) == ReplayFrom(1)
    tr.feed(live[3])
    tr.feed(live[4])  # a third held batch: give up on 1
    assert tr.stats().num_batches_lost == 1 and tr.stats().num_held_batches == 0


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_one_token_pages(version: str) -> None:
    tr, seen = run_live(f"sglang-{version}_page1", expected_sglang)
    assert tr.stats().num_blocks == len(seen.blocks)
    assert tr.stats().dropped_unknown_parent == 0


@pytest.mark.parametrize("version", SGLANG)
def test_sglang_salt_and_gap(version: str) -> None:
    doc = load(f"sglang-{version}_page1")
    live, replay = batches(doc), batches(doc, "replay")
    tr, seen = make()
    for b in live[:3]:
        tr.feed(b)
    out = tr.take_batches()
    salted = [e for e in out[-1].events if isinstance(e, BlockStored)]
    assert salted and all(e.partition == Partition(cache_salt="tenant-a") for e in salted)
    assert tr.feed(live[5]) == ReplayFrom(3)
    for b in replay:
        tr.feed_replay(b)
    tr.end_replay()
    seen.apply(out + tr.take_batches())
    assert seen.blocks == set(tr.held_blocks()) == expected_sglang(doc, 5)


def test_snapshot_rebuilds_the_same_set() -> None:
    tr, seen = run_live("vllm-0.32.0_b32", expected_vllm)
    snap = tr.snapshot()
    assert snap.epoch == tr.epoch and snap.seq == seen.seq
    assert {h for b in snap.blocks for h in b.block_hashes} == seen.blocks
    Announced._check_chain(snap.blocks[0])


def test_block_sizes_that_do_not_fit_are_dropped() -> None:
    tr, _ = make()
    ev = EngineBlockStored((1, 2), None, tuple(range(48)), 24)
    tr.feed(EngineBatch(0, 0.0, (ev,)))
    assert tr.stats().dropped_block_size == 2 and not tr.take_batches()


def test_a_replay_that_makes_progress_is_asked_again() -> None:
    """The answer brought seq 1 but not 2 (lost after the replay was asked for): ask for 2."""
    live = batches(load("vllm-0.32.0_b16"))
    tr, _ = make()
    tr.feed(live[0])
    assert tr.feed(live[3]) == ReplayFrom(1)
    tr.feed_replay(live[1])
    assert tr.end_replay() == ReplayFrom(2)
    tr.feed_replay(live[2])  # 3 drains behind it
    assert tr.end_replay() is None
    st = tr.stats()
    assert (st.num_gaps, st.num_batches_lost, st.num_batches_applied) == (2, 0, 4)


@pytest.mark.parametrize("version", ["0.34.0", "0.32.0"])
def test_vllm_bytes_hashes(version: str) -> None:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte engine hashes, the same blocks of ours."""
    doc = load(f"vllm-{version}_b16-bytes")
    first = batches(doc)[0].events[0]
    assert isinstance(first, EngineBlockStored)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in first.block_hashes)
    tr, _ = run_live(f"vllm-{version}_b16-bytes", expected_vllm)
    assert tr.stats().num_engine_duplicate_stores == 2


def test_a_load_report_takes_the_next_seq_of_the_current_epoch():
    import random as _random

    from kvroute_proto.events import LoadReport
    from worker.bridge.translate import EventTranslator, TranslatorConfig

    t = EventTranslator(TranslatorConfig("w", 16), _random.Random(0))
    t.publish_load(LoadReport(num_running=2))
    t.publish_load(LoadReport(num_waiting=1))
    first, second = t.take_batches()
    assert (first.seq, second.seq) == (1, 2) and first.epoch == second.epoch == t.epoch
    assert first.events == () and first.load == LoadReport(num_running=2)
    assert t.snapshot().seq == 2  # a subscriber's snapshot follows them
