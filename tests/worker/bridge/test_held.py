"""HeldBlocks' partition table (decision 0041): ids that no held block names any more are
dropped when the table fills, so a salt per user does not grow it for ever, and the blocks
still held keep their partitions."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvroute_proto.events import TOKEN_DTYPE, Partition
from kvroute_proto.hashing import block_hashes
from tests.worker.bridge.test_translate_stateful import TranslatorMachine
from worker.bridge import held
from worker.bridge.held import OURS_INDEX, OURS_PARTITION, HeldBlocks


def store_one(blocks: HeldBlocks, engine_hash: int, salt: str) -> int:
    """One new 16-token chain under ``salt``; its block of ours."""
    partition = Partition(cache_salt=salt)
    tokens = np.arange(engine_hash, engine_hash + 16, dtype=TOKEN_DTYPE)
    (ours,) = block_hashes(tokens, 16, partition.seed).tolist()
    new, duplicates = blocks.store(
        (engine_hash,), 16, 0, [ours], None, partition, tokens.tobytes(), 0
    )
    assert new == [0] and duplicates == 0
    return ours


def test_partitions_no_block_names_are_dropped_and_held_ones_keep_theirs(monkeypatch) -> None:
    monkeypatch.setattr(held, "MIN_PARTITIONS_COMPACTED", 8)
    blocks = HeldBlocks(16)
    kept = {store_one(blocks, 10_000, "kept-a"): "kept-a"}
    kept[store_one(blocks, 20_000, "kept-b")] = "kept-b"
    for i in range(200):  # a salt per user, each block evicted soon after
        store_one(blocks, 100 * i + 30_000, f"user-{i}")
        gone, unknown = blocks.remove((100 * i + 30_000,))
        assert len(gone) == 1 and unknown == 0
    assert len(blocks.partitions) <= 2 * 8 + 2
    for ours, salt in kept.items():
        assert blocks.partitions[blocks.our_block(ours)[OURS_PARTITION]] == Partition(
            cache_salt=salt
        )
    for engine_hash in blocks.chains:
        chain = blocks.chain(engine_hash)
        assert chain is not None and blocks.partitions[chain[0]].cache_salt.startswith("kept-")


def test_a_full_table_of_partitions_in_use_doubles(monkeypatch) -> None:
    monkeypatch.setattr(held, "MIN_PARTITIONS_COMPACTED", 4)
    blocks = HeldBlocks(16)
    salts = {store_one(blocks, 1_000 * (i + 1), f"s{i}"): f"s{i}" for i in range(12)}
    assert len(blocks.partitions) == 12  # every one still names a held block
    for ours, salt in salts.items():
        assert blocks.partitions[blocks.our_block(ours)[OURS_PARTITION]] == Partition(
            cache_salt=salt
        )


def test_run_ids_go_round_past_those_still_held(monkeypatch) -> None:
    """Codes stay below 2**63 however many runs were stored: ids start again at 1 and skip
    the runs still held."""
    monkeypatch.setattr(held, "MAX_RUN_ID", 4)
    blocks = HeldBlocks(16)
    kept = store_one(blocks, 10_000, "")  # run 1, held throughout
    for i in range(10):
        store_one(blocks, 20_000 + 100 * i, "")
        gone, _ = blocks.remove((20_000 + 100 * i,))
        assert len(gone) == 1
    assert sorted(blocks.runs) == [1] and blocks.our_block(kept)[OURS_INDEX] == 0
    assert blocks.chain(10_000) is not None
    assert blocks.remove((10_000,)) == ([kept], 0) and not blocks.runs


def test_the_translator_machine_with_every_removal_taken_as_an_array(monkeypatch) -> None:
    """The state machine of test_translate_stateful, with removals of any length taken
    the way long ones are (its evictions are short): the same announced blocks."""
    monkeypatch.setattr(held, "MIN_REMOVED_AS_ARRAY", 1)
    run_state_machine_as_test(
        TranslatorMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None),
    )


def test_removing_only_blocks_not_held_as_an_array() -> None:
    blocks = HeldBlocks(16)
    store_one(blocks, 1_000, "")
    assert blocks.remove(tuple(range(5_000, 5_000 + held.MIN_REMOVED_AS_ARRAY))) == (
        [],
        held.MIN_REMOVED_AS_ARRAY,
    )
    assert len(blocks.chains) == len(blocks.ours) == len(blocks.runs) == 1
